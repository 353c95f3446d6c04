"""Checkpoints are untrusted input: a crafted run directory never runs code, and a
malformed checkpoint is one line naming it (CLI exit 2), from ``--resume`` and from
``recaccel.evaluate``, for single-process ``.pt`` files and hybrid DCP folders."""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import recaccel
from recaccel.cli import train_main
from recaccel.config import load_config
from recaccel.errors import RecaccelError
from recaccel.train.checkpoint.dcp_read import read_dcp_metadata
from recaccel.train.checkpoint.digests import record_digests
from recaccel.train.checkpoint.paths import all_checkpoints
from recaccel.train.checkpoint.state import list_checkpoints
from tests.helpers.checkpoints import STEPS, dcp_folder
from tests.helpers.dlrm_run import overrides, set_args


class Evil:
    """Unpickled without restriction, creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def _reseal(run: Path) -> None:
    """Records the edited checkpoints' SHA-256s, as a crafter would: these tests check what
    follows the checksum (test_checkpoint_integrity.py checks the checksum)."""
    for path in all_checkpoints(run):
        try:
            record_digests(path)
        except RecaccelError:  # recaccel.json itself broken: the load names it
            pass


def _resume(run: Path, capsys, caplog) -> tuple[int, str]:
    _reseal(run)
    capsys.readouterr()
    caplog.clear()
    code = train_main(["--resume", str(run), "--set", f"train.steps={STEPS + 3}"])
    # pytest's log capture keeps the CLI's stderr handler out: what it would print is here.
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and _printed(r)]
    assert not logged, logged
    return code, capsys.readouterr().err.strip()


def _printed(record: logging.LogRecord) -> bool:
    """Whether the CLI would print a log record: it reaches the root logger (whose
    handler writes stderr), or a logger on its way has a handler of its own."""
    logger = logging.getLogger(record.name)
    while True:
        if logger is logging.root:
            return True
        own = [
            h
            for h in logger.handlers
            if not isinstance(h, logging.NullHandler) and not type(h).__module__.startswith("_pytest")
        ]
        if own:
            return True
        if not logger.propagate:
            return False
        logger = logger.parent


def _evaluate(run: Path) -> dict:
    return recaccel.evaluate(load_config(run / "config.toml", [f'train.out_dir="{run}"']))


def _assert_one_line(text: str, *names: str) -> None:
    assert len(text.splitlines()) == 1, text
    assert "Traceback" not in text and "weights_only" not in text, text
    for name in names:
        assert name in text, (name, text)


def _resume_refused(
    base: Path, tmp_path: Path, capsys, caplog, change: Callable[[dict], object], *expected: str
) -> tuple[Path, Path]:
    """A copy of ``base`` whose newest checkpoint ``change`` edited, resumed: exit 2 and one
    line naming the checkpoint and ``expected``; returns (the run, the checkpoint)."""
    run = _copy(base, tmp_path)
    path = list_checkpoints(run)[-1]
    _edit(path, change)
    code, err = _resume(run, capsys, caplog)
    assert code == 2
    _assert_one_line(err, path.name, *expected)
    return run, path


def _copy(base: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(base, run)
    return run


# ------------------------------------------------------------- single process


@pytest.fixture(scope="module")
def single_run(tiny_data, tmp_path_factory) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("single") / "run"
    assert train_main(set_args(overrides(tiny_data, out, f"train.steps={STEPS}"))) == 0
    return out


def _edit(path: Path, change: Callable[[dict], object]) -> None:
    payload = torch.load(path, weights_only=True)
    result = change(payload)
    torch.save(payload if result is None else result, path)


def _pop(entries: dict, key: str) -> None:
    del entries[key]


def _first_tensor_key(state: dict) -> str:
    return next(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() == 2)


def _exp_avg(payload: dict) -> None:
    state = payload["optimizer"]["state"]
    key = next(iter(state))
    state[key]["exp_avg"] = torch.zeros(7, 7)


def _poison(t: torch.Tensor, lo: int, hi: int, value: str) -> None:
    t.view(-1)[lo:hi] = float(value)


def _optimizer_tensor(payload: dict) -> torch.Tensor:
    state = payload["optimizer"]["state"]
    return state[next(iter(state))]["exp_avg"]


def _reader_seed(payload: dict) -> None:
    reader = json.loads(payload["reader"])
    reader["seed"] += 1
    payload["reader"] = json.dumps(reader)


MALFORMED: dict[str, tuple[Callable[[dict], object], str]] = {
    "not_a_dict": (lambda p: [1, 2, 3], "not a dict"),
    "missing_rng": (lambda p: _pop(p, "rng"), "missing entry 'rng'"),
    "string_step": (lambda p: p.update(step="5"), "'step'"),
    "bool_step": (lambda p: p.update(step=True), "'step'"),
    "negative_epoch": (lambda p: p.update(epoch=-1), "'epoch'"),
    "nan_seconds": (lambda p: p.update(train_seconds=float("nan")), "'train_seconds'"),
    "reader_not_json": (lambda p: p.update(reader="{oops"), "'reader'"),
    "reader_a_list": (lambda p: p.update(reader="[1, 2]"), "'reader'"),
    "reader_tensor": (lambda p: p.update(reader=torch.zeros(2)), "'reader'"),
    "rng_torch_short": (lambda p: p["rng"].update(torch=torch.zeros(3, dtype=torch.uint8)), "'rng.torch'"),
    "rng_torch_float": (lambda p: p["rng"].update(torch=torch.zeros(5056)), "'rng.torch'"),
    "rng_python": (lambda p: p["rng"].update(python="[3, [1, 2], null]"), "'rng.python'"),
    "rng_numpy": (lambda p: p["rng"].update(numpy='{"state": 1}'), "'rng.numpy'"),
    "model_not_a_dict": (lambda p: p.update(model=[torch.zeros(1)]), "'model'"),
    "model_missing_key": (lambda p: _pop(p["model"], _first_tensor_key(p["model"])), "lacks key"),
    "model_extra_key": (lambda p: p["model"].update(extra=torch.zeros(1)), "'extra'"),
    "model_shape": (lambda p: p["model"].update({_first_tensor_key(p["model"]): torch.zeros(1, 1)}), "shape"),
    "optimizer_state_shape": (_exp_avg, "'exp_avg'"),
    "model_nan": (
        lambda p: _poison(p["model"][_first_tensor_key(p["model"])], 3, 5, "nan"),
        "holds 2 NaN values",
    ),
    "optimizer_nan": (lambda p: _poison(_optimizer_tensor(p), 0, 1, "nan"), "holds 1 NaN values"),
    "optimizer_lr_string": (lambda p: p["optimizer"]["param_groups"][0].update(lr="fast"), "'lr'"),
    "optimizer_groups": (lambda p: p["optimizer"].update(param_groups=[]), "parameter groups"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_checkpoint_is_one_line(single_run, tmp_path, capsys, caplog, name):
    change, expected = MALFORMED[name]
    run, path = _resume_refused(single_run, tmp_path, capsys, caplog, change, expected)
    with pytest.raises(RecaccelError) as caught:
        _evaluate(run)
    _assert_one_line(str(caught.value), path.name, expected)


def test_reader_position_of_another_run_names_the_checkpoint(single_run, tmp_path, capsys, caplog):
    run = _copy(single_run, tmp_path)
    path = list_checkpoints(run)[-1]
    _edit(path, _reader_seed)
    code, err = _resume(run, capsys, caplog)
    assert code == 2
    _assert_one_line(err, path.name, "reader position", "seed")
    assert _evaluate(run)["eval_rows"] > 0  # evaluation does not read the training position


def _reader_field(key: str, value: int) -> Callable[[dict], None]:
    def change(payload: dict) -> None:
        reader = json.loads(payload["reader"])
        reader[key] = value
        payload["reader"] = json.dumps(reader)

    return change


CONTRADICTIONS: dict[str, tuple[Callable[[dict], object], tuple[str, ...]]] = {
    # The run would count on from a step it never trained (it ended at once past train.steps).
    "step_past_its_name": (lambda p: p.update(step=10**18), ("entry 'step' is 1000000000000000000", "named for step")),
    "step_before_its_name": (lambda p: p.update(step=p["step"] - 1), ("entry 'step'", "named for step")),
    # Caught when iterating only, these skipped the epoch's rest or named no checkpoint.
    "buffer_past_the_data": (_reader_field("buffer_index", 999), ("reader position", "buffer 999", "past this rank's data")),
    "row_past_its_buffer": (_reader_field("row_offset", 10**9), ("reader position", "row 1000000000", "rows")),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CONTRADICTIONS))
def test_a_checkpoint_contradicting_itself_or_its_data_is_one_line(
    single_run, tmp_path, capsys, caplog, name
):
    change, expected = CONTRADICTIONS[name]
    _resume_refused(single_run, tmp_path, capsys, caplog, change, *expected)


def test_truncated_checkpoint_is_one_line(single_run, tmp_path, capsys, caplog):
    run = _copy(single_run, tmp_path)
    path = list_checkpoints(run)[-1]
    path.write_bytes(path.read_bytes()[:200])
    code, err = _resume(run, capsys, caplog)
    assert code == 2
    _assert_one_line(err, path.name, "cannot be read", "zip archive")


@pytest.mark.parametrize(("dense", "missing"), [('"sgd"', "'momentum'"), ('"adagrad"', "'lr_decay'")])
def test_resuming_with_another_dense_optimizer_is_one_line_and_leaves_the_run_resumable(
    single_run, tmp_path, capsys, caplog, dense, missing
):
    """The saved groups lack what the new optimizer's step reads: refused before any
    step (it was a KeyError inside the first one), config.toml not rewritten."""
    run = _copy(single_run, tmp_path)
    before = (run / "config.toml").read_text()
    capsys.readouterr()
    code = train_main(
        ["--resume", str(run), "--set", f"optim.dense={dense}", "--set", f"train.steps={STEPS + 3}"]
    )
    assert code == 2
    _assert_one_line(
        capsys.readouterr().err.strip(), list_checkpoints(run)[-1].name, missing, "another optimizer"
    )
    assert (run / "config.toml").read_text() == before
    assert _resume(run, capsys, caplog)[0] == 0  # the run's own optimizer resumes


def test_a_learning_rate_set_on_resume_is_the_one_trained_with(single_run, tmp_path, capsys, caplog):
    """torch's load_state_dict restores the saved groups' rate: the run trained on at the
    checkpoint's rate while config.toml recorded the new one."""
    run = _copy(single_run, tmp_path)
    assert (
        train_main(["--resume", str(run), "--set", "optim.lr=0.125", "--set", f"train.steps={STEPS + 3}"])
        == 0
    )
    saved = torch.load(list_checkpoints(run)[-1], weights_only=True)["optimizer"]["param_groups"]
    assert [g["lr"] for g in saved] == [0.125] * len(saved)
    assert "lr = 0.125" in (run / "config.toml").read_text()


def test_infinities_a_model_keeps_on_purpose_pass_the_check(tmp_path):
    """A mask buffer of -inf (a user model's attention mask) is state, not divergence."""
    from recaccel.train.checkpoint.payload import check_module_state

    class Masked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.register_buffer("mask", torch.full((4, 4), float("-inf")).triu(1))

    model = Masked()
    check_module_state(tmp_path / "step-000000001.pt", "model", model, model.state_dict())
    poisoned = {k: v.clone() for k, v in model.state_dict().items()}
    poisoned["mask"][0, 0] = float("nan")
    with pytest.raises(RecaccelError, match="key 'mask' holds 1 NaN values of 16"):
        check_module_state(tmp_path / "step-000000001.pt", "model", model, poisoned)


@pytest.mark.parametrize("writer", ["torch_save", "plain_pickle"])
def test_malicious_pickle_never_runs(single_run, tmp_path, capsys, caplog, writer):
    run = _copy(single_run, tmp_path)
    path = list_checkpoints(run)[-1]
    marker = tmp_path / "pwned"
    payload = torch.load(path, weights_only=True)
    payload["model"] = Evil(marker)
    if writer == "torch_save":
        torch.save(payload, path)
    else:
        path.write_bytes(pickle.dumps(payload, protocol=2))
    code, err = _resume(run, capsys, caplog)
    assert code == 2 and not marker.exists()
    _assert_one_line(err, path.name, "not a recaccel checkpoint", "refused to unpickle global", "system")
    with pytest.raises(RecaccelError) as caught:
        _evaluate(run)
    _assert_one_line(str(caught.value), path.name, "system")
    assert not marker.exists()


# ------------------------------------------------------------ hybrid (DCP)


def _set_bytes_entry(folder: Path, fqn: str, data: bytes) -> None:
    """Points the entry ``fqn`` (bytes or tensor) of a DCP folder at ``data`` (a new file)."""
    metadata = read_dcp_metadata(folder / ".metadata")
    (folder / "crafted.distcp").write_bytes(data)
    for index, info in metadata.storage_data.items():
        if index.fqn == fqn:
            info.relative_path, info.offset, info.length = "crafted.distcp", 0, len(data)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def _saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _blob_entry(folder: Path, fqn: str, change: Callable[[object], object]) -> None:
    """Rewrites a recaccel blob entry (``torch.save`` bytes inside DCP's byte item)."""
    sd = {fqn: b""}
    import torch.distributed.checkpoint as dcp

    dcp.load(sd, checkpoint_id=str(folder))
    obj = torch.load(io.BytesIO(sd[fqn]), weights_only=True)
    result = change(obj)
    _set_bytes_entry(folder, fqn, _saved(_saved(obj if result is None else result)))


def _hybrid_error(run: Path, capsys, caplog) -> str:
    code, err = _resume(run, capsys, caplog)
    assert code == 2, err
    with pytest.raises(RecaccelError) as caught:
        _evaluate(run)
    assert str(caught.value) in err
    return err


def test_real_dcp_metadata_passes_the_restricted_unpickler(hybrid_run):
    from torch.distributed.checkpoint.metadata import Metadata

    raw = (dcp_folder(hybrid_run) / ".metadata").read_bytes()
    metadata = read_dcp_metadata(dcp_folder(hybrid_run) / ".metadata")
    assert isinstance(metadata, Metadata)
    assert metadata.state_dict_metadata.keys() == pickle.loads(raw).state_dict_metadata.keys()
    assert "ranks.0" in metadata.state_dict_metadata


def test_malicious_dcp_metadata_never_runs(hybrid_run, tmp_path, capsys, caplog):
    run = _copy(hybrid_run, tmp_path)
    marker = tmp_path / "pwned"
    (dcp_folder(run) / ".metadata").write_bytes(pickle.dumps({"x": Evil(marker)}))
    err = _hybrid_error(run, capsys, caplog)
    assert not marker.exists()
    _assert_one_line(err, ".metadata", "refused to unpickle global", "system")


def test_malicious_dcp_byte_entry_never_runs(hybrid_run, tmp_path, capsys, caplog):
    run = _copy(hybrid_run, tmp_path)
    marker = tmp_path / "pwned"
    # DCP's own planner unpickles byte entries unrestricted: this payload would run there.
    _set_bytes_entry(dcp_folder(run), "ranks.0", pickle.dumps(Evil(marker), protocol=2))
    err = _hybrid_error(run, capsys, caplog)
    assert not marker.exists()
    _assert_one_line(err, dcp_folder(run).name, "ranks.0", "system")


def _rank_step(entries: dict) -> None:
    entries["step"] = "5"


def _rank_rng(entries: dict) -> None:
    entries["rng"]["torch"] = torch.zeros(3, dtype=torch.uint8)


def _dense_shape(state: dict) -> None:
    first = next(iter(state["state"].values()))
    first["exp_avg"] = torch.zeros(9, 9)


HYBRID_BLOBS = {
    "ranks_step": ("ranks.0", _rank_step, "'ranks.0.step'"),
    "ranks_rng": ("ranks.0", _rank_rng, "'ranks.0.rng.torch'"),
    "ranks_not_a_dict": ("ranks.0", lambda e: [1], "'ranks.0' must be a dict"),
    "dense_optim_shape": ("dense_optim", _dense_shape, "'exp_avg'"),
    "dense_optim_nan": (
        "dense_optim",
        lambda s: _poison(next(iter(s["state"].values()))["exp_avg"], 0, 2, "nan"),
        "holds 2 NaN values",
    ),
    "replicated_optim_groups": ("replicated_optim", lambda s: s.update(param_groups=[]), "parameter groups"),
}


def test_malicious_dcp_tensor_item_never_runs(hybrid_run, tmp_path, capsys, caplog):
    run = _copy(hybrid_run, tmp_path)
    marker = tmp_path / "pwned"
    metadata = read_dcp_metadata(dcp_folder(run) / ".metadata")
    tensor = next(k for k in metadata.state_dict_metadata if k.startswith("model."))
    _set_bytes_entry(dcp_folder(run), tensor, pickle.dumps(Evil(marker), protocol=2))
    err = _hybrid_error(run, capsys, caplog)
    assert not marker.exists()
    _assert_one_line(err, dcp_folder(run).name, "not a recaccel checkpoint", "system")


@pytest.mark.parametrize("name", list(HYBRID_BLOBS))
def test_malformed_dcp_entry_is_one_line(hybrid_run, tmp_path, capsys, caplog, name):
    fqn, change, expected = HYBRID_BLOBS[name]
    run = _copy(hybrid_run, tmp_path)
    _blob_entry(dcp_folder(run), fqn, change)
    _assert_one_line(_hybrid_error(run, capsys, caplog), dcp_folder(run).name, expected)


def _drop_tensor(folder: Path) -> None:
    metadata = read_dcp_metadata(folder / ".metadata")
    key = next(k for k in metadata.state_dict_metadata if k.startswith("model."))
    del metadata.state_dict_metadata[key]
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def _escape(folder: Path) -> None:
    metadata = read_dcp_metadata(folder / ".metadata")
    for info in metadata.storage_data.values():
        info.relative_path = "../../config.toml"
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def _transform(folder: Path) -> None:
    metadata = read_dcp_metadata(folder / ".metadata")
    for info in metadata.storage_data.values():
        info.transform_descriptors = ["zstd"]
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


HYBRID_FILES: dict[str, tuple[Callable[[Path], None], str]] = {
    "metadata_truncated": (
        lambda f: (f / ".metadata").write_bytes((f / ".metadata").read_bytes()[:50]),
        "cannot be read",
    ),
    "metadata_foreign": (
        lambda f: (f / ".metadata").write_bytes(pickle.dumps({"a": [1, 2]})),
        "not a DCP metadata file",
    ),
    "metadata_escapes": (_escape, "bad storage entry"),
    "metadata_transform": (_transform, "stream transforms"),
    "tensor_missing": (_drop_tensor, "does not fit this run"),
    "info_not_json": (lambda f: (f / "recaccel.json").write_text("{oops"), "recaccel.json"),
    "info_a_list": (lambda f: (f / "recaccel.json").write_text("[1]"), "recaccel.json"),
}


@pytest.mark.parametrize("name", list(HYBRID_FILES))
def test_malformed_dcp_folder_is_one_line(hybrid_run, tmp_path, capsys, caplog, name):
    change, expected = HYBRID_FILES[name]
    run = _copy(hybrid_run, tmp_path)
    change(dcp_folder(run))
    _assert_one_line(_hybrid_error(run, capsys, caplog), dcp_folder(run).name, expected)
