"""Each sparse field's id count, known on the host: counted from host offsets before a
batch leaves for a device, carried by the device loader's layout, kept by the field
operations, and refused where it cannot be true.

A ``meta`` tensor has no values: any read of one raises, so a batch moved to ``meta``
proves an operation used the host's counts and not the device's offsets.
"""

from __future__ import annotations

import pytest
import torch

from recaccel.io.host_buffer import pack, unpack
from recaccel.sparse import Batch, SparseFeatures, TaskBatch
from tests.helpers.ops_inputs import random_sparse_batch

KEYS = ["u", "i", "g"]
ROWS = {"u": 9, "i": 50, "g": 4}


def _batch(batch_size: int, seed: int, **kwargs) -> SparseFeatures:
    return random_sparse_batch(
        ROWS, KEYS, batch_size, generator=torch.Generator().manual_seed(seed), **kwargs
    )


def _counted_on_device(sf: SparseFeatures) -> tuple[int, ...]:
    """The reference: each field's ids, from the offsets at the field boundaries."""
    b = sf.batch_size
    bounds = sf.offsets.long()[torch.arange(sf.num_fields + 1) * b]
    return tuple(bounds.diff().tolist())


@pytest.mark.parametrize("batch_size", [0, 1, 7, 64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_host_counts_are_each_fields_ids(batch_size, seed):
    sf = _batch(batch_size, seed, max_len=5)
    assert sf.known_field_counts is None  # never counted unasked on the host
    assert sf.count_fields_on_host() == _counted_on_device(sf)


def test_int32_offsets_are_counted_too():
    sf = _batch(16, 3)
    narrow = SparseFeatures(sf.keys, sf.values.int(), sf.offsets.int())
    assert narrow.count_fields_on_host() == _counted_on_device(sf)


def test_a_one_hot_batch_knows_its_counts_from_its_shape():
    sf = SparseFeatures(KEYS, torch.arange(12), None)
    assert sf.known_field_counts == (4, 4, 4)
    assert sf.to("meta").known_field_counts == (4, 4, 4)


@pytest.mark.parametrize(
    "offsets",
    [[1, 2, 3, 4], [0, 3, 2, 4], [0, 1, 2, 5], [0, -1, 2, 4]],
    ids=["not-from-0", "decreasing", "past-the-ids", "negative"],
)
def test_malformed_offsets_are_not_counted(offsets):
    sf = SparseFeatures(["a", "b", "c"], torch.arange(4), torch.tensor(offsets))
    assert sf.count_fields_on_host() is None
    assert sf.to("meta").known_field_counts is None


def test_a_batch_leaving_the_host_takes_its_counts_along():
    sf = _batch(10, 4)
    moved = sf.to("meta")
    assert moved.known_field_counts == _counted_on_device(sf)
    assert moved.to("meta").known_field_counts == moved.known_field_counts


def test_reorder_and_select_move_the_counts_without_reading_the_device():
    sf = _batch(6, 5)
    counts = dict(zip(KEYS, _counted_on_device(sf)))
    on_meta = sf.to("meta")
    for names in (["g", "u", "i"], ["i", "g"], ["u"]):  # a subset's id count is not free: it needs them
        picked = on_meta.select(names)
        assert picked.known_field_counts == tuple(counts[n] for n in names)
        assert picked.values.numel() == sum(counts[n] for n in names)
        # The same fields picked on the host: same layout.
        assert picked.offsets.shape == sf.select(names).offsets.shape


def test_assigning_new_offsets_forgets_the_counts():
    sf = _batch(5, 6).to("meta")
    assert sf.known_field_counts is not None
    sf.offsets = torch.zeros(sf.num_fields * sf.batch_size + 1, dtype=torch.int64, device="meta")
    assert sf.known_field_counts is None


@pytest.mark.parametrize(
    "counts", [(1, 2), (1, 2, 3, 4), (-1, 0, 0)], ids=["too-few", "too-many", "negative"]
)
def test_counts_that_cannot_be_true_are_refused_in_one_line(counts):
    sf = _batch(4, 7)
    with pytest.raises(ValueError, match=r"field counts .* do not fit a batch of 3 fields") as err:
        sf.remember_field_counts(counts)
    assert "\n" not in str(err.value)


def test_counts_not_summing_to_the_ids_are_refused():
    sf = _batch(4, 8)
    wrong = list(_counted_on_device(sf))
    wrong[0] += 1
    with pytest.raises(ValueError, match="do not fit"):
        sf.remember_field_counts(tuple(wrong))


def _dense_batch(sf: SparseFeatures, seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    b = sf.batch_size
    return Batch(torch.rand(b, 3, generator=gen), sf, torch.rand(b, generator=gen))


def test_the_loaders_buffer_carries_the_counts_of_each_part():
    support, query = _batch(8, 9), _batch(5, 10)
    task = TaskBatch(
        _dense_batch(support, 1),
        _dense_batch(query, 2),
        torch.ones(8, dtype=torch.bool),
        torch.ones(5, dtype=torch.bool),
        torch.zeros(1, dtype=torch.int64),
    )
    buf, layout = pack(task)
    got = unpack(buf, layout)
    assert got.support.sparse.known_field_counts == _counted_on_device(support)
    assert got.query.sparse.known_field_counts == _counted_on_device(query)
    plain = unpack(*pack(_dense_batch(support, 3)))
    assert plain.sparse.known_field_counts == _counted_on_device(support)


def test_the_loaders_buffer_carries_no_counts_for_malformed_offsets():
    sf = SparseFeatures(["a", "b"], torch.arange(3), torch.tensor([0, 2, 1, 3, 3]))
    got = unpack(*pack(_dense_batch(sf, 4)))
    assert got.sparse.known_field_counts is None
