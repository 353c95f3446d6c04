"""Per-row predictions of an evaluation, written as Parquet.

One output row per evaluation row, in the order the evaluation read them (the data's order
in one process: evaluation neither shuffles nor drops rows):

- DLRM runs: ``prediction`` (float64: the click probability for BCE, the rating for MSE),
  ``label`` (float32), and ``weight`` (float32) when the data has sample weights.
- meta runs (and ``train.eval_tasks``): also ``task`` (int64, the task key) and ``query``
  (bool: True for a query row, False for a support row the model adapted on). Rows are
  task by task, support rows first. ``prediction`` is after adaptation and
  ``prediction_no_adapt`` from the meta-parameters as they are; both are null on support
  rows (their labels were the model's input, not scored). No ``weight`` column: a task
  batch's ``Batch.weights`` are its row masks, not sample weights.

Columns are built as tensors (:func:`row_columns`, :func:`task_columns`) where evaluation
runs, and written by :func:`write_predictions`.

Shapes: N rows, T tasks, S support and Q query rows per task.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from recaccel.config import Loss
from recaccel.sparse import TaskBatch

# Receives the columns of every evaluation row, once per evaluation.
PredictionSink = Callable[[dict[str, Tensor]], None]
METADATA_KEY = b"recaccel.predictions"
_NULL_ON_SUPPORT = ("prediction", "prediction_no_adapt")


def _scale(outputs: Tensor, loss: Loss) -> Tensor:
    """Model outputs -> predictions: probabilities (float64 keeps distinct logits distinct)
    for BCE, the outputs themselves for MSE."""
    outputs = outputs.detach().cpu().double()
    return torch.sigmoid(outputs) if loss == "bce" else outputs


def row_columns(logits: Tensor, labels: Tensor, weights: Tensor | None, loss: Loss) -> dict[str, Tensor]:
    """Columns of a DLRM evaluation.

    Args:
        logits: [N] model outputs (logits for BCE, ratings for MSE).
        labels: [N].
        weights: [N] sample weights, or None.
        loss: the run's loss kind.
    """
    out = {"prediction": _scale(logits, loss), "label": labels.detach().cpu().float()}
    if weights is not None:
        out["weight"] = weights.detach().cpu().float()
    return out


def task_columns(tb: TaskBatch, pred: Tensor, pred0: Tensor, loss: Loss) -> dict[str, Tensor]:
    """Columns of one evaluated TaskBatch: its real support and query rows, task by task.

    Args:
        tb: T tasks of S support and Q query rows.
        pred: [T, Q] query outputs after adaptation.
        pred0: [T, Q] query outputs without adaptation.
        loss: the run's loss kind.
    """
    t, s, q = tb.num_tasks, tb.support_size, tb.query_size
    real = torch.cat([tb.support_mask, tb.query_mask], 1).cpu() > 0  # [T, S+Q]

    def rows(support: Tensor, query: Tensor) -> Tensor:
        """[T, S] and [T, Q] -> the real rows, task by task, support first."""
        return torch.cat([support.cpu(), query.cpu()], 1)[real]

    nan = torch.full((t, s), float("nan"), dtype=torch.float64)
    out = {
        "task": rows(*(tb.task_ids.cpu().view(t, 1).expand(t, n) for n in (s, q))),
        "query": rows(torch.zeros(t, s, dtype=torch.bool), torch.ones(t, q, dtype=torch.bool)),
        "label": rows(tb.support.labels.float().view(t, s), tb.query.labels.float().view(t, q)),
        "prediction": rows(nan, _scale(pred, loss)),
        "prediction_no_adapt": rows(nan, _scale(pred0, loss)),
    }
    return out


def concat_columns(parts: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """The columns of several parts, one after another (no part: no column)."""
    if not parts:
        return {}
    return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}


def write_predictions(path: str | Path, columns: dict[str, Tensor], info: dict[str, Any]) -> Path:
    """Writes ``columns`` as one Parquet file at ``path`` (atomically: a temporary file, renamed).

    Args:
        path: the output file; its folder is created.
        columns: equal-length [N] tensors by name (see the module docstring).
        info: JSON-able facts (run, checkpoint step, data, loss) kept in the file's
            metadata under ``recaccel.predictions``.

    Returns:
        The written path.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    arrays = {}
    query = columns.get("query")
    support = None if query is None else ~query.numpy()
    for name in ("task", "query", "label", "weight", "prediction", "prediction_no_adapt"):
        if name in columns:
            mask = support if name in _NULL_ON_SUPPORT else None
            arrays[name] = pa.array(columns[name].numpy(), mask=mask)
    table = pa.table(arrays).replace_schema_metadata({METADATA_KEY: json.dumps(info).encode()})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    return path
