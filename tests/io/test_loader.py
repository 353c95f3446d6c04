"""Packing (one buffer per batch) and the prefetching device loader."""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from recaccel.config import TasksConfig
from recaccel.errors import ConfigError
from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.io.format.writer import write_parquet
from recaccel.io.host_buffer import ALIGN, layout_of, pack, unpack
from recaccel.io.loader import DeviceLoader, _DaliCopier
from recaccel.io.readers.options import ReadOptions
from recaccel.io.readers.protocol import Reader
from recaccel.io.readers.rows import BatchReader
from recaccel.io.readers.tasks.reader import TaskReader
from recaccel.sparse import TaskBatch
from tests.helpers.loader_batches import ListReader, assert_same, make_batch
from tests.helpers.task_data import write_tasks

HAS_DALI = (
    importlib.util.find_spec("nvidia") is not None and importlib.util.find_spec("nvidia.dali") is not None
)


@pytest.mark.parametrize("weights,id_weights", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("b", [0, 1, 7])
def test_pack_unpack_batch_roundtrip(b, weights, id_weights):
    batch = make_batch(b, 3, ["a", "b", "c"], b, weights, id_weights)
    buf, layout = pack(batch)
    assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.numel() == layout.nbytes
    assert all(s is None or s[0] % ALIGN == 0 for s in layout.slots)
    out = unpack(buf, layout)
    assert_same(out, batch)
    # Views of the one buffer, not copies.
    assert out.dense.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()


def test_pack_unpack_task_batch_and_buffer_reuse():
    sup = make_batch(12, 2, ["x", "y"], 1, True, False)
    qry = make_batch(8, 2, ["x", "y"], 2, False, True)
    tb = TaskBatch(sup, qry, torch.ones(4, 3), torch.zeros(4, 2), torch.arange(4) * 7)
    scratch = torch.empty(1 << 16, dtype=torch.uint8)
    buf, layout = pack(tb, scratch)
    assert buf.data_ptr() == scratch.data_ptr()  # filled in place
    assert_same(unpack(buf, layout), tb)
    small = make_batch(2, 2, ["x"], 3, False, False)
    buf2, layout2 = pack(small, scratch)
    assert_same(unpack(buf2, layout2), small)
    assert layout_of(tb).nbytes == layout.nbytes
    with pytest.raises(TypeError, match="Batch or TaskBatch"):
        pack({"dense": torch.zeros(1)})


def test_cpu_loader_same_batches_with_and_without_prefetch_and_exact_states():
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        schema = FeatureSchema(dense=("d",), sparse=(SparseField("s", 10), SparseField("m", 5, True)))
        rng = np.random.default_rng(0)
        off = np.concatenate([[0], np.cumsum(rng.integers(0, 3, 200))])
        write_parquet(
            path,
            schema,
            {
                "label": rng.integers(0, 2, 200).astype(np.float32),
                "d": rng.normal(size=200),
                "s": rng.integers(0, 10, 200),
                "m": (rng.integers(0, 5, off[-1]), off),
            },
            rows_per_row_group=30,
        )
        reference = [(b, s) for b, s in BatchReader(path, 16, ReadOptions(seed=2)).iter_with_state()]
        for prefetch in (0, 1, 3):
            loader = DeviceLoader(BatchReader(path, 16, ReadOptions(seed=2)), "cpu", prefetch)
            got = []
            for batch in loader:
                got.append((batch, loader.state_dict()))
            assert len(got) == len(reference)
            for (a, sa), (b, sb) in zip(got, reference):
                assert_same(a, b)
                assert sa == sb


def test_loader_task_batches_and_resume_through_the_loader():
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        write_tasks(path, list(range(1, 40)), 3, rg=17)
        c = TasksConfig(
            tasks_per_batch=4, support_size=5, query_size=3, min_task_rows=2, shuffle_buffer_tasks=6
        )
        full = list(TaskReader(path, c, ReadOptions(seed=1)))
        reader = TaskReader(path, c, ReadOptions(seed=1))
        loader = DeviceLoader(reader, "cpu", prefetch=2)
        taken = []
        for tb in loader:
            taken.append(tb)
            if len(taken) == 3:
                break
        state = loader.state_dict()  # after the 3rd batch, although the thread ran ahead
        resumed = TaskReader(path, c, ReadOptions(seed=1))
        resumed.load_state_dict(state)
        rest = list(DeviceLoader(resumed, "cpu", prefetch=2))
        assert len(taken) + len(rest) == len(full)
        for a, b in zip(taken + rest, full):
            assert_same(a, b)


def test_loader_propagates_reader_errors_and_stops_cleanly():
    batches = [make_batch(4, 1, ["a"], i, False, False) for i in range(5)]
    with pytest.raises(RuntimeError, match="reader broke"):
        list(DeviceLoader(ListReader(batches, fail_at=3), "cpu", prefetch=2))
    loader = DeviceLoader(ListReader(batches), "cpu", prefetch=1)
    for i, _ in enumerate(loader):
        if i == 1:
            break
    assert loader.state_dict() == {"pos": 2}
    assert len(list(DeviceLoader(ListReader(batches), "cpu", prefetch=0))) == 5


def test_loader_state_is_the_one_paired_with_the_batch_handed_out():
    """The reader runs ahead on the thread (its own position moves on); the loader's state
    is the one ``iter_with_state`` paired with the last batch the consumer got."""
    batches = [make_batch(4, 1, ["a"], i, False, False) for i in range(6)]
    reader = ListReader(batches)
    assert isinstance(reader, Reader)
    loader = DeviceLoader(reader, "cpu", prefetch=3)
    states = []
    for _ in loader:
        states.append(loader.state_dict())
        if len(states) == 2:
            break
    assert states == [{"pos": 1}, {"pos": 2}]


def test_backend_choice_errors():
    with pytest.raises(ConfigError, match="backend"):
        DeviceLoader(ListReader([]), "cpu", backend="nccl")
    with pytest.raises(ConfigError, match="CUDA device"):
        DeviceLoader(ListReader([]), "cpu", backend="dali")


@pytest.mark.skipif(HAS_DALI, reason="DALI is installed; this checks the message when it is not")
def test_dali_missing_is_a_clear_error():
    with pytest.raises(ConfigError, match="needs NVIDIA DALI, which is not installed"):
        _DaliCopier(torch.device("cuda", 0))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "dali"])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_cuda_loader_matches_cpu_batches(backend, prefetch):
    if backend == "dali" and not HAS_DALI:
        pytest.skip("NVIDIA DALI is not installed")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        write_tasks(path, list(range(1, 30)), 5, rg=13)
        c = TasksConfig(tasks_per_batch=3, support_size=4, query_size=4, min_task_rows=1)
        ref = list(TaskReader(path, c, ReadOptions(seed=4)))
        loader = DeviceLoader(TaskReader(path, c, ReadOptions(seed=4)), "cuda", prefetch, backend=backend)
        side = torch.cuda.Stream()
        got = []
        with torch.cuda.stream(side):  # the consumer's current stream is not the default one
            for tb in loader:
                assert tb.support.dense.device.type == "cuda"
                got.append(tb.to("cpu"))
        assert len(got) == len(ref)
        for a, b in zip(got, ref):
            assert_same(a, b)
