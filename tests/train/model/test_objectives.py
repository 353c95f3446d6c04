"""A model that diverged ends evaluation in one line (exit 2), not NaN metrics or a traceback."""

from __future__ import annotations

import math

import pytest
import torch

from recaccel.cli import train_main
from recaccel.config import Config, load_config
from recaccel.errors import DataError
from recaccel.io.convert.synth import generate_synthetic
from recaccel.metrics import MetricError, StreamingBinaryMetrics
from recaccel.sparse import Batch, SparseFeatures
from recaccel.train.model.objectives import DLRMObjective

SYNTH = [
    "synth.train_rows=600",
    "synth.test_rows=300",
    "synth.num_dense=2",
    "synth.num_sparse=2",
    "synth.cardinality=20",
    "synth.multi_hot_fields=0",
    "synth.rows_per_row_group=300",
    "synth.rows_per_file=600",
]


@pytest.mark.parametrize("kind", ["bce", "mse"])
def test_metrics_reject_non_finite_predictions(kind):
    objective = DLRMObjective(Config(), torch.nn.Identity(), kind)
    logits = torch.tensor([0.2, -1.0, math.nan, 0.5])
    match = r"evaluation: model predictions: 1 of 4 values .* index 2: nan.*diverged"
    with pytest.raises(MetricError, match=match):
        objective.metrics(logits, torch.tensor([0.0, 1.0, 1.0, 0.0]))


def test_diverged_model_is_a_one_line_error(tmp_path, capsys):
    data = tmp_path / "synth"
    generate_synthetic(load_config(None, [*SYNTH, f'synth.out_dir="{data}"']).synth)
    sets = [
        *SYNTH,
        f'data.train="{data / "train"}"',
        f'data.test="{data / "test"}"',
        f'train.out_dir="{tmp_path / "run"}"',
        "data.batch_size=100",
        "model.embedding_dim=4",
        "model.bottom_mlp=[4]",
        "model.top_mlp=[4, 1]",
        "train.steps=4",
        "train.progress=false",
        "optim.lr=1e30",
        "optim.sparse_lr=1e30",
    ]
    assert train_main([a for s in sets for a in ("--set", s)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "evaluation: model predictions" in err and "diverged" in err


class _Scores(torch.nn.Module):
    """A model whose logit is the batch's first dense column (what evaluation sees)."""

    def forward(self, batch):
        return batch.dense[:, 0]


def _rows(logits: list[float], labels: list[float]) -> Batch:
    n = len(logits)
    sparse = SparseFeatures(["a"], torch.zeros(n, dtype=torch.int64), torch.arange(n + 1))
    return Batch(torch.tensor(logits).reshape(n, 1), sparse, torch.tensor(labels))


def test_dlrm_evaluation_scores_the_gathered_predictions_of_all_ranks():
    # AUC is not a mean of per-rank parts: the objective computes it over what `gather`
    # returns (here: another rank's rows appended), not over this rank's rows.
    objective = DLRMObjective(Config(), _Scores(), "bce")
    local = [_rows([0.9, 0.1], [1.0, 0.0])]
    # The other rank's accumulator, its state in the order evaluation gathers it.
    other = StreamingBinaryMetrics()
    other.update(torch.tensor([0.8, 0.7]), torch.tensor([0.0, 1.0]))
    state = other.state()
    parts = (
        state["sums"].view(1, -1),
        state["bins"],
        state["coarse"].to(torch.uint8),
        state["keys"],
        state["weights"],
    )
    calls = iter(parts)

    def gather(tensor):
        return torch.cat([tensor, next(calls)])

    metrics = objective.evaluate(local, gather=gather, source="test/")
    assert metrics["eval_rows"] == 4
    assert metrics["auc"] == pytest.approx(0.75)  # 3 of the 4 positive-negative pairs in order
    alone = objective.evaluate(local, gather=lambda t: t, source="test/")
    assert alone["eval_rows"] == 2 and alone["auc"] == pytest.approx(1.0)


def test_dlrm_evaluation_of_no_rows_names_the_data():
    objective = DLRMObjective(Config(), _Scores(), "mse")
    with pytest.raises(DataError, match=r"^evaluation data data/empty has no rows$"):
        objective.evaluate([], gather=lambda t: t, source="data/empty")
