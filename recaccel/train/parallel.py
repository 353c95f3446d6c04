"""How a run is spread over processes. Single-process here; hybrid in recaccel.train.hybrid."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn


class Parallelism(Protocol):
    """The process layout a Trainer runs under."""

    rank: int
    world_size: int

    @property
    def is_main(self) -> bool: ...

    def wrap(self, module: nn.Module) -> nn.Module: ...

    def gather(self, tensor: Tensor) -> Tensor: ...

    def close(self) -> None: ...


class SingleProcess:
    """One process, one device: wrapping and gathering are identities."""

    rank = 0
    world_size = 1

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @property
    def is_main(self) -> bool:
        return True

    def wrap(self, module: nn.Module) -> nn.Module:
        return module

    def gather(self, tensor: Tensor) -> Tensor:
        """Concatenates a per-rank [N, ...] tensor over ranks (here: itself)."""
        return tensor

    def close(self) -> None:
        pass
