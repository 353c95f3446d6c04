"""Synthetic meta-learning tasks with a planted per-task offset (tests and benchmarks).

A fixed "world" maps a row to a global score ``g(x) = w . dense + sum_f mean(b_f[ids])``.
Each sampled task t draws an offset ``c_t ~ N(0, task_scale^2)`` that no feature reveals:

- ``loss="mse"``: ``label = g(x) + c_t + noise * N(0, 1)`` (ratings);
- ``loss="bce"``: ``label ~ Bernoulli(sigmoid(g(x) + c_t))`` (clicks).

A single global model cannot predict ``c_t``; one inner step on a task's support rows
can estimate it, so meta-learning beats plain training by a margin set by
``task_scale``. Padded rows (mask 0) have zero dense features, empty bags and label 0.

Shapes: T tasks, S / Q rows per task, Dd dense features, F fields.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from recaccel.config import Loss
from recaccel.meta.functional import LOSSES
from recaccel.sparse import Batch, SparseFeatures, TaskBatch


class SyntheticTasks:
    """A planted world of tasks.

    Args:
        num_dense: Dd.
        cardinalities: rows of each field's id space (F fields named ``f0, f1, ...``).
        loss: ``"mse"`` or ``"bce"``.
        task_scale: standard deviation of the per-task offset.
        noise: label noise standard deviation (``mse`` only).
        max_bag: bags hold 1..max_bag ids (1: single-hot).
        seed: seed of the world (weights and biases).
    """

    def __init__(
        self,
        num_dense: int = 4,
        cardinalities: Sequence[int] = (20, 20, 20),
        *,
        loss: Loss = "mse",
        task_scale: float = 1.0,
        noise: float = 0.1,
        max_bag: int = 1,
        seed: int = 0,
    ) -> None:
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
        if max_bag < 1 or not cardinalities or min(cardinalities) < 1:
            raise ValueError(
                f"need max_bag >= 1 and positive cardinalities, got {max_bag}, {list(cardinalities)}"
            )
        gen = torch.Generator().manual_seed(seed)
        self.loss, self.task_scale, self.noise, self.max_bag = loss, task_scale, noise, max_bag
        self.keys = [f"f{i}" for i in range(len(cardinalities))]
        self.cardinalities = [int(c) for c in cardinalities]
        self.num_dense = num_dense
        self.dense_weight = torch.randn(num_dense, generator=gen) / max(num_dense, 1) ** 0.5
        self.id_bias = [torch.randn(c, generator=gen) * 0.5 for c in self.cardinalities]

    def _rows(self, n: int, real: Tensor, offsets_of_task: Tensor, gen: torch.Generator) -> Batch:
        """``n`` rows; ``real`` [n] bool; ``offsets_of_task`` [n] the task offset of each row."""
        dense = torch.randn(n, self.num_dense, generator=gen) * real.unsqueeze(1)
        score = dense @ self.dense_weight
        lengths, values = [], []
        for card, bias in zip(self.cardinalities, self.id_bias):
            length = torch.randint(1, self.max_bag + 1, (n,), generator=gen) * real
            ids = torch.randint(0, card, (int(length.sum()),), generator=gen)
            row = torch.repeat_interleave(torch.arange(n), length)
            score += torch.zeros(n).index_add_(0, row, bias[ids]) / length.clamp_min(1)
            lengths.append(length)
            values.append(ids)
        logit = score + offsets_of_task
        if self.loss == "mse":
            labels = logit + self.noise * torch.randn(n, generator=gen)
        else:
            labels = torch.bernoulli(torch.sigmoid(logit), generator=gen)
        sparse = SparseFeatures.from_lengths(self.keys, torch.cat(values), torch.cat(lengths))
        return Batch(dense, sparse, labels * real)

    def sample(
        self,
        num_tasks: int,
        support: int,
        query: int,
        *,
        generator: torch.Generator,
        min_rows: int | None = None,
    ) -> TaskBatch:
        """T fresh tasks (new offsets) of S support and Q query rows.

        Args:
            num_tasks: T.
            support: S.
            query: Q.
            generator: the random stream of rows and offsets.
            min_rows: when given, each task keeps a random number of real rows in
                ``[min_rows, S]`` (and ``[min_rows, Q]``); the rest is padding.
        """
        offsets = torch.randn(num_tasks, generator=generator) * self.task_scale
        masks = []
        for rows in (support, query):
            lo = rows if min_rows is None else min(min_rows, rows)
            keep = torch.randint(lo, rows + 1, (num_tasks, 1), generator=generator)
            masks.append((torch.arange(rows).unsqueeze(0) < keep).float())
        sup = self._rows(
            num_tasks * support, masks[0].flatten() > 0, offsets.repeat_interleave(support), generator
        )
        qry = self._rows(
            num_tasks * query, masks[1].flatten() > 0, offsets.repeat_interleave(query), generator
        )
        return TaskBatch(sup, qry, masks[0], masks[1], torch.arange(num_tasks))
