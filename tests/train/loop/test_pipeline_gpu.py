"""The batch pipeline and step runners on CUDA (``pytest -m gpu``; skipped without a GPU).

The side stream must be waited on before a prepared batch is used, and the pipelined
steps must train what the plain step trains.
"""

from __future__ import annotations

import pytest
import torch

from recaccel.config import TrainConfig
from recaccel.train.loop.parallel import SingleProcess
from recaccel.train.loop.pipeline import BatchPipeline
from tests.helpers.step_parts import random_batch, tiny_objective

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_a_prepared_batch_is_used_only_after_its_side_stream_work():
    device = torch.device("cuda")

    def slow_prepare(batch: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(50_000_000)  # ~tens of ms on the side stream before the write
        out = torch.empty_like(batch)
        out.copy_(batch + 1)
        return out

    source = [(torch.full((1 << 16,), float(i), device=device), {"i": i}) for i in range(3)]
    torch.cuda.synchronize()
    for item in BatchPipeline(slow_prepare, device, "sync")(source):
        # Read on the consumer stream at once: without the wait it would see garbage.
        assert torch.all(item.batch == item.reader_state["i"] + 1).item()


def _run(mode: str, micro_batches: int = 1, steps: int = 4) -> tuple[dict, list[float]]:
    objective = tiny_objective(backend="triton", sparse_optim="rowwise_adagrad", device="cuda")
    train = TrainConfig(pipeline=mode, micro_batches=micro_batches)
    optimizer = torch.optim.Adam(objective.module.parameters(), lr=0.01)
    source = [(random_batch(64, s).to("cuda"), {"s": s}) for s in range(steps)]
    layout = SingleProcess(torch.device("cuda"))
    losses = [float(done.loss) for done in layout.steps(source, objective, optimizer, train)]
    return {k: v.detach().cpu().clone() for k, v in objective.module.state_dict().items()}, losses


def test_sync_pipeline_on_cuda_trains_what_off_trains():
    off, off_losses = _run("off")
    sync, sync_losses = _run("sync")
    assert sync_losses == off_losses
    for key in off:
        torch.testing.assert_close(sync[key], off[key], rtol=0, atol=0, msg=key)


def test_micro_batches_on_cuda_give_the_one_batch_step():
    one, one_losses = _run("off")
    many, many_losses = _run("sync", micro_batches=4)
    torch.testing.assert_close(torch.tensor(many_losses), torch.tensor(one_losses), rtol=1e-5, atol=1e-6)
    for key in one:
        torch.testing.assert_close(many[key], one[key], rtol=1e-4, atol=1e-5, msg=key)


def test_semi_sync_on_cuda_trains_with_finite_losses():
    _, losses = _run("semi_sync", steps=6)
    assert all(torch.isfinite(torch.tensor(losses)))
