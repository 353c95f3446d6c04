"""Fixtures of the benchmark tests: the tiny train-benchmark preset three test modules run."""

from __future__ import annotations

import pytest

from tests.helpers.bench_presets import TINY_PRESET


@pytest.fixture
def tiny(tmp_path):
    """The tiny preset written to ``tmp_path/tiny.toml``."""
    path = tmp_path / "tiny.toml"
    path.write_text(TINY_PRESET)
    return path
