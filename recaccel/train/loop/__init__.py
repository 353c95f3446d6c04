"""The training loop: the Trainer, one step (micro-batches, overlap, the batch pipeline),
the schedule, the step observers, the process layout it runs under (``Parallelism``) and
graceful stops."""

__all__ = [
    "data_wait",
    "finish",
    "observers",
    "overlap",
    "parallel",
    "parts",
    "pipeline",
    "preemption",
    "schedule",
    "setup",
    "step",
    "trainer",
]
