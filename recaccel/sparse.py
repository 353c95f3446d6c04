"""Batch types: the unit of data between the reader, the loader and the model.

Shapes: B batch, F sparse fields, Dd dense features, N total ids in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from recaccel.errors import DataError


@dataclass
class SparseFeatures:
    """Field-major CSR of sparse ids, the layout of TorchRec's KeyedJaggedTensor.

    Bag ``(f, b)`` (field f, row b) holds ``values[offsets[f*B+b] : offsets[f*B+b+1]]``.

    Attributes:
        keys: F field names.
        values: int64 [N] ids.
        offsets: int64 [F*B+1], starting at 0 and non-decreasing.
        weights: optional float32 [N] per-id weights.
    """

    keys: list[str]
    values: Tensor
    offsets: Tensor
    weights: Tensor | None = None

    def __post_init__(self) -> None:
        if self.offsets.dim() != 1 or self.offsets.numel() < 1:
            raise ValueError(
                f"offsets must be 1-D with at least one element, got shape {tuple(self.offsets.shape)}"
            )
        if self.keys and (self.offsets.numel() - 1) % len(self.keys) != 0:
            raise ValueError(
                f"offsets has {self.offsets.numel()} elements, not F*B+1 for F={len(self.keys)} fields"
            )
        if self.weights is not None and self.weights.shape != self.values.shape:
            raise ValueError(
                f"weights shape {tuple(self.weights.shape)} != values shape {tuple(self.values.shape)}"
            )

    @property
    def num_fields(self) -> int:
        return len(self.keys)

    @property
    def batch_size(self) -> int:
        return (self.offsets.numel() - 1) // max(len(self.keys), 1)

    def lengths(self) -> Tensor:
        """int64 [F*B] bag lengths."""
        return self.offsets[1:] - self.offsets[:-1]

    def field(self, name: str) -> tuple[Tensor, Tensor, Tensor | None]:
        """Ids of one field as (values [n], offsets [B+1] starting at 0, weights [n] or None)."""
        f = self.keys.index(name)
        b = self.batch_size
        off = self.offsets[f * b : (f + 1) * b + 1]
        start, end = int(off[0]), int(off[-1])
        w = None if self.weights is None else self.weights[start:end]
        return self.values[start:end], off - start, w

    def select(self, names: list[str] | tuple[str, ...]) -> SparseFeatures:
        """The fields ``names``, in that order (a subset of :attr:`keys`, or all of them reordered).

        Returns ``self`` (no copy) when ``names`` equals :attr:`keys`. Otherwise one
        gather builds the new CSR; a reordering of every field needs no host sync.

        Args:
            names: distinct field names of this batch.

        Returns:
            ``len(names)`` fields of the same B rows, bags unchanged; int64 offsets.

        Raises:
            DataError: a name is not a field of the batch, or repeats.
        """
        names = list(names)
        if names == self.keys:
            return self
        index = {k: i for i, k in enumerate(self.keys)}
        unknown = [n for n in names if n not in index]
        if unknown:
            raise DataError(f"the batch has no sparse field {_names(unknown)}; it has {self.keys}")
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise DataError(f"sparse field {_names(repeated)} asked for more than once in {names}")
        return self._gather_fields([index[n] for n in names])

    def reorder(self, names: list[str] | tuple[str, ...]) -> SparseFeatures:
        """This batch with its fields in the order ``names``: how a batch meets a model by name.

        ``names`` is the model's field order; the batch must hold exactly those fields
        (in any order). Returns ``self`` (no copy) when the order already matches.

        Raises:
            DataError: the batch lacks fields of ``names``, has fields outside them, or
                repeats a field (one line naming each).
        """
        names = list(names)
        if names == self.keys:
            return self
        self.check_keys(names)
        index = {k: i for i, k in enumerate(self.keys)}
        return self._gather_fields([index[n] for n in names])

    def check_keys(self, names: list[str] | tuple[str, ...]) -> None:
        """Checks that the batch holds exactly the fields ``names``, in any order.

        Raises:
            DataError: fields missing from the batch, fields outside ``names``, or a
                repeated field (one line naming each).
        """
        names = list(names)
        if names == self.keys:
            return
        have, want = set(self.keys), set(names)
        missing = [n for n in names if n not in have]
        unknown = [k for k in self.keys if k not in want]
        repeated = sorted({k for k in self.keys if self.keys.count(k) > 1})
        if missing or unknown or repeated:
            problems = [
                f"{what} {_names(fields)}"
                for what, fields in (("missing", missing), ("unknown", unknown), ("repeated", repeated))
                if fields
            ]
            raise DataError(
                f"the batch's sparse fields do not match the model's: {', '.join(problems)} "
                f"(model fields {names}, batch fields {self.keys})"
            )

    def _gather_fields(self, src: list[int]) -> SparseFeatures:
        """Fields ``src`` (indices into :attr:`keys`, distinct) as a new field-major CSR."""
        f, b = self.num_fields, self.batch_size
        device = self.offsets.device
        offsets = self.offsets.long()
        pick = torch.tensor(src, dtype=torch.int64, device=device)
        starts = offsets[torch.arange(f + 1, device=device) * b]  # [F+1]: where each field's ids begin
        first = starts[:-1].index_select(0, pick)
        counts = starts.diff().index_select(0, pick)
        # All fields reordered: the id count is known, so no host sync.
        n = self.values.numel() if len(src) == f else int(counts.sum())
        field_of = torch.repeat_interleave(torch.arange(len(src), device=device), counts, output_size=n)
        run_start = torch.cumsum(counts, 0) - counts
        index = torch.arange(n, device=device) + (first - run_start)[field_of]
        lengths = self.lengths().long().view(f, b).index_select(0, pick).reshape(-1)
        weights = None if self.weights is None else self.weights[index]
        return SparseFeatures.from_lengths([self.keys[i] for i in src], self.values[index], lengths, weights)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SparseFeatures:
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return SparseFeatures(self.keys, move(self.values), move(self.offsets), move(self.weights))

    def pin_memory(self) -> SparseFeatures:
        pin = lambda t: None if t is None else t.pin_memory()  # noqa: E731
        return SparseFeatures(self.keys, pin(self.values), pin(self.offsets), pin(self.weights))

    @classmethod
    def from_lengths(
        cls, keys: list[str], values: Tensor, lengths: Tensor, weights: Tensor | None = None
    ) -> SparseFeatures:
        """Builds from bag lengths int64 [F*B] instead of offsets."""
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
        torch.cumsum(lengths, 0, out=offsets[1:])
        return cls(keys, values, offsets, weights)

    def to_kjt(self):
        """Converts to a TorchRec KeyedJaggedTensor sharing this object's tensors (no copy).

        Raises:
            ImportError: if torchrec is not installed.
        """
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        return KeyedJaggedTensor(
            keys=list(self.keys),
            values=self.values,
            weights=self.weights,
            offsets=self.offsets,
            stride=self.batch_size,
        )

    @classmethod
    def from_kjt(cls, kjt) -> SparseFeatures:
        """Converts from a TorchRec KeyedJaggedTensor, sharing its tensors when they are int64.

        int32 ids, lengths or offsets (TorchRec allows them) are widened to the int64
        this layout documents.

        Raises:
            DataError: a variable-batch KJT (TorchRec's VBE, built with
                ``stride_per_key_per_rank``): its keys may have different batch sizes and
                its rows map to the batch through inverse indices, while field-major CSR
                has one batch size B for every field.
        """
        keys = list(kjt.keys())
        if kjt.variable_stride_per_key():
            strides = dict(zip(keys, kjt.stride_per_key()))
            raise DataError(
                f"a variable-batch (VBE) KeyedJaggedTensor (batch size per key {strides}) has no "
                "field-major CSR form: expand it to one batch size for every key first"
            )
        return cls(keys, kjt.values().long(), kjt.offsets().long(), kjt.weights_or_none())


def _names(fields: list[str]) -> str:
    """``'a'`` or ``'a', 'b'``: field names for an error message."""
    return ", ".join(repr(f) for f in fields)


@dataclass
class Batch:
    """One mini-batch.

    Attributes:
        dense: float32 [B, Dd].
        sparse: the B rows' sparse ids.
        labels: float32 [B].
        weights: optional float32 [B] sample weights (also used as a row mask).
    """

    dense: Tensor
    sparse: SparseFeatures
    labels: Tensor
    weights: Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.labels.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
            None if self.weights is None else self.weights.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> Batch:
        return Batch(
            self.dense.pin_memory(),
            self.sparse.pin_memory(),
            self.labels.pin_memory(),
            None if self.weights is None else self.weights.pin_memory(),
        )


@dataclass
class TaskBatch:
    """T tasks for meta-learning, each with S support and Q query rows.

    Rows are task-major: task t owns support rows ``t*S .. (t+1)*S - 1`` and query rows
    ``t*Q .. (t+1)*Q - 1``. Tasks with fewer rows are padded; the masks mark real rows,
    so every task has the same shape and the meta step can vmap over tasks.

    Attributes:
        support: Batch of T*S rows.
        query: Batch of T*Q rows.
        support_mask: float32 [T, S], 1 for a real row, 0 for padding.
        query_mask: float32 [T, Q].
        task_ids: int64 [T] task keys.
    """

    support: Batch
    query: Batch
    support_mask: Tensor
    query_mask: Tensor
    task_ids: Tensor

    @property
    def num_tasks(self) -> int:
        return self.task_ids.shape[0]

    @property
    def support_size(self) -> int:
        return self.support_mask.shape[1]

    @property
    def query_size(self) -> int:
        return self.query_mask.shape[1]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TaskBatch:
        return TaskBatch(
            self.support.to(device, non_blocking),
            self.query.to(device, non_blocking),
            self.support_mask.to(device, non_blocking=non_blocking),
            self.query_mask.to(device, non_blocking=non_blocking),
            self.task_ids.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> TaskBatch:
        return TaskBatch(
            self.support.pin_memory(),
            self.query.pin_memory(),
            self.support_mask.pin_memory(),
            self.query_mask.pin_memory(),
            self.task_ids.pin_memory(),
        )
