"""AUC and logloss against scikit-learn (an outside reference), and their input checks."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recaccel.errors import RecaccelError
from recaccel.metrics import (
    MetricError,
    UndefinedMetricWarning,
    binary_auc,
    binary_logloss,
    calibration,
    check_finite,
    normalized_entropy,
)

pytestmark = pytest.mark.numeric


skm = pytest.importorskip("sklearn.metrics", reason="scikit-learn is the outside reference for the metrics")


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 300), levels=st.integers(1, 10), seed=st.integers(0, 10_000), weighted=st.booleans())
def test_auc_matches_sklearn_with_ties(n, levels, seed, weighted):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, levels, (n,), generator=g).float()  # heavy ties
    labels = (torch.rand(n, generator=g) < 0.4).float()
    labels[0], labels[1] = 0.0, 1.0
    weights = torch.rand(n, generator=g) if weighted else None
    expected = skm.roc_auc_score(
        labels.numpy(), scores.numpy(), sample_weight=None if weights is None else weights.numpy()
    )
    assert binary_auc(scores, labels, weights) == pytest.approx(expected, abs=1e-12)


def test_auc_does_not_depend_on_row_order_with_ties():
    g = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 3, (200,), generator=g).double()
    labels = (torch.rand(200, generator=g) < 0.5).double()
    perm = torch.randperm(200, generator=g)
    want = skm.roc_auc_score(labels.numpy(), scores.numpy())
    assert binary_auc(scores, labels) == pytest.approx(want, abs=1e-12)
    assert binary_auc(scores[perm], labels[perm]) == pytest.approx(want, abs=1e-12)
    assert binary_auc(scores.flip(0), labels.flip(0)) == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("reverse", [False, True])
def test_auc_rejects_non_finite_scores(bad, reverse):
    # Before the check, NaN scores sorted to one end: AUC 1.0, or 0.0 with rows reversed.
    scores = torch.tensor([0.1, 0.4, bad, 0.8, bad])
    labels = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])
    if reverse:
        scores, labels = scores.flip(0), labels.flip(0)
    with pytest.raises(MetricError, match=r"binary_auc: scores: 2 of 5 values are NaN or infinite") as e:
        binary_auc(scores, labels)
    first = 0 if reverse else 2
    assert f"first at index {first}" in str(e.value)
    assert isinstance(e.value, RecaccelError) and "\n" not in str(e.value)
    with pytest.raises(ValueError):  # sklearn refuses them too
        skm.roc_auc_score(labels.numpy(), scores.numpy())


@pytest.mark.parametrize(
    "labels, match",
    [
        ([0.0, 1.0, 2.0, 1.0], r"labels must be 0 or 1: 1 of 4 are not \(first at index 2: 2.0\)"),
        ([0.0, -1.0, 1.0, 1.0], r"labels must be 0 or 1: 1 of 4 are not \(first at index 1: -1.0\)"),
        ([0.0, 0.5, 1.0, 1.0], r"labels must be 0 or 1: 1 of 4 are not \(first at index 1: 0.5\)"),
        ([0.0, 1.0, math.nan, 1.0], r"labels: 1 of 4 values are NaN or infinite \(first at index 2: nan\)"),
    ],
)
def test_auc_rejects_bad_labels(labels, match):
    with pytest.raises(MetricError, match=match):
        binary_auc(torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor(labels))


@pytest.mark.parametrize(
    "weights, match",
    [([1.0, -0.5, 1.0], r"weights must be >= 0"), ([1.0, math.nan, 1.0], r"weights: 1 of 3 values")],
)
def test_auc_rejects_bad_weights(weights, match):
    with pytest.raises(MetricError, match=match):
        binary_auc(torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.0, 1.0, 1.0]), torch.tensor(weights))


def test_auc_rejects_mismatched_lengths():
    with pytest.raises(MetricError, match="labels has 3 values, scores/probs have 4"):
        binary_auc(torch.rand(4), torch.tensor([0.0, 1.0, 1.0]))


@pytest.mark.parametrize("cls", [0.0, 1.0])
def test_auc_single_class_is_nan_with_a_warning(cls):
    labels = torch.full((5,), cls)
    with pytest.warns(UndefinedMetricWarning, match="only (positives|negatives) among 5 rows"):
        assert math.isnan(binary_auc(torch.rand(5), labels))
    # sklearn agrees that it is undefined (recent versions warn and return NaN, older raise).
    try:
        with pytest.warns(Warning):
            assert math.isnan(skm.roc_auc_score(labels.numpy(), torch.rand(5).numpy()))
    except ValueError:
        pass


def test_auc_class_with_zero_weight_counts_as_absent():
    with pytest.warns(UndefinedMetricWarning, match="only positives"):
        got = binary_auc(
            torch.rand(4), torch.tensor([0.0, 1.0, 1.0, 0.0]), torch.tensor([0.0, 1.0, 2.0, 0.0])
        )
    assert math.isnan(got)


def test_auc_of_no_rows_is_nan_with_a_warning():
    with pytest.warns(UndefinedMetricWarning, match="no rows"):
        assert math.isnan(binary_auc(torch.empty(0), torch.empty(0)))


@pytest.mark.parametrize("weighted", [False, True])
def test_logloss_matches_sklearn(weighted):
    g = torch.Generator().manual_seed(0)
    p = torch.rand(200, generator=g).double() * 0.98 + 0.01
    p[:20] = 0.3  # ties do not matter to logloss, but keep them in
    y = (torch.rand(200, generator=g) < 0.3).double()
    w = torch.rand(200, generator=g).double() if weighted else None
    want = skm.log_loss(y.numpy(), p.numpy(), sample_weight=None if w is None else w.numpy())
    assert binary_logloss(p, y, weights=w) == pytest.approx(want, rel=1e-12)


def test_logloss_single_class_matches_sklearn_without_warning(recwarn):
    p = torch.tensor([0.2, 0.7, 0.9], dtype=torch.float64)
    y = torch.ones(3, dtype=torch.float64)
    want = skm.log_loss(y.numpy(), p.numpy(), labels=[0, 1])
    assert binary_logloss(p, y) == pytest.approx(want, rel=1e-12)
    assert not [w for w in recwarn if issubclass(w.category, UndefinedMetricWarning)]


def test_logloss_clamps_certain_probabilities():
    got = binary_logloss(torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.0]), eps=1e-7)
    assert got == pytest.approx(-math.log(1e-7), rel=1e-9)


@pytest.mark.parametrize(
    "probs, labels, match",
    [
        ([0.2, math.nan, 0.5], [0.0, 1.0, 1.0], r"probs: 1 of 3 values are NaN or inf.* index 1"),
        ([0.2, 0.4, math.inf], [0.0, 1.0, 1.0], r"probs: 1 of 3 values are NaN or inf.* index 2"),
        ([0.2, 1.5, -0.1], [0.0, 1.0, 1.0], r"probs must be in \[0, 1\]: 2 of 3 are not \(first at index 1"),
        ([0.2, 0.4, 0.5], [0.0, 2.0, 1.0], r"labels must be in \[0, 1\]: 1 of 3 are not \(first at index 1"),
        ([0.2, 0.4, 0.5], [math.nan, 1.0, 1.0], r"labels: 1 of 3 values are NaN or infinite"),
    ],
)
def test_logloss_rejects_bad_input(probs, labels, match):
    with pytest.raises(MetricError, match="binary_logloss: " + match):
        binary_logloss(torch.tensor(probs), torch.tensor(labels))


def test_logloss_of_no_rows_is_nan_with_a_warning():
    with pytest.warns(UndefinedMetricWarning, match="no rows"):
        assert math.isnan(binary_logloss(torch.empty(0), torch.empty(0)))


def test_check_finite_names_what_and_hint():
    with pytest.raises(MetricError) as e:
        check_finite(torch.tensor([[1.0, 2.0], [math.inf, 3.0]]), "model predictions", "lower the lr")
    assert str(e.value) == (
        "model predictions: 1 of 4 values are NaN or infinite (first at index 2: inf); lower the lr"
    )
    check_finite(torch.tensor([1.0, -2.0]), "fine")


def _numpy_ne_and_calibration(p, y, w):
    """NE and calibration in float64 numpy, written from their definitions."""
    import numpy as np

    p, y = np.asarray(p, np.float64), np.asarray(y, np.float64)
    w = np.ones_like(p) if w is None else np.asarray(w, np.float64)
    rate = (w * y).sum() / w.sum()
    entropy = -(rate * np.log(rate) + (1 - rate) * np.log(1 - rate))
    logloss = -(w * (y * np.log(p) + (1 - y) * np.log(1 - p))).sum() / w.sum()
    return logloss / entropy, (w * p).sum() / (w * y).sum()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("weighted", [False, True])
def test_ne_and_calibration_match_numpy_and_sklearn_logloss(seed, weighted):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(500, generator=g).double() * 0.98 + 0.01
    y = (torch.rand(500, generator=g) < p).double()
    w = torch.rand(500, generator=g).double() * 3 if weighted else None
    want_ne, want_cal = _numpy_ne_and_calibration(p.numpy(), y.numpy(), None if w is None else w.numpy())
    assert normalized_entropy(p, y, weights=w) == pytest.approx(want_ne, rel=1e-12)
    assert calibration(p, y, weights=w) == pytest.approx(want_cal, rel=1e-12)
    # The numerator is sklearn's logloss; the denominator is the logloss of the base rate.
    ww = None if w is None else w.numpy()
    rate = float(((w if w is not None else 1) * y).sum() / (w.sum() if w is not None else len(y)))
    base = skm.log_loss(y.numpy(), [rate] * len(y), sample_weight=ww)
    assert normalized_entropy(p, y, weights=w) == pytest.approx(
        skm.log_loss(y.numpy(), p.numpy(), sample_weight=ww) / base, rel=1e-10
    )


def test_ne_is_one_when_predicting_the_base_rate_and_calibration_one_when_means_agree():
    y = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    p = torch.full_like(y, 0.25)
    assert normalized_entropy(p, y) == pytest.approx(1.0, rel=1e-12)
    assert calibration(p, y) == pytest.approx(1.0, rel=1e-12)
    assert calibration(p * 2, y) == pytest.approx(2.0, rel=1e-12)  # over-predicts clicks


def test_weights_count_like_repeated_rows_in_ne_and_calibration():
    g = torch.Generator().manual_seed(5)
    p = torch.rand(40, generator=g).double() * 0.9 + 0.05
    y = (torch.rand(40, generator=g) < 0.4).double()
    y[0], y[1] = 0.0, 1.0
    reps = torch.randint(0, 4, (40,), generator=g)
    rp, ry = p.repeat_interleave(reps), y.repeat_interleave(reps)
    w = reps.double()
    assert normalized_entropy(p, y, weights=w) == pytest.approx(normalized_entropy(rp, ry), rel=1e-12)
    assert calibration(p, y, weights=w) == pytest.approx(calibration(rp, ry), rel=1e-12)


@pytest.mark.parametrize("cls", [0.0, 1.0])
def test_ne_of_a_single_class_is_nan_with_a_warning(cls):
    labels = torch.full((6,), cls)
    with pytest.warns(
        UndefinedMetricWarning, match=f"normalized_entropy: the base rate of the labels is {cls:g}"
    ):
        assert math.isnan(normalized_entropy(torch.full((6,), 0.3), labels))


def test_calibration_of_all_zero_labels_is_nan_with_a_warning_and_of_all_ones_is_defined():
    with pytest.warns(UndefinedMetricWarning, match="calibration: no positive labels"):
        assert math.isnan(calibration(torch.full((4,), 0.2), torch.zeros(4)))
    assert calibration(torch.full((4,), 0.2), torch.ones(4)) == pytest.approx(0.2, rel=1e-6)


def test_one_row_gives_nan_ne_and_a_defined_calibration():
    with pytest.warns(UndefinedMetricWarning, match="base rate of the labels is 1"):
        assert math.isnan(normalized_entropy(torch.tensor([0.8]), torch.tensor([1.0])))
    assert calibration(torch.tensor([0.8]), torch.tensor([1.0])) == pytest.approx(0.8, rel=1e-6)


@pytest.mark.parametrize("fn", [normalized_entropy, calibration])
def test_ne_and_calibration_of_no_rows_or_zero_weights_are_nan_with_a_warning(fn):
    with pytest.warns(UndefinedMetricWarning, match="no rows"):
        assert math.isnan(fn(torch.empty(0), torch.empty(0)))
    with pytest.warns(UndefinedMetricWarning, match="weights sum to 0|no positive labels"):
        assert math.isnan(fn(torch.tensor([0.2, 0.7]), torch.tensor([0.0, 1.0]), weights=torch.zeros(2)))


@pytest.mark.parametrize("fn", [normalized_entropy, calibration])
@pytest.mark.parametrize(
    "probs, labels, weights, match",
    [
        ([0.2, math.nan, 0.5], [0.0, 1.0, 1.0], None, r"probs: 1 of 3 values are NaN or inf.* index 1"),
        ([0.2, 1.5, 0.5], [0.0, 1.0, 1.0], None, r"probs must be in \[0, 1\]: 1 of 3 are not"),
        ([0.2, 0.4, 0.5], [0.0, 2.0, 1.0], None, r"labels must be in \[0, 1\]: 1 of 3 are not"),
        ([0.2, 0.4, 0.5], [0.0, 1.0, 1.0], [1.0, -1.0, 1.0], r"weights must be >= 0"),
        ([0.2, 0.4], [0.0, 1.0, 1.0], None, r"labels has 3 values, scores/probs have 2"),
    ],
)
def test_ne_and_calibration_reject_bad_input_in_one_line(fn, probs, labels, weights, match):
    w = None if weights is None else torch.tensor(weights)
    with pytest.raises(MetricError, match=f"{fn.__name__}: " + match) as e:
        fn(torch.tensor(probs), torch.tensor(labels), weights=w)
    assert "\n" not in str(e.value)


def test_evaluation_metrics_add_ne_and_calibration_and_keep_the_others():
    from recaccel.train.evaluation.evaluate import binary_metrics

    g = torch.Generator().manual_seed(11)
    logits = torch.randn(300, generator=g)
    labels = (torch.rand(300, generator=g) < torch.sigmoid(logits)).float()
    probs = torch.sigmoid(logits.double())
    got = binary_metrics(logits, labels)
    assert set(got) == {"auc", "logloss", "ne", "calibration", "ctr", "eval_rows"}
    assert got["auc"] == binary_auc(logits, labels)
    assert got["logloss"] == binary_logloss(probs, labels)
    want_ne, want_cal = _numpy_ne_and_calibration(probs.numpy(), labels.double().numpy(), None)
    assert got["ne"] == pytest.approx(want_ne, rel=1e-12)
    assert got["calibration"] == pytest.approx(want_cal, rel=1e-12)
    assert got["ne"] == pytest.approx(
        got["logloss"] / skm.log_loss(labels.numpy(), [got["ctr"]] * 300), rel=1e-9
    )
