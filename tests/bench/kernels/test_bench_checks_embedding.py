"""The embedding benchmark's post-step check reads the rows the step updated."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from recaccel.bench.kernels.embedding_cases import (
    Candidate,
    CandidateMismatchError,
    EmbeddingCase,
    make_inputs,
    packed_candidate,
    per_table_candidate,
)
from recaccel.bench.kernels.embedding_run import run_embedding_bench

# Few ids over many rows: the check's step batch and the last batch touch disjoint rows.
SPARSE_CASE = EmbeddingCase(tables=1, batch=2, dim=4, bag_len=1, rows=10_000)


def _double_lr(case, init, device):
    """The reference with twice the learning rate: right forward, wrong update."""
    doubled = packed_candidate("reference", seed=0)(replace(case, lr=2 * case.lr), init, device)
    return Candidate("wrong", doubled.forward, doubled.train_step)


def test_a_wrong_update_is_caught_when_the_last_batch_reads_no_updated_row():
    inputs = make_inputs(SPARSE_CASE, 2, torch.device("cpu"), seed=0)
    first, last = (set(sf.values.tolist()) for sf in inputs.batches)
    assert not first & last  # the premise: forward on the last batch alone cannot see the update
    factories = {"per_table": per_table_candidate, "reference": packed_candidate("reference", seed=0)}
    with pytest.raises(CandidateMismatchError, match="'wrong' forward after one train step"):
        run_embedding_bench(
            [SPARSE_CASE], "cpu", repeats=1, warmup=0, num_batches=2, factories=factories,
            extra_candidates={"wrong": _double_lr},
        )  # fmt: skip
