"""recaccel: fast training of DLRM and meta-learning DLRM on GPUs."""

from recaccel.api import evaluate, resume, train
from recaccel.config import (
    Config,
    DataConfig,
    ModelConfig,
    OptimConfig,
    SynthConfig,
    TrainConfig,
    load_config,
)
from recaccel.errors import ConfigError, DataError, RecaccelError

__version__ = "0.1.0"

__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "DataError",
    "ModelConfig",
    "OptimConfig",
    "RecaccelError",
    "SynthConfig",
    "TrainConfig",
    "evaluate",
    "load_config",
    "resume",
    "train",
]
