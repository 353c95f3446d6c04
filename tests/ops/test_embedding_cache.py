"""Host-placed tables behind a device cache (recaccel.ops.embedding.cache).

A host-placed module must train bit for bit like the device-placed one built alike (same
seed) on the CPU, with a cache much smaller than the tables (so that rows are evicted and
dirty ones written back), whatever the order of preparations and steps; its checkpoints
must load into a device-placed module and back; its statistics must follow a hand-made
trace; its errors must name the tables and the keys to change. Triton runs under
TRITON_INTERPRET=1 without CUDA (tiny shapes); the GPU tests (``-m gpu``) check the
copy stream against the device placement.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before the kernel module is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from recaccel.errors import ConfigError
from recaccel.ops.backend import triton_interpret_enabled
from recaccel.ops.embedding import PackedEmbeddingBag, SparseOptimConfig, TableSpec
from recaccel.ops.embedding.cache import CacheOptions
from recaccel.ops.embedding.cache.host_store import check_host_memory
from recaccel.ops.embedding.cache.pack import CachedPack
from recaccel.sparse import SparseFeatures
from tests.helpers.ops_inputs import random_sparse_batch

needs_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_interpret_enabled()),
    reason="triton kernels need CUDA or TRITON_INTERPRET=1",
)
CFG = SparseOptimConfig(lr=0.1, eps=1e-3, weight_decay=0.01)
KEYS = ["b2", "a", "b1"]


def _tables(optimizer: str, placement: str, rows: tuple[int, int] = (120, 60)) -> list[TableSpec]:
    return [
        TableSpec("a", rows[0], 4, pooling="mean", optimizer=optimizer, placement=placement),
        TableSpec("b", rows[1], 4, features=["b1", "b2"], optimizer=optimizer, placement=placement),
    ]


def _module(tables, backend="reference", device="cpu", **cache) -> PackedEmbeddingBag:
    options = CacheOptions(**cache) if cache else None
    return PackedEmbeddingBag(tables, backend=backend, optim=CFG, seed=3, device=device, cache=options)


def _batch(tables, seed, batch_size=3, max_len=4, keys=KEYS, device="cpu", weighted=True) -> SparseFeatures:
    rows = {f: t.num_rows for t in tables for f in t.features}
    gen = torch.Generator().manual_seed(seed)
    return random_sparse_batch(
        rows, keys, batch_size, max_len=max_len, weighted=weighted, generator=gen, device=device
    )


def _grad(shape, seed: int, device="cpu") -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)


def _assert_same_state(got: PackedEmbeddingBag, want: PackedEmbeddingBag, exact: bool = True) -> None:
    got_sd, want_sd = got.state_dict(), want.state_dict()
    assert sorted(got_sd) == sorted(want_sd)
    for k in want_sd:
        if exact:
            assert torch.equal(got_sd[k].cpu(), want_sd[k].cpu()), k
        else:
            torch.testing.assert_close(got_sd[k].cpu(), want_sd[k].cpu(), msg=k)


def _host_pack(m: PackedEmbeddingBag) -> CachedPack:
    return next(p for p in m._packs if isinstance(p, CachedPack))


# ------------------------------------------------------------ host == device, bit for bit


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_host_trains_bit_identical_to_device_with_evictions(optimizer):
    device = _module(_tables(optimizer, "device"))
    host = _module(_tables(optimizer, "host"), rows=74, window=2)
    # Prepared one batch ahead, as the sync pipeline does: batch i+1 is made resident
    # (evicting dirty rows) before batch i's backward.
    batches = [_batch(device.tables, seed=s, batch_size=1 if s == 2 else 3) for s in range(10)]
    ahead = host.prepare(batches[0])
    for step, sf in enumerate(batches):
        ready = ahead
        out_host = host(ready)
        if step + 1 < len(batches):
            ahead = host.prepare(batches[step + 1])
        out_dev = device(sf)
        assert torch.equal(out_host, out_dev), step
        g = _grad(out_dev.shape, step)
        out_host.backward(g)
        out_dev.backward(g)
    stats = host.cache_stats()
    assert stats["cache_rows_evicted"] > 0 and stats["cache_bytes_d2h"] > 0
    _assert_same_state(host, device)


@needs_triton
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_host_trains_bit_identical_to_device_on_triton(optimizer):
    device = _module(_tables(optimizer, "device", (12, 9)), backend="triton")
    host = _module(_tables(optimizer, "host", (12, 9)), backend="triton", rows=8, window=1)
    for step in range(3):
        sf = _batch(device.tables, seed=20 + step, batch_size=2, max_len=3)
        out_host, out_dev = host(host.prepare(sf)), device(sf)
        assert torch.equal(out_host, out_dev)
        g = _grad(out_dev.shape, step)
        out_host.backward(g)
        out_dev.backward(g)
    assert host.cache_stats()["cache_rows_evicted"] > 0
    _assert_same_state(host, device)


def test_mixed_placement_and_big_stacked_batch():
    """One host pack beside one device pack; a meta-style lookup (support and query rows of
    many tasks stacked in one batch) with duplicate ids across tasks."""
    tables = lambda host_b: [  # noqa: E731
        TableSpec("a", 40, 4, pooling="mean"),
        TableSpec("b", 200, 4, features=["b1", "b2"], optimizer="adam", placement=host_b),
    ]
    device, host = _module(tables("device")), _module(tables("host"), fraction=0.5, window=1)
    assert [p.placement for p in host.plan.packs] == ["device", "host"]
    for step in range(3):
        sf = _batch(device.tables, seed=40 + step, batch_size=16, max_len=3)
        out_host, out_dev = host(sf), device(sf)
        assert torch.equal(out_host, out_dev)
        g = _grad(out_dev.shape, step)
        out_host.backward(g)
        out_dev.backward(g)
    assert host.cache_stats()["cache_rows"] == 100 and host.cache_stats()["cache_rows_evicted"] > 0
    _assert_same_state(host, device)


def test_micro_batches_and_eval_match_device():
    device = _module(_tables("rowwise_adagrad", "device"))
    host = _module(_tables("rowwise_adagrad", "host"), rows=50, window=1)
    for step in range(3):
        sf = _batch(device.tables, seed=60 + step, batch_size=4)
        ready = host.prepare(sf)
        parts = [host.lookup_rows(ready, 0, 1), host.lookup_rows(ready, 1, 4)]
        assert torch.equal(torch.cat(parts), device(sf).detach())
        g = _grad((4, 3, 4), step)
        host.apply_gradient(ready, g)
        device.apply_gradient(device.prepare(sf), g)
    host.eval()
    device.eval()
    with torch.no_grad():
        sf = _batch(device.tables, seed=99, batch_size=4)
        assert torch.equal(host(sf), device(sf))
    _assert_same_state(host, device)


def _train_released_batches(host, device, batches) -> None:
    """window=1: preparing the next batch releases the previous one before its backward and
    even before its lookup; the three batches' steps on ``host`` match ``device``'s."""
    a, b, c = batches
    pa, pb = host.prepare(a), host.prepare(b)  # a released before its lookup
    out_a = host(pa)
    host.prepare(c)  # b released; a's rows may be evicted before its backward
    host.prepare(a)
    pc = host.prepare(c)
    out_a.backward(_grad(out_a.shape, 1))
    out_b = host(pb)
    out_b.backward(_grad(out_b.shape, 2))
    out_c = host(pc)
    out_c.backward(_grad(out_c.shape, 3))
    for sf, seed, got in ((a, 1, out_a), (b, 2, out_b), (c, 3, out_c)):
        out = device(sf)
        assert torch.equal(got, out)
        out.backward(_grad(out.shape, seed))
    _assert_same_state(host, device)


def test_released_batches_are_made_resident_again():
    """Batches released before their lookup or backward are made resident again where
    used, exactly."""
    device = _module(_tables("adam", "device"))
    host = _module(_tables("adam", "host"), rows=100, window=1)
    _train_released_batches(host, device, [_batch(device.tables, seed=s, batch_size=4) for s in (80, 81, 82)])


@needs_triton
def test_released_batches_are_made_resident_again_on_triton_with_the_piece_lanes(monkeypatch):
    """As above on the Triton backend with the piece lanes tuned: a batch prepared again
    before its update hands the update its fresh sorted occurrences and pieces (a stale
    copy would update the old slots), bit for bit the all-device module."""
    from recaccel.ops.embedding.prepared import PreparedPack
    from recaccel.ops.embedding.triton import tuning

    lanes = {"piece_len": 2, "block_pieces": 4, "unroll": 2, "num_warps": 2}
    real = tuning.lookup
    monkeypatch.setattr(
        tuning,
        "lookup",
        lambda d, key, table=None: dict(lanes) if key.startswith("bwd_") else real(d, key, table),
    )
    taken = []
    real_take = PreparedPack.take
    monkeypatch.setattr(
        PreparedPack, "take", lambda self, fresh: taken.append(fresh.sorted) or real_take(self, fresh)
    )
    device = _module(_tables("adam", "device", (12, 9)), backend="triton")
    host = _module(_tables("adam", "host", (12, 9)), backend="triton", rows=12, window=1)
    batches = [_batch(device.tables, seed=s, batch_size=2, max_len=3) for s in (80, 81, 82)]
    _train_released_batches(host, device, batches)
    assert taken and all(t is not None and t.piece_len == 2 for t in taken)  # refreshed, with pieces


# ------------------------------------------------------------------------ checkpoints


def test_checkpoints_move_between_placements():
    host = _module(_tables("adam", "host"), rows=40, window=1)
    for step in range(3):
        out = host(_batch(host.tables, seed=100 + step))
        out.backward(_grad(out.shape, step))
    device = _module(_tables("adam", "device"))
    device.load_state_dict(host.state_dict())
    _assert_same_state(device, host)
    # Back into a fresh host module with rows resident: the loaded rows replace them.
    other = _module(_tables("adam", "host"), rows=40, window=1)
    other(_batch(other.tables, seed=7)).backward(torch.ones(3, 3, 4))
    other.load_state_dict(device.state_dict())
    for step in range(3):
        sf = _batch(host.tables, seed=200 + step)
        out_o, out_d = other(sf), device(sf)
        assert torch.equal(out_o, out_d)
        out_o.backward(_grad(out_o.shape, step))
        out_d.backward(_grad(out_d.shape, step))
    _assert_same_state(other, device)


def test_table_state_writes_reach_the_cache():
    host = _module(_tables("sgd", "host"), rows=40)
    sf = _batch(host.tables, seed=5, weighted=False)
    host(sf).backward(torch.ones(3, 3, 4))
    with torch.no_grad():
        host.table_state("a")["weight"].fill_(2.0)
        host.table_state("b")["weight"].fill_(0.0)
    host.eval()
    want = torch.where(sf.lengths().view(3, 3).T[:, 1] > 0, 2.0, 0.0)  # "a" (mean) is feature 1
    out = host(sf)
    assert torch.equal(out[:, 1], want[:, None].expand(3, 4))
    assert torch.equal(out[:, [0, 2]], torch.zeros(3, 2, 4))


# ------------------------------------------------------------------ stats and policies


def _trace_module(policy: str) -> PackedEmbeddingBag:
    m = PackedEmbeddingBag(
        [TableSpec("a", 10, 4, placement="host", optimizer="sgd")],
        backend="reference",
        seed=0,
        cache=CacheOptions(rows=3, policy=policy, window=1),
    )
    return m.eval()


def _lookup_ids(m: PackedEmbeddingBag, ids: list[int]) -> None:
    with torch.no_grad():
        m(SparseFeatures.from_lengths(["a"], torch.tensor(ids), torch.tensor([len(ids)])))


@pytest.mark.parametrize(("policy", "gone"), [("lru", 1), ("lfu", 2)])
def test_stats_and_victims_on_a_hand_made_trace(policy, gone):
    m = _trace_module(policy)
    # [0 1]: 2 misses (slots 0, 1). [1 2]: 1 hit, row 2 to slot 2. [3]: full; LRU and LFU both
    # evict row 0 (slot 0: oldest; fewest uses, oldest). [0 3]: row 3 hits; row 0 needs a
    # slot: LRU evicts row 1 (slots 1 and 2 tie on last use: lower slot), LFU row 2
    # (requested once; row 1 twice).
    for ids in ([0, 1], [1, 2], [3], [0, 3, 3]):
        _lookup_ids(m, ids)
    stats = m.cache_stats()
    assert stats["cache_requests"] == 7 and stats["cache_hits"] == 2
    assert stats["cache_hit_rate"] == 2 / 7
    assert stats["cache_rows_fetched"] == 5 and stats["cache_rows_evicted"] == 2
    assert stats["cache_bytes_h2d"] == 5 * 4 * 4 and stats["cache_bytes_d2h"] == 0  # eval: nothing dirty
    assert stats["cache_rows"] == 3 and stats["cache_staging_bytes"] <= 3 * 4 * 4
    resident = _host_pack(m).table.slot_of >= 0
    assert resident.nonzero().flatten().tolist() == sorted({0, 1, 2, 3} - {gone})


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_victims_are_never_locked_rows(policy):
    """The rows of the window's batches stay in their slots until released (LFU would
    otherwise evict the newest rows first: they have been requested least)."""
    tables = _tables("rowwise_adagrad", "host", (30, 20))
    host = _module(tables, rows=42, window=2, policy=policy)
    pack = _host_pack(host)
    locked: list[tuple] = []
    for step in range(12):
        sf = _batch(tables, seed=300 + step, batch_size=3, max_len=3)
        ticket = host.prepare(sf).packs[0].ticket
        locked = (locked + [(ticket, pack.table.row_of.index_select(0, ticket.slots).clone())])[-2:]
        for ticket, rows in locked:
            assert not ticket.released
            assert (pack.table.locks.index_select(0, ticket.slots) > 0).all()
            assert torch.equal(pack.table.row_of.index_select(0, ticket.slots), rows)
            assert torch.equal(pack.table.slot_of.index_select(0, rows).long(), ticket.slots)
    assert host.cache_stats()["cache_rows_evicted"] > 0


def test_lfu_never_evicts_a_locked_row():
    """LFU ranks the window's fresh rows (requested once) before an old hot row: the locks
    must keep them."""
    m = PackedEmbeddingBag(
        [TableSpec("a", 10, 4, placement="host", optimizer="sgd")],
        backend="reference",
        cache=CacheOptions(rows=4, policy="lfu", window=2),
    )
    pack = _host_pack(m)
    for ids in ([0], [0], [0], [1, 2], [3, 4]):  # training preparations: no lookup releases them
        m.prepare(SparseFeatures.from_lengths(["a"], torch.tensor(ids), torch.tensor([len(ids)])))
    # [3 4] takes the empty slot and row 0's (hot, but no longer locked); rows 1, 2 stay.
    assert (pack.table.slot_of >= 0).nonzero().flatten().tolist() == [1, 2, 3, 4]


# ------------------------------------------------------------------------------ errors


def test_cache_smaller_than_a_batch_is_one_line_error():
    host = _module(_tables("sgd", "host"), rows=3, window=1)
    sf = SparseFeatures.from_lengths(["a"], torch.tensor([0, 1, 2, 3, 4]), torch.tensor([5]))
    with pytest.raises(ConfigError, match=r"tables \['a', 'b'\] has 3 rows, but a batch needs 5 unique") as e:
        host.prepare(sf)
    assert "model.cache_rows" in str(e.value) and "\n" not in str(e.value)


def test_window_locks_count_against_the_cache():
    host = _module(_tables("sgd", "host"), rows=5, window=2)
    host.prepare(SparseFeatures.from_lengths(["a"], torch.tensor([0, 1, 2]), torch.tensor([3])))
    with pytest.raises(ConfigError, match="needs 3 unique rows and the 1 batches of the window lock 3 more"):
        host.prepare(SparseFeatures.from_lengths(["a"], torch.tensor([5, 6, 7]), torch.tensor([3])))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "autograd"}, "needs mode='fused'"),
        ({"dtype": "bf16"}, "needs float32 rows"),
        ({"backend": "fbgemm"}, "fbgemm"),
    ],
)
def test_unsupported_host_options(kwargs, match):
    kwargs = {"backend": "reference", **kwargs}
    with pytest.raises(ConfigError, match=match):
        PackedEmbeddingBag(_tables("sgd", "host"), **kwargs)


def test_host_memory_is_checked_before_allocating():
    from recaccel.ops.embedding.packing import PackingPlan

    layouts = PackingPlan(_tables("adam", "host", (1000, 1000))).packs
    check_host_memory(layouts, available=2000 * 12 * 4)  # rows, m1, m2: 12 floats a row
    with pytest.raises(ConfigError, match=r"need 0\.00 GiB of host memory .* only"):
        check_host_memory(layouts, available=2000 * 12 * 4 - 1)


def test_cache_options_are_checked():
    with pytest.raises(ConfigError, match="model.cache_fraction"):
        CacheOptions(fraction=0.0)
    with pytest.raises(ConfigError, match="model.cache_policy"):
        CacheOptions(policy="fifo")
    assert CacheOptions(fraction=0.1).capacity(95) == 10
    assert CacheOptions(rows=500).capacity(95) == 95


# --------------------------------------------------------------------------------- GPU


def _train_prepared_one_ahead(optimizer: str, device: torch.device) -> None:
    """Trains a host-table module on batches prepared one ahead (as the pipeline does; on
    CUDA on a side stream) and a device-table module on the same batches: equal outputs
    each step, close state at the end, and rows evicted on the way."""
    on_cuda = device.type == "cuda"
    dev = _module(_tables(optimizer, "device", (400, 300)), backend="auto", device=device)
    # 200 rows: a batch's unique rows (up to ~80) and the prepared batch ahead's stay locked
    # together; 8 batches touch ~400 of the 700 rows, so rows are still evicted.
    host = _module(_tables(optimizer, "host", (400, 300)), backend="auto", device=device, rows=200, window=2)
    side = torch.cuda.Stream() if on_cuda else None
    batches = [_batch(dev.tables, seed=500 + s, batch_size=16, max_len=4, device=device) for s in range(8)]

    def prepare(sf):
        if not on_cuda:
            return host.prepare(sf), None
        with torch.cuda.stream(side):
            ready = host.prepare(sf)
            event = torch.cuda.Event()
            event.record(side)
        return ready, event

    ahead = prepare(batches[0])
    for step, sf in enumerate(batches):
        ready, event = ahead
        if on_cuda:
            torch.cuda.current_stream().wait_event(event)
            # Made on the side stream, used here: without this the allocator may hand its
            # memory to a later preparation while this step's kernels still read it.
            ready.record_stream(torch.cuda.current_stream())
        out_host = host(ready)
        if step + 1 < len(batches):
            ahead = prepare(batches[step + 1])
        out_dev = dev(sf)
        torch.testing.assert_close(out_host, out_dev)
        g = _grad(out_dev.shape, step, device)
        out_host.backward(g)
        out_dev.backward(g)
    assert host.cache_stats()["cache_rows_evicted"] > 0
    _assert_same_state(host, dev, exact=False)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_prepared_one_ahead_trains_like_device(optimizer):
    _train_prepared_one_ahead(optimizer, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_gpu_prepared_on_a_side_stream_trains_like_device(optimizer):
    """The copy stream's fetches and write-backs must be ordered against the step on the
    main stream."""
    _train_prepared_one_ahead(optimizer, torch.device("cuda"))
