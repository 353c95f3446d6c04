"""Packed per-field ops: references against their definitions, Triton against the references."""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():  # before the kernel module is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recaccel.errors import ConfigError
from recaccel.ops.backend import triton_interpret_enabled
from recaccel.ops.field_ops import (
    DenseTransformParams,
    FieldIdParams,
    dense_transform,
    dense_transform_reference,
    map_ids,
    map_ids_reference,
    splitmix64_63,
)

pytestmark = pytest.mark.numeric


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_interpret_enabled()),
    reason="triton kernels need CUDA or TRITON_INTERPRET=1",
)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
U64 = 2**64 - 1


def _splitmix64_63_python(v: int) -> int:
    """SplitMix64's output function on Python ints, as the docstring defines it."""
    z = (v + 0x9E3779B97F4A7C15) & U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64
    return (z ^ (z >> 31)) >> 1


def _random_batch(num_fields, batch, seed, max_bag=3, empty_frac=0.3, id_range=(INT64_MIN, INT64_MAX)):
    """Field-major CSR with empty bags, duplicates and ids across the whole int64 range."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_bag + 1, (num_fields * batch,), generator=g)
    lengths[torch.rand(lengths.shape, generator=g) < empty_frac] = 0
    offsets = torch.zeros(num_fields * batch + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    n = int(offsets[-1])
    values = torch.randint(id_range[0], id_range[1], (n,), dtype=torch.int64, generator=g)
    if n >= 4:
        values[n // 2] = values[0]  # a duplicate id
        values[1], values[-1] = INT64_MAX, INT64_MIN
        values[2] = -1
    return values, offsets


def _random_params(num_fields, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    cards = [int(c) for c in torch.randint(1, 10**6, (num_fields,), generator=g)]
    cards[0] = 1  # a single-row field
    if num_fields > 2:
        cards[1] = 2**62  # near the limit: hashing must still land in range
    modes = ["hash" if bool(b) else "modulo" for b in torch.rand(num_fields, generator=g) < 0.5]
    return FieldIdParams.build(cards, modes, device=device), cards, modes


def _map_ids_python(values, offsets, cards, modes, row_offsets):
    """Per-id loop over the CSR, straight from the docstring."""
    f = len(cards)
    b = (len(offsets) - 1) // f
    out = []
    for bag in range(f * b):
        field = bag // b
        for v in values[offsets[bag] : offsets[bag + 1]]:
            key = v if modes[field] == "modulo" else _splitmix64_63_python(v)
            out.append(row_offsets[field] + key % cards[field])  # Python % is non-negative here
    return out


def test_splitmix64_matches_python_definition():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(INT64_MIN, INT64_MAX, (200,), dtype=torch.int64, generator=g)
    ids = torch.cat([ids, torch.tensor([0, 1, -1, INT64_MAX, INT64_MIN, INT64_MAX - 1])])
    got = splitmix64_63(ids).tolist()
    assert got == [_splitmix64_63_python(int(v)) for v in ids]
    assert min(got) >= 0


@pytest.mark.parametrize("num_fields,batch", [(1, 6), (7, 5), (1000, 2)])
def test_map_ids_reference_matches_definition(num_fields, batch):
    values, offsets = _random_batch(num_fields, batch, seed=num_fields)
    params, cards, modes = _random_params(num_fields, seed=num_fields + 1)
    row_offsets = [sum(cards[:i]) for i in range(num_fields)]
    got = map_ids_reference(values, offsets, params)
    assert got.tolist() == _map_ids_python(values.tolist(), offsets.tolist(), cards, modes, row_offsets)


def test_modulo_is_non_negative_python_style():
    values = torch.tensor([-7, -1, 0, 6, 7, INT64_MIN, INT64_MAX])
    offsets = torch.tensor([0, 3, 7])
    params = FieldIdParams.build([5], "modulo", row_offsets=[100])
    got = map_ids_reference(values, offsets, params)
    assert got.tolist() == [100 + v % 5 for v in values.tolist()]


def _check_map_ids_triton(num_fields, batch, seed, **kw):
    values, offsets = _random_batch(num_fields, batch, seed, **kw)
    params, *_ = _random_params(num_fields, seed + 1)
    expected = map_ids_reference(values, offsets, params)
    got = map_ids(values.to(DEVICE), offsets.to(DEVICE), params.to(DEVICE), backend="triton")
    assert torch.equal(got.cpu(), expected)  # integer op: bit-exact
    # Every row lands inside its own field's slice of the packed table.
    field = torch.repeat_interleave(torch.arange(num_fields), (offsets[::batch].diff()))
    lo = params.row_offset[field]
    assert bool(((expected >= lo) & (expected < lo + params.cardinality[field])).all())


@needs_triton
@pytest.mark.parametrize("num_fields,batch", [(1, 8), (26, 4), (1000, 2)])
def test_map_ids_triton_bit_exact(num_fields, batch):
    _check_map_ids_triton(num_fields, batch, seed=3 * num_fields + batch)


@needs_triton
@settings(max_examples=10, deadline=None)
@given(num_fields=st.integers(1, 64), batch=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_map_ids_triton_random(num_fields, batch, seed):
    _check_map_ids_triton(num_fields, batch, seed)


@needs_triton
def test_map_ids_triton_all_bags_empty_and_no_ids():
    params = FieldIdParams.build([3, 4], ["hash", "modulo"], device=DEVICE)
    offsets = torch.zeros(2 * 3 + 1, dtype=torch.int64, device=DEVICE)
    out = map_ids(torch.empty(0, dtype=torch.int64, device=DEVICE), offsets, params, backend="triton")
    assert out.shape == (0,) and out.dtype == torch.int64


@needs_triton
def test_map_ids_triton_leading_and_trailing_empty_fields():
    # fields 0, 1 and 4 have no ids at all: the search must skip them
    values = torch.tensor([5, -5, 123456789, 9, 10], device=DEVICE)
    offsets = torch.tensor([0, 0, 0, 0, 0, 2, 3, 5, 5, 5, 5], device=DEVICE)  # F=5, B=2
    params = FieldIdParams.build(
        [2, 3, 4, 5, 6], ["modulo", "hash", "modulo", "hash", "modulo"], device=DEVICE
    )
    got = map_ids(values, offsets, params, backend="triton").cpu()
    assert torch.equal(got, map_ids_reference(values.cpu(), offsets.cpu(), params.to("cpu")))


def test_map_ids_bad_inputs():
    params = FieldIdParams.build([10, 10])
    with pytest.raises(ValueError, match="F\\*B\\+1"):
        map_ids(torch.zeros(3, dtype=torch.int64), torch.tensor([0, 1, 2, 3]), params)
    with pytest.raises(ValueError, match="from 0 to N=3"):
        map_ids(torch.zeros(3, dtype=torch.int64), torch.tensor([0, 1, 2, 2, 2]), params)
    with pytest.raises(ValueError, match="int64"):
        map_ids(torch.zeros(3, dtype=torch.int32), torch.tensor([0, 1, 2, 3, 3]), params)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"cardinalities": [10, 0]}, "field #1: cardinality 0"),
        ({"cardinalities": [10], "modes": "crc32"}, "'crc32' is not one of"),
        ({"cardinalities": [10, 5], "names": ["a", "b"], "row_offsets": [0, -1]}, "field b: rows"),
        ({"cardinalities": [2**62, 2**62], "row_offsets": [0, 2**63 - 1]}, "do not fit int64"),
        ({"cardinalities": [1, 2], "modes": ["hash"]}, "modes has 1 entries, expected 2"),
        ({"cardinalities": []}, "at least one field"),
    ],
)
def test_field_id_params_validation(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        FieldIdParams.build(**kwargs)


def test_field_id_params_default_packing():
    params = FieldIdParams.build([3, 5, 2], ["modulo", "hash", "modulo"])
    assert params.row_offset.tolist() == [0, 3, 8]
    assert params.mode.tolist() == [0, 1, 0] and params.num_fields == 3


# ---- dense_transform ---------------------------------------------------------------

SPECIALS = [float("nan"), float("inf"), float("-inf"), -1.0, -0.0, 0.0, 1e-8, 1e-3, 0.999, 1.0, 3e38]


def _dense_python(v: float, op: str, lo: float, hi: float) -> float:
    """One element, straight from the docstring."""
    if math.isnan(v):
        return v
    y = math.log1p(max(v, 0.0)) if op == "log1p" else v
    return min(max(y, lo), hi)


def _dense_case(batch, seed):
    g = torch.Generator().manual_seed(seed)
    ops = ["log1p", "identity", "clip", "log1p", "clip", "identity", "log1p"]
    lo = [float("-inf"), -2.0, -1.0, 0.5, float("-inf"), float("-inf"), -3.0]
    hi = [float("inf"), 2.0, 1.0, 3.0, 0.0, float("inf"), 5.0]
    x = torch.randn(batch, len(ops), generator=g) * torch.logspace(-6, 6, batch).unsqueeze(1)
    specials = torch.tensor(SPECIALS)
    x[: len(SPECIALS)] = specials[:batch, None] if batch < len(SPECIALS) else specials[:, None]
    return x, DenseTransformParams.build(ops, clip_min=lo, clip_max=hi), ops, lo, hi


def test_dense_reference_matches_definition():
    x, params, ops, lo, hi = _dense_case(40, seed=0)
    got = dense_transform_reference(x, params)
    want = torch.tensor(
        [
            [_dense_python(float(x[i, c]), ops[c], lo[c], hi[c]) for c in range(len(ops))]
            for i in range(len(x))
        ]
    )
    torch.testing.assert_close(got, want, equal_nan=True)
    assert torch.equal(torch.isnan(got), torch.isnan(x))  # NaN propagates, nothing else makes NaN


@needs_triton
@pytest.mark.parametrize("batch", [1, 40, 75])
def test_dense_triton_matches_reference(batch):
    x, params, *_ = _dense_case(batch, seed=batch)
    want = dense_transform_reference(x, params)
    got = dense_transform(x.to(DEVICE), params.to(DEVICE), backend="triton").cpu()
    torch.testing.assert_close(got, want, equal_nan=True)
    assert torch.equal(torch.isnan(got), torch.isnan(want))


@needs_triton
def test_dense_triton_wide_non_contiguous_and_bf16():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(70, 5, generator=g) * 100).t()  # [5, 70], column-major storage
    params = DenseTransformParams.build("log1p", num_columns=70, clip_max=4.0)
    want = dense_transform_reference(x, params)
    torch.testing.assert_close(dense_transform(x.to(DEVICE), params.to(DEVICE), "triton").cpu(), want)
    xb = x.to(torch.bfloat16)
    got = dense_transform(xb.to(DEVICE), params.to(DEVICE), "triton").cpu()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, dense_transform_reference(xb, params))


@needs_triton
def test_dense_triton_log1p_is_accurate_for_small_values():
    # log(1 + x) in float32 loses all digits below x ~ 1e-7; log1p must keep them.
    g = torch.Generator().manual_seed(4)
    x = torch.exp(torch.empty(4096, 1).uniform_(-25.0, 1.0, generator=g))
    params = DenseTransformParams.build("log1p", num_columns=1)
    got = dense_transform(x.to(DEVICE), params.to(DEVICE), "triton").cpu()
    torch.testing.assert_close(got, torch.log1p(x.double()).float(), rtol=5e-7, atol=0.0)


def test_dense_params_validation():
    with pytest.raises(ConfigError, match="column b: op 'sqrt'"):
        DenseTransformParams.build(["log1p", "sqrt"], names=["a", "b"])
    with pytest.raises(ConfigError, match="column #0: clip range"):
        DenseTransformParams.build("clip", num_columns=2, clip_min=1.0, clip_max=0.0)
    with pytest.raises(ConfigError, match="num_columns"):
        DenseTransformParams.build("clip")
    with pytest.raises(ValueError, match="3 columns, params have 2"):
        dense_transform(torch.zeros(4, 3), DenseTransformParams.build("log1p", num_columns=2))


@pytest.mark.gpu
def test_gpu_real_size_map_ids_and_dense():
    num_fields, batch = 26, 16384
    values, offsets = _random_batch(num_fields, batch, seed=7, max_bag=4)
    params, *_ = _random_params(num_fields, seed=8)
    expected = map_ids_reference(values, offsets, params)
    got = map_ids(values.cuda(), offsets.cuda(), params.to("cuda"))  # auto -> triton on CUDA
    assert torch.equal(got.cpu(), expected)
    x, dparams, *_ = _dense_case(batch, seed=9)
    dense = dense_transform(x.cuda(), dparams.to("cuda")).cpu()
    torch.testing.assert_close(dense, dense_transform_reference(x, dparams), equal_nan=True)
