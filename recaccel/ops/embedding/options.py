"""How a :class:`~recaccel.ops.embedding.PackedEmbeddingBag` is built: :class:`EmbeddingOptions`.

One typed record of the module's settings (backend, mode, optimizer, bounds check, row
dtype, cache), checked once when it is made, so that a new setting or a new kernel
touches this record rather than every constructor and factory that passes settings on.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from recaccel.errors import ConfigError
from recaccel.ops.embedding.cache.options import CacheOptions
from recaccel.ops.embedding.rounding import EMBEDDING_DTYPES
from recaccel.ops.embedding.specs import SparseOptimConfig

_OP = "PackedEmbeddingBag"
PackMode = Literal["fused", "autograd"]
BoundsCheck = Literal[True, False, "eager", "deferred", "auto"]
PackBackendName = Literal["auto", "reference", "triton", "fbgemm"]
MODES: tuple[str, ...] = ("fused", "autograd")
BOUNDS_CHECKS: tuple[bool | str, ...] = (True, False, "eager", "deferred", "auto")


@dataclasses.dataclass(frozen=True)
class EmbeddingOptions:
    """The settings of one :class:`~recaccel.ops.embedding.PackedEmbeddingBag`.

    Attributes:
        backend: ``"auto"``, ``"reference"``, ``"triton"`` or ``"fbgemm"`` (resolved per
            device by :func:`~recaccel.ops.embedding.choose_backend`, which rejects any
            other name).
        mode: ``"fused"`` (the sparse optimizer runs in the backward) or ``"autograd"``
            (the packed rows are Parameters).
        optim: Sparse optimizer hyper-parameters (fused mode); None means the defaults.
        bounds_check: ``True`` / ``"eager"``, ``"deferred"``, ``"auto"`` (deferred on
            the Triton backend, eager elsewhere) or ``False`` (see
            :class:`~recaccel.ops.embedding.PackedEmbeddingBag`).
        sparse_grad: Autograd mode: sparse COO gradients for the packed rows.
        dtype: The packed rows' dtype, ``"fp32"``, ``"bf16"`` or ``"fp16"`` (16-bit rows
            need fused mode).
        cache: The device cache of host-placed packs; None means the defaults.

    Raises:
        ConfigError: a mode, bounds check or dtype outside its choices, or 16-bit rows
            outside fused mode.
    """

    backend: PackBackendName = "auto"
    mode: PackMode = "fused"
    optim: SparseOptimConfig = dataclasses.field(default_factory=SparseOptimConfig)
    bounds_check: BoundsCheck = True
    sparse_grad: bool = False
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    cache: CacheOptions = dataclasses.field(default_factory=CacheOptions)

    def __post_init__(self) -> None:
        # None stands for the defaults, as the module's keyword arguments always allowed.
        if self.optim is None:
            object.__setattr__(self, "optim", SparseOptimConfig())
        if self.cache is None:
            object.__setattr__(self, "cache", CacheOptions())
        if self.mode not in MODES:
            raise ConfigError(f"{_OP}: mode must be one of {MODES}, got {self.mode!r}")
        if self.bounds_check not in BOUNDS_CHECKS:
            raise ConfigError(
                f"{_OP}: bounds_check must be True, False, 'eager', 'deferred' or 'auto', got {self.bounds_check!r}"
            )
        if self.dtype not in EMBEDDING_DTYPES:
            raise ConfigError(f"{_OP}: dtype must be one of {EMBEDDING_DTYPES}, got {self.dtype!r}")
        if self.dtype != "fp32" and self.mode != "fused":
            raise ConfigError(
                f"{_OP}: dtype={self.dtype!r} needs mode='fused' (16-bit rows are updated only by the fused "
                "optimizer, in float32 with stochastic rounding)"
            )
