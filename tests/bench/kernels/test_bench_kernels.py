"""``recaccel-bench kernels`` (the kernel config sweep) and the per-device tuning table.

The sweep runs its CPU mode here (the kernels under TRITON_INTERPRET=1, set in conftest.py
before the kernel modules are imported); the table is exercised by pretending the device
is a tuned GPU (``tuning.device_name`` patched) and checking that the launches take the
table's config: a config changes the summation order, hence the result's bits.
"""

from __future__ import annotations

import json

import pytest
import torch

from recaccel.bench.kernels import sweep as kernels
from recaccel.bench.kernels import sweep_cases
from recaccel.cli import bench_main
from recaccel.ops.backend import triton_interpret_enabled
from recaccel.ops.embedding.packing import LocalFeatures, gather_pack_ids
from recaccel.sparse import SparseFeatures

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_interpret_enabled()),
    reason="triton kernels need CUDA or TRITON_INTERPRET=1",
)

from recaccel.ops.embedding.triton import backward, forward, tuning  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FAKE_GPU = "NVIDIA Test GPU"


def _cpu_args(tmp_path, *extra: str) -> list[str]:
    return ["kernels", "--device", "cpu", "--json", str(tmp_path / "k.json"), "--out", str(tmp_path / "k.md"),
            *extra]  # fmt: skip


def test_cpu_mode_writes_json_with_every_figure_after_each_case_and_the_table(tmp_path, monkeypatch):
    seen_before_case = []
    sweep_case = kernels.sweep_case

    def spy(case, *args, **kwargs):  # what the JSON holds when each case starts
        path = tmp_path / "k.json"
        seen_before_case.append(json.loads(path.read_text())["cases"] if path.exists() else None)
        return sweep_case(case, *args, **kwargs)

    monkeypatch.setattr(kernels, "sweep_case", spy)
    table = tmp_path / "table.py"
    assert bench_main(_cpu_args(tmp_path, "--write-table", str(table))) == 0

    report = json.loads((tmp_path / "k.json").read_text())
    assert seen_before_case[0] is None
    assert [c["name"] for c in seen_before_case[1]] == [sweep_cases.CPU_CASES[0].name]
    assert report["copy_gb_s"] > 0 and report["skipped"] == [] and report["device_name"] == "cpu"
    assert [c["case"]["kernel"] for c in report["cases"]] == ["forward", "backward"]
    for case in report["cases"]:
        assert len(case["configs"]) == 2 and "default" in case["configs"] and case["dropped"] == {}
        for figures in case["configs"].values():
            assert figures["ms"] > 0 and figures["gb_s"] > 0 and figures["pct_copy"] > 0
            assert figures["num_warps"] in (2, 4, 8)
        assert case["best"] in case["configs"] and not case["truncated"]
    written = tuning.read_table(table)["cpu"]
    for case in report["cases"]:
        best = case["configs"][case["best"]]
        assert all(best[k] == v for k, v in written[case["key"]].items())
    assert "Embedding kernel config sweep" in (tmp_path / "k.md").read_text()


def test_a_config_with_wrong_output_or_that_fails_to_compile_is_dropped_not_timed(tmp_path):
    case = sweep_cases.CPU_CASES[0]
    twin, _ = sweep_cases.forward_candidates(case, DEVICE)  # the same seeded batch as the sweep's
    good = twin["default"]
    wrong = sweep_cases.Candidate({**good.fields, "block_bags": 16}, lambda: good.run() * 1.01)
    bad_fields = {**good.fields, "block_bags": 3}  # not a power of two: tl.arange rejects it
    bad_config = forward.ForwardConfig(**bad_fields)
    weight, sf, local = sweep_cases.make_batch(case, DEVICE)
    bad = sweep_cases.Candidate(
        bad_fields, lambda: forward.embedding_bag_forward(weight, sf, local, case.batch, config=bad_config)
    )
    report = kernels.run_sweep(
        [case],
        DEVICE,
        tmp_path / "k.json",
        budget_s=300,
        max_configs=3,
        extra={case.name: {"wrong": wrong, "bad": bad}},
    )
    (record,) = report["cases"]
    assert set(record["dropped"]) == {"wrong", "bad"}
    assert "AssertionError" in record["dropped"]["wrong"]
    assert list(record["configs"]) == ["default"]
    assert kernels.winners(report["cases"])[record["key"]] == good.fields


def test_a_spent_budget_skips_the_remaining_cases_and_still_writes_the_json(tmp_path):
    report = kernels.run_sweep(sweep_cases.CPU_CASES, DEVICE, tmp_path / "k.json", budget_s=1e-9)
    assert report["cases"] == []
    assert report["skipped"] == [c.name for c in sweep_cases.CPU_CASES]
    assert json.loads((tmp_path / "k.json").read_text())["skipped"] == report["skipped"]


def test_budget_must_be_positive_one_line_error_exit_2(tmp_path, capsys):
    assert bench_main(_cpu_args(tmp_path, "--budget-s", "0")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["recaccel-bench: error: recaccel-bench kernels: --budget-s 0.0: must be > 0"]


def test_write_table_merges_devices_and_lookup_returns_the_winner_or_none(tmp_path, monkeypatch):
    path = tmp_path / "table.py"
    fwd_key = tuning.forward_key(128, 32, torch.bfloat16)
    tuning.write_table(
        path, "Other GPU", {fwd_key: {"block_bags": 8, "num_warps": 8, "unroll": 1, "long_threshold": 64}}
    )
    winner = {"block_bags": 32, "num_warps": 2, "unroll": 2, "long_threshold": 512}
    tuning.write_table(
        path,
        FAKE_GPU,
        {fwd_key: winner, tuning.backward_key(48, "float32"): {"block_occ": 16, "num_warps": 8}},
    )
    table = tuning.read_table(path)
    assert set(table) == {"Other GPU", FAKE_GPU}
    monkeypatch.setattr(tuning, "_load_table", lambda: table)
    monkeypatch.setattr(tuning, "device_name", lambda device: FAKE_GPU)

    assert tuning.lookup(DEVICE, fwd_key) == winner
    assert forward.forward_config(128, 20.0, torch.bfloat16, DEVICE) == forward.ForwardConfig(**winner)
    heuristic = forward.forward_config(128, 20.0, torch.bfloat16)
    assert heuristic != forward.ForwardConfig(**winner)
    assert forward.forward_config(128, 20.0, torch.float32, DEVICE) == forward.forward_config(
        128, 20.0, torch.float32
    )
    assert backward.tile_config(48, torch.float32, DEVICE) == (16, 8, 1)  # no "subtiles": 1
    assert backward.tile_config(48, torch.bfloat16, DEVICE) == backward.tile_config(48)

    monkeypatch.setattr(tuning, "device_name", lambda device: "an untuned GPU")
    assert tuning.lookup(DEVICE, fwd_key) is None
    assert forward.forward_config(128, 20.0, torch.bfloat16, DEVICE) == heuristic
    assert backward.tile_config(48, torch.float32, DEVICE) == backward.tile_config(48)


def _bags(dim: int, length: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    rows, batch = 6, 12
    lengths = torch.full((batch,), length, dtype=torch.int64)
    ids = torch.randint(0, rows, (batch * length,), generator=gen)
    sf = SparseFeatures.from_lengths(["f"], ids, lengths).to(DEVICE)
    local = LocalFeatures.build([0], [0], [False], 1, DEVICE)
    weight = torch.randn(rows, dim, generator=gen).to(DEVICE)
    return weight, sf, local, batch


def test_forward_launch_takes_this_devices_table_entry(monkeypatch):
    weight, sf, local, batch = _bags(dim=16, length=100, seed=5)
    # long_threshold 2 routes every bag to the long-bag kernel, which sums 64-row chunks
    # and then the chunk sums (the tile kernel sums row by row): another order, other bits.
    entry = {"block_bags": 8, "num_warps": 2, "unroll": 1, "long_threshold": 2}
    table = {FAKE_GPU: {tuning.forward_key(16, 32, torch.float32): entry}}
    monkeypatch.setattr(tuning, "_load_table", lambda: table)
    default = forward.embedding_bag_forward(weight, sf, local, batch)
    monkeypatch.setattr(tuning, "device_name", lambda device: FAKE_GPU)

    got = forward.embedding_bag_forward(weight, sf, local, batch)
    tuned = forward.embedding_bag_forward(weight, sf, local, batch, config=forward.ForwardConfig(**entry))
    assert torch.equal(got, tuned)
    assert not torch.equal(got, default)
    torch.testing.assert_close(got, default, rtol=1e-5, atol=1e-5)


def test_backward_launch_takes_this_devices_table_entry(monkeypatch):
    weight, sf, local, batch = _bags(dim=16, length=20, seed=9)
    ids = gather_pack_ids(sf, local, batch, with_bags=True)  # 240 ids of 6 rows: tiles of 4 split every row
    grad_out = torch.randn(batch, 1, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    table = {FAKE_GPU: {tuning.backward_key(16, torch.float32): {"block_occ": 4, "num_warps": 2}}}
    monkeypatch.setattr(tuning, "_load_table", lambda: table)
    _, default = backward.embedding_bag_backward(grad_out, ids, batch)
    monkeypatch.setattr(tuning, "device_name", lambda device: FAKE_GPU)

    _, got = backward.embedding_bag_backward(grad_out, ids, batch)
    _, tuned = backward.embedding_bag_backward(grad_out, ids, batch, block_occ=4, num_warps=2)
    assert torch.equal(got, tuned)
    assert not torch.equal(got, default)
    torch.testing.assert_close(got, default, rtol=1e-5, atol=1e-5)


def test_gpu_cases_cover_the_issue_shapes_and_interleave_kernels():
    cases = sweep_cases.gpu_cases()
    assert [c.kernel for c in cases[:4]] == ["forward", "backward", "forward", "backward"]
    shapes = {(c.kernel, c.tables, c.batch, c.dim, c.length, c.dtype, c.zipf) for c in cases}
    assert ("forward", 500, 4096, 32, 1, "float32", False) in shapes
    assert ("forward", 26, 65536, 128, 1, "float32", False) in shapes
    assert {c.dim for c in cases} == {16, 32, 64, 128, 256}
    assert {c.length for c in cases} == {0, 1, 20}
    assert {c.dtype for c in cases} == {"float32", "bfloat16"}
    assert any(c.zipf for c in cases if c.kernel == "forward") and any(
        c.zipf for c in cases if c.kernel == "backward"
    )
    assert len({c.name for c in cases}) == len(cases)
    for case in cases:
        sweep = (
            sweep_cases.forward_sweep(case) if case.kernel == "forward" else sweep_cases.backward_sweep(case)
        )
        assert sweep and len({sweep_cases.config_name(f) for f in sweep}) == len(sweep)


def test_a_config_writing_wrong_values_into_the_shared_output_buffer_is_dropped(tmp_path, monkeypatch):
    """The forward's candidates write into one buffer: the default's output is kept as a
    copy, or a config that writes wrong values there would match it by aliasing."""
    case = sweep_cases.CPU_CASES[0]
    shared = torch.zeros(4)

    def candidates(case, device):
        def writer(value: float):
            return lambda: shared.fill_(value)

        return {
            "default": sweep_cases.Candidate({"block_bags": 1}, writer(1.0)),
            "wrong": sweep_cases.Candidate({"block_bags": 2}, writer(2.0)),
            "same": sweep_cases.Candidate({"block_bags": 4}, writer(1.0)),
        }, 16

    monkeypatch.setattr(kernels, "forward_candidates", candidates)
    record = kernels.sweep_case(case, DEVICE, copy_gbs=1.0, deadline=float("inf"))
    assert set(record["dropped"]) == {"wrong"} and set(record["configs"]) == {"default", "same"}


def test_precompile_runs_every_config_once_on_several_threads_and_survives_a_failing_one():
    import threading

    seen: list[tuple[int, str]] = []
    barrier = threading.Barrier(3, timeout=10)  # three runs at once, or the barrier breaks

    def make(i: int):
        def run():
            seen.append((i, threading.current_thread().name))
            if i < 3:
                barrier.wait()
            if i == 4:
                raise RuntimeError("does not compile")
            return torch.zeros(1)

        return sweep_cases.Candidate({"i": i}, run)

    kernels.precompile([make(i) for i in range(6)], workers=3, device=torch.device("cpu"))
    assert sorted(i for i, _ in seen) == list(range(6))
    assert all(name.startswith("recaccel-compile") for _, name in seen)
    assert not barrier.broken
    ran = []
    kernels.precompile(
        [sweep_cases.Candidate({}, lambda: ran.append(1))], workers=3, device=torch.device("cpu")
    )
    assert ran == []  # one config: nothing to do at once
    assert 1 <= kernels.compile_workers() <= 8
