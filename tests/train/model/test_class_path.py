"""A model of one's own named from the CLI (model.class_path, model.init_args): it trains,
resumes exactly and evaluates from the run's config.toml alone; a bad class path is one
line and exit status 2 before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import recaccel
from recaccel.api import run_config
from recaccel.cli import eval_main, train_main
from recaccel.cli.export import export_main
from recaccel.config import load_config
from recaccel.errors import ConfigError
from recaccel.train.checkpoint.state import list_checkpoints
from tests.helpers.dlrm_run import overrides, set_args

MODELS = "tests.train.model.class_path_models"
OWN = [f'model.class_path="{MODELS}:ConcatMLP"', "model.init_args={hidden = 12}"]


def _final_model(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(list_checkpoints(run)[-1], weights_only=True)["model"]


@pytest.fixture(scope="module")
def own_runs(tiny_data, tmp_path_factory):  # noqa: F811
    """The same class-path run trained 14 steps straight, and 6 steps then resumed to 14."""
    root = tmp_path_factory.mktemp("class_path")
    full, part = root / "full", root / "part"
    common = [*OWN, "train.epochs=2"]
    assert train_main(set_args(overrides(tiny_data, full, *common, "train.steps=14"))) == 0
    assert train_main(set_args(overrides(tiny_data, part, *common, "train.steps=6"))) == 0
    assert train_main(["--resume", str(part), "--set", "train.steps=14"]) == 0
    return full, part


def test_a_class_path_model_trains_with_its_init_args_from_the_cli(own_runs):
    full, _ = own_runs
    state = _final_model(full)
    assert state["mlp.0.weight"].shape[0] == 12  # init_args reached the constructor
    assert not any(k.startswith("dense_arch.") for k in state)  # not recaccel's DLRM
    metrics = json.loads((full / "metrics.json").read_text())
    assert metrics["steps"] == 14 and 0.5 < metrics["auc"] <= 1.0
    saved = load_config(full / "config.toml")
    assert saved.model.class_path == f"{MODELS}:ConcatMLP" and saved.model.init_args == {"hidden": 12}


def test_a_class_path_run_resumes_exactly_from_its_config(own_runs):
    full, part = own_runs
    a, b = _final_model(full), _final_model(part)
    assert set(a) == set(b)
    for key, value in a.items():
        assert torch.equal(value, b[key]), key
    ma = json.loads((full / "metrics.json").read_text())
    mb = json.loads((part / "metrics.json").read_text())
    assert ma["auc"] == mb["auc"] and ma["logloss"] == mb["logloss"]


def test_a_class_path_run_evaluates_from_its_config(own_runs, tmp_path, capsys):
    full, _ = own_runs
    out = tmp_path / "eval.json"
    assert eval_main([str(full), "--out", str(out)]) == 0
    scored = json.loads(out.read_text())
    trained = json.loads((full / "metrics.json").read_text())
    assert scored["checkpoint_step"] == 14
    assert scored["auc"] == pytest.approx(trained["auc"], abs=1e-6)


def test_export_refuses_a_class_path_run_in_one_line(own_runs, tmp_path, capsys):
    full, _ = own_runs
    code = export_main([str(full), str(tmp_path / "m.pt2"), "--format", "torch_export"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "model.class_path" in err and "recaccel's DLRM and MeLU only" in err


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (['model.class_path="no_such_module_xyz:Model"'], "no module 'no_such_module_xyz'"),
        ([f'model.class_path="{MODELS}:Missing"'], "has no 'Missing'"),
        (
            ['model.class_path="tests.train.model.class_path_broken:Model"'],
            "importing 'tests.train.model.class_path_broken' failed: RuntimeError: this module needs a GPU driver",
        ),
        ([f'model.class_path="{MODELS}:NOT_CALLABLE"'], "names a int, not a class"),
        (['model.class_path="ConcatMLP"'], "must look like package.module:Class"),
        ([*OWN[:1], "model.init_args={width = 3}"], "init_args={width = 3} does not fit"),
        ([*OWN[:1], "model.init_args={hidden = 4, extra = 1}"], "got an unexpected keyword"),
        (["model.init_args={hidden = 4}"], "is for model.class_path, which is unset"),
        ([f'model.class_path="{MODELS}:NoHead"'], "model NoHead has no head: a model needs"),
        ([f'model.class_path="{MODELS}:not_a_module"'], "built a str, not a torch nn.Module"),
    ],
)
def test_a_bad_class_path_is_one_line_and_exit_2(tiny_data, tmp_path, capsys, sets, expected):  # noqa: F811
    run = tmp_path / "run"
    code = train_main(set_args(overrides(tiny_data, run, *sets)))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("recaccel-train: error: ") and expected in err, err
    assert not list_checkpoints(run)


def test_model_argument_and_class_path_together_are_refused(tiny_data, tmp_path):  # noqa: F811
    from tests.train.model.class_path_models import ConcatMLP

    cfg = load_config(None, overrides(tiny_data, tmp_path / "run", *OWN, "train.steps=2"))
    with pytest.raises(ConfigError, match=r"model= and config key model.class_path=.* both name the model"):
        recaccel.train(cfg, model=lambda schema, device: ConcatMLP(cfg, schema, device))
    assert not list_checkpoints(tmp_path / "run")


def test_the_python_api_trains_a_class_path_config_alone(tiny_data, tmp_path):  # noqa: F811
    cfg = load_config(None, overrides(tiny_data, tmp_path / "run", *OWN, "train.steps=3"))
    assert recaccel.train(cfg)["steps"] == 3
    assert "mlp.0.weight" in _final_model(tmp_path / "run")
    scored = recaccel.evaluate(run_config(tmp_path / "run"))
    assert scored["checkpoint_step"] == 3
