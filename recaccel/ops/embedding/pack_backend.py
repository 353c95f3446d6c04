"""One pack on one backend: the interface :class:`PackedEmbeddingBag` drives, and the base
of the packs whose tensors the module itself holds.

A :class:`PackedEmbeddingBag` builds one pack object per (dim, optimizer) pack, all of one
backend class chosen once at construction (:class:`~recaccel.ops.embedding.reference.ReferencePack`,
:class:`~recaccel.ops.embedding.triton.TritonPack`,
:class:`~recaccel.ops.embedding.fbgemm.FbgemmPack`), and from then on only calls
:class:`PackBackend` methods: the module holds no backend branches.

Reference and Triton packs keep their rows and optimizer state as tensors of the owning
module (``weight_<p>``, ``momentum1_<p>``, ...: Parameters in autograd mode, else
non-persistent buffers), so ``.to()``, ``parameters()`` and ``buffers()`` see them;
``.to()`` replaces buffers, so the module hands a pack its current tensors (``held``, by
name) at every call instead of the pack keeping them. The FBGEMM pack keeps its tables
in its TBE and holds nothing on the module.

Shapes: B batch, F features of a batch, F_p (= S) of them in the pack, D dim, N ids, R_t rows
of a table, R of the pack.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar, Protocol

import torch
from torch import Tensor, nn

from recaccel.ops.embedding.optimizers import PackState, init_states
from recaccel.ops.embedding.packing import PackLayout
from recaccel.ops.embedding.prepared import PackBatch, PreparedPack
from recaccel.ops.embedding.rounding import StochasticRounding
from recaccel.ops.embedding.specs import OPTIMIZER_STATES, SparseOptimConfig

_OP = "PackedEmbeddingBag"


@dataclasses.dataclass(frozen=True)
class PackOptions:
    """How every pack of one module is built (the module's settings, shared by its packs).

    Attributes:
        mode: ``"fused"`` or ``"autograd"``.
        optim: Sparse optimizer hyper-parameters (fused mode).
        sparse_grad: Autograd mode: a sparse gradient for the packed weight.
        dtype: The rows' dtype (float32; bfloat16 or float16 in fused mode). The optimizer
            state is float32 whatever it is.
        rounding: 16-bit rows: the module's stochastic-rounding seeds.
    """

    mode: str
    optim: SparseOptimConfig
    sparse_grad: bool = False
    dtype: torch.dtype = torch.float32
    rounding: StochasticRounding | None = None


def table_views(layout: PackLayout, tensors: Mapping[str, Tensor], step: Tensor) -> list[dict[str, Tensor]]:
    """Per table of ``layout``: its rows of each packed tensor ([R_t, ...] views, by
    checkpoint name), plus Adam's ``step``."""
    out = []
    for table, start in zip(layout.tables, layout.row_offsets):
        rows = slice(start, start + table.num_rows)
        views = {name: t[rows] for name, t in tensors.items()}
        if table.optimizer == "adam":
            views["step"] = step
        out.append(views)
    return out


class PackBackend(Protocol):
    """What the module asks of one pack.

    A lookup is prepared (:meth:`prepare`: whatever the pack's kernels need before they
    run, made possibly ahead of time on a side stream) and then run (:meth:`lookup`,
    :meth:`lookup_rows`); a fused pack's update runs in the lookup's backward or, for a
    batch whose dense work ran in micro-batches, once from :meth:`apply_gradient`.

    Every call after :meth:`create` takes the batch as one :class:`PackBatch` (the batch,
    the pack's route, B, the training flag and the pack's preparation), so a new kernel
    or a new per-call input changes that record, not these signatures. ``held`` is the
    module's tensors of the pack, by name (looked up at every call: ``.to()`` replaces
    buffers).

    Attributes:
        always_checks_ids: Check every batch's ids whatever ``bounds_check`` says (the
            reference: its gathers would fail with an opaque message otherwise).
    """

    always_checks_ids: ClassVar[bool]

    @classmethod
    def create(
        cls, layout: PackLayout, weights: list[Tensor], options: PackOptions, device: torch.device
    ) -> tuple[PackBackend, dict[str, Tensor]]:
        """The pack of ``layout``, and the tensors the module is to hold for it.

        Args:
            layout: The pack.
            weights: Initial float32 [R_t, D] rows of each table of the pack (CPU).
            options: The module's settings.
            device: Where the rows live.

        Returns:
            (pack, held): ``held`` by name; the module registers each as ``<name>_<pack>``,
            a Parameter as a parameter, the others as non-persistent buffers.
        """

    def check_batch_device(self, held: Mapping[str, Tensor], device: torch.device) -> None:
        """Raises ValueError when a batch on ``device`` cannot be looked up by this pack."""

    def prepare(self, batch: PackBatch) -> PreparedPack | None:
        """The pack's input preparation for a batch.

        Args:
            batch: The batch (its ids checked when the module checks them; int32 or
                int64 ids and offsets [N], [F*B+1]), ``batch.train`` true to include
                what the backward needs; ``batch.prepared`` is None.

        Returns:
            What the later calls read as ``batch.prepared``, or None when the pack needs
            nothing.
        """

    def lookup(self, held: Mapping[str, Tensor], batch: PackBatch) -> Tensor:
        """Pools the pack's features of a batch.

        A pack whose class sets ``writes_out = True`` also takes ``out=``: [B, F_p, D] of
        float32 or a 16-bit dtype (checked by the caller) that the kernel writes into and
        returns, carrying the lookup's autograd node.

        Args:
            held: The module's tensors of this pack, by name.
            batch: The batch with its preparation; ``batch.train``: the lookup is part of
                a training step (module in training mode, grad enabled), so a fused
                pack's backward updates its rows.

        Returns:
            float32 [B, F_p, D] in the batch's feature order.
        """

    def lookup_rows(
        self,
        held: Mapping[str, Tensor],
        batch: PackBatch,
        lo: int,
        hi: int,
        out_dtype: torch.dtype | None = None,
    ) -> Tensor:
        """Pools rows ``lo .. hi-1`` of a prepared batch, without a graph (``0 <= lo < hi <= B``).

        Returns:
            [hi-lo, F_p, D]: rows ``lo:hi`` of :meth:`lookup`'s result, in ``out_dtype``
            when given (a 16-bit dtype: written in 16 bits, or cast).
        """

    def deferred_update_unsupported(self) -> str | None:
        """Why :meth:`apply_gradient` cannot run on this pack, or None when it can."""

    def apply_gradient(self, held: Mapping[str, Tensor], batch: PackBatch, grad: Tensor) -> None:
        """Applies the update a fused lookup's backward would, for this output gradient.

        Args:
            held: The module's tensors of this pack, by name.
            batch: The batch, its preparation made for training.
            grad: [B, F_p, D] gradient of the pack's pooled output, in the dtype
                :meth:`lookup_rows` gave it (float32 or 16 bits).
        """

    def table_tensors(self, held: Mapping[str, Tensor]) -> list[dict[str, Tensor]]:
        """Per table of the pack: views of its rows [R_t, D] and optimizer state, by
        checkpoint name (``weight``, ``momentum1``, ``momentum2``, ``step``)."""

    def set_learning_rate(self, lr: float) -> None:
        """Changes the learning rate of the pack's sparse optimizer."""


class HeldPack(ABC):
    """Base of the packs whose rows and optimizer state the module holds (reference, Triton).

    Subclasses say how to prepare a batch, how to pool in each mode and how to update;
    this class builds the tensors, picks the mode, and slices the packed tensors into
    per-table views.

    Args:
        layout: The pack.
        options: The module's settings.
    """

    always_checks_ids: ClassVar[bool] = False
    # Its lookup_autograd / lookup_frozen / lookup_fused take ``out=`` and write into it.
    writes_out: ClassVar[bool] = False

    def __init__(self, layout: PackLayout, options: PackOptions) -> None:
        self.layout = layout
        self.mode = options.mode
        self.optim = options.optim  # replaced by set_learning_rate
        self.sparse_grad = options.sparse_grad
        self.rounding = options.rounding
        # Adam's t: a CPU tensor, so that reading it never waits for the GPU.
        self.step = torch.zeros((), dtype=torch.int64)
        self._lr_scalar: Tensor | None = None  # optim.lr on the device (_lr_on)
        # A captured step's updates read one rate tensor per pack, refilled by the schedule.
        self.rates_in_place = False

    @classmethod
    def create(
        cls, layout: PackLayout, weights: list[Tensor], options: PackOptions, device: torch.device
    ) -> tuple[HeldPack, dict[str, Tensor]]:
        """The pack, and its tensors for the module to hold: ``weight`` [R, D] in
        ``options.dtype`` (a Parameter in autograd mode) from the tables' initial rows
        ``weights`` (float32 [R_t, D] each, rounded to nearest), then zero float32
        optimizer state."""
        pack = cls(layout, options)
        weight = torch.cat(weights).to(device=device, dtype=options.dtype)
        held = {"weight": nn.Parameter(weight) if options.mode == "autograd" else weight}
        held.update(init_states(layout.optimizer, layout.num_rows, layout.dim, device))
        return pack, held

    def check_batch_device(self, held: Mapping[str, Tensor], device: torch.device) -> None:
        if device != held["weight"].device:
            raise ValueError(f"{_OP}: the batch is on {device} but the tables are on {held['weight'].device}")

    @abstractmethod
    def prepare(self, batch: PackBatch) -> PreparedPack | None:
        """See :meth:`PackBackend.prepare`."""

    def lookup(self, held: Mapping[str, Tensor], batch: PackBatch, out: Tensor | None = None) -> Tensor:
        """See :meth:`PackBackend.lookup`; ``out`` only where the class sets ``writes_out``."""
        weight = held["weight"]
        kw = {} if out is None else {"out": out}
        if self.mode == "autograd":
            return self.lookup_autograd(weight, batch, **kw)
        if not batch.train:
            return self.lookup_frozen(weight, batch, **kw)
        # The rows are buffers: an empty input that requires grad makes autograd call the
        # fused backward.
        anchor = torch.empty(0, device=weight.device, requires_grad=True)
        return self.lookup_fused(anchor, self._state(held), batch, **kw)

    @torch.no_grad()
    def lookup_rows(
        self,
        held: Mapping[str, Tensor],
        batch: PackBatch,
        lo: int,
        hi: int,
        out_dtype: torch.dtype | None = None,
    ) -> Tensor:
        return self.pool_rows(held["weight"].detach(), batch, lo, hi, out_dtype)

    def deferred_update_unsupported(self) -> str | None:
        if self.mode == "autograd":
            return (
                "mode='autograd' (the packed rows are Parameters: the caller accumulates their gradients "
                "over the micro-batches and applies its own optimizer)"
            )
        return None

    def apply_gradient(self, held: Mapping[str, Tensor], batch: PackBatch, grad: Tensor) -> None:
        self.update(self._state(held), grad, batch)

    @abstractmethod
    def lookup_autograd(self, weight: Tensor, batch: PackBatch) -> Tensor:
        """Autograd mode: float32 [B, S, D], differentiable w.r.t. the Parameter ``weight`` [R, D]."""

    @abstractmethod
    def lookup_frozen(self, weight: Tensor, batch: PackBatch) -> Tensor:
        """Fused mode outside training: float32 [B, S, D] from ``weight`` [R, D], no graph."""

    @abstractmethod
    def lookup_fused(self, anchor: Tensor, state: PackState, batch: PackBatch) -> Tensor:
        """Fused mode in training: float32 [B, S, D] whose backward runs :meth:`update`
        (``anchor``: an empty tensor that requires grad)."""

    @abstractmethod
    def pool_rows(
        self, weight: Tensor, batch: PackBatch, lo: int, hi: int, out_dtype: torch.dtype | None
    ) -> Tensor:
        """Rows ``lo:hi`` of the pooled batch: [hi-lo, S, D] (float32, or ``out_dtype``),
        ``weight`` [R, D] detached, no graph."""

    @abstractmethod
    def update(self, state: PackState, grad: Tensor, batch: PackBatch) -> None:
        """Fused mode: the sparse update of one batch's output gradient ``grad`` [B, S, D]
        (the body of the fused backward, which :meth:`apply_gradient` runs too; float32, or
        16 bits after a 16-bit :meth:`pool_rows`); ``batch.prepared`` was made for training."""

    def _optimizer_states(self, held: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {name: held[name] for name, _ in OPTIMIZER_STATES[self.layout.optimizer]}

    def _state(self, held: Mapping[str, Tensor]) -> PackState:
        seed = None if self.rounding is None else self.rounding.next_seed
        weight = held["weight"]
        return PackState(
            self.layout.optimizer,
            weight,
            self._optimizer_states(held),
            self.step,
            seed,
            self._lr_on(weight.device),
        )

    def _lr_on(self, device: torch.device) -> Tensor:
        """The learning rate as a float32 [1] tensor on ``device``, made by a fill (no copy
        from the host) on first use there and after each change of rate; with
        :attr:`rates_in_place` it is made once and refilled (:meth:`set_learning_rate`)."""
        lr = self._lr_scalar
        if lr is None or lr.device != device:
            lr = self._lr_scalar = torch.full((1,), self.optim.lr, dtype=torch.float32, device=device)
        return lr

    def table_tensors(self, held: Mapping[str, Tensor]) -> list[dict[str, Tensor]]:
        tensors = {"weight": held["weight"].detach(), **self._optimizer_states(held)}
        return table_views(self.layout, tensors, self.step)

    def set_learning_rate(self, lr: float) -> None:
        self.optim = dataclasses.replace(self.optim, lr=lr)
        if self._lr_scalar is None:
            return
        if self.rates_in_place:  # on the current stream, before the step whose replay reads it
            self._lr_scalar.fill_(lr)
        else:  # a lookup made before the change (semi_sync's) keeps its rate for its update
            self._lr_scalar = None
