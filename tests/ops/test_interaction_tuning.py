"""Dot interaction launch plans: every config the tuning sweep may pick computes the
reference's result, forward and backward; tuned table entries replace the heuristic."""

from __future__ import annotations

import pytest
import torch

from recaccel.bench.kernels import interaction_tune
from recaccel.ops.interaction import dot_interaction_backward_reference, dot_interaction_reference, tuning
from recaccel.ops.interaction.launch_plan import (
    KernelConfig,
    check_config,
    heuristic_plan,
    launch_plan,
    tile_rows,
    with_tuned,
)
from recaccel.ops.tuning_tables import read_table, write_table
from tests.helpers.marks import needs_triton


def _inputs(batch: int, fields: int, dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(batch, dim, generator=gen, dtype=torch.float64)
    pooled = torch.randn(batch, fields, dim, generator=gen, dtype=torch.float64)
    return dense, pooled


@needs_triton
@pytest.mark.parametrize(("batch", "fields", "dim"), [(5, 3, 40), (1, 26, 16), (3, 70, 8)])
def test_every_sweep_config_matches_the_reference_forward_and_backward(batch, fields, dim):
    """Odd batch sizes (a partial block of rows), a D that is no power of two, and R > 64
    (the tile-pair grid); every third candidate of the sweep, the default always."""
    from recaccel.ops.interaction.triton import backward_with, forward_with

    dense, pooled = _inputs(batch, fields, dim)
    x = torch.cat([dense[:, None], pooled], 1)
    want = dot_interaction_reference(x)
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want_grad = dot_interaction_backward_reference(grad, x)
    case = interaction_tune.TuneCase("fwd", batch, fields, dim, "float32")
    configs = interaction_tune.configs(case)
    assert next(iter(configs)) == "default"
    f32 = [t.float() for t in (dense, pooled, grad)]
    for name in list(configs)[::3]:
        config = configs[name]
        got = forward_with(f32[0], f32[1], False, config)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=name)
        g_dense, g_pooled = backward_with(f32[2], f32[0], f32[1], config)
        got_grad = torch.cat([g_dense[:, None], g_pooled], 1)
        torch.testing.assert_close(got_grad.double(), want_grad, rtol=1e-5, atol=1e-5, msg=name)


def test_sweep_configs_fit_the_register_budget_and_launch():
    for fields, dim in ((26, 128), (500, 32), (3, 8)):
        plan = heuristic_plan(fields + 1, dim)
        for kernel in ("fwd", "bwd"):
            configs = interaction_tune.configs(interaction_tune.TuneCase(kernel, 64, fields, dim, "bfloat16"))
            assert len(configs) == len(set(configs.values())) > 1
            for config in configs.values():
                check_config(config, fields + 1)
                bt = tile_rows(config, fields + 1)
                assert config.block_b * bt * max(bt, config.bd) <= interaction_tune.MAX_TILE_ELEMENTS
                assert fields + 1 <= 64 or config.block_b == 1
                assert config.bt != plan.bt  # the default row tile is stored as 0
            row_tiles = {tile_rows(c, fields + 1) for c in configs.values()}
            assert row_tiles == ({16, 32, 64} if fields == 500 else {plan.bt})


def test_a_config_that_cannot_launch_is_refused_in_one_line():
    for bad, rows in (
        (KernelConfig(3, 32, 4), 27),
        (KernelConfig(2, 8, 4), 27),
        (KernelConfig(2, 32, 4), 501),
        (KernelConfig(1, 32, 4, 8), 501),  # a row tile under tl.dot's 16
        (KernelConfig(1, 32, 4, 48), 501),
        (KernelConfig(1, 32, 4, 16), 27),  # one tile holds every row: no row tile of its own
    ):
        with pytest.raises(ValueError, match=r"launch config .* cannot run at R="):
            check_config(bad, rows)


def test_table_entries_replace_the_heuristic_per_kernel():
    plan = heuristic_plan(27, 128)
    tuned = with_tuned(plan, {"block_b": 4, "bd": 32, "num_warps": 8}, None)
    assert tuned.fwd == KernelConfig(4, 32, 8) and tuned.bwd == plan.bwd and tuned.bt == plan.bt
    assert with_tuned(plan, None, None) == plan
    # Off CUDA nothing is tuned: the interpreter runs the heuristic.
    assert launch_plan(27, 128, torch.float32, torch.device("cpu")) == plan


def test_table_round_trip_keeps_other_devices_and_reads_its_formatted_module(tmp_path):
    path = tmp_path / "table.py"
    key = tuning.shape_key("fwd", 27, 128, torch.bfloat16, "native")
    assert key == "fwd_R27_D128_bfloat16_native"
    write_table(path, "GPU A", {key: {"block_b": 2, "bd": 64, "num_warps": 4}}, tuning.HEADER)
    tuning.write(path, "GPU B", {key: {"block_b": 1, "bd": 128, "num_warps": 8}})
    table = read_table(path)
    assert table["GPU A"][key]["bd"] == 64 and table["GPU B"][key]["num_warps"] == 8
    assert tuning.lookup("cpu", key, table) is None
    assert tuning.lookup("cpu", key, {"cpu": {key: {"block_b": 1, "bd": 32, "num_warps": 2}}}) == {
        "block_b": 1,
        "bd": 32,
        "num_warps": 2,
    }
    # The module is Python with trailing commas (what ruff format leaves), not JSON.
    namespace: dict = {}
    exec(path.read_text(), namespace)
    assert namespace["TABLE"] == table


def test_a_tuned_row_tile_reaches_the_plan_and_the_default_stays_unwritten():
    plan = heuristic_plan(501, 32)
    tuned = with_tuned(
        plan, {"block_b": 1, "bd": 32, "num_warps": 2, "bt": 16}, {"block_b": 1, "bd": 32, "num_warps": 4}
    )
    assert tile_rows(tuned.fwd, 501) == 16 and tile_rows(tuned.bwd, 501) == 64 == plan.bt
    figures = {"ms": 1.0, "block_b": 1, "bd": 32, "num_warps": 2}
    records = [
        {
            "key": "k",
            "best": "a",
            "configs": {"a": figures | {"bt": 32}, "b": {**figures, "ms": 2.0, "bt": 0}},
        }
    ]
    assert interaction_tune.winners(records) == {"k": {"block_b": 1, "bd": 32, "num_warps": 2, "bt": 32}}
    records[0]["configs"]["b"]["ms"], records[0]["best"] = 0.5, "b"
    assert interaction_tune.winners(records) == {"k": {"block_b": 1, "bd": 32, "num_warps": 2}}


@needs_triton
@pytest.mark.parametrize("bt", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_smaller_row_tile_on_the_tile_pair_grid_is_the_reference(bt, dtype, monkeypatch):
    """R = 131 (partial last tiles at 16 and 32 rows), forward and backward, fp32 and bf16:
    the reference runs in float64 on the same (rounded) inputs, so the kernel is held to its
    float32 sums and one rounding of its output."""
    from recaccel.ops.interaction import triton as kernels

    launched = []
    for name in ("_dot_interaction_fwd_kernel", "_dot_interaction_bwd_kernel"):
        monkeypatch.setattr(kernels, name, _Recording(getattr(kernels, name), launched))
    monkeypatch.setattr(kernels, "check_triton_launchable", lambda *args: None)  # it reads the wrapped type
    dense, pooled = _inputs(3, 130, 24, seed=4)
    grad_shape = (3, 24 + 131 * 130 // 2)
    grad = torch.randn(grad_shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    args = [t.to(dtype) for t in (dense, pooled, grad)]
    x = torch.cat([args[0][:, None], args[1]], 1).double()
    want = dot_interaction_reference(x)
    want_grad = dot_interaction_backward_reference(args[2].double(), x)
    config = KernelConfig(1, 32, 2, bt)
    rounding = 1e-6 if dtype == torch.float32 else 2.0**-8

    def close(got, expected):
        torch.testing.assert_close(
            got.double(), expected, rtol=2 * rounding, atol=2 * rounding * float(expected.abs().max())
        )

    got = kernels.forward_with(args[0], args[1], True, config)
    close(got[:, : want.shape[1]], want)
    assert not got[:, want.shape[1] :].any()  # the padding columns are zero
    g_dense, g_pooled = kernels.backward_with(args[2], args[0], args[1], config)
    close(torch.cat([g_dense[:, None], g_pooled], 1), want_grad)
    assert launched == [(bt, -(-131 // bt))] * 2  # both kernels ran with the config's row tile


class _Recording:
    """A kernel whose launches record their (BT, NT) before running."""

    def __init__(self, kernel, launched: list) -> None:
        self.kernel, self.launched = kernel, launched

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launched.append((kwargs["BT"], kwargs["NT"]))
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.mark.parametrize(
    "entry",
    [
        {"block_b": 4, "bd": 32},
        {"block_b": 4, "bd": "32", "num_warps": 8},
        {"block_b": 1, "bd": 32, "num_warps": 8, "bt": "16"},
    ],
)
def test_a_hand_edited_entry_is_a_one_line_config_error(entry):
    from recaccel.errors import ConfigError

    plan = heuristic_plan(27, 16)
    with pytest.raises(ConfigError, match="bwd entry") as err:
        with_tuned(plan, None, entry)
    assert "\n" not in str(err.value)


def test_a_table_entry_that_cannot_launch_at_its_shape_is_refused_at_lookup(monkeypatch):
    """A row tile on a one-tile shape (R <= 64), hand-edited into a table: one ConfigError
    naming the key when the plan is made, not a ValueError at every launch."""
    from recaccel.errors import ConfigError

    entry = {"block_b": 1, "bd": 32, "num_warps": 4, "bt": 16}
    monkeypatch.setattr(tuning, "lookup", lambda device, key: entry if key.startswith("fwd") else None)
    with pytest.raises(
        ConfigError, match=r"tuning table: fwd_R27_D128_bfloat16_native: .*cannot run at R=27"
    ):
        launch_plan(27, 128, torch.bfloat16, torch.device("cuda"))
    plan = launch_plan(501, 32, torch.bfloat16, torch.device("cuda"))  # the same entry fits R=501
    assert tile_rows(plan.fwd, 501) == 16 and plan.bwd == heuristic_plan(501, 32).bwd
