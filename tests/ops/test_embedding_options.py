"""PackedEmbeddingBag's settings as one EmbeddingOptions record (and the keyword shorthand)."""

from __future__ import annotations

import pytest
import torch

from recaccel.errors import ConfigError
from recaccel.ops.embedding import EmbeddingOptions, PackedEmbeddingBag, SparseOptimConfig, TableSpec
from recaccel.ops.embedding.cache import CacheOptions
from recaccel.sparse import SparseFeatures

TABLES = [TableSpec("a", 10, 4), TableSpec("b", 6, 4, pooling="mean")]


def _batch() -> SparseFeatures:
    return SparseFeatures.from_lengths(["a", "b"], torch.tensor([1, 9, 3, 5, 0]), torch.tensor([2, 1, 1, 1]))


def test_options_and_keyword_settings_build_the_same_module() -> None:
    optim = SparseOptimConfig(lr=0.05)
    by_options = PackedEmbeddingBag(
        TABLES, EmbeddingOptions(backend="reference", mode="autograd", optim=optim), seed=3
    )
    by_keywords = PackedEmbeddingBag(TABLES, backend="reference", mode="autograd", optim=optim, seed=3)
    assert by_options.options == by_keywords.options
    assert (by_options.backend, by_options.mode, by_options.optim) == ("reference", "autograd", optim)
    assert torch.equal(by_options(_batch()), by_keywords(_batch()))


def test_keyword_settings_replace_those_of_the_options() -> None:
    base = EmbeddingOptions(backend="reference", bounds_check=False, cache=CacheOptions(rows=3))
    emb = PackedEmbeddingBag(TABLES, base, bounds_check="eager", seed=0)
    assert emb.options == EmbeddingOptions(
        backend="reference", bounds_check="eager", cache=CacheOptions(rows=3)
    )
    assert emb.bounds_check == "eager" and emb.cache_options.rows == 3
    assert base.bounds_check is False  # the caller's record is not changed


def test_none_stands_for_the_default_optimizer_and_cache() -> None:
    options = EmbeddingOptions(optim=None, cache=None)
    assert options.optim == SparseOptimConfig() and options.cache == CacheOptions()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"mode": "dense"}, r"mode must be one of \('fused', 'autograd'\), got 'dense'"),
        (
            {"bounds_check": "lazy"},
            r"bounds_check must be True, False, 'eager', 'deferred' or 'auto', got 'lazy'",
        ),
        ({"dtype": "fp8"}, r"dtype must be one of \('fp32', 'bf16', 'fp16'\), got 'fp8'"),
        ({"dtype": "bf16", "mode": "autograd"}, r"dtype='bf16' needs mode='fused'"),
    ],
)
def test_bad_options_raise_one_line_config_errors(settings: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        EmbeddingOptions(**settings)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=message):  # the keyword shorthand checks the same way
        PackedEmbeddingBag(TABLES, **settings)


def test_a_learning_rate_change_is_seen_in_the_options() -> None:
    emb = PackedEmbeddingBag(TABLES, EmbeddingOptions(backend="reference"), seed=0)
    emb.set_learning_rate(0.125)
    assert emb.optim.lr == 0.125 and emb.options.optim.lr == 0.125
