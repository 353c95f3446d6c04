"""Fixtures shared by the evaluation tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from recaccel.cli import train_main
from recaccel.config import load_config
from recaccel.io.convert.synth import generate_synthetic
from tests.helpers.dlrm_run import TINY
from tests.helpers.eval_run import EVERY, STEPS


@pytest.fixture(scope="module")
def dlrm_run(tmp_path_factory) -> Path:
    """A trained DLRM run (BCE) with checkpoints at steps 6 and 12."""
    root = tmp_path_factory.mktemp("eval")
    generate_synthetic(load_config(None, [*TINY, f'synth.out_dir="{root / "data"}"']).synth)
    sets = [
        *TINY,
        f'data.train="{root / "data" / "train"}"',
        f'data.test="{root / "data" / "test"}"',
        f'train.out_dir="{root / "run"}"',
        f"train.steps={STEPS}",
        f"train.checkpoint_every={EVERY}",
    ]
    assert train_main([a for s in sets for a in ("--set", s)]) == 0
    return root / "run"
