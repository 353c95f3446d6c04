"""Hand-edited tuning-table entries of the Triton embedding kernels: a one-line
ConfigError naming the entry's key, never a KeyError or TypeError from deep in a launch."""

from __future__ import annotations

import pytest
import torch

from recaccel.ops.embedding.triton import backward, tuning
from tests.helpers.marks import needs_triton

pytestmark = needs_triton


@pytest.mark.parametrize(
    "entry",
    [
        {"piece_len": 32, "block_pieces": 16, "num_warps": 4},
        {"block_occ": 8},
        {"block_occ": "8", "num_warps": 4},
        {"block_occ": 8, "num_warps": 4, "bogus": 1},
        {"piece_len": 32, "block_pieces": 16, "unroll": 1, "num_warps": 4, "block_occ": 8},
        {"block_occ": 8, "num_warps": 4, "subtiles": "x"},
        {"block_occ": 8, "num_warps": 4, "subtiles": 2.7},
        {"block_occ": True, "num_warps": 4},
    ],
    ids=[
        "lanes-without-unroll",
        "tiles-without-warps",
        "a-string",
        "an-extra-field",
        "lanes-and-tiles",
        "string-subtiles",
        "float-subtiles",
        "a-bool",
    ],  # fmt: skip
)
def test_a_hand_edited_tuning_entry_is_a_one_line_config_error_naming_its_key(entry, monkeypatch):
    from recaccel.errors import ConfigError

    monkeypatch.setattr(
        tuning, "_load_table", lambda: {"cpu": {tuning.backward_key(8, torch.float32): entry}}
    )
    monkeypatch.setattr(tuning, "device_name", lambda device: "cpu")
    with pytest.raises(ConfigError, match="bwd_D8_float32") as err:
        backward.tile_config(8, torch.float32, "cpu", 4)
    assert "\n" not in str(err.value)


def test_a_hand_edited_forward_entry_is_a_one_line_config_error_naming_its_key(monkeypatch):
    from recaccel.errors import ConfigError
    from recaccel.ops.embedding.triton.forward import forward_config

    key = tuning.forward_key(8, 1, torch.float32)
    monkeypatch.setattr(tuning, "_load_table", lambda: {"cpu": {key: {"block_bags": 16, "num_warps": 4}}})
    monkeypatch.setattr(tuning, "device_name", lambda device: "cpu")
    with pytest.raises(ConfigError, match="fwd_D8_L1_float32") as err:
        forward_config(8, 1.0, torch.float32, "cpu")
    assert "\n" not in str(err.value)
