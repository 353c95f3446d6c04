"""A lookup's pooled output in 16 bits (``forward(out_dtype=...)``), as a DLRM under
mixed precision takes it: the rows pooled in float32 and rounded once.

Forward: the reference's is its float32 pooling cast; the Triton kernel rounds in its
store (to nearest on CUDA, checked bit for bit there; the CPU interpreter truncates, so
within one 16-bit step here). Backward: the 16-bit gradient read as it is gives the
update of the same values in float32, bit for bit, fused and autograd, and through
``apply_gradient``. A DLRM trained under bf16 autocast with the 16-bit output trains as
the float32 output does (its arches cast the pooled embeddings to bf16 anyway).
"""

from __future__ import annotations

import pytest
import torch

from recaccel.errors import RecaccelError
from recaccel.ops.embedding import PackedEmbeddingBag, SparseOptimConfig, TableSpec
from recaccel.sparse import SparseFeatures
from tests.helpers.marks import needs_triton
from tests.helpers.ops_inputs import random_sparse_batch
from tests.helpers.step_parts import random_batch, tiny_objective

pytestmark = pytest.mark.numeric

BACKENDS = ["reference", pytest.param("triton", marks=needs_triton)]
DTYPES = [torch.bfloat16, torch.float16]
# Same dim, two optimizers: two packs, their outputs joined in batch order.
TABLES = [
    TableSpec("a", 11, 4, pooling="mean", optimizer="adam"),
    TableSpec("b", 7, 4, features=["b1", "b2"], optimizer="rowwise_adagrad"),
    TableSpec("s", 5, 4, optimizer="sgd"),
]
KEYS = ["b2", "s", "a", "b1"]
ROWS = {f: t.num_rows for t in TABLES for f in t.features}


def _module(backend: str, mode: str = "fused", device: str = "cpu") -> PackedEmbeddingBag:
    return PackedEmbeddingBag(
        TABLES, backend=backend, mode=mode, optim=SparseOptimConfig(lr=0.1, eps=1e-3), seed=3, device=device
    )


def _batch(seed: int, device: str = "cpu", batch_size: int = 6, weighted: bool = True) -> SparseFeatures:
    gen = torch.Generator().manual_seed(seed)
    return random_sparse_batch(ROWS, KEYS, batch_size, weighted=weighted, generator=gen, device=device)


def _one_step(dtype: torch.dtype) -> float:
    """A 16-bit step at 1 (the largest relative rounding of one value)."""
    return torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_16_bit_output_is_the_float32_pooling_rounded_once(backend, dtype):
    m = _module(backend).eval()
    sf = _batch(1)
    want = m(sf)
    got = m(sf, out_dtype=dtype)
    assert got.dtype == dtype and got.shape == want.shape
    if backend == "reference":
        assert torch.equal(got, want.to(dtype))
    else:  # the interpreter truncates where CUDA rounds to nearest: one step apart at most
        torch.testing.assert_close(got.float(), want, rtol=_one_step(dtype), atol=0)


def _train_step(
    m: PackedEmbeddingBag, sf: SparseFeatures, dtype: torch.dtype | None, seed: int
) -> torch.Tensor:
    out = m(sf, out_dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    grad = torch.randn(out.shape, generator=gen).to(torch.bfloat16)  # values every dtype holds
    out.backward(grad.to(out.dtype))
    return out.detach()


@pytest.mark.parametrize("weighted", [False, True], ids=["sum-unweighted", "weighted"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_16_bit_gradient_updates_the_rows_as_its_float32_values_do(backend, dtype, weighted):
    """Unweighted sum pools scale nothing: the gradient is summed as read (in float32)."""
    half, full = _module(backend).train(), _module(backend).train()
    for step in range(3):
        sf = _batch(10 + step, weighted=weighted)
        _train_step(half, sf, dtype, seed=step)
        _train_step(full, sf, None, seed=step)
    for name, state in full.table_states().items():
        for key, value in state.items():
            assert torch.equal(half.table_state(name)[key], value), (name, key)


@pytest.mark.parametrize("backend", BACKENDS)
def test_autograd_mode_gives_the_rows_the_same_gradient_from_a_16_bit_output(backend):
    half, full = _module(backend, "autograd").train(), _module(backend, "autograd").train()
    sf = _batch(20)
    _train_step(half, sf, torch.bfloat16, seed=0)
    _train_step(full, sf, None, seed=0)
    grads = {n: p.grad for n, p in full.named_parameters()}
    assert grads and all(torch.equal(p.grad, grads[n]) for n, p in half.named_parameters())


@pytest.mark.parametrize("backend", BACKENDS)
def test_apply_gradient_takes_a_16_bit_gradient(backend):
    half, full = _module(backend).train(), _module(backend).train()
    sf = _batch(30)
    grad = torch.randn(6, len(KEYS), 4, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    half.apply_gradient(half.prepare(sf), grad)
    full.apply_gradient(full.prepare(sf), grad.float())
    for name, state in full.table_states().items():
        for key, value in state.items():
            assert torch.equal(half.table_state(name)[key], value), (name, key)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"out_dtype": torch.float64}, r"out_dtype torch.float64 is not float32, bfloat16 or float16"),
        (
            {"out_dtype": torch.float16, "out": torch.empty(6, 4, 4, dtype=torch.bfloat16)},
            r"out_dtype torch.float16 but out has dtype torch.bfloat16",
        ),
    ],
    ids=["float64", "out-disagrees"],
)
def test_a_bad_out_dtype_is_a_one_line_error(kwargs, message):
    with pytest.raises(RecaccelError, match=message) as err:
        _module("reference")(_batch(40), **kwargs)
    assert "\n" not in str(err.value)


def _bf16_objective(backend: str, autocast_output: bool):
    objective = tiny_objective(backend, sparse_optim="adam", precision="bf16")
    objective.module.sparse_arch.autocast_output = autocast_output
    return objective


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dlrm_under_bf16_autocast_trains_on_its_16_bit_lookup_as_on_the_float32_one(backend):
    half, full = _bf16_objective(backend, True), _bf16_objective(backend, False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert half.module.embed(random_batch(4, 0).sparse).dtype == torch.bfloat16
        assert full.module.embed(random_batch(4, 0).sparse).dtype == torch.float32
    optimizers = [torch.optim.SGD(o.module.parameters(), lr=0.1) for o in (half, full)]
    for step in range(3):
        batch = random_batch(6, step)
        losses = []
        for objective, opt in zip((half, full), optimizers, strict=True):
            loss = objective.batch_loss(batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        if backend == "reference":  # the arches round the pooled rows to bf16 as the lookup did
            assert torch.equal(losses[0], losses[1])
        else:  # the interpreter's truncation against torch's rounding: a bf16 step per value
            torch.testing.assert_close(losses[0], losses[1], rtol=0.02, atol=1e-3)
    if backend == "reference":
        for (name, value), other in zip(half.module.state_dict().items(), full.module.state_dict().values()):
            assert torch.equal(value, other), name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_triton_kernel_rounds_its_16_bit_output_to_nearest_on_cuda(dtype):
    m = _module("triton", device="cuda").eval()
    sf = _batch(50, device="cuda", batch_size=512)
    assert torch.equal(m(sf, out_dtype=dtype), m(sf).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_lookup_rows_in_16_bits_are_the_rows_of_the_16_bit_forward(backend, dtype):
    m = _module(backend).eval()
    sf = m.prepare(_batch(60))
    whole = m(sf, out_dtype=dtype)
    parts = [m.lookup_rows(sf, lo, hi, out_dtype=dtype) for lo, hi in ((0, 2), (2, 6))]
    assert all(p.dtype == dtype for p in parts)
    assert torch.equal(torch.cat(parts), whole)


@pytest.mark.parametrize(
    ("precision", "want"), [("bf16", torch.bfloat16), ("fp32", torch.float32), ("tf32", torch.float32)]
)
def test_the_steps_without_a_graph_look_rows_up_in_the_dtype_embed_gives(precision, want):
    objective = tiny_objective("reference", precision=precision)
    assert objective.pooled_dtype(torch.device("cpu")) == want
    objective.module.sparse_arch.autocast_output = False
    assert objective.pooled_dtype(torch.device("cpu")) == torch.float32
