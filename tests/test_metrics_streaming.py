"""StreamingBinaryMetrics: bounded memory, and equal to the exact in-memory metrics."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from sklearn.metrics import roc_auc_score

from recaccel.metrics import (
    MetricError,
    StreamingBinaryMetrics,
    binary_auc,
    binary_logloss,
    calibration,
    float32_keys,
    normalized_entropy,
)


def _stream(logits, labels, weights=None, batch=1000, **kwargs) -> dict:
    acc = StreamingBinaryMetrics(**kwargs)
    for start in range(0, logits.numel(), batch):
        part = slice(start, start + batch)
        acc.update(logits[part], labels[part], None if weights is None else weights[part])
    return acc.compute()


def _data(n: int, seed: int, *, ties: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = (torch.rand(n, generator=g) < 0.3).float()
    logits = torch.randn(n, generator=g) + labels  # informative, not separable
    if ties:
        logits = (logits * 4).round() / 4
    return logits.float(), labels


def test_float32_keys_sort_as_the_scores_and_equal_only_for_equal_values():
    s = torch.tensor([-3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, 2.0, float(torch.finfo(torch.float32).max)])
    keys = float32_keys(s)
    assert torch.equal(keys, torch.sort(keys).values)
    assert keys[2] == keys[3] and keys[5] == keys[6]
    assert len(set(keys.tolist())) == 6


@pytest.mark.parametrize("ties", [False, True])
def test_streaming_auc_equals_sklearn_on_fresh_seeded_scores(ties):
    logits, labels = _data(20_000, seed=1 + ties, ties=ties)
    got = _stream(logits, labels, batch=777)
    assert got["auc_exact"] and got["auc_error_bound"] == 0
    assert got["auc"] == pytest.approx(roc_auc_score(labels.numpy(), logits.numpy()), abs=1e-12)


def test_streaming_weighted_metrics_equal_sklearn_and_the_in_memory_metrics():
    logits, labels = _data(10_000, seed=3, ties=True)
    weights = torch.rand(10_000, generator=torch.Generator().manual_seed(4)) * 3
    weights[:50] = 0
    got = _stream(logits, labels, weights, batch=333)
    expected = roc_auc_score(labels.numpy(), logits.numpy(), sample_weight=weights.numpy())
    assert got["auc"] == pytest.approx(expected, abs=1e-12)
    probs = torch.sigmoid(logits.double())
    assert got["logloss"] == pytest.approx(binary_logloss(probs, labels, weights=weights), rel=1e-12)
    assert got["ne"] == pytest.approx(normalized_entropy(probs, labels, weights=weights), rel=1e-12)
    assert got["calibration"] == pytest.approx(calibration(probs, labels, weights=weights), rel=1e-12)


def test_streaming_auc_of_a_million_rows_equals_sklearn_within_a_bounded_table():
    logits, labels = _data(1_000_000, seed=5)
    acc = StreamingBinaryMetrics(max_entries=1 << 21)
    for part in range(0, 1_000_000, 65_536):
        acc.update(logits[part : part + 65_536], labels[part : part + 65_536])
    got = acc.compute()
    assert got["auc_exact"] and got["eval_rows"] == 1_000_000
    assert got["auc"] == pytest.approx(roc_auc_score(labels.numpy(), logits.numpy()), abs=1e-12)


def test_memory_stays_under_the_cap_however_many_rows_and_the_bound_holds():
    cap, batch = 4096, 1000
    acc = StreamingBinaryMetrics(max_entries=cap, bin_bits=12)
    limit = 16 * (1 << 12) + (1 << 12) + 40 + 24 * (2 * cap + batch)  # bins, coarse, sums, table + pending
    logits, labels = _data(200_000, seed=6)
    peak = 0
    for start in range(0, logits.numel(), batch):
        acc.update(logits[start : start + batch], labels[start : start + batch])
        peak = max(peak, acc.memory_bytes())
    assert peak <= limit
    got = acc.compute()
    exact = binary_auc(logits, labels)
    assert not got["auc_exact"] and 0 < got["auc_error_bound"] < 0.01
    assert abs(got["auc"] - exact) <= got["auc_error_bound"]


def test_coarsened_bins_of_one_class_keep_the_auc_exact():
    # Negatives spread over many distinct scores below 0, positives tied above: the
    # coarsened (negative-only) bins cannot change the order of any positive-negative pair.
    g = torch.Generator().manual_seed(7)
    neg = -torch.rand(50_000, generator=g) - 1
    logits = torch.cat([neg, torch.full((500,), 2.0)]).float()
    labels = torch.cat([torch.zeros(50_000), torch.ones(500)])
    got = _stream(logits, labels, max_entries=1000, bin_bits=12)
    assert got["auc_exact"] and got["auc"] == 1.0


def test_merging_rank_accumulators_equals_one_over_all_rows():
    logits, labels = _data(30_000, seed=8, ties=True)
    parts = [StreamingBinaryMetrics(max_entries=2000, bin_bits=10) for _ in range(3)]
    for i, acc in enumerate(parts):
        acc.update(logits[i::3], labels[i::3])
    whole = StreamingBinaryMetrics(max_entries=2000, bin_bits=10)
    whole.load_state(parts[0].state())
    whole.merge(parts[1])
    whole.merge(parts[2])
    got = whole.compute()
    assert abs(got["auc"] - binary_auc(logits, labels)) <= got["auc_error_bound"] + 1e-12
    assert got["logloss"] == pytest.approx(binary_logloss(torch.sigmoid(logits.double()), labels), rel=1e-12)


def test_one_class_and_empty_streams_give_nan_auc_and_ne_without_failing():
    logits, _ = _data(100, seed=9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        only_neg = _stream(logits, torch.zeros(100))
        empty = StreamingBinaryMetrics().compute()
    assert math.isnan(only_neg["auc"]) and math.isnan(only_neg["ne"]) and math.isnan(only_neg["calibration"])
    assert only_neg["logloss"] > 0 and only_neg["eval_rows"] == 100
    assert empty["eval_rows"] == 0 and math.isnan(empty["auc"]) and math.isnan(empty["logloss"])


def test_bad_batches_are_refused_in_one_line():
    acc = StreamingBinaryMetrics()
    with pytest.raises(MetricError, match="logits: 1 of 3 values are NaN"):
        acc.update(torch.tensor([0.0, float("nan"), 1.0]), torch.tensor([0.0, 1.0, 1.0]))
    with pytest.raises(MetricError, match="labels must be 0 or 1"):
        acc.update(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 2.0]))
    assert acc.compute()["eval_rows"] == 0


def test_trainer_evaluation_streams_the_metrics_of_the_in_memory_path(small_data, tmp_path):  # noqa: F811
    from recaccel.config import load_config
    from recaccel.train.evaluation.evaluate import binary_metrics
    from recaccel.train.loop.trainer import Trainer
    from tests.helpers.resume import small_sets

    argv = small_sets(small_data, tmp_path / "run", "train.steps=6")
    cfg = load_config(None, [s for s in argv if s != "--set"])
    trainer = Trainer(cfg)
    trainer.fit()
    streamed = trainer.evaluate()
    reader = trainer._reader(trainer.evaluator, cfg.data.test, train=False)
    logits, labels = trainer.objective.predictions(trainer._loader(reader))
    in_memory = binary_metrics(logits, labels)
    assert streamed.keys() == in_memory.keys()
    for key, value in in_memory.items():
        assert streamed[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
