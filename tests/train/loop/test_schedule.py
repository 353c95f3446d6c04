"""Learning-rate schedules: the factor against hand-computed values and torch's own
schedulers, the rates both optimizers hold at each step of a run (single process and
hybrid), and exact resume with a schedule."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from recaccel.cli import train_main
from recaccel.config import load_config
from recaccel.errors import ConfigError
from recaccel.ops.embedding import PackedEmbeddingBag, SparseOptimConfig, TableSpec
from recaccel.train.checkpoint.state import list_checkpoints
from recaccel.train.loop.parallel import SingleProcess
from recaccel.train.loop.schedule import LRSchedule, lr_factor, sparse_rate_setters
from recaccel.train.loop.trainer import Trainer
from tests.helpers.gloo_ranks import gloo_group_of_one
from tests.helpers.resume import STEPS_PER_EPOCH, assert_same_run, small_sets

pytestmark = pytest.mark.numeric


def _optim(*sets: str):
    return load_config(None, [f"optim.{s}" for s in sets]).optim


# ----------------------------------------------------------------- the factor


def test_warmup_then_constant_then_linear_decay_by_hand():
    cfg = _optim("schedule=linear", "warmup_steps=4", "decay_start=6", "decay_steps=4", "final_lr_ratio=0.2")
    want = [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2, 0.2]
    got = [lr_factor(k, 100, cfg) for k in range(len(want))]
    assert got == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize(
    ("shape", "extra", "at_quarter", "at_half"),
    [
        ("cosine", [], 0.2 + 0.8 * (1 + math.cos(math.pi / 4)) / 2, 0.6),
        ("polynomial", ["poly_power=2.0"], 0.2 + 0.8 * 0.75**2, 0.2 + 0.8 * 0.25),
        ("polynomial", ["poly_power=1.0"], 0.2 + 0.8 * 0.75, 0.6),
    ],
)
def test_cosine_and_polynomial_by_hand(shape, extra, at_quarter, at_half):
    cfg = _optim(f"schedule={shape}", "decay_start=10", "decay_steps=8", "final_lr_ratio=0.2", *extra)
    assert lr_factor(0, None, cfg) == 1.0 and lr_factor(10, None, cfg) == 1.0  # no warmup
    assert lr_factor(12, None, cfg) == pytest.approx(at_quarter, abs=1e-12)
    assert lr_factor(14, None, cfg) == pytest.approx(at_half, abs=1e-12)
    assert lr_factor(18, None, cfg) == pytest.approx(0.2) and lr_factor(50, None, cfg) == pytest.approx(0.2)


def test_decay_until_the_runs_last_step_and_right_after_warmup():
    """decay_steps = 0: the decay spans the rest of the run; decay_start = 0: it starts
    when the warmup ends. The last step keeps a rate above the final one."""
    cfg = _optim("schedule=linear", "warmup_steps=2", "final_lr_ratio=0")
    total = 12  # decay over steps 2..11, 10 steps
    assert [lr_factor(k, total, cfg) for k in (0, 1, 2, 3, 11)] == pytest.approx([0.5, 1.0, 1.0, 0.9, 0.1])


def test_constant_keeps_the_warmup_and_ignores_decay_keys():
    cfg = _optim(
        "schedule=constant", "warmup_steps=3", "decay_steps=2", "decay_start=5", "final_lr_ratio=0.1"
    )
    assert [lr_factor(k, None, cfg) for k in range(8)] == pytest.approx([1 / 3, 2 / 3, 1, 1, 1, 1, 1, 1])


def _torch_factors(make, steps: int) -> list[float]:
    """Factors a torch scheduler gives an optimizer of base rate 1, one per step."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = make(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return out


@pytest.mark.parametrize(
    ("schedule", "extra", "make"),
    [
        (
            "linear",
            ["final_lr_ratio=0.1"],
            lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=1.0, end_factor=0.1, total_iters=20),
        ),
        (
            "cosine",
            ["final_lr_ratio=0.1"],
            lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=20, eta_min=0.1),
        ),
        (
            "polynomial",
            ["final_lr_ratio=0", "poly_power=2.0"],
            lambda o: torch.optim.lr_scheduler.PolynomialLR(o, total_iters=20, power=2.0),
        ),
        (
            "polynomial",
            ["final_lr_ratio=0", "poly_power=0.5"],
            lambda o: torch.optim.lr_scheduler.PolynomialLR(o, total_iters=20, power=0.5),
        ),
    ],
)
def test_warmup_and_decay_equal_torchs_schedulers(schedule, extra, make):
    """The warmup is LinearLR from 1/warmup; the decay (after a constant stretch) is the
    torch scheduler of its shape started at decay_start."""
    warmup, start, n = 5, 9, 20
    cfg = _optim(
        f"schedule={schedule}", f"warmup_steps={warmup}", f"decay_start={start}", f"decay_steps={n}", *extra
    )
    ours = [lr_factor(k, None, cfg) for k in range(start + n + 4)]
    ramp = _torch_factors(
        lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=1 / warmup, total_iters=warmup - 1),
        warmup,
    )
    decay = _torch_factors(make, n + 1)
    assert ours[:warmup] == pytest.approx(ramp, rel=1e-9)
    assert ours[warmup:start] == [1.0] * (start - warmup)
    assert ours[start : start + n + 1] == pytest.approx(decay, rel=1e-6, abs=1e-12)
    assert ours[start + n :] == pytest.approx([decay[-1]] * 4)  # held (torch's cosine would rise again)


def test_bad_schedules_are_one_line_config_errors():
    with pytest.raises(ConfigError, match="optim.decay_start=3 lies inside the warmup"):
        lr_factor(0, 100, _optim("schedule=cosine", "warmup_steps=5", "decay_start=3"))
    with pytest.raises(ConfigError, match="optim.decay_steps=0 .* length is unknown"):
        lr_factor(0, None, _optim("schedule=cosine"))
    with pytest.raises(ConfigError, match="optim.decay_steps=0 .* the run has 10 steps"):
        lr_factor(0, 10, _optim("schedule=linear", "warmup_steps=10"))
    # The fused sparse optimizers need a rate > 0: a decay to 0 that ends mid-run is refused.
    cfg = _optim("schedule=linear", "decay_steps=5", "final_lr_ratio=0")
    dense = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(
        ConfigError, match="optim.final_lr_ratio=0 brings the sparse rate to 0 at step 6 of 9"
    ):
        LRSchedule(cfg, 9, dense, [lambda lr: None])
    LRSchedule(cfg, 9, dense, [])  # no sparse optimizer: a dense rate of 0 is fine
    LRSchedule(cfg, 5, dense, [lambda lr: None])  # the decay ends with the run
    late = LRSchedule(cfg, None, dense, [lambda lr: None])  # length unknown: refused when reached
    late.apply(4)
    with pytest.raises(ConfigError, match="brings optim.sparse_lr to 0 at step 6"):
        late.apply(5)


# ----------------------------------------------------------- applying the rates


def test_schedule_sets_dense_groups_and_packed_embedding():
    cfg = _optim(
        "lr=0.1", "sparse_lr=0.4", "schedule=linear", "warmup_steps=2", "decay_steps=4", "final_lr_ratio=0.5"
    )
    emb = PackedEmbeddingBag(
        [TableSpec("t", 10, 4, ("f",))], backend="reference", optim=SparseOptimConfig(lr=0.4)
    )
    head = torch.nn.Linear(4, 1)
    dense = torch.optim.Adam([{"params": [head.weight]}, {"params": [head.bias]}], lr=0.1)
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    schedule = LRSchedule(cfg, None, dense, sparse_rate_setters(model, SingleProcess(torch.device("cpu"))))
    for step, factor in [(0, 0.5), (1, 1.0), (3, 0.875), (6, 0.5), (9, 0.5)]:
        schedule.apply(step)
        assert [g["lr"] for g in dense.param_groups] == pytest.approx([0.1 * factor] * 2)
        assert emb.optim.lr == pytest.approx(0.4 * factor)
        assert schedule.rates(step) == pytest.approx((0.1 * factor, 0.4 * factor))


def test_without_a_schedule_nothing_is_touched():
    cfg = _optim("lr=0.1")
    emb = PackedEmbeddingBag(
        [TableSpec("t", 10, 4, ("f",))], backend="reference", optim=SparseOptimConfig(lr=0.3)
    )
    dense = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.25)  # e.g. a checkpoint's rate
    schedule = LRSchedule(cfg, 10, dense, sparse_rate_setters(emb, SingleProcess(torch.device("cpu"))))
    for step in range(12):
        schedule.apply(step)
    assert dense.param_groups[0]["lr"] == 0.25 and emb.optim.lr == 0.3


SCHEDULE = [
    "optim.sparse=sgd",
    "optim.lr=0.01",
    "optim.sparse_lr=0.2",
    "optim.schedule=polynomial",
    "optim.warmup_steps=4",
    "optim.decay_start=7",
    "optim.final_lr_ratio=0.1",
    "optim.poly_power=2.0",
]


def _flat(rows: list[tuple[float, ...]]) -> list[float]:
    return [x for row in rows for x in (*row, len(row))]


def _recording(trainer: Trainer) -> list[tuple[float, float]]:
    """(dense, sparse) rates the optimizers hold when each step's forward starts."""
    seen = []
    embedding = trainer.objective.embedding
    loss = trainer.objective.batch_loss

    def record(batch):
        seen.append((trainer.optimizer.param_groups[0]["lr"], embedding.optim.lr))
        return loss(batch)

    trainer.objective.batch_loss = record
    return seen


def test_each_step_trains_at_its_rates_and_the_log_says_so(small_data, tmp_path):  # noqa: F811
    steps = STEPS_PER_EPOCH + 3  # into the second epoch: decay_steps = 0 spans both
    sets = [*SCHEDULE, f"train.steps={steps}", "train.log_every=2"]
    cfg = load_config(None, small_sets(small_data, tmp_path / "run", *sets)[1::2])
    trainer = Trainer(cfg)
    seen = _recording(trainer)
    trainer.fit()
    want = [
        (0.01 * lr_factor(k, steps, cfg.optim), 0.2 * lr_factor(k, steps, cfg.optim)) for k in range(steps)
    ]
    assert _flat(seen) == pytest.approx(_flat(want), rel=1e-12)
    assert want[0] == pytest.approx((0.0025, 0.05)) and want[-1][0] > 0.001  # warmup; decayed, not to the end
    events = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    train = [e for e in events if e["event"] == "train"]
    assert [e["step"] for e in train] == [1, *range(2, steps + 1, 2)]
    for e in train:
        assert (e["lr"], e["sparse_lr"]) == pytest.approx(want[e["step"] - 1], rel=1e-12)
        assert e["samples_per_s"] > 0 and e["data_wait_s"] >= 0


# ----------------------------------------------------------------- exact resume


def test_resumed_mid_warmup_and_mid_decay_equals_uninterrupted(small_data, tmp_path):  # noqa: F811
    """Stopped at step 3 (warmup), resumed to step 17 (decay), resumed to the end."""
    sched = [*SCHEDULE, f"optim.decay_steps={STEPS_PER_EPOCH}"]  # explicit: train.steps changes below
    full, part = tmp_path / "full", tmp_path / "part"
    assert train_main(small_sets(small_data, full, *sched)) == 0
    assert train_main(small_sets(small_data, part, *sched, "train.steps=3")) == 0
    assert train_main(["--resume", str(part), "--set", "train.steps=17"]) == 0
    assert train_main(["--resume", str(part), "--set", "train.steps=0"]) == 0
    assert_same_run(full, part)


def test_resumed_from_warmup_and_decay_checkpoints_equals_uninterrupted(small_data, tmp_path, monkeypatch):  # noqa: F811
    """decay_steps = 0 (until the run's end): the same run, resumed from its checkpoint
    at step 3 (warmup) and at step 18 (decay) as if it had stopped there."""
    saved = tmp_path / "saved"
    saved.mkdir()
    save = SingleProcess.save_checkpoint

    def keep_every_checkpoint(self, run_dir, model, optimizer, state, *keep):
        path = save(self, run_dir, model, optimizer, state, *keep)
        shutil.copy(path, saved / path.name)  # the run itself keeps only the newest train.keep_checkpoints
        return path

    monkeypatch.setattr(SingleProcess, "save_checkpoint", keep_every_checkpoint)
    full = tmp_path / "full"
    assert train_main(small_sets(small_data, full, *SCHEDULE, "train.checkpoint_every=3")) == 0
    for keep in (3, 18):
        run = tmp_path / f"from{keep}"
        shutil.copytree(full, run)
        (run / "metrics.json").unlink()
        for path in list_checkpoints(run):
            path.unlink()
        shutil.copy(saved / f"step-{keep:09d}.pt", run / "checkpoints")
        assert train_main(["--resume", str(run)]) == 0
        events = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
        # Resumed, not retrained: the log (trimmed to the checkpoint's step on resume) holds each
        # train step once, in order, and one final event; a run from step 0 would log 1..keep twice.
        steps = [e["step"] for e in events if e["event"] == "train"]
        assert steps == sorted(set(steps)) and any(step > keep for step in steps)
        assert [e["event"] for e in events].count("final") == 1 and events[-1]["event"] == "final"
        assert_same_run(full, run)


# ---------------------------------------------------------------------- hybrid


def test_hybrid_schedule_reaches_torchrecs_fused_and_replicated_optimizers(small_data, tmp_path):  # noqa: F811
    """One gloo process in hybrid mode: the sharded tables' FBGEMM kernels, the
    data-parallel table's optimizer and the dense one hold each step's rates."""
    pytest.importorskip("torchrec", exc_type=ImportError)
    steps = 9
    sets = [
        *SCHEDULE,
        "optim.sparse=rowwise_adagrad",
        "parallel.mode=hybrid",
        'parallel.table_sharding=["C2=data_parallel"]',
        f"train.steps={steps}",
    ]
    pairs = small_sets(small_data, tmp_path / "run", *sets)
    with gloo_group_of_one():
        trainer = Trainer(load_config(None, pairs[1::2]))
        fused = trainer.parallel.dmp.fused_optimizer
        replicated = trainer.parallel.replicated_optimizer
        seen = []
        loss = trainer.objective.batch_loss

        def record(batch):
            kernels = [kernel.get_learning_rate() for kernel in _fbgemm_kernels(fused)]
            seen.append(
                (
                    trainer.optimizer.param_groups[0]["lr"],
                    replicated.param_groups[0]["lr"],
                    *{round(k, 12) for k in kernels},
                )
            )
            return loss(batch)

        trainer.objective.batch_loss = record
        trainer.fit()
    cfg = trainer.cfg.optim
    want = [
        (0.01 * lr_factor(k, steps, cfg), 0.2 * lr_factor(k, steps, cfg), 0.2 * lr_factor(k, steps, cfg))
        for k in range(steps)
    ]
    assert _flat(seen) == pytest.approx(_flat(want), rel=1e-6)


def _fbgemm_kernels(optimizer) -> list:
    """FBGEMM's table-batched modules under TorchRec's (nested) combined fused optimizer."""
    if hasattr(optimizer, "_emb_module"):
        return [optimizer._emb_module]
    return [k for _, inner in optimizer.optimizers for k in _fbgemm_kernels(inner)]
