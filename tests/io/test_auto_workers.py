"""``data.workers = "auto"`` (the default): a count chosen from the device and the cores."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from recaccel.config import load_config
from recaccel.errors import ConfigError
from recaccel.io.readers.options import MAX_AUTO_WORKERS, MIN_AUTO_BUFFERS, auto_workers
from recaccel.train.loop.setup import with_reader_workers


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def test_a_number_is_kept_and_auto_reads_in_process_on_a_cpu_device():
    assert auto_workers(3, "cpu") == 3 and auto_workers(0, "cuda") == 0
    assert auto_workers("auto", "cpu") == 0


def test_auto_on_a_gpu_takes_half_the_cores_shared_by_the_hosts_ranks_at_most_eight():
    assert auto_workers("auto", "cuda") == min(MAX_AUTO_WORKERS, _cores() // 2)
    assert auto_workers("auto", "cuda", local_ranks=4) == min(MAX_AUTO_WORKERS, _cores() // 8)
    assert auto_workers("auto", "cuda", local_ranks=10_000) == 0


def test_auto_reads_in_process_when_an_epoch_is_a_few_shuffle_buffers():
    assert auto_workers("auto", "cuda", buffers=MIN_AUTO_BUFFERS - 1) == 0
    assert auto_workers("auto", "cuda", buffers=MIN_AUTO_BUFFERS) == auto_workers("auto", "cuda")
    cfg = load_config(None, ["data.shuffle_buffer_rows=1000"])
    assert with_reader_workers(cfg, torch.device("cuda"), rows=3000).data.workers == 0
    assert with_reader_workers(cfg, torch.device("cuda"), rows=4000).data.workers == auto_workers(
        "auto", "cuda"
    )


def _auto_in_child(queue) -> None:
    queue.put(auto_workers("auto", "cuda"))


def test_auto_is_zero_inside_a_daemonic_process_which_cannot_start_workers():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_auto_in_child, args=(queue,), daemon=True)
    child.start()
    try:
        assert queue.get(timeout=60) == 0
    finally:
        child.join(10)


def test_the_config_defaults_to_auto_and_names_the_choices_for_a_wrong_word():
    assert load_config(None, []).data.workers == "auto"
    assert load_config(None, ["data.workers=3"]).data.workers == 3
    with pytest.raises(ConfigError, match=r"data.workers=many must be one of auto"):
        load_config(None, ['data.workers="many"'])
    with pytest.raises(ConfigError, match=r"data.workers=-1 must be >= 0"):
        load_config(None, ["data.workers=-1"])


def test_the_trainer_config_records_the_resolved_count():
    cfg = load_config(None, [])
    assert with_reader_workers(cfg, torch.device("cpu")).data.workers == 0
    kept = load_config(None, ["data.workers=2"])
    assert with_reader_workers(kept, torch.device("cpu")) is kept
