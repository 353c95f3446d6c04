"""recaccel-eval: scoring a run's checkpoints, the metrics it writes, and per-row predictions
checked against an independent forward of the checkpoint's model (and scikit-learn's AUC)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recaccel.cli import eval_main, train_main
from recaccel.config import load_config
from recaccel.io.convert.synth import generate_synthetic
from recaccel.train.evaluation.predictions import METADATA_KEY, row_columns, write_predictions
from tests.helpers.eval_run import EVERY, STEPS, printed_metrics
from tests.helpers.meta_run import write_ratings


def _reference_probs(run: Path, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Click probabilities [N] and labels [N] of the test rows in file order, from the
    checkpoint file loaded by hand into a model with the reference embedding backend."""
    from recaccel.io.format.dataset import open_dataset
    from recaccel.io.readers.rows import BatchReader
    from recaccel.models.factory import build_model

    cfg = load_config(run / "config.toml")
    model_cfg = dataclasses.replace(cfg.model, embedding_backend="reference")
    model = build_model(model_cfg, cfg.optim, open_dataset(cfg.data.train).schema, torch.device("cpu"))
    saved = torch.load(run / "checkpoints" / f"step-{step:09d}.pt", weights_only=True)
    model.load_state_dict(saved["model"])
    model.eval()
    probs = []
    with torch.no_grad():
        for batch in BatchReader.from_config(cfg.data.test, cfg.data, train=False):
            probs.append(torch.sigmoid(model(batch).double()))
    files = sorted(Path(cfg.data.test).glob("*.parquet"))
    labels = pa.concat_tables([pq.read_table(f, columns=["label"]) for f in files])["label"].to_numpy()
    return torch.cat(probs).numpy(), labels


def test_eval_scores_newest_checkpoint_and_writes_predictions(dlrm_run, tmp_path, capsys):
    from sklearn.metrics import log_loss, roc_auc_score

    before = (dlrm_run / "metrics.json").read_bytes()
    preds = tmp_path / "out" / "preds.parquet"
    assert eval_main([str(dlrm_run), "--predictions", str(preds)]) == 0
    printed = printed_metrics(capsys.readouterr().out)
    written = json.loads((dlrm_run / f"eval-{STEPS}.json").read_text())
    assert (dlrm_run / "metrics.json").read_bytes() == before  # the run's record is untouched
    assert written["checkpoint_step"] == STEPS and float(printed["checkpoint_step"]) == STEPS
    # The final checkpoint is the trained model: the run's own final evaluation again.
    run_metrics = json.loads(before)
    assert written["auc"] == pytest.approx(run_metrics["auc"], abs=1e-12)
    assert float(printed["auc"]) == pytest.approx(written["auc"], abs=1e-5)

    table = pq.read_table(preds)
    assert table.column_names == ["label", "prediction"]  # no weights in this data
    assert json.loads(table.schema.metadata[METADATA_KEY])["checkpoint_step"] == STEPS
    probs, labels = _reference_probs(dlrm_run, STEPS)
    assert table.num_rows == written["eval_rows"] == labels.size == 2000
    np.testing.assert_array_equal(table["label"].to_numpy(), labels)
    np.testing.assert_allclose(table["prediction"].to_numpy(), probs, atol=1e-6)
    assert roc_auc_score(labels, table["prediction"].to_numpy()) == pytest.approx(written["auc"], abs=1e-9)
    assert log_loss(labels, table["prediction"].to_numpy()) == pytest.approx(written["logloss"], abs=1e-6)


def test_eval_named_checkpoint_other_data_and_out(dlrm_run, tmp_path, capsys):
    out = tmp_path / "older.json"
    train_dir = load_config(dlrm_run / "config.toml").data.train
    argv = [str(dlrm_run), "--checkpoint", str(EVERY), "--data", train_dir, "--out", str(out)]
    assert eval_main([*argv, "--predictions", str(tmp_path / "p.parquet")]) == 0
    older = json.loads(out.read_text())
    assert older["checkpoint_step"] == EVERY and older["data"] == train_dir and older["eval_rows"] == 6000
    assert not (dlrm_run / f"eval-{EVERY}.json").exists()
    probs = pq.read_table(tmp_path / "p.parquet")["prediction"].to_numpy()
    newest = _reference_probs(dlrm_run, STEPS)[0]
    assert probs.size == 6000 and not np.allclose(probs[: newest.size], newest)  # another model


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--checkpoint", "7"], "no checkpoint at step 7; available steps: 6, 12"),
        (["--out", "{run}/metrics.json"], "is the run's own metrics.json"),
    ],
)
def test_eval_refusals_are_one_line(dlrm_run, capsys, argv, expected):
    argv = [a.replace("{run}", str(dlrm_run)) for a in argv]
    assert eval_main([str(dlrm_run), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("recaccel-eval: error:") and expected in err


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            "synth.cardinality=80",
            "is not a row of the model's table (valid ids are 0..49; the data scored)",
        ),
        ("synth.num_sparse=5", "(the data scored; the model was built from data.train)"),
    ],
)
def test_eval_data_the_model_cannot_read_is_one_line_naming_the_file(
    dlrm_run, tmp_path, capsys, change, expected
):
    """Ids past the model's tables, another schema: named with the file, as training names
    its data.test (the lookup's own error named a column only)."""
    from tests.helpers.dlrm_run import TINY

    generate_synthetic(load_config(None, [*TINY, change, f'synth.out_dir="{tmp_path / "other"}"']).synth)
    test = tmp_path / "other" / "test"
    assert eval_main([str(dlrm_run), "--data", str(test), "--out", str(tmp_path / "m.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        len(err.splitlines()) == 1
        and err.startswith(f"recaccel-eval: error: file {test}")
        and expected in err
    )
    assert not (tmp_path / "m.json").exists()


def test_eval_without_run_or_checkpoint(tmp_path, capsys):
    assert eval_main([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"run directory {tmp_path / 'nope'} does not exist" in err
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    assert eval_main([str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has no checkpoint" in err


def test_meta_predictions_per_task(tmp_path_factory, tmp_path):
    root = tmp_path_factory.mktemp("meta_eval")
    train, test = (
        write_ratings(root / "train", range(0, 48), 0),
        write_ratings(root / "test", range(48, 64), 1),
    )
    run = tmp_path / "meta"
    sets = [
        f'data.train="{train}"',
        f'data.test="{test}"',
        f'train.out_dir="{run}"',
        "train.progress=false",
        "train.mode=meta",
        "train.steps=8",
        "tasks.tasks_per_batch=8",
        "tasks.support_size=16",
        "tasks.query_size=8",
        "tasks.query_count=5",
        "tasks.min_task_rows=6",
        "model.embedding_dim=8",
        "model.bottom_mlp=[8]",
        "model.top_mlp=[16, 1]",
        "meta.inner_lr=0.1",
    ]
    assert train_main([a for s in sets for a in ("--set", s)]) == 0
    preds = tmp_path / "meta.parquet"
    assert eval_main([str(run), "--predictions", str(preds)]) == 0
    metrics = json.loads((run / "eval-8.json").read_text())
    rows = pq.read_table(preds).to_pandas()
    assert list(rows.columns) == ["task", "query", "label", "prediction", "prediction_no_adapt"]
    query, support = rows[rows["query"]], rows[~rows["query"]]
    assert len(query) == metrics["query_rows"] and rows["task"].nunique() == metrics["tasks"] == 16
    assert support["prediction"].isna().all() and support["prediction_no_adapt"].isna().all()
    assert len(support) > 0 and not query["prediction"].isna().any()
    for column, key in (("prediction", "mae"), ("prediction_no_adapt", "mae_no_adapt")):
        mae = (query[column] - query["label"]).abs().mean()
        assert mae == pytest.approx(metrics[key], abs=1e-6)
    # Every row is one of its task's rows in the data (the task key is the user).
    data = pa.concat_tables([pq.read_table(f) for f in sorted(test.glob("*.parquet"))]).to_pandas()
    for task, part in rows.groupby("task"):
        own = data.loc[data["user"] == task, "label"].to_numpy()
        assert np.isin(part["label"].to_numpy(), own).all() and len(part) <= own.size


def test_write_predictions_keeps_weights_and_nulls(tmp_path):
    logits = torch.tensor([-1.0, 0.0, 20.0, 21.0])
    cols = row_columns(logits, torch.tensor([0.0, 1.0, 1.0, 1.0]), torch.tensor([1.0, 2.0, 0.5, 1.0]), "bce")
    path = write_predictions(tmp_path / "p.parquet", cols, {"loss": "bce"})
    table = pq.read_table(path)
    assert table.column_names == ["label", "weight", "prediction"]
    assert table["weight"].to_pylist() == [1.0, 2.0, 0.5, 1.0]
    prob = table["prediction"].to_numpy()
    assert (
        prob[0] == pytest.approx(1 / (1 + math.exp(1.0))) and prob[2] < prob[3]
    )  # float64 keeps what float32 would round to 1
    mse = row_columns(torch.tensor([3.5]), torch.tensor([4.0]), None, "mse")
    assert write_predictions(tmp_path / "r.parquet", mse, {}) and pq.read_table(tmp_path / "r.parquet")[
        "prediction"
    ].to_pylist() == [3.5]


@pytest.mark.slow
def test_hybrid_run_evaluates_in_one_process(tmp_path):
    """A 2-rank gloo run's step-*.dcp checkpoints (row-wise shards + a data-parallel table),
    read whole: the same scores as the ranks' own final evaluation."""
    pytest.importorskip("torchrec", exc_type=ImportError)
    from sklearn.metrics import roc_auc_score

    from tests.helpers.hybrid_run import HYBRID_TINY, hybrid_set_args

    data, run = tmp_path / "data", tmp_path / "hybrid"
    generate_synthetic(load_config(None, [*HYBRID_TINY, f'synth.out_dir="{data}"']).synth)
    extra = [
        "train.steps=8",
        "train.checkpoint_every=4",
        "parallel.mode=hybrid",
        "parallel.sharding=row_wise",
    ]
    argv = hybrid_set_args(data, run, *extra, 'parallel.table_sharding=["C2=data_parallel"]')
    assert train_main([*argv, "--nproc", "2"]) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step-000000004.dcp",
        "step-000000008.dcp",
    ]
    preds = tmp_path / "p.parquet"
    assert eval_main([str(run), "--predictions", str(preds)]) == 0
    ranks = json.loads((run / "metrics.json").read_text())
    mine = json.loads((run / "eval-8.json").read_text())
    for key in ("auc", "logloss", "eval_rows"):
        assert mine[key] == pytest.approx(ranks[key], abs=1e-6), key
    table = pq.read_table(preds)
    assert roc_auc_score(table["label"].to_numpy(), table["prediction"].to_numpy()) == pytest.approx(
        mine["auc"], abs=1e-9
    )
    assert eval_main([str(run), "--checkpoint", "4"]) == 0
    assert json.loads((run / "eval-4.json").read_text())["auc"] != mine["auc"]
