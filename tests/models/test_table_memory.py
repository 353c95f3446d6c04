"""check_table_memory: tables that cannot fit are refused naming the file, before allocating."""

import pytest
import torch

from recaccel.errors import DataError
from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.models.table_memory import check_table_memory, host_memory_bytes, table_memory_bytes


def test_tables_that_cannot_fit_are_refused_naming_the_file():
    schema = FeatureSchema.from_arrow(
        FeatureSchema(("d0",), (SparseField("big", 10**12), SparseField("s1", 3))).arrow_schema(), "f.parquet"
    )
    need = (10**12 + 3) * 16 * 4
    assert table_memory_bytes(schema, 16) == need
    expected = rf"^file f\.parquet: .*need .*\({need} bytes.* memory of cpu .*'big'"
    with pytest.raises(DataError, match=expected):
        check_table_memory(schema, 16, "cpu")  # 64 TB: no host has it
    assert 0 < host_memory_bytes() < need
    small = FeatureSchema((), (SparseField("s0", 1000),), origin="g.parquet")
    check_table_memory(small, 16, "cpu")
    check_table_memory(small, 16, "cpu", limit_bytes=1000 * 16 * 4)  # exactly fits
    expected = r"^file g\.parquet: .*64000 bytes.* the configured limit is .*63999 bytes"
    with pytest.raises(DataError, match=expected):
        check_table_memory(small, 16, "cpu", limit_bytes=1000 * 16 * 4 - 1)


def test_model_factory_refuses_tables_before_allocating():
    from recaccel.config import ModelConfig, OptimConfig
    from recaccel.models.factory import build_model

    schema = FeatureSchema(("d0",), (SparseField("big", 10**12),), origin="f.parquet")
    cfg = ModelConfig(embedding_dim=16, bottom_mlp=[16], top_mlp=[8, 1])
    with pytest.raises(DataError, match=r"file f\.parquet: the embedding tables .* 'big': 1000000000000 ids"):
        build_model(cfg, OptimConfig(), schema, torch.device("cpu"))
