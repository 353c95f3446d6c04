"""Meta evaluation metrics against plain numpy / scikit-learn references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import log_loss, ndcg_score, roc_auc_score

from recaccel.config import MetaConfig
from recaccel.meta import MetaLearner
from recaccel.meta.evaluation import TaskMetrics, evaluate_meta
from recaccel.meta.ranking import ndcg_per_task
from tests.helpers.meta_batches import make_dlrm, make_task_batch


def _explicit_ndcg(scores, rel, k, gain):
    """nDCG@k of one list, written out."""
    g = (lambda r: 2.0**r - 1.0) if gain == "exponential" else (lambda r: r)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    dcg = sum(g(rel[i]) / math.log2(n + 2) for n, i in enumerate(order[:k]))
    ideal = sorted(rel, reverse=True)
    idcg = sum(g(r) / math.log2(n + 2) for n, r in enumerate(ideal[:k]))
    return dcg / idcg if idcg > 0 else math.nan


def _random_tasks(seed, t=7, q=6, ratings=True):
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=(t, q))  # continuous: no ties
    labels = (
        rng.integers(1, 6, size=(t, q)).astype(float)
        if ratings
        else rng.integers(0, 2, size=(t, q)).astype(float)
    )
    mask = (rng.random((t, q)) > 0.3).astype(float)
    mask[0] = 0.0  # a task without query rows
    mask[1, :] = 0.0
    mask[1, 0] = 1.0  # a task with one row
    return scores, labels, mask


@pytest.mark.parametrize("gain", ["exponential", "linear"])
@pytest.mark.parametrize("k", [1, 3, 10])
@pytest.mark.parametrize("ratings", [True, False])
def test_ndcg_matches_explicit_formula(gain, k, ratings):
    scores, labels, mask = _random_tasks(k, ratings=ratings)
    got = ndcg_per_task(torch.tensor(scores), torch.tensor(labels), torch.tensor(mask), k, gain).numpy()
    for t in range(scores.shape[0]):
        real = mask[t] > 0
        want = (
            _explicit_ndcg(list(scores[t][real]), list(labels[t][real]), k, gain) if real.any() else math.nan
        )
        if math.isnan(want):
            assert math.isnan(got[t])
        else:
            assert got[t] == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("k", [1, 3])
def test_linear_ndcg_matches_sklearn(k):
    scores, labels, mask = _random_tasks(3)
    got = ndcg_per_task(torch.tensor(scores), torch.tensor(labels), torch.tensor(mask), k, "linear").numpy()
    for t in range(scores.shape[0]):
        real = mask[t] > 0
        if real.sum() >= 2:
            assert got[t] == pytest.approx(ndcg_score([labels[t][real]], [scores[t][real]], k=k), rel=1e-12)


def test_rating_metrics_match_numpy():
    scores, labels, mask = _random_tasks(5)
    m = TaskMetrics("mse", ks=(1, 3))
    m.update(torch.tensor(scores[:4]), torch.tensor(labels[:4]), torch.tensor(mask[:4]))
    m.update(torch.tensor(scores[4:]), torch.tensor(labels[4:]), torch.tensor(mask[4:]))
    out = m.compute()
    real = mask > 0
    err = scores[real] - labels[real]
    assert out["mae"] == pytest.approx(np.abs(err).mean(), rel=1e-12)
    assert out["rmse"] == pytest.approx(np.sqrt((err**2).mean()), rel=1e-12)
    assert out["query_rows"] == real.sum() and out["tasks"] == real.any(1).sum()
    for k in (1, 3):
        per = [
            _explicit_ndcg(list(scores[t][real[t]]), list(labels[t][real[t]]), k, "exponential")
            for t in range(7)
            if real[t].any()
        ]
        assert out[f"ndcg@{k}"] == pytest.approx(np.nanmean(per), rel=1e-12)


def test_click_metrics_match_sklearn():
    scores, labels, mask = _random_tasks(6, t=9, q=8, ratings=False)
    labels[2][mask[2] > 0] = 1.0  # a one-class task: left out of the grouped AUC
    m = TaskMetrics("bce")
    m.update(torch.tensor(scores), torch.tensor(labels), torch.tensor(mask))
    out = m.compute()
    real = mask > 0
    assert out["auc"] == pytest.approx(roc_auc_score(labels[real], scores[real]), rel=1e-12)
    probs = 1 / (1 + np.exp(-scores[real]))
    assert out["logloss"] == pytest.approx(log_loss(labels[real], probs), rel=1e-9)
    per_task = [
        roc_auc_score(labels[t][real[t]], scores[t][real[t]])
        for t in range(9)
        if len(set(labels[t][real[t]])) == 2
    ]
    assert out["gauc"] == pytest.approx(np.mean(per_task), rel=1e-12)
    assert out["gauc_tasks"] == len(per_task)


@pytest.mark.parametrize("loss", ["mse", "bce"])
def test_evaluate_meta_scores_adapted_and_unadapted_predictions(loss):
    learner = MetaLearner(make_dlrm(), MetaConfig(inner_steps=1, inner_lr=0.3), loss=loss)
    batches = [make_task_batch(4, 5, 6, loss=loss, seed=s) for s in (1, 2)]
    out = evaluate_meta(learner, batches)
    for suffix, predict in (
        ("", learner.adapt_and_predict),
        ("_no_adapt", learner.predict_without_adaptation),
    ):
        want = TaskMetrics(loss)
        for tb in batches:
            want.update(predict(tb), tb.query.labels.view(4, 6), tb.query_mask)
        for key, value in want.compute().items():
            if key in ("tasks", "query_rows") and suffix:
                continue
            assert out[key + suffix] == pytest.approx(value, rel=1e-12, nan_ok=True), key + suffix
    assert learner.training  # evaluation restores the mode
