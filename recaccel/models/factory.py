"""Builds models from typed configs and a dataset's feature schema."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from recaccel.config import EmbeddingPlacement, InteractionBackend, ModelConfig, OptimConfig
from recaccel.errors import ConfigError
from recaccel.models.arches import DCNv2InteractionArch, DenseArch, InteractionArch, OverArch, SparseArch
from recaccel.models.dlrm import DLRM
from recaccel.models.embedding import field_embedding
from recaccel.models.table_memory import check_table_memory
from recaccel.ops.backend import op_backends, resolve_backend

if TYPE_CHECKING:  # only read by attribute: models do not depend on io at run time
    from recaccel.io.format.schema import FeatureSchema


def build_embedding(
    model_cfg: ModelConfig, optim_cfg: OptimConfig, schema: FeatureSchema, device: torch.device
) -> nn.Module:
    """The module behind SparseArch: packed (fused sparse optimizer) or per-table."""
    from recaccel.ops.embedding import SparseOptimConfig

    placement = table_placement(model_cfg, schema)
    # Refused before anything is allocated; 16-bit rows take half the bytes. Host tables
    # are checked against host memory by the module, their device caches are small.
    row_bytes = 4 if model_cfg.embedding_dtype == "fp32" else 2
    device_fields = tuple(f for f in schema.sparse if placement[f.name] == "device")
    if device_fields:
        on_device = dataclasses.replace(schema, sparse=device_fields)
        check_table_memory(on_device, model_cfg.embedding_dim, device, bytes_per_value=row_bytes)
    optim = SparseOptimConfig.from_config(optim_cfg)
    return field_embedding(
        list(schema.sparse),
        model_cfg.embedding_dim,
        backend=model_cfg.embedding_backend,
        pooling=model_cfg.pooling,
        optimizer=optim_cfg.sparse,
        optim=optim,
        device=device,
        dtype=model_cfg.embedding_dtype,
        placement=placement,
        cache=cache_options(model_cfg),
    )


def places_tables_on_host(model_cfg: ModelConfig) -> bool:
    """Whether ``model.embedding_placement`` or a ``model.table_placement`` entry puts a
    table in host memory (behind the device cache)."""
    return model_cfg.embedding_placement == "host" or any(
        e.endswith("=host") for e in model_cfg.table_placement
    )


def table_placement(model_cfg: ModelConfig, schema: FeatureSchema) -> dict[str, EmbeddingPlacement]:
    """Where each field's table lives: ``model.embedding_placement``, overridden per table
    by ``model.table_placement`` entries ``table=host|device``.

    Raises:
        ConfigError: an override names no field of the schema.
    """
    placement = {f.name: model_cfg.embedding_placement for f in schema.sparse}
    for entry in model_cfg.table_placement:
        name, _, where = entry.partition("=")
        if name not in placement:
            raise ConfigError(
                f"config key model.table_placement names table {name!r}, which the data does not have; "
                f"its tables: {sorted(placement)}"
            )
        placement[name] = where
    return placement


def cache_options(model_cfg: ModelConfig):
    """The device cache of host tables from ``model.cache_*``.

    The window (batches whose rows stay locked) is ``cache_lookahead`` plus one: the
    pipeline prepares ``cache_lookahead - 1`` batches ahead of the one handed out (at least
    one under ``semi_sync``), so the batches prepared and not yet trained are at most that
    many plus the one being prepared. The cache's copies wait for every queued use of
    the cache, so a slot the running step still reads is never overwritten early.
    """
    from recaccel.ops.embedding.cache import CacheOptions

    return CacheOptions(
        fraction=model_cfg.cache_fraction,
        rows=model_cfg.cache_rows,
        policy=model_cfg.cache_policy,
        window=model_cfg.cache_lookahead + 1,
    )


def build_model(
    model_cfg: ModelConfig, optim_cfg: OptimConfig, schema: FeatureSchema, device: torch.device
) -> DLRM:
    """A DLRM (or MeLU) for ``schema``'s fields.

    Raises:
        ConfigError: on an unknown arch or inconsistent layer sizes, or a config naming a
            model of one's own (``model.class_path``: training and evaluation build it).
    """
    if model_cfg.class_path:
        raise ConfigError(
            f"config key model.class_path={model_cfg.class_path} names a model of your own, which "
            "training and evaluation build; this command builds recaccel's DLRM and MeLU only"
        )
    if not model_cfg.top_mlp or model_cfg.top_mlp[-1] != 1:
        raise ConfigError(
            f"model.top_mlp must end in 1 unit (the top MLP outputs a logit), got {model_cfg.top_mlp}"
        )
    if model_cfg.arch == "melu":
        return build_melu(model_cfg, optim_cfg, schema, device)
    dim = model_cfg.embedding_dim
    if not model_cfg.bottom_mlp or model_cfg.bottom_mlp[-1] != dim:
        raise ConfigError(
            f"model.bottom_mlp must end in model.embedding_dim={dim} units, got {model_cfg.bottom_mlp}"
        )
    interaction = build_interaction(model_cfg, schema.num_sparse, device)
    return DLRM(
        # The interaction arches cast the pooled embeddings to the autocast dtype: the lookup
        # may write them in it.
        sparse_arch=SparseArch(build_embedding(model_cfg, optim_cfg, schema, device), autocast_output=True),
        dense_arch=DenseArch(schema.num_dense, model_cfg.bottom_mlp),
        interaction_arch=interaction,
        over_arch=OverArch(
            interaction.output_dim, model_cfg.top_mlp, padded_input=getattr(interaction, "pad", False)
        ),
    ).to(device)


def build_interaction(
    model_cfg: ModelConfig, num_sparse: int, device: torch.device | str = "cpu"
) -> InteractionArch | DCNv2InteractionArch:
    """The interaction arch ``model.interaction`` names, for F = ``num_sparse`` fields on ``device``.

    Raises:
        ConfigError: an unknown interaction.
    """
    dim, backend = model_cfg.embedding_dim, model_cfg.interaction_backend
    if model_cfg.interaction == "dot":
        return InteractionArch(num_sparse, dim, backend=backend, pad=interaction_pads(model_cfg, device))
    if model_cfg.interaction == "dcnv2":
        return DCNv2InteractionArch(
            num_sparse,
            dim,
            model_cfg.dcn_layers,
            model_cfg.dcn_rank,
            backend=backend,
            kernel=model_cfg.dcn_kernel,
        )
    raise ConfigError(f"model.interaction must be 'dot' or 'dcnv2', got {model_cfg.interaction!r}")


def interaction_pads(model_cfg: ModelConfig, device: torch.device | str) -> bool:
    """Whether the dot interaction pads its output row to a multiple of 8 elements
    (``model.interaction_pad``; ``auto``: where the Triton kernel runs on CUDA, which
    writes the padding in the same pass, so the top MLP's first GEMM reads aligned rows
    at no extra copy; elsewhere padding would only add one)."""
    if model_cfg.interaction_pad != "auto":
        return model_cfg.interaction_pad == "on"
    device = torch.device(device)
    if device.type != "cuda":
        return False
    available = op_backends(InteractionBackend)
    return (
        resolve_backend(model_cfg.interaction_backend, device, available=available, op="dot_interaction")
        == "triton"
    )


def build_melu(
    model_cfg: ModelConfig, optim_cfg: OptimConfig, schema: FeatureSchema, device: torch.device
) -> DLRM:
    """MeLU: ``model.item_fields`` are the item attributes, the other fields the user's.

    The rating MLP has ``model.top_mlp`` layers (MeLU: [64, 64, 1]).
    """
    from recaccel.models.melu import MeLU, MeLUConfig

    names = schema.sparse_names
    unknown = sorted(set(model_cfg.item_fields) - set(names))
    if not model_cfg.item_fields or unknown:
        raise ConfigError(
            f"model.item_fields must name item fields of the data ({names}); got {model_cfg.item_fields}"
        )
    items = [f for f in schema.sparse if f.name in model_cfg.item_fields]
    users = [f for f in schema.sparse if f.name not in model_cfg.item_fields]
    if names != [f.name for f in items + users]:
        raise ConfigError(f"MeLU needs the item fields first in the data's field order; the data has {names}")
    cfg = MeLUConfig(
        item_fields=items,
        user_fields=users,
        embedding_dim=model_cfg.embedding_dim,
        hidden=model_cfg.top_mlp[:-1],
        num_dense=schema.num_dense,
        pooling=model_cfg.pooling,
    )
    return MeLU(cfg, embedding=build_embedding(model_cfg, optim_cfg, schema, device)).to(device)
