"""train.loggers: TensorBoard event files hold each event's numbers as scalars (read back
with TensorBoard's EventAccumulator); log.jsonl is written as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recaccel.cli import train_main
from recaccel.errors import ConfigError
from recaccel.train.run.runlog import TENSORBOARD_DIR, RunLog, read_events, scalars
from tests.helpers.resume import small_sets

pytest.importorskip("tensorboard", exc_type=ImportError)

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def _scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(run / TENSORBOARD_DIR), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_holds_loss_metrics_rates_throughput(small_data, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    sets = [
        'train.loggers=["jsonl", "tensorboard"]',
        "train.steps=8",
        "train.log_every=2",
        "train.eval_every=4",
        "optim.schedule=linear",
        "optim.warmup_steps=2",
        "optim.final_lr_ratio=0.5",
    ]
    assert train_main(small_sets(small_data, run, *sets)) == 0
    events = read_events(run)
    got = _scalars(run)
    train = [e for e in events if e["event"] == "train"]
    for key in ("loss", "lr", "sparse_lr", "samples_per_s", "data_wait_s"):
        want = [(e["step"], e[key]) for e in train]
        assert [s for s, _ in got[f"train/{key}"]] == [s for s, _ in want]
        assert [v for _, v in got[f"train/{key}"]] == pytest.approx([v for _, v in want], rel=1e-6)
    evals = [e for e in events if e["event"] == "eval"]
    assert [s for s, _ in got["eval/auc"]] == [4, 8] and [s for s, _ in got["eval/logloss"]] == [4, 8]
    assert [v for _, v in got["eval/auc"]] == pytest.approx([e["auc"] for e in evals], rel=1e-6)
    final = events[-1]
    assert got["final/auc"] == [(8, pytest.approx(final["auc"], rel=1e-6))]
    assert got["final/data/rows_read"][0][1] == final["data"]["rows_read"]  # nested: a/b
    assert "train/step" not in got and "train/epoch" not in got


def test_cache_hit_rate_reaches_tensorboard(small_data, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    sets = [
        'train.loggers=["jsonl", "tensorboard"]',
        "train.steps=4",
        "train.log_every=2",
        "model.embedding_placement=host",
        "model.embedding_backend=reference",
        "model.cache_rows=90",  # the whole pack: ids miss on first use, hit after
        "model.cache_lookahead=1",
        "optim.sparse=sgd",
    ]
    assert train_main(small_sets(small_data, run, *sets)) == 0
    train = [e for e in read_events(run) if e["event"] == "train"]
    got = _scalars(run)
    assert [v for _, v in got["train/cache_hit_rate"]] == pytest.approx([e["cache_hit_rate"] for e in train])


def test_jsonl_only_by_default_and_log_unchanged(small_data, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    assert train_main(small_sets(small_data, run, "train.steps=3", "train.log_every=1")) == 0
    assert not (run / TENSORBOARD_DIR).exists()
    lines = (run / "log.jsonl").read_text().splitlines()
    assert [json.loads(line)["event"] for line in lines] == ["train"] * 3 + ["final"]
    assert read_events(run) == [json.loads(line) for line in lines]


def test_resumed_run_purges_what_came_after_its_checkpoint(tmp_path):
    log = RunLog(tmp_path, loggers=["jsonl", "tensorboard"])
    for step in (1, 2, 3, 4):
        log.event("train", step=step, loss=float(step))
    log.close()
    log = RunLog(tmp_path, loggers=["jsonl", "tensorboard"], resumed_at=2)  # stretch 3, 4 trained again
    for step in (3, 4):
        log.event("train", step=step, loss=10.0 * step)
    log.close()
    assert _scalars(tmp_path)["train/loss"] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_scalars_flatten_numbers_only():
    record = {
        "event": "final",
        "time": 1.0,
        "step": 3,
        "auc": 0.7,
        "ok": True,
        "name": "x",
        "nan": float("nan"),
    }
    record["states"] = {"warm": {"mae": 0.9, "rows": 4}}
    assert dict(scalars(record)) == {"auc": 0.7, "states/warm/mae": 0.9, "states/warm/rows": 4.0}


def test_read_events_skips_a_torn_line_and_names_a_missing_log(tmp_path):
    (tmp_path / "log.jsonl").write_text('{"event": "train", "step": 1}\n{"event": "tr')
    assert read_events(tmp_path) == [{"event": "train", "step": 1}]
    with pytest.raises(FileNotFoundError, match="no run log"):
        read_events(tmp_path / "nothing")


def test_missing_tensorboard_is_a_config_error(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match="train.loggers=tensorboard needs the tensorboard package"):
        RunLog(tmp_path, loggers=["jsonl", "tensorboard"])
    assert not (tmp_path / "log.jsonl").exists()


def test_csv_logger_writes_one_row_per_log_step_with_a_stable_header(small_data, tmp_path):  # noqa: F811
    import csv

    from recaccel.train.run.loggers import CSV_COLUMNS

    run = tmp_path / "run"
    sets = ['train.loggers=["jsonl", "csv"]', "train.steps=6", "train.log_every=2", "train.metric_window=300"]
    assert train_main(small_sets(small_data, run, *sets)) == 0
    with open(run / "metrics.csv", newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert tuple(reader.fieldnames) == CSV_COLUMNS
    train = [e for e in read_events(run) if e["event"] == "train"]
    assert [int(r["step"]) for r in rows] == [e["step"] for e in train] == [1, 2, 4, 6]
    assert [float(r["loss"]) for r in rows] == pytest.approx([e["loss"] for e in train])
    assert [r["grad_norm"] for r in rows] == [""] * 4  # clipping is off: no norm
    assert [int(r["window_rows"]) for r in rows] == [128, 256, 300, 300]


def test_metric_window_scores_exactly_the_last_rows_of_the_training_logits():
    import torch

    from recaccel.metrics import binary_auc, binary_logloss
    from recaccel.train.evaluation.evaluate import MetricWindow

    g = torch.Generator().manual_seed(11)
    window = MetricWindow(250, "bce")
    logits, labels = torch.randn(1000, generator=g), (torch.rand(1000, generator=g) < 0.4).float()
    for start in range(0, 1000, 96):
        window.add(logits[start : start + 96], labels[start : start + 96])
    got = window.metrics()
    assert got["window_rows"] == 250
    assert got["window_auc"] == pytest.approx(binary_auc(logits[-250:], labels[-250:]), abs=1e-12)
    expected = binary_logloss(torch.sigmoid(logits[-250:].double()), labels[-250:])
    assert got["window_logloss"] == pytest.approx(expected, rel=1e-9)


def test_gradient_norm_is_logged_when_clipping_is_on(small_data, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    sets = ["train.steps=4", "train.log_every=2", "optim.grad_clip_norm=0.01"]
    assert train_main(small_sets(small_data, run, *sets)) == 0
    norms = [e["grad_norm"] for e in read_events(run) if e["event"] == "train"]
    assert len(norms) == 3 and all(n > 0 for n in norms)


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_wandb_and_mlflow_without_their_package_are_one_line_errors(
    name,
    small_data,  # noqa: F811
    tmp_path,
    capsys,
    monkeypatch,
):
    import sys

    monkeypatch.setitem(sys.modules, name, None)  # absent even where it is installed
    run = tmp_path / "run"
    assert train_main(small_sets(small_data, run, f'train.loggers=["jsonl", "{name}"]', "train.steps=2")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"recaccel-train: error: config key train.loggers has '{name}' but the {name} package is not "
        f"installed (pip install {name}), or leave '{name}' out"
    )


def test_tensorboard_holds_the_hyperparameters_and_the_config(small_data, tmp_path):  # noqa: F811
    from tensorboard.plugins.hparams import plugin_data_pb2

    run = tmp_path / "run"
    sets = ['train.loggers=["jsonl", "tensorboard"]', "train.steps=2", "optim.lr=0.0125"]
    assert train_main(small_sets(small_data, run, *sets)) == 0
    acc = EventAccumulator(str(run / TENSORBOARD_DIR), size_guidance={"tensors": 0})
    acc.Reload()
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    start = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    assert start.hparams["optim.lr"].number_value == pytest.approx(0.0125)
    assert start.hparams["train.loggers"].string_value == '["jsonl", "tensorboard"]'
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "lr = 0.0125" in text


def test_resumed_csv_keeps_the_rows_up_to_its_checkpoint_once(tmp_path):
    import csv

    log = RunLog(tmp_path, loggers=["jsonl", "csv"])
    for step in (1, 2, 3, 4):
        log.event("train", step=step, loss=float(step))
    log.close()
    log = RunLog(tmp_path, loggers=["jsonl", "csv"], resumed_at=2)  # steps 3, 4 trained again
    for step in (3, 4):
        log.event("train", step=step, loss=10.0 * step)
    log.event("eval", step=4, auc=0.7)  # not a log step: no row
    log.close()
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = [(int(r["step"]), float(r["loss"])) for r in csv.DictReader(f)]
    assert rows == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
