"""Runs laid end to end (``recaccel.sparse.csr.runs_index``): the CUDA way (each element's
run found by a search among the runs' ends) against the CPU way (repeat_interleave), on
random runs with empty ones, given or packed run starts, int32 and int64 counts."""

from __future__ import annotations

import pytest
import torch

from recaccel.sparse.csr import runs_index


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
def test_searching_the_runs_ends_gives_the_repeat_interleave_positions(seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    k = int(torch.randint(1, 40, (1,), generator=gen))
    counts = torch.randint(0, 6, (k,), generator=gen) * (torch.rand(k, generator=gen) > 0.3)  # empty runs too
    counts[0] *= seed % 2  # a leading empty run on odd seeds
    counts = counts.to(dtype)
    starts = torch.randint(0, 1000, (k,), generator=gen).to(dtype)
    n = int(counts.sum())
    for run_start in (None, torch.cumsum(counts, 0) - counts + 7):  # packed, or shifted by a base
        want = runs_index(starts, counts, n, run_start, search=False)
        got = runs_index(starts, counts, n, run_start, search=True)
        assert torch.equal(got, want)
    positions = []
    for s, c in zip(starts.tolist(), counts.tolist()):
        positions += range(s, s + c)
    assert runs_index(starts, counts, n, search=True).tolist() == positions


def test_no_runs_or_only_empty_runs_give_no_positions():
    empty = torch.zeros(0, dtype=torch.int64)
    for search in (False, True):
        assert runs_index(empty, empty, 0, search=search).numel() == 0
        zeros = torch.zeros(3, dtype=torch.int64)
        assert runs_index(torch.tensor([4, 5, 6]), zeros, 0, search=search).numel() == 0


@pytest.mark.gpu
def test_on_cuda_a_batchs_fields_sliced_and_reordered_match_the_cpu():
    """The default (search) on CUDA, through SparseFeatures' slice_rows and reorder, at a size
    where the fields are long runs: the CPU's batch, moved."""
    from recaccel.sparse import SparseFeatures

    gen = torch.Generator().manual_seed(0)
    f, b = 26, 4096
    lengths = torch.randint(0, 5, (f * b,), generator=gen)
    values = torch.randint(0, 10_000, (int(lengths.sum()),), generator=gen)
    keys = [f"f{i}" for i in range(f)]
    cpu = SparseFeatures.from_lengths(keys, values, lengths)
    cuda = cpu.to("cuda")
    for make in (lambda sf: sf.slice_rows(100, 3000), lambda sf: sf.reorder(keys[::-1])):
        want, got = make(cpu), make(cuda)
        assert torch.equal(got.values.cpu(), want.values) and torch.equal(got.offsets.cpu(), want.offsets)
