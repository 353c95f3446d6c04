"""Fields meet a model by name, never by position.

A batch (or a KeyedJaggedTensor from another pipeline) may list the model's fields in
any order: the logits and gradients must not change. The external reference is
TorchRec's own DLRM, which looks pooled embeddings up by feature name; recaccel's DLRM
must agree with it on copied weights in float64, forward and backward, with the batch's
fields shuffled. Then every embedding backend, meta-learning and hybrid mode: the same
logits for a permuted batch, and one-line errors for missing or unknown fields.

Each permuted-batch check also makes sure it could fail: the same tensors under the
model's names in batch order (what reading fields by position computes) give other
logits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from recaccel.config import ModelConfig, OptimConfig
from recaccel.errors import DataError
from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.models.arches import DenseArch, InteractionArch, OverArch, SparseArch
from recaccel.models.dlrm import DLRM
from recaccel.models.embedding import PerTableEmbeddingBag
from recaccel.models.factory import build_model
from recaccel.ops.backend import fbgemm_installed, triton_interpret_enabled
from recaccel.sparse import Batch, SparseFeatures, TaskBatch

KEYS = ["user", "item", "cat", "city"]  # the model's (the schema's) field order
SHUFFLED = ["cat", "city", "user", "item"]
ROWS = [7, 9, 5, 6]  # per field: different cardinalities catch ids read from the wrong table
DIM, NUM_DENSE, BOTTOM, TOP = 4, 3, [6, 4], [5, 1]

needs_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_interpret_enabled()),
    reason="triton kernels need CUDA or TRITON_INTERPRET=1",
)
needs_fbgemm = pytest.mark.skipif(not fbgemm_installed(), reason="fbgemm_gpu is not installed")


def random_batch(b: int, seed: int, keys: list[str] = KEYS, dtype: torch.dtype = torch.float32) -> Batch:
    """B rows in ``keys`` order; every id is valid in every table (ids < min(ROWS))."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(keys) * b,), generator=g)
    values = torch.randint(0, min(ROWS), (int(lengths.sum()),), generator=g)
    dense = torch.randn(b, NUM_DENSE, generator=g, dtype=dtype)
    labels = torch.randint(0, 2, (b,), generator=g).to(dtype)
    return Batch(dense, SparseFeatures.from_lengths(keys, values, lengths), labels)


def with_sparse(batch: Batch, sparse: SparseFeatures) -> Batch:
    return Batch(batch.dense, sparse, batch.labels, batch.weights)


def by_position(sf: SparseFeatures, keys: list[str]) -> SparseFeatures:
    """The same tensors under other names: what a model reading fields by position sees."""
    return SparseFeatures(list(keys), sf.values, sf.offsets, sf.weights)


def assert_order_free(forward, batch: Batch) -> None:
    """``forward`` gives the same logits for ``batch`` with its fields shuffled, and would
    not if it read fields by position."""
    shuffled = with_sparse(batch, batch.sparse.select(SHUFFLED))
    assert shuffled.sparse.keys == SHUFFLED
    want = forward(batch)
    torch.testing.assert_close(forward(shuffled), want, rtol=0, atol=0)
    positional = forward(with_sparse(batch, by_position(shuffled.sparse, KEYS)))
    assert not torch.allclose(positional, want), "the check cannot tell field orders apart"


# ------------------------------------------------------------------ TorchRec's DLRM


def linears(module: nn.Module) -> list[nn.Linear]:
    return [m for m in module.modules() if isinstance(m, nn.Linear)]


def test_dlrm_matches_torchrec_dlrm_forward_and_backward_with_shuffled_fields():
    pytest.importorskip("torchrec", reason="torchrec is not installed: no external DLRM reference")
    from torchrec.models.dlrm import DLRM as TorchRecDLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=f"t_{k}", embedding_dim=DIM, num_embeddings=n, feature_names=[k])
            for k, n in zip(KEYS, ROWS)
        ],
        device=torch.device("cpu"),
    )
    theirs = TorchRecDLRM(ebc, NUM_DENSE, BOTTOM, TOP).double()
    inter = InteractionArch(len(KEYS), DIM, backend="reference")
    ours = DLRM(
        SparseArch(PerTableEmbeddingBag(KEYS, ROWS, DIM)),
        DenseArch(NUM_DENSE, BOTTOM),
        inter,
        OverArch(inter.output_dim, TOP),
    ).double()
    with torch.no_grad():
        for k, bag in zip(KEYS, ours.sparse_arch.embedding.bags):
            bag.weight.copy_(ebc.embedding_bags[f"t_{k}"].weight)
        for arch_ours, arch_theirs in (
            (ours.dense_arch, theirs.dense_arch),
            (ours.over_arch, theirs.over_arch),
        ):
            pairs = list(zip(linears(arch_ours), linears(arch_theirs), strict=True))
            for mine, ref in pairs:
                mine.weight.copy_(ref.weight)
                mine.bias.copy_(ref.bias)

    batch = random_batch(6, seed=3, keys=SHUFFLED, dtype=torch.float64)
    logits_theirs = theirs(batch.dense, batch.sparse.to_kjt()).squeeze(-1)
    logits_ours = ours(batch)
    torch.testing.assert_close(logits_ours, logits_theirs)

    F.binary_cross_entropy_with_logits(logits_theirs, batch.labels).backward()
    F.binary_cross_entropy_with_logits(logits_ours, batch.labels).backward()
    for arch_ours, arch_theirs in ((ours.dense_arch, theirs.dense_arch), (ours.over_arch, theirs.over_arch)):
        for mine, ref in zip(linears(arch_ours), linears(arch_theirs)):
            torch.testing.assert_close(mine.weight.grad, ref.weight.grad)
            torch.testing.assert_close(mine.bias.grad, ref.bias.grad)
    for k, bag in zip(KEYS, ours.sparse_arch.embedding.bags):
        ref = ebc.embedding_bags[f"t_{k}"].weight.grad
        assert ref is not None and bool(ref.abs().sum() > 0), f"table {k}: no gradient in the reference"
        torch.testing.assert_close(bag.weight.grad, ref, msg=lambda m, k=k: f"table {k}: {m}")


# ------------------------------------------------------------------ every backend


def schema() -> FeatureSchema:
    dense = tuple(f"d{i}" for i in range(NUM_DENSE))
    return FeatureSchema(dense, tuple(SparseField(k, n) for k, n in zip(KEYS, ROWS)))


def built_model(backend: str) -> DLRM:
    cfg = ModelConfig(embedding_dim=DIM, bottom_mlp=BOTTOM, top_mlp=TOP, embedding_backend=backend)
    torch.manual_seed(0)
    return build_model(cfg, OptimConfig(sparse="sgd"), schema(), torch.device("cpu")).eval()


BACKENDS = [
    "reference",
    "per_table",
    pytest.param("fbgemm", marks=needs_fbgemm),
    pytest.param("triton", marks=needs_triton),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_permuted_batch_gives_the_same_logits_on_every_backend(backend):
    model = built_model(backend)
    assert model.features == KEYS
    with torch.no_grad():
        assert_order_free(model, random_batch(3, seed=1))


@pytest.mark.parametrize("backend", ["reference", "per_table"])
def test_a_kjt_from_another_pipeline_meets_the_model_by_name(backend):
    pytest.importorskip("torchrec", reason="torchrec is not installed")
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    model = built_model(backend)
    batch = random_batch(4, seed=2)
    # Another pipeline's KJT: other key order, lengths only, int32.
    shuffled = batch.sparse.select(SHUFFLED)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=SHUFFLED, values=shuffled.values.int(), lengths=shuffled.lengths().int()
    )
    with torch.no_grad():
        got = model(with_sparse(batch, SparseFeatures.from_kjt(kjt)))
        torch.testing.assert_close(got, model(batch), rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["reference", "per_table"])
def test_missing_or_unknown_fields_are_one_line_naming_them(backend):
    model = built_model(backend)
    batch = random_batch(2, seed=4)
    missing = with_sparse(batch, batch.sparse.select(["city", "user", "item"]))
    with pytest.raises(DataError, match=r"missing 'cat'") as e:
        model(missing)
    assert "\n" not in str(e.value)
    extra = random_batch(2, seed=4, keys=[*SHUFFLED, "zip"])
    with pytest.raises(DataError, match=r"unknown 'zip'") as e:
        model(extra)
    assert "\n" not in str(e.value)
    renamed = random_batch(2, seed=4, keys=["user", "item", "cat", "town"])
    with pytest.raises(DataError, match=r"missing 'city', unknown 'town'"):
        model(renamed)


class Recorder(nn.Module):
    """An embedding that records the SparseFeatures it is given."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.seen = inner, []

    def forward(self, sf: SparseFeatures) -> torch.Tensor:
        self.seen.append(sf)
        return self.inner(sf)


def test_the_embedding_gets_the_model_order_and_no_copy_when_it_matches():
    model = built_model("reference")
    recorder = Recorder(model.sparse_arch.embedding)
    model.sparse_arch.embedding = recorder
    batch = random_batch(2, seed=5)
    with torch.no_grad():
        model(batch)
        model(with_sparse(batch, batch.sparse.select(SHUFFLED)))
    assert recorder.seen[0] is batch.sparse
    assert recorder.seen[1].keys == KEYS


# ------------------------------------------------------------------ meta-learning


def test_meta_learning_matches_fields_by_name():
    from recaccel.config import MetaConfig
    from recaccel.meta import MetaLearner

    torch.manual_seed(0)
    inter = InteractionArch(len(KEYS), DIM, backend="reference")
    model = DLRM(
        SparseArch(PerTableEmbeddingBag(KEYS, ROWS, DIM)),
        DenseArch(NUM_DENSE, BOTTOM),
        inter,
        OverArch(inter.output_dim, TOP),
    )
    learner = MetaLearner(model, MetaConfig(inner_steps=1, inner_lr=0.3), loss="bce")
    t, s, q = 2, 3, 2
    support, query = random_batch(t * s, seed=6), random_batch(t * q, seed=7)
    tb = TaskBatch(support, query, torch.ones(t, s), torch.ones(t, q), torch.arange(t))

    def predict(task_batch: TaskBatch) -> torch.Tensor:
        return learner.adapt_and_predict(task_batch).detach()

    want = predict(tb)
    # Support and query in two other orders: matched by name, to the model's and to each other.
    query_order = ["item", "user", "city", "cat"]
    permuted = TaskBatch(
        with_sparse(support, support.sparse.select(SHUFFLED)),
        with_sparse(query, query.sparse.select(query_order)),
        tb.support_mask,
        tb.query_mask,
        tb.task_ids,
    )
    torch.testing.assert_close(predict(permuted), want, rtol=0, atol=0)
    positional = TaskBatch(
        with_sparse(support, by_position(support.sparse.select(SHUFFLED), KEYS)),
        with_sparse(query, by_position(query.sparse.select(SHUFFLED), KEYS)),
        tb.support_mask,
        tb.query_mask,
        tb.task_ids,
    )
    assert not torch.allclose(predict(positional), want)
    with pytest.raises(DataError, match="missing 'cat'"):
        predict(
            TaskBatch(
                support,
                with_sparse(query, query.sparse.select(["user", "item", "city"])),
                tb.support_mask,
                tb.query_mask,
                tb.task_ids,
            )
        )


# ------------------------------------------------------------------ hybrid mode


def test_hybrid_sharded_lookup_matches_fields_by_name(one_rank_group):
    """A TorchRec sharded collection fixes its feature permutation on the first batch and
    applies it by position afterwards: a later batch in another order must still be
    looked up by name."""
    pytest.importorskip("torchrec", reason="torchrec is not installed")
    from recaccel.config import load_config
    from recaccel.train.distributed.hybrid import HybridParallel

    model = built_model("reference").train()
    batch = random_batch(4, seed=8)
    with torch.no_grad():
        want = model(batch)
    cfg = load_config(None, ["parallel.mode=hybrid", "parallel.sharding=table_wise", "optim.sparse=sgd"])
    parallel = HybridParallel(cfg, torch.device("cpu"))
    try:
        parallel.wrap(model)
        model.eval()
        with torch.no_grad():
            torch.testing.assert_close(model(batch), want)  # the first batch fixes TorchRec's order
            shuffled = with_sparse(batch, batch.sparse.select(SHUFFLED))
            torch.testing.assert_close(model(shuffled), want)
            # The TorchRec wrapper alone, fed a permuted batch: by name as well.
            pooled = parallel.embedding(shuffled.sparse)
            torch.testing.assert_close(
                pooled, model.embed(batch.sparse).index_select(1, torch.tensor([2, 3, 0, 1]))
            )
            with pytest.raises(DataError, match="missing 'cat'"):
                model(with_sparse(batch, batch.sparse.select(["user", "item", "city"])))
    finally:
        parallel.close()
