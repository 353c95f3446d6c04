"""The deferred bounds check in a training run: the lookup kernels count out-of-range ids
without a host sync, and the run stops at the next log step (or checkpoint, or
evaluation) with the eager check's one-line error and exit status 2.

The model (tests/train/model/deferred_bounds_models.py) has a first table shorter than the
data's cardinality; its Triton kernels run under TRITON_INTERPRET=1 without CUDA.
"""

from __future__ import annotations

import json
import os
import re

import torch

if not torch.cuda.is_available():  # before the kernel module is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from recaccel.cli import train_main
from recaccel.ops.backend import triton_interpret_enabled
from recaccel.ops.embedding import InvalidIdError, PackedEmbeddingBag, TableSpec, check_deferred_ids
from recaccel.sparse import SparseFeatures
from recaccel.train.checkpoint.state import list_checkpoints
from tests.helpers.dlrm_run import overrides, set_args

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_interpret_enabled()),
    reason="triton kernels need CUDA or TRITON_INTERPRET=1",
)

SHORT = 'model.class_path="tests.train.model.deferred_bounds_models:ShortTable"'
OUT_OF_RANGE = r"feature '\w+': id \d+ at batch row \d+ is out of range \[0, 10\) of table '\w+'"


def _module() -> PackedEmbeddingBag:
    return PackedEmbeddingBag([TableSpec("a", 5, 4)], backend="triton", bounds_check="deferred", seed=0)


def _bad_batch() -> SparseFeatures:
    return SparseFeatures.from_lengths(["a"], torch.tensor([1, 9, 2]), torch.tensor([2, 1]))


def _events(run) -> list[dict]:
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def test_an_out_of_range_id_stops_the_cli_run_in_one_line_with_exit_2(tiny_data, tmp_path, capsys):  # noqa: F811
    run = tmp_path / "run"
    code = train_main(set_args(overrides(tiny_data, run, SHORT, "train.steps=3")))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("recaccel-train: error: "), err
    assert re.search(OUT_OF_RANGE, err), err
    assert not list_checkpoints(run)  # no checkpoint holds a step that read a bad id


def test_the_error_comes_at_the_first_log_step_before_its_loss_is_logged(tiny_data, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    assert train_main(set_args(overrides(tiny_data, run, SHORT, "train.steps=1"))) == 2
    assert not [e for e in _events(run) if e.get("event") == "train"]


def test_check_deferred_ids_finds_the_packed_embedding_inside_a_model():
    model = torch.nn.Sequential(_module())
    model[0](_bad_batch())  # counted on the device; nothing waits
    with pytest.raises(InvalidIdError, match=r"feature 'a': id 9 at batch row 0 is out of range \[0, 5\)"):
        check_deferred_ids(model)
    check_deferred_ids(model)  # raised once


def test_switching_to_evaluation_raises_a_pending_bad_id():
    m = _module().train()
    m(_bad_batch())
    with pytest.raises(InvalidIdError, match="id 9"):
        m.eval()
    m.eval()  # raised once
    assert not m.training


def test_a_model_without_the_deferred_check_is_left_alone():
    eager = PackedEmbeddingBag([TableSpec("a", 5, 4)], backend="reference", seed=0)
    check_deferred_ids(torch.nn.Sequential(eager, torch.nn.Linear(2, 2)))


# The first column's schema cardinality below the data's ids (0..49): ids 30..49 meet
# data.invalid_ids in the reader, before any embedding sees them.
SCHEMA = (
    'data.schema={label="label", dense=["I1", "I2", "I3"], sparse={C1={cardinality=30}, '
    "C2={cardinality=50}, C3={cardinality=50}, C4={cardinality=50}}}"
)


def _run(tiny_data, run, policy: str, check: str) -> int:  # noqa: F811
    full_tables = f"model.init_args={{rows = 0, bounds_check = {check}}}"
    sets = [SHORT, full_tables, SCHEMA, f"data.invalid_ids={policy}", "data.batch_size=32", "train.steps=3"]
    return train_main(set_args(overrides(tiny_data, run, *sets)))


@pytest.mark.parametrize("policy", ["clip", "hash", "skip"])
def test_each_invalid_ids_policy_trains_the_same_with_the_deferred_and_the_eager_check(
    tiny_data,  # noqa: F811
    tmp_path,
    policy,
):
    finals = []
    for check in ('"deferred"', "true"):
        run = tmp_path / check.strip('"')
        assert _run(tiny_data, run, policy, check) == 0
        finals.append(torch.load(list_checkpoints(run)[-1], weights_only=True)["model"])
    deferred, eager = finals
    assert deferred.keys() == eager.keys()
    for key, tensor in eager.items():
        assert torch.equal(deferred[key], tensor), key


def test_the_error_policy_refuses_the_bad_id_in_the_reader_either_way(tiny_data, tmp_path, capsys):  # noqa: F811
    lines = []
    for check in ('"deferred"', "true"):
        assert _run(tiny_data, tmp_path / check.strip('"'), "error", check) == 2
        lines.append(capsys.readouterr().err.strip())
    assert len(lines[0].splitlines()) == 1 and "C1" in lines[0], lines[0]
    assert lines[0].replace("deferred", "true") == lines[1].replace("deferred", "true")
