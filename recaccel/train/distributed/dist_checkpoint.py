"""Sharded checkpoints of hybrid runs with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory ``run_dir/checkpoints/step-<step>.dcp/`` that every rank
writes at once: each rank its own shards of the embedding tables and of their fused
optimizer state (ShardedTensors), one copy of what all ranks share (dense parameters,
data-parallel tables, the dense optimizer state), and its own reader position and RNG
state under ``ranks.<rank>``. ``recaccel.json`` beside DCP's files records the world
size, the step and (``sha256``) the SHA-256 of every other file of the folder, hashed by
rank 0 once every rank has written. The directory is written under a temporary name and
renamed by rank 0 once every rank has finished, so a crash mid-write never leaves a
checkpoint that looks complete; the two newest are kept.

Tamper evidence: a resume (each rank hashing its share of the files, sharing the outcome)
and a whole-checkpoint read (evaluation, export) check those SHA-256s before anything is
read, so a changed byte is refused in one line naming the file. A folder without them
(written before recaccel recorded them) loads with a warning: DCP's files carry no
checksums of their own.

Resuming with the same number of ranks, each rank reads back exactly its shards and its
own position. With another number W' (a smaller or larger torchrun launch), the planner
of the new run places the tables for W' ranks and DCP reshards: every rank reads the
parts of the saved ShardedTensors (tables and their fused optimizer state) that overlap
its new shards, by global offsets; the rest is replicated and read whole. Row-wise
Adagrad of a ``column_wise`` table keeps one accumulator per row *per column shard*
(``[R * shards]``): it moves only when the new plan cuts the table's columns where the
saved one did, else the resume is refused naming the table. :func:`consolidated_state_dict`
gathers the full tables on rank 0 in the single-process layout
(``<embedding prefix><table>.weight`` / ``.momentum1``), to compare with or continue as
a single-process run.

Training state on another world size. Rank r of the new run reads ``ranks.<r>`` when
the checkpoint has it, else ``ranks.0``:

- counters (step, epoch, samples, training seconds, last loss) are the same in every
  entry; ``step`` keeps counting steps, whose rows are W' times a rank's batch with
  ``parallel.data = "dynamic"`` (an epoch then has another number of steps);
- the reader position: with ``parallel.data = "global"`` it is the one shared global
  reader's, the same in every entry; with ``dynamic`` every entry holds the epoch's
  merged shard ledger, which any number of ranks resumes; with ``sharded`` it is the
  position in the rank's own row groups, which are cut per world size: refused;
- RNG state: each rank restores the entry it reads (ranks are seeded alike, so a rank
  beyond the old world size continues rank 0's streams).

Optimizer states that only exist after a first step (torch optimizers) are stored as
serialized blobs; tensors that exist from the start are loaded in place.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from recaccel.config import Config
from recaccel.errors import RecaccelError
from recaccel.train.checkpoint.dcp_read import dcp_failure, safe_dcp_planner, safe_dcp_reader
from recaccel.train.checkpoint.digests import (
    check_manifest,
    folder_digests,
    fsync_path,
    fsync_tree,
    verify_digests,
)
from recaccel.train.checkpoint.errors import CheckpointError, first_line, show
from recaccel.train.checkpoint.paths import INFO_FILE, list_sharded_checkpoints
from recaccel.train.checkpoint.payload import (
    apply_state,
    check_entries,
    check_finite,
    check_optimizer_state,
    read_payload,
)
from recaccel.train.checkpoint.state import TrainState, restore_checked, state_entries
from recaccel.train.run.runlog import CHECKPOINT_DIR

logger = logging.getLogger(__name__)

FORMAT = 1


class ShardedLayout(Protocol):
    """What a sharded checkpoint reads of the hybrid layout
    (:class:`~recaccel.train.distributed.hybrid.HybridParallel` after ``wrap``)."""

    cfg: Config
    rank: int
    world_size: int
    dmp: Any  # TorchRec's DistributedModelParallel of the sharded tables, or None
    plan: Any  # its sharding plan
    replicated: Any  # the data-parallel tables' PackedEmbeddingBag, or None
    replicated_optimizer: torch.optim.Optimizer | None
    embedding_prefix: str  # the SparseArch embedding's state-dict prefix

    @property
    def is_main(self) -> bool: ...


def _blob(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _unblob(path: Path, entry: str, data: Any) -> Any:
    """A blob of :func:`_blob`, unpickled restricted (see ``recaccel.train.checkpoint.payload.read_payload``)."""
    if not isinstance(data, bytes) or not data:
        raise CheckpointError(path, f"entry {entry!r} must be a non-empty blob, got {show(data)}")
    return read_payload(io.BytesIO(data), f"{path} (entry {entry!r})")


def _state_dict(
    parallel: ShardedLayout, model: nn.Module, optimizer: torch.optim.Optimizer, entry: int | None = None
) -> dict[str, Any]:
    """What DCP writes or reads: tensors in place, blobs (bytes) for the rest; ``entry``:
    the rank whose ``ranks.<entry>`` is read (default this rank)."""
    sd: dict[str, Any] = {"model": model.state_dict(), "dense_optim": b""}
    if parallel.dmp is not None:
        sd["embedding"] = parallel.dmp.state_dict()
        sd["sparse_optim"] = parallel.dmp.fused_optimizer.state_dict()
    if parallel.replicated is not None:
        sd["replicated"] = parallel.replicated.state_dict()
        sd["replicated_optim"] = b""
    sd[f"ranks.{parallel.rank if entry is None else entry}"] = b""
    return sd


def save_sharded(
    run_dir: Path,
    parallel: ShardedLayout,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainState,
    keep: int = 2,
) -> Path:
    """Writes ``run_dir/checkpoints/step-<step>.dcp`` (a collective: every rank calls it).

    Returns:
        The checkpoint directory.
    """
    import torch.distributed.checkpoint as dcp

    folder = Path(run_dir) / CHECKPOINT_DIR
    final = folder / f"step-{state.step:09d}.dcp"
    partial = folder / f".step-{state.step:09d}.dcp.partial"
    if parallel.is_main:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    sd = _state_dict(parallel, model, optimizer)
    sd["dense_optim"] = _blob(optimizer.state_dict())
    if parallel.replicated_optimizer is not None:
        sd["replicated_optim"] = _blob(parallel.replicated_optimizer.state_dict())
    entries = state_entries(state)
    sd[f"ranks.{parallel.rank}"] = _blob(entries)
    dcp.save(sd, checkpoint_id=str(partial))
    dist.barrier()
    if parallel.is_main:
        counters = {k: v for k, v in entries.items() if k not in ("reader", "rng", "data", "last_loss")}
        info = {"format": FORMAT, "world_size": parallel.world_size, **counters}
        info["sha256"] = folder_digests(partial, skip=(INFO_FILE,))
        (partial / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        fsync_tree(partial)  # every rank's files and the folder are on disk before the rename
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        fsync_path(folder)
        for old in list_sharded_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load_sharded(
    run_dir: Path, parallel: ShardedLayout, model: nn.Module, optimizer: torch.optim.Optimizer
) -> TrainState:
    """Restores the newest sharded checkpoint of ``run_dir`` (a collective), resharded when
    it was written by another number of ranks (see the module docstring).

    The folder is untrusted input: DCP's ``.metadata`` pickle is read restricted to DCP's
    metadata classes, byte entries restricted to tensors, numbers, strings and containers,
    and the unpickled entries are checked before any is applied.

    Raises:
        RecaccelError: no checkpoint, one that cannot move to this number of ranks
            (``parallel.data = "sharded"``, a column-wise table's optimizer state), or one
            line naming the checkpoint and its first problem.
    """
    found = list_sharded_checkpoints(run_dir)
    if not found:
        raise RecaccelError(
            f"no sharded checkpoint (step-*.dcp) in {Path(run_dir) / CHECKPOINT_DIR}; cannot resume"
        )
    path = found[-1]
    saved_world = check_world_size(path, parallel.cfg, parallel.world_size)
    verify_sharded(path, parallel.rank, parallel.world_size, warn=parallel.is_main)
    entry = parallel.rank if parallel.rank < saved_world else 0
    sd = _state_dict(parallel, model, optimizer, entry)
    reader = safe_dcp_reader(path)
    if saved_world != parallel.world_size and parallel.dmp is not None:
        _check_movable(path, reader.read_metadata(), parallel, sd, saved_world)
    dcp_load(path, sd, reader=reader)
    for key, value in sd["model"].items():  # the dense part; shapes are the model's own (dcp fills them)
        check_finite(path, f"entry 'model' key {key!r}", value)
    model.load_state_dict(sd["model"])
    dense_optim, replicated_optim, entries = check_sharded_entries(
        path, sd, optimizer, parallel.replicated_optimizer, [entry]
    )
    apply_state(path, "dense_optim", optimizer.load_state_dict, dense_optim)
    if parallel.dmp is not None:
        apply_state(path, "embedding", parallel.dmp.load_state_dict, sd["embedding"])
        apply_state(path, "sparse_optim", parallel.dmp.fused_optimizer.load_state_dict, sd["sparse_optim"])
    if parallel.replicated is not None:
        apply_state(path, "replicated", parallel.replicated.load_state_dict, sd["replicated"])
        apply_state(path, "replicated_optim", parallel.replicated_optimizer.load_state_dict, replicated_optim)
    return restore_checked(path, entries[entry])


def check_world_size(path: Path, cfg: Config, world_size: int) -> int:
    """The number of ranks that wrote the sharded checkpoint ``path``, checked against a
    resume with ``world_size`` ranks.

    Raises:
        RecaccelError: an unreadable ``recaccel.json``, or another number of ranks with
            ``parallel.data = "sharded"`` (its reader positions are per-rank row groups).
    """
    saved = read_info(path).get("world_size")
    if isinstance(saved, bool) or not isinstance(saved, int) or saved < 1:
        raise CheckpointError(path / INFO_FILE, f"world_size must be a positive int, got {show(saved)}")
    if saved != world_size and cfg.parallel.data == "sharded":
        raise RecaccelError(
            f"checkpoint {path} was written by {saved} ranks with parallel.data=sharded, whose reader "
            f"positions are each rank's own row groups and do not carry over to {world_size} ranks; "
            f"resume it with --nproc {saved} (runs meant to change size: parallel.data=dynamic or global)"
        )
    return saved


def check_resume_world_size(run_dir: Path, cfg: Config, world_size: int) -> None:
    """:func:`check_world_size` of the newest sharded checkpoint of ``run_dir`` (nothing
    when it has none): the launcher's check before any rank starts."""
    found = list_sharded_checkpoints(run_dir)
    if found:
        check_world_size(found[-1], cfg, world_size)


def _check_movable(
    path: Path, metadata: Any, parallel: ShardedLayout, sd: dict[str, Any], saved_world: int
) -> None:
    """Refuses a table whose per-column-shard accumulators the new plan would cut elsewhere.

    Args:
        path: the checkpoint (named by the error).
        metadata: its DCP metadata (each entry's global size and saved chunks).
        parallel: the new layout.
        sd: what DCP is to fill (``embedding`` / ``sparse_optim`` of the new plan).
        saved_world: the number of ranks that wrote it.

    Raises:
        CheckpointError: one line naming the table, its kind and the column cuts.
    """
    from recaccel.train.distributed.sharding import plan_rows

    kinds = {row["table"]: row["sharding"] for row in plan_rows(parallel.plan)}
    saved = metadata.state_dict_metadata
    for param, states in sd["sparse_optim"]["state"].items():
        weight, old_weight = sd["embedding"].get(param), saved.get(f"embedding.{param}")
        if (
            not hasattr(weight, "metadata")
            or old_weight is None
            or tuple(old_weight.size) != tuple(weight.size())
        ):
            continue  # another model: DCP names the mismatch
        rows = weight.size(0)
        for name, value in states.items():
            old = saved.get(f"sparse_optim.state.{param}.{name}")
            if old is None or not hasattr(old, "size") or not hasattr(value, "size"):
                continue
            sizes = (tuple(old.size), tuple(value.size()))
            if all(len(s) != 1 or s[0] == rows for s in sizes):
                continue  # one accumulator per row (or per element): moves by offsets
            cuts = [
                sorted({int(c.offsets[1]) for c in old_weight.chunks}),
                sorted({int(s.shard_offsets[1]) for s in weight.metadata().shards_metadata}),
            ]
            if sizes[0] != sizes[1] or cuts[0] != cuts[1]:
                table = name.rpartition(".")[0]
                raise CheckpointError(
                    path,
                    f"table {table!r} ({kinds.get(table, 'column_wise')} here) keeps its row-wise Adagrad "
                    f"state per column shard, cut at columns {cuts[0]} by {saved_world} ranks and "
                    f"{cuts[1]} by {parallel.world_size}: it cannot move; resume with --nproc {saved_world} "
                    "(or shard the table table_wise or row_wise from the start)",
                )


def check_sharded_entries(
    path: Path,
    sd: dict[str, Any],
    optimizer: torch.optim.Optimizer | None,
    replicated_optimizer: torch.optim.Optimizer | None,
    ranks: list[int],
) -> tuple[Any, Any, dict[int, dict[str, Any]]]:
    """Unpickles (restricted) and checks the blob entries of a loaded sharded checkpoint,
    before any is applied: ``dense_optim`` against ``optimizer``, ``replicated_optim``
    against ``replicated_optimizer`` (row-wise), and each ``ranks.<r>``'s training state.

    Args:
        path: the checkpoint folder (named by every error).
        sd: what :func:`dcp_load` filled: the byte entries of the checks asked for.
        optimizer: the dense optimizer (None: ``dense_optim`` not checked).
        replicated_optimizer: the data-parallel tables' (None: none, not checked).
        ranks: the ranks whose ``ranks.<r>`` entry to check.

    Returns:
        The dense and replicated optimizer states (None where not checked) and each
        rank's training-state entries.

    Raises:
        CheckpointError: one line naming the first bad entry.
    """
    dense_optim = replicated_optim = None
    if optimizer is not None:
        dense_optim = _unblob(path, "dense_optim", sd["dense_optim"])
        check_optimizer_state(path, "dense_optim", optimizer, dense_optim)
    if replicated_optimizer is not None:
        replicated_optim = _unblob(path, "replicated_optim", sd["replicated_optim"])
        check_optimizer_state(path, "replicated_optim", replicated_optimizer, replicated_optim, rowwise=True)
    entries = {}
    for rank in ranks:
        entry = f"ranks.{rank}"
        entries[rank] = _unblob(path, entry, sd[entry])
        check_entries(path, entries[rank], entry=entry)
    return dense_optim, replicated_optim, entries


def verify_sharded(path: Path, rank: int = 0, world_size: int = 1, *, warn: bool = True) -> None:
    """Checks the files of the sharded checkpoint ``path`` against the SHA-256s its
    ``recaccel.json`` records, before any is read. With ``world_size`` > 1 (a collective
    of the default process group) each rank hashes every ``world_size``-th file and all
    ranks raise the first failure found.

    Args:
        path: the ``step-*.dcp`` folder.
        rank: this process's rank.
        world_size: the number of ranks sharing the work (1: this process checks all).
        warn: log a warning when the folder records no digests (one rank of many).

    Raises:
        CheckpointError: ``checkpoint <path>: SHA-256 checksum mismatch in <file>: ...``,
            a listed file missing, or a malformed ``sha256`` entry.
    """
    info = read_info(path)
    if "sha256" not in info:
        if warn:
            logger.warning(
                "checkpoint %s records no SHA-256s of its files (written before recaccel recorded "
                "them): loaded unverified",
                path,
            )
        return
    manifest = check_manifest(path, info["sha256"], path / INFO_FILE)
    names = sorted(manifest)[rank::world_size]
    failure = verify_digests(path, manifest, names)
    if world_size > 1:
        failures: list[Any] = [None] * world_size
        dist.all_gather_object(failures, failure)
        failure = next((f for f in failures if f is not None), None)
    if failure is not None:
        raise failure


def read_info(path: Path) -> dict[str, Any]:
    """``recaccel.json`` of a sharded checkpoint (one line naming it when unreadable)."""
    try:
        info = json.loads((path / INFO_FILE).read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(path / INFO_FILE, f"cannot be read ({first_line(e)})") from None
    if not isinstance(info, dict):
        raise CheckpointError(path / INFO_FILE, f"must hold a JSON object, got {show(info)}")
    return info


def dcp_load(path: Path, sd: dict[str, Any], *, reader: Any = None, no_dist: bool = False) -> None:
    """``dcp.load`` into ``sd`` in place, with metadata and byte entries read restricted.

    Args:
        path: the checkpoint folder.
        sd: the entries to read, in place (bytes: a blob, read into ``sd``).
        reader: a :func:`~recaccel.train.checkpoint.dcp_read.safe_dcp_reader` of ``path``
            already made (None: one is made).
        no_dist: read in this process alone, whatever the process group.

    Raises:
        RecaccelError: one line naming the checkpoint and its first problem.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = reader if reader is not None else safe_dcp_reader(path)
    # A RuntimeError outside DCP's wrapping may be a peer rank's failure, unless there are none.
    failures = (ValueError, KeyError, TypeError, AssertionError, OSError) + (
        (RuntimeError,) if no_dist else ()
    )
    try:
        with warnings.catch_warnings():
            # TorchRec's sharded state is ShardedTensors, which DCP calls deprecated at every load.
            warnings.filterwarnings("ignore", message=".*ShardedTensor", category=FutureWarning)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(
                sd,
                checkpoint_id=str(path),
                storage_reader=reader,
                planner=safe_dcp_planner(path),
                no_dist=no_dist,
            )
    except CheckpointException as e:  # every rank's failure, wrapped: e.g. another model or plan
        raise dcp_failure(path, e) from None
    except RecaccelError:
        raise
    except failures as e:
        raise dcp_failure(path, e) from None


def _local_pieces(parallel: ShardedLayout) -> list[tuple[str, tuple[int, ...], tuple[int, ...], Tensor]]:
    """This rank's shards of every table's rows and row-wise accumulators:
    (checkpoint name, full shape, offsets, tensor)."""
    from recaccel.train.distributed.sharding import plan_rows

    column_wise = {row["table"] for row in plan_rows(parallel.plan) if row["sharding"] == "column_wise"}
    pieces = []

    def add(name: str, value: Any) -> None:
        for shard in value.local_shards():
            offsets = tuple(shard.metadata.shard_offsets)
            pieces.append((name, tuple(value.shape), offsets, shard.tensor.detach().cpu().clone()))

    for key, value in parallel.dmp.state_dict().items():
        add(f"{key.split('.')[-2]}.weight", value)
    for states in parallel.dmp.fused_optimizer.state_dict()["state"].values():
        for name, value in states.items():
            table, _, kind = name.rpartition(".")
            # Column shards keep one accumulator per row and shard: no single-table equivalent.
            if kind == "momentum1" and table not in column_wise and hasattr(value, "local_shards"):
                add(name, value)
    return pieces


def consolidated_state_dict(parallel: ShardedLayout, model: nn.Module) -> dict[str, Tensor] | None:
    """The model's full state in the single-process layout, on rank 0 (None on other ranks).

    Dense entries are ``model.state_dict()``'s; each table adds
    ``<prefix><table>.weight`` [R, D] and, for row-wise Adagrad, ``<prefix><table>.momentum1``
    [R] (column-wise tables keep one accumulator per column shard: not included).
    A collective (every rank calls it) that moves every table to rank 0: meant for
    export and tests, not for tables that do not fit one host.
    """
    pieces = _local_pieces(parallel) if parallel.dmp is not None else []
    gathered: list | None = [None] * parallel.world_size if parallel.is_main else None
    dist.gather_object(pieces, gathered, dst=0)
    if not parallel.is_main:
        return None
    out = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    prefix = parallel.embedding_prefix
    for rank_pieces in gathered:
        for name, shape, offsets, tensor in rank_pieces:
            full = out.setdefault(f"{prefix}{name}", torch.zeros(shape, dtype=tensor.dtype))
            full[tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))] = tensor
    if parallel.replicated is not None:
        momentum = _replicated_momentum(parallel)
        for table, tensors in parallel.replicated.table_states().items():
            out[f"{prefix}{table}.weight"] = tensors["weight"].detach().cpu().clone()
            if table in momentum:
                out[f"{prefix}{table}.momentum1"] = momentum[table]
    return out


def _replicated_momentum(parallel: ShardedLayout) -> dict[str, Tensor]:
    """Row-wise Adagrad accumulators [R] of the data-parallel tables, by table."""
    opt = parallel.replicated_optimizer
    if opt is None or parallel.cfg.optim.sparse != "rowwise_adagrad":
        return {}
    out = {}
    for layout in parallel.replicated.plan.packs:
        param = getattr(parallel.replicated, f"weight_{layout.index}")
        total = opt.state.get(param, {}).get("sum")
        total = torch.zeros(param.shape[0]) if total is None else total.detach().cpu().reshape(-1)
        for table, start in zip(layout.tables, layout.row_offsets):
            out[table.name] = total[start : start + table.num_rows].clone()
    return out
