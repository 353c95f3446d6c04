"""nDCG and grouped AUC against scikit-learn (an outside reference), ties and bad input included."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from recaccel.config import MetaConfig
from recaccel.errors import RecaccelError
from recaccel.meta import MetaLearner
from recaccel.meta.evaluation import TaskMetrics, evaluate_meta
from recaccel.meta.ranking import auc_per_task, ndcg_per_task
from recaccel.metrics import MetricError, UndefinedMetricWarning
from tests.helpers.meta_batches import make_dlrm, make_task_batch

skm = pytest.importorskip("sklearn.metrics", reason="scikit-learn is the outside reference for nDCG and AUC")


def _tied_tasks(seed, t=9, q=8, ratings=True):
    """Few score levels (many ties), a padded share of rows, a one-row and an empty task."""
    rng = np.random.default_rng(seed)
    scores = rng.integers(0, 3, size=(t, q)).astype(float)
    labels = rng.integers(0, 6, size=(t, q)) if ratings else rng.integers(0, 2, size=(t, q))
    mask = (rng.random((t, q)) > 0.25).astype(float)
    mask[0] = 0.0
    mask[1] = 0.0
    mask[1, 3] = 1.0
    scores[~(mask > 0)] = rng.normal(size=int((mask == 0).sum())) * 100  # padding: anything
    return scores, labels.astype(float), mask


def _ndcg(scores, labels, mask, k, gain):
    return ndcg_per_task(torch.tensor(scores), torch.tensor(labels), torch.tensor(mask), k, gain).numpy()


@pytest.mark.parametrize("gain", ["linear", "exponential"])
@pytest.mark.parametrize("k", [1, 2, 3, 8, 20])
@pytest.mark.parametrize("seed", [0, 1])
def test_ndcg_matches_sklearn_with_ties(gain, k, seed):
    scores, labels, mask = _tied_tasks(seed)
    got = _ndcg(scores, labels, mask, k, gain)
    compared = 0
    for t in range(scores.shape[0]):
        real = mask[t] > 0
        rel = labels[t][real] if gain == "linear" else 2.0 ** labels[t][real] - 1.0
        if not real.any() or rel.max() == 0:  # no nDCG here (sklearn says 0 for IDCG 0)
            assert math.isnan(got[t])
            continue
        if real.sum() == 1:  # sklearn needs two items
            assert got[t] == 1.0
            continue
        want = skm.ndcg_score([rel], [scores[t][real]], k=k)
        assert got[t] == pytest.approx(want, rel=1e-12, abs=1e-15), t
        compared += 1
    assert compared >= 5
    assert math.isnan(got[0])  # no real rows


def test_ndcg_with_ties_does_not_depend_on_row_order():
    scores, labels, mask = _tied_tasks(4)
    perm = np.random.default_rng(5).permutation(scores.shape[1])
    got = _ndcg(scores, labels, mask, 3, "exponential")
    shuffled = _ndcg(scores[:, perm], labels[:, perm], mask[:, perm], 3, "exponential")
    np.testing.assert_allclose(shuffled, got, rtol=1e-12, atol=0)
    # All predictions tied: every order is equally likely, so nDCG is that of the mean gain.
    flat = _ndcg(np.zeros((1, 4)), np.array([[3.0, 0.0, 0.0, 0.0]]), np.ones((1, 4)), 1, "linear")
    assert flat[0] == pytest.approx(0.25, rel=1e-12)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_ndcg_rejects_non_finite_predictions_of_real_rows_only(bad):
    scores, labels, mask = _tied_tasks(2)
    pad = np.argwhere(mask == 0)[0]
    scores[tuple(pad)] = bad  # a padded row may hold anything
    _ndcg(scores, labels, mask, 3, "linear")
    real = np.argwhere(mask > 0)[1]
    scores[tuple(real)] = bad
    with pytest.raises(MetricError, match=r"ndcg: predictions of real rows: 1 of \d+ values are NaN or inf"):
        _ndcg(scores, labels, mask, 3, "linear")


def test_ndcg_of_a_task_with_negative_relevance_is_undefined_like_sklearn():
    scores, labels, mask = _tied_tasks(3)
    expected = _ndcg(scores, labels, mask, 3, "linear")
    t, q = np.argwhere(mask > 0)[0]
    labels[t, q] = -1.0
    got = _ndcg(scores, labels, mask, 3, "linear")
    assert np.isnan(got[t])
    others = np.arange(len(got)) != t
    np.testing.assert_allclose(got[others], expected[others])
    with pytest.raises(ValueError):
        skm.ndcg_score([labels[t][mask[t] > 0]], [scores[t][mask[t] > 0]])
    labels[t, q] = np.nan
    with pytest.raises(MetricError, match=r"ndcg: labels of real rows: 1 of \d+ values are NaN or inf"):
        _ndcg(scores, labels, mask, 3, "linear")


def test_gauc_matches_sklearn_per_task_and_skips_one_class_tasks_silently(recwarn):
    scores, labels, mask = _tied_tasks(6, ratings=False)
    labels[2] = 1.0  # a one-class task
    got = auc_per_task(torch.tensor(scores), torch.tensor(labels), torch.tensor(mask)).numpy()
    for t in range(scores.shape[0]):
        y, s = labels[t][mask[t] > 0], scores[t][mask[t] > 0]
        if len(set(y)) < 2:
            assert math.isnan(got[t])
        else:
            assert got[t] == pytest.approx(skm.roc_auc_score(y, s), abs=1e-12)
    assert math.isnan(got[2])
    assert not [w for w in recwarn if issubclass(w.category, UndefinedMetricWarning)]


def test_gauc_rejects_nan_and_non_binary_labels():
    scores, labels, mask = _tied_tasks(7, ratings=False)
    t, q = np.argwhere(mask > 0)[2]
    bad_labels = labels.copy()
    bad_labels[t, q] = 3.0
    match = rf"gauc: labels of real rows must be 0 or 1: 1 are not \(first at task {t}"
    with pytest.raises(MetricError, match=match):
        auc_per_task(torch.tensor(scores), torch.tensor(bad_labels), torch.tensor(mask))
    scores[t, q] = math.nan
    with pytest.raises(MetricError, match="gauc: predictions of real rows"):
        auc_per_task(torch.tensor(scores), torch.tensor(labels), torch.tensor(mask))


def test_task_metrics_single_class_auc_is_nan_with_a_warning():
    m = TaskMetrics("bce", ks=(1,))
    m.update(torch.rand(3, 4, dtype=torch.float64), torch.ones(3, 4), torch.ones(3, 4))
    with pytest.warns(UndefinedMetricWarning, match="binary_auc: only positives"):
        out = m.compute()
    assert math.isnan(out["auc"]) and math.isnan(out["gauc"]) and out["gauc_tasks"] == 0
    assert out["logloss"] > 0


def test_diverged_meta_model_is_a_one_line_error():
    model = make_dlrm()
    with torch.no_grad():
        model.over_arch.model[-1].bias.fill_(math.nan)
    learner = MetaLearner(model, MetaConfig(inner_steps=1), loss="bce")
    with pytest.raises(RecaccelError) as e:
        evaluate_meta(learner, [make_task_batch(4, 5, 6, loss="bce")])
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("meta evaluation: query predictions after adaptation:") and "diverged" in msg
