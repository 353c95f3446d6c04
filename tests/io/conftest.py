"""Fixtures shared by the reader worker tests: a small row dataset and a task dataset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.helpers.row_data import small_dataset
from tests.helpers.task_data import write_tasks


@pytest.fixture(scope="module")
def worker_rows_data(tmp_path_factory) -> Path:
    """300 rows in row groups of 25, files of 120 rows."""
    path = tmp_path_factory.mktemp("rows")
    small_dataset(path, n=300, rg=25, per_file=120)
    return path


@pytest.fixture(scope="module")
def worker_task_data(tmp_path_factory) -> Path:
    """40 tasks of 2-13 rows in task-aligned row groups of up to 16 rows."""
    path = tmp_path_factory.mktemp("tasks")
    write_tasks(path, [int(n) for n in np.random.default_rng(5).integers(2, 14, 40)], rg=16)
    return path
