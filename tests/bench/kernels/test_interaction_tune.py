"""``recaccel-bench interaction_tune`` on the CPU (the Triton interpreter): it checks and
times its configs, writes the JSON, the markdown and the tuning table."""

from __future__ import annotations

import json

import pytest

from recaccel.bench.kernels import interaction_tune
from recaccel.cli import bench_main
from recaccel.ops.tuning_tables import read_table
from tests.helpers.marks import needs_triton


@needs_triton
def test_cpu_run_writes_every_case_and_the_winners(tmp_path):
    table = tmp_path / "table.py"
    rc = bench_main(["interaction_tune", "--device", "cpu", "--json", str(tmp_path / "t.json"),
                     "--out", str(tmp_path / "t.md"), "--write-table", str(table)])  # fmt: skip
    assert rc == 0
    report = json.loads((tmp_path / "t.json").read_text())
    assert [c["name"] for c in report["cases"]] == [c.name for c in interaction_tune.CPU_CASES]
    for case in report["cases"]:
        assert len(case["configs"]) == 2 and not case["dropped"] and case["best"] in case["configs"]
        assert all(figures["ms"] > 0 for figures in case["configs"].values())
    entries = read_table(table)["cpu"]
    assert sorted(entries) == sorted(c["key"] for c in report["cases"])
    assert "| fwd_B4_R4_D8_float32 | 2 | 0 |" in (tmp_path / "t.md").read_text()


def test_winner_is_the_config_fastest_over_every_case_of_a_key():
    def case(key, **ms):
        configs = {
            n: {"ms": v, "block_b": i + 1, "bd": 32, "num_warps": 4} for i, (n, v) in enumerate(ms.items())
        }
        return {"key": key, "best": min(configs, key=lambda n: configs[n]["ms"]), "configs": configs}

    records = [case("k", a=1.0, b=1.1), case("k", a=2.0, b=1.0), case("j", a=3.0)]
    # a: 1 + 2 = 3 relative to the bests; b: 1.1 + 1 = 2.1
    assert interaction_tune.winners(records) == {
        "k": {"block_b": 2, "bd": 32, "num_warps": 4},
        "j": {"block_b": 1, "bd": 32, "num_warps": 4},
    }


def test_bad_budget_is_one_line(tmp_path, capsys):
    assert (
        bench_main(
            ["interaction_tune", "--device", "cpu", "--budget-s", "0", "--json", str(tmp_path / "t.json")]
        )
        == 2
    )
    assert "--budget-s 0.0: must be > 0" in capsys.readouterr().err


@pytest.mark.parametrize("kernel", ["fwd", "bwd"])
def test_case_bytes_count_inputs_once_and_outputs_once(kernel):
    case = interaction_tune.TuneCase(kernel, 2, 3, 8, "bfloat16")
    x, out = 2 * 4 * 8, 2 * (8 + 6)
    assert interaction_tune.case_bytes(case) == 2 * (x + out if kernel == "fwd" else out + 2 * x)
