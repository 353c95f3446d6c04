"""The TF32 switch recaccel sets for a run: readable and restorable whichever of torch's two
APIs the process uses (the new ``fp32_precision`` strings make legacy reads raise)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from recaccel.ops.tf32 import tf32, tf32_enabled

NEW_API = hasattr(torch.backends.cuda.matmul, "fp32_precision")

# Every switch of both APIs as a printable tuple; the legacy ones read as "raises" where
# torch refuses the read.
_STATE = """
import torch
b = torch.backends
def legacy(read):
    try:
        return read()
    except RuntimeError:
        return "raises"
def state():
    new = tuple(getattr(o, "fp32_precision", None) for o in (b.cuda.matmul, b.cudnn.conv, b.cudnn.rnn))
    return new + (legacy(lambda: b.cuda.matmul.allow_tf32), legacy(lambda: b.cudnn.allow_tf32),
                  legacy(torch.get_float32_matmul_precision))
"""


def _run(body: str) -> str:
    """Runs ``body`` in a fresh interpreter (the API state is process-wide and sticky)."""
    code = _STATE + "\nfrom recaccel.ops.tf32 import tf32, tf32_enabled\n" + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_a_legacy_api_process_sees_its_flags_inside_and_every_switch_exactly_restored():
    out = _run(
        """
        before = state()
        for on in (True, False):
            with tf32(on):
                assert tf32_enabled() is on
                assert b.cuda.matmul.allow_tf32 is on and b.cudnn.allow_tf32 is on  # legacy reads work
            assert state() == before, (state(), before)
        print("ok", before)
        """
    )
    assert out.startswith("ok")


@pytest.mark.skipif(not NEW_API, reason="this torch has no fp32_precision API")
def test_a_new_api_process_is_switched_through_the_new_api_and_restored_exactly():
    out = _run(
        """
        b.cuda.matmul.fp32_precision = "tf32"  # the user's own setting, through the new API
        assert state()[3] == "raises"  # what a legacy read would do here
        before = state()
        assert tf32_enabled()
        with tf32(False):
            assert not tf32_enabled()
            with tf32(True):
                assert tf32_enabled()
            assert not tf32_enabled()
        assert state() == before, (state(), before)
        print("ok")
        """
    )
    assert out == "ok"


@pytest.mark.skipif(not NEW_API, reason="this torch has no fp32_precision API")
def test_the_generic_new_api_setting_is_inherited_by_a_matmul_left_at_none():
    out = _run(
        """
        b.fp32_precision = "tf32"
        print(b.cuda.matmul.fp32_precision, tf32_enabled())
        """
    )
    matmul, enabled = out.split()
    assert enabled == str(matmul in ("tf32", "none"))


def test_the_switch_is_restored_when_the_body_raises():
    before = tf32_enabled()
    with pytest.raises(ValueError, match="boom"), tf32(not before):
        assert tf32_enabled() is (not before)
        raise ValueError("boom")
    assert tf32_enabled() is before
