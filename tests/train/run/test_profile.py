"""train.profile_steps: a run writes the torch.profiler trace of those steps and its timeline."""

from __future__ import annotations

import json

import pytest

from recaccel.cli import train_main
from recaccel.config import load_config
from recaccel.errors import ConfigError
from tests.helpers.resume import small_sets

pytest.importorskip("matplotlib")


def test_profile_steps_write_a_chrome_trace_and_its_timeline_png(small_data, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    assert train_main(small_sets(small_data, run, "train.steps=5", "train.profile_steps=[2, 3]")) == 0
    trace = json.loads((run / "profile-steps-2-3.json").read_text())
    events = trace["traceEvents"]
    steps = [e for e in events if e.get("name") == "recaccel/train-step"]
    assert len(steps) == 2  # steps 2 and 3, labelled
    assert any(e.get("cat") == "cpu_op" for e in events)
    png = (run / "profile-steps-2-3.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")


def test_no_profile_unless_asked(small_data, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    assert train_main(small_sets(small_data, run, "train.steps=2")) == 0
    assert not list(run.glob("profile-*"))


def test_profile_steps_out_of_order_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"train.profile_steps=\[3, 2\] must be \[first, last\]"):
        load_config(None, ["train.profile_steps=[3, 2]"])
