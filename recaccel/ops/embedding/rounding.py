"""16-bit embedding rows: their dtypes, and the stochastic rounding of their fp32 updates.

A pack stored in bf16 or fp16 is updated in fp32 (the row is loaded and upcast, the
optimizer state is fp32) and written back with stochastic rounding, as FBGEMM does for
its 16-bit weights: an fp32 value ``x`` between the neighbouring 16-bit values
``lo < |x| < hi`` (by magnitude) becomes ``hi`` with probability
``(|x| - lo) / (hi - lo)``, else ``lo``. The rounding is unbiased (the expected stored
value is ``x``), so updates far smaller than half a 16-bit step still move the rows on
average, where round-to-nearest would stall them.

The uniform noise of element ``(row, col)`` is a hash of ``row * D + col`` and a 32-bit
seed drawn once per pack update from a CPU generator the module owns
(:class:`StochasticRounding`, saved in checkpoints), the same hash on every backend,
so a run repeats and resumes exactly.

Shapes: U rows updated, D dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from recaccel.config import EmbeddingDtype, choices

EMBEDDING_DTYPES = choices(EmbeddingDtype)  # fp32, bf16, fp16
TORCH_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# The hash's constants (both < 2^31, so a 32-bit value times one never overflows int64).
_MASK32 = 0xFFFFFFFF
_MUL1 = 0x7FEB352D
_MUL2 = 0x2C1B3C6D


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of an ``EmbeddingDtype`` name (``fp32``, ``bf16``, ``fp16``)."""
    return TORCH_DTYPES[name]


class StochasticRounding:
    """The seeds of one module's stochastic rounding: one per pack update.

    Args:
        seed: Seed of the module's CPU generator.
    """

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def next_seed(self) -> int:
        """A fresh 32-bit seed (a CPU draw: no device synchronization)."""
        return int(torch.randint(0, 2**32, (), generator=self.generator))

    def state(self) -> Tensor:
        """The generator's state, uint8 [K], for a checkpoint."""
        return self.generator.get_state()

    def load_state(self, state: Tensor) -> None:
        self.generator.set_state(state.cpu())


def uniform_noise(seed: int, index: Tensor) -> Tensor:
    """Uniform float32 in [0, 1) from a seed and int64 element indices (a counter-based hash).

    The Triton fused update computes the same function (``_uniform_noise`` there).
    """
    h = (index & _MASK32) ^ seed
    h = h ^ (h >> 16)
    h = (h * _MUL1) & _MASK32
    h = h ^ (h >> 15)
    h = (h * _MUL2) & _MASK32
    h = h ^ (h >> 16)
    return (h >> 8).to(torch.float32) * 2.0**-24


def stochastic_round(x: Tensor, dtype: torch.dtype, seed: int, rows: Tensor) -> Tensor:
    """Rounds updated fp32 rows to a 16-bit dtype, stochastically (see the module docstring).

    Args:
        x: float32 [U, D] updated rows.
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        seed: This update's 32-bit seed.
        rows: int64 [U] the rows' packed indices (the noise of element ``(r, c)`` is that
            of index ``r * D + c``).

    Returns:
        [U, D] in ``dtype``; values a 16-bit value holds exactly (and NaN) are kept.
    """
    dim = x.shape[1]
    index = rows[:, None] * dim + torch.arange(dim, device=x.device)
    nearest = x.to(dtype)
    near = nearest.float()
    up = x.abs() > near.abs()  # the other neighbour is further from zero
    step = torch.where(up, 1, -1).to(torch.int16)
    other = (nearest.view(torch.int16) + step).view(dtype)
    far = other.float()
    lo, hi = torch.where(up, near, far), torch.where(up, far, near)
    pick_hi = uniform_noise(seed, index) < (x - lo) / (hi - lo)
    rounded = torch.where(pick_hi == up, other, nearest)
    return torch.where((near == x) | x.isnan(), nearest, rounded)
