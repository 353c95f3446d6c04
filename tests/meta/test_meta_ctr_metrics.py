"""Meta evaluation of click tasks reports NE and calibration over the real query rows."""

import numpy as np
import pytest
import torch

from recaccel.meta.evaluation import TaskMetrics


def test_meta_click_metrics_include_ne_and_calibration_of_real_query_rows():
    g = torch.Generator().manual_seed(4)
    scores = torch.randn(6, 8, generator=g, dtype=torch.float64)
    labels = (torch.rand(6, 8, generator=g) < 0.35).double()
    mask = (torch.rand(6, 8, generator=g) < 0.8).double()  # padded rows must not count
    m = TaskMetrics("bce", ks=(1,))
    m.update(scores, labels, mask)
    out = m.compute()
    real = mask.numpy() > 0
    p, y = 1 / (1 + np.exp(-scores.numpy()[real])), labels.numpy()[real]
    rate = y.mean()
    logloss = -(y * np.log(p) + (1 - y) * np.log(1 - p)).mean()
    entropy = -(rate * np.log(rate) + (1 - rate) * np.log(1 - rate))
    assert out["ne"] == pytest.approx(logloss / entropy, rel=1e-12)
    assert out["calibration"] == pytest.approx(p.sum() / y.sum(), rel=1e-12)
