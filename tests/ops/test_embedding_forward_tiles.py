"""The Triton embedding forward as bag tiles (recaccel/ops/embedding/triton/forward.py).

Every case compares against the plain-PyTorch reference
(:func:`recaccel.ops.embedding.reference.reference_lookup`) on fresh seeded inputs. Without
CUDA the kernels run under TRITON_INTERPRET=1 (set before the kernel module is imported),
on small shapes; a subprocess compiles them for sm_90 and checks that rows load 16 bytes
at a time.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before the kernel module is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import re
import textwrap

import pytest

from recaccel.errors import RecaccelError
from recaccel.ops.backend import triton_interpret_enabled
from recaccel.ops.embedding import PackedEmbeddingBag, TableSpec
from recaccel.ops.embedding.packing import LocalFeatures, gather_pack_ids
from recaccel.ops.embedding.reference import reference_lookup
from recaccel.ops.embedding.triton import forward as fwd
from recaccel.sparse import SparseFeatures
from tests.helpers.ops_inputs import compile_in_subprocess

pytestmark = [
    pytest.mark.numeric,
    pytest.mark.skipif(
        not (torch.cuda.is_available() or triton_interpret_enabled()),
        reason="triton kernels need CUDA or TRITON_INTERPRET=1",
    ),
]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TABLE_ROWS = [5, 9, 3]  # small tables: duplicate ids within and across bags


def _batch(
    lengths: list[int], num_features: int, gen: torch.Generator, *, weighted: bool, rows: int = 3
) -> SparseFeatures:
    """A batch with the given bag lengths (feature-major) and ids below ``rows``."""
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    ids = torch.randint(0, rows, (int(lengths_t.sum()),), generator=gen)
    weights = torch.rand(ids.numel(), generator=gen) + 0.5 if weighted else None
    keys = [f"f{i}" for i in range(num_features)]
    return SparseFeatures.from_lengths(keys, ids, lengths_t, weights).to(DEVICE)


def _local(src: list[int], row_offset: list[int], is_mean: list[bool], num_keys: int) -> LocalFeatures:
    return LocalFeatures.build(src, row_offset, is_mean, num_keys, torch.device(DEVICE))


def _three_features(batch_size: int, gen: torch.Generator, *, weighted: bool, max_len: int = 4):
    """Three features of tables 5, 9 and 3 rows, packed in reverse order (shifted ids),
    the middle one mean-pooled; lengths 0..max_len."""
    lengths = torch.randint(0, max_len + 1, (3 * batch_size,), generator=gen).tolist()
    sf = _batch(lengths, 3, gen, weighted=weighted)
    local = _local([2, 1, 0], [0, 3, 12], [False, True, False], 3)
    return sf, local


def _reference(
    weight: torch.Tensor, sf: SparseFeatures, local: LocalFeatures, batch_size: int
) -> torch.Tensor:
    ids = gather_pack_ids(sf, local, batch_size)
    return reference_lookup(weight, ids, batch_size, local.count)


def _weight(rows: int, dim: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(rows, dim, generator=gen).to(device=DEVICE, dtype=dtype)


# Float32 sums of a few rows: a few ulps of the sum's magnitude.
TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("dim", [16, 48, 100, 128])
@pytest.mark.parametrize("weighted", [False, True])
def test_forward_matches_reference_for_each_dim_and_row_dtype(dim, dtype, weighted):
    gen = torch.Generator().manual_seed(dim * 7 + len(dtype) + weighted)
    batch_size = 5
    sf, local = _three_features(batch_size, gen, weighted=weighted)
    weight = _weight(17, dim, DTYPES[dtype], gen)
    got = fwd.embedding_bag_forward(weight, sf, local, batch_size)
    assert got.dtype == torch.float32 and got.shape == (batch_size, 3, dim)
    torch.testing.assert_close(got, _reference(weight, sf, local, batch_size), **TOL)


def test_empty_bags_and_bags_of_one_pool_to_zeros_and_to_the_row():
    gen = torch.Generator().manual_seed(3)
    lengths = [0, 1, 0, 1, 1, 0]  # two features, B=3
    sf = _batch(lengths, 2, gen, weighted=False)
    local = _local([0, 1], [0, 3], [True, False], 2)
    weight = _weight(6, 16, torch.float32, gen)
    got = fwd.embedding_bag_forward(weight, sf, local, 3)
    assert torch.count_nonzero(got[0, 0]) == 0 and torch.count_nonzero(got[2, 0]) == 0
    assert torch.count_nonzero(got[2, 1]) == 0
    torch.testing.assert_close(got[1, 0], weight[sf.values[0]], rtol=0, atol=0)
    torch.testing.assert_close(got, _reference(weight, sf, local, 3), **TOL)


@pytest.mark.parametrize("weighted", [False, True])
def test_one_300_id_bag_among_short_ones_goes_to_the_long_path(weighted):
    gen = torch.Generator().manual_seed(4 + weighted)
    batch_size = 9
    lengths = torch.randint(0, 3, (3 * batch_size,), generator=gen)
    lengths[batch_size + 4] = 300  # the mean-pooled feature
    sf = _batch(lengths.tolist(), 3, gen, weighted=weighted)
    local = _local([2, 1, 0], [0, 3, 12], [False, True, False], 3)
    weight = _weight(17, 48, torch.float32, gen)
    mean_len = sf.values.numel() / (3 * batch_size)
    assert fwd.forward_config(48, mean_len, torch.float32).long_threshold < 300
    got = fwd.embedding_bag_forward(weight, sf, local, batch_size)
    torch.testing.assert_close(got, _reference(weight, sf, local, batch_size), **TOL)


@pytest.mark.parametrize("dim", [100, 256])
def test_many_long_bags_in_one_scan_block_and_column_blocks(dim):
    """A threshold of 2 sends every bag of 3+ ids to the long path: several per scan
    block, over one (D=100) or two (D=256) column blocks, mean and weights included."""
    gen = torch.Generator().manual_seed(dim)
    batch_size = 7
    sf, local = _three_features(batch_size, gen, weighted=True, max_len=6)
    weight = _weight(17, dim, torch.bfloat16, gen)
    config = fwd.ForwardConfig(block_bags=8, num_warps=4, unroll=2, long_threshold=2)
    got = fwd.embedding_bag_forward(weight, sf, local, batch_size, config=config)
    torch.testing.assert_close(got, _reference(weight, sf, local, batch_size), **TOL)


def test_tile_size_and_unroll_do_not_change_a_bag_bit_for_bit():
    """A short bag is summed position by position whatever the tile, so every config gives
    the same bits (what lets a row slice reproduce the full batch)."""
    gen = torch.Generator().manual_seed(6)
    batch_size = 11
    sf, local = _three_features(batch_size, gen, weighted=True, max_len=7)
    weight = _weight(17, 48, torch.float32, gen)
    outs = [
        fwd.embedding_bag_forward(weight, sf, local, batch_size, config=fwd.ForwardConfig(bb, nw, u, 64))
        for bb, nw, u in [(8, 1, 1), (16, 2, 2), (32, 4, 4)]
    ]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_rows_slice_equals_the_full_forward_bit_for_bit():
    gen = torch.Generator().manual_seed(7)
    batch_size = 10
    lengths = torch.randint(0, 4, (3 * batch_size,), generator=gen)
    lengths[5] = 150  # a long bag inside the slice
    sf = _batch(lengths.tolist(), 3, gen, weighted=True)
    local = _local([2, 1, 0], [0, 3, 12], [False, True, False], 3)
    weight = _weight(17, 16, torch.float32, gen)
    full = fwd.embedding_bag_forward(weight, sf, local, batch_size)
    part = fwd.embedding_bag_forward_rows(weight, sf, local, batch_size, 3, 8)
    assert torch.equal(part, full[3:8])


def test_out_writes_into_a_strided_view_of_the_interaction_input():
    gen = torch.Generator().manual_seed(8)
    batch_size, dim = 6, 16
    sf, local = _three_features(batch_size, gen, weighted=False)
    weight = _weight(17, dim, torch.float32, gen)
    buffer = torch.full((batch_size, 4, dim), 7.0, device=DEVICE)  # [B, F+1, D]: dense row first
    view = buffer[:, 1:]
    got = fwd.embedding_bag_forward(weight, sf, local, batch_size, out=view)
    assert got.data_ptr() == view.data_ptr()
    assert torch.all(buffer[:, 0] == 7.0)
    torch.testing.assert_close(buffer[:, 1:], _reference(weight, sf, local, batch_size), **TOL)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_16bit_output_is_the_rounded_fp32_sum(out_dtype):
    gen = torch.Generator().manual_seed(9)
    batch_size = 5
    sf, local = _three_features(batch_size, gen, weighted=True)
    weight = _weight(17, 48, torch.bfloat16, gen)
    got = fwd.embedding_bag_forward(weight, sf, local, batch_size, out_dtype=out_dtype)
    want = _reference(weight, sf, local, batch_size)
    assert got.dtype == out_dtype
    # One rounding of the float32 sum: within one 16-bit step (compiled kernels round to
    # nearest; Triton 3.6's interpreter truncates to bfloat16).
    step = 2.0**-7 if out_dtype == torch.bfloat16 else 2.0**-10
    torch.testing.assert_close(got.float(), want, rtol=step, atol=1e-6)


def test_autocast_picks_the_output_dtype():
    device = torch.device(DEVICE)
    assert fwd.autocast_out_dtype(device) == torch.float32
    with torch.autocast(device.type, dtype=torch.bfloat16):
        assert fwd.autocast_out_dtype(device) == torch.bfloat16


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: torch.empty(4, 3, 16, device=DEVICE), r"out has shape \(4, 3, 16\), expected \(5, 3, 16\)"),
        (lambda: torch.empty(5, 3, 16, dtype=torch.float64, device=DEVICE), "out has dtype torch.float64"),
        (lambda: torch.empty(5, 16, 3, device=DEVICE).transpose(1, 2), "last dim has stride 3"),
    ],
)
def test_a_wrong_out_is_refused_in_one_line(make, match):
    gen = torch.Generator().manual_seed(10)
    sf, local = _three_features(5, gen, weighted=False)
    weight = _weight(17, 16, torch.float32, gen)
    with pytest.raises(RecaccelError, match=match) as info:
        fwd.embedding_bag_forward(weight, sf, local, 5, out=make())
    assert "\n" not in str(info.value)


def test_absent_feature_pools_to_zeros():
    gen = torch.Generator().manual_seed(11)
    sf = _batch([1, 2, 3, 0], 2, gen, weighted=False)
    local = _local([1, -1, 0], [0, 0, 3], [False, True, False], 2)
    weight = _weight(6, 16, torch.float32, gen)
    got = fwd.embedding_bag_forward(weight, sf, local, 2)
    assert torch.count_nonzero(got[:, 1]) == 0
    present = _local([1, 0], [0, 3], [False, False], 2)
    torch.testing.assert_close(got[:, [0, 2]], _reference(weight, sf, present, 2), **TOL)


@pytest.mark.parametrize(
    "tables, batch_size",
    [
        ([TableSpec("t", 6, 16, pooling="mean")], 1),
        ([TableSpec(f"t{i}", 2 + i % 7, 16, pooling="mean" if i % 3 else "sum") for i in range(50)], 2),
    ],
    ids=["one_table_batch_of_one", "50_tables"],
)
def test_module_forward_matches_reference(tables, batch_size, sparse_batch):
    """Through PackedEmbeddingBag (the Triton backend's wiring), fused and autograd modes."""
    rows = {t.name: t.num_rows for t in tables}
    sf = sparse_batch(
        rows, list(rows), batch_size, max_len=3, weighted=True, generator=torch.Generator().manual_seed(12)
    )
    want = PackedEmbeddingBag(tables, backend="reference", seed=3).eval().forward_concat(sf)
    for mode in ("fused", "autograd"):
        got = PackedEmbeddingBag(tables, backend="triton", mode=mode, seed=3).eval()
        with torch.no_grad():
            torch.testing.assert_close(got.forward_concat(sf), want, **TOL)


def test_forward_config_defaults_and_table_override(monkeypatch):
    for dim in (16, 48, 100, 128, 256):
        for mean_len in (0.0, 1.0, 3.5, 20.0, 500.0):
            c = fwd.forward_config(dim, mean_len, torch.float32)
            block_d = 1 << (dim - 1).bit_length()
            assert c.block_bags * block_d <= 4096 or c.block_bags == 8
            assert c.block_bags * block_d * c.unroll <= 8192 or c.unroll == 1
            assert c.long_threshold >= 64 and c.long_threshold >= 8 * fwd.length_bucket(mean_len)
    assert fwd.forward_config(128, 1.0, torch.float32).unroll == 1
    tuned = fwd.ForwardConfig(block_bags=64, num_warps=8, unroll=2, long_threshold=512)
    monkeypatch.setitem(fwd.FORWARD_TABLE, (128, 32, "bfloat16"), tuned)
    assert fwd.forward_config(128, 20.0, torch.bfloat16) is tuned
    assert fwd.forward_config(128, 20.0, torch.float32) != tuned


_COMPILE = textwrap.dedent(
    """
    import re, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from recaccel.ops.embedding.triton import forward as F

    PTRS = ["values_ptr", "offsets_ptr", "id_weights_ptr", "src_ptr", "row_offset_ptr", "is_mean_ptr", "out_ptr",
            "limit_ptr", "bad_ptr"]
    TYPES = ["*i64", "*i64", "*fp32", "*i64", "*i64", "*i1", "*fp32", "*i64", "*i32"]
    INTS = ["batch_size", "row_lo", "num_rows", "long_threshold", "stride_w", "stride_ob", "stride_of"]
    ALIGNED = {"weight_ptr", "values_ptr", "offsets_ptr", "out_ptr", "stride_w", "stride_ob", "stride_of"}

    def v4_loads(fn, wtype, consts, num_warps, otype="*fp32"):
        sig = {"weight_ptr": wtype, **dict(zip(PTRS, TYPES)), **{n: "i32" for n in INTS}, "out_ptr": otype}
        params = list(fn.arg_names)
        signature = {p: "constexpr" if p in consts else sig[p] for p in params}
        # Strides are 16-divisible only when D is (D=100: the hints alone must vectorise).
        aligned = ALIGNED if consts["DIM"] % 16 == 0 else ALIGNED - {"stride_w", "stride_ob", "stride_of"}
        attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in aligned}
        k = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
        return len(re.findall(r"ld\\.global[.\\w]*\\.v4", k.asm["ptx"]))

    tile = dict(HAS_WEIGHTS=True, HAS_MEAN=True, BLOCK_BAGS=32, BLOCK_D=128, O_VEC=4, CHECK=False)
    cases = [
        (F._bag_tile_kernel, "*fp32", dict(tile, DIM=128, UNROLL=1, W_VEC=4), 4, 32 * 128 * 4),
        (F._bag_tile_kernel, "*fp32", dict(tile, DIM=100, UNROLL=2, W_VEC=4), 4, 32 * 128 * 4 * 2),
        (F._bag_tile_kernel, "*bf16", dict(tile, DIM=128, UNROLL=2, W_VEC=8), 4, 32 * 128 * 2 * 2),
        (F._bag_tile_kernel, "*fp16", dict(tile, DIM=16, BLOCK_BAGS=128, BLOCK_D=16, UNROLL=4, W_VEC=8), 4,
         128 * 16 * 2 * 4),
        (F._long_bag_kernel, "*fp32", dict(HAS_WEIGHTS=True, HAS_MEAN=True, DIM=128, SCAN_BAGS=128, CHUNK=32,
                                           BLOCK_D=128, W_VEC=4, CHECK=False), 4, 32 * 128 * 4),
        # The deferred bounds check (ids counted on the device) keeps the 16-byte row loads.
        (F._bag_tile_kernel, "*fp32", dict(tile, DIM=128, UNROLL=1, W_VEC=4, CHECK=True), 4, 32 * 128 * 4),
        (F._long_bag_kernel, "*fp32", dict(HAS_WEIGHTS=True, HAS_MEAN=True, DIM=128, SCAN_BAGS=128, CHUNK=32,
                                           BLOCK_D=128, W_VEC=4, CHECK=True), 4, 32 * 128 * 4),
        # A bf16 pooled output (mixed precision): the rows still load in 16 bytes.
        (F._bag_tile_kernel, "*fp32", dict(tile, DIM=128, UNROLL=1, W_VEC=4), 4, 32 * 128 * 4, "*bf16"),
    ]
    for fn, wtype, consts, warps, row_bytes, *otype in cases:
        want = row_bytes // 16 // (32 * warps)  # every row byte in a 16-byte load
        got = v4_loads(fn, wtype, consts, warps, *otype)
        print(fn.__name__, wtype, consts["DIM"], "v4 loads", got, "want >=", want)
        assert got >= want, (fn.__name__, wtype, consts, got, want)
    print("compiled", len(cases))
    """
)


def test_kernels_compile_for_sm90_with_16_byte_row_loads(tmp_path):
    """Triton's compiler (never run by the interpreter) builds every variant for sm_90,
    and each thread's share of the rows is loaded by ld.global.v4 (16 bytes)."""
    done = compile_in_subprocess(_COMPILE, tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert re.search(r"^compiled 8$", done.stdout, re.M)
