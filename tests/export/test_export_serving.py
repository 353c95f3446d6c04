"""recaccel-export --format torch_export: the saved program, loaded back (and in a fresh
process that can import nothing of recaccel), predicts what the recaccel model does, for
any batch size, on the run's own rows and on random bags (empty bags, repeated ids, a
batch of one), and refuses ids outside their table."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from recaccel.export import load_run
from tests.helpers.export_run import data_batches, export, random_sparse


@pytest.fixture(params=["dot_run", "dcn_run", "melu_run", "meta_run"])
def any_run(request) -> Path:
    return request.getfixturevalue(request.param)


def expected(loaded, dense: torch.Tensor, sparse) -> torch.Tensor:
    """The recaccel model's prediction: a probability for click labels, else the rating."""
    with torch.no_grad():
        out = loaded.model.head(dense, loaded.model.embed(sparse))
    return torch.sigmoid(out) if loaded.label_kind == "binary" else out


def serving_cases(run: Path, loaded) -> list[tuple[torch.Tensor, object]]:
    names = [n for n, _ in loaded.fields]
    cases = [(b.dense, b.sparse.reorder(names)) for b in data_batches(run)[:2]]
    g = torch.Generator().manual_seed(3)
    for seed, batch in enumerate((1, 2, 33)):
        cases.append(
            (torch.randn(batch, loaded.num_dense, generator=g), random_sparse(loaded.fields, batch, seed))
        )
    return cases


def test_program_predicts_as_the_model_for_any_batch_size(any_run, tmp_path):
    spec = export(any_run, "torch_export", tmp_path / "model.pt2")
    program = torch.export.load(str(tmp_path / "model.pt2")).module()
    loaded = load_run(any_run)
    assert [f["name"] for f in spec["fields"]] == [n for n, _ in loaded.fields]
    assert spec["output"].endswith("click probability" if loaded.label_kind == "binary" else "rating")
    for dense, sparse in serving_cases(any_run, loaded):
        got = program(dense, sparse.values, sparse.offsets)
        assert got.shape == (dense.shape[0],)
        torch.testing.assert_close(got, expected(loaded, dense, sparse), rtol=1e-5, atol=1e-6)


def test_program_refuses_ids_outside_their_table_and_bad_offsets(dot_run, tmp_path):
    export(dot_run, "torch_export", tmp_path / "model.pt2")
    program = torch.export.load(str(tmp_path / "model.pt2")).module()
    loaded = load_run(dot_run)
    sparse = random_sparse(loaded.fields, 4, 0)
    dense = torch.randn(4, loaded.num_dense)
    first_of_c2 = int(sparse.offsets[4])  # the first id of field 1: one past its table would hit C3's rows
    assert first_of_c2 < int(sparse.offsets[8])
    for bad in (30, -1):
        values = sparse.values.clone()
        values[first_of_c2] = bad
        with pytest.raises(RuntimeError, match="outside its field's table"):
            program(dense, values, sparse.offsets)
    with pytest.raises(RuntimeError, match="offsets must rise"):
        program(dense, sparse.values[:-1], sparse.offsets)
    empty = torch.zeros(3 * 4 + 1, dtype=torch.int64)
    no_ids = program(dense, torch.zeros(0, dtype=torch.int64), empty)  # every bag empty: pooled zeros
    with torch.no_grad():
        pooled = torch.zeros(4, 3, loaded.cfg.model.embedding_dim)
        torch.testing.assert_close(no_ids, torch.sigmoid(loaded.model.head(dense, pooled)))


def test_program_runs_in_a_process_without_recaccel(dcn_run, tmp_path):
    export(dcn_run, "torch_export", tmp_path / "model.pt2")
    loaded = load_run(dcn_run)
    sparse = random_sparse(loaded.fields, 5, 7)
    dense = torch.randn(5, loaded.num_dense)
    torch.save({"dense": dense, "values": sparse.values, "offsets": sparse.offsets}, tmp_path / "inputs.pt")
    script = textwrap.dedent(
        f"""
        import sys

        class NoRecaccel:  # any import of recaccel fails
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "recaccel":
                    raise ImportError("recaccel must not be needed to serve")

        sys.meta_path.insert(0, NoRecaccel())
        import torch

        inputs = torch.load({str(tmp_path / "inputs.pt")!r}, weights_only=True)
        program = torch.export.load({str(tmp_path / "model.pt2")!r}).module()
        with torch.inference_mode():
            out = program(inputs["dense"], inputs["values"], inputs["offsets"])
        torch.save(out, {str(tmp_path / "out.pt")!r})
        assert not any(m.split(".")[0] == "recaccel" for m in sys.modules)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    torch.testing.assert_close(got, expected(loaded, dense, sparse), rtol=1e-5, atol=1e-6)


def test_description_lists_inputs_and_source(melu_run, tmp_path):
    spec = export(melu_run, "torch_export", tmp_path / "melu.pt2", "--checkpoint", "2")
    assert spec == json.loads((tmp_path / "melu.json").read_text())
    assert spec["arch"] == "melu" and spec["pooling"] == "mean" and spec["num_dense"] == 2
    assert spec["source"]["step"] == 2 and spec["source"]["checkpoint"].endswith("step-000000002.pt")
    assert spec["inputs"]["offsets"].startswith("int64 [3*B + 1]")
