"""Before anything is timed: the eager baseline (and recaccel's auto backends) compute
the reference backend's function on the preset's model (small tables, equal logits)."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Sequence

import torch

from recaccel.bench.step.candidates import build_recaccel_model
from recaccel.bench.step.data import Preset, random_batch
from recaccel.bench.step.eager import EagerDLRM, check_same_function, cross_shape, same_logits

CHECK_CARDINALITY = 1000  # tables of the equivalence check's models (the function does not depend on it)
CHECK_ROWS = 256


def check_preset(preset: Preset, device: torch.device, seed: int, candidates: Sequence[str]) -> str:
    """Checks, on the preset's model with small tables, that the eager baseline (and
    recaccel's auto backends) compute the reference backend's logits.

    Returns:
        A note for the report.

    Raises:
        RecaccelError: a candidate computes a different function.
    """
    synth = preset.cfg.synth
    cards = [
        min(c, CHECK_CARDINALITY) for c in (synth.cardinalities or [synth.cardinality] * synth.num_sparse)
    ]
    small = dataclasses.replace(preset.cfg, synth=dataclasses.replace(synth, cardinalities=cards))
    schema = dataclasses.replace(preset, cfg=small).schema
    torch.manual_seed(seed)
    reference = build_recaccel_model(small, schema, device, "reference")
    batch = random_batch(schema, CHECK_ROWS, synth.max_bag, seed, device)
    eager = EagerDLRM(
        schema.sparse_names, cards, schema.num_dense, small.model.bottom_mlp, small.model.top_mlp, device,
        cross=cross_shape(small.model),
    )  # fmt: skip
    eager_diff = check_same_function(eager, reference, batch, preset.name)
    note = (
        f"{preset.name}: eager computes recaccel's function: recaccel's (reference backends) initial "
        f"weights copied in, logits equal on {CHECK_ROWS} random rows (max |diff| {eager_diff:.2g}; "
        f"the preset's model with tables capped at {CHECK_CARDINALITY} rows)"
    )
    if "recaccel" in candidates:
        fast = build_recaccel_model(small, schema, device, "recaccel")
        fast.load_state_dict(reference.state_dict())
        with torch.no_grad():
            mine, theirs = fast(batch), reference(batch)
        diff = same_logits(
            mine,
            theirs,
            f"train bench {preset.name}: recaccel's auto backends disagree with its reference backends",
        )
        note += f"; recaccel (auto backends) too (max |diff| {diff:.2g})"
    del reference, eager
    free_memory(device)
    return note


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
