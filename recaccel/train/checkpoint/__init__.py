"""Checkpoints in one package: what one holds and how it is saved and restored (state),
where a run's lie (paths), reading them as untrusted input (errors, payload, dcp_read), durable
writes and byte checks (digests), and the best periodic evaluation (best). Hybrid runs'
sharded folders are written by ``recaccel.train.distributed.dist_checkpoint``."""

__all__ = ["best", "dcp_read", "digests", "errors", "paths", "payload", "state"]
