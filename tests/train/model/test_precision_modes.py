"""``train.precision = "fp32" | "tf32" | "bf16"``: the TF32 switches a run sets and puts back.

The switch (``torch.backends.cuda.matmul.allow_tf32``) exists without CUDA, so these run
on CPU: what a run sets is checked where the model runs (forward and backward hooks
record the switch), and that it is back as it was afterwards. On CPU ``tf32`` trains
exactly as ``fp32`` (CPU matmuls ignore the switch) and says so in one log line.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from recaccel.cli import train_main
from recaccel.config import load_config
from recaccel.io.convert.synth import generate_synthetic
from recaccel.train.loop.trainer import Trainer
from recaccel.train.model.precision import matmul_precision, runs_as

TINY = [
    "synth.train_rows=2000",
    "synth.test_rows=1000",
    "synth.num_dense=3",
    "synth.num_sparse=4",
    "synth.cardinality=50",
    "synth.multi_hot_fields=1",
    "synth.rows_per_row_group=500",
    "synth.rows_per_file=1000",
    "data.batch_size=128",
    "data.shuffle_buffer_rows=500",
    "model.embedding_dim=8",
    "model.bottom_mlp=[16, 8]",
    "model.top_mlp=[16, 1]",
    "train.steps=6",
    "train.eval_every=3",
    "train.log_every=100",
    "train.progress=false",
    "train.device=cpu",
]
SWITCHES = ("matmul", "cudnn")


_STRING_OWNERS = [
    (owner, "fp32_precision")
    for owner in (torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn)
    if hasattr(owner, "fp32_precision")
]


def _fp32_precision_strings() -> list[str]:
    return [getattr(owner, name) for owner, name in _STRING_OWNERS]


def _switches() -> tuple[bool, bool]:
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


@pytest.fixture
def switches():
    """Puts the process's TF32 switches back after the test, whatever it set."""
    saved, strings = _switches(), _fp32_precision_strings()
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    for (owner, name), value in zip(_STRING_OWNERS, strings):
        setattr(owner, name, value)  # the legacy setter above leaves "ieee" where "none" was


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("precision_modes")
    generate_synthetic(load_config(None, [*TINY, f'synth.out_dir="{root}"']).synth)
    return root


def _config(data: Path, out: Path, *extra: str):
    return load_config(
        None,
        [
            *TINY,
            f'data.train="{data / "train"}"',
            f'data.test="{data / "test"}"',
            f'train.out_dir="{out}"',
            *extra,
        ],
    )


def _record_switches(trainer: Trainer) -> list[tuple[str, tuple[bool, bool]]]:
    """Hooks on the top MLP that record (phase, switches) each time it runs forward or backward."""
    seen: list[tuple[str, tuple[bool, bool]]] = []
    top = trainer.objective.module.over_arch
    phase = lambda: "train" if top.training else "eval"  # noqa: E731
    top.register_forward_hook(lambda *_: seen.append((f"{phase()} forward", _switches())))
    top.register_full_backward_hook(lambda *_: seen.append(("backward", _switches())))
    return seen


@pytest.mark.parametrize(
    ("precision", "before", "inside"),
    [
        ("tf32", (False, False), (True, True)),
        ("fp32", (True, True), (False, False)),
        ("bf16", (True, False), (False, False)),
    ],
)
def test_matmul_precision_sets_the_tf32_switches_inside_and_restores_them_after(
    switches, precision, before, inside
):
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
    with matmul_precision(precision):
        assert _switches() == inside
    assert _switches() == before


def test_matmul_precision_restores_the_switches_when_the_body_raises(switches):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    with pytest.raises(RuntimeError, match="boom"), matmul_precision("tf32"):
        assert _switches() == (True, True)
        raise RuntimeError("boom")
    assert _switches() == (False, False)


def test_nested_modes_restore_the_outer_mode(switches):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    with matmul_precision("tf32"):
        with matmul_precision("fp32"):
            assert _switches() == (False, False)
        assert _switches() == (True, True)
    assert _switches() == (False, False)


def test_tf32_runs_as_fp32_off_cuda_and_as_tf32_on_cuda():
    assert runs_as("tf32", torch.device("cpu")) == "fp32"
    assert runs_as("tf32", torch.device("cuda")) == "tf32"
    assert runs_as("bf16", torch.device("cpu")) == "bf16"
    assert runs_as("fp32", torch.device("cuda")) == "fp32"


@pytest.mark.parametrize(("precision", "expected"), [("tf32", (True, True)), ("fp32", (False, False))])
def test_fit_holds_the_mode_in_every_forward_backward_and_evaluation_then_restores_it(
    switches, tiny_data, tmp_path, precision, expected
):
    outside = (not expected[0], not expected[1])  # the opposite, so a switch left unset would show
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = outside
    trainer = Trainer(_config(tiny_data, tmp_path / precision, f"train.precision={precision}"))
    seen = _record_switches(trainer)
    trainer.fit()
    assert _switches() == outside
    phases = {phase for phase, _ in seen}
    assert phases == {"train forward", "backward", "eval forward"}, phases
    assert all(state == expected for _, state in seen), seen


def test_evaluating_a_checkpoint_alone_multiplies_as_its_training(switches, tiny_data, tmp_path):
    cfg = _config(tiny_data, tmp_path / "run", "train.precision=tf32")
    Trainer(cfg).fit()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    trainer = Trainer(cfg, resume=True)  # what recaccel-eval builds
    seen = _record_switches(trainer)
    trainer.evaluate()
    assert seen and all(state == (True, True) for _, state in seen), seen
    assert _switches() == (False, False)


def test_tf32_on_cpu_trains_exactly_as_fp32_and_says_so_once(switches, tiny_data, tmp_path, caplog):
    fp32 = Trainer(_config(tiny_data, tmp_path / "fp32", "train.precision=fp32")).fit()
    with caplog.at_level(logging.INFO, logger="recaccel.train.model.precision"):
        tf32 = Trainer(_config(tiny_data, tmp_path / "tf32", "train.precision=tf32")).fit()
    said = [r.getMessage() for r in caplog.records if r.name == "recaccel.train.model.precision"]
    assert said == ["train.precision=tf32 runs as fp32 on cpu (TF32 is a CUDA tensor-core mode)"]
    # Same host, same process: CPU matmuls ignore the switch, so the runs are identical.
    assert (tf32["auc"], tf32["logloss"], tf32["train_loss"]) == (
        fp32["auc"],
        fp32["logloss"],
        fp32["train_loss"],
    )


def test_an_unknown_precision_is_one_line_naming_the_key_and_exit_2(tiny_data, tmp_path, capsys):
    argv = [arg for o in TINY for arg in ("--set", o)]
    argv += ["--set", f'train.out_dir="{tmp_path / "bad"}"', "--set", "train.precision=fp16"]
    assert train_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train.precision" in err and "tf32" in err, err
    assert not (tmp_path / "bad" / "metrics.json").exists()


def test_tf32_is_recorded_in_the_run_config(switches, tiny_data, tmp_path):
    out = tmp_path / "run"
    Trainer(_config(tiny_data, out, "train.precision=tf32")).fit()
    assert 'precision = "tf32"' in (out / "config.toml").read_text()
    assert json.loads((out / "metrics.json").read_text())["steps"] == 6


@pytest.mark.gpu
def test_tf32_on_cuda_holds_the_switch_through_fit_and_lands_near_fp32(switches, tiny_data, tmp_path):
    """On CUDA tf32 is a real mode: the switch is on in every forward and backward of the
    fit, off again after it, and the run lands near fp32's AUC (tiny data: a loose bound)."""
    assert torch.cuda.is_available()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    fp32 = Trainer(_config(tiny_data, tmp_path / "fp32", "train.device=cuda")).fit()
    trainer = Trainer(_config(tiny_data, tmp_path / "tf32", "train.device=cuda", "train.precision=tf32"))
    seen = _record_switches(trainer)
    tf32 = trainer.fit()
    assert seen and all(state == (True, True) for _, state in seen), seen
    assert _switches() == (False, False)
    assert abs(tf32["auc"] - fp32["auc"]) < 0.02, (tf32["auc"], fp32["auc"])
