"""16-bit packed embedding rows (bf16, fp16) on every backend that runs on CPU.

Forward equals the float32 lookup of the upcast rows; one fused update equals the
float32 update rule within one 16-bit step; the stochastic rounding is unbiased (tiny
updates move the rows on average where round-to-nearest stalls); the optimizer state
stays float32; runs repeat and checkpoints restore the rounding generator. Triton runs
under TRITON_INTERPRET=1 (tiny shapes); FBGEMM's CPU build refuses 16-bit rows in one
line.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before the kernel module is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses

import pytest

from recaccel.errors import ConfigError
from recaccel.models.embedding import field_embedding
from recaccel.ops.backend import fbgemm_installed, triton_interpret_enabled
from recaccel.ops.embedding import PackedEmbeddingBag, SparseOptimConfig, TableSpec
from recaccel.ops.embedding.rounding import stochastic_round
from recaccel.sparse import SparseFeatures

pytestmark = pytest.mark.numeric


needs_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_interpret_enabled()),
    reason="triton kernels need CUDA or TRITON_INTERPRET=1",
)
needs_fbgemm = pytest.mark.skipif(not fbgemm_installed(), reason="fbgemm_gpu is not installed")
BACKENDS = ["reference", pytest.param("triton", marks=needs_triton)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# One 16-bit step relative to the value (bf16: 8 significant bits, fp16: 11).
RTOL = {"bf16": 2.0**-7, "fp16": 2.0**-10}
CFG = SparseOptimConfig(lr=0.05, eps=1e-3)

# Mixed dims, a shared table, mean pooling, three optimizers.
TABLES = [
    TableSpec("a", 11, 4, pooling="mean"),
    TableSpec("b", 7, 4, features=["b1", "b2"]),
    TableSpec("c", 5, 8, optimizer="sgd"),
    TableSpec("d", 9, 8, pooling="mean", optimizer="adam"),
]
KEYS = ["b2", "c", "a", "d", "b1"]


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    """CPU everywhere; CUDA in the GPU suite (``pytest -m gpu``)."""
    return request.param


def _runnable(backend: str, device: str) -> None:
    if backend == "triton" and device == "cpu" and not triton_interpret_enabled():
        pytest.skip("triton on CPU runs only under TRITON_INTERPRET=1")


def _batch(weighted: bool, device: str) -> SparseFeatures:
    """B=3: duplicate ids inside a bag and across bags and features, and empty bags."""
    lengths = [2, 0, 3, 1, 1, 0, 3, 2, 0, 0, 4, 1, 2, 2, 0]  # [F*B] feature-major
    ids = [1, 1, 0, 2, 2, 4, 4, 3, 3, 1, 5, 6, 6, 6, 0, 0, 8, 6, 2, 1, 1]
    values = torch.tensor(ids)
    weights = torch.linspace(0.5, 1.5, values.numel()) if weighted else None
    sf = SparseFeatures.from_lengths(KEYS, values, torch.tensor(lengths), weights)
    return sf.to(device) if device != "cpu" else sf


def _pair(backend: str, dtype: str, device: str) -> tuple[PackedEmbeddingBag, PackedEmbeddingBag]:
    """A 16-bit module and a float32 reference module holding its rows upcast."""
    _runnable(backend, device)
    low = PackedEmbeddingBag(TABLES, backend=backend, optim=CFG, seed=0, dtype=dtype, device=device)
    ref = PackedEmbeddingBag(TABLES, backend="reference", optim=CFG, seed=0, device=device)
    with torch.no_grad():
        for name, state in low.table_states().items():
            ref.table_state(name)["weight"].copy_(state["weight"].float())
    return low, ref


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("weighted", [False, True])
def test_forward_is_fp32_lookup_of_upcast_rows(backend, dtype, weighted, device):
    low, ref = _pair(backend, dtype, device)
    assert low.table_state("a")["weight"].dtype == DTYPES[dtype]
    sf = _batch(weighted, device)
    for train in (False, True):
        low.train(train), ref.train(train)
        with torch.no_grad():
            got, want = low.forward_concat(sf), ref.forward_concat(sf)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fused_update_is_fp32_rule_within_one_16bit_step(backend, dtype, device):
    """Each step, from the same (upcast) rows: every stored value is within one 16-bit step
    of the float32 rule's, untouched rows keep their bits, the state is float32."""
    low, ref = _pair(backend, dtype, device)
    sf = _batch(True, device)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):  # Adam's and Adagrad's state carry over the steps
        before = {n: s["weight"].clone() for n, s in low.table_states().items()}
        with torch.no_grad():
            for name, state in before.items():
                ref.table_state(name)["weight"].copy_(state.float())
        target = torch.randn(3, 28, generator=g).to(device)
        for module in (low, ref):
            (module.forward_concat(sf) * target).sum().backward()
        touched = 0
        for name, state in low.table_states().items():
            want = ref.table_state(name)
            got = state["weight"]
            assert got.dtype == DTYPES[dtype]
            tol = RTOL[dtype] * want["weight"].abs() + 1e-7
            if name == "d":  # Adam: float32 gradient noise (u * sqrt(n) * |term| <= 4.5) times lr / eps
                u = torch.finfo(torch.float32).eps / 2
                tol = tol + CFG.lr / CFG.eps * 4 * u * int(torch.bincount(sf.values).max()) ** 0.5 * 4.5
            assert ((got.float() - want["weight"]).abs() <= tol).all(), name
            moved = (want["weight"] != before[name].float()).any(dim=1)
            touched += int(moved.sum())
            assert torch.equal(got[~moved], before[name][~moved]), name
            for key in ("momentum1", "momentum2"):
                if key in state:
                    assert state[key].dtype == torch.float32
                    torch.testing.assert_close(state[key], want[key], rtol=1e-5, atol=1e-7)
        assert touched > 10


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_stochastic_rounding_is_unbiased_where_nearest_stalls(backend, dtype, device):
    """All rows start at 1.0; each step subtracts ``delta``, below half a 16-bit step under
    1.0, so round-to-nearest never moves them; the mean of the stochastic rows follows the
    exact float32 result."""
    _runnable(backend, device)
    rows, dim, steps = 64, 64, 3
    delta = {"bf16": 1e-3, "fp16": 1e-4}[dtype]
    torch_dtype = DTYPES[dtype]
    assert torch.tensor(1.0 - delta).to(torch_dtype).item() == 1.0  # nearest stalls
    table = TableSpec("t", rows, dim, optimizer="sgd")
    module = PackedEmbeddingBag(
        [table], backend=backend, optim=SparseOptimConfig(lr=delta), seed=0, dtype=dtype, device=device
    )
    weight = module.table_state("t")["weight"]
    weight.fill_(1.0)
    sf = SparseFeatures.from_lengths(["t"], torch.arange(rows), torch.ones(rows, dtype=torch.int64))
    sf = sf.to(device) if device != "cpu" else sf
    for _ in range(steps):
        module(sf).sum().backward()  # gradient 1 for every element
    exact = 1.0 - steps * delta
    mean = weight.float().mean().item()
    assert abs(mean - exact) < 0.1 * steps * delta, (mean, exact)
    assert (weight.float() < 1.0).any() and (weight.float() <= 1.0).all()


def test_rounding_helper_hits_both_neighbours_in_proportion():
    x = torch.full((512, 32), 1.0 + 0.25 * 2.0**-7)  # a quarter of the way to bf16's next value
    out = stochastic_round(x, torch.bfloat16, seed=3, rows=torch.arange(512)).float()
    assert set(out.unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    assert abs((out > 1.0).float().mean().item() - 0.25) < 0.02
    special = torch.tensor([[0.0, -0.0, float("inf"), 1.0, -2.0]])
    assert torch.equal(stochastic_round(special, torch.float16, 0, torch.arange(1)).float(), special)


@pytest.mark.parametrize("backend", BACKENDS)
def test_runs_repeat_and_checkpoints_restore_rounding(backend, device):
    _runnable(backend, device)
    sf = _batch(False, device)

    def train(module: PackedEmbeddingBag, steps: int) -> None:
        for _ in range(steps):
            module.forward_concat(sf).pow(2).sum().backward()

    def make(seed: int) -> PackedEmbeddingBag:
        return PackedEmbeddingBag(TABLES, backend=backend, optim=CFG, seed=seed, dtype="bf16", device=device)

    a, b = make(0), make(0)
    train(a, 2), train(b, 2)
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    saved = a.state_dict()
    assert "rounding_generator" in saved and saved["a.weight"].dtype == torch.bfloat16
    c = make(5)
    c.load_state_dict(saved)
    train(a, 2), train(c, 2)
    for key, value in a.state_dict().items():
        assert torch.equal(value, c.state_dict()[key]), key
    fp32 = PackedEmbeddingBag(TABLES, backend="reference", optim=CFG, seed=0, device=device)
    assert "rounding_generator" not in fp32.state_dict()
    with pytest.raises(RuntimeError, match="a.weight: the checkpoint holds torch.bfloat16 rows but"):
        fp32.load_state_dict(saved)


def test_16bit_needs_fused_mode_and_a_packed_backend():
    with pytest.raises(ConfigError, match="needs mode='fused'"):
        PackedEmbeddingBag(TABLES, backend="reference", mode="autograd", dtype="bf16")
    with pytest.raises(ConfigError, match="dtype must be one of"):
        PackedEmbeddingBag(TABLES, backend="reference", dtype="fp8")
    field = dataclasses.make_dataclass("F", ["name", "cardinality"])
    with pytest.raises(ConfigError, match="per_table does not support model.embedding_dtype=fp16") as e:
        field_embedding([field("x", 5)], 4, backend="per_table", dtype="fp16")
    assert "\n" not in str(e.value)


@needs_fbgemm
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fbgemm_on_cpu_refuses_16bit_rows_in_one_line(dtype):
    tables = [dataclasses.replace(t, dim=8, optimizer="sgd") for t in TABLES]
    with pytest.raises(ConfigError, match=f"backend='fbgemm' with dtype='{dtype}'") as e:
        PackedEmbeddingBag(tables, backend="fbgemm", dtype=dtype, device="cpu")
    assert "\n" not in str(e.value) and "stochastic rounding" in str(e.value)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_triton_16bit_at_real_size_on_cuda(dtype):
    """CUDA: Triton's 16-bit forward equals the upcast float32 lookup, and an update stays
    within one 16-bit step of the float32 rule, at B=4096, 26 tables, D=128."""
    tables = [TableSpec(f"t{i}", 10_000, 128) for i in range(26)]
    keys = [t.name for t in tables]
    low = PackedEmbeddingBag(tables, backend="triton", optim=CFG, seed=0, dtype=dtype, device="cuda")
    ref = PackedEmbeddingBag(tables, backend="reference", optim=CFG, seed=0, device="cuda")
    with torch.no_grad():
        for name, state in low.table_states().items():
            ref.table_state(name)["weight"].copy_(state["weight"].float())
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 5, (26 * 4096,), generator=g)
    values = torch.randint(0, 10_000, (int(lengths.sum()),), generator=g)
    sf = SparseFeatures.from_lengths(keys, values, lengths).to("cuda")
    with torch.no_grad():
        torch.testing.assert_close(low(sf), ref(sf), rtol=1e-5, atol=1e-6)
    target = torch.randn(4096, 26, 128, device="cuda")
    for module in (low, ref):
        (module(sf) * target).sum().backward()
    for name, state in low.table_states().items():
        want = ref.table_state(name)["weight"]
        assert ((state["weight"].float() - want).abs() <= RTOL[dtype] * want.abs() + 1e-6).all(), name
        assert state["momentum1"].dtype == torch.float32
