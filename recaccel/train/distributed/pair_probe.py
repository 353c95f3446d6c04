"""Link probes of the monitor (``monitor.probe_every``): find a slow pair of ranks, as C4.

Every collective of a step spans all ranks, so its time cannot say which link is slow.
A probe times each pair alone: in ``W - 1`` rounds of a round-robin schedule (the circle
method: every pair meets once, each rank in one pair per round) the two ranks of a pair
ping-pong :data:`PROBE_BYTES` (send/recv over the process group, :data:`REPEATS` times,
the fastest kept so a partner still finishing its previous round does not count). One
all_gather brings each rank's row of times to rank 0; a pair's time is the lower of its two
ranks' (both time the same round trips, and scheduling noise only adds). It flags a pair whose time
exceeds ``monitor.slow_factor`` times the median pair's (by more than a noise floor) in
``monitor.slow_steps`` probes in a row. Needs three ranks or more: with two there is one
link and nothing to compare it with.

Fault injection (tests and demos): ``fault.slow_pair = [a, b]`` delays each ping of that
pair by ``fault.slow_pair_delay_s`` (only the probe's: a real slow link slows every
collective, which the probe then names).

::

    W = 4   round 1: (0,3) (1,2)   round 2: (0,2) (3,1)   round 3: (0,1) (2,3)
    times   [[0, .2, .2, .2], [.2, 0, 9.1, .2], ...] ms  ->  pair (1, 2) is slow
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

PROBE_BYTES = 1 << 16  # 64 KiB per ping: a few link latencies, cheap next to a step
REPEATS = 5
NOISE_S = 0.001  # a pair is slow only by more than this many seconds over the median


def schedule(world_size: int) -> list[list[tuple[int, int]]]:
    """The round-robin rounds of pairs ``(a, b)``, ``a < b``: every pair once, each rank
    at most once per round (``W - 1`` rounds, ``W`` for odd ``W``, where one rank rests)."""
    n = world_size + world_size % 2  # an odd world gets a resting slot
    others = list(range(1, n))
    rounds = []
    for _ in range(n - 1):
        ring = [0, *others]
        pairs = [(ring[i], ring[n - 1 - i]) for i in range(n // 2)]
        rounds.append([(min(p), max(p)) for p in pairs if max(p) < world_size])
        others = others[-1:] + others[:-1]
    return rounds


def probe(
    rank: int, world_size: int, device: torch.device, slow_pair: tuple[int, int] | None, delay_s: float
) -> list[float]:
    """Times this rank's ping-pong with every peer (a collective: every rank calls it).

    Returns:
        [W] seconds per round trip to each peer (0 for itself).
    """
    times = [0.0] * world_size
    out = torch.zeros(PROBE_BYTES // 4, dtype=torch.float32, device=device)
    back = torch.empty_like(out)
    for pairs in schedule(world_size):
        for a, b in pairs:
            if rank not in (a, b):
                continue
            peer = b if rank == a else a
            slow = slow_pair is not None and {a, b} == set(slow_pair)
            best = float("inf")
            for _ in range(REPEATS):
                start = time.perf_counter()
                if rank == a:
                    if slow:
                        time.sleep(delay_s)
                    dist.send(out, peer)
                    dist.recv(back, peer)
                else:
                    dist.recv(back, peer)
                    dist.send(out, peer)
                best = min(best, time.perf_counter() - start)
            times[peer] = best
    return times


def slow_pairs(rows: list[list[float]], factor: float) -> Iterator[tuple[int, int, float]]:
    """The pairs ``(a, b, ratio)`` of one probe slower than ``factor`` times the median pair.

    Args:
        rows: per rank, its round-trip seconds to each peer ([W][W]).
        factor: ``monitor.slow_factor``.
    """
    world = len(rows)
    pairs = {(a, b): min(rows[a][b], rows[b][a]) for a in range(world) for b in range(a + 1, world)}
    if len(pairs) < 3:
        return
    median = statistics.median(pairs.values())
    for (a, b), t in pairs.items():
        if t > factor * median and t - median > NOISE_S:
            yield a, b, t / max(median, 1e-9)


class LinkWatch:
    """Rank 0's streaks of slow pairs over probes, flagged after ``slow_steps`` in a row.

    Args:
        factor: ``monitor.slow_factor``.
        slow_steps: ``monitor.slow_steps``.
    """

    def __init__(self, factor: float, slow_steps: int) -> None:
        self.factor = factor
        self.slow_steps = slow_steps
        self._streaks: dict[tuple[int, int], int] = {}
        self.history: list[list[list[float]]] = []

    def judge(self, rows: list[list[float]]) -> list[dict]:
        """This probe's flags: ``{"rank": a, "peer": b, "kind": "link", "ratio", "gathers"}``."""
        self.history.append(rows)
        slow = {(a, b): ratio for a, b, ratio in slow_pairs(rows, self.factor)}
        self._streaks = {pair: self._streaks.get(pair, 0) + 1 for pair in slow}
        return [
            {"rank": a, "peer": b, "kind": "link", "ratio": round(slow[(a, b)], 3), "gathers": n}
            for (a, b), n in sorted(self._streaks.items())
            if n >= self.slow_steps
        ]

    def summary(self) -> dict[str, float]:
        """Median round trip (seconds) per pair ``"a-b"`` over the probes."""
        if not self.history:
            return {}
        world = len(self.history[0])
        return {
            f"{a}-{b}": statistics.median(min(h[a][b], h[b][a]) for h in self.history)
            for a in range(world)
            for b in range(a + 1, world)
        }


__all__ = ["LinkWatch", "PROBE_BYTES", "probe", "schedule", "slow_pairs"]
