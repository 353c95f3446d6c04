import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import log_loss, roc_auc_score

from recaccel.metrics import binary_auc, binary_logloss


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 300), levels=st.integers(1, 10), seed=st.integers(0, 10_000), weighted=st.booleans())
def test_auc_matches_sklearn_with_ties(n, levels, seed, weighted):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, levels, (n,), generator=g).float()  # heavy ties
    labels = (torch.rand(n, generator=g) < 0.4).float()
    labels[0], labels[1] = 0.0, 1.0
    weights = torch.rand(n, generator=g) if weighted else None
    expected = roc_auc_score(labels.numpy(), scores.numpy(), sample_weight=None if weights is None else weights.numpy())
    assert binary_auc(scores, labels, weights) == pytest.approx(expected, abs=1e-12)


def test_auc_single_class_is_nan():
    assert torch.isnan(torch.tensor(binary_auc(torch.rand(5), torch.ones(5))))


def test_logloss_matches_sklearn():
    g = torch.Generator().manual_seed(0)
    p = torch.rand(200, generator=g).double()
    y = (torch.rand(200, generator=g) < 0.3).double()
    assert binary_logloss(p, y) == pytest.approx(log_loss(y.numpy(), p.numpy()), rel=1e-9)
