"""recaccel-bench straggler at a tiny size (2 gloo ranks), its row counting and timing
helpers against hand-made step records, and its flag checks."""

from __future__ import annotations

import json

import pytest

from recaccel.bench.distributed.straggler import epoch_rows
from recaccel.bench.distributed.straggler_report import count_rows, detect_step, throughput
from recaccel.cli import bench_main

KEYS = {
    "clean_samples_per_s",
    "slowed_samples_per_s",
    "rebalance_samples_per_s",
    "backup_samples_per_s",
    "detect_steps",
    "rows_lost",
    "rows_repeated",
}


def _tiny(tmp_path, *flags: str) -> tuple[dict, str]:
    out, js = tmp_path / "s.md", tmp_path / "s.json"
    argv = ["straggler", "--ranks", "2", "--rows", "2048", "--batch", "32", "--mlp", "32", "--warmup", "2"]
    argv += ["--slow-factor", "4", "--repeats", "1", "--out", str(out), "--json", str(js), *flags]
    assert bench_main(argv) == 0
    return json.loads(js.read_text()), out.read_text()


def test_tiny_run_counts_every_row_and_flags_the_slow_rank(tmp_path):
    pytest.importorskip("torchrec", exc_type=ImportError)
    result, text = _tiny(tmp_path)
    assert KEYS <= set(result)
    scenarios = result["scenarios"]
    assert set(scenarios) == {"clean", "clean_dynamic", "slowed", "rebalance", "backup"}
    assert (
        scenarios["backup"]["vs_clean"]
        == scenarios["backup"]["samples_per_s"] / scenarios["clean_dynamic"]["samples_per_s"]
    )
    for name in ("clean", "slowed"):  # no mitigation: every row once, 2048 / (2 x 32) steps
        s = scenarios[name]
        assert s["rows_lost"] == 0 and s["rows_repeated"] == 0
        assert s["steps"] == 32 and s["local_batch_last"] == [32, 32]
        assert result[f"{name}_samples_per_s"] == s["samples_per_s"] > 0
        assert [r["samples_per_s"] for r in s["rounds"]] == [s["samples_per_s"]]  # one round
    for name, s in scenarios.items():  # mitigated too: each row exactly once per epoch
        assert "refused" not in s, name
        assert (s["rows_lost"], s["rows_repeated"]) == (0, 0), name
        assert [(r["rows_lost"], r["rows_repeated"]) for r in s["rounds"]] == [(0, 0)], name
    assert result["rows_lost"] == result["rows_repeated"] == 0
    assert result["detect_steps"] is not None and result["detect_steps"] <= 20  # 4x slow, flagged at 2.5x
    assert not scenarios["clean"]["monitor_flags"]
    assert "| clean | global | off | no |" in text and "Detection: slow rank flagged at step" in text
    assert result["setup"]["slow_factor"] == 4.0 and "slowdown" not in result["setup"]
    assert "fault.slow_rank" in text and (tmp_path / "s.png").stat().st_size > 0


def test_tiny_slowed_scenario_alone(tmp_path):
    pytest.importorskip("torchrec", exc_type=ImportError)
    result, text = _tiny(tmp_path, "--scenarios", "slowed", "--plot", "")
    assert set(result["scenarios"]) == {"slowed"} and result["clean_samples_per_s"] is None
    assert result["rows_lost"] == result["rows_repeated"] == 0
    assert result["detect_steps"] is not None and result["detect_steps"] <= 20
    assert "| slowed | global | off | yes |" in text and not (tmp_path / "s.png").exists()


def test_count_rows_against_hand_counts():
    steps = [[(0.0, [0, 1]), (1.0, [2, 2])], [(0.0, [4, 5]), (1.0, [7, 9])]]
    # rows 0..7: 3 and 6 never trained; 2 twice; 9 is outside the epoch
    assert count_rows(steps, 8) == (2, 2)
    assert count_rows([[(0.0, [1, 0])], [(0.0, [2, 3])]], 4) == (0, 0)


def test_throughput_times_rank_zero_after_the_warmup():
    # rank 0 starts steps at 0, 1, 3, 4 s; each step trains 2 + 3 rows
    steps = [[(0.0, [0, 1]), (1.0, [2, 3]), (3.0, [4, 5]), (4.0, [6, 7])], [(0.0, [8, 9, 10])] * 4]
    rate, step_ms = throughput(steps, warmup=1)
    assert rate == pytest.approx(10 / 3)  # steps 1 and 2 (5 rows each) between t=1 and t=4
    assert step_ms == pytest.approx([1000.0, 2000.0, 1000.0])


def test_detect_step_reads_the_first_compute_flag_of_the_slow_rank():
    flags = [
        {"rank": 0, "kind": "compute", "step": 4},
        {"rank": 1, "kind": "collective", "step": 6},
        {"rank": 1, "kind": "compute", "step": 8},
    ]
    assert detect_step({"monitor": {"flags": flags}}, 1) == 8
    assert detect_step({"monitor": {"flags": flags}}, 2) is None
    assert detect_step({}, 1) is None


def test_rows_round_down_to_whole_shards_per_rank():
    class Args:
        rows, ranks, batch = 10_000, 3, 256

    assert epoch_rows(Args) == 9216  # 3 ranks x 2 x 256-row shards x 6


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ranks", "1"], "--ranks must be >= 2"),
        (["--scenarios", "clean,fast"], "--scenarios: unknown ['fast']"),
        (["--rows", "100"], "gives too few steps"),
        (["--slow-factor", "0.5"], "--slow-factor must be >= 1"),
        (["--ranks", "4", "--batch", "2"], "--batch must be >= --ranks"),
    ],
)
def test_bad_flags_are_one_line_errors(capsys, flags, message):
    assert bench_main(["straggler", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
