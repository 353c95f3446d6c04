"""The dense head as a DLRM step calls it: eager, torch.compile'd, CUDA-graphed.

Every form is checked against the eager ``model.head`` on fresh random inputs, forward
and backward (gradients of the head's parameters and of ``pooled``, which feeds the
embedding's backward). On CPU: the compiled head (Inductor), the one-line config
errors, and the graphed head's autograd plumbing and fallback with a capture that keeps
the graphs' static-memory contract (static inputs, outputs and gradients overwritten
by every replay) but recomputes eagerly. On a GPU (``gpu`` marker): real CUDA graphs,
with optimizer steps between replays, the fallback on another batch size, bf16
autocast, the Triton interaction, MeLU, compile plus graphs, and a whole step through
the fused embedding.
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from recaccel.config import ModelConfig, OptimConfig, TrainConfig
from recaccel.errors import ConfigError
from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.models.dlrm import DLRM
from recaccel.models.factory import build_model
from recaccel.sparse import SparseFeatures
from recaccel.train.model.dense_head import (
    GraphedHead,
    build_head,
    check_head_options,
    head_parameters,
)
from tests.helpers.graph_capture import eager_capture
from tests.helpers.step_parts import random_batch, tiny_objective

pytestmark = pytest.mark.numeric


KEYS = ["user", "item", "cat"]
ROWS = [7, 9, 5]
NUM_DENSE, DIM = 3, 4
CPU = torch.device("cpu")


def small_model(device: torch.device = CPU, *, interaction: str = "reference", arch: str = "dlrm") -> DLRM:
    schema = FeatureSchema(
        tuple(f"d{i}" for i in range(NUM_DENSE)), tuple(SparseField(k, n) for k, n in zip(KEYS, ROWS))
    )
    cfg = ModelConfig(
        arch=arch,
        embedding_dim=DIM,
        bottom_mlp=[6, DIM],
        top_mlp=[5, 1],
        interaction_backend=interaction,
        item_fields=["user"] if arch == "melu" else [],
    )
    torch.manual_seed(0)
    return build_model(cfg, OptimConfig(sparse="sgd"), schema, device)


def head_inputs(b: int, seed: int, device: torch.device = CPU) -> tuple[torch.Tensor, torch.Tensor]:
    """dense [B, Dd] and a leaf pooled [B, F, D] that requires grad (as the embedding's output)."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(b, NUM_DENSE, generator=g).to(device)
    pooled = torch.randn(b, len(KEYS), DIM, generator=g).to(device).requires_grad_()
    return dense, pooled


def step_grads(head, model: nn.Module, dense, pooled, labels) -> tuple[torch.Tensor, list, torch.Tensor]:
    """Logits, the head parameters' gradients and pooled's gradient of one BCE step."""
    logits = head(dense, pooled)
    F.binary_cross_entropy_with_logits(logits.float(), labels).backward()
    return logits.detach(), [p.grad.clone() for p in head_parameters(model)], pooled.grad.clone()


def assert_same_step(got, want, **tol) -> None:
    torch.testing.assert_close(got[0], want[0], **tol)
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, **tol)
    torch.testing.assert_close(got[2], want[2], **tol)


# ------------------------------------------------------------------ build_head and its errors


def test_default_head_is_the_models_head():
    model = small_model()
    assert build_head(model, TrainConfig(), CPU) == model.head


@pytest.mark.parametrize("key", ["compile", "cuda_graphs"])
def test_meta_mode_refuses_compile_and_graphs(key):
    with pytest.raises(ConfigError, match=rf"^train\.{key}=true runs train\.mode=dlrm only") as e:
        check_head_options(TrainConfig(mode="meta", **{key: True}), small_model(), CPU)
    assert "\n" not in str(e.value)


def test_cuda_graphs_on_cpu_is_refused():
    with pytest.raises(ConfigError, match=r"^train\.cuda_graphs=true captures CUDA graphs; device is cpu"):
        build_head(small_model(), TrainConfig(cuda_graphs=True), CPU)


@pytest.mark.parametrize("key", ["compile", "cuda_graphs"])
def test_a_model_without_a_dlrm_head_is_refused(key):
    with pytest.raises(ConfigError, match=rf"^train\.{key}=true needs a DLRM .* got a Linear$"):
        check_head_options(TrainConfig(**{key: True}), nn.Linear(2, 1), torch.device("cuda"))


def test_melu_is_a_dlrm_with_a_head():
    model = small_model(arch="melu")
    check_head_options(TrainConfig(compile=True, cuda_graphs=True), model, torch.device("cuda"))
    dense, pooled = head_inputs(4, 0)
    assert build_head(model, TrainConfig(), CPU)(dense, pooled).shape == (4,)


# ------------------------------------------------------------------ torch.compile (CPU, Inductor)


def _inductor_or_skip() -> None:
    try:
        torch.compile(lambda x: x * 2)(torch.ones(2))
    except Exception as e:  # no C++ compiler or a broken Inductor install
        pytest.skip(f"torch.compile's inductor backend is unavailable here: {type(e).__name__}: {e}")


@pytest.fixture
def compiled_here():
    """Dynamo reset, and Inductor's compiled-graph caches off for this test.

    Inductor keeps whole compiled graphs on disk (by default one folder per user, shared
    by every process on the host), and which entry a graph gets depends on process-wide
    switches such as the float32 matmul precision a training run sets: after a training
    test this graph was served a cached entry that corrupted the heap (an abort, never
    seen alone or with a fresh cache folder). Compiled here, the graph comes from this
    process; its C++ kernels, cached by their source, are still reused.
    """
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    with (
        inductor_config.patch(fx_graph_cache=False),
        functorch_config.patch(enable_autograd_cache=False),
    ):
        yield
    torch._dynamo.reset()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_compiled_head_matches_eager_forward_and_backward(precision, compiled_here):
    _inductor_or_skip()
    model = small_model()
    eager_model = copy.deepcopy(model)
    compiled = build_head(model, TrainConfig(compile=True, precision=precision), CPU)
    assert compiled != model.head
    labels = torch.randint(0, 2, (8,)).float()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    with autocast:
        got = step_grads(compiled, model, *head_inputs(8, 1), labels)
        want = step_grads(eager_model.head, eager_model, *head_inputs(8, 1), labels)
    # float32: reassociated sums; bf16: Inductor keeps some intermediates in float32.
    tol = dict(rtol=1e-5, atol=1e-6) if precision == "fp32" else dict(rtol=2e-2, atol=2e-2)
    assert_same_step(got, want, **tol)
    assert got[2].abs().sum() > 0, "no gradient reached pooled"


# ------------------------------------------------------------------ the graphed head's plumbing (CPU)


def test_graphed_head_trains_like_eager_with_optimizer_steps_between():
    model = small_model()
    eager_model = copy.deepcopy(model)
    graphed = GraphedHead(model, capture=eager_capture)
    opts = [torch.optim.Adam(m.parameters(), lr=0.05) for m in (model, eager_model)]
    for step in range(4):
        labels = torch.randint(0, 2, (8,)).float()
        got = step_grads(graphed, model, *head_inputs(8, step), labels)
        want = step_grads(eager_model.head, eager_model, *head_inputs(8, step), labels)
        assert_same_step(got, want, rtol=0, atol=0)
        for p, static in zip(head_parameters(model), graphed.graph.static_grads[1:]):
            assert p.grad.data_ptr() != static.data_ptr(), ".grad adopted the graph's memory"
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert (graphed.graphed_calls, graphed.eager_calls) == (4, 0)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_graphed_gradients_accumulate_over_micro_batches():
    model = small_model()
    eager_model = copy.deepcopy(model)
    graphed = GraphedHead(model, capture=eager_capture)
    labels = torch.randint(0, 2, (8,)).float()
    for seed in (1, 2):  # two backward passes into the same .grad, no zero_grad between
        got = step_grads(graphed, model, *head_inputs(8, seed), labels)
        want = step_grads(eager_model.head, eager_model, *head_inputs(8, seed), labels)
    assert_same_step(got, want, rtol=0, atol=0)


def test_graphed_backward_after_a_later_forward_is_refused():
    model = small_model()
    graphed = GraphedHead(model, capture=eager_capture)
    first = graphed(*head_inputs(8, 0)).sum()
    graphed(*head_inputs(8, 1))
    with pytest.raises(RuntimeError, match="after a later graphed forward"):
        first.backward()


def test_graphed_head_falls_back_to_eager_for_other_calls(caplog):
    model = small_model()
    graphed = GraphedHead(model, capture=eager_capture)
    graphed(*head_inputs(8, 0)).sum().backward()
    with caplog.at_level(logging.INFO, logger="recaccel.train.model.dense_head"):
        for b in (3, 3):  # the last, smaller batch of an epoch: eager, logged once
            dense, pooled = head_inputs(b, b)
            got = graphed(dense, pooled)
            torch.testing.assert_close(got, model.head(dense, pooled), rtol=0, atol=0)
            got.sum().backward()
            assert pooled.grad is not None
    assert sum("run eagerly (logged once)" in r.message for r in caplog.records) == 1
    with torch.no_grad():  # evaluation: eager, not logged
        graphed(*head_inputs(8, 5))
    model.eval()
    graphed(*head_inputs(8, 6))
    assert (graphed.graphed_calls, graphed.eager_calls) == (1, 4)
    model.train()
    graphed(*head_inputs(8, 7))
    assert graphed.graphed_calls == 2


def test_graphed_head_refuses_a_replaced_parameter():
    model = small_model()
    graphed = GraphedHead(model, capture=eager_capture)
    graphed(*head_inputs(8, 0)).sum().backward()
    weight = model.over_arch.model[0].weight
    weight.data = weight.data.clone()
    with pytest.raises(RuntimeError, match="replaced after capture"):
        graphed(*head_inputs(8, 1))


# ------------------------------------------------------------------ real CUDA graphs (GPU)

gpu = pytest.mark.gpu
CUDA = torch.device("cuda")


def cuda_inputs(b: int, seed: int):
    return head_inputs(b, seed, CUDA)


def cuda_labels(b: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2, (b,), generator=torch.Generator().manual_seed(seed)).float().to(CUDA)


def run_steps(head, model, steps, *, batch=64, autocast=False, optimizer=torch.optim.Adam):
    """Per step: logits, head grads, pooled grad; an optimizer step between steps."""
    opt = optimizer(model.parameters(), lr=0.05)
    out = []
    for step, b in enumerate(steps if isinstance(steps, list) else [batch] * steps):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out.append(step_grads(head, model, *cuda_inputs(b, step), cuda_labels(b, step)))
        opt.step()
        opt.zero_grad()
    return out


@gpu
@pytest.mark.parametrize("interaction", ["reference", "triton"])
@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.SGD])
def test_cuda_graphed_head_matches_eager_across_optimizer_steps(interaction, optimizer):
    model = small_model(CUDA, interaction=interaction)
    eager_model = copy.deepcopy(model)
    graphed = build_head(model, TrainConfig(cuda_graphs=True), CUDA)
    assert isinstance(graphed, GraphedHead)
    got = run_steps(graphed, model, 5, optimizer=optimizer)
    want = run_steps(eager_model.head, eager_model, 5, optimizer=optimizer)
    for g, w in zip(got, want):
        assert_same_step(g, w)
    assert (graphed.graphed_calls, graphed.eager_calls) == (5, 0)
    assert not torch.equal(got[0][0], got[-1][0]), "parameters did not change between replays"


@gpu
def test_graphed_steps_meet_no_accumulate_grad_node_of_the_capture_stream():
    """The capture's autograd graph is dropped, so the head parameters' AccumulateGrad nodes
    are made where the replayed backward runs: torch never warns of a stream mismatch (the
    H200's train log did, with a stream sync each step)."""
    model = small_model(CUDA)
    graphed = build_head(model, TrainConfig(cuda_graphs=True), CUDA)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_steps(graphed, model, 4)
    assert graphed.graphed_calls == 4
    assert not [str(w.message) for w in caught if "AccumulateGrad" in str(w.message)]


@gpu
def test_cuda_graphed_head_falls_back_on_another_batch_size():
    model = small_model(CUDA)
    eager_model = copy.deepcopy(model)
    graphed = build_head(model, TrainConfig(cuda_graphs=True), CUDA)
    sizes = [64, 64, 17, 64, 1]
    for g, w in zip(run_steps(graphed, model, sizes), run_steps(eager_model.head, eager_model, sizes)):
        assert_same_step(g, w)
    assert (graphed.graphed_calls, graphed.eager_calls) == (3, 2)
    with torch.no_grad():
        torch.testing.assert_close(graphed(*cuda_inputs(64, 9)), eager_model.head(*cuda_inputs(64, 9)))
    assert graphed.eager_calls == 3


@gpu
def test_cuda_graphed_head_under_bf16_autocast():
    model = small_model(CUDA, interaction="triton")
    eager_model = copy.deepcopy(model)
    graphed = build_head(model, TrainConfig(cuda_graphs=True, precision="bf16"), CUDA)
    got = run_steps(graphed, model, 4, autocast=True)
    want = run_steps(eager_model.head, eager_model, 4, autocast=True)
    for g, w in zip(got, want):
        assert_same_step(g, w, rtol=2e-3, atol=2e-3)
    assert graphed.graphed_calls == 4
    assert graphed.graph.key.autocast == (True, torch.bfloat16)
    run_steps(graphed, model, 1)  # fp32 call: another autocast state, eager
    assert graphed.eager_calls == 1


@gpu
@pytest.mark.parametrize("arch", ["dlrm", "melu"])
def test_cuda_graphed_compiled_head_matches_eager(arch):
    torch._dynamo.reset()
    model = small_model(CUDA, arch=arch)
    eager_model = copy.deepcopy(model)
    graphed = build_head(model, TrainConfig(cuda_graphs=True, compile=True), CUDA)
    for g, w in zip(run_steps(graphed, model, 3), run_steps(eager_model.head, eager_model, 3)):
        assert_same_step(g, w, rtol=1e-4, atol=1e-5)
    assert graphed.graphed_calls == 3


@gpu
def test_cuda_graphed_head_in_a_whole_step_through_the_fused_embedding():
    """pooled's gradient leaves the graphed backward into the fused sparse update."""
    model = small_model(CUDA, interaction="triton")
    eager_model = copy.deepcopy(model)
    graphed = build_head(model, TrainConfig(cuda_graphs=True), CUDA)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager_model)]
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        lengths = torch.randint(0, 4, (len(KEYS) * 32,), generator=g)
        values = torch.randint(0, min(ROWS), (int(lengths.sum()),), generator=g)
        sparse = SparseFeatures.from_lengths(KEYS, values, lengths).to(CUDA)
        dense, labels = torch.randn(32, NUM_DENSE, generator=g).to(CUDA), cuda_labels(32, step)
        for m, head, opt in ((model, graphed, opts[0]), (eager_model, eager_model.head, opts[1])):
            F.binary_cross_entropy_with_logits(head(dense, m.embed(sparse)), labels).backward()
            opt.step()
            opt.zero_grad()
    assert graphed.graphed_calls == 4
    state, eager_state = model.state_dict(), eager_model.state_dict()
    for name, value in state.items():
        torch.testing.assert_close(value, eager_state[name], msg=name)


@gpu
def test_cuda_graphed_head_reading_the_lookups_buffer_trains_bitwise_like_the_copy_path():
    """The Triton lookup writes into the captured graph's input; the copy path is the same
    graphed head behind a plain function (no buffer to ask for)."""
    results = []
    for buffered in (True, False):
        objective = tiny_objective("triton", device="cuda")
        graphed = build_head(objective.module, TrainConfig(cuda_graphs=True), CUDA)
        objective._head = graphed if buffered else (lambda dense, pooled, h=graphed: h(dense, pooled))
        opt = torch.optim.SGD(objective.module.parameters(), lr=0.1)
        losses = []
        for step in range(3):
            loss = objective.batch_loss(random_batch(64, step).to(CUDA))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        results.append((losses, objective.module.state_dict(), graphed))
    (got, got_state, graphed), (want, want_state, graphed_copy) = results
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    for name, value in got_state.items():
        assert torch.equal(value, want_state[name]), name
    assert graphed.graphed_calls == graphed_copy.graphed_calls == 3
    assert (graphed.graph.copy_ins, graphed_copy.graph.copy_ins) == (1, 3)
