"""A tiny DLRM objective and seeded batches for the step and pipeline tests."""

from __future__ import annotations

import torch

from recaccel.config import Config, TrainConfig
from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.models.factory import build_model
from recaccel.sparse import Batch, SparseFeatures
from recaccel.train.model.objectives import DLRMObjective


def tiny_objective(
    backend: str = "reference", sparse_optim: str = "sgd", device: str = "cpu", **train
) -> DLRMObjective:
    cfg = Config()
    cfg.model.embedding_dim = 4
    cfg.model.bottom_mlp = [8, 4]
    cfg.model.top_mlp = [8, 1]
    cfg.model.embedding_backend = backend
    cfg.optim.sparse = sparse_optim
    cfg.optim.sparse_lr = 0.5
    cfg.train = TrainConfig(**train)
    schema = FeatureSchema(
        ("d0", "d1", "d2"), tuple(SparseField(f"sparse_{i}", n) for i, n in enumerate([20, 7, 11]))
    )
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.optim, schema, torch.device(device))
    return DLRMObjective(cfg, model, "bce")


def random_batch(rows: int, seed: int, weights: bool = False) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (3 * rows,), generator=g)
    lengths[:rows] = 1  # field 0 one-hot; the others bags, some empty
    cards = [20, 7, 11]
    values = torch.cat(
        [
            torch.randint(0, c, (int(lengths[f * rows : (f + 1) * rows].sum()),), generator=g)
            for f, c in enumerate(cards)
        ]
    )
    names = ["sparse_0", "sparse_1", "sparse_2"]
    sparse = SparseFeatures.from_lengths(names, values % 7, lengths)  # duplicate ids
    labels = torch.randint(0, 2, (rows,), generator=g).float()
    w = torch.rand(rows, generator=g) + 0.5 if weights else None
    return Batch(torch.randn(rows, 3, generator=g), sparse, labels, w)


NAMES = ["sparse_0", "sparse_1", "sparse_2"]
CARDS = [20, 7, 11]


def one_hot_batch(rows: int, seed: int, bad: int | None = None) -> Batch:
    """A one-hot batch of the tiny objective's fields (implicit offsets); ``bad``: the row
    whose sparse_1 id is out of its table's range."""
    g = torch.Generator().manual_seed(seed)
    values = torch.cat([torch.randint(0, c, (rows,), generator=g) for c in CARDS])
    if bad is not None:
        values[rows + bad] = CARDS[1] + 3
    labels = torch.randint(0, 2, (rows,), generator=g).float()
    return Batch(torch.randn(rows, 3, generator=g), SparseFeatures(NAMES, values, None), labels)


# A one-hot synthetic run on CUDA (the whole-step graph tests): data, model and schedule.
ONE_HOT = [
    "synth.train_rows=2048",
    "synth.test_rows=256",
    "synth.num_dense=2",
    "synth.num_sparse=3",
    "synth.cardinality=40",
    "synth.multi_hot_fields=0",
    "synth.rows_per_row_group=256",
    "synth.rows_per_file=1024",
    "data.batch_size=128",
    "data.shuffle_buffer_rows=512",
    "model.embedding_dim=8",
    "model.bottom_mlp=[16, 8]",
    "model.top_mlp=[16, 1]",
    "optim.sparse=rowwise_adagrad",
    "optim.warmup_steps=6",  # rates that change every step: the replays read them from the device
    "train.log_every=4",
    "train.progress=false",
    "train.epochs=2",
    'train.device="cuda"',
    "train.checkpoint_every=8",
]
