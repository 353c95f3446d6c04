"""PackedEmbeddingBag: every table of a model in a few packed buffers, one lookup per pack.

The module routes a batch's features to their packs and holds the packs' tensors; each
pack's lookups, updates and state belong to its backend object (chosen once at
construction: :mod:`~recaccel.ops.embedding.backends`). A lookup is two phases:
:meth:`PackedEmbeddingBag.prepare` (validation, routing, the bounds check, the packs' ids
and the backward's sort: :mod:`~recaccel.ops.embedding.preparation`) and the kernels. A
pipeline prepares the next batch ahead on a side stream (:class:`PreparedSparse`);
micro-batches look up slices of a prepared batch and apply its sparse update once
(:mod:`~recaccel.ops.embedding.micro_batches`).

Shapes: B batch, F features of a batch, F_p of them in pack p, D dim, R rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor, nn

from recaccel.errors import ConfigError
from recaccel.ops.embedding.backends import build_packs, choose_backend, pack_backend_class
from recaccel.ops.embedding.cache.counters import merge_stats
from recaccel.ops.embedding.cache.host_store import check_host_memory
from recaccel.ops.embedding.cache.options import check_host_placement
from recaccel.ops.embedding.cache.pack import CachedPack
from recaccel.ops.embedding.capture import CapturedUpdates
from recaccel.ops.embedding.deferred_check import PendingChecks
from recaccel.ops.embedding.init_weights import init_table_weights, rounding_seed
from recaccel.ops.embedding.lookup_out import as_out_dtype, into_out, pack_lookup, pack_outs
from recaccel.ops.embedding.micro_batches import apply_pack_gradients, lookup_pack_rows
from recaccel.ops.embedding.options import EmbeddingOptions
from recaccel.ops.embedding.pack_backend import PackBackend, PackOptions
from recaccel.ops.embedding.packing import PackingPlan, Routing, check_one_dim
from recaccel.ops.embedding.preparation import as_kernel_input, check_id_dtype, prepare_packs
from recaccel.ops.embedding.prepared import PreparedSparse
from recaccel.ops.embedding.rounding import StochasticRounding, torch_dtype
from recaccel.ops.embedding.specs import TableSpec
from recaccel.ops.embedding.state import ROUNDING_KEY, load_rounding, load_tables, save_tables
from recaccel.sparse import SparseFeatures

_OP = "PackedEmbeddingBag"
_MAX_CACHED_ROUTES = 16


class PackedEmbeddingBag(CapturedUpdates, nn.Module):
    """Pooled embedding lookups of many tables, packed by (dim, optimizer).

    Semantics (every backend): feature ``f`` of a batch looks up its table; bag ``(f, b)``
    pools ``sum_i w_i * row(id_i)`` over its ids (``w_i`` = the per-id weight, 1 when
    ``sf.weights`` is None). Mean pooling divides that sum by the bag's number of ids
    ``L`` (not by the sum of the weights), as ``nn.EmbeddingBag(mode="mean")`` does; an
    empty bag pools to zeros. Per-id weights are constants (no gradient flows to them).

    Example::

        Tables of one dim and optimizer share a packed buffer; a batch's features are
        looked up with one lookup per pack:

            tables (TableSpec)           packs
              user   [100, 4] --+
              item   [ 50, 4] --+---->  pack 0 [150, 4]  rows 0..99 user, 100..149 item
              genre  [ 20, 8] -------->  pack 1 [ 20, 8]

            batch (SparseFeatures)  row 0    row 1
              "item"                [3, 7]   []      --> pack 0, ids + 100 --+
              "user"                [42]     [5]     --> pack 0, ids + 0   --+--> [B, F, D] = [2, 2, 4]
                                                       out[b, f] = the pooled rows of bag (f, b)

        >>> tables = [TableSpec("user", 100, 4), TableSpec("item", 50, 4), TableSpec("genre", 20, 8)]
        >>> emb = PackedEmbeddingBag(tables, backend="reference", seed=0)
        >>> [(p.num_rows, p.dim) for p in emb.plan.packs]
        [(150, 4), (20, 8)]
        >>> sf = SparseFeatures.from_lengths(
        ...     ["item", "user"], torch.tensor([3, 7, 42, 5]), torch.tensor([2, 0, 1, 1])
        ... )
        >>> emb(sf).shape  # [B, F, D], features in sf.keys order
        torch.Size([2, 2, 4])
        >>> item = emb.table_state("item")["weight"]  # a view of pack 0's rows 100..149
        >>> torch.equal(emb(sf)[0, 0], item[3] + item[7]), emb(sf)[1, 0].abs().sum().item()
        (True, 0.0)
        >>> mixed = SparseFeatures.from_lengths(
        ...     ["user", "genre"], torch.tensor([1, 2]), torch.tensor([1, 0, 0, 1])
        ... )
        >>> emb.forward_concat(mixed).shape  # mixed dims: [B, 4 + 8]
        torch.Size([2, 12])

    Modes:
        ``"fused"``: packed rows and optimizer state are buffers (``parameters()`` yields
        none of them); in training mode with grad enabled, backward sums each touched
        row's gradient and applies the table's sparse optimizer (see
        :class:`SparseOptimConfig`) in place; no dense [R, D] gradient ever exists. In
        eval mode the lookup builds no graph.
        ``"autograd"``: packed rows are Parameters ``weight_<p>`` [R_p, D_p] and backward
        returns their gradient (dense, or sparse COO with ``sparse_grad=True``); the
        caller applies any optimizer.

    Checkpoints use a backend-independent layout: per table ``<table>.weight`` [R, D],
    and its optimizer state ``<table>.momentum1`` ([R] row-wise Adagrad, [R, D] Adam),
    ``<table>.momentum2`` [R, D] and ``<table>.step`` (Adam). ``torch.load(...,
    weights_only=True)`` reads it, and any backend loads what any backend saved.

    16-bit rows (``dtype="bf16"`` or ``"fp16"``, fused mode): the packed rows are stored
    in that dtype, the optimizer state stays float32, lookups pool in float32 (float32
    output), and each update computes in float32 and writes the rows back with
    stochastic rounding (:mod:`~recaccel.ops.embedding.rounding`), seeded from a CPU
    generator the module owns (seeded by ``seed``, else drawn from ``generator`` or
    torch's global generator after the initial rows). Checkpoints hold the rows in their
    dtype and the generator's state under ``rounding_generator``, so a resumed run
    repeats the uninterrupted one; loading rows of another dtype is an error (the
    module does not cast silently: build it with the checkpoint's dtype).

    Args:
        tables: The tables.
        options: The module's settings (:class:`EmbeddingOptions`: backend, mode, sparse
            optimizer, bounds check, sparse gradients, row dtype, cache); default
            ``EmbeddingOptions()``. ``bounds_check``: ``True`` (or ``"eager"``) checks in
            :meth:`prepare`, one vectorized check and host sync per batch, and raises
            before any kernel runs; ``"deferred"`` (Triton and reference backends,
            device-placed tables; elsewhere it is ``True``) checks without a host sync,
            in the Triton lookup kernels or the reference's preparation, an out-of-range
            id reading row 0 of its table: see :meth:`check_ids` for when the error is
            raised. ``"auto"``: deferred on the Triton backend, else ``True`` (what
            recaccel's models use). ``False`` does not check, except on the reference
            backend, which always checks one way or the other. The fbgemm backend's tables
            stay on ``device`` (``.to()`` does not move them): build it on its final device.
        device: Where the rows live.
        seed: Seed of the initial rows.
        generator: A CPU generator for the initial rows (instead of ``seed``).
        **settings: Fields of :class:`EmbeddingOptions` by keyword (``backend="reference"``,
            ``mode="autograd"``, ...), replacing those of ``options``: a shorthand.

    Ids: int32 or int64 ids and offsets are read as given (int32 stays int32 through the
    preparation to every kernel that reads it: the reference's ``embedding_bag``, the
    Triton kernels, FBGEMM's TBE); any other integer dtype is widened to int64.

    Host placement: a pack of host-placed tables keeps its rows and optimizer state in
    host memory (pinned on CUDA) behind a device cache (see
    :mod:`recaccel.ops.embedding.cache`); it trains to the same parameters as on the
    device, and checkpoints hold the same whole tables. It needs fused mode, float32 rows
    and the reference or Triton backend; :meth:`cache_stats` reports the cache's traffic.

    Raises:
        ConfigError: inconsistent tables or options; a 16-bit dtype in autograd mode, or
            on a backend that cannot update it (fbgemm on CPU); host-placed tables with
            autograd mode, 16-bit rows or fbgemm, or more host memory than is available.
    """

    def __init__(
        self,
        tables: list[TableSpec],
        options: EmbeddingOptions | None = None,
        *,
        device: torch.device | str | None = None,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        **settings: Any,
    ) -> None:
        super().__init__()
        tables = list(tables)
        for t in tables:
            if not isinstance(t, TableSpec):
                raise ConfigError(f"{_OP}: tables must be TableSpec instances, got {type(t).__name__}")
        options = options if options is not None else EmbeddingOptions()
        if settings:
            options = dataclasses.replace(options, **settings)
        self.options = options
        mode, dtype = options.mode, options.dtype
        device = torch.device(device if device is not None else "cpu")
        self.tables = tuple(tables)
        self.plan = PackingPlan(tables)
        self.mode = mode
        self.optim = options.optim
        self.bounds_check = options.bounds_check
        self.sparse_grad = options.sparse_grad
        self.dtype = dtype
        self.backend = choose_backend(options.backend, device, tables, mode, self.optim, dtype)
        host_packs = [layout for layout in self.plan.packs if layout.placement == "host"]
        if host_packs:
            check_host_placement(host_packs, self.backend, mode, dtype)
            check_host_memory(host_packs)
        self.cache_options = options.cache
        pack_class = pack_backend_class(self.backend)
        init = init_table_weights(tables, seed, generator)
        self.rounding = None if dtype == "fp32" else StochasticRounding(rounding_seed(seed, generator))
        self._packs: list[PackBackend] = []
        self._held_names: list[tuple[str, ...]] = []  # per pack: what this module holds for it
        pack_options = PackOptions(mode, self.optim, self.sparse_grad, torch_dtype(dtype), self.rounding)
        built = build_packs(self.plan, init, pack_options, device, pack_class, self.cache_options)
        for p, (pack, held) in enumerate(built):
            for name, tensor in held.items():
                if isinstance(tensor, nn.Parameter):
                    self.register_parameter(f"{name}_{p}", tensor)
                else:
                    self.register_buffer(f"{name}_{p}", tensor, persistent=False)
            self._packs.append(pack)
            self._held_names.append(tuple(held))
        # The deferred check needs kernels that count (Triton's) or a preparation that does
        # (the reference's), on device-placed packs; "auto" defers with Triton only.
        deferrable = self.backend in ("triton", "reference") and not host_packs
        wanted = self.bounds_check == "deferred" or (self.bounds_check == "auto" and self.backend == "triton")
        self._defer_check = wanted and deferrable
        self._always_check_ids = (pack_class.always_checks_ids and not self._defer_check) or bool(host_packs)
        self._pending_checks = PendingChecks(self.plan)
        self._checks_by_caller = False  # a captured step queues its replays' checks itself
        self._routes: dict[tuple, Routing] = {}

    # ----------------------------------------------------------------- lookups

    def forward(
        self, sf: SparseFeatures, *, out: Tensor | None = None, out_dtype: torch.dtype | None = None
    ) -> Tensor:
        """Pools every feature of a batch.

        Args:
            sf: F features of B rows (any subset of the tables' features, any order); a
                :class:`PreparedSparse` this module prepared is looked up without being
                prepared again (see :meth:`prepare`).
            out: float32, bfloat16 or float16 [B, F, D] to write the result into
                (:mod:`~recaccel.ops.embedding.lookup_out`).
            out_dtype: The result's dtype: bfloat16 or float16 halve its traffic and its
                gradient's (the Triton kernels pool in float32 and write 16 bits, rounding
                to nearest; other backends cast); None for float32.

        Returns:
            [B, F, D] in ``sf.keys`` order, float32 or ``out_dtype``; ``out`` itself when given.

        Raises:
            ValueError: the batch's features have different dims (use
                :meth:`forward_packs` or :meth:`forward_concat`).
            InvalidIdError: an id outside its table, or malformed offsets.
            DataError: an unknown or repeated feature.
            RecaccelError: ``out`` of the wrong shape, dtype or device, or a leaf requiring grad.
        """
        routing, outs = self._lookup(sf, out, out_dtype)
        check_one_dim(routing, "forward")
        return into_out(as_out_dtype(routing.to_batch_order(outs), out_dtype), out)

    def forward_packs(self, sf: SparseFeatures) -> list[Tensor]:
        """Pools a batch pack by pack (mixed dims).

        Returns:
            One float32 [B, F_p, D_p] per pack (F_p may be 0); :meth:`pack_features`
            names the features of each.
        """
        return self._lookup(sf)[1]

    def forward_concat(self, sf: SparseFeatures) -> Tensor:
        """Pools a batch into one row per example: float32 [B, sum_f D_f], features in ``sf.keys`` order."""
        routing, outs = self._lookup(sf)
        flat = torch.cat([o.reshape(o.shape[0], o.shape[1] * o.shape[2]) for o in outs], dim=1)
        return flat if routing.restore_columns is None else flat.index_select(1, routing.restore_columns)

    def pack_features(self, keys: list[str]) -> list[list[str]]:
        """Feature names of each of :meth:`forward_packs`'s outputs for a batch with ``keys``."""
        return [[keys[i] for i in r.features] for r in self.plan.route(keys, torch.device("cpu")).packs]

    def prepare(self, sf: SparseFeatures) -> PreparedSparse:
        """Everything a lookup of ``sf`` does before its kernels, done now.

        Validates the batch, routes its features, checks its ids (one host
        synchronization with the eager check; none with the deferred one), and prepares
        each pack's input: the ids, and in training mode the sort (and unique rows, where
        the backward needs them) of the backward (see :mod:`~recaccel.ops.embedding.prepared`
        for the synchronizations). Run on a side stream
        ahead of the step, the synchronization no longer drains the main stream;
        :meth:`forward` (and the other lookups) of the result then skip all of it and
        give bit for bit what they give for ``sf``. The preparation's memory lives as
        long as the batch and its graph (see :mod:`recaccel.ops.embedding.prepared`).

        The result is tied to this module and its mode at this call: another module, or
        this one in training mode given a batch prepared in eval mode, prepares it again
        (correct, just not ahead of time).

        Args:
            sf: F features of B rows (as for :meth:`forward`).

        Returns:
            The validated batch (int64 ids and offsets, float32 weights) with its preparation.

        Raises:
            InvalidIdError, DataError, ValueError: as :meth:`forward` would for ``sf``.
        """
        return self._prepare(sf, self.training)

    def lookup_rows(
        self, sf: SparseFeatures, lo: int, hi: int, *, out_dtype: torch.dtype | None = None
    ) -> Tensor:
        """Pools rows ``lo .. hi-1`` of a prepared batch, without a graph.

        For micro-batches: each micro-batch's lookup can run on a side stream while the
        previous one's dense work runs; the batch is validated and checked once, by
        :meth:`prepare`. The sparse update is then :meth:`apply_gradient`'s.

        Args:
            sf: The batch, prepared by this module (any other batch is prepared here).
            lo: First row, ``0 <= lo <= hi <= B``.
            hi: One past the last row.
            out_dtype: As :meth:`forward`'s.

        Returns:
            [hi-lo, F, D] in ``sf.keys`` order: rows ``lo:hi`` of ``forward(sf, out_dtype=out_dtype)``.

        Raises:
            ValueError: rows outside the batch, or features of different dims.
        """
        self.raise_landed_checks()
        sf = self._prepared(sf, training=False)
        out = lookup_pack_rows(sf, lo, hi, self._packs, self._held, self.plan, out_dtype)
        self._queue_check(sf)
        return out

    def deferred_update_unsupported(self) -> str | None:
        """Why :meth:`apply_gradient` cannot run on this module, or None when it can
        (fused mode on the reference or Triton backend)."""
        return self._packs[0].deferred_update_unsupported()

    @torch.no_grad()
    def apply_gradient(self, sf: SparseFeatures, grad: Tensor) -> None:
        """Applies the sparse update of a batch for a gradient of its pooled output.

        Exactly what the fused backward of ``forward(sf)`` does with ``grad`` as the
        gradient of its output: the same rows, optimizer state and step, and for 16-bit
        rows the same draws of the rounding seeds. For micro-batches: the dense work
        runs per micro-batch on :meth:`lookup_rows`, and the sparse update once per step
        with the whole batch's math.

        Args:
            sf: The batch, prepared by this module in training mode (any other batch is
                prepared here, for training).
            grad: [B, F, D] gradient of ``forward(sf)``, features in ``sf.keys`` order.

        Raises:
            ConfigError: the module cannot defer its update (:meth:`deferred_update_unsupported`).
            ValueError: ``grad`` of the wrong shape, or features of different dims.
        """
        reason = self.deferred_update_unsupported()
        if reason is not None:
            raise ConfigError(f"{_OP}.apply_gradient: no deferred sparse update with {reason}")
        apply_pack_gradients(self._prepared(sf, training=True), grad, self._packs, self._held)

    def _lookup(
        self, sf: SparseFeatures, out: Tensor | None = None, out_dtype: torch.dtype | None = None
    ) -> tuple[Routing, list[Tensor]]:
        self.raise_landed_checks()
        train = self.training and torch.is_grad_enabled()
        sf = self._prepared(sf, training=train)
        targets = pack_outs(sf, out, self._packs, out_dtype)
        outs = [self._lookup_pack(p, sf, train, o) for p, o in enumerate(targets)]
        self._queue_check(sf)
        return sf.routing, outs

    def _lookup_pack(self, p: int, sf: PreparedSparse, train: bool, out: Tensor | None = None) -> Tensor:
        count, batch_size = sf.routing.packs[p].local.count, sf.batch_size
        if count == 0 or batch_size == 0:
            return torch.zeros(batch_size, count, self.plan.packs[p].dim, device=sf.values.device)
        return pack_lookup(self._packs[p], self._held(p), sf.pack_batch(p, train), out)

    def _prepared(self, sf: SparseFeatures, training: bool) -> PreparedSparse:
        """``sf`` itself when this module prepared it (for training if ``training``), else
        ``sf`` prepared now."""
        if isinstance(sf, PreparedSparse) and sf.usable_by(self, training):
            # The one check that is not the batch's own: the module may have moved since.
            self._packs[0].check_batch_device(self._held(0), sf.values.device)
            return sf
        return self._prepare(sf, training)

    def _prepare(self, sf: SparseFeatures, training: bool) -> PreparedSparse:
        sf = self._validate(sf)
        routing = self._route(sf.keys, sf.values.device)
        check = "eager" if self.bounds_check or self._always_check_ids else "off"
        if self._defer_check:
            check = "deferred"
        return prepare_packs(
            sf, routing, self._packs, plan=self.plan, training=training, check=check, owner=self
        )

    def check_ids(self) -> None:
        """Raises the deferred bounds check's error of any batch looked up so far.

        With ``bounds_check="deferred"`` the lookup kernels count each batch's
        out-of-range ids on the device (an out-of-range id reads row 0 of its feature's
        table, and a training step's update then changes that row; malformed offsets are
        counted by :meth:`prepare`, and the kernels read the batch clamped into a valid
        CSR). At the end of each lookup the count is copied to the host without waiting;
        the error is raised, with the eager check's message (feature, id, batch row,
        ``[0, R)`` and table, or the malformed offsets), by the first of: the module's
        next lookup once that copy has landed (on CUDA normally the next step's, on CPU
        always), :meth:`check_ids`, which waits for it (a training loop calls it at
        each log step, through :func:`check_deferred_ids`), ``eval()`` (no evaluation
        follows an unreported id) or ``state_dict()`` (so no checkpoint holds a step
        that read an out-of-range id). It is raised once. Without the deferred check
        this does nothing.

        Raises:
            InvalidIdError: a batch looked up since the last check had an id outside its
                table or malformed offsets.
        """
        self._pending_checks.raise_bad(wait=True)

    def train(self, mode: bool = True) -> PackedEmbeddingBag:
        """Sets training mode; leaving it checks the deferred bounds check's pending
        batches first (:meth:`check_ids`), so that no evaluation follows an unreported
        out-of-range id."""
        if self.training and not mode:
            self.check_ids()
        return super().train(mode)

    def _held(self, p: int) -> dict[str, Tensor]:
        """This module's tensors of pack ``p``, by name (looked up now: ``.to()`` replaces buffers)."""
        return {name: getattr(self, f"{name}_{p}") for name in self._held_names[p]}

    def _route(self, keys: list[str], device: torch.device) -> Routing:
        key = (tuple(keys), device)
        routing = self._routes.get(key)
        if routing is None:
            if len(self._routes) >= _MAX_CACHED_ROUTES:
                self._routes.clear()
            routing = self._routes[key] = self.plan.route(keys, device, check_in_kernels=self._defer_check)
        return routing

    def _validate(self, sf: SparseFeatures) -> SparseFeatures:
        check_id_dtype(sf)
        self._packs[0].check_batch_device(self._held(0), sf.values.device)
        return as_kernel_input(sf)

    # ------------------------------------------------------- optimizer and state

    def set_learning_rate(self, lr: float) -> None:
        """Changes the sparse optimizer's learning rate (e.g. from a schedule)."""
        self.optim = dataclasses.replace(self.optim, lr=lr)
        self.options = dataclasses.replace(self.options, optim=self.optim)
        for pack in self._packs:
            pack.set_learning_rate(lr)

    def table_state(self, name: str) -> dict[str, Tensor]:
        """Views of one table's rows and optimizer state, by checkpoint name.

        Returns:
            ``{"weight": [R, D], ...}`` plus ``momentum1``/``momentum2``/``step`` as the
            table's optimizer has them; writing into the tensors writes the module's state.

        Raises:
            KeyError: unknown table.
        """
        if name not in {t.name for t in self.tables}:
            raise KeyError(f"no table named {name!r}; tables: {[t.name for t in self.tables]}")
        return self.table_states()[name]

    def table_states(self) -> dict[str, dict[str, Tensor]]:
        """:meth:`table_state` of every table, by table name, in table order."""
        out: dict[str, dict[str, Tensor]] = {}
        for p, layout in enumerate(self.plan.packs):
            for table, tensors in zip(layout.tables, self._packs[p].table_tensors(self._held(p))):
                out[table.name] = tensors
        return {t.name: out[t.name] for t in self.tables}

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        self.check_ids()  # no checkpoint holds a step that read an out-of-range id
        save_tables(self.table_states(), destination, prefix)
        if self.rounding is not None:
            destination[prefix + ROUNDING_KEY] = self.rounding.state()

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        tables = load_rounding(self.rounding, state_dict, prefix, strict, missing_keys, unexpected_keys)
        load_tables(self.table_states(), tables, prefix, strict, missing_keys, unexpected_keys, error_msgs)

    def cache_stats(self) -> dict[str, float]:
        """The device caches of the host-placed packs, summed: cumulative counters and sizes.

        Returns:
            ``cache_hit_rate`` (requested unique rows already resident when their batch was
            prepared, over all requested; a row counts once per batch), ``cache_requests``,
            ``cache_hits``, ``cache_rows_fetched`` (host to device), ``cache_rows_evicted``
            (occupied slots reused), ``cache_bytes_h2d``, ``cache_bytes_d2h`` (rows and
            optimizer state), ``cache_staging_bytes`` (staging buffers now allocated) and
            ``cache_rows`` (the caches' capacity); an empty dict without host-placed tables.
        """
        packs = [pack for pack in self._packs if isinstance(pack, CachedPack)]
        return merge_stats([pack.stats() for pack in packs]) if packs else {}

    def cached_packs(self) -> dict[int, CachedPack]:
        """The host-placed packs (behind a device cache), by pack index of :attr:`plan`."""
        return {i: pack for i, pack in enumerate(self._packs) if isinstance(pack, CachedPack)}

    def extra_repr(self) -> str:
        packs = ", ".join(
            f"(D={p.dim}, {p.optimizer}, {len(p.tables)} tables, {p.num_rows} rows"
            + (")" if p.placement == "device" else f", host, {self._packs[p.index].capacity} cached)")
            for p in self.plan.packs
        )
        dtype = "" if self.dtype == "fp32" else f", dtype={self.dtype!r}"
        return f"backend={self.backend!r}, mode={self.mode!r}{dtype}, packs=[{packs}]"
