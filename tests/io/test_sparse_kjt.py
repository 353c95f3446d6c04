"""SparseFeatures against TorchRec's KeyedJaggedTensor (an external reference).

Both are field-major CSR; converting either way must keep every bag, widen TorchRec's
int32 ids / lengths / offsets to the int64 SparseFeatures documents, and refuse a
variable-batch (VBE) KJT, whose keys have their own batch sizes, instead of misassigning
its bags.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchrec", reason="torchrec is not installed: no KeyedJaggedTensor reference")

from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

from recaccel.errors import DataError  # noqa: E402
from recaccel.sparse import SparseFeatures  # noqa: E402

KEYS = ["a", "b", "c"]


def random_bags(b: int, seed: int, weighted: bool) -> dict[str, list[tuple[list[int], list[float] | None]]]:
    """bags[key][row] = (ids, weights), written as plain lists (empty bags included)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key in KEYS:
        rows = []
        for _ in range(b):
            n = int(torch.randint(0, 4, (1,), generator=g))
            ids = torch.randint(0, 1000, (n,), generator=g).tolist()
            rows.append((ids, torch.rand(n, generator=g).tolist() if weighted else None))
        out[key] = rows
    return out


def csr(bags: dict, keys: list[str]) -> tuple[list[int], list[int], list[float]]:
    """values, lengths, weights of ``bags`` in field-major order."""
    values, lengths, weights = [], [], []
    for key in keys:
        for ids, w in bags[key]:
            values += ids
            lengths.append(len(ids))
            weights += w or []
    return values, lengths, weights


def sf_bags(sf: SparseFeatures) -> dict:
    out = {}
    for key in sf.keys:
        values, offsets, weights = sf.field(key)
        off = offsets.tolist()
        out[key] = [
            (values[lo:hi].tolist(), None if weights is None else weights[lo:hi].tolist())
            for lo, hi in zip(off[:-1], off[1:])
        ]
    return out


def kjt_bags(kjt: KeyedJaggedTensor) -> dict:
    out = {}
    for key, jt in kjt.to_dict().items():
        off = jt.offsets().tolist()
        w = jt.weights_or_none()
        out[key] = [
            (jt.values()[lo:hi].tolist(), None if w is None else w[lo:hi].tolist())
            for lo, hi in zip(off[:-1], off[1:])
        ]
    return out


@pytest.mark.parametrize("b", [0, 1, 5])
@pytest.mark.parametrize("weighted", [False, True])
def test_to_kjt_keeps_every_bag(b, weighted):
    bags = random_bags(b, seed=b, weighted=weighted)
    values, lengths, weights = csr(bags, KEYS)
    sf = SparseFeatures.from_lengths(
        KEYS,
        torch.tensor(values, dtype=torch.int64),
        torch.tensor(lengths, dtype=torch.int64),
        torch.tensor(weights) if weighted else None,
    )
    kjt = sf.to_kjt()
    assert kjt.keys() == KEYS and kjt.stride() == b
    if b:  # TorchRec's to_dict cannot split an empty batch
        assert kjt_bags(kjt) == bags
    else:
        assert kjt.lengths().numel() == 0
    back = SparseFeatures.from_kjt(kjt)
    assert back.keys == KEYS and back.values is sf.values and back.offsets is sf.offsets  # no copy
    assert sf_bags(back) == bags


@pytest.mark.parametrize("b", [1, 4])
@pytest.mark.parametrize("weighted", [False, True])
def test_from_kjt_keeps_every_bag_of_a_kjt_built_by_torchrec(b, weighted):
    bags = random_bags(b, seed=10 + b, weighted=weighted)
    keys = ["c", "a", "b"]  # another pipeline's key order
    values, lengths, weights = csr(bags, keys)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=torch.tensor(values),
        lengths=torch.tensor(lengths),
        weights=torch.tensor(weights) if weighted else None,
    )
    sf = SparseFeatures.from_kjt(kjt)
    assert sf.keys == keys and sf.batch_size == b
    assert sf_bags(sf) == bags
    assert sf_bags(sf.reorder(KEYS)) == bags and sf.reorder(KEYS).keys == KEYS


def test_int32_kjt_gives_int64_values_and_offsets():
    bags = random_bags(3, seed=5, weighted=False)
    values, lengths, _ = csr(bags, KEYS)
    kjt = KeyedJaggedTensor(
        keys=KEYS,
        values=torch.tensor(values, dtype=torch.int32),
        lengths=torch.tensor(lengths, dtype=torch.int32),
    )
    assert kjt.offsets().dtype == torch.int32  # TorchRec keeps the lengths' dtype
    sf = SparseFeatures.from_kjt(kjt)
    assert sf.offsets.dtype == torch.int64 and sf.values.dtype == torch.int64
    assert sf.offsets.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert sf_bags(sf) == bags
    # int32 lengths given straight to SparseFeatures give int64 offsets too.
    direct = SparseFeatures.from_lengths(KEYS, kjt.values(), kjt.lengths())
    assert direct.offsets.dtype == torch.int64 and direct.offsets.tolist() == sf.offsets.tolist()


@pytest.mark.parametrize(
    "strides",
    [
        [[1], [3]],  # 4 bags: read as F=2, B=2 they would silently pair the wrong rows
        [[2], [3]],
        [[1, 1], [2, 1]],  # two ranks' batches per key
    ],
)
def test_a_variable_batch_kjt_is_refused_in_one_line(strides):
    n_bags = sum(sum(s) for s in strides)
    lengths = torch.ones(n_bags, dtype=torch.int64)
    kjt = KeyedJaggedTensor(
        keys=["x", "y"], values=torch.arange(n_bags), lengths=lengths, stride_per_key_per_rank=strides
    )
    assert kjt.variable_stride_per_key()
    with pytest.raises(DataError, match=r"variable-batch \(VBE\) KeyedJaggedTensor .*'x': ") as e:
        SparseFeatures.from_kjt(kjt)
    assert "\n" not in str(e.value)
