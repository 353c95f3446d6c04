"""Hybrid training pieces that need neither TorchRec nor a second process: rank slices of
batches, loss shares, the dense-gradient bucket, config parsing, launching."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from recaccel.config import load_config
from recaccel.errors import ConfigError, DataError, RecaccelError
from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.io.readers.protocol import Reader
from recaccel.models.factory import build_model
from recaccel.sparse import Batch, SparseFeatures, TaskBatch
from recaccel.train.distributed.dense_sync import DenseGradSync
from recaccel.train.distributed.hybrid_data import GlobalSlices, row_bounds
from recaccel.train.distributed.launch import check_launch, launch_config, strip_nproc
from recaccel.train.distributed.sharding import table_kinds
from recaccel.train.model.objectives import DLRMObjective, MetaObjective, loss_denominator

KEYS = ["a", "b", "c"]


def _sparse(rows: int, gen: torch.Generator, weighted: bool = False) -> SparseFeatures:
    lengths = torch.randint(0, 4, (len(KEYS) * rows,), generator=gen)
    values = torch.randint(0, 9, (int(lengths.sum()),), generator=gen)
    weights = torch.rand(values.shape, generator=gen) if weighted else None
    return SparseFeatures.from_lengths(KEYS, values, lengths, weights)


def _batch(rows: int, gen: torch.Generator, weights: bool = False) -> Batch:
    return Batch(
        torch.randn(rows, 2, generator=gen),
        _sparse(rows, gen),
        torch.randint(0, 2, (rows,), generator=gen).float(),
        torch.rand(rows, generator=gen) + 0.5 if weights else None,
    )


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 40), world=st.integers(1, 5))
def test_row_bounds_tile_the_batch_near_equally(n, world):
    parts = [row_bounds(n, r, world) for r in range(world)]
    assert parts[0][0] == 0 and parts[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
    sizes = [hi - lo for lo, hi in parts]
    assert max(sizes) - min(sizes) <= 1


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 12), seed=st.integers(0, 1000), data=st.data())
def test_slice_rows_keeps_each_bag(rows, seed, data):
    sf = _sparse(rows, torch.Generator().manual_seed(seed), weighted=True)
    lo = data.draw(st.integers(0, rows))
    hi = data.draw(st.integers(lo, rows))
    part = sf.slice_rows(lo, hi)
    assert part.keys == sf.keys and part.batch_size == hi - lo
    for name in KEYS:
        values, offsets, weights = sf.field(name)
        got_v, got_o, got_w = part.field(name)
        expect = offsets[lo : hi + 1]
        torch.testing.assert_close(got_o, expect - expect[0])
        torch.testing.assert_close(got_v, values[int(expect[0]) : int(expect[-1])])
        torch.testing.assert_close(got_w, weights[int(expect[0]) : int(expect[-1])])


def _task_batch(tasks: int, s: int, q: int, gen: torch.Generator) -> TaskBatch:
    q_mask = (torch.rand(tasks, q, generator=gen) > 0.4).float()
    q_mask[0] = 0.0  # a task without query rows
    support, query = _batch(tasks * s, gen), _batch(tasks * q, gen)
    return TaskBatch(support, query, torch.ones(tasks, s), q_mask, torch.arange(tasks))


def test_slice_tasks_takes_whole_tasks():
    tb = _task_batch(4, 3, 2, torch.Generator().manual_seed(0))
    part = tb.slice_tasks(1, 3)
    assert part.num_tasks == 2 and part.task_ids.tolist() == [1, 2]
    torch.testing.assert_close(part.query_mask, tb.query_mask[1:3])
    torch.testing.assert_close(part.support.dense, tb.support.dense[3:9])
    torch.testing.assert_close(part.query.labels, tb.query.labels[2:6])
    assert part.query.sparse.values.tolist() == tb.query.sparse.slice_rows(2, 6).values.tolist()


def _schema() -> FeatureSchema:
    return FeatureSchema(dense=("x", "y"), sparse=tuple(SparseField(k, 9) for k in KEYS))


@pytest.mark.parametrize("kind,weights", [("bce", False), ("bce", True), ("mse", True), ("meta", False)])
def test_loss_shares_add_up_to_the_global_loss(kind, weights):
    """sum_r (n_r / N) * loss(slice_r) == loss(global batch): what makes ranks' gradients sum
    to the single-process gradient."""
    cfg = load_config(
        None,
        [
            "model.embedding_dim=4",
            "model.bottom_mlp=[4]",
            "model.top_mlp=[4, 1]",
            "model.embedding_backend=per_table",
            "meta.adapt=top_mlp",
        ],
    )
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.optim, _schema(), torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    if kind == "meta":
        objective, batch, loss = MetaObjective(cfg, model, "bce"), _task_batch(4, 3, 5, gen), "bce"
        slices = [batch.slice_tasks(*row_bounds(4, r, 2)) for r in range(2)]
    else:
        objective, batch, loss = DLRMObjective(cfg, model, kind), _batch(10, gen, weights), kind
        slices = [batch.slice_rows(*row_bounds(10, r, 3)) for r in range(3)]
    total = sum(loss_denominator(s, loss) for s in slices)
    assert total == pytest.approx(loss_denominator(batch, loss), rel=1e-12)
    shared = sum(objective.batch_loss(s) * loss_denominator(s, loss) / total for s in slices)
    torch.testing.assert_close(shared, objective.batch_loss(batch))


class _Reader:
    """A minimal resumable reader of fixed batches."""

    def __init__(self, batches):
        self.batches, self.pos, self.epoch, self.counters = batches, 0, 0, {"rows": 1}

    @property
    def num_batches(self):
        return len(self.batches)

    def __iter__(self):
        for b, _ in self.iter_with_state():
            yield b

    def iter_with_state(self):
        for i, b in enumerate(self.batches[self.pos :], self.pos):
            self.pos = i + 1
            yield b, {"pos": self.pos}

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]

    def set_epoch(self, epoch):
        self.epoch, self.pos = epoch, 0


def test_global_slices_partition_every_batch():
    gen = torch.Generator().manual_seed(3)
    batches = [_batch(6, gen) for _ in range(3)]
    per_rank = [list(GlobalSlices(_Reader(batches), r, 3, train=True).iter_with_state()) for r in range(3)]
    for i, batch in enumerate(batches):
        dense = torch.cat([per_rank[r][i][0].dense for r in range(3)])
        torch.testing.assert_close(dense, batch.dense)
        assert {per_rank[r][i][1]["pos"] for r in range(3)} == {i + 1}
    reader = GlobalSlices(_Reader(batches), 0, 4, train=True)
    with pytest.raises(DataError, match="multiple of 4"):
        next(iter(reader))
    uneven = next(iter(GlobalSlices(_Reader(batches), 3, 4, train=False)))
    assert uneven.batch_size == 1  # evaluation slices may differ by one row
    tb = _task_batch(4, 2, 2, gen)
    assert next(iter(GlobalSlices(_Reader([tb]), 1, 2, train=False, whole_tasks=True))) is tb


def test_dense_grad_sync_is_one_bucket(one_rank_group, monkeypatch):
    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(2, 2, dtype=torch.float64))
    c = torch.nn.Parameter(torch.ones(4))  # no grad this step: left alone
    a.grad, b.grad = torch.arange(3.0), torch.full((2, 2), 2.0, dtype=torch.float64)
    sizes = []
    original = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, **kw: (sizes.append(t.numel()), original(t, **kw))[1])
    extras = DenseGradSync([a, b, c, a]).allreduce(torch.tensor([5.0]))
    assert sizes == [3 + 1, 4]  # one bucket per dtype, the extra scalar rides in the first
    torch.testing.assert_close(extras, torch.tensor([5.0]))
    torch.testing.assert_close(a.grad, torch.arange(3.0))
    assert c.grad is None


def test_table_sharding_entries_are_checked():
    cfg = load_config(None, ["parallel.sharding=row_wise", 'parallel.table_sharding=["b=table_wise"]'])
    assert table_kinds(cfg.parallel, KEYS) == {"a": "row_wise", "b": "table_wise", "c": "row_wise"}
    bad = (("zz=row_wise", "no table 'zz'"), ("b=diagonal", "kind must be"), ("b", "name=kind"))
    for entry, match in bad:
        cfg = load_config(None, [f'parallel.table_sharding=["{entry}"]'])
        with pytest.raises(ConfigError, match=match):
            table_kinds(cfg.parallel, KEYS)
    with pytest.raises(ConfigError, match="parallel.sharding"):
        load_config(None, ["parallel.sharding=diagonal"])


def test_launch_helpers(tmp_path):
    assert strip_nproc(["--nproc", "2", "--set", "a.b=1", "--nproc=3", "-v"]) == ["--set", "a.b=1", "-v"]
    launch = launch_config(2, str(tmp_path))
    assert (launch.nproc_per_node, launch.max_nodes, launch.max_restarts) == (2, 1, 0)
    with pytest.raises(ConfigError, match="parallel.mode=hybrid"):
        check_launch(load_config(None, []), 2)
    check_launch(load_config(None, ["parallel.mode=hybrid"]), 2)


def test_a_rank_exits_with_its_status_and_flushed_output(tmp_path):
    import subprocess
    import sys

    # Buffered stdout (a pipe), a log record and an error status must all survive os._exit.
    script = (
        "import logging, sys; from recaccel.train.distributed.launch import exit_rank; "
        "logging.basicConfig(stream=sys.stderr); print('metrics', end=''); "
        "logging.getLogger('r').warning('logged'); exit_rank(3)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (3, "metrics") and "logged" in done.stderr

    # A rank (RANK/WORLD_SIZE set) of `python -m recaccel.cli` keeps the CLI's error status.
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2"}
    done = subprocess.run(
        [sys.executable, "-m", "recaccel.cli", "--config", str(tmp_path / "missing.toml")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2 and "missing.toml" in done.stderr


def test_hybrid_needs_a_launcher_and_single_mode_refuses_many_ranks(monkeypatch):
    from recaccel.train.distributed.hybrid import HybridParallel
    from recaccel.train.loop.trainer import build_parallel

    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match="torchrun"):
        HybridParallel(load_config(None, ["parallel.mode=hybrid"]), torch.device("cpu"))
    with pytest.raises(ConfigError, match="drop_last"):
        cfg = load_config(None, ["parallel.mode=hybrid", "data.drop_last=false"])
        HybridParallel(cfg, torch.device("cpu"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="parallel.mode=hybrid"):
        build_parallel(load_config(None, []), torch.device("cpu"))


def test_sharded_data_checkpoint_refuses_another_world_size(tmp_path):
    from types import SimpleNamespace

    from recaccel.train.distributed.dist_checkpoint import INFO_FILE, load_sharded

    ckpt = tmp_path / "checkpoints" / "step-000000004.dcp"
    ckpt.mkdir(parents=True)
    (ckpt / INFO_FILE).write_text(json.dumps({"format": 1, "world_size": 4, "step": 4}))
    sharded = SimpleNamespace(world_size=2, cfg=load_config(None, ["parallel.data=sharded"]))
    with pytest.raises(RecaccelError, match="parallel.data=sharded.*--nproc 4"):
        load_sharded(tmp_path, sharded, None, None)
    with pytest.raises(RecaccelError, match="no sharded checkpoint"):
        load_sharded(tmp_path / "elsewhere", sharded, None, None)


def test_global_slices_is_a_reader_of_the_wrapped_position():
    """Epoch, counters, batch count and position are the wrapped reader's; a state saved
    on one rank resumes the slices of every rank."""
    gen = torch.Generator().manual_seed(4)
    batches = [_batch(4, gen) for _ in range(3)]
    inner = _Reader(batches)
    inner.schema = "the wrapped reader's own attribute"
    reader = GlobalSlices(inner, 1, 2, train=True)
    assert isinstance(reader, Reader)
    assert (reader.epoch, reader.counters, reader.num_batches) == (0, {"rows": 1}, 3)
    assert reader.counters is inner.counters  # live, not a copy
    first = next(iter(reader))
    torch.testing.assert_close(first.dense, batches[0].dense[2:4])
    assert reader.state_dict() == {"pos": 1}
    resumed = GlobalSlices(_Reader(batches), 1, 2, train=True)
    resumed.load_state_dict(reader.state_dict())
    rest = list(resumed)
    assert len(rest) == 2
    torch.testing.assert_close(rest[0].dense, batches[1].dense[2:4])
    reader.set_epoch(5)
    assert (reader.epoch, inner.pos) == (5, 0)
    assert not hasattr(reader, "schema")  # nothing else of the wrapped reader shows through
