"""``recaccel-bench embedding --profile``: the packed candidates' kernels and host ms per
iteration, written after every case; a profiler failure leaves the timed rows standing."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from recaccel.bench.kernels import embedding as bench
from recaccel.bench.kernels import embedding_profile
from recaccel.bench.kernels.embedding_cases import EmbeddingCase
from recaccel.bench.kernels.embedding_run import run_embedding_bench
from recaccel.ops.backend import fbgemm_installed
from recaccel.plotting.timeline import FORWARD, Span, Timeline
from tests.helpers.embedding_bench import cpu_factories

CASE = EmbeddingCase(tables=2, batch=16, dim=8, bag_len=2, rows=40)


def test_cpu_profile_gives_every_packed_candidate_and_mode_its_host_ms(tmp_path):
    path = tmp_path / "embedding_kernels.md"
    result = run_embedding_bench([CASE], "cpu", repeats=1, warmup=0, num_batches=2, factories=cpu_factories(),
                                 profile_path=path)  # fmt: skip
    packed = ["reference"] + (["fbgemm"] if fbgemm_installed() else [])
    text = path.read_text()
    for name in packed:
        for mode in ("forward", "fwd+bwd+update"):
            row = next(
                line for line in text.splitlines() if line.startswith(f"| {name} {mode} T=2 B=16 D=8 L=2 |")
            )
            host_ms = float(row.split("|")[3])
            assert host_ms > 0  # the host's time per iteration, the only figure on a CPU
    assert "per_table" not in text  # the baseline is timed, not profiled
    host = (tmp_path / "embedding_host.txt").read_text()
    assert "## reference fwd+bwd+update T=2 B=16 D=8 L=2" in host and "Self CPU" in host
    assert host.count("Python functions by own time") == 2 * len(packed)
    assert "recaccel/ops/embedding/module.py:" in host  # the module's own Python, by name
    assert (
        result["profile"].startswith("Per-kernel device time and host ms")
        and "embedding_kernels.md" in result["profile"]
    )
    assert [r["mode"] for r in result["results"]] == ["forward", "fwd+bwd+update"]


def test_kernels_of_a_profile_are_tabled_with_their_launching_op(tmp_path, monkeypatch):
    """What the CUDA profile gives (a kernel span with its op) reaches the markdown."""

    def fake_profile(step, steps, device, host_table=None):
        for _ in range(steps):
            step()
        host_table.write_text("host ops\n")
        kernel = Span(
            "CUDA stream 7", FORWARD, "void at::native::radix_sort_kernel", 0.0, 0.5, "aten::sort [340] i32"
        )
        return Timeline([kernel], [0.0, 2.0, 4.0][:steps])

    monkeypatch.setattr(embedding_profile, "profile_steps", fake_profile)
    path = tmp_path / "k.md"
    run_embedding_bench(
        [CASE], "cpu", repeats=1, warmup=0, num_batches=1, factories=cpu_factories(), profile_path=path
    )
    text = path.read_text()
    row = next(
        line for line in text.splitlines() if line.startswith("| reference forward T=2 B=16 D=8 L=2 |")
    )
    cells = [c.strip() for c in row.split("|")[2:5]]
    assert cells[0] == "0.167" and cells[2] == "0.33"  # 0.5 ms of kernels over 3 iterations
    assert float(cells[1]) > 0  # the host's own time per iteration, timed apart from the profile
    assert (
        "| `radix_sort_kernel` | other | forward | 0.33 | 0.1667 | 100.0% | `aten::sort [340] i32` |" in text
    )


def test_a_failure_after_some_profiles_writes_those_and_the_note_names_real_files(tmp_path, monkeypatch):
    real = embedding_profile.profile_steps
    calls = []

    def second_fails(step, steps, device, host_table=None):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("CUPTI_ERROR_UNKNOWN")
        return real(step, steps, device, host_table)

    monkeypatch.setattr(embedding_profile, "profile_steps", second_fails)
    path = tmp_path / "k.md"
    result = run_embedding_bench([CASE], "cpu", repeats=1, warmup=0, num_batches=1, factories=cpu_factories(),
                                 profile_path=path)  # fmt: skip
    assert (
        "k.md" in result["profile"]
        and "profiling stopped: RuntimeError: CUPTI_ERROR_UNKNOWN" in result["profile"]
    )
    assert "| reference forward T=2 B=16 D=8 L=2 |" in path.read_text()  # the one profile made
    assert "## reference forward" in (tmp_path / "k_host.txt").read_text()


def test_a_profiler_failure_stops_profiling_and_keeps_the_timed_rows(tmp_path, monkeypatch):
    calls = []

    def failing(step, steps, device, host_table=None):
        calls.append(1)
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED\nmore detail")

    monkeypatch.setattr(embedding_profile, "profile_steps", failing)
    cases = [CASE, EmbeddingCase(tables=3, batch=8, dim=4, bag_len=1, rows=20)]
    result = run_embedding_bench(cases, "cpu", repeats=1, warmup=0, num_batches=1, factories=cpu_factories(),
                                 profile_path=tmp_path / "k.md")  # fmt: skip
    assert len(calls) == 1  # no second try on the next case
    assert result["profile"] == "Per-kernel device time: none (RuntimeError: CUPTI_ERROR_NOT_INITIALIZED)"
    assert len(result["results"]) == 4


def test_cli_profile_flag_writes_the_tables_beside_the_markdown_and_names_them(tmp_path):
    parser = argparse.ArgumentParser()
    bench.add_args(parser)
    out = tmp_path / "embedding.md"
    args = parser.parse_args(
        ["--tables", "2", "--shapes", "8:4:1", "--cases", "--rows", "10", "--repeats", "1", "--warmup", "0",
         "--batches", "1", "--profile", "--out", str(out), "--device", "cpu"]
    )  # fmt: skip
    text = bench.main(args, "recaccel-bench embedding --profile").read_text()
    assert (tmp_path / "embedding_kernels.md").exists() and (tmp_path / "embedding_host.txt").exists()
    assert "embedding_kernels.md (each kernel with the op that launched it)" in text


def test_on_cuda_only_triton_is_profiled_and_on_a_cpu_every_packed_candidate():
    from recaccel.bench.kernels.embedding_run import profile_skips

    cands = dict.fromkeys(["per_table", "reference", "triton", "fbgemm"])
    assert profile_skips(cands, torch.device("cuda")) == ("per_table", "reference", "fbgemm")
    assert profile_skips(cands, torch.device("cpu")) == ("per_table",)
    without_triton = dict.fromkeys(["per_table", "reference"])
    assert profile_skips(without_triton, torch.device("cuda")) == ("per_table",)


def test_the_markdown_is_written_after_every_case(tmp_path, monkeypatch):
    """A run killed at its budget (here: during the second case's timing) keeps the first
    case's rows in its markdown and JSON, with the profile's note."""
    parser = argparse.ArgumentParser()
    bench.add_args(parser)
    out = tmp_path / "embedding.md"
    args = parser.parse_args(
        ["--tables", "2", "3", "--shapes", "8:4:1", "--cases", "--rows", "10", "--repeats", "1", "--warmup",
         "0", "--batches", "1", "--profile", "--out", str(out), "--json", str(tmp_path / "e.json"),
         "--device", "cpu"]
    )  # fmt: skip
    from recaccel.bench.kernels import embedding_run

    timed = embedding_run.time_interleaved

    def killed_on_the_second_case(callables, *a, **k):
        if len(calls) == 1:
            raise KeyboardInterrupt("budget")
        calls.append(1)
        return timed(callables, *a, **k)

    calls: list = []
    monkeypatch.setattr(embedding_run, "time_interleaved", killed_on_the_second_case)
    with pytest.raises(KeyboardInterrupt):
        bench.main(args, "recaccel-bench embedding --profile")
    text = out.read_text()
    assert "| forward | 2 | 8 | 4 | 1 | 10 |" in text and "| forward | 3 |" not in text
    assert "embedding_kernels.md" in text
    assert [r["T"] for r in json.loads((tmp_path / "e.json").read_text())["results"]] == [2, 2]
