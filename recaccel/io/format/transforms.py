"""Dense column transforms of a ``[data.schema]`` mapping (``data.schema.transforms``).

Applied as a row group is decoded, before the ``data.invalid_dense`` checks, so training,
evaluation and :func:`recaccel.export.encode` see the same numbers:

- ``log1p``: sign(x) * log(1 + abs(x)) (log1p for x >= 0, odd-symmetric below);
- ``standardize``: (x - mean) / std with the statistics ``recaccel-data inspect`` stored;
- ``none``: x.

Computed in float64, then rounded to float32 once (the decoder's dense dtype).
"""

from __future__ import annotations

import numpy as np

from recaccel.config import DenseTransform


def apply_transform(values: np.ndarray, transform: DenseTransform) -> np.ndarray:
    """``values`` [n] (any real dtype; NaN stays NaN) transformed, as float32 [n]."""
    x = np.asarray(values, dtype=np.float64)
    if transform.transform == "log1p":
        x = np.sign(x) * np.log1p(np.abs(x))
    elif transform.transform == "standardize":
        x = (x - transform.mean) / transform.std
    return x.astype(np.float32)
