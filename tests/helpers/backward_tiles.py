"""Seeded packs of occurrences, optimizer states and the reference update for the tests
of the Triton occurrence-tile backward (one chunk or several per program)."""

from __future__ import annotations

import torch

from recaccel.ops.embedding.optimizers import PackState, init_states
from recaccel.ops.embedding.packing import LocalFeatures, PackIds, gather_pack_ids
from recaccel.ops.embedding.prepared import PreparedPack
from recaccel.ops.embedding.reference import fused_backward
from recaccel.ops.embedding.row_groups import group_by_row
from recaccel.ops.embedding.specs import SparseOptimConfig
from recaccel.sparse import SparseFeatures

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CFG = SparseOptimConfig(lr=0.1, eps=1e-3, weight_decay=0.01)
OPTIMIZERS = ["sgd", "rowwise_adagrad", "adam"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ROUNDING_SEED = 12345


class Batch:
    """One pack's occurrences with their output gradient.

    Attributes:
        ids: The pack's ids with bags and per-id scales (weights, ``1/L`` for mean).
        num_rows: R, the pack's rows (tables stacked).
        batch_size: B.
        num_local: S.
    """

    def __init__(self, ids: PackIds, num_rows: int, batch_size: int, num_local: int) -> None:
        self.ids, self.num_rows, self.batch_size, self.num_local = ids, num_rows, batch_size, num_local

    def grad_out(self, dim: int, seed: int) -> torch.Tensor:
        # Drawn on the device: at criteo size ([65536, 26, 128]) a host draw and copy costs
        # seconds of a short GPU loan; on the CPU the values are the ones a CPU draw gives.
        g = torch.Generator(DEVICE).manual_seed(seed)
        return torch.randn(self.batch_size, self.num_local, dim, generator=g, device=DEVICE)


def zipf_ids(num_rows: int, count: int, gen: torch.Generator, alpha: float = 1.05) -> torch.Tensor:
    """``count`` ids of a table of ``num_rows`` rows, row ``k`` drawn with weight ``1/(k+1)^alpha``."""
    p = 1.0 / torch.arange(1, num_rows + 1, dtype=torch.float64) ** alpha
    return torch.multinomial(p, count, replacement=True, generator=gen)


def make_batch(
    table_rows: list[int],
    batch_size: int,
    max_len: int,
    *,
    min_len: int = 0,
    mean: bool = False,
    weighted: bool = False,
    zipf: bool = False,
    seed: int = 0,
) -> Batch:
    """One feature per table, bag lengths uniform in [min_len, max_len], ids uniform or Zipf; the
    pack's ids as the lookup prepares them (:func:`gather_pack_ids`)."""
    gen = torch.Generator().manual_seed(seed)
    keys = [f"f{i}" for i in range(len(table_rows))]
    lengths = torch.randint(min_len, max_len + 1, (len(keys) * batch_size,), generator=gen)
    values = []
    for f, rows in enumerate(table_rows):
        n = int(lengths[f * batch_size : (f + 1) * batch_size].sum())
        values.append(zipf_ids(rows, n, gen) if zipf else torch.randint(0, rows, (n,), generator=gen))
    ids = torch.cat(values)
    weights = torch.rand(ids.numel(), generator=gen) + 0.5 if weighted else None
    sf = SparseFeatures.from_lengths(keys, ids, lengths, weights).to(DEVICE)
    offsets = [sum(table_rows[:i]) for i in range(len(table_rows))]
    local = LocalFeatures.build(
        list(range(len(keys))), offsets, [mean] * len(keys), len(keys), torch.device(DEVICE)
    )
    pack_ids = gather_pack_ids(sf, local, batch_size, with_bags=True)
    return Batch(pack_ids, sum(table_rows), batch_size, len(keys))


def sorted_rows_batch(counts: list[int]) -> Batch:
    """Row ``r`` occurs ``counts[r]`` times (one feature of sum-pooled bags of one id each,
    in shuffled bag order), so the row-sorted segments have exactly these lengths."""
    gen = torch.Generator().manual_seed(7)
    rows = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    rows = rows[torch.randperm(rows.numel(), generator=gen)]
    batch_size = rows.numel()
    lengths = torch.ones(batch_size, dtype=torch.int64)
    sf = SparseFeatures.from_lengths(["f"], rows, lengths).to(DEVICE)
    local = LocalFeatures.build([0], [0], [False], 1, torch.device(DEVICE))
    return Batch(gather_pack_ids(sf, local, batch_size, with_bags=True), len(counts), batch_size, 1)


def float64_row_grads(batch: Batch, grad_out: torch.Tensor) -> torch.Tensor:
    """[R, D] float64: each row's summed occurrence gradients, by ``index_add_``."""
    ids, b = batch.ids, batch.batch_size
    contrib = grad_out.double()[ids.bags % b, ids.bags // b]
    if ids.scale is not None:
        contrib = contrib * ids.scale.double()[:, None]
    out = torch.zeros(batch.num_rows, grad_out.shape[2], dtype=torch.float64, device=grad_out.device)
    return out.index_add_(0, ids.rows, contrib)


def make_state(optimizer: str, batch: Batch, dim: int, dtype: torch.dtype, seed: int = 3) -> PackState:
    gen = torch.Generator(DEVICE).manual_seed(seed)
    weight = torch.randn(batch.num_rows, dim, generator=gen, device=DEVICE).to(dtype)
    sixteen_bit = dtype != torch.float32
    return PackState(
        optimizer,
        weight,
        init_states(optimizer, batch.num_rows, dim, torch.device(DEVICE)),
        torch.zeros((), dtype=torch.int64),
        (lambda: ROUNDING_SEED) if sixteen_bit else None,
    )


def copy_state(state: PackState) -> PackState:
    return PackState(
        state.optimizer,
        state.weight.clone(),
        {k: v.clone() for k, v in state.states.items()},
        state.step.clone(),
        state.rounding_seed,
    )


def assert_states_close(got: PackState, want: PackState, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(got.weight, want.weight, rtol=1e-5, atol=1e-6)
    else:
        # Summation order moves the fp32 value by a few ulps, which can flip a stochastic
        # rounding to the other 16-bit neighbour: within one 16-bit step, mostly the same bits.
        torch.testing.assert_close(got.weight.float(), want.weight.float(), rtol=2.0**-7, atol=1e-6)
        assert (got.weight == want.weight).float().mean() > 0.9
    assert int(got.step) == int(want.step)
    for key, value in want.states.items():
        torch.testing.assert_close(
            got.states[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}"
        )


def two_steps(update, state: PackState, batch: Batch, dim: int) -> None:
    """Two updates with different output gradients (Adam's and Adagrad's state carry over)."""
    for step in range(2):
        update(state, batch.ids, batch.grad_out(dim, seed=10 + step), batch.batch_size)


def reference_update(state, ids, grad_out, batch_size):
    fused_backward(state, CFG, grad_out, PreparedPack(ids, group_by_row(ids.rows)))
