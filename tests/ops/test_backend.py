"""Backend resolution: auto choices per device, clear errors for unknown or unrunnable names."""

from __future__ import annotations

import pytest
import torch

from recaccel.errors import ConfigError
from recaccel.ops.backend import check_triton_launchable, fbgemm_installed, resolve_backend, triton_installed


def test_auto_on_cpu_is_reference_without_fbgemm_in_op():
    assert resolve_backend("auto", "cpu", available=("reference", "triton")) == "reference"


def test_auto_on_cpu_is_reference_even_with_fbgemm():
    # fbgemm-gpu-cpu measured slower end to end on CPU (see recaccel.ops.backend).
    assert resolve_backend("auto", "cpu", available=("reference", "triton", "fbgemm")) == "reference"
    if fbgemm_installed():
        assert resolve_backend("fbgemm", "cpu", available=("reference", "triton", "fbgemm")) == "fbgemm"


def test_auto_on_cuda_prefers_triton():
    want = "triton" if triton_installed() else "reference"
    assert resolve_backend("auto", torch.device("cuda", 0), available=("reference", "triton")) == want


def test_auto_without_reference_and_nothing_runnable():
    with pytest.raises(ValueError, match="no backend"):
        resolve_backend("auto", "cpu", available=("triton",), op="myop")


def test_explicit_names():
    assert resolve_backend("reference", "cpu") == "reference"
    with pytest.raises(ValueError, match="myop: unknown backend 'cuda'"):
        resolve_backend("cuda", "cpu", op="myop")
    with pytest.raises(ValueError, match="'fbgemm' is not implemented"):
        resolve_backend("fbgemm", "cpu", available=("reference", "triton"))


@pytest.mark.skipif(not triton_installed(), reason="triton is not installed")
def test_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1") as err:
        resolve_backend("triton", "cpu", op="myop")
    assert isinstance(err.value, ConfigError)  # the CLI reports it in one line, exit 2
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", "cpu") == "triton"
    assert resolve_backend("triton", "cuda") == "triton"


class JITFunction:  # stands in for a compiled kernel: only its type name matters
    fn = test_explicit_names


class InterpretedFunction:
    fn = test_explicit_names


def test_check_triton_launchable():
    with pytest.raises(RuntimeError, match="compiled \\(not interpreted\\)"):
        check_triton_launchable(JITFunction(), torch.device("cpu"), "myop")
    check_triton_launchable(InterpretedFunction(), torch.device("cpu"), "myop")
    check_triton_launchable(JITFunction(), torch.device("cuda"), "myop")
