"""The communication monitor of hybrid runs (as C4), and fault injection for tests and demos.

Synchronous collectives are periodic and the same on every rank, so a rank that differs
from its peers points at the faulty component. Each rank times every step (from its first
agreement to the end of its dense allreduce): the time inside each collective (``agree``:
the agreement allreduce, ``lookup``: the sharded lookup's forward all-to-alls, ``dense_sync``:
the dense gradient allreduce) with the bytes it sends (the lookup: its ids and lengths).
Its compute is its own work: from the step's start, less those collectives, up to the
moment its pooled embeddings' gradient is ready (forward and the dense backward; a hook,
:meth:`Monitor.local_backward_done`); the rest of the step is communication (the
collectives, the backward all-to-all with its wait for slower peers, the sparse update).
A step without a sharded lookup counts all but the timed collectives as compute. Every
``monitor.every`` steps one all_gather of a few floats per rank brings each rank's window
medians to rank 0, which flags:

- a slow rank: its compute median above ``monitor.slow_factor`` times the median of the
  other ranks' (a straggler: its peers wait for it inside the next collective);
- a slow collective: its collective time above ``slow_factor`` times the others', after
  taking off the time it waited for slower peers (the compute they spent beyond its own);

each in ``monitor.slow_steps`` gathers in a row and by more than a noise floor;

- a slow link: every collective spans all ranks, so every ``monitor.probe_every`` gathers
  each pair of ranks is timed alone (:mod:`recaccel.train.distributed.pair_probe`).

While the monitor runs, each rank writes the number of the collective it is entering to
the process group's store; when a collective fails, :meth:`Monitor.absent` reads them and
names the ranks that never arrived. The store is kept by torchrun's agent (or rank 0 in a
plain ``env://`` group), so a hung rank can be named; a dead store leaves the message
without the names.

Fault injection (``[fault]``, :mod:`recaccel.train.distributed.faults`): ``fault.slow_rank``
sleeps when the monitor marks its own compute done: when its pooled embeddings' gradient is
ready (before the backward all-to-all, so the delay overlaps the other ranks' compute as a
slower device's would; after backward where a step has no sharded lookup).

The monitor is a step observer: after a step with a gather, rank 0 reports a ``monitor``
event and a ``flag`` event (and a warning) for each new flag; its summary goes to metrics.json.
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from recaccel.config import Config, FaultConfig, MonitorConfig
from recaccel.config.rules import check_rule
from recaccel.errors import ConfigError
from recaccel.train.distributed.faults import SlowRank
from recaccel.train.distributed.pair_probe import LinkWatch, probe
from recaccel.train.loop.observers import Note, StepDone, StepObserver

KINDS = ("agree", "lookup", "dense_sync")  # the timed collectives of a step
# One row per rank in the gather: window medians of these, then the window's step count.
FIELDS = ("step_s", "compute_s", "comm_s", *(f"{k}_s" for k in KINDS), "bytes")
NOISE_S = 0.002  # a rank is slow only by more than this many seconds over its peers
_ARRIVED = "recaccel/monitor/"  # store keys: + generation/rank -> "seq kind"
_STORE_TIMEOUT = datetime.timedelta(seconds=2)  # reading the arrivals after a failure


def check_faults(cfg: Config, world_size: int) -> None:
    """Refuses monitor and fault settings this run cannot act on.

    Raises:
        ConfigError: a slow rank or a monitor outside hybrid mode, or a rank out of range.
    """
    check_rule(cfg, "monitor_runs_hybrid")  # a config changed after it was loaded
    check_rule(cfg, "slow_rank_runs_hybrid")
    if cfg.fault.slow_rank >= world_size:
        raise ConfigError(
            f"fault.slow_rank={cfg.fault.slow_rank} is not a rank of this {world_size}-rank run"
        )
    pair = cfg.fault.slow_pair
    if pair and (len(pair) != 2 or pair[0] == pair[1] or not all(0 <= r < world_size for r in pair)):
        raise ConfigError(f"fault.slow_pair={pair} must be two different ranks of this {world_size}-rank run")
    if cfg.monitor.probe_every > 0 and world_size < 3:
        raise ConfigError(
            f"monitor.probe_every={cfg.monitor.probe_every} compares links of 3 ranks or more "
            f"(this run has {world_size}); set it to 0"
        )
    if cfg.fault.kill_rank_at_step > 0 and cfg.fault.kill_rank >= world_size:
        raise ConfigError(
            f"fault.kill_rank={cfg.fault.kill_rank} is not a rank of this {world_size}-rank run"
        )


class Monitor(StepObserver):
    """One rank's step and collective timings, gathered on rank 0 every ``monitor.every`` steps.

    Args:
        monitor: ``[monitor]`` (``every = 0``: nothing is recorded or gathered).
        fault: ``[fault]`` (the slow rank's sleep).
        rank: this rank.
        world_size: the number of ranks.
        device: where the gather's tensor lives (CUDA under NCCL).
    """

    def __init__(
        self, monitor: MonitorConfig, fault: FaultConfig, rank: int, world_size: int, device: torch.device
    ) -> None:
        self.cfg = monitor
        self.enabled = monitor.every > 0
        self.rank, self.world_size, self.device = rank, world_size, device
        self._pace = SlowRank(fault, rank)  # fault.slow_rank's sleep
        self._window: list[list[float]] = []  # this window's steps: FIELDS each
        self._start: float | None = None  # perf_counter() at the open step's start
        self._comm = dict.fromkeys(KINDS, 0.0)
        self._bytes = 0.0
        self._seq = 0  # collectives entered (the same sequence on every rank)
        self._kind = "start-up"  # the last one's kind
        self._store, self._keys = self._arrivals() if self.enabled else (None, "")
        self._streaks = [dict.fromkeys(("compute", "collective"), 0) for _ in range(world_size)]
        self._history: list[list[list[float]]] = []  # rank 0: each gather's [rank][FIELDS]
        self.flags: list[dict[str, Any]] = []  # rank 0: each (rank, kind) flagged, first time
        self._pending: dict[str, Any] | None = None  # rank 0: the last gather, not yet logged
        self._gathers = 0
        self._links = LinkWatch(monitor.slow_factor, monitor.slow_steps)  # rank 0: link probes
        self._slow_pair = tuple(fault.slow_pair) if fault.slow_pair else None
        self._pair_delay_s = fault.slow_pair_delay_s
        # The last closed step's own compute (the straggler controller's input, see the
        # module docstring): up to the pooled embeddings' gradient, the fault's sleep included.
        self.last_compute_s = 0.0
        self._local: float | None = None  # this step's own compute, at the pooled gradient
        self._slept = 0.0  # this step's injected sleep (fault.slow_rank)

    # -------------------------------------------------------------- recording

    def start_step(self) -> None:
        """Opens a step (at its first agreement; a step already open goes on)."""
        if self._start is None:
            self._start = time.perf_counter()

    def drop_step(self) -> None:
        """Forgets the open step (its agreement ended the epoch)."""
        self._start, self._comm, self._bytes = None, dict.fromkeys(KINDS, 0.0), 0.0
        self._local, self._slept = None, 0.0

    def local_backward_done(self, grad: Any = None) -> None:
        """Marks this rank's own compute done (a hook on the pooled embeddings' gradient: what
        follows is the backward all-to-all, which waits for the slowest rank).

        Fault injection: the slow rank sleeps here, ``slow_factor - 1`` times its own compute,
        before its first synchronization in backward, so its delay overlaps the other ranks'
        compute as a slower device's would (once per step).
        """
        if self._start is None:
            return
        local = time.perf_counter() - self._start - sum(self._comm.values())
        if not self._slept:
            self._slept = self._pace(local)
        self._local = local + self._slept

    @contextmanager
    def collective(self, kind: str, nbytes: int) -> Iterator[None]:
        """Times one collective of an open step (with the monitor on, its arrival is written
        to the store first)."""
        if self.enabled:
            self._arrive(kind)
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._start is not None:
                self._comm[kind] += time.perf_counter() - start
                self._bytes += nbytes

    def after_compute(self) -> None:
        """Fault injection where :meth:`local_backward_done` did not sleep (no sharded
        lookup in the step): the slow rank sleeps ``slow_factor - 1`` times its compute so far."""
        if self._start is not None and not self._slept:
            self._slept = self._pace(time.perf_counter() - self._start - sum(self._comm.values()))

    def end_step(self) -> bool:
        """Closes the open step; returns whether a gather is due (every rank the same)."""
        if self._start is None:
            return False
        step = time.perf_counter() - self._start
        compute = step - sum(self._comm.values()) if self._local is None else self._local
        self.last_compute_s = compute
        if self.enabled:
            self._window.append([step, compute, step - compute, *self._comm.values(), self._bytes])
        self.drop_step()
        return self.enabled and len(self._window) >= self.cfg.every

    # ------------------------------------------------------------ observer

    name = "monitor"

    def after_step(self, step: int, done: StepDone) -> list[Note]:
        """Rank 0, after a step with a gather: a ``flag`` note (a warning) for each new
        flag, then the ``monitor`` note with the per-rank medians and flags."""
        event = self.take_event()
        if event is None:
            return []
        notes = [_flag_note(flag) for flag in self.note_flags(event["flags"], step)]
        return [*notes, Note("monitor", {"step": step, **event})]

    def final_metrics(self) -> dict[str, Any]:
        """Rank 0 with the monitor on: ``{"monitor": medians and flags}``."""
        return {"monitor": self.summary()} if self.enabled and self.rank == 0 else {}

    # ---------------------------------------------------------------- gathers

    def gather(self) -> None:
        """All ranks: one all_gather of the window medians; rank 0 keeps and judges them."""
        local = torch.tensor([statistics.median(col) for col in zip(*self._window)], dtype=torch.float64)
        self._window = []
        parts = [torch.empty_like(local, device=self.device) for _ in range(self.world_size)]
        dist.all_gather(parts, local.to(self.device))
        self._gathers += 1
        links = (
            self._probe_links()
            if self.cfg.probe_every and self._gathers % self.cfg.probe_every == 0
            else None
        )
        if self.rank != 0:
            return
        rows = [p.cpu().tolist() for p in parts]
        self._history.append(rows)
        flags = [*self._judge(rows)]
        if links is not None:
            flags += self._links.judge(links)
        self._pending = {
            "ranks": {str(r): dict(zip(FIELDS, row)) for r, row in enumerate(rows)},
            "flags": flags,
        }

    def _probe_links(self) -> list[list[float]]:
        """All ranks: times every pair's ping-pong and gathers the [W][W] round trips."""
        times = torch.tensor(
            probe(self.rank, self.world_size, self.device, self._slow_pair, self._pair_delay_s),
            dtype=torch.float64,
        )
        parts = [torch.empty_like(times, device=self.device) for _ in range(self.world_size)]
        dist.all_gather(parts, times.to(self.device))
        return [p.cpu().tolist() for p in parts]

    def _judge(self, rows: list[list[float]]) -> Iterator[dict[str, Any]]:
        """This gather's slow ranks (flagged after ``slow_steps`` in a row)."""
        for rank, slow in enumerate(slow_ranks(rows, self.cfg.slow_factor)):
            streak = self._streaks[rank]
            for name in streak:
                streak[name] = streak[name] + 1 if name in slow else 0
                if streak[name] >= self.cfg.slow_steps:
                    yield {"rank": rank, "kind": name, "ratio": round(slow[name], 3), "gathers": streak[name]}

    def take_event(self) -> dict[str, Any] | None:
        """Rank 0: the last gather's ``monitor`` event fields (once), else None."""
        event, self._pending = self._pending, None
        return event

    def note_flags(self, flags: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
        """Rank 0: records the first step each (rank, kind[, peer]) was flagged at; returns
        those new (a slow link: ``kind = "link"`` with its ``peer``)."""
        seen = {(f["rank"], f["kind"], f.get("peer")) for f in self.flags}
        new = [
            {
                "rank": f["rank"],
                "kind": f["kind"],
                "step": step,
                "ratio": f["ratio"],
                **({"peer": f["peer"]} if "peer" in f else {}),
            }
            for f in flags
            if (f["rank"], f["kind"], f.get("peer")) not in seen
        ]
        self.flags += new
        return new

    def summary(self) -> dict[str, Any]:
        """Rank 0: per-rank medians over the run's gathers and the flags (for metrics.json)."""
        ranks = {
            str(r): {name: statistics.median(g[r][i] for g in self._history) for i, name in enumerate(FIELDS)}
            for r in range(self.world_size)
            if self._history
        }
        out = {"every": self.cfg.every, "gathers": len(self._history), "ranks": ranks, "flags": self.flags}
        if self.cfg.probe_every:
            out["links"] = self._links.summary()  # median round trip per pair "a-b", seconds
        return out

    # ------------------------------------------------------ hung collectives

    def _arrivals(self) -> tuple[Any, str]:
        """The store and this monitor's key prefix: every rank makes its monitors in the
        same order, so counting them in the store numbers each generation alike on all."""
        store = _default_store()
        if store is None:
            return None, ""
        generation = (store.add(f"{_ARRIVED}monitors", 1) - 1) // self.world_size
        return store, f"{_ARRIVED}{generation}/"

    def _arrive(self, kind: str) -> None:
        self._seq, self._kind = self._seq + 1, kind
        if self._store is not None:
            self._store.set(f"{self._keys}{self.rank}", f"{self._seq} {kind}")

    def absent(self) -> str | None:
        """After a failed collective: which ranks never arrived at it (None: cannot tell).

        Returns:
            ``"rank 1 never arrived at collective #7 (agree; its last: #5 dense_sync)"``.
        """
        if not self.enabled or self._store is None:
            return None
        try:
            self._store.set_timeout(_STORE_TIMEOUT)
            missing = []
            for rank in range(self.world_size):
                key = f"{self._keys}{rank}"
                seq, kind = (
                    self._store.get(key).decode().split() if self._store.check([key]) else ("0", "start-up")
                )
                if int(seq) < self._seq:
                    missing.append((rank, f"#{seq} {kind}"))
        except (RuntimeError, ValueError):
            return None
        if not missing:
            return None
        ranks = ", ".join(str(r) for r, _ in missing)
        lasts = ", ".join(last for _, last in missing)
        noun = "rank" if len(missing) == 1 else "ranks"
        return f"{noun} {ranks} never arrived at collective #{self._seq} ({self._kind}; last: {lasts})"


def _flag_note(flag: dict[str, Any]) -> Note:
    """A new flag's ``flag`` event (its kind as ``slow``: "kind" names the event's own
    field) and warning line."""
    if flag["kind"] == "link":
        what = f"the link {flag['rank']}-{flag['peer']} is slow ({flag['ratio']:.2f}x the median pair's)"
    else:
        what = f"rank {flag['rank']} is slow ({flag['kind']} {flag['ratio']:.2f}x the other ranks' median)"
    fields = {key: value for key, value in flag.items() if key != "kind"}
    return Note(
        "flag", {"slow": flag["kind"], **fields}, "monitor: %s at step %d", (what, flag["step"]), True
    )


def slow_ranks(rows: list[list[float]], factor: float) -> list[dict[str, float]]:
    """Each rank's slowness in one gather: ``{"compute": ratio}`` and/or ``{"collective": ratio}``.

    Args:
        rows: per rank, the window medians of :data:`FIELDS`.
        factor: ``monitor.slow_factor``.

    Returns:
        Per rank, the kinds it is slow in and its ratio to the other ranks' median.
    """
    c, m = FIELDS.index("compute_s"), FIELDS.index("comm_s")
    compute = [row[c] for row in rows]
    # A rank's collective time less what it waited for the slowest peer's extra compute.
    own_comm = [max(row[m] - (max(compute) - row[c]), 0.0) for row in rows]
    out = []
    for rank in range(len(rows)):
        kinds: dict[str, float] = {}
        for name, values in (("compute", compute), ("collective", own_comm)):
            others = statistics.median(v for r, v in enumerate(values) if r != rank) if len(rows) > 1 else 0.0
            if values[rank] > factor * others and values[rank] - others > NOISE_S:
                kinds[name] = values[rank] / max(others, 1e-9)
        out.append(kinds)
    return out


def _default_store():
    """The default process group's store (None where this PyTorch does not expose it)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
