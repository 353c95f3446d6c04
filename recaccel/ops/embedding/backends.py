"""Which pack backend a :class:`~recaccel.ops.embedding.module.PackedEmbeddingBag` runs,
and its packs built on it: the module's backend dispatch, chosen once at construction.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from recaccel.errors import ConfigError
from recaccel.ops.backend import BACKENDS, resolve_backend
from recaccel.ops.embedding.cache.options import CacheOptions
from recaccel.ops.embedding.cache.pack import CachedPack
from recaccel.ops.embedding.fbgemm import FbgemmPack, fbgemm_unsupported
from recaccel.ops.embedding.pack_backend import PackBackend, PackOptions
from recaccel.ops.embedding.packing import PackingPlan
from recaccel.ops.embedding.reference import ReferencePack
from recaccel.ops.embedding.specs import SparseOptimConfig, TableSpec

logger = logging.getLogger(__name__)

_OP = "PackedEmbeddingBag"


def choose_backend(
    backend: str,
    device: torch.device,
    tables: list[TableSpec],
    mode: str,
    optim: SparseOptimConfig,
    dtype: str = "fp32",
) -> str:
    """Resolves ``backend`` for these tables on ``device``.

    ``auto`` picks triton on CUDA and reference on CPU (see :mod:`recaccel.ops.backend`
    for why not fbgemm there); ``fbgemm`` runs when ``fbgemm_gpu`` imports and supports
    the tables, mode, optimizer settings and row dtype on ``device``.

    Raises:
        ConfigError: ``fbgemm`` asked for explicitly with an option it does not support.
        ValueError, RuntimeError: see :func:`recaccel.ops.backend.resolve_backend`.
    """
    name = resolve_backend(backend, device, available=BACKENDS, op=_OP)
    if name != "fbgemm":
        return name
    reason = fbgemm_unsupported(tables, mode, optim, dtype, device)
    if reason is None:
        try:
            import fbgemm_gpu.split_table_batched_embeddings_ops_training  # noqa: F401
        except (ImportError, OSError) as e:
            reason = f"an fbgemm_gpu that does not import ({e})"
    if reason is None:
        return name
    if backend == "fbgemm":
        raise ConfigError(f"{_OP}: backend='fbgemm' with dtype={dtype!r} does not support {reason}")
    logger.info("%s: backend auto -> reference (fbgemm does not support %s)", _OP, reason)
    return "reference"


def pack_backend_class(backend: str) -> type[PackBackend]:
    """The pack class of a resolved backend (Triton's imported only when chosen)."""
    if backend == "triton":
        from recaccel.ops.embedding.triton import TritonPack

        return TritonPack
    return {"reference": ReferencePack, "fbgemm": FbgemmPack}[backend]


def build_packs(
    plan: PackingPlan,
    init: dict[str, Tensor],
    options: PackOptions,
    device: torch.device,
    pack_class: type[PackBackend],
    cache: CacheOptions,
) -> list[tuple[PackBackend, dict[str, Tensor]]]:
    """Each pack of ``plan`` on its backend (host-placed ones behind a device cache), with
    the tensors the module holds for it (registered as ``<name>_<pack>``).

    Args:
        plan: The packing plan.
        init: Initial rows of each table, by table name.
        options: The packs' settings.
        device: Where the rows (or a host-placed pack's cache) live.
        pack_class: The backend's pack class (:func:`pack_backend_class`).
        cache: The device caches' settings.
    """
    built = []
    for layout in plan.packs:
        weights = [init[t.name] for t in layout.tables]
        if layout.placement == "host":
            built.append(
                CachedPack.create(layout, weights, options, device, inner_class=pack_class, cache=cache)
            )
        else:
            built.append(pack_class.create(layout, weights, options, device))
    return built
