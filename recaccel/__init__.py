"""recaccel: fast training of DLRM and meta-learning DLRM on GPUs.

The public API: :func:`train`, :func:`launch` (N processes), :func:`resume`,
:func:`evaluate`, :func:`load_config`, the config classes and the errors a caller
catches. Importing it does not import torch (checked by ``tests/test_layout.py``).
"""

from recaccel import train  # the package, callable as recaccel.api.train (see its __init__)
from recaccel.api import evaluate, launch, resume
from recaccel.config import (
    Config,
    DataConfig,
    MetaConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    SynthConfig,
    TasksConfig,
    TrainConfig,
    load_config,
)
from recaccel.errors import ConfigError, DataError, RecaccelError
from recaccel.reproducible import pin_cpu_matmul_path

# Importing recaccel imports no torch, so this comes before MKL's first call: see recaccel.reproducible.
pin_cpu_matmul_path()

__version__ = "0.1.0"

__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "DataError",
    "MetaConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RecaccelError",
    "SynthConfig",
    "TasksConfig",
    "TrainConfig",
    "evaluate",
    "launch",
    "load_config",
    "resume",
    "train",
]
