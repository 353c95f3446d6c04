"""A stand-in for CUDA graph capture that keeps the graphs' static-memory contract on CPU."""

from __future__ import annotations

import torch

from recaccel.train.model.dense_head import CallKey, HeadGraph


def eager_capture(head, params, dense, pooled, *, warmup_iters):
    """A HeadGraph whose 'replays' recompute eagerly into the same static tensors a real
    capture allocates, so every replay overwrites outputs and gradients in place."""
    static_dense = dense.detach().clone().requires_grad_(dense.requires_grad)
    static_pooled = pooled.detach().clone().requires_grad_(pooled.requires_grad)
    inputs = [t for t in (static_dense, static_pooled) if t.requires_grad] + list(params)
    static_out = torch.empty(pooled.shape[0])
    static_grad_out = torch.empty_like(static_out)
    static_grads = tuple(torch.empty_like(t) for t in inputs)
    saved = {}

    def replay_forward():
        with torch.enable_grad():
            saved["out"] = head(static_dense, static_pooled)
        static_out.copy_(saved["out"].detach())

    def replay_backward():
        for s, g in zip(static_grads, torch.autograd.grad(saved["out"], inputs, static_grad_out)):
            s.copy_(g)

    statics = (static_dense, static_pooled, static_out, static_grad_out)
    return HeadGraph(
        CallKey.of(dense, pooled), params, statics, static_grads, replay_forward, replay_backward
    )
