"""The dense head of a DLRM step as the objective calls it: eager, compiled, or CUDA-graphed.

A DLRM step is ``pooled = model.embed(batch.sparse)`` then ``head(batch.dense, pooled)``
(bottom MLP, interaction, top MLP: :meth:`~recaccel.models.dlrm.DLRM.head`). The head is
a few small kernels per layer whose launch cost dominates at high throughput;
:func:`build_head` returns it in the form ``[train]`` asks for:

- default: ``model.head`` itself.
- ``train.compile``: ``torch.compile`` of the whole head (:func:`compile_head`). The
  Triton interaction backend is a ``torch.autograd.Function`` over ``torch.library``
  custom ops with fake rules, so Dynamo traces it into the same graph as the MLPs (no
  graph break: checked with ``torch._dynamo.explain``) and Inductor calls the kernels
  as opaque ops; the reference backend is plain PyTorch and is fused with the rest.
  Graph breaks are allowed (not ``fullgraph``) so a future arch that breaks still runs.
  The first new batch size (the last, smaller batch; evaluation) recompiles once with a
  dynamic batch dimension.
- ``train.cuda_graphs``: a :class:`GraphedHead`, the head's forward AND backward
  captured as two CUDA graphs for the batch shape of the first training call and
  replayed for every call of that shape; every other call runs eagerly (counted,
  logged once). With ``train.compile`` too, the compiled head is what is captured.
  The plain step's lookup writes the pooled embeddings straight into the graph's input
  (:meth:`GraphedHead.pooled_buffer`, :mod:`recaccel.train.model.head_input`): a replay
  then copies nothing in.

Parameters are read by the graphs at their addresses: the dense optimizer must update
them in place (every ``torch.optim`` optimizer does; loading a checkpoint with
``load_state_dict`` copies in place too). A replay checks the addresses and raises if a
parameter's storage moved. The dense optimizer step itself stays eager (outside this
module: capturing it needs ``capturable=True`` optimizers and static gradients).

Shapes: B batch, Dd dense features, F sparse fields, D embedding dim.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from recaccel.config import TrainConfig
from recaccel.errors import ConfigError
from recaccel.models.dlrm import DLRM

logger = logging.getLogger(__name__)

# (dense [B, Dd], pooled [B, F, D]) -> logits [B]
Head = Callable[[Tensor, Tensor], Tensor]

# Warmup runs before capture (torch's CUDA graph docs: lazy initialisation, cuBLAS
# workspaces and compilation must happen outside the capture).
WARMUP_ITERS = 3


def check_head_options(train_cfg: TrainConfig, model: nn.Module, device: torch.device) -> None:
    """Refuses ``train.compile`` / ``train.cuda_graphs`` where they cannot apply.

    Call it in meta mode too (where :func:`build_head` is not used): both keys are
    refused there, since the meta engines run the head functionally
    (``torch.func.functional_call`` over per-task adapted weights, second-order
    gradients), which neither a compiled wrapper nor a captured graph serves.

    Raises:
        ConfigError: one line naming the key and value.
    """
    for key, on in (("compile", train_cfg.compile), ("cuda_graphs", train_cfg.cuda_graphs)):
        if on and train_cfg.mode == "meta":
            raise ConfigError(
                f"train.{key}=true runs train.mode=dlrm only (the meta engines adapt the head "
                f"functionally, per task, with second-order gradients); use train.{key}=false"
            )
        if on and not isinstance(model, DLRM):
            raise ConfigError(
                f"train.{key}=true needs a DLRM with a dense head (dense_arch, interaction_arch, "
                f"over_arch); got a {type(model).__name__}"
            )
    if train_cfg.cuda_graph_scope == "step" and not train_cfg.cuda_graphs:
        logger.warning("train.cuda_graph_scope=step captures nothing with train.cuda_graphs=false")
    if train_cfg.cuda_graphs and device.type != "cuda":
        raise ConfigError(
            f"train.cuda_graphs=true captures CUDA graphs; device is {device}: use train.device=cuda "
            "or train.cuda_graphs=false"
        )


def build_head(model: DLRM, train_cfg: TrainConfig, device: torch.device) -> Head:
    """The head callable ``(dense [B, Dd], pooled [B, F, D]) -> logits [B]`` of ``train_cfg``.

    Call it under the run's autocast as ``model.head`` would be (a :class:`GraphedHead`
    captures under the autocast state of its first training call).

    Raises:
        ConfigError: see :func:`check_head_options`.
    """
    check_head_options(train_cfg, model, device)
    head = compile_head(model) if train_cfg.compile else model.head
    # With cuda_graph_scope = "step" the whole step is captured (its runner's): the head is plain.
    graphed = train_cfg.cuda_graphs and train_cfg.cuda_graph_scope == "head"
    return GraphedHead(model, head) if graphed else head


def compile_head(model: DLRM) -> Head:
    """``torch.compile`` of ``model.head`` (the module itself is left as it is)."""
    return torch.compile(model.head)


def head_parameters(model: DLRM) -> list[nn.Parameter]:
    """The trainable parameters the head reads (dense, interaction and over arches), once each."""
    params: dict[int, nn.Parameter] = {}
    for arch in (model.dense_arch, model.interaction_arch, model.over_arch):
        for p in arch.parameters():
            if p.requires_grad:
                params.setdefault(id(p), p)
    return list(params.values())


def _describe(t: Tensor) -> tuple:
    return (tuple(t.shape), t.dtype, t.device, t.requires_grad)


@dataclass(frozen=True)
class CallKey:
    """What a captured graph is valid for: the inputs' shapes, dtypes, devices and whether
    they require grad, and the CUDA autocast state."""

    dense: tuple
    pooled: tuple
    autocast: tuple[bool, torch.dtype]

    @staticmethod
    def of(dense: Tensor, pooled: Tensor) -> CallKey:
        return CallKey.of_pooled(dense, _describe(pooled))

    @staticmethod
    def of_pooled(dense: Tensor, pooled: tuple) -> CallKey:
        """The key of a call with ``dense`` and a pooled tensor described by ``pooled``
        (shape, dtype, device, requires grad), under the current autocast state."""
        autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        return CallKey(_describe(dense), pooled, autocast)

    @property
    def batch_size(self) -> int:
        return self.pooled[0][0]


class HeadGraph:
    """A captured head: static input, output and gradient tensors, and the two replays.

    ``replay_forward`` recomputes ``static_out`` from ``static_dense``, ``static_pooled``
    and the parameters; ``replay_backward`` recomputes ``static_grads`` (one per
    differentiable input: dense and pooled where they require grad, then ``params``;
    None where unused) from ``static_grad_out``. The saved activations live in the
    graph's memory, so call i's backward must run before call i+1's forward: checked.

    Gradients leave as follows: the parameters' static gradients as they are (autograd's
    accumulation then copies them into ``.grad``, or adds them, and never adopts graph
    memory as ``.grad``, which the next replay would overwrite: accumulation over
    micro-batches stays right); dense and pooled gradients and the logits as copies, so
    nothing handed out aliases graph memory, with one exception: a pooled input its
    lookup wrote into the buffer lent for a consumer that uses its gradient up inside
    the same ``backward()`` (:meth:`GraphedHead.pooled_buffer` with ``lend_gradient``:
    the fused sparse update, which keeps nothing) gets the static gradient itself, saving
    a copy of [B, F, D]. From this node alone nothing would tell that consumer apart from
    one that keeps the gradient (``retain_grad``, a hook, a leaf's ``.grad``), which the
    next replay would overwrite: hence the lender's promise, never a guess here.

    Input: a ``pooled`` that already is ``static_pooled`` (same storage, shape and
    strides: the lookup wrote into :meth:`GraphedHead.pooled_buffer`) is not copied;
    :attr:`copy_ins` counts the copies made.
    """

    def __init__(
        self,
        key: CallKey,
        params: Sequence[nn.Parameter],
        static: tuple[Tensor, Tensor, Tensor, Tensor],
        static_grads: tuple[Tensor | None, ...],
        replay_forward: Callable[[], None],
        replay_backward: Callable[[], None],
    ) -> None:
        self.key = key
        self.params = tuple(params)
        self.static_dense, self.static_pooled, self.static_out, self.static_grad_out = static
        self.static_grads = static_grads
        self.replay_forward = replay_forward
        self.replay_backward = replay_backward
        self._addresses = [p.data_ptr() for p in self.params]
        self.generation = 0  # graphed forwards so far
        self.copy_ins = 0  # forwards that copied pooled into static_pooled
        self.pending = False  # a graphed forward's backward has not run yet
        self.lend_next = False  # the next forward's pooled, if the buffer, lends its gradient
        self.lent = False  # this call's pooled gradient is handed out uncopied
        self.clone_outs = 0  # backwards that copied the pooled gradient out

    def check_parameters(self) -> None:
        """Raises RuntimeError if a parameter's storage was replaced (the graph reads old addresses)."""
        if any(p.data_ptr() != a for p, a in zip(self.params, self._addresses)):
            raise RuntimeError(
                "GraphedHead: a head parameter was replaced after capture (CUDA graphs read parameters "
                "by address): update parameters in place (torch.optim does) or build a new GraphedHead"
            )

    def forward(self, dense: Tensor, pooled: Tensor) -> tuple[Tensor, int]:
        """Logits [B] (a copy) and the generation to hand to :meth:`backward`."""
        with torch.no_grad():
            self.static_dense.copy_(dense)
            in_place = aliases(pooled, self.static_pooled)
            if not in_place:
                self.static_pooled.copy_(pooled)
                self.copy_ins += 1
        self.lent, self.lend_next = in_place and self.lend_next, False
        self.replay_forward()
        self.generation += 1
        self.pending = True
        return self.static_out.clone(), self.generation

    def backward(self, grad_out: Tensor, generation: int) -> tuple[Tensor | None, ...]:
        """Gradients w.r.t. (dense, pooled, *params); None where not required."""
        if generation != self.generation:
            raise RuntimeError(
                "GraphedHead: the backward of a graphed call ran after a later graphed forward, which "
                "overwrote its saved activations; run each step's backward before the next head call"
            )
        self.static_grad_out.copy_(grad_out)
        self.replay_backward()
        self.pending = False
        grads = iter(self.static_grads)
        dense = next(grads).clone() if self.static_dense.requires_grad else None
        pooled = next(grads) if self.static_pooled.requires_grad else None
        if pooled is not None and not self.lent:
            pooled = pooled.clone()
            self.clone_outs += 1
        return (dense, pooled, *grads)


def aliases(t: Tensor, static: Tensor) -> bool:
    """Whether ``t`` is ``static``'s memory seen the same way (storage, shape, strides, dtype)."""
    return (
        t.data_ptr() == static.data_ptr()
        and t.shape == static.shape
        and t.stride() == static.stride()
        and t.dtype == static.dtype
        and t.device == static.device
    )


class _ReplayHead(torch.autograd.Function):
    """One autograd node whose forward and backward are a :class:`HeadGraph`'s replays."""

    @staticmethod
    def forward(ctx, graph: HeadGraph, dense: Tensor, pooled: Tensor, *params: Tensor) -> Tensor:
        logits, ctx.generation = graph.forward(dense, pooled)
        ctx.graph = graph
        return logits

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logits: Tensor) -> tuple[Tensor | None, ...]:
        return (None, *ctx.graph.backward(grad_logits, ctx.generation))


def capture_head(
    head: Head,
    params: Sequence[nn.Parameter],
    dense: Tensor,
    pooled: Tensor,
    *,
    warmup_iters: int = WARMUP_ITERS,
) -> HeadGraph:
    """Captures ``head``'s forward and backward on CUDA for inputs shaped like ``dense``, ``pooled``.

    As torch's CUDA graph docs require: warmup iterations on a side stream first, then
    the forward and the backward (``torch.autograd.grad`` w.r.t. the inputs that require
    grad and ``params``, so no ``.grad`` is touched) captured in one memory pool. Under
    autocast, warmup and capture run under the same autocast with its weight-cast cache
    off (a cached cast would be a stale copy at replay; uncached, the casts are in the
    graph and read the current parameters). ``thread_local`` capture mode: the loader's
    prefetch thread may pin memory and copy during the capture.
    """
    if not pooled.is_cuda:
        raise ValueError(f"capture_head: CUDA graphs need CUDA tensors, got pooled on {pooled.device}")
    key = CallKey.of(dense, pooled)
    enabled, dtype = key.autocast
    static_dense = dense.detach().clone().requires_grad_(dense.requires_grad)
    static_pooled = pooled.detach().clone().requires_grad_(pooled.requires_grad)
    inputs = [t for t in (static_dense, static_pooled) if t.requires_grad] + list(params)

    def run() -> Tensor:
        with torch.autocast("cuda", dtype=dtype, enabled=enabled, cache_enabled=False):
            return head(static_dense, static_pooled)

    with torch.cuda.device(pooled.device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup_iters):
                out = run()
                torch.autograd.grad(out, inputs, torch.ones_like(out), allow_unused=True)
        torch.cuda.current_stream().wait_stream(side)
        fwd, bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(fwd, capture_error_mode="thread_local"):
            static_out = run()
        static_grad_out = torch.empty_like(static_out)
        with torch.cuda.graph(bwd, pool=fwd.pool(), capture_error_mode="thread_local"):
            static_grads = torch.autograd.grad(static_out, inputs, static_grad_out, allow_unused=True)
    # Only the output's memory is replayed into: dropping its autograd graph lets go of the
    # parameters' AccumulateGrad nodes made on the capture stream, which the replayed
    # backward's gradients (main stream) would otherwise meet every step (torch warns of a
    # stream mismatch and synchronises the two streams).
    static_out = static_out.detach()
    return HeadGraph(
        key,
        params,
        (static_dense, static_pooled, static_out, static_grad_out),
        tuple(static_grads),
        fwd.replay,
        bwd.replay,
    )


class GraphedHead:
    """The head replayed from CUDA graphs for one batch shape, eager for any other call.

    The first call that can be graphed (grad enabled, head in training mode) captures
    forward and backward for its key (:class:`CallKey`: shapes, dtypes, requires-grad
    flags, autocast state) with :func:`capture_head`; every later call with that key
    replays them in one autograd node, so ``loss.backward()`` runs the graphed backward
    and the gradient w.r.t. ``pooled`` flows on into the embedding's backward. Any other
    call (the last, smaller batch of an epoch without ``data.drop_last``, evaluation
    under ``no_grad`` or in eval mode) runs ``head`` eagerly: counted in
    :attr:`eager_calls` (:attr:`graphed_calls` for replays), logged once.

    One graphed call at a time: a call's backward must run before the next graphed
    call's forward (checked; the activations live in the graph's memory).

    Args:
        model: the DLRM whose head parameters the graph reads.
        head: the callable to capture and to fall back to (``model.head``, or compiled).
        warmup_iters: eager iterations on a side stream before the capture.
        capture: makes the :class:`HeadGraph` (:func:`capture_head`; a test may pass one
            that records the same static-memory contract without CUDA).
    """

    def __init__(
        self,
        model: DLRM,
        head: Head | None = None,
        *,
        warmup_iters: int = WARMUP_ITERS,
        capture: Callable[..., HeadGraph] = capture_head,
    ) -> None:
        self.model = model
        self.head = head if head is not None else model.head
        self.warmup_iters = warmup_iters
        self.capture = capture
        self.graph: HeadGraph | None = None
        self.eager_calls = 0
        self.graphed_calls = 0
        self._fallback_logged = False

    def _graphable(self) -> bool:
        return torch.is_grad_enabled() and self.model.training

    def pooled_buffer(
        self,
        dense: Tensor,
        shape: tuple[int, int, int],
        dtype: torch.dtype,
        device: torch.device,
        *,
        lend_gradient: bool = False,
    ) -> Tensor | None:
        """Where a lookup may write the pooled input [B, F, D] of the next call, or None.

        A detached alias of the graph's static input when a graph is captured and a call
        now with ``dense`` and a pooled tensor of this shape, dtype and device that
        requires grad (a training lookup's output) would replay it: the replay then
        skips its copy-in. Else None (no graph yet, another shape, evaluation): look up
        as usual and the call copies.

        Ordering: the static input and the saved activations belong to the last graphed
        call until its backward has run, so the buffer is handed out only when no
        graphed call's backward is pending. Ask for it right before the lookup whose
        result is the very next head call's input; a lookup made ahead of a pending
        backward (a pipeline's prefetch of the next batch) must not write into it.

        ``lend_gradient``: the caller promises that the lookup's result feeds only this
        head call and that its backward uses the gradient up before ``backward()``
        returns, keeping no reference (the fused sparse update): the call's backward then
        hands out the graph's static gradient w.r.t. ``pooled`` without copying it.
        """
        g = self.graph
        if g is None or g.pending or not self._graphable():
            return None
        key = CallKey.of_pooled(dense, (tuple(shape), dtype, torch.device(device), True))
        if key != g.key:
            return None
        g.lend_next = lend_gradient
        return g.static_pooled.detach()

    def __call__(self, dense: Tensor, pooled: Tensor) -> Tensor:
        """Logits [B] of dense [B, Dd] and pooled [B, F, D]."""
        graphable = self._graphable()
        if graphable and self.graph is None:
            params = head_parameters(self.model)
            self.graph = self.capture(self.head, params, dense, pooled, warmup_iters=self.warmup_iters)
            logger.info("cuda graphs: captured the dense head for a batch of %d rows", pooled.shape[0])
        if graphable and self.graph is not None and self.graph.key == CallKey.of(dense, pooled):
            return self._replay(dense, pooled)
        self._note_fallback(dense, pooled)
        self.eager_calls += 1
        return self.head(dense, pooled)

    def _replay(self, dense: Tensor, pooled: Tensor) -> Tensor:
        self.graph.check_parameters()
        self.graphed_calls += 1
        return _ReplayHead.apply(self.graph, dense, pooled, *self.graph.params)

    def _note_fallback(self, dense: Tensor, pooled: Tensor) -> None:
        if self._fallback_logged or not self._graphable():
            return  # evaluation calls are expected to run eagerly
        self._fallback_logged = True
        captured = self.graph.key.batch_size if self.graph is not None else None
        logger.info(
            "cuda graphs: a head call of %d rows does not match the captured graph (%s rows); calls "
            "that do not match run eagerly (logged once)",
            pooled.shape[0],
            captured,
        )
