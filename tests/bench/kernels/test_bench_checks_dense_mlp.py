"""The dense MLP benchmark refuses to time a fast path whose outputs or gradients differ
from the plain layers' (deliberately wrong fast MLPs on the CPU)."""

from __future__ import annotations

import argparse

import pytest
import torch

from recaccel.bench.kernels import dense_mlp
from recaccel.errors import RecaccelError

PLAIN_BUILD = dense_mlp.build_mlps


def _wrong_output(mlps):
    with torch.no_grad():
        next(mlps[1].parameters()).mul_(1.05)  # the top MLP's first weight


def _wrong_gradient(mlps):
    next(mlps[0].parameters()).register_hook(lambda g: g * 1.05)  # forward untouched


@pytest.mark.parametrize("spoil", [_wrong_output, _wrong_gradient], ids=["output", "gradient"])
def test_a_fast_path_with_wrong_outputs_or_gradients_is_refused_before_timing(spoil, monkeypatch, tmp_path):
    def build(device, *, fast, seed=0):
        mlps = PLAIN_BUILD(device, fast=fast, seed=seed)
        if fast:
            spoil(mlps)
        return mlps

    monkeypatch.setattr(dense_mlp, "build_mlps", build)
    parser = argparse.ArgumentParser()
    dense_mlp.add_args(parser)
    args = parser.parse_args(["--device", "cpu", "--batch", "3", "--repeats", "1", "--warmup", "0"])
    args.precision, args.out = "fp32", str(tmp_path / "never.md")
    with pytest.raises(RecaccelError, match="fast"):
        dense_mlp.main(args, "test")
    assert not (tmp_path / "never.md").exists()
