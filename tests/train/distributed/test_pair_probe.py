"""The monitor's link probes (``monitor.probe_every``): the round-robin schedule, the slow-pair
judgement, and three gloo ranks where an injected slow link is named and nothing else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recaccel.config import FaultConfig, MonitorConfig, load_config
from recaccel.errors import ConfigError
from recaccel.train.distributed.monitor import Monitor, check_faults
from recaccel.train.distributed.pair_probe import LinkWatch, schedule, slow_pairs
from tests.helpers.gloo_ranks import run_ranks


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_schedule_meets_every_pair_once_one_pair_per_rank_and_round(world):
    rounds = schedule(world)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == [(a, b) for a in range(world) for b in range(a + 1, world)]
    for r in rounds:
        ranks = [x for p in r for x in p]
        assert len(ranks) == len(set(ranks))
    assert len(rounds) == world - 1 + world % 2


def _rows(world: int, base: float, slow: dict[tuple[int, int], float]) -> list[list[float]]:
    rows = [[0.0 if a == b else base for b in range(world)] for a in range(world)]
    for (a, b), t in slow.items():
        rows[a][b] = rows[b][a] = t
    return rows


def test_slow_pairs_needs_a_factor_and_a_noise_floor():
    assert list(slow_pairs(_rows(4, 0.001, {(1, 2): 0.05}), 2.0)) == [(1, 2, pytest.approx(50.0))]
    assert list(slow_pairs(_rows(4, 0.001, {(1, 2): 0.0019}), 2.0)) == []  # under the factor
    assert list(slow_pairs(_rows(4, 0.0001, {(1, 2): 0.0009}), 2.0)) == []  # 9x but under the floor
    assert list(slow_pairs(_rows(2, 0.001, {}), 2.0)) == []  # one link: nothing to compare


def test_link_watch_flags_after_slow_steps_in_a_row():
    watch = LinkWatch(2.0, 2)
    slow, clean = _rows(4, 0.001, {(0, 3): 0.02}), _rows(4, 0.001, {})
    assert watch.judge(slow) == []
    assert watch.judge(clean) == []  # the streak breaks
    assert watch.judge(slow) == []
    flags = watch.judge(slow)
    assert [(f["rank"], f["peer"], f["kind"], f["gathers"]) for f in flags] == [(0, 3, "link", 2)]
    assert watch.summary()["0-3"] == pytest.approx(0.02) and watch.summary()["1-2"] == pytest.approx(0.001)


def test_checks_refuse_a_bad_pair_and_a_probe_of_two_ranks():
    cfg = load_config(None, ["parallel.mode=hybrid", "fault.slow_pair=[1, 1]"])
    with pytest.raises(ConfigError, match="fault.slow_pair=.1, 1. must be two different ranks"):
        check_faults(cfg, 3)
    cfg = load_config(None, ["parallel.mode=hybrid", "fault.slow_pair=[0, 3]"])
    with pytest.raises(ConfigError, match="of this 3-rank run"):
        check_faults(cfg, 3)
    cfg = load_config(None, ["parallel.mode=hybrid", "monitor.every=2", "monitor.probe_every=1"])
    with pytest.raises(ConfigError, match="3 ranks or more"):
        check_faults(cfg, 2)


def _worker(rank: int, world: int, root: Path) -> None:
    result = {}
    for name, pair in (("slow", [1, 2]), ("clean", [])):
        monitor = Monitor(
            # A loud fault and a high bar: 3 ranks busy-waiting on 2 cores delay pings by a few ms.
            MonitorConfig(every=1, slow_steps=3, slow_factor=5, probe_every=1),
            FaultConfig(slow_pair=pair, slow_pair_delay_s=0.06),
            rank,
            world,
            torch.device("cpu"),
        )
        flags = []
        for step in range(1, 5):
            monitor.start_step()
            assert monitor.end_step()  # a gather is due every step
            monitor.gather()
            event = monitor.take_event()
            if rank == 0:
                flags += monitor.note_flags(event["flags"], step)
        result[name] = {"flags": flags, "summary": monitor.summary() if rank == 0 else None}
    if rank == 0:
        (root / "rank0.json").write_text(json.dumps(result))


def test_three_ranks_name_the_slow_link_only(tmp_path):
    run_ranks(_worker, 3, tmp_path, join_s=120)
    out = tmp_path / "rank0.json"
    got = json.loads(out.read_text())
    slow = got["slow"]
    assert [(f["rank"], f["peer"], f["kind"], f["step"]) for f in slow["flags"]] == [(1, 2, "link", 3)]
    links = slow["summary"]["links"]  # median round trip per pair: the delay once per round trip
    assert links["1-2"] > 0.06 > max(links["0-1"], links["0-2"])
    assert got["clean"]["flags"] == []
