"""The sharded embedding lookup of a hybrid model, guarded: communication failures become
one-line errors, the monitor times its all-to-alls, and TorchRec's train pipeline can feed
it the pooled result it computed ahead."""

from __future__ import annotations

from typing import Any

from torch import nn


class GuardedLookup(nn.Module):
    """Runs the sharded lookup's forward with communication errors made clear.

    In a step of TorchRec's train pipeline the pooled result is computed by the
    pipeline's own call of the sharded module and :meth:`feed` s the next lookup;
    any other lookup (evaluation between steps) first detaches the pipeline, giving
    the sharded module its own forward back.
    """

    def __init__(self, dmp: nn.Module, parallel: Any) -> None:
        super().__init__()
        self.dmp = dmp
        object.__setattr__(self, "parallel", parallel)  # not a submodule
        self._fed = None
        self.pipeline = None  # TorchRec's train pipeline while it drives the sharded module

    def feed(self, pooled) -> None:
        """Makes the next lookup return ``pooled`` (a pooled KeyedTensor or its awaitable)."""
        self._fed = pooled

    def clear_feed(self) -> bool:
        """Drops a fed result; returns whether one was left unused."""
        unused, self._fed = self._fed is not None, None
        return unused

    def detach_pipeline(self) -> None:
        """Gives the sharded module its own forward back (TorchRec's ``detach``; the
        pipeline's next ``progress`` re-attaches it, batches in flight kept)."""
        if self.pipeline is not None and self.pipeline._model_attached:
            self.pipeline.detach()

    def forward(self, kjt):
        ids = kjt.values().nbytes + kjt.lengths().nbytes
        with (
            self.parallel.collectives("the embedding lookup"),
            self.parallel.monitor.collective("lookup", ids),
        ):
            if self._fed is not None:
                pooled, self._fed = self._fed, None
            else:
                self.detach_pipeline()
                pooled = self.dmp(kjt)
            values = pooled.values()  # waits for the all-to-all inside the guard
        if values.requires_grad:
            # Its gradient is ready before the backward all-to-all waits for the other ranks:
            # this rank's own compute ends there (the straggler controller's measure).
            values.register_hook(self.parallel.monitor.local_backward_done)
        return pooled
