"""The lookup writes straight into a CUDA-graphed head's input buffer.

On CPU the graphs are the eager stand-in of :mod:`tests.helpers.graph_capture` (same
static tensors, overwritten by every replay); the Triton lookup runs under
TRITON_INTERPRET=1 at tiny shapes. The real graphs are checked in test_dense_head.py
(``gpu`` marker).
"""

from __future__ import annotations

import copy

import pytest
import torch

from recaccel.errors import RecaccelError
from recaccel.ops.embedding import PackedEmbeddingBag, TableSpec
from recaccel.sparse import SparseFeatures
from recaccel.train.loop.pipeline import StepInput
from recaccel.train.loop.step import SemiSyncStep
from recaccel.train.model.dense_head import GraphedHead, aliases
from recaccel.train.model.head_input import embed_for_head, head_buffer
from recaccel.train.model.objectives import DLRMObjective
from tests.helpers.graph_capture import eager_capture
from tests.helpers.marks import needs_triton
from tests.helpers.step_parts import random_batch, tiny_objective

pytestmark = pytest.mark.numeric

BACKENDS = ["reference", pytest.param("triton", marks=needs_triton)]
ROWS = 6


def graphed_objective(backend: str, head=None, **train) -> tuple[DLRMObjective, GraphedHead]:
    """A tiny DLRM objective whose head is graphed by the eager stand-in capture."""
    objective = tiny_objective(backend, **train)
    graphed = GraphedHead(objective.module, head, capture=eager_capture)
    objective._head = graphed
    return objective, graphed


def copy_path(objective: DLRMObjective, graphed: GraphedHead) -> None:
    """The same graphed head behind a plain function: no buffer to ask for, so every replay copies."""
    objective._head = lambda dense, pooled: graphed(dense, pooled)


def train(objective: DLRMObjective, steps: int) -> list[torch.Tensor]:
    """Losses of ``steps`` plain steps (loss, backward, dense SGD step)."""
    opt = torch.optim.SGD(objective.module.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        loss = objective.batch_loss(random_batch(ROWS, step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name, value in sa.items():
        assert torch.equal(value, sb[name]), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_buffer_path_trains_bitwise_like_the_copy_path(backend):
    steps = 4
    buffered, graphed = graphed_objective(backend)
    copied, graphed_copy = graphed_objective(backend)
    copy_path(copied, graphed_copy)
    got_logits, want_logits = [], []
    buffered.watch = lambda out, labels: got_logits.append(out.detach().clone())
    copied.watch = lambda out, labels: want_logits.append(out.detach().clone())
    got, want = train(buffered, steps), train(copied, steps)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert len(got_logits) == steps
    for g, w in zip(got_logits, want_logits, strict=True):
        assert torch.equal(g, w)
    assert_same_state(buffered.module, copied.module)  # dense parameters and every embedding row
    assert graphed.graphed_calls == graphed_copy.graphed_calls == steps
    # Only the capturing call copied: every later lookup wrote into the graph's input, and
    # (the fused update uses it up inside backward) took its gradient without a copy.
    assert (graphed.graph.copy_ins, graphed_copy.graph.copy_ins) == (1, steps)
    assert (graphed.graph.clone_outs, graphed_copy.graph.clone_outs) == (1, steps)


@pytest.mark.parametrize("backend", BACKENDS)
def test_under_bf16_the_lookup_writes_the_graphs_bf16_input_bitwise_like_the_copy_path(backend):
    """Mixed precision: the graph's pooled input is bf16 (the lookup's output dtype there),
    the lookup writes it, and training matches the copy path bit for bit."""
    steps = 3
    buffered, graphed = graphed_objective(backend, precision="bf16")
    copied, graphed_copy = graphed_objective(backend, precision="bf16")
    copy_path(copied, graphed_copy)
    for g, w in zip(train(buffered, steps), train(copied, steps), strict=True):
        assert torch.equal(g, w)
    assert_same_state(buffered.module, copied.module)
    assert graphed.graph.static_pooled.dtype == torch.bfloat16
    assert (graphed.graph.copy_ins, graphed_copy.graph.copy_ins) == (1, steps)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_lookup_that_keeps_its_gradient_gets_a_copy_of_it(backend):
    """Autograd mode (the rows' gradient is built from the pooled one and kept in .grad):
    the graph's static gradient is never lent, and training stays bitwise the copy path's."""
    objective, graphed = graphed_objective(backend)
    objective.embedding.mode = "autograd"
    reference, graphed_copy = graphed_objective(backend)
    reference.embedding.mode = "autograd"
    copy_path(reference, graphed_copy)
    steps = 3
    for g, w in zip(train(objective, steps), train(reference, steps), strict=True):
        assert torch.equal(g, w)
    assert_same_state(objective.module, reference.module)
    assert graphed.graph.copy_ins == 1 and graphed.graph.clone_outs == steps


def test_a_lent_gradient_is_the_graphs_own_and_a_kept_one_a_copy():
    objective, graphed = graphed_objective("reference")
    train(objective, 1)  # captures
    g = graphed.graph
    seen = []
    # The gradient w.r.t. pooled reaches the lookup's node: record what it receives.
    hook = lambda grad: seen.append(grad.data_ptr())  # noqa: E731
    for lend in (True, False):
        batch = random_batch(ROWS, 7)
        sparse = objective.module.prepare_sparse(batch.sparse)
        buffer = graphed.pooled_buffer(
            batch.dense, tuple(g.static_pooled.shape), torch.float32, "cpu", lend_gradient=lend
        )
        pooled = objective.embedding(sparse.reorder(objective.module.sparse_arch.features), out=buffer)
        pooled.register_hook(hook)
        graphed(batch.dense, pooled).sum().backward()
    static_grad = g.static_grads[int(g.static_dense.requires_grad)].data_ptr()  # [dense's,] pooled's
    assert seen == [static_grad, seen[1]] and seen[1] != static_grad


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_lookup_returns_the_graphs_input_with_its_autograd_node(backend):
    objective, graphed = graphed_objective(backend)
    train(objective, 1)  # captures
    batch = random_batch(ROWS, 7)
    pooled = embed_for_head(objective.module, graphed, batch.dense, batch.sparse)
    assert aliases(pooled, graphed.graph.static_pooled)
    assert pooled.grad_fn is not None  # the backward reaches the lookup's sparse update
    assert torch.equal(pooled, objective.module.embed(batch.sparse))


def test_no_buffer_before_capture_for_other_shapes_or_evaluation():
    objective, graphed = graphed_objective("reference")
    model, batch = objective.module, random_batch(ROWS, 0)
    assert head_buffer(model, graphed, batch.dense, batch.sparse) is None  # nothing captured yet
    train(objective, 1)
    assert head_buffer(model, graphed, batch.dense, batch.sparse) is not None
    small = random_batch(ROWS - 1, 1)
    assert head_buffer(model, graphed, small.dense, small.sparse) is None
    with torch.no_grad():
        assert head_buffer(model, graphed, batch.dense, batch.sparse) is None
    model.eval()
    assert head_buffer(model, graphed, batch.dense, batch.sparse) is None
    model.train()
    assert head_buffer(model, model.head, batch.dense, batch.sparse) is None  # not a graphed head


def reads_pooled_in_backward(model):
    """The model's head plus a term whose backward reads ``pooled`` itself (the graph's
    static input): a lookup writing there before that backward would change it."""
    return lambda dense, pooled: model.head(dense, pooled) + 0.01 * pooled.pow(2).sum((1, 2))


def test_no_buffer_while_a_graphed_backward_is_pending():
    objective, graphed = graphed_objective("reference")
    graphed.head = reads_pooled_in_backward(objective.module)
    reference = copy.deepcopy(objective)
    reference._head = reads_pooled_in_backward(reference.module)
    train(objective, 1)
    train(reference, 1)
    batch, following = random_batch(ROWS, 1), random_batch(ROWS, 2)
    loss = objective.batch_loss(batch)
    # A prefetch of the next batch before this backward: it must not get the buffer.
    ahead = embed_for_head(objective.module, graphed, following.dense, following.sparse)
    assert not aliases(ahead, graphed.graph.static_pooled)
    loss.backward()  # with the buffer overwritten, autograd would refuse (pooled changed in place)
    reference.batch_loss(batch).backward()
    for p, q in zip(objective.module.parameters(), reference.module.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert_same_state(objective.module, reference.module)
    assert head_buffer(objective.module, graphed, following.dense, following.sparse) is not None


def test_semi_sync_prefetch_never_writes_the_graphs_input():
    objective, graphed = graphed_objective("reference")
    graphed.head = reads_pooled_in_backward(objective.module)
    eager = copy.deepcopy(objective)
    eager._head = reads_pooled_in_backward(eager.module)
    batches = [random_batch(ROWS, s) for s in range(5)]
    for obj in (objective, eager):
        step, opt = SemiSyncStep(obj, torch.device("cpu")), torch.optim.SGD(obj.module.parameters(), lr=0.1)
        for i, batch in enumerate(batches):
            step.forward_backward(StepInput(batch, batches[i + 1] if i + 1 < len(batches) else None, None))
            opt.step()
            opt.zero_grad()
    assert_same_state(objective.module, eager.module)
    assert graphed.graph.copy_ins == graphed.graphed_calls == len(batches)


# ------------------------------------------------------------------ PackedEmbeddingBag.forward(out=)

TABLES = [TableSpec("a", 11, 4), TableSpec("b", 7, 4), TableSpec("s", 5, 4, optimizer="sgd")]


def sparse_batch(keys: list[str], rows: int = 3) -> SparseFeatures:
    g = torch.Generator().manual_seed(len(keys))
    lengths = torch.randint(0, 3, (len(keys) * rows,), generator=g)
    values = torch.randint(0, 5, (int(lengths.sum()),), generator=g)
    return SparseFeatures.from_lengths(keys, values, lengths)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("keys", "direct"),
    [(["a", "b"], True), (["b", "a"], True), (["a", "s"], False), (["b", "s", "a"], False)],
    ids=["one-pack", "one-pack-reordered", "two-packs", "two-packs-interleaved"],
)
def test_forward_into_out_matches_forward(backend, keys, direct):
    with_out = PackedEmbeddingBag(TABLES, backend=backend, seed=0)
    plain = PackedEmbeddingBag(TABLES, backend=backend, seed=0)
    sf = sparse_batch(keys)
    out = torch.full((3, len(keys), 4), float("nan"))
    got, want = with_out(sf, out=out), plain(sf)
    assert got is out
    assert torch.equal(got, want)
    # The Triton kernel writes the result of one pack (its features in the batch's order)
    # itself; the packs' outputs joined or reordered are copied in.
    wrote_directly = type(got.grad_fn).__name__ != "CopyBackwards"
    assert wrote_directly == (direct and backend == "triton")
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(3))
    got.backward(grad)
    want.backward(grad)
    assert_same_state(with_out, plain)  # the same sparse update


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_into_out_in_autograd_mode_gives_the_same_row_gradients(backend):
    with_out = PackedEmbeddingBag(TABLES, backend=backend, seed=0, mode="autograd")
    plain = PackedEmbeddingBag(TABLES, backend=backend, seed=0, mode="autograd")
    sf = sparse_batch(["a", "b"])
    got = with_out(sf, out=torch.empty(3, 2, 4))
    want = plain(sf)
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(4))
    got.backward(grad)
    want.backward(grad)
    grads = [(p.grad, q.grad) for p, q in zip(with_out.parameters(), plain.parameters(), strict=True)]
    assert grads[0][0] is not None  # pack 0's rows; pack 1 ("s") is not in the batch
    for g, w in grads:
        assert (g is None and w is None) or torch.equal(g, w)


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_into_out_without_grad(backend):
    emb = PackedEmbeddingBag(TABLES, backend=backend, seed=0).eval()
    sf, out = sparse_batch(["a", "b"]), torch.empty(3, 2, 4)
    with torch.no_grad():
        assert emb(sf, out=out) is out
    assert torch.equal(out, emb(sf))


@pytest.mark.parametrize(
    ("out", "message"),
    [
        (torch.empty(3, 2, 5), r"out has shape \(3, 2, 5\), expected \(3, 2, 4\)"),
        (
            torch.empty(3, 2, 4, dtype=torch.float64),
            r"out has dtype torch.float64, expected float32, bfloat16 or float16",
        ),
        (torch.empty(3, 2, 4, device="meta"), r"out is on meta but the batch is on cpu"),
        (torch.empty(3, 2, 4, requires_grad=True), r"out is a leaf that requires grad"),
    ],
    ids=["shape", "dtype", "device", "leaf-requiring-grad"],
)
def test_a_bad_out_is_a_one_line_error(out, message):
    emb = PackedEmbeddingBag(TABLES, backend="reference", seed=0)
    with pytest.raises(RecaccelError, match=rf"^PackedEmbeddingBag\.forward: {message}") as e:
        emb(sparse_batch(["a", "b"]), out=out)
    assert "\n" not in str(e.value)
