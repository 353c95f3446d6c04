"""A trained model as a ``torch.export`` program over plain tensors, for serving.

Inputs (one CSR for all fields, the layout of recaccel's SparseFeatures and TorchRec's
KeyedJaggedTensor, fields in the order the JSON beside the program lists them):

- ``dense``: float32 [B, Dd] (Dd may be 0);
- ``values``: int64 [N], every field's ids, field-major: field 0's bags for rows
  0..B-1, then field 1's, ...;
- ``offsets``: int64 [F*B + 1], bag (f, b) is ``values[offsets[f*B + b] : offsets[f*B + b + 1]]``;
  ``offsets[0] = 0`` and ``offsets[-1] = N``; an empty bag pools to zeros.

``model.json`` (the ``.json`` beside the program) records how each raw column became
its input (hash, vocabulary, dense transform); :func:`recaccel.export.encode.encode`
applies it to raw rows.

Output: float32 [B], the click probability (sigmoid of the logit) for binary labels,
the predicted rating for rating labels. B and N are dynamic.

The program holds every table in one float32 buffer; the lookup is one
``embedding_bag`` over all F*B bags, each id shifted to its field's rows. Ids outside
their field's table, or offsets that do not span ``values``, fail the call (a runtime
assertion), never read another table's rows. The dense part is the run's own arches
with the reference kernels, so the program needs nothing but PyTorch to run.

Shapes: B batch, Dd dense features, F fields, N ids, D embedding dim.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from recaccel.export.load import LoadedRun, check_arch

FORMAT = "torch_export"
ARCHES = ("dlrm", "dlrm_dcn", "melu")


class ServingModel(nn.Module):
    """Plain-tensor front of a trained model: the lookup written out, then its head.

    Args:
        loaded: the trained model (see :func:`recaccel.export.load.load_run`).
    """

    def __init__(self, loaded: LoadedRun) -> None:
        super().__init__()
        tables = loaded.table_weights()
        rows = torch.tensor([w.shape[0] for w in tables.values()], dtype=torch.int64)
        self.num_fields = len(tables)
        self.pooling = loaded.cfg.model.pooling
        self.probability = loaded.label_kind == "binary"
        self.register_buffer("weight", torch.cat(list(tables.values())))  # [sum R, D]
        self.register_buffer("row_start", torch.cumsum(rows, 0) - rows)  # [F] first row of each field
        self.register_buffer("num_rows", rows)  # [F]
        model = loaded.model
        # Only the dense arches: the packed embedding (and its optimizer state) stays behind.
        self.dense_arch = copy.deepcopy(model.dense_arch)
        self.interaction_arch = copy.deepcopy(model.interaction_arch)
        self.over_arch = copy.deepcopy(model.over_arch)

    def pooled(self, values: Tensor, offsets: Tensor, batch: int) -> Tensor:
        """Pooled embeddings [B, F, D] of the CSR ``values`` [N] / ``offsets`` [F*B + 1]."""
        fields = self.num_fields
        starts = offsets[
            torch.arange(fields + 1, device=offsets.device) * batch
        ]  # [F+1] each field's first id
        position = torch.arange(values.shape[0], device=values.device)
        field = torch.bucketize(position, starts[1:-1], right=True)  # [N] the field of each id
        in_table = (values >= 0) & (values < self.num_rows[field])
        torch._assert_async(torch.all(in_table), "an id is outside its field's table")
        spans = (offsets[0] == 0) & (offsets[-1] == values.shape[0]) & torch.all(offsets[1:] >= offsets[:-1])
        torch._assert_async(spans, "offsets must rise from 0 to len(values)")
        flat = nn.functional.embedding_bag(
            values + self.row_start[field], self.weight, offsets, mode=self.pooling, include_last_offset=True
        )  # [F*B, D]
        return flat.view(fields, batch, self.weight.shape[1]).transpose(0, 1)

    def forward(self, dense: Tensor, values: Tensor, offsets: Tensor) -> Tensor:
        """Returns [B]: probabilities (binary labels) or ratings."""
        pooled = self.pooled(values, offsets, dense.shape[0])
        out = self.over_arch(self.interaction_arch(self.dense_arch(dense), pooled))
        return torch.sigmoid(out) if self.probability else out


def export_program(loaded: LoadedRun) -> torch.export.ExportedProgram:
    """``torch.export`` of :class:`ServingModel` with a dynamic batch size and id count.

    Raises:
        ConfigError: an arch this format does not cover.
    """
    check_arch(loaded, ARCHES, FORMAT)
    module = ServingModel(loaded).eval().requires_grad_(False)
    example = example_inputs(loaded, batch=4)
    batch = torch.export.Dim("batch", min=1)
    ids = torch.export.Dim("ids", min=0)
    fields = module.num_fields
    shapes = {"dense": {0: batch}, "values": {0: ids}, "offsets": {0: fields * batch + 1}}
    with torch.no_grad():
        return torch.export.export(module, example, dynamic_shapes=shapes)


def example_inputs(loaded: LoadedRun, batch: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Random valid inputs (dense [B, Dd], values [N], offsets [F*B + 1]) for ``loaded``'s fields."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (len(loaded.fields) * batch,), generator=g)
    ids = []
    for f, (_, rows) in enumerate(loaded.fields):
        count = int(lengths[f * batch : (f + 1) * batch].sum())
        ids.append(torch.randint(0, rows, (count,), generator=g))
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    return torch.randn(batch, loaded.num_dense, generator=g), torch.cat(ids), offsets


def serving_spec(loaded: LoadedRun) -> dict[str, Any]:
    """What a serving client needs to call the program (JSON-ready), with how each raw
    column becomes an input (``dense``, ``fields``: see :func:`recaccel.export.encode.encode`)."""
    from recaccel.export.encode import describe_inputs
    from recaccel.export.load import run_schema

    return {
        "format": FORMAT,
        "arch": loaded.arch,
        "inputs": {
            "dense": f"float32 [B, {loaded.num_dense}]",
            "values": "int64 [N]: every field's ids, field-major (field 0's bags for rows 0..B-1, then field 1's, ...)",
            "offsets": f"int64 [{len(loaded.fields)}*B + 1]: bag (f, b) = values[offsets[f*B+b]:offsets[f*B+b+1]]",
        },
        **describe_inputs(loaded.cfg, run_schema(loaded.cfg)),
        "num_dense": loaded.num_dense,
        "pooling": loaded.cfg.model.pooling,
        "output": "float32 [B] click probability" if loaded.label_kind == "binary" else "float32 [B] rating",
        "source": {
            "run_dir": str(loaded.cfg.train.out_dir),
            "checkpoint": str(loaded.checkpoint),
            "step": loaded.step,
        },
    }


def save_program(program: torch.export.ExportedProgram, path: Path) -> None:
    """``torch.export.save`` to ``path`` (a ``.pt2`` file)."""
    torch.export.save(program, str(path))
