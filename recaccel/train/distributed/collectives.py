"""How a failed collective is told apart and reported (shared by the hybrid layout and
the launcher, which names the rank that failed first and never one that lost a peer)."""

from __future__ import annotations

from recaccel.errors import RecaccelError

_COMM_MARKERS = ("gloo", "nccl", "connection", "timed out", "timeout", "processgroup", "peer", "socket")


class CollectiveError(RecaccelError):
    """A collective failed: a peer rank exited, or did not answer within the timeout."""


def is_comm_error(error: BaseException) -> bool:
    """Whether ``error`` (raised inside a collective) is a communication failure."""
    import torch.distributed as dist

    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(m in text for m in _COMM_MARKERS)
