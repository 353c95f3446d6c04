"""Per-feature values spread over a pack's feature-major ids: the CUDA path (each id's
feature found, then a gather) against the CPU path (repeat_interleave), on random bag
lengths with empty bags and empty features, with and without each id's bag."""

from __future__ import annotations

import pytest
import torch

from recaccel.ops.embedding.packing import _per_id_of_feature


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("index", [torch.int32, torch.int64], ids=str)
def test_finding_each_ids_feature_spreads_like_repeat_interleave(seed, index):
    gen = torch.Generator().manual_seed(seed)
    s, b = int(torch.randint(1, 30, (1,), generator=gen)), int(torch.randint(1, 9, (1,), generator=gen))
    lengths = torch.randint(0, 4, (s * b,), generator=gen)
    lengths[: b * int(torch.randint(0, s, (1,), generator=gen))] *= seed % 2  # leading empty features
    offsets = torch.zeros(s * b + 1, dtype=index)
    torch.cumsum(lengths, 0, out=offsets[1:])
    n = int(offsets[-1])
    bags = torch.repeat_interleave(torch.arange(s * b), lengths, output_size=n)
    per_feature = torch.randint(-50, 50, (s,), generator=gen).to(index)
    want = _per_id_of_feature(offsets, bags, b, n, gather=False)(per_feature)
    assert want.shape == (n,)
    for known_bags in (bags, None):
        spread = _per_id_of_feature(offsets, known_bags, b, n, gather=True)
        assert torch.equal(spread(per_feature), want)
        assert torch.equal(spread(per_feature * 3), want * 3)  # the features found once, reused
