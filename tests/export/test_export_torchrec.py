"""recaccel-export --format torchrec: TorchRec's own DLRM / DLRM_DCN, built from the JSON the
export writes, loads the state dict strictly and predicts what the recaccel run does.

The run fixtures (tiny CLI runs: dot and DCN-v2 DLRMs, MeLU, a meta-DLRM) are in
tests/export/conftest.py, shared with test_export_serving.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from recaccel.cli import export_main
from recaccel.config import load_config
from recaccel.errors import ConfigError
from recaccel.export import load_run, torchrec_state_dict
from tests.helpers.export_run import data_batches, export, random_sparse, train_run


@pytest.fixture(params=["dot", "dcn"])
def dlrm_run(request) -> Path:
    return request.getfixturevalue(f"{request.param}_run")


def torchrec_model_from_json(spec: dict):
    """TorchRec's DLRM built by hand from the exported JSON, as a user would."""
    from torchrec.models.dlrm import DLRM, DLRM_DCN
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=t["name"],
                num_embeddings=t["num_embeddings"],
                embedding_dim=t["embedding_dim"],
                feature_names=t["feature_names"],
                pooling=PoolingType[t["pooling"]],
            )
            for t in spec["tables"]
        ]
    )
    sizes = dict(
        dense_in_features=spec["dense_in_features"],
        dense_arch_layer_sizes=spec["dense_arch_layer_sizes"],
        over_arch_layer_sizes=spec["over_arch_layer_sizes"],
    )
    if spec["class"] == "torchrec.models.dlrm.DLRM_DCN":
        return DLRM_DCN(
            ebc, **sizes, dcn_num_layers=spec["dcn_num_layers"], dcn_low_rank_dim=spec["dcn_low_rank_dim"]
        )
    assert spec["class"] == "torchrec.models.dlrm.DLRM"
    return DLRM(ebc, **sizes)


def test_torchrec_dlrm_loads_the_export_strictly_and_predicts_alike(dlrm_run, tmp_path):
    pytest.importorskip("torchrec", reason="TorchRec is not installed: the interop test needs its DLRM")
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    spec = export(dlrm_run, "torchrec", tmp_path / "dlrm.pt")
    theirs = torchrec_model_from_json(spec)
    theirs.load_state_dict(torch.load(tmp_path / "dlrm.pt", weights_only=True), strict=True)
    theirs.eval()
    ours = load_run(dlrm_run).model
    fields = [(t["name"], t["num_embeddings"]) for t in spec["tables"]]
    names = [n for n, _ in fields]
    cases = [(b.dense, b.sparse) for b in data_batches(dlrm_run)]
    g = torch.Generator().manual_seed(0)
    for seed, batch in enumerate((1, 2, 37)):
        cases.append(
            (torch.randn(batch, spec["dense_in_features"], generator=g), random_sparse(fields, batch, seed))
        )
    assert len(cases) > 5 and cases[3][0].shape[0] == 200 % 64  # the short last batch of the test rows
    with torch.no_grad():
        for dense, sparse in cases:
            sparse = sparse.reorder(names)
            kjt = KeyedJaggedTensor.from_offsets_sync(
                keys=names, values=sparse.values, offsets=sparse.offsets
            )
            expected = ours.head(dense, ours.embed(sparse))
            got = theirs(dense_features=dense, sparse_features=kjt)
            assert got.shape == (dense.shape[0], 1)
            torch.testing.assert_close(got.squeeze(1), expected, rtol=1e-5, atol=1e-6)


def test_torchrec_export_holds_the_checkpoint_tensors_under_torchrec_names(dcn_run, tmp_path):
    spec = export(dcn_run, "torchrec", tmp_path / "dcn.pt")
    state = torch.load(tmp_path / "dcn.pt", weights_only=True)
    saved = torch.load(sorted((dcn_run / "checkpoints").glob("step-*.pt"))[-1], weights_only=True)["model"]
    assert spec["class"] == "torchrec.models.dlrm.DLRM_DCN" and spec["source"]["step"] == 4
    assert [t["name"] for t in spec["tables"]] == ["C1", "C2", "C3"] and spec["tables"][0][
        "pooling"
    ] == "MEAN"
    for name in ("C1", "C2", "C3"):
        exported = state[f"sparse_arch.embedding_bag_collection.embedding_bags.{name}.weight"]
        rows = saved[f"sparse_arch.embedding.{name}.weight"]
        assert rows.dtype == torch.bfloat16 and exported.dtype == torch.float32  # widened exactly
        assert torch.equal(exported, rows.float())
    assert torch.equal(state["inter_arch.crossnet.W_kernels.1"], saved["interaction_arch.u"][1])
    assert torch.equal(state["inter_arch.crossnet.V_kernels.0"], saved["interaction_arch.v"][0])
    assert torch.equal(state["over_arch.model.1.weight"], saved["over_arch.model.2.weight"])
    assert torch.equal(state["dense_arch.model._mlp.1._linear.bias"], saved["dense_arch.model.2.bias"])
    assert not any("momentum" in key for key in state)  # optimizer state stays behind


def test_checkpoint_step_picks_an_older_checkpoint(dot_run, tmp_path):
    spec = export(dot_run, "torchrec", tmp_path / "old.pt", "--checkpoint", "2")
    old = torch.load(tmp_path / "old.pt", weights_only=True)
    export(dot_run, "torchrec", tmp_path / "new.pt")
    new = torch.load(tmp_path / "new.pt", weights_only=True)
    ckpt = torch.load(dot_run / "checkpoints" / "step-000000002.pt", weights_only=True)["model"]
    key = "dense_arch.model._mlp.0._linear.weight"
    assert spec["source"]["step"] == 2
    assert torch.equal(old[key], ckpt["dense_arch.model.0.weight"]) and not torch.equal(old[key], new[key])


def test_meta_run_exports_its_global_model(meta_run, tmp_path):
    pytest.importorskip("torchrec", reason="TorchRec is not installed: the interop test needs its DLRM")
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    spec = export(meta_run, "torchrec", tmp_path / "meta.pt")
    theirs = torchrec_model_from_json(spec)
    theirs.load_state_dict(torch.load(tmp_path / "meta.pt", weights_only=True), strict=True)
    saved = torch.load(sorted((meta_run / "checkpoints").glob("step-*.pt"))[-1], weights_only=True)["model"]
    assert torch.equal(theirs.over_arch.model[1].weight, saved["model.over_arch.model.2.weight"])
    ours = load_run(meta_run).model
    sparse = random_sparse([(t["name"], t["num_embeddings"]) for t in spec["tables"]], 9, 1)
    dense = torch.randn(9, 1)
    kjt = KeyedJaggedTensor.from_offsets_sync(keys=sparse.keys, values=sparse.values, offsets=sparse.offsets)
    with torch.no_grad():
        torch.testing.assert_close(theirs(dense, kjt).squeeze(1), ours.head(dense, ours.embed(sparse)))
    assert spec["output"].startswith("rating")


def _one_line_error(capsys, argv: list[str]) -> str:
    capsys.readouterr()  # drop what a fixture's training run printed before the export
    assert export_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("recaccel-export: error: ") and "\n" not in err, err
    return err


def test_errors_are_one_line(dot_run, melu_run, tmp_path, capsys):
    out = str(tmp_path / "m.pt")
    assert "torchrec, torch_export" in _one_line_error(capsys, [str(dot_run), out, "--format", "onnx"])
    err = _one_line_error(capsys, [str(dot_run), out, "--format", "torchrec", "--checkpoint", "3"])
    assert "step 3" in err and "2, 4" in err
    assert "does not exist" in _one_line_error(capsys, [str(tmp_path / "nope"), out, "--format", "torchrec"])
    (tmp_path / "empty").mkdir()
    assert "no checkpoint" in _one_line_error(capsys, [str(tmp_path / "empty"), out, "--format", "torchrec"])
    err = _one_line_error(capsys, [str(melu_run), out, "--format", "torchrec"])
    assert "dlrm and dlrm_dcn" in err and "model.arch=melu" in err
    assert ".pt2" in _one_line_error(capsys, [str(dot_run), out, "--format", "torch_export"])
    assert not Path(out).exists()


def test_one_layer_top_mlp_is_refused_for_torchrec(tmp_path, capsys, tiny_data):
    run = train_run(tiny_data, tmp_path / "one", "model.top_mlp=[1]", "train.steps=2")
    err = _one_line_error(capsys, [str(run), str(tmp_path / "m.pt"), "--format", "torchrec"])
    assert "model.top_mlp=[1]" in err and "torch_export" in err


def test_model_without_dense_features_is_refused_for_torchrec(dot_run):
    no_dense = dataclasses.replace(load_run(dot_run), num_dense=0)
    with pytest.raises(ConfigError, match="no dense features"):
        torchrec_state_dict(no_dense)


@pytest.mark.slow
def test_hybrid_run_exports_from_its_sharded_checkpoint(tmp_path):
    """A 2-rank gloo run (row-wise shards + a data-parallel table): its step-*.dcp read
    whole; TorchRec's DLRM with the export scores the test rows as the ranks did."""
    pytest.importorskip("torchrec", exc_type=ImportError)
    from sklearn.metrics import roc_auc_score
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recaccel.cli import train_main
    from recaccel.io.convert.synth import generate_synthetic
    from tests.helpers.hybrid_run import HYBRID_TINY, hybrid_set_args

    data, run = tmp_path / "data", tmp_path / "hybrid"
    generate_synthetic(load_config(None, [*HYBRID_TINY, f'synth.out_dir="{data}"']).synth)
    extra = [
        "train.steps=8",
        "train.checkpoint_every=8",
        "parallel.mode=hybrid",
        "parallel.sharding=row_wise",
    ]
    assert (
        train_main(
            [
                *hybrid_set_args(data, run, *extra, 'parallel.table_sharding=["C2=data_parallel"]'),
                "--nproc",
                "2",
            ]
        )
        == 0
    )
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-000000008.dcp"]
    spec = export(run, "torchrec", tmp_path / "dlrm.pt")
    theirs = torchrec_model_from_json(spec)
    theirs.load_state_dict(torch.load(tmp_path / "dlrm.pt", weights_only=True), strict=True)
    theirs.eval()
    names = [t["name"] for t in spec["tables"]]
    scores, labels = [], []
    with torch.no_grad():
        for batch in data_batches(run, 256):
            sparse = batch.sparse.reorder(names)
            kjt = KeyedJaggedTensor.from_offsets_sync(
                keys=names, values=sparse.values, offsets=sparse.offsets
            )
            scores.append(theirs(dense_features=batch.dense, sparse_features=kjt).squeeze(1))
            labels.append(batch.labels)
    auc = roc_auc_score(torch.cat(labels).numpy(), torch.cat(scores).numpy())
    assert auc == pytest.approx(json.loads((run / "metrics.json").read_text())["auc"], abs=1e-6)
