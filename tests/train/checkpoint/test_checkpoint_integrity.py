"""Checkpoints are tamper-evident: a changed byte in a checkpoint's tensor data is refused
in one line naming the file (CLI exit 2) by ``--resume``, ``recaccel-eval`` and
``recaccel-export``, before any weight is applied, instead of loading changed weights.

``step-*.pt`` files carry a SHA-256 digest file written before them; those written before
recaccel recorded digests are still checked through their zip CRC-32s. ``step-*.dcp``
folders list every file's SHA-256 in their ``recaccel.json``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

import recaccel
from recaccel.cli import eval_main, export_main, train_main
from recaccel.config import load_config
from recaccel.errors import RecaccelError
from recaccel.train.checkpoint.errors import CheckpointError
from recaccel.train.checkpoint.paths import INFO_FILE, digest_file
from recaccel.train.checkpoint.payload import read_payload
from recaccel.train.checkpoint.state import TrainState, list_checkpoints, load_checkpoint, save_checkpoint
from tests.helpers.checkpoints import dcp_folder
from tests.helpers.dlrm_run import overrides, set_args

STEPS = 5
OLD = Path(__file__).parents[2] / "fixtures" / "checkpoints_2026_11_23" / "dlrm" / "checkpoints"
CHECKPOINT_LOG = "recaccel.train.checkpoint.payload"


def _flip_tensor_byte(path: Path) -> str:
    """Flips one bit in the middle of the largest tensor-data member of a torch zip
    checkpoint (past its local header); returns the member's name."""
    with zipfile.ZipFile(path) as archive:
        member = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[member.header_offset + 26 : member.header_offset + 30])
    start = member.header_offset + 30 + name_len + extra_len
    raw[start + member.file_size // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    return member.filename


def _flip_middle_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))


def _tensors(state: dict) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}


def _differs(a: dict, b: dict) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


def _one_line(err: str, *names: str) -> None:
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for name in names:
        assert name in err, (name, err)


def _copy(base: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(base, run)
    return run


def _snapshot(run: Path) -> dict[str, bytes]:
    """Every file of the run directory but its log and lock: what a refused resume must
    leave as is."""
    return {
        str(p.relative_to(run)): p.read_bytes()
        for p in sorted(run.rglob("*"))
        if p.is_file() and p.name not in ("log.jsonl", ".lock")
    }


def _cli_errors(run: Path, tmp_path: Path, capsys) -> dict[str, str]:
    """The stderr of a refused resume, evaluation and export of ``run`` (each must exit 2)."""
    errors = {}
    commands = {
        "resume": lambda: train_main(["--resume", str(run), "--set", f"train.steps={STEPS + 3}"]),
        "eval": lambda: eval_main([str(run)]),
        "export": lambda: export_main([str(run), str(tmp_path / "m.pt"), "--format", "torchrec"]),
    }
    for name, command in commands.items():
        capsys.readouterr()
        assert command() == 2, name
        errors[name] = capsys.readouterr().err.strip()
    assert not (tmp_path / "m.pt").exists()
    return errors


# ------------------------------------------------------------- single process


@pytest.fixture(scope="module")
def single_run(tiny_data, tmp_path_factory) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("single") / "run"
    assert train_main(set_args(overrides(tiny_data, out, f"train.steps={STEPS}"))) == 0
    return out


def _fresh_model(run: Path, out: Path) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and optimizer of a new run (in ``out``) with ``run``'s config."""
    from recaccel.train.loop.trainer import Trainer

    trainer = Trainer(load_config(run / "config.toml", [f'train.out_dir="{out}"']))
    return trainer.objective.module, trainer.optimizer


def test_clean_checkpoint_has_a_sha256sum_digest_file_and_loads_without_warning(single_run, caplog):
    path = list_checkpoints(single_run)[-1]
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest_file(path).read_text() == f"{digest}  {path.name}\n"  # sha256sum -c reads it
    with caplog.at_level(logging.WARNING, logger=CHECKPOINT_LOG):
        assert read_payload(path, path)["step"] == STEPS
    assert not caplog.records


def test_flipped_tensor_byte_fails_resume_eval_and_export_with_one_line(single_run, tmp_path, capsys):
    run = _copy(single_run, tmp_path)
    path = list_checkpoints(run)[-1]
    before = torch.load(path, weights_only=True)["model"]
    _flip_tensor_byte(path)
    # Unchecked, torch loads the flipped file as changed weights without complaint.
    assert _differs(_tensors(before), _tensors(torch.load(path, weights_only=True)["model"]))
    files = _snapshot(run)
    for name, err in _cli_errors(run, tmp_path, capsys).items():
        _one_line(err, f"checkpoint {path}", "SHA-256 checksum mismatch")
        assert ": error: " in err, (name, err)
    assert _snapshot(run) == files  # nothing trained, evaluated or exported from it


def test_flipped_checkpoint_leaves_the_model_and_optimizer_untouched(single_run, tmp_path):
    run = _copy(single_run, tmp_path)
    path = list_checkpoints(run)[-1]
    _flip_tensor_byte(path)
    model, optimizer = _fresh_model(run, tmp_path / "fresh")
    weights, moments = _tensors(model.state_dict()), optimizer.state_dict()
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_checkpoint(run, model, optimizer, torch.device("cpu"))
    assert not _differs(weights, _tensors(model.state_dict()))
    assert optimizer.state_dict() == moments


def test_truncated_checkpoint_fails_its_checksum(single_run, tmp_path, capsys):
    run = _copy(single_run, tmp_path)
    path = list_checkpoints(run)[-1]
    path.write_bytes(path.read_bytes()[: path.stat().st_size - 100])
    capsys.readouterr()
    assert train_main(["--resume", str(run), "--set", f"train.steps={STEPS + 3}"]) == 2
    _one_line(capsys.readouterr().err, f"checkpoint {path}", "SHA-256 checksum mismatch")


def test_checkpoint_without_digest_file_is_still_checked_by_its_zip_crcs(single_run, tmp_path, capsys):
    run = _copy(single_run, tmp_path)
    path = list_checkpoints(run)[-1]
    digest_file(path).unlink()
    member = _flip_tensor_byte(path)
    for err in _cli_errors(run, tmp_path, capsys).values():
        _one_line(err, f"checkpoint {path}", "zip CRC-32 checksum mismatch", member)


def test_old_checkpoint_without_digest_loads_with_a_warning(tmp_path, caplog):
    path = tmp_path / "step-000000017.pt"
    shutil.copy(OLD / path.name, path)
    with caplog.at_level(logging.WARNING, logger=CHECKPOINT_LOG):
        assert read_payload(path, path)["step"] == 17
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and path.name in warned[0] and "CRC-32" in warned[0], warned


def test_flipped_byte_in_an_old_checkpoint_is_caught_by_its_zip_crc(tmp_path):
    path = tmp_path / "step-000000017.pt"
    shutil.copy(OLD / path.name, path)
    member = _flip_tensor_byte(path)
    torch.load(path, weights_only=True)  # which torch alone loads
    with pytest.raises(CheckpointError) as caught:
        read_payload(path, path)
    _one_line(str(caught.value), f"checkpoint {path}", "zip CRC-32 checksum mismatch", member)


def test_edited_checkpoint_loads_once_its_digests_are_recorded_again(single_run, tmp_path):
    from recaccel.train.checkpoint.digests import record_digests

    run = _copy(single_run, tmp_path)
    path = list_checkpoints(run)[-1]
    payload = torch.load(path, weights_only=True)
    payload["train_seconds"] = 1.5
    torch.save(payload, path)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        read_payload(path, path)
    record_digests(path)
    assert read_payload(path, path)["train_seconds"] == 1.5


# ------------------------------------------------------ writing and pruning


def _save(folder: Path, step: int, value: float, keep: int = 2) -> Path:
    model = nn.Linear(3, 2)
    nn.init.constant_(model.weight, value)
    return save_checkpoint(
        folder, model, torch.optim.SGD(model.parameters(), lr=0.1), TrainState(step=step), keep
    )


def test_digest_file_is_written_and_pruned_with_its_checkpoint(tmp_path):
    for step in range(1, 5):
        _save(tmp_path, step, float(step))
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == [
        "step-000000003.pt",
        "step-000000003.pt.sha256",
        "step-000000004.pt",
        "step-000000004.pt.sha256",
    ]


def test_digest_file_is_renamed_and_its_directory_fsynced_before_the_checkpoint(tmp_path, events):  # noqa: F811
    path = _save(tmp_path, 3, 1.0).resolve()
    sidecar = digest_file(path)
    renamed = events.index(("replace", path.with_suffix(".tmp"), path))
    sealed = events.index(("replace", sidecar.with_name(sidecar.name + ".tmp"), sidecar))
    assert sealed < events.index(("fsync", path.parent), sealed) < renamed


class Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs, no handler catches it."""


def _killed_at(monkeypatch, n: int) -> None:
    """Every rename and unlink after the first ``n`` raises Killed instead of running."""
    calls = {"done": 0}

    def guard(real):
        def call(*args, **kwargs):
            if calls["done"] >= n:
                raise Killed
            calls["done"] += 1
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(os, "replace", guard(os.replace))
    monkeypatch.setattr(os, "unlink", guard(os.unlink))


@pytest.mark.parametrize("step", [3, 2])  # a new step (pruning step 1); step 2 saved again
def test_a_kill_between_any_two_writes_never_leaves_a_checkpoint_that_fails_verification(
    tmp_path, monkeypatch, caplog, step
):
    saved = {1: 1.0, 2: 2.0}
    for n in range(50):
        folder = tmp_path / f"kill{n}"
        for old, value in saved.items():
            _save(folder, old, value)
        with monkeypatch.context() as m:
            _killed_at(m, n)
            try:
                _save(folder, step, 9.0)
                finished = True
            except Killed:
                finished = False
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=CHECKPOINT_LOG):
            found = list_checkpoints(folder)
            for path in found:  # every visible checkpoint has its digest, and matches it
                weight = read_payload(path, path)["model"]["weight"]
                assert float(weight[0, 0]) in (saved.get(int(path.stem[5:])), 9.0), (n, path)
        assert not caplog.records, (n, [r.getMessage() for r in caplog.records])
        assert found[-1].name in (f"step-{step:09d}.pt", "step-000000002.pt"), n
        if finished:
            sidecars = sorted(p.name for p in (folder / "checkpoints").glob("*.sha256"))
            assert sidecars == [p.name + ".sha256" for p in found], n  # none left without its file
            return
    pytest.fail("the save never finished")


def test_digest_file_left_by_a_kill_before_its_checkpoint_is_removed_at_the_next_save(tmp_path):
    first = _save(tmp_path, 1, 1.0)
    orphan = digest_file(first.with_name("step-000000002.pt"))
    orphan.write_text(digest_file(first).read_text())
    _save(tmp_path, 3, 3.0)
    assert not orphan.exists() and digest_file(first).exists()


# ------------------------------------------------------------ hybrid (DCP)


def _evaluate(run: Path) -> dict:
    return recaccel.evaluate(load_config(run / "config.toml", [f'train.out_dir="{run}"']))


def test_dcp_info_records_the_sha256_of_every_other_file(hybrid_run):  # noqa: F811
    folder = dcp_folder(hybrid_run)
    recorded = json.loads((folder / INFO_FILE).read_text())["sha256"]
    files = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir() if p.name != INFO_FILE
    }
    assert recorded == files and ".metadata" in files and any(n.endswith(".distcp") for n in files)


@pytest.mark.parametrize("which", ["shard", "metadata"])
def test_flipped_byte_in_a_dcp_file_fails_resume_eval_and_export(hybrid_run, tmp_path, capsys, which):  # noqa: F811
    run = _copy(hybrid_run, tmp_path)
    folder = dcp_folder(run)
    shard = max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)
    target = shard if which == "shard" else folder / ".metadata"
    _flip_middle_byte(target)
    files = _snapshot(run)
    capsys.readouterr()
    assert train_main(["--resume", str(run), "--set", f"train.steps={STEPS + 3}"]) == 2
    err = capsys.readouterr().err
    _one_line(err, f"checkpoint {folder}", f"SHA-256 checksum mismatch in {target.name}")
    with pytest.raises(RecaccelError) as caught:
        _evaluate(run)
    assert str(caught.value) in err
    assert export_main([str(run), str(tmp_path / "m.pt"), "--format", "torchrec"]) == 2
    assert str(caught.value) in capsys.readouterr().err
    assert _snapshot(run) == files


def test_missing_dcp_file_listed_in_its_info_is_one_line(hybrid_run, tmp_path):  # noqa: F811
    run = _copy(hybrid_run, tmp_path)
    shard = next(dcp_folder(run).glob("*.distcp"))
    shard.unlink()
    with pytest.raises(RecaccelError) as caught:
        _evaluate(run)
    _one_line(str(caught.value), dcp_folder(run).name, f"{shard.name} is missing")


def test_old_dcp_folder_without_digests_loads_with_a_warning(hybrid_run, tmp_path, caplog):  # noqa: F811
    run = _copy(hybrid_run, tmp_path)
    info_file = dcp_folder(run) / INFO_FILE
    info = json.loads(info_file.read_text())
    del info["sha256"]
    info_file.write_text(json.dumps(info))
    with caplog.at_level(logging.WARNING, logger="recaccel.train.distributed.dist_checkpoint"):
        assert _evaluate(run)["eval_rows"] > 0
    assert any("records no SHA-256" in r.getMessage() for r in caplog.records)


def _verify_job(rank: int, world: int, root: Path, folder: str) -> None:
    from recaccel.train.distributed.dist_checkpoint import verify_sharded

    try:
        verify_sharded(Path(folder), rank, world)
        seen = "ok"
    except CheckpointError as e:
        seen = str(e)
    (root / f"seen-{rank}.txt").write_text(seen)


def test_every_rank_refuses_a_dcp_file_that_another_rank_found_changed(tmp_path):
    from recaccel.train.checkpoint.digests import record_digests
    from tests.helpers.gloo_ranks import run_ranks

    folder = tmp_path / "step-000000004.dcp"
    folder.mkdir()
    for i in range(4):
        (folder / f"__{i}_0.distcp").write_bytes(bytes(range(256)) * (i + 1))
    (folder / INFO_FILE).write_text(json.dumps({"format": 1, "world_size": 2}))
    record_digests(folder)
    changed = sorted(json.loads((folder / INFO_FILE).read_text())["sha256"])[1]  # rank 1 hashes it
    _flip_middle_byte(folder / changed)
    run_ranks(_verify_job, 2, tmp_path, str(folder))
    seen = {(tmp_path / f"seen-{r}.txt").read_text() for r in range(2)}
    assert seen == {
        f"checkpoint {folder}: SHA-256 checksum mismatch in {changed}: "
        "its bytes changed since the checkpoint was written"
    }
