"""One SplitMix64: numpy words and torch int64 bits give the same hash."""

from __future__ import annotations

import numpy as np
import torch

from recaccel.hashing import GAMMA, as_int64, mix64, mix64_int64, splitmix64_63

U64 = 2**64 - 1
EDGES = [0, -1, 1, 2**63 - 1, -(2**63)]


def _mix64_python(x: int) -> int:
    """The finalizer on Python ints, written out from the published algorithm."""
    x &= U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & U64
    return x ^ (x >> 31)


def _ids() -> np.ndarray:
    """int64 [1005]: the edge cases, then random ids over the whole int64 range."""
    rng = np.random.default_rng(0)
    random = rng.integers(-(2**63), 2**63 - 1, size=1000, dtype=np.int64, endpoint=True)
    return np.concatenate([np.array(EDGES, dtype=np.int64), random])


def test_numpy_finalizer_matches_the_definition():
    words = _ids().view(np.uint64)
    assert mix64(words).tolist() == [_mix64_python(int(w)) for w in words]


def test_numpy_and_torch_finalizers_agree_bit_for_bit():
    ids = _ids()
    from_numpy = mix64(ids.view(np.uint64)).view(np.int64)
    from_torch = mix64_int64(torch.from_numpy(ids.copy())).numpy()
    np.testing.assert_array_equal(from_torch, from_numpy)


def test_splitmix64_63_is_numpy_mix_of_id_plus_gamma_shifted_once():
    ids = _ids()
    with np.errstate(over="ignore"):
        expected = (mix64(ids.view(np.uint64) + np.uint64(GAMMA)) >> np.uint64(1)).astype(np.int64)
    got = splitmix64_63(torch.from_numpy(ids.copy())).numpy()
    np.testing.assert_array_equal(got, expected)
    assert (got >= 0).all()


def test_as_int64_keeps_the_bits():
    for value in (0, 1, 2**63 - 1, 2**63, GAMMA, U64):
        assert as_int64(value) & U64 == value
        assert -(2**63) <= as_int64(value) < 2**63
