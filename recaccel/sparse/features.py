"""SparseFeatures: the sparse ids of B rows in field-major CSR (TorchRec's KJT layout),
with its row operations: slicing rows, stacking two batches' rows, reordering fields.

Shapes: B batch, F sparse fields, N total ids in the batch.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field

import torch
from torch import Tensor

from recaccel.errors import DataError
from recaccel.sparse.csr import check_rows, runs_index


@dataclass
class SparseFeatures:
    """Field-major CSR of sparse ids, the layout of TorchRec's KeyedJaggedTensor.

    Bag ``(f, b)`` (field f, row b) holds ``values[offsets[f*B+b] : offsets[f*B+b+1]]``:
    all the bags of the first field, row by row, then those of the second, and so on.

    Attributes:
        keys: F field names.
        values: integer [N] ids: int64, or int32 when every table's ids fit (widened by ``.long()``).
        offsets: int64 [F*B+1], starting at 0 and non-decreasing. Given as None, every
            bag holds exactly one id (one-hot: N = F*B) and the offsets are implicit:
            ``arange(F*B+1)`` is made on the values' device the first time it is read,
            and :meth:`to` / :meth:`pin_memory` move no offsets (see :attr:`one_hot`).
        weights: optional float32 [N] per-id weights.

    Example::

        2 fields, 3 rows (F = 2, B = 3); a bag may be empty:

                      row 0      row 1      row 2
            "user"    [10, 11]   []         [12]
            "item"    [20]       [21, 22]   [23]

            keys    = ["user", "item"]
            values  = [10, 11, 12,  20, 21, 22, 23]     # N = 7, "user" ids then "item" ids
            lengths = [ 2,  0,  1,   1,  2,  1]         # F*B bags, bag (f, b) at f*B + b
            offsets = [0, 2, 2, 3,  4, 6, 7]            # F*B + 1: bag (f, b) is
                                                        # values[offsets[f*B+b] : offsets[f*B+b+1]]
            weights = None, or one float per id (N)

        >>> sf = SparseFeatures.from_lengths(
        ...     ["user", "item"],
        ...     torch.tensor([10, 11, 12, 20, 21, 22, 23]),
        ...     torch.tensor([2, 0, 1, 1, 2, 1]),
        ... )
        >>> sf.offsets.tolist(), sf.batch_size
        ([0, 2, 2, 3, 4, 6, 7], 3)
        >>> sf.field("item")[0].tolist()  # one field's ids, and its offsets from 0
        [20, 21, 22, 23]
        >>> part = sf.slice_rows(1, 3)  # rows 1 and 2 of every field
        >>> part.values.tolist(), part.offsets.tolist()
        ([12, 21, 22, 23], [0, 0, 1, 3, 4])
        >>> sf.select(["item"]).values.tolist()  # fields by name
        [20, 21, 22, 23]
    """

    keys: list[str]
    values: Tensor
    offsets: InitVar[Tensor | None]  # read through the property below
    weights: Tensor | None = None
    # The stored offsets, None when implicit: a dataclass field, so code that rebuilds the
    # object from its fields (the reader workers' shared memory) keeps it one-hot.
    _offsets: Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self, offsets: Tensor | None) -> None:
        self._offsets = offsets
        if offsets is None:
            self._check_one_hot()
        elif offsets.dim() != 1 or offsets.numel() < 1:
            raise ValueError(
                f"offsets must be 1-D with at least one element, got shape {tuple(offsets.shape)}"
            )
        elif self.keys and (offsets.numel() - 1) % len(self.keys) != 0:
            raise ValueError(
                f"offsets has {offsets.numel()} elements, not F*B+1 for F={len(self.keys)} fields"
            )
        if self.weights is not None and self.weights.shape != self.values.shape:
            raise ValueError(
                f"weights shape {tuple(self.weights.shape)} != values shape {tuple(self.values.shape)}"
            )

    def _check_one_hot(self) -> None:
        if not self.keys:
            raise ValueError("implicit (None) offsets need at least one field")
        if self.values.dim() != 1 or self.values.numel() % len(self.keys) != 0:
            raise ValueError(
                f"implicit (None) offsets need one id per bag: values of shape {tuple(self.values.shape)} "
                f"is not F*B for F={len(self.keys)} fields"
            )

    def _get_offsets(self) -> Tensor:
        if self._offsets is not None:
            return self._offsets
        made = self.__dict__.get("_made")  # not a field: never stored or sent
        if made is None:  # made once, where the values are: nothing to copy there
            made = torch.arange(self.values.numel() + 1, dtype=torch.int64, device=self.values.device)
            self.__dict__["_made"] = made
        return made

    def _set_offsets(self, offsets: Tensor | None) -> None:
        self._offsets = offsets
        self.__dict__.pop("_made", None)
        self.__dict__.pop("_field_counts", None)

    @property
    def known_field_counts(self) -> tuple[int, ...] | None:
        """Each field's number of ids [F], when the host knows them without reading the
        ids' device: a one-hot batch (B each), or a batch whose counts came with it from
        host memory (:meth:`count_fields_on_host`, :meth:`remember_field_counts`: the
        device loader and :meth:`to` bring them); else None.

        A lookup that splits a batch's ids among several packs sizes each pack from
        them instead of reading the device (a host synchronization per step).
        """
        if self._offsets is None:
            return (self.batch_size,) * self.num_fields
        return self.__dict__.get("_field_counts")  # not a field: never stored or sent

    def remember_field_counts(self, counts: tuple[int, ...] | None) -> SparseFeatures:
        """Records ``counts`` (each field's number of ids, computed where the offsets were
        in host memory) as :attr:`known_field_counts`; returns this batch. None records nothing.

        Raises:
            ValueError: ``counts`` does not hold F non-negative counts summing to N.
        """
        if counts is None or self._offsets is None:
            return self
        counts = tuple(int(c) for c in counts)
        if len(counts) != self.num_fields or min(counts, default=0) < 0 or sum(counts) != self.values.numel():
            raise ValueError(
                f"field counts {counts} do not fit a batch of {self.num_fields} fields and "
                f"{self.values.numel()} ids"
            )
        self.__dict__["_field_counts"] = counts
        return self

    def with_tensors(
        self, values: Tensor, offsets: Tensor | None, weights: Tensor | None, cls: type | None = None, **extra
    ) -> SparseFeatures:
        """The same fields and bags in other tensors (another dtype, made offsets, the deferred
        check's copy of valid offsets): a new batch (a ``cls`` with ``extra`` fields: a preparation)
        keeping :attr:`known_field_counts`; a one-hot batch stays one-hot, ``offsets`` its CSR."""
        made = (cls or SparseFeatures)(self.keys, values, None if self.one_hot else offsets, weights, **extra)
        if offsets is not None and self.one_hot:
            made.__dict__["_made"] = offsets
        if offsets is not None and self.known_field_counts is not None:
            made.__dict__["_field_counts"] = self.known_field_counts  # same bags: counted once
        return made

    def count_fields_on_host(self) -> tuple[int, ...] | None:
        """Each field's number of ids, counted from offsets in host memory (CPU; one pass,
        on the loader's thread), or None when the offsets are elsewhere or malformed (not
        a valid CSR: a lookup's bounds check then reports them)."""
        known = self.known_field_counts
        if known is not None:
            return known
        offsets, n = self._offsets, self.values.numel()
        if offsets.device.type != "cpu" or not self.keys:
            return None
        if int(offsets[0]) != 0 or int(offsets[-1]) != n or not bool((offsets[1:] >= offsets[:-1]).all()):
            return None
        b = self.batch_size
        bounds = offsets[::b] if b > 0 else torch.zeros(self.num_fields + 1, dtype=offsets.dtype)
        return tuple(bounds.diff().tolist())

    @property
    def one_hot(self) -> bool:
        """Whether the offsets are implicit (every bag holds one id; built without offsets).

        Stays True once :attr:`offsets` has been materialised, so packing and moving the
        batch still skip them.
        """
        return self._offsets is None

    @property
    def num_fields(self) -> int:
        return len(self.keys)

    @property
    def batch_size(self) -> int:
        if self._offsets is None:
            return self.values.numel() // len(self.keys)
        return (self._offsets.numel() - 1) // max(len(self.keys), 1)

    def lengths(self) -> Tensor:
        """int64 [F*B] bag lengths."""
        if self._offsets is None:
            return torch.ones(self.values.numel(), dtype=torch.int64, device=self.values.device)
        return self.offsets[1:] - self.offsets[:-1]

    def field(self, name: str) -> tuple[Tensor, Tensor, Tensor | None]:
        """Ids of one field as (values [n], offsets [B+1] starting at 0, weights [n] or None)."""
        f = self.keys.index(name)
        b = self.batch_size
        if self._offsets is None:
            w = None if self.weights is None else self.weights[f * b : (f + 1) * b]
            off = torch.arange(b + 1, dtype=torch.int64, device=self.values.device)
            return self.values[f * b : (f + 1) * b], off, w
        off = self.offsets[f * b : (f + 1) * b + 1]
        start, end = int(off[0]), int(off[-1])
        w = None if self.weights is None else self.weights[start:end]
        return self.values[start:end], off - start, w

    def select(self, names: list[str] | tuple[str, ...]) -> SparseFeatures:
        """The fields ``names``, in that order (a subset of :attr:`keys`, or all of them reordered).

        Returns ``self`` (no copy) when ``names`` equals :attr:`keys`. Otherwise one
        gather builds the new CSR; a reordering of every field needs no host sync. A
        one-hot batch stays one-hot (implicit offsets).

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
        if self._offsets is None:  # each field's ids are one run of B: a row gather of the [F, B] view
            return self._one_hot_rows(list(src), 0, b)
        device = self.offsets.device
        offsets = self.offsets.long()
        pick = torch.tensor(src, dtype=torch.int64, device=device)
        starts = offsets[torch.arange(f + 1, device=device) * b]  # [F+1]: where each field's ids begin
        first = starts[:-1].index_select(0, pick)
        counts = starts.diff().index_select(0, pick)
        # All fields reordered, or their counts known: no host sync for the id count.
        known = self.known_field_counts
        moved = None if known is None else tuple(known[i] for i in src)
        if moved is not None:
            n = sum(moved)
        else:
            n = self.values.numel() if len(src) == f else int(counts.sum())
        index = runs_index(first, counts, n)
        lengths = self.lengths().long().view(f, b).index_select(0, pick).reshape(-1)
        weights = None if self.weights is None else self.weights[index]
        picked = SparseFeatures.from_lengths(
            [self.keys[i] for i in src], self.values[index], lengths, weights
        )
        return picked.remember_field_counts(moved)

    def slice_rows(self, lo: int, hi: int) -> SparseFeatures:
        """Rows ``[lo, hi)`` of every field (a rank's part of a global batch).

        One gather (each field's ids of those rows are one contiguous run); one host
        sync for the id count.

        Args:
            lo: first row, ``0 <= lo <= hi``.
            hi: one past the last row, ``hi <= B``.

        Returns:
            The same F fields of ``hi - lo`` rows, bags unchanged; int64 offsets, or
            implicit ones (no host sync) when this batch is one-hot.

        Raises:
            ValueError: the rows are not within ``[0, B]``.
        """
        f, b = self.num_fields, self.batch_size
        check_rows(lo, hi, b, "rows")
        if self._offsets is None:
            return self._one_hot_rows(list(range(f)), lo, hi)
        device = self.offsets.device
        rows = torch.arange(f, device=device) * b
        starts, ends = self.offsets[rows + lo], self.offsets[rows + hi]
        counts = ends - starts
        index = runs_index(starts, counts, int(counts.sum()))
        lengths = self.lengths().view(f, b)[:, lo:hi].reshape(-1)
        weights = None if self.weights is None else self.weights[index]
        return SparseFeatures.from_lengths(list(self.keys), self.values[index], lengths, weights)

    def concat_rows(self, other: SparseFeatures) -> SparseFeatures:
        """The rows of this batch, then the rows of ``other``: one CSR for one lookup.

        Fully vectorised (no loop over fields, no host synchronisation): every id of
        field f moves by the number of ids of the other batch that now precede it.

        Args:
            other: the same F fields (matched by name, in any order) of B2 rows.

        Returns:
            F fields of B + B2 rows, in this batch's field order. ``weights`` is None
            when neither batch has weights; when only one has, the other's ids get
            weight 1.

        Raises:
            DataError: the two batches do not hold the same fields.
            ValueError: the tensors are on different devices.
        """
        first, second = self, other.reorder(self.keys)
        if first.values.device != second.values.device:
            raise ValueError(
                f"batches are on different devices: {first.values.device} vs {second.values.device}"
            )
        num_fields = first.num_fields
        if first.one_hot and second.one_hot and num_fields:
            return _concat_one_hot(first, second)
        device = first.offsets.device
        if num_fields == 0:
            return SparseFeatures([], first.values[:0], torch.zeros(1, dtype=torch.int64, device=device))
        rows_a, rows_b = first.batch_size, second.batch_size
        lengths = torch.cat(
            [first.lengths().view(num_fields, rows_a), second.lengths().view(num_fields, rows_b)], dim=1
        ).reshape(-1)
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=device)
        torch.cumsum(lengths, 0, out=offsets[1:])

        # Start of each field's ids in each input and in the output: [F + 1].
        field_bounds = torch.arange(num_fields + 1, device=device)
        start_a = first.offsets[field_bounds * rows_a]
        start_b = second.offsets[field_bounds * rows_b]
        count_a, count_b = start_a.diff(), start_b.diff()
        start_out = start_a[:-1] + start_b[:-1]
        n_a, n_b = first.values.numel(), second.values.numel()
        pos_a = runs_index(start_out, count_a, n_a, start_a[:-1])
        pos_b = runs_index(start_out + count_a, count_b, n_b, start_b[:-1])

        values = first.values.new_empty(n_a + n_b)
        values[pos_a] = first.values
        values[pos_b] = second.values.to(values.dtype)
        weights = None
        if first.weights is not None or second.weights is not None:
            w_a = first.weights if first.weights is not None else torch.ones(n_a, device=device)
            w_b = second.weights if second.weights is not None else torch.ones(n_b, device=device)
            weights = w_a.new_empty(n_a + n_b)
            weights[pos_a] = w_a
            weights[pos_b] = w_b.to(weights.dtype)
        return SparseFeatures(list(first.keys), values, offsets, weights)

    def _one_hot_rows(self, fields: list[int], lo: int, hi: int) -> SparseFeatures:
        """Fields ``fields`` (indices), rows ``[lo, hi)`` of a one-hot batch, still one-hot."""
        f, b = self.num_fields, self.batch_size
        pick = slice(None) if fields == list(range(f)) else torch.tensor(fields, device=self.values.device)
        take = lambda t: t.reshape(f, b)[pick, lo:hi].reshape(-1)  # noqa: E731
        weights = None if self.weights is None else take(self.weights)
        return SparseFeatures([self.keys[i] for i in fields], take(self.values), None, weights)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SparseFeatures:
        """This batch on ``device``; implicit offsets stay implicit (nothing copied for them)."""
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        moved = SparseFeatures(self.keys, move(self.values), move(self.explicit_offsets), move(self.weights))
        leaving_host = self.values.device.type == "cpu" and torch.device(device).type != "cpu"
        counts = self.count_fields_on_host() if leaving_host else self.known_field_counts
        return moved.remember_field_counts(counts)

    def pin_memory(self) -> SparseFeatures:
        """This batch in pinned memory; implicit offsets stay implicit."""
        pin = lambda t: None if t is None else t.pin_memory()  # noqa: E731
        return SparseFeatures(self.keys, pin(self.values), pin(self.explicit_offsets), pin(self.weights))

    @property
    def explicit_offsets(self) -> Tensor | None:
        """The offsets to store or copy: None when they are implicit (:attr:`one_hot`)."""
        return self._offsets

    @classmethod
    def from_lengths(
        cls, keys: list[str], values: Tensor, lengths: Tensor, weights: Tensor | None = None
    ) -> SparseFeatures:
        """Builds from bag lengths int64 [F*B] instead of offsets."""
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
        torch.cumsum(lengths, 0, out=offsets[1:])
        return cls(keys, values, offsets, weights)

    def to_kjt(self):
        """Converts to a TorchRec KeyedJaggedTensor sharing this object's tensors (no copy
        of int64 ids; int32 ids are widened to the offsets' int64).

        Raises:
            ImportError: if torchrec is not installed.
        """
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        # TorchRec's kernels want ids and offsets of one dtype: int32 ids are widened.
        return KeyedJaggedTensor(
            keys=list(self.keys),
            values=self.values.to(self.offsets.dtype),
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


# The dataclass's __init__ assigns ``offsets`` through this property: None stays implicit.
SparseFeatures.offsets = property(  # type: ignore[assignment]
    SparseFeatures._get_offsets, SparseFeatures._set_offsets, doc="int64 [F*B+1] (made when implicit)."
)


def _concat_one_hot(first: SparseFeatures, second: SparseFeatures) -> SparseFeatures:
    """Rows of ``first`` then ``second`` (same fields, same order, both one-hot), one-hot."""
    f = first.num_fields
    dtype = torch.promote_types(first.values.dtype, second.values.dtype)
    join = lambda a, b: torch.cat([a.reshape(f, -1), b.to(a.dtype).reshape(f, -1)], dim=1).reshape(-1)  # noqa: E731
    values = join(first.values.to(dtype), second.values)
    weights = None
    if first.weights is not None or second.weights is not None:
        w_a = (
            first.weights if first.weights is not None else torch.ones_like(first.values, dtype=torch.float32)
        )
        w_b = (
            second.weights
            if second.weights is not None
            else torch.ones_like(second.values, dtype=torch.float32)
        )
        weights = join(w_a, w_b)
    return SparseFeatures(list(first.keys), values, None, weights)


def _names(fields: list[str]) -> str:
    """``'a'`` or ``'a', 'b'``: field names for an error message."""
    return ", ".join(repr(f) for f in fields)
