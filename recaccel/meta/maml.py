"""The MAML inner and outer loop over T tasks, in three interchangeable engines.

Every engine computes the same thing. For each task t, starting from the shared
parameters ``p0`` (meta-parameters; the embedding shift starts at zero)::

    for k in 1..K:   p <- p - lr * grad_p L_support_t(p)      (lr: scalar or Meta-SGD rates)
    L_t = L_query_t(p)
    loss = mean of L_t over the tasks with real query rows

First order (FOMAML) treats the inner gradients as constants (detached); second order
differentiates through them. The engines:

- ``batched`` (default): the per-task parameters are stacked on a task axis and the
  head runs as batched matmuls for all T tasks at once; one ``autograd.grad`` call per
  inner step gives every task's gradient (task losses are independent, so the gradient
  of their sum w.r.t. task t's copy is task t's gradient). It is ``vmap`` written out
  by hand for Linear/ReLU heads: the same batched matmuls without functorch's per-op
  wrapping (recaccel-bench meta: about 1.25x faster than ``vmap`` for the whole step on
  2 CPU cores at T=S=Q=32).
- ``vmap``: the textbook ``torch.func.vmap`` of ``torch.func.grad`` over tasks through
  the model's own modules; works for any head whose ops ``vmap`` supports (in the
  ``head`` modes the interaction runs under ``vmap``: use its reference backend there).
- ``loop``: a Python loop over tasks with ``torch.autograd.grad``; the baseline.

Nothing here communicates: the inner loop is local to the process by construction.

Shapes: T tasks, S support and Q query rows per task.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from recaccel.config import Loss, MetaEngine, choices
from recaccel.meta.functional import masked_task_losses, mean_over_tasks
from recaccel.meta.heads import TaskHead

ENGINES = choices(MetaEngine)

Block = dict[str, Tensor]
Rates = dict[str, Tensor] | float


@dataclass
class MetaOutput:
    """What a meta step produces.

    Attributes:
        loss: scalar mean query loss after adaptation (differentiable unless evaluating).
        query_pred: [T, Q] query predictions after adaptation (logits or ratings).
        support_loss: scalar mean support loss before adaptation, detached.
    """

    loss: Tensor
    query_pred: Tensor
    support_loss: Tensor


def _rate(rates: Rates, name: str) -> Tensor | float:
    return rates if isinstance(rates, float) else rates[name]


def _detached(block: Block) -> Block:
    return {k: v.detach() for k, v in block.items()}


def run_batched(
    head: TaskHead,
    init: dict[str, Tensor],
    rates: Rates,
    support: Block,
    query: Block,
    *,
    steps: int,
    first_order: bool,
    loss: Loss,
) -> MetaOutput:
    """The batched engine; ``support`` / ``query`` hold [T, S|Q, ...] blocks."""
    num_tasks = support["labels"].shape[0]
    params = {n: v.expand(num_tasks, *v.shape) for n, v in init.items()}
    support_loss = None
    for _ in range(steps):
        if first_order:
            leaves, block = {n: v.detach().requires_grad_() for n, v in params.items()}, _detached(support)
        else:
            leaves, block = params, support
        with torch.enable_grad():
            losses = masked_task_losses(head.batched(leaves, block), block["labels"], block["mask"], loss)
            grads = torch.autograd.grad(losses.sum(), list(leaves.values()), create_graph=not first_order)
        if support_loss is None:
            support_loss = mean_over_tasks(losses.detach(), support["mask"])
        params = {n: v - _rate(rates, n) * g for (n, v), g in zip(params.items(), grads)}
    if support_loss is None:
        with torch.no_grad():
            pred = head.batched(params, support)
            support_loss = mean_over_tasks(
                masked_task_losses(pred, support["labels"], support["mask"], loss), support["mask"]
            )
    pred = head.batched(params, query)
    query_loss = mean_over_tasks(
        masked_task_losses(pred, query["labels"], query["mask"], loss), query["mask"]
    )
    return MetaOutput(query_loss, pred, support_loss)


def _task_adapt(
    head: TaskHead,
    rates: Rates,
    loss: Loss,
    steps: int,
    first_order: bool,
    grad_fn: Callable[[Callable[..., Tensor], dict[str, Tensor], Block], tuple[dict[str, Tensor], Tensor]],
) -> Callable[[dict[str, Tensor], Block, Block], tuple[Tensor, Tensor, Tensor]]:
    """One task's adaptation and query loss, given how to take a gradient."""

    def support_loss(params: dict[str, Tensor], block: Block) -> Tensor:
        return masked_task_losses(head.per_task(params, block), block["labels"], block["mask"], loss)

    def task(params: dict[str, Tensor], sup: Block, qry: Block) -> tuple[Tensor, Tensor, Tensor]:
        first = None
        for _ in range(steps):
            grads, value = grad_fn(support_loss, params, sup)
            first = value if first is None else first
            if first_order:
                grads = {n: g.detach() for n, g in grads.items()}
            params = {n: v - _rate(rates, n) * grads[n] for n, v in params.items()}
        if first is None:
            first = support_loss(params, sup).detach()
        pred = head.per_task(params, qry)
        return masked_task_losses(pred, qry["labels"], qry["mask"], loss), pred, first.detach()

    return task


def run_vmap(
    head: TaskHead,
    init: dict[str, Tensor],
    rates: Rates,
    support: Block,
    query: Block,
    *,
    steps: int,
    first_order: bool,
    loss: Loss,
) -> MetaOutput:
    """The ``torch.func`` engine: ``vmap`` over tasks of ``grad`` of the support loss."""

    def grad_fn(fn, params, block):
        return torch.func.grad_and_value(fn)(params, block)

    task = _task_adapt(head, rates, loss, steps, first_order, grad_fn)
    losses, pred, first = torch.func.vmap(task, in_dims=(None, 0, 0))(init, support, query)
    return MetaOutput(mean_over_tasks(losses, query["mask"]), pred, mean_over_tasks(first, support["mask"]))


def run_loop(
    head: TaskHead,
    init: dict[str, Tensor],
    rates: Rates,
    support: Block,
    query: Block,
    *,
    steps: int,
    first_order: bool,
    loss: Loss,
) -> MetaOutput:
    """The baseline: a Python loop over tasks, ``torch.autograd.grad`` per inner step."""

    def grad_fn(fn, params, block):
        if first_order:
            params, block = {n: v.detach().requires_grad_() for n, v in params.items()}, _detached(block)
        with torch.enable_grad():
            value = fn(params, block)
            grads = torch.autograd.grad(value, list(params.values()), create_graph=not first_order)
        return dict(zip(params, grads)), value

    task = _task_adapt(head, rates, loss, steps, first_order, grad_fn)
    num_tasks = support["labels"].shape[0]
    outs = [
        task(init, {k: v[t] for k, v in support.items()}, {k: v[t] for k, v in query.items()})
        for t in range(num_tasks)
    ]
    losses, pred, first = (torch.stack(x) for x in zip(*outs))
    return MetaOutput(mean_over_tasks(losses, query["mask"]), pred, mean_over_tasks(first, support["mask"]))


def run_engine(
    engine: MetaEngine,
    head: TaskHead,
    init: dict[str, Tensor],
    rates: Rates,
    support: Block,
    query: Block,
    *,
    steps: int,
    first_order: bool,
    loss: Loss,
) -> MetaOutput:
    """Dispatches to :func:`run_batched`, :func:`run_vmap` or :func:`run_loop`."""
    runners = {"batched": run_batched, "vmap": run_vmap, "loop": run_loop}
    if engine not in runners:
        raise ValueError(f"meta engine must be one of {ENGINES}, got {engine!r}")
    return runners[engine](head, init, rates, support, query, steps=steps, first_order=first_order, loss=loss)
