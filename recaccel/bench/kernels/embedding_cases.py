"""Cases, inputs, candidates and correctness checks of the embedding benchmark.

A case is T tables of R rows and dim D, one feature per table, B bags per feature of L
ids each (fixed, or drawn uniformly from ``0..2L`` so the mean is L), ids uniform or
Zipf-skewed over a table's rows. A candidate wraps one implementation behind two calls
on the same inputs: ``forward(sf)`` (no autograd graph, no update) and
``train_step(sf, grad_out)`` (forward, backward of ``<pooled, grad_out>``, sparse
optimizer step).

Shapes: B batch, T tables (= features), D dim, L bag length, R rows per table, N ids.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from recaccel.errors import ConfigError, RecaccelError
from recaccel.models.embedding import PerTableEmbeddingBag
from recaccel.ops.embedding import (
    OPTIMIZER_STATES,
    EmbeddingOptions,
    PackedEmbeddingBag,
    SparseOptimConfig,
    TableSpec,
    init_table_weights,
)
from recaccel.sparse import SparseFeatures

ID_DISTRIBUTIONS = ("uniform", "zipf")
LENGTHS = ("fixed", "variable")
PACKED_BACKENDS = ("reference", "triton", "fbgemm")

# Torch optimizer of the per-table baseline, per fused optimizer (see baseline_optimizer).
BASELINE_OPTIMIZERS = {
    "sgd": "torch.optim.SGD (sparse grads)",
    "rowwise_adagrad": "torch.optim.Adagrad (sparse grads, element-wise: torch has no row-wise Adagrad)",
    "adam": "torch.optim.SparseAdam",
}


class CandidateMismatchError(RecaccelError):
    """A candidate's output differs from the reference on the benchmark's inputs."""


class CandidateUnavailable(Exception):
    """A candidate cannot run here (device, missing package, unsupported option); skipped."""


@dataclass(frozen=True)
class EmbeddingCase:
    """One benchmark setting.

    Attributes:
        tables: T.
        batch: B.
        dim: D.
        bag_len: L (mean L when ``lengths == "variable"``).
        rows: R rows per table.
        ids: ``"uniform"`` or ``"zipf"``.
        zipf_alpha: Zipf exponent (``p(k) ~ (k+1)^-alpha`` over a shuffled row order).
        lengths: ``"fixed"`` (every bag holds L ids) or ``"variable"`` (uniform in ``0..2L``).
        optimizer: Fused sparse optimizer (``"sgd"``, ``"rowwise_adagrad"``, ``"adam"``).
        lr: Learning rate of every optimizer.
    """

    tables: int
    batch: int
    dim: int
    bag_len: int
    rows: int
    ids: str = "uniform"
    zipf_alpha: float = 1.05
    lengths: str = "fixed"
    optimizer: str = "sgd"
    lr: float = 0.01

    def __post_init__(self) -> None:
        for name in ("tables", "batch", "dim", "bag_len", "rows"):
            if getattr(self, name) < 1:
                raise ConfigError(f"embedding bench: {name} must be >= 1, got {getattr(self, name)}")
        if self.ids not in ID_DISTRIBUTIONS:
            raise ConfigError(f"embedding bench: ids must be one of {ID_DISTRIBUTIONS}, got {self.ids!r}")
        if self.lengths not in LENGTHS:
            raise ConfigError(f"embedding bench: lengths must be one of {LENGTHS}, got {self.lengths!r}")
        if self.optimizer not in BASELINE_OPTIMIZERS:
            raise ConfigError(
                f"embedding bench: optimizer must be one of {tuple(BASELINE_OPTIMIZERS)}, "
                f"got {self.optimizer!r}"
            )

    @property
    def keys(self) -> list[str]:
        return [f"t{i}" for i in range(self.tables)]

    def table_specs(self) -> list[TableSpec]:
        return [TableSpec(k, self.rows, self.dim, optimizer=self.optimizer) for k in self.keys]

    def optim_config(self) -> SparseOptimConfig:
        return SparseOptimConfig(lr=self.lr)


# The two modes every candidate is timed (and profiled) in: key -> the label of the rows.
MODES = {"fwd": "forward", "train": "fwd+bwd+update"}


def mode_calls(candidate: Candidate, inputs: BenchInputs) -> dict[str, Callable[[], object]]:
    """By mode of :data:`MODES`, a zero-argument call of ``candidate`` whose k-th run reads
    batch k % K (:func:`cycling`)."""
    return {
        "fwd": cycling(candidate.forward, [(sf,) for sf in inputs.batches]),
        "train": cycling(candidate.train_step, list(zip(inputs.batches, inputs.grads))),
    }


def cycling(step: Callable, args: Sequence[tuple]) -> Callable[[], object]:
    """A zero-argument callable whose k-th call runs ``step(*args[k % K])`` (repeat k of a
    timed or profiled candidate reads batch k % K)."""
    state = {"k": 0}

    def call():
        a = args[state["k"] % len(args)]
        state["k"] += 1
        return step(*a)

    return call


def default_rows(device: torch.device, tables: int, dim: int) -> int:
    """Rows per table when not given.

    CUDA: 100k, and when T > 100 fewer so that one copy of all tables fits 4 GiB. CPU:
    10k, fewer so that one copy fits 1 GiB (each candidate holds its own copy).
    """
    if device.type == "cuda":
        return 100_000 if tables <= 100 else max(1, min(100_000, 4 * 2**30 // (tables * dim * 4)))
    return max(1, min(10_000, 2**30 // (tables * dim * 4)))


@dataclass
class BenchInputs:
    """Batches and output gradients, shared by every candidate.

    Attributes:
        batches: K SparseFeatures of T features and B rows; repeat k uses ``k % K``.
        grads: K float32 [B, T, D] gradients of the pooled output (the loss is
            ``sum(pooled * grad)``).
        unique_rows: Distinct (table, row) pairs per batch, for the byte counts.
    """

    batches: list[SparseFeatures]
    grads: list[Tensor]
    unique_rows: list[int]


def make_inputs(case: EmbeddingCase, num_batches: int, device: torch.device, seed: int = 0) -> BenchInputs:
    """Draws ``num_batches`` batches (on the CPU with a seeded generator, then moved)."""
    gen = torch.Generator().manual_seed(seed)
    t, b, r = case.tables, case.batch, case.rows
    order = torch.randperm(r, generator=gen)  # hot Zipf rows scattered over the table
    cdf = None
    if case.ids == "zipf":
        p = torch.arange(1, r + 1, dtype=torch.float64).pow(-case.zipf_alpha)
        cdf = (p.cumsum(0) / p.sum()).to(torch.float64)
    batches, grads, uniques = [], [], []
    for _ in range(num_batches):
        if case.lengths == "fixed":
            lengths = torch.full((t * b,), case.bag_len, dtype=torch.int64)
        else:
            lengths = torch.randint(0, 2 * case.bag_len + 1, (t * b,), generator=gen)
        n = int(lengths.sum())
        if cdf is None:
            values = torch.randint(0, r, (n,), generator=gen)
        else:
            u = torch.rand(n, generator=gen, dtype=torch.float64)
            values = order[torch.searchsorted(cdf, u).clamp(max=r - 1)]
        feature = torch.repeat_interleave(torch.arange(t), lengths.view(t, b).sum(1), output_size=n)
        uniques.append(int(torch.unique(feature * r + values).numel()))
        batches.append(SparseFeatures.from_lengths(case.keys, values, lengths).to(device))
        grads.append(torch.randn(b, t, case.dim, generator=gen).to(device))
    return BenchInputs(batches, grads, uniques)


# --------------------------------------------------------------------------- candidates


@dataclass
class Candidate:
    """One implementation under test.

    Attributes:
        name: Row/column label.
        forward: ``sf -> float32 [B, T, D]`` pooled, without graph or update.
        train_step: ``(sf, grad_out [B, T, D]) -> None``: forward, backward, optimizer step.
        same_update_as_reference: its optimizer step is the reference's rule (checked).
    """

    name: str
    forward: Callable[[SparseFeatures], Tensor]
    train_step: Callable[[SparseFeatures, Tensor], None]
    same_update_as_reference: bool = True


CandidateFactory = Callable[[EmbeddingCase, Mapping[str, Tensor], torch.device], Candidate]
"""``(case, initial rows by table name [R, D] on the CPU, device) -> Candidate``; raises
:class:`CandidateUnavailable` when it cannot run."""


def baseline_optimizer(case: EmbeddingCase, params) -> torch.optim.Optimizer:
    """The torch optimizer a per-table user pairs with sparse gradients (see BASELINE_OPTIMIZERS)."""
    cfg = case.optim_config()
    if case.optimizer == "sgd":
        return torch.optim.SGD(params, lr=case.lr)
    if case.optimizer == "rowwise_adagrad":
        return torch.optim.Adagrad(params, lr=case.lr, eps=cfg.eps)
    return torch.optim.SparseAdam(params, lr=case.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def per_table_candidate(case: EmbeddingCase, init: Mapping[str, Tensor], device: torch.device) -> Candidate:
    """``PerTableEmbeddingBag`` (one ``nn.EmbeddingBag(sparse=True)`` per table) + a torch optimizer."""
    # sparse=True: what a per-table user sets to get row gradients, not dense [R, D] ones.
    module = PerTableEmbeddingBag(case.keys, [case.rows] * case.tables, case.dim, sparse=True)
    with torch.no_grad():
        for name, bag in zip(case.keys, module.bags):
            bag.weight.copy_(init[name])
    module.to(device)
    return _torch_optim_candidate("per_table", module, case)


def _torch_optim_candidate(name: str, module: torch.nn.Module, case: EmbeddingCase) -> Candidate:
    """``module`` trained on sparse gradients by :func:`baseline_optimizer`: zero_grad, backward, step."""
    opt = baseline_optimizer(case, module.parameters())

    def forward(sf: SparseFeatures) -> Tensor:
        with torch.no_grad():
            return module(sf)

    def train_step(sf: SparseFeatures, grad: Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        module(sf).backward(grad)
        opt.step()

    same_rule = case.optimizer != "rowwise_adagrad"
    return Candidate(name, forward, train_step, same_update_as_reference=same_rule)


def _packed(case: EmbeddingCase, device: torch.device, backend: str, seed: int) -> PackedEmbeddingBag:
    # The models' bounds check ("auto": deferred into the Triton kernels, eager elsewhere), so
    # the module is timed as a training step runs it: the eager check's host sync per call
    # once made the H200's triton forward read 1.27 ms where its kernel took 0.13 ms.
    options = EmbeddingOptions(backend=backend, mode="fused", optim=case.optim_config(), bounds_check="auto")
    return PackedEmbeddingBag(case.table_specs(), options, device=device, seed=seed)


def packed_candidate(backend: str, seed: int) -> CandidateFactory:
    """Factory of ``PackedEmbeddingBag(backend=backend, mode="fused")`` (rows from ``seed``)."""

    def build(case: EmbeddingCase, init: Mapping[str, Tensor], device: torch.device) -> Candidate:
        if backend == "triton" and device.type != "cuda":
            raise CandidateUnavailable(f"triton on {device.type}: only its interpreter runs here (not timed)")
        try:
            module = _packed(case, device, backend, seed)
        except (RecaccelError, RuntimeError, ValueError, ImportError, OSError, NotImplementedError) as e:
            raise CandidateUnavailable(f"{backend}: {e}") from e
        module.train()

        def forward(sf: SparseFeatures) -> Tensor:
            with torch.no_grad():
                return module(sf)

        def train_step(sf: SparseFeatures, grad: Tensor) -> None:
            module(sf).backward(grad)

        return Candidate(backend, forward, train_step)

    return build


def packed_autograd_candidate(seed: int) -> CandidateFactory:
    """Packed reference lookup in ``mode="autograd"`` (sparse grads) + the baseline's torch optimizer.

    Separates what packing gains from what the fused update gains.
    """

    def build(case: EmbeddingCase, init: Mapping[str, Tensor], device: torch.device) -> Candidate:
        options = EmbeddingOptions(backend="reference", mode="autograd", sparse_grad=True)
        module = PackedEmbeddingBag(case.table_specs(), options, device=device, seed=seed)
        return _torch_optim_candidate("reference_autograd", module, case)

    return build


def default_factories(seed: int, *, with_autograd: bool = False) -> dict[str, CandidateFactory]:
    """The candidates in table order: per-table loop, then each packed backend."""
    out: dict[str, CandidateFactory] = {"per_table": per_table_candidate}
    out.update({b: packed_candidate(b, seed) for b in PACKED_BACKENDS})
    if with_autograd:
        out["reference_autograd"] = packed_autograd_candidate(seed)
    return out


def initial_rows(case: EmbeddingCase, seed: int) -> dict[str, Tensor]:
    """The rows every candidate starts from (those ``PackedEmbeddingBag(seed=seed)`` draws)."""
    return init_table_weights(case.table_specs(), seed=seed)


# --------------------------------------------------------------------------- checks


def check_candidates(
    candidates: Mapping[str, Candidate], reference: str, inputs: BenchInputs, case: EmbeddingCase
) -> None:
    """Checks every candidate against ``reference`` before anything is timed.

    1. Forward on batch 0 equals the reference's (``torch.testing.assert_close``).
    2. One train step on batch 0, then forward on batch 0 (which reads every updated row)
       and on the last batch: equal for candidates whose update rule is the reference's
       (the per-table baseline with element-wise Adagrad is not). The step's output
       gradient is positive (``|G| + 0.5``) so that
       the gradients of a row's duplicates cannot cancel: Adam's first step moves each
       element by about ``lr * g / |g|``, which turns the rounding of a near-zero sum
       (summation order differs between implementations) into a visible difference.
       This leaves every candidate one step past its initial rows.

    Raises:
        CandidateMismatchError: naming the candidate, the check and the case.
    """
    ref = candidates[reference]
    first, last = inputs.batches[0], inputs.batches[-1]

    def compare(name: str, what: str, actual: Tensor, expected: Tensor) -> None:
        try:
            torch.testing.assert_close(actual, expected)
        except AssertionError as e:
            raise CandidateMismatchError(
                f"embedding bench: candidate {name!r} {what} differs from {reference!r} on {case}: {e}"
            ) from None

    expected = ref.forward(first)
    for name, cand in candidates.items():
        if name != reference:
            compare(name, "forward", cand.forward(first), expected)
    grad = inputs.grads[0].abs() + 0.5
    for cand in candidates.values():
        cand.train_step(first, grad)
    # The step's batch reads every row the step updated; the last batch may read none of them.
    for batch in [first] if last is first else [first, last]:
        expected = ref.forward(batch)
        for name, cand in candidates.items():
            if name != reference and cand.same_update_as_reference:
                compare(name, "forward after one train step", cand.forward(batch), expected)


# --------------------------------------------------------------------------- bytes


def state_floats_per_row(optimizer: str, dim: int) -> int:
    """float32 optimizer-state values per row: 0 (SGD), 1 (row-wise Adagrad), 2D (Adam)."""
    return sum(1 if rowwise else dim for _, rowwise in OPTIMIZER_STATES[optimizer])


def bytes_moved(case: EmbeddingCase, num_ids: int, unique_rows: int) -> tuple[int, int]:
    """Minimum bytes of forward, and of forward+backward+update, of one batch (float32 rows, int64 ids).

    Forward: read N rows of D (each id's row, as FBGEMM's benchmark counts
    ``B*T*L*D``), the N ids and T*B+1 offsets; write B*T*D pooled.
    Backward+update: read the B*T*D output gradient and the ids and offsets again;
    read and write each of the U distinct touched rows (D floats) and their optimizer
    state (0 / 1 / 2D floats for SGD / row-wise Adagrad / Adam).
    """
    b, t, d = case.batch, case.tables, case.dim
    index_bytes = num_ids * 8 + (t * b + 1) * 8
    fwd = num_ids * d * 4 + index_bytes + b * t * d * 4
    bwd = b * t * d * 4 + index_bytes + 2 * unique_rows * (d + state_floats_per_row(case.optimizer, d)) * 4
    return fwd, fwd + bwd
