"""The generated tuning-table modules: what the package ships reads back as the table the
kernels import, so a tuning run can merge its winners into it (even after ruff format)."""

from __future__ import annotations

import pytest

from recaccel.ops.embedding.triton import tuning as embedding_tuning
from recaccel.ops.interaction import tuning as interaction_tuning
from recaccel.ops.tuning_tables import read_table, write_table


@pytest.mark.parametrize(
    ("module", "imported"),
    [
        (embedding_tuning.TABLE_MODULE, "recaccel.ops.embedding.triton.tuning_table"),
        (interaction_tuning.TABLE_MODULE, "recaccel.ops.interaction.tuning_table"),
    ],
)
def test_the_shipped_tables_read_back_and_take_a_merge(module, imported, tmp_path):
    import importlib

    table = importlib.import_module(imported).TABLE
    assert read_table(module) == table
    copy = tmp_path / "table.py"
    copy.write_text(module.read_text())
    write_table(copy, "Some GPU", {"k": {"a": 1}}, "header\n")
    assert read_table(copy) == {**table, "Some GPU": {"k": {"a": 1}}}


def test_a_missing_table_reads_empty(tmp_path):
    assert read_table(tmp_path / "none.py") == {}
