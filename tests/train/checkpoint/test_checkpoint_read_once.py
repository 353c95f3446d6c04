"""A checkpoint file is read once on load: the bytes its digest file vouches for are the
bytes unpickled (no second read that could see other bytes).

A named pipe stands in for the file: its bytes can be read only once, so a loader that
hashed the file and then opened it again to unpickle would find no writer there.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
from pathlib import Path

import pytest
import torch

from recaccel.train.checkpoint.digests import write_digests
from recaccel.train.checkpoint.errors import CheckpointError
from recaccel.train.checkpoint.payload import read_payload

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX only")


def _checkpoint_bytes() -> bytes:
    gen = torch.Generator().manual_seed(0)
    buffer = io.BytesIO()
    torch.save({"model": {"w": torch.randn(64, 8, generator=gen)}, "step": 3}, buffer)
    return buffer.getvalue()


def _serve_once(fifo: Path, data: bytes) -> threading.Thread:
    """Writes ``data`` into the pipe for its first reader, then closes it."""

    def serve() -> None:
        with open(fifo, "wb") as f:
            f.write(data)

    writer = threading.Thread(target=serve, daemon=True)
    writer.start()
    return writer


def _load_in_thread(fifo: Path) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def load() -> None:
        try:
            out["payload"] = read_payload(fifo, fifo)
        except CheckpointError as e:
            out["error"] = e

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    return loader, out


def _release_a_second_open(fifo: Path) -> None:
    """A loader blocked opening the pipe again gets end-of-file (so its thread ends)."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # no reader waiting: nothing to release
        return
    os.close(fd)


def test_a_checkpoint_with_a_digest_is_hashed_and_unpickled_from_one_read(tmp_path):
    data = _checkpoint_bytes()
    fifo = tmp_path / "step-000000003.pt"
    os.mkfifo(fifo)
    write_digests(fifo, [hashlib.sha256(data).hexdigest()])
    writer = _serve_once(fifo, data)
    loader, out = _load_in_thread(fifo)
    loader.join(10)
    read_twice = loader.is_alive()
    _release_a_second_open(fifo)
    loader.join(5)
    writer.join(5)
    assert not read_twice, "the loader opened the checkpoint a second time"
    assert "error" not in out, out.get("error")
    assert out["payload"]["step"] == 3
    expected = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out["payload"]["model"]["w"], expected)


def test_a_checkpoint_read_once_still_fails_its_digest_check_in_one_line(tmp_path):
    data = _checkpoint_bytes()
    fifo = tmp_path / "step-000000003.pt"
    os.mkfifo(fifo)
    write_digests(fifo, [hashlib.sha256(data + b"x").hexdigest()])
    writer = _serve_once(fifo, data)
    loader, out = _load_in_thread(fifo)
    loader.join(10)
    _release_a_second_open(fifo)
    loader.join(5)
    writer.join(5)
    assert "SHA-256 checksum mismatch" in str(out.get("error"))
    assert "\n" not in str(out["error"])
