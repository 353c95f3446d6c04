"""Synthetic data generator: determinism, id ranges and skew, planted-model metrics."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from sklearn.metrics import log_loss, roc_auc_score

from recaccel.config import SynthConfig
from recaccel.errors import ConfigError, DataError
from recaccel.io.convert import synth
from recaccel.io.convert.synth import SynthRows, build_planted_model, generate_synthetic, rows_from_table
from recaccel.io.format.schema import FeatureSchema


def _cfg(tmp_path, name="ds", **kw) -> SynthConfig:
    base = dict(
        out_dir=str(tmp_path / name),
        train_rows=3000,
        test_rows=2000,
        num_dense=4,
        num_sparse=6,
        cardinality=50,
        multi_hot_fields=2,
        max_bag=4,
        rows_per_row_group=500,
        rows_per_file=1200,
        seed=3,
    )
    base.update(kw)
    return SynthConfig(**base)


def _read(paths) -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in paths])


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    cfg = _cfg(tmp_path_factory.mktemp("synth"))
    return cfg, generate_synthetic(cfg)


def test_same_seed_same_data_other_seed_differs(tmp_path, small):
    cfg, report = small
    again = generate_synthetic(dataclasses.replace(cfg, out_dir=str(tmp_path / "again")))
    other = generate_synthetic(dataclasses.replace(cfg, out_dir=str(tmp_path / "other"), seed=cfg.seed + 1))
    for split in ("train_paths", "test_paths"):
        assert _read(getattr(report, split)).equals(_read(getattr(again, split)))
        assert not _read(getattr(report, split)).equals(_read(getattr(other, split)))
    assert report.bayes_auc == again.bayes_auc and report.train_ctr == again.train_ctr


def test_schema_ids_in_range_and_bag_lengths(small):
    cfg, report = small
    for path in report.train_paths + report.test_paths:
        assert FeatureSchema.from_arrow(pq.read_schema(path), path) == report.schema
    table = _read(report.train_paths)
    assert table.num_rows == cfg.train_rows
    multi = [f for f in report.schema.sparse if f.multi_hot]
    first_multi = cfg.num_sparse - cfg.multi_hot_fields + 1
    assert [f.name for f in multi] == [f"C{j}" for j in range(first_multi, cfg.num_sparse + 1)]
    for field in report.schema.sparse:
        col = table.column(field.name).combine_chunks()
        if field.multi_hot:
            assert col.type == pa.list_(pa.int32())  # every synth cardinality fits int32
            lengths = pa.compute.list_value_length(col).to_numpy()
            assert lengths.min() >= 1 and lengths.max() <= cfg.max_bag
            assert set(np.unique(lengths)) == set(range(1, cfg.max_bag + 1))
            ids = col.flatten().to_numpy()
        else:
            assert col.type == pa.int32()
            ids = col.to_numpy()
        assert ids.min() >= 0 and ids.max() < field.cardinality
    dense = np.stack([table.column(n).to_numpy() for n in report.schema.dense])
    assert np.isfinite(dense).all() and dense.min() >= 0  # log1p of counts
    assert set(np.unique(table.column("label").to_numpy())) <= {0.0, 1.0}


def test_streaming_writes_files_and_row_groups(small):
    cfg, report = small
    for paths, rows in ((report.train_paths, cfg.train_rows), (report.test_paths, cfg.test_rows)):
        sizes = [min(cfg.rows_per_file, rows - s) for s in range(0, rows, cfg.rows_per_file)]
        assert [pq.ParquetFile(p).metadata.num_rows for p in paths] == sizes
        for path, size in zip(paths, sizes):
            meta = pq.ParquetFile(path).metadata
            groups = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
            rg = cfg.rows_per_row_group
            assert groups == [min(rg, size - s) for s in range(0, size, rg)]


def test_chunking_does_not_change_rows_beyond_chunk_boundaries(tmp_path, monkeypatch):
    """Small chunks (many writes per row group) give valid files with all rows."""
    monkeypatch.setattr(synth, "_MAX_CHUNK_ROWS", 170)
    cfg = _cfg(tmp_path, train_rows=1000, test_rows=600)
    report = generate_synthetic(cfg)
    table = _read(report.test_paths)
    assert table.num_rows == cfg.test_rows
    logits = build_planted_model(cfg).logits_from_table(table)
    expected = roc_auc_score(table.column("label").to_numpy(), logits)
    assert report.bayes_auc == pytest.approx(expected, abs=1e-12)


def test_zipf_skew_matches_truncated_zipf(tmp_path):
    cfg = _cfg(
        tmp_path,
        train_rows=6000,
        test_rows=100,
        num_sparse=2,
        multi_hot_fields=0,
        cardinality=1000,
        zipf_a=1.2,
    )
    report = generate_synthetic(cfg)
    ranks = np.arange(1, cfg.cardinality + 1, dtype=np.float64)
    p_top = 1.0 / np.sum(ranks**-cfg.zipf_a)  # truncated Zipf: P(rank 1)
    table = _read(report.train_paths)
    tops = []
    for name in report.schema.sparse_names:
        counts = np.bincount(table.column(name).to_numpy(), minlength=cfg.cardinality)
        freq = counts.max() / cfg.train_rows
        tolerance = 5 * np.sqrt(p_top * (1 - p_top) / cfg.train_rows)
        assert abs(freq - p_top) < tolerance
        assert freq > 50 / cfg.cardinality  # far above uniform
        tops.append(int(counts.argmax()))
    assert tops[0] != tops[1]  # each field has its own permutation (hot id not always 0)


def test_bayes_metrics_match_recomputed_planted_model(small):
    cfg, report = small
    table = _read(report.test_paths)
    labels = table.column("label").to_numpy()
    logits = build_planted_model(cfg).logits_from_table(table)
    probs = 1 / (1 + np.exp(-logits))
    torch.testing.assert_close(report.bayes_auc, float(roc_auc_score(labels, logits)), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(report.bayes_logloss, float(log_loss(labels, probs)), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(report.planted_ctr, float(probs.mean()), rtol=1e-9, atol=1e-9)
    const = np.full_like(probs, report.train_ctr)
    torch.testing.assert_close(report.constant_logloss, float(log_loss(labels, const)), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(report.test_ctr, float(labels.mean(dtype=np.float64)), rtol=1e-12, atol=1e-12)
    assert report.bayes_logloss < report.constant_logloss
    saved = json.loads((Path(report.out_dir) / "synth.json").read_text())["report"]
    assert saved["bayes_auc"] == report.bayes_auc and saved["test_rows"] == cfg.test_rows


def _naive_terms(model, rows: SynthRows):
    """Per-row Python reference of the planted model's terms (double loop over fields)."""
    out = []
    num_single = rows.single.shape[1]
    for i in range(rows.num_rows):
        bags = [[int(v)] for v in rows.single[i]]
        bags += [list(values[offsets[i] : offsets[i + 1]]) for values, offsets in rows.bags]
        vecs, bias = [], 0.0
        for f, bag in enumerate(bags):
            g = [model.field_offsets[f] + v for v in bag]
            bias += sum(float(model.bias[x]) for x in g)
            vecs.append(np.sum([model.latent[x].astype(np.float64) for x in g], axis=0))
        inter = sum(float(vecs[f] @ vecs[h]) for f in range(len(vecs)) for h in range(f + 1, len(vecs)))
        out.append((bias, inter, float(rows.dense[i].astype(np.float64) @ model.dense_weight)))
    assert num_single + len(rows.bags) == model.schema.num_sparse
    return np.array(out)


def test_planted_terms_match_naive_pairwise_reference(small):
    cfg, report = small
    model = build_planted_model(cfg)
    rows = rows_from_table(model.schema, _read(report.test_paths).slice(0, 40))
    got = np.stack(model.terms(rows), axis=1)
    expected = _naive_terms(model, rows)
    torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(expected), rtol=1e-9, atol=1e-9)


def test_ctr_and_logit_spread_follow_config(tmp_path, small):
    cfg, report = small
    for ctr in (report.train_ctr, report.test_ctr, report.planted_ctr):
        assert abs(ctr - synth.TARGET_CTR) < 0.05
    weak = generate_synthetic(_cfg(tmp_path, "weak", signal_scale=0.5))
    strong = generate_synthetic(_cfg(tmp_path, "strong", signal_scale=2.0))
    assert 0.5 < weak.bayes_auc < report.bayes_auc < strong.bayes_auc
    table = _read(strong.test_paths)
    logits = build_planted_model(_cfg(tmp_path, "strong", signal_scale=2.0)).logits_from_table(table)
    assert logits.std() == pytest.approx(2.0, rel=0.2)  # calibrated on an independent sample


def test_thousand_fields(tmp_path):
    cfg = _cfg(
        tmp_path,
        num_sparse=1000,
        cardinality=100,
        multi_hot_fields=5,
        train_rows=600,
        test_rows=400,
        rows_per_row_group=256,
        rows_per_file=10_000,
    )
    report = generate_synthetic(cfg)
    table = _read(report.test_paths)
    assert report.schema.num_sparse == 1000 and table.num_columns == 1 + cfg.num_dense + 1000
    rows = rows_from_table(report.schema, table)  # checks every id is in range
    assert rows.single.shape == (cfg.test_rows, 995) and len(rows.bags) == 5
    assert report.bayes_auc > 0.6


def test_per_field_cardinalities(tmp_path):
    cards = [3, 1, 70, 1000, 5, 2]
    cfg = _cfg(tmp_path, cardinalities=cards, train_rows=800, test_rows=400)
    report = generate_synthetic(cfg)
    assert report.schema.cardinalities == cards
    rows = rows_from_table(report.schema, _read(report.train_paths))
    assert rows.single[:, 1].max() == 0


def test_fixed_bag_sizes_per_multi_hot_field(tmp_path):
    # MLPerf's multi-hot Criteo: every bag of a field has that field's size.
    cfg = _cfg(tmp_path, multi_hot_fields=3, bag_sizes=[1, 4, 2], train_rows=300, test_rows=100)
    report = generate_synthetic(cfg)
    rows = rows_from_table(report.schema, _read(report.train_paths))
    assert len(rows.bags) == 3
    for (values, offsets), size in zip(rows.bags, [1, 4, 2]):
        assert np.all(np.diff(offsets) == size) and values.size == size * 300


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(multi_hot_fields=2, bag_sizes=[1, 2, 3]), "bag_sizes"),
        (dict(cardinalities=[10, 10]), "cardinalities"),
        (dict(multi_hot_fields=7), "multi_hot_fields"),
        (dict(train_rows=0), "train_rows"),
        (dict(zipf_a=-1.0), "zipf_a"),
        (dict(rows_per_row_group=0), "rows_per_row_group"),
    ],
)
def test_bad_config_raises(tmp_path, change, words):
    with pytest.raises(ConfigError, match=words):
        generate_synthetic(_cfg(tmp_path, **change))


def test_existing_dataset_needs_overwrite(tmp_path):
    cfg = _cfg(tmp_path, train_rows=300, test_rows=200)
    generate_synthetic(cfg)
    with pytest.raises(DataError, match="already exists"):
        generate_synthetic(cfg)
    report = generate_synthetic(cfg, overwrite=True)
    assert _read(report.train_paths).num_rows == cfg.train_rows


def test_rows_from_table_rejects_out_of_range_ids(small):
    cfg, report = small
    table = _read(report.test_paths).slice(0, 10)
    too_big = pa.array([cfg.cardinality] * 10, pa.int64())
    bad = table.set_column(table.schema.get_field_index("C1"), "C1", too_big)
    with pytest.raises(DataError, match="C1"):
        rows_from_table(report.schema, bad)


def test_progress_bar(tmp_path, capsys):
    generate_synthetic(_cfg(tmp_path, train_rows=300, test_rows=200), progress=True)
    assert "synth" in capsys.readouterr().err


def test_cli_reuses_data_of_the_same_config_and_names_what_differs(tmp_path, capsys):
    from recaccel.cli import data_main

    cfg = tmp_path / "s.toml"
    cfg.write_text(
        f'[synth]\nout_dir = "{tmp_path / "d"}"\ntrain_rows = 300\ntest_rows = 50\nnum_sparse = 2\n'
    )
    assert data_main(["synth", "--config", str(cfg)]) == 0
    done = tmp_path / "d" / "synth.json"
    saved = json.loads(done.read_text())
    del saved["config"]["compression"]  # written before the key existed: its default applies
    done.write_text(json.dumps(saved))
    capsys.readouterr()
    assert data_main(["synth", "--config", str(cfg)]) == 0
    assert "up to date" in capsys.readouterr().err
    assert data_main(["synth", "--config", str(cfg), "--set", 'synth.compression="lz4"']) == 2
    assert "differs in: compression" in capsys.readouterr().err
    assert data_main(["synth", "--config", str(cfg), "--set", 'synth.compression="lz4"', "--overwrite"]) == 0
