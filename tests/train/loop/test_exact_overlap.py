"""``train.pipeline = "overlap"``: weight gradients deferred after backward, the next batch's
lookup after the sparse update. It must train exactly what ``off`` trains (bit for bit on
CPU), resume exactly, leave no deferred work behind, and refuse what it cannot run in one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from recaccel.bench.step.candidates import BASELINE, Combination, recaccel_candidates
from recaccel.cli import train_main
from recaccel.config import Config, TrainConfig, load_config
from recaccel.errors import ConfigError
from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.models.arches import MLP, DenseArch
from recaccel.models.dlrm import DLRM
from recaccel.models.factory import build_model
from recaccel.sparse import Batch, SparseFeatures
from recaccel.train.distributed.hybrid_pipeline import check_pipelined
from recaccel.train.loop.overlap import OverlapStep
from recaccel.train.loop.pipeline import BatchPipeline, StepInput
from recaccel.train.loop.step import build_step
from recaccel.train.model.objectives import DLRMObjective
from recaccel.train.model.optim import build_dense_optimizer
from tests.helpers.resume import STEPS_PER_EPOCH, assert_same_run, small_sets

pytestmark = pytest.mark.numeric

CARDS = [20, 7, 11]
NAMES = [f"sparse_{i}" for i in range(len(CARDS))]


def _objective(
    interaction: str = "dot", dense: str = "adam", precision: str = "fp32", **model
) -> DLRMObjective:
    cfg = Config()
    cfg.model.embedding_dim = 4
    cfg.model.bottom_mlp = [8, 4]
    cfg.model.top_mlp = [8, 1]
    cfg.model.interaction = interaction
    cfg.model.dcn_layers = 2
    cfg.model.dcn_rank = 3
    cfg.model.embedding_backend = "reference"
    for key, value in model.items():
        setattr(cfg.model, key, value)
    cfg.optim.dense = dense
    cfg.optim.sparse = "rowwise_adagrad"
    cfg.optim.sparse_lr = 0.5
    cfg.train = TrainConfig(precision=precision)
    schema = FeatureSchema(("d0", "d1", "d2"), tuple(SparseField(n, c) for n, c in zip(NAMES, CARDS)))
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.optim, schema, torch.device("cpu"))
    return DLRMObjective(cfg, model, "bce")


def _batch(rows: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (len(CARDS) * rows,), generator=g)
    lengths[:rows] = 1  # field 0 one-hot; the others bags, some empty
    values = torch.cat(
        [
            torch.randint(0, c, (int(lengths[f * rows : (f + 1) * rows].sum()),), generator=g)
            for f, c in enumerate(CARDS)
        ]
    )
    sparse = SparseFeatures.from_lengths(NAMES, values % 7, lengths)  # duplicate ids
    labels = torch.randint(0, 2, (rows,), generator=g).float()
    return Batch(torch.randn(rows, 3, generator=g), sparse, labels, None)


def _batches(n: int = 5) -> list[Batch]:
    return [_batch(8 if i < n - 1 else 5, 10 + i) for i in range(n)]  # a smaller last batch


def _run(objective: DLRMObjective, mode: str, batches: list[Batch], after_step=None, micro_batches: int = 1):
    """Trains ``batches`` the way the single-process loop does; returns the step losses
    and the dense optimizer."""
    optimizer = build_dense_optimizer(objective.module, objective.cfg.optim)
    train = TrainConfig(pipeline=mode, micro_batches=micro_batches)
    runner = build_step(train, objective, torch.device("cpu"))
    losses = []
    pipeline = BatchPipeline(objective.prepare, torch.device("cpu"), mode, objective.batches_ahead)
    for item in pipeline((b, {}) for b in batches):
        optimizer.zero_grad(set_to_none=True)
        losses.append(runner.forward_backward(item))
        if after_step is not None:
            after_step(runner, objective)
        optimizer.step()
    return losses, optimizer


def _assert_same_training(a: tuple, b: tuple, oa: DLRMObjective, ob: DLRMObjective) -> None:
    (losses_a, opt_a), (losses_b, opt_b) = a, b
    assert all(torch.equal(x, y) for x, y in zip(losses_a, losses_b, strict=True))
    sa, sb = oa.module.state_dict(), ob.module.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:  # dense weights, embedding rows and the sparse optimizer's state
        assert torch.equal(sa[key], sb[key]), key
    for pa, pb in zip(opt_a.state.values(), opt_b.state.values(), strict=True):
        for key in pa:
            assert torch.equal(torch.as_tensor(pa[key]), torch.as_tensor(pb[key])), key


# ------------------------------------------------------------- bit identity


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("dense", ["sgd", "adam"])
@pytest.mark.parametrize("interaction", ["dot", "dcnv2"])
def test_overlap_trains_bit_identical_to_off(interaction, dense, precision):
    batches = _batches()
    off, overlap = (_objective(interaction, dense, precision) for _ in range(2))
    _assert_same_training(_run(off, "off", batches), _run(overlap, "overlap", batches), off, overlap)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("dense", ["sgd", "adam"])
def test_overlap_with_micro_batches_trains_bit_identical_to_sync_with_them(dense, precision):
    batches = _batches()
    sync, overlap = (_objective("dot", dense, precision) for _ in range(2))
    _assert_same_training(
        _run(sync, "sync", batches, micro_batches=3),
        _run(overlap, "overlap", batches, micro_batches=3),
        sync,
        overlap,
    )


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_overlap_of_the_fused_bias_relu_layers_trains_bit_identical_to_off(precision):
    # CUDA's default layer form (bias + ReLU in the GEMM epilogue, aligned widths), forced on CPU.
    batches = _batches()
    off, overlap = (_objective(precision=precision) for _ in range(2))
    for objective in (off, overlap):
        for m in objective.module.modules():
            if isinstance(m, MLP):
                m.fused, m.align = True, True
    _assert_same_training(_run(off, "off", batches), _run(overlap, "overlap", batches), off, overlap)


def test_overlap_with_a_padded_interaction_trains_bit_identical_to_off():
    # The top MLP's first layer takes a padded input and pads its weight at run time.
    batches = _batches()
    off, overlap = (_objective(interaction_pad="on", bottom_mlp=[5, 4]) for _ in range(2))
    assert overlap.module.over_arch.padded_input
    _assert_same_training(_run(off, "off", batches), _run(overlap, "overlap", batches), off, overlap)


def test_overlap_with_16_bit_rows_draws_the_same_rounding_as_off():
    batches = _batches()
    off, overlap = (_objective(embedding_dtype="bf16") for _ in range(2))
    _assert_same_training(_run(off, "off", batches), _run(overlap, "overlap", batches), off, overlap)


@pytest.mark.parametrize("lookahead", [1, 2])
def test_overlap_with_host_tables_and_their_cache_trains_bit_identical_to_off(lookahead):
    batches = _batches(6)
    off, overlap = (
        _objective(embedding_placement="host", cache_fraction=0.9, cache_lookahead=lookahead)
        for _ in range(2)
    )
    _assert_same_training(_run(off, "off", batches), _run(overlap, "overlap", batches), off, overlap)


def test_overlap_run_from_the_cli_equals_off_and_resumes_exactly(small_data, full_run, tmp_path):  # noqa: F811
    whole = tmp_path / "whole"
    extra = (f"train.checkpoint_every={STEPS_PER_EPOCH}", "train.pipeline=overlap")
    assert train_main(small_sets(small_data, whole, *extra)) == 0
    assert_same_run(full_run, whole)
    part = tmp_path / "part"
    assert train_main(small_sets(small_data, part, *extra, f"train.steps={STEPS_PER_EPOCH // 2}")) == 0
    assert train_main(["--resume", str(part), "--set", "train.steps=0"]) == 0
    assert_same_run(full_run, part)


# ------------------------------------------------------------- deferred work


def _dense_params(objective: DLRMObjective) -> list[nn.Parameter]:
    return [p for p in objective.module.parameters() if p.requires_grad]


def test_no_weight_gradient_is_queued_after_a_step():
    objective = _objective()
    seen = []

    def check(runner: OverlapStep, obj: DLRMObjective) -> None:
        seen.append(len(runner.queue))
        assert all(p.grad is not None for p in _dense_params(obj))

    _run(objective, "overlap", _batches(), after_step=check)
    assert seen == [0] * 5
    # Between steps the model's MLPs are plain again (a shared or evaluated model).
    mlps = [m for m in objective.module.modules() if isinstance(m, MLP)]
    assert mlps and all(m.wgrad_queue is None for m in mlps)


def test_a_step_raising_mid_backward_leaves_no_queued_work():
    objective = _objective()
    runner = build_step(TrainConfig(pipeline="overlap"), objective, torch.device("cpu"))
    optimizer = build_dense_optimizer(objective.module, objective.cfg.optim)
    b0, b1 = (objective.prepare(b) for b in _batches(2))
    queued_when_raised = []

    def fail(grad: torch.Tensor) -> torch.Tensor:
        queued_when_raised.append(len(runner.queue))
        raise RuntimeError("injected failure in backward")

    # The interaction's output gradient arrives after the top MLP has queued its wgrads.
    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.register_hook(fail)

    handle = objective.module.interaction_arch.register_forward_hook(hook)
    optimizer.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match="injected failure"):
        runner.forward_backward(StepInput(b0, b1, {}))
    handle.remove()
    assert queued_when_raised == [2]  # the top MLP's two layers had queued their work
    assert len(runner.queue) == 0
    assert all(p.grad is None for p in objective.module.over_arch.parameters())
    # The next step runs whole: every dense parameter gets its gradient.
    runner.forward_backward(StepInput(b1, None, {}))
    assert len(runner.queue) == 0
    assert all(p.grad is not None for p in _dense_params(objective))


# ------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "train, message",
    [
        (dict(mode="meta", pipeline="overlap"), r"^config key train.pipeline=overlap runs train.mode=dlrm"),
        (
            dict(pipeline="overlap", cuda_graphs=True),
            r"^config keys train.pipeline=overlap and train.cuda_graphs=true",
        ),
        (
            dict(pipeline="overlap", compile=True),
            r"^config keys train.pipeline=overlap and train.compile=true",
        ),
    ],
)
def test_overlap_refuses_options_it_cannot_combine_with_in_one_line(train, message):
    with pytest.raises(ConfigError, match=message) as err:
        TrainConfig(**train)
    assert "\n" not in str(err.value)


def test_overlap_refuses_an_embedding_outside_the_packed_fused_one():
    objective = _objective(embedding_backend="per_table")
    with pytest.raises(
        ConfigError, match=r"^train.pipeline=overlap needs recaccel's packed embedding"
    ) as err:
        build_step(TrainConfig(pipeline="overlap"), objective, torch.device("cpu"))
    assert "\n" not in str(err.value)


class _LinearOver(nn.Module):
    """A top arch that is one plain Linear (no split layers)."""

    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear(features).squeeze(-1)


class _OwnLookup(DLRM):
    """A DLRM whose lookup is its own (the overlapped step could not reproduce it)."""

    def embed(self, sparse: SparseFeatures) -> torch.Tensor:
        return 2 * super().embed(sparse)


def test_overlap_refuses_a_model_without_split_linears():
    base = _objective()
    m = base.module
    model = DLRM(
        m.sparse_arch, DenseArch(0, [4]), m.interaction_arch, _LinearOver(m.interaction_arch.output_dim)
    )
    objective = DLRMObjective(base.cfg, model, "bce")
    with pytest.raises(
        ConfigError, match=r"^train.pipeline=overlap needs dense layers built as recaccel MLPs"
    ):
        build_step(TrainConfig(pipeline="overlap"), objective, torch.device("cpu"))


def test_overlap_refuses_a_model_with_a_lookup_of_its_own():
    m = _objective().module
    objective = DLRMObjective(
        _objective().cfg, _OwnLookup(m.sparse_arch, m.dense_arch, m.interaction_arch, m.over_arch), "bce"
    )
    with pytest.raises(
        ConfigError, match=r"^train.pipeline=overlap needs recaccel's DLRM .* not a _OwnLookup"
    ):
        build_step(TrainConfig(pipeline="overlap"), objective, torch.device("cpu"))


def test_overlap_is_refused_in_hybrid_mode():
    with pytest.raises(ConfigError, match=r"train.pipeline=overlap runs parallel.mode=single") as err:
        load_config(None, ['parallel.mode="hybrid"', 'train.pipeline="overlap"'])
    assert "\n" not in str(err.value)
    # A config changed after it was loaded meets the same refusal where TorchRec's pipeline starts.
    with pytest.raises(ConfigError, match=r"^train.pipeline=overlap runs parallel.mode=single"):
        check_pipelined(None, None, "overlap")


def test_overlap_refusal_from_the_cli_is_one_line(tmp_path: Path, capsys):
    code = train_main(
        [
            "--set",
            "train.pipeline=overlap",
            "--set",
            "train.compile=true",
            "--set",
            f'train.out_dir="{tmp_path}"',
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "train.pipeline=overlap and train.compile=true" in err[0]


# ------------------------------------------------------------- the train bench


def test_the_train_bench_times_overlap_beside_off_and_sync_on_one_shared_model():
    cfg = _objective().cfg
    schema = FeatureSchema(("d0", "d1", "d2"), tuple(SparseField(n, c) for n, c in zip(NAMES, CARDS)))
    combinations = [BASELINE, Combination("sync", 1, "off"), Combination("overlap", 1, "off")]
    candidates, skipped = recaccel_candidates(cfg, schema, torch.device("cpu"), "recaccel", combinations)
    assert skipped == {}
    assert [c.key for c in candidates] == ["recaccel", "recaccel sync/1/off", "recaccel overlap/1/off"]
    overlap, off = candidates[2], candidates[0]
    assert len(list(overlap.steps((b, {}) for b in _batches(3)))) == 3
    # The model is shared: after overlap's steps the plain step still fills every gradient.
    next(off.steps([(_batch(8, 99), {})]))
    assert all(p.grad is not None for p in off.trainer.model.parameters() if p.requires_grad)
