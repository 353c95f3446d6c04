"""AUC and logloss against scikit-learn (an outside reference), and their input checks."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recaccel.errors import RecaccelError
from recaccel.metrics import MetricError, UndefinedMetricWarning, binary_auc, binary_logloss, check_finite

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
