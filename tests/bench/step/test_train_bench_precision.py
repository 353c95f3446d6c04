"""``recaccel-bench train --precision``: every candidate timed under each precision mode,
under the same setting (a fair baseline), the mode on every row, speedups within a mode."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from recaccel.bench.step.candidates import parse_precisions
from recaccel.bench.step.report import speedups
from recaccel.cli import bench_main
from recaccel.errors import ConfigError
from tests.helpers.bench_presets import TINY_PRESET


def _argv(tmp_path, preset, *extra):
    return [
        "train",
        "--preset",
        str(preset),
        "--device",
        "cpu",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--phase-steps",
        "1",
        "--rotate",
        "2",
        "--compile-backend",
        "aot_eager",  # dynamo + AOT autograd without inductor's C++ build: seconds, not a minute
        "--mode",
        "device",
        "--plot",
        "",
        "--out",
        str(tmp_path / "train.md"),
        "--json",
        str(tmp_path / "train.json"),
        *extra,
    ]


def _rows(tmp_path) -> list[dict]:
    return json.loads((tmp_path / "train.json").read_text())["results"]


def test_every_candidate_has_a_row_per_precision_mode_with_the_mode_named(tmp_path, tiny):
    argv = _argv(tmp_path, tiny, "--precision", "fp32,tf32,bf16", "--candidates", "recaccel", "eager")
    assert bench_main(argv) == 0
    rows = _rows(tmp_path)
    assert sorted((r["candidate"], r["precision"]) for r in rows) == sorted(
        (c, p) for c in ("recaccel", "eager") for p in ("fp32", "tf32", "bf16")
    )
    for r in rows:
        assert r["status"] == "ok", r
        assert r["step_ms"] > 0
        if r["candidate"] == "eager":  # each mode's eager is its own mode's baseline
            assert r["speedup_vs_eager"] == 1.0
    text = (tmp_path / "train.md").read_text()
    assert "| preset | mode | precision | candidate |" in text
    assert "| tiny | device | bf16 | eager |" in text
    assert "tf32 on cpu: runs as fp32" in text
    assert "bf16 adds torch.autocast(bfloat16)" in text


def test_without_precision_each_preset_runs_its_own_mode(tmp_path, tiny):
    tiny.write_text(TINY_PRESET + '[train]\nprecision = "bf16"\n')
    assert bench_main(_argv(tmp_path, tiny, "--candidates", "eager")) == 0
    assert [r["precision"] for r in _rows(tmp_path)] == ["bf16"]


class MatmulRecorder(TorchDispatchMode):
    """Records (TF32 switch, output dtype) of every matrix product torch runs (below
    autocast, so the dtype is the one multiplied in)."""

    PRODUCTS = {"mm", "addmm", "bmm", "baddbmm", "_addmm_activation"}

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in self.PRODUCTS:
            self.seen.append((torch.backends.cuda.matmul.allow_tf32, out.dtype))
        return out


@pytest.mark.parametrize("candidate", ["eager", "compiled", "recaccel"])
def test_each_mode_runs_the_candidate_under_its_switch_and_autocast(tmp_path, tiny, candidate):
    """Every matrix product of the timed steps sees the mode: TF32 on and float32 under
    tf32; TF32 off and bfloat16 under bf16 (float32 products with the switch off are the
    equivalence check's, run before the modes, and recaccel's float32 logit layer)."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with MatmulRecorder() as recorder:
            argv = _argv(tmp_path, tiny, "--precision", "tf32,bf16", "--candidates", candidate)
            assert bench_main(argv) == 0
        after = torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    assert after is False, "the bench must put the switch back"
    assert all(r["status"] == "ok" for r in _rows(tmp_path)), "a skipped candidate would prove nothing"
    seen = recorder.seen
    assert set(seen) == {(True, torch.float32), (False, torch.bfloat16), (False, torch.float32)}
    assert seen.count((False, torch.bfloat16)) > 10  # the bf16 pass's products, step after step


def test_an_unknown_precision_is_one_line_exit_2(tmp_path, tiny, capsys):
    assert bench_main(_argv(tmp_path, tiny, "--precision", "fp32,fp16")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "--precision 'fp16' is not one of fp32, tf32, bf16" in err
    assert not (tmp_path / "train.json").exists()


def test_precision_list_keeps_its_order_once_each_and_refuses_an_empty_one():
    assert parse_precisions("bf16, fp32,bf16") == ["bf16", "fp32"]
    assert parse_precisions(None) is None
    with pytest.raises(ConfigError, match="--precision=',' names nothing"):
        parse_precisions(",")


def test_speedups_compare_rows_of_the_same_precision_mode_only():
    def row(candidate, precision, step_ms, pipeline=None):
        return {
            "candidate": candidate,
            "preset": "p",
            "mode": "device",
            "precision": precision,
            "step_ms": step_ms,
            "pipeline": pipeline,
            "micro_batches": 1 if pipeline else None,
            "cuda_graphs": False if pipeline else None,
        }

    rows = [
        row("eager", "fp32", 10.0),
        row("eager", "bf16", 4.0),
        row("recaccel", "fp32", 5.0, "off"),
        row("recaccel", "bf16", 1.0, "off"),
        row("recaccel", "bf16", 0.5, "sync"),
    ]
    speedups(rows)
    assert [r["speedup_vs_eager"] for r in rows] == [1.0, 1.0, 2.0, 4.0, 8.0]
    assert [r["speedup_vs_off"] for r in rows] == [None, None, 1.0, 1.0, 2.0]
