"""MetaLearner: a MAML / Meta-SGD meta step over a TaskBatch for DLRM-like models.

One meta step looks up the embeddings of every support and query row of the T tasks in
one call (support and query CSRs merged row-wise), runs the work all tasks share once,
adapts the head per task (see :mod:`recaccel.meta.maml`) and returns the mean query
loss. The caller calls ``backward()`` on it and steps its optimizers: head parameters
and Meta-SGD rates get ``.grad`` for a dense optimizer; the embeddings get their
gradient through the pooled output (a fused packed embedding applies its sparse update
inside its backward; an autograd one gets ``.grad``).

Under ``precision = "bf16"`` the shared work and the whole inner loop (support
forward, inner gradients, query forward) run under ``torch.autocast`` to bfloat16: the
matmuls in bfloat16, the losses and the adapted parameters (``p - lr * g``) in float32,
so first and second order, every engine and Meta-SGD keep their float32 parameters.

Shapes: T tasks, S support and Q query rows per task, F fields, D embedding dim.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from recaccel.config import Loss, MetaConfig, MetaEngine, Precision
from recaccel.errors import ConfigError
from recaccel.meta.functional import LOSSES
from recaccel.meta.heads import SHIFT, TaskHead, adapt_plan, initial_params, shift_shape
from recaccel.meta.maml import ENGINES, Block, MetaOutput, Rates, run_engine
from recaccel.sparse import TaskBatch


def _rate_key(name: str) -> str:
    # ParameterDict keys cannot contain dots.
    return name.replace(".", "__")


class MetaLearner(nn.Module):
    """Meta-learning wrapper of a model with ``embed`` / ``head`` and DLRM-style arches.

    Args:
        model: DLRM, MeLU or any module with ``embed(sparse) -> [B, F, D]``,
            ``sparse_arch``, ``dense_arch``, ``interaction_arch`` (its parameters, if
            any, shared and never adapted) and ``over_arch`` (see :mod:`recaccel.meta.heads`).
        cfg: inner steps, inner lr, first/second order, Meta-SGD, adapt mode.
        loss: ``"bce"`` (binary labels, logits) or ``"mse"`` (ratings).
        engine: ``"batched"`` (stacked batched matmuls; needs Linear/ReLU MLP arches),
            ``"vmap"`` (torch.func over the model's modules) or ``"loop"`` (baseline).
        precision: ``train.precision``; ``"bf16"`` runs the step under bfloat16
            autocast (``fp32`` / ``tf32`` need nothing here: TF32 is a process switch).

    Raises:
        ConfigError: bad config values or a model that cannot be meta-learned.
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: MetaConfig,
        loss: Loss = "bce",
        engine: MetaEngine = "batched",
        precision: Precision = "fp32",
    ) -> None:
        super().__init__()
        if loss not in LOSSES:
            raise ConfigError(f"meta loss must be one of {LOSSES}, got {loss!r}")
        if engine not in ENGINES:
            raise ConfigError(f"meta engine must be one of {ENGINES}, got {engine!r}")
        if int(cfg.inner_steps) < 0:
            raise ConfigError(f"meta.inner_steps must be >= 0, got {cfg.inner_steps}")
        if not cfg.inner_lr > 0:
            raise ConfigError(f"meta.inner_lr must be > 0, got {cfg.inner_lr}")
        self.model = model
        self.cfg = cfg
        self.loss = loss
        self.engine = engine
        self.bf16 = precision == "bf16"
        self.plan = adapt_plan(model, cfg.adapt)
        try:
            self.head = TaskHead(model, self.plan, batched=engine == "batched")
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e)) from None
        self.inner_lrs = nn.ParameterDict()
        if cfg.meta_sgd:
            named = dict(model.named_parameters())
            for name in self.plan.names:
                if name == SHIFT:
                    ref = next(model.over_arch.parameters())
                    rate = torch.full(
                        shift_shape(model), float(cfg.inner_lr), dtype=ref.dtype, device=ref.device
                    )
                else:
                    rate = torch.full_like(named[name].detach(), float(cfg.inner_lr))
                self.inner_lrs[_rate_key(name)] = nn.Parameter(rate)

    def meta_parameters(self) -> list[nn.Parameter]:
        """Dense meta-parameters for a dense optimizer: every model parameter outside
        ``sparse_arch``, then the Meta-SGD rates (if any)."""
        dense = [p for n, p in self.model.named_parameters() if not n.startswith("sparse_arch.")]
        return dense + list(self.inner_lrs.values())

    def embedding_parameters(self) -> list[nn.Parameter]:
        """Parameters of ``sparse_arch`` (empty for a fused packed embedding, whose weights are buffers)."""
        return list(self.model.sparse_arch.parameters())

    def inner_rates(self) -> Rates:
        """The inner learning rate: ``cfg.inner_lr``, or with Meta-SGD a dict from each adapted
        name (model-level, or :data:`~recaccel.meta.heads.SHIFT`) to its rate Parameter."""
        if not self.cfg.meta_sgd:
            return float(self.cfg.inner_lr)
        return {name: self.inner_lrs[_rate_key(name)] for name in self.plan.names}

    def _blocks(self, tb: TaskBatch) -> tuple[dict[str, Tensor], Block, Block]:
        """Embeds all rows once, runs the shared work, splits into [T, S|Q, ...] blocks."""
        t, s, q = tb.num_tasks, tb.support_size, tb.query_size
        for name, batch, rows in (("support", tb.support, s), ("query", tb.query, q)):
            if batch.batch_size != t * rows or batch.sparse.batch_size != t * rows:
                raise ValueError(
                    f"TaskBatch {name} has {batch.batch_size} rows ({batch.sparse.batch_size} sparse rows), "
                    f"expected T*{name[0].upper()} = {t}*{rows}"
                )
        pooled = self.model.embed(tb.concat_sparse())
        dense = torch.cat([tb.support.dense, tb.query.dense]).to(pooled.dtype)
        shared = self.head.shared_rows(dense, pooled)
        support: Block = {}
        query: Block = {}
        for key, rows in shared.items():
            support[key], query[key] = tb.split_rows(rows)
        support["labels"] = tb.support.labels.to(pooled.dtype).view(t, s)
        query["labels"] = tb.query.labels.to(pooled.dtype).view(t, q)
        support["mask"] = tb.support_mask.to(pooled.dtype)
        query["mask"] = tb.query_mask.to(pooled.dtype)
        return initial_params(self.model, self.plan, pooled), support, query

    def _autocast(self, device: torch.device) -> torch.autocast:
        """bfloat16 autocast on ``device`` under ``precision = "bf16"``, else a no-op."""
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def _run(self, tb: TaskBatch, steps: int, first_order: bool) -> MetaOutput:
        with self._autocast(tb.support.labels.device):
            return self._adapt(self._blocks(tb), steps, first_order)

    def _adapt(
        self, blocks: tuple[dict[str, Tensor], Block, Block], steps: int, first_order: bool
    ) -> MetaOutput:
        init, support, query = blocks
        # Without grad mode there is no outer graph; first order gives the same values.
        first_order = first_order or not torch.is_grad_enabled()
        with self._autocast(support["labels"].device):
            out = run_engine(
                self.engine,
                self.head,
                init,
                self.inner_rates(),
                support,
                query,
                steps=steps,
                first_order=first_order,
                loss=self.loss,
            )
        if not self.bf16:
            return out
        # Losses and predictions leave in float32 (autocast's matmuls give bfloat16).
        return MetaOutput(out.loss.float(), out.query_pred.float(), out.support_loss.float())

    def step_loss(self, tb: TaskBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """The meta step up to the scalar outer loss.

        Args:
            tb: T tasks of S support and Q query rows.

        Returns:
            ``(loss, info)``: the mean query loss after adaptation (call ``backward()``
            on it), and detached scalars ``support_loss`` (before adaptation),
            ``query_loss`` and ``tasks`` (tasks with real query rows).
        """
        out = self._run(tb, int(self.cfg.inner_steps), bool(self.cfg.first_order))
        info = {
            "support_loss": out.support_loss,
            "query_loss": out.loss.detach(),
            "tasks": (tb.query_mask.sum(-1) > 0).sum(),
        }
        return out.loss, info

    def forward(self, tb: TaskBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """Same as :meth:`step_loss`."""
        return self.step_loss(tb)

    @torch.no_grad()
    def adapt_and_predict(self, tb: TaskBatch) -> Tensor:
        """Query predictions [T, Q] after adapting on each task's support rows.

        Nothing is recorded for backward: embeddings are looked up without grad, and
        the inner gradients are taken on detached copies (the adapted values equal
        those of the training step, first or second order).
        """
        return self._run(tb, int(self.cfg.inner_steps), True).query_pred.detach()

    @torch.no_grad()
    def predict_without_adaptation(self, tb: TaskBatch) -> Tensor:
        """Query predictions [T, Q] of the meta-parameters themselves (no inner step)."""
        return self._run(tb, 0, True).query_pred.detach()

    @torch.no_grad()
    def predict(self, tb: TaskBatch) -> tuple[Tensor, Tensor]:
        """``(adapted, unadapted)`` query predictions [T, Q] from one embedding lookup."""
        with self._autocast(tb.support.labels.device):
            blocks = self._blocks(tb)
        adapted = self._adapt(blocks, int(self.cfg.inner_steps), True)
        base = self._adapt(blocks, 0, True)
        return adapted.query_pred.detach(), base.query_pred.detach()
