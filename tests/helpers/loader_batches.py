"""Seeded batches and a list-backed reader for the device loader tests."""

from __future__ import annotations

import torch

from recaccel.sparse import Batch, SparseFeatures, TaskBatch

EXACT = dict(rtol=0, atol=0)


def make_batch(b: int, dd: int, keys: list[str], seed: int, weights: bool, id_weights: bool) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(keys) * b,), generator=g)
    n = int(lengths.sum())
    sparse = SparseFeatures.from_lengths(
        keys,
        torch.randint(0, 1000, (n,), generator=g),
        lengths,
        torch.rand(n, generator=g) if id_weights else None,
    )
    return Batch(
        torch.randn(b, dd, generator=g),
        sparse,
        torch.rand(b, generator=g),
        torch.rand(b, generator=g) if weights else None,
    )


def assert_same(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, TaskBatch):
        for x, y in ((a.support, b.support), (a.query, b.query)):
            assert_same(x, y)
        for x, y in (
            (a.support_mask, b.support_mask),
            (a.query_mask, b.query_mask),
            (a.task_ids, b.task_ids),
        ):
            assert x.dtype == y.dtype
            torch.testing.assert_close(x.cpu(), y.cpu(), **EXACT)
        return
    assert a.sparse.keys == b.sparse.keys
    pairs = [
        (a.dense, b.dense),
        (a.labels, b.labels),
        (a.weights, b.weights),
        (a.sparse.values, b.sparse.values),
        (a.sparse.offsets, b.sparse.offsets),
        (a.sparse.weights, b.sparse.weights),
    ]
    for x, y in pairs:
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape
            torch.testing.assert_close(x.cpu(), y.cpu(), **EXACT)


class ListReader:
    """A Reader of fixed batches; state = number handed out. The loader reads only
    ``iter_with_state`` (plain iteration raises, so a loader that used it would fail)."""

    epoch, counters, num_batches = 0, {}, None

    def __init__(self, batches, fail_at: int | None = None) -> None:
        self.batches, self.pos, self.fail_at = batches, 0, fail_at

    def set_epoch(self, epoch: int) -> None:
        raise AssertionError("the loader does not move the epoch")

    def __iter__(self):
        raise AssertionError("the loader iterates iter_with_state()")

    def iter_with_state(self):
        for i, b in enumerate(self.batches):
            if i == self.fail_at:
                raise RuntimeError("reader broke")
            self.pos = i + 1
            yield b, self.state_dict()

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state) -> None:
        self.pos = state["pos"]
