"""Packed embedding ops on CUDA at real sizes, in every row dtype offered, against float64.

T=26 tables of D=128, B=16384, bags of L=1 and L=20 ids (and ragged 0..20): forward,
the gradient the fused backward applies, and the fused update itself, each compared
with a float64 computation on the same rows (``||got - ref|| / ||ref||``, METHOD.md's
tolerances: float32 far under 1e-3; 16-bit rows within their rounding). The 16-bit
row dtypes come from ``recaccel.config.choices(EmbeddingDtype)``; one the module
rejects is skipped with its message.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from recaccel.config import EmbeddingDtype, choices
from recaccel.errors import ConfigError
from recaccel.ops.embedding import PackedEmbeddingBag, SparseOptimConfig, TableSpec
from recaccel.ops.embedding.optimizers import PackState, update_rows
from recaccel.sparse import SparseFeatures

pytestmark = pytest.mark.gpu

T, B, D, ROWS = 26, 16384, 128, 100_000
LR = 0.05
# Relative error allowed per row dtype: forward sums float32 products of the stored rows;
# an update writes rows rounded (stochastically) to the row dtype.
FWD_TOL = {"fp32": 1e-5, "bf16": 1e-5, "fp16": 1e-5}
STEP_TOL = {"fp32": 1e-6, "bf16": 8e-3, "fp16": 1e-3}


def _tables(optimizer: str = "sgd") -> list[TableSpec]:
    return [TableSpec(f"t{i}", ROWS - 997 * i, D, optimizer=optimizer) for i in range(T)]


def _batch(tables: list[TableSpec], bag: int | str, seed: int, device) -> SparseFeatures:
    """Random ids, uniform per table; ``bag`` ids per bag, or ``"ragged"`` (0..20, empty bags too)."""
    gen = torch.Generator().manual_seed(seed)
    n = len(tables) * B
    lengths = torch.randint(0, 21, (n,), generator=gen) if bag == "ragged" else torch.full((n,), bag)
    values = []
    for f, t in enumerate(tables):
        count = int(lengths[f * B : (f + 1) * B].sum())
        values.append(torch.randint(0, t.num_rows, (count,), generator=gen))
    return SparseFeatures.from_lengths([t.name for t in tables], torch.cat(values), lengths).to(device)


def _module(tables, dtype: str, backend: str = "auto", seed: int = 1) -> PackedEmbeddingBag:
    try:
        return PackedEmbeddingBag(
            tables, backend=backend, optim=SparseOptimConfig(lr=LR), seed=seed, device="cuda", dtype=dtype
        )
    except ConfigError as e:
        pytest.skip(f"embedding dtype {dtype} on {backend}: {e}")


def _rows64(module: PackedEmbeddingBag, tables) -> dict[str, torch.Tensor]:
    state = module.state_dict()
    return {t.name: state[f"{t.name}.weight"].double() for t in tables}


def _pooled64(rows: dict[str, torch.Tensor], sf: SparseFeatures) -> torch.Tensor:
    """float64 [B, F*D]: sum pooling of every bag, feature f in columns f*D..(f+1)*D."""
    b = sf.batch_size
    bag = torch.repeat_interleave(torch.arange(len(sf.keys) * b, device=sf.values.device), sf.lengths())
    out = []
    for f, key in enumerate(sf.keys):
        lo, hi = int(sf.offsets[f * b]), int(sf.offsets[(f + 1) * b])
        pooled = torch.zeros(b, rows[key].shape[1], dtype=torch.float64, device=rows[key].device)
        pooled.index_add_(0, bag[lo:hi] - f * b, rows[key][sf.values[lo:hi]])
        out.append(pooled)
    return torch.cat(out, dim=1)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(got).all(), "non-finite output"
    return float((got.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("bag", [1, 20, "ragged"])
@pytest.mark.parametrize("dtype", choices(EmbeddingDtype))
def test_gpu_embedding_forward_matches_float64(dtype, bag):
    tables = _tables()
    m = _module(tables, dtype)
    sf = _batch(tables, bag, seed=3, device="cuda")
    ref = _pooled64(_rows64(m, tables), sf)
    out = torch.full((B, T * D), float("nan"), device="cuda")
    with torch.no_grad():
        out.copy_(m.forward_concat(sf))  # every element written: no NaN survives
    assert out.dtype == torch.float32
    assert _rel(out, ref) < FWD_TOL[dtype]


@pytest.mark.parametrize("bag", [1, 20, "ragged"])
@pytest.mark.parametrize("dtype", choices(EmbeddingDtype))
def test_gpu_embedding_fused_sgd_step_matches_float64(dtype, bag):
    """One fused backward: every touched row moves by -lr * (sum of its bags' output
    gradients), rounded to the row dtype; untouched rows stay bit for bit."""
    tables = _tables("sgd")
    m = _module(tables, dtype)
    sf = _batch(tables, bag, seed=4, device="cuda")
    before = {k: v.clone() for k, v in m.state_dict().items() if k.endswith(".weight")}
    rows = _rows64(m, tables)
    grad = torch.randn(B, T * D, generator=torch.Generator(device="cuda").manual_seed(5), device="cuda")
    (m.forward_concat(sf) * grad).sum().backward()
    torch.cuda.synchronize()
    after = m.state_dict()
    b = sf.batch_size
    bag_of = torch.repeat_interleave(torch.arange(T * b, device="cuda"), sf.lengths())
    total_err, total_ref = 0.0, 0.0
    for f, t in enumerate(tables):
        lo, hi = int(sf.offsets[f * b]), int(sf.offsets[(f + 1) * b])
        ids = sf.values[lo:hi]
        g = torch.zeros_like(rows[t.name])
        g.index_add_(0, ids, grad[bag_of[lo:hi] - f * b, f * D : (f + 1) * D].double())
        want = rows[t.name] - LR * g
        got = after[f"{t.name}.weight"]
        touched = torch.zeros(t.num_rows, dtype=torch.bool, device="cuda")
        touched[ids] = True
        assert torch.equal(got[~touched], before[f"{t.name}.weight"][~touched]), (
            f"{t.name}: untouched rows moved"
        )
        assert torch.isfinite(got).all()
        total_err += float((got.double()[touched] - want[touched]).norm() ** 2)
        total_ref += float(want[touched].norm() ** 2)
    assert (total_err / total_ref) ** 0.5 < STEP_TOL[dtype]


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_gpu_triton_fused_update_equals_reference_at_real_size(optimizer):
    """fp32 rows, L=20: two fused steps of Triton and of the reference backend leave the
    same rows and optimizer state (float32 sums in another order: 1e-5)."""
    tables = _tables(optimizer)
    got = _module(tables, "fp32", backend="triton", seed=6)
    want = _module(tables, "fp32", backend="reference", seed=6)
    for sf, grad in _two_steps(tables):
        for m in (got, want):
            (m.forward_concat(sf) * grad).sum().backward()
    got_sd, want_sd = got.state_dict(), want.state_dict()
    for key, value in want_sd.items():
        if value.is_floating_point():
            assert _rel(got_sd[key], value.double()) < 1e-5, key


def _two_steps(tables) -> list[tuple[SparseFeatures, torch.Tensor]]:
    """Two L=20 batches and the output gradient each backward receives."""
    out = []
    for step in range(2):
        gen = torch.Generator(device="cuda").manual_seed(step)
        out.append(
            (
                _batch(tables, 20, seed=10 + step, device="cuda"),
                torch.randn(B, T * D, generator=gen, device="cuda"),
            )
        )
    return out


def adam_float64(
    rows: torch.Tensor,
    steps: list[tuple[torch.Tensor, torch.Tensor]],
    optim: SparseOptimConfig,
    shifts: list[torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], int]:
    """The documented Adam rule run in float64 on one table (the exact result).

    Args:
        rows: float64 [R, D] initial rows.
        steps: per step, (ids [N], output-gradient rows [N, D] of the bags holding them).
        optim: the hyper-parameters.
        shifts: per step, float64 [R, D] added to the rows' summed gradients (a perturbation).

    Returns:
        (weight, momentum1, momentum2 by name; the most occurrences any row summed).
    """
    zeros = torch.zeros_like(rows)
    state = PackState("adam", rows.clone(), {"momentum1": zeros, "momentum2": zeros.clone()}, torch.tensor(0))
    most = 0
    for i, (ids, grad_rows) in enumerate(steps):
        state.step += 1
        touched, counts = torch.unique(ids, return_counts=True)
        most = max(most, int(counts.max()))
        g = torch.zeros_like(rows).index_add_(0, ids, grad_rows.double())
        if shifts is not None:
            g += shifts[i]
        update_rows(state, optim, touched, g[touched])
    return {"weight": state.weight, **state.states}, most


def adam_fp32_rtol(terms: int) -> float:
    """Norm-wise relative bound on float32 Adam state against the float64 rule.

    A row's gradient sums ``terms`` products, whose rounding errors (random in sign) grow
    like ``sqrt(terms)`` units of float32. ``1 - beta2`` is formed in float64 on the host and
    rounded once (both backends), so it adds one unit, not ``beta2 / (1 - beta2)`` (999 units
    at 0.999, what the kernel's own float32 ``1 - beta2`` once cost). The factor 4 covers the
    tail of the sum and the few roundings of the update itself.
    """
    u = torch.finfo(torch.float32).eps / 2
    return 4 * u * (terms**0.5 + 1)


def float32_sum_error_bound(ids: torch.Tensor, grad_rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """float64 [R, D]: a bound on the error of each row's float32 gradient sum, any order.

    Summing n exact float32 terms (sum pooling, no weights: each term is an output-gradient
    element) in float32 errs by at most ``(n - 1) u sum |t|`` in any order (Higham's
    recursive-summation bound, which also covers tree and tiled orders); ``n u`` bounds it.
    """
    u = torch.finfo(torch.float32).eps / 2
    counts = torch.bincount(ids, minlength=num_rows).double()[:, None]
    abs_sums = torch.zeros(num_rows, grad_rows.shape[1], dtype=torch.float64, device=ids.device)
    return counts * u * abs_sums.index_add_(0, ids, grad_rows.double().abs())


def adam_rounding_response(
    rows: torch.Tensor, steps: list[tuple[torch.Tensor, torch.Tensor]], optim: SparseOptimConfig
) -> torch.Tensor:
    """float64 [R, D]: how far the float64 rule's rows move when each step's row gradients
    move by their float32 summation bound (:func:`float32_sum_error_bound`), in the worst
    of the sign patterns.

    Adam's step ``g / (|g| + eps)`` has slope up to ``1 / eps`` (1e8 at eps=1e-8) where a row
    element's gradient cancels to near zero: there a float32 sum's last bits (both backends
    sum in float32) move the row by up to ``2 lr``, which no relative bound on the rows
    covers. The rule's own response to those bits, element by element, is the allowance.
    """
    exact, _ = adam_float64(rows, steps, optim)
    bounds = [float32_sum_error_bound(ids, g, rows.shape[0]) for ids, g in steps]
    response = torch.zeros_like(rows)
    for signs in itertools.product((1.0, -1.0), repeat=len(steps)):
        moved, _ = adam_float64(rows, steps, optim, [s * b for s, b in zip(signs, bounds)])
        response = torch.maximum(response, (moved["weight"] - exact["weight"]).abs())
    return response


def test_gpu_fused_adam_at_real_size_is_the_float64_rule_within_float32_rounding():
    """fp32 rows, L=20, two fused Adam steps: Triton's and the reference backend's rows and
    moments both lie within float32 rounding (:func:`adam_fp32_rtol`) of the float64 rule;
    the rows also within the rule's response to float32 gradient sums
    (:func:`adam_rounding_response`)."""
    tables = _tables("adam")
    modules = {b: _module(tables, "fp32", backend=b, seed=6) for b in ("triton", "reference")}
    initial = _rows64(modules["reference"], tables)
    batches = _two_steps(tables)
    for sf, grad in batches:
        for m in modules.values():
            (m.forward_concat(sf) * grad).sum().backward()
    states = {b: m.state_dict() for b, m in modules.items()}
    optim = SparseOptimConfig(lr=LR)
    err = {(b, k): 0.0 for b in modules for k in ("weight", "momentum1", "momentum2")}
    ref_norm = dict.fromkeys(("weight", "momentum1", "momentum2"), 0.0)
    most, response_sq = 0, 0.0
    for f, t in enumerate(tables):
        per_step = []
        for sf, grad in batches:
            b = sf.batch_size
            lo, hi = int(sf.offsets[f * b]), int(sf.offsets[(f + 1) * b])
            bag_of = torch.repeat_interleave(
                torch.arange(b, device="cuda"), sf.lengths()[f * b : (f + 1) * b]
            )
            per_step.append((sf.values[lo:hi], grad[bag_of, f * D : (f + 1) * D]))
        want, terms = adam_float64(initial[t.name], per_step, optim)
        most = max(most, terms)
        response_sq += float(adam_rounding_response(initial[t.name], per_step, optim).norm() ** 2)
        for key, exact in want.items():
            ref_norm[key] += float(exact.norm() ** 2)
            for backend, sd in states.items():
                err[backend, key] += float((sd[f"{t.name}.{key}"].double() - exact).norm() ** 2)
    bound = adam_fp32_rtol(most)
    for (backend, key), e in err.items():
        # Rows: the rounding of the update plus the response to the gradient sums' rounding;
        # the sums themselves stay held to float32 rounding through momentum1 = (1 - beta1) g.
        slack = response_sq**0.5 if key == "weight" else 0.0
        allowed = bound * ref_norm[key] ** 0.5 + slack
        assert e**0.5 < allowed, (backend, key, (e / ref_norm[key]) ** 0.5, allowed / ref_norm[key] ** 0.5)
