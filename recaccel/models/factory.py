"""Builds models from typed configs and a dataset's feature schema."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from recaccel.config import ModelConfig, OptimConfig
from recaccel.errors import ConfigError
from recaccel.models.arches import DCNv2InteractionArch, DenseArch, InteractionArch, OverArch, SparseArch
from recaccel.models.dlrm import DLRM
from recaccel.models.embedding import field_embedding
from recaccel.models.table_memory import check_table_memory

if TYPE_CHECKING:  # only read by attribute: models do not depend on io at run time
    from recaccel.io.format.schema import FeatureSchema


def build_embedding(
    model_cfg: ModelConfig, optim_cfg: OptimConfig, schema: FeatureSchema, device: torch.device
) -> nn.Module:
    """The module behind SparseArch: packed (fused sparse optimizer) or per-table."""
    from recaccel.ops.embedding import SparseOptimConfig

    # Refused before anything is allocated; 16-bit rows take half the bytes.
    row_bytes = 4 if model_cfg.embedding_dtype == "fp32" else 2
    check_table_memory(schema, model_cfg.embedding_dim, device, bytes_per_value=row_bytes)
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
    )


def build_model(
    model_cfg: ModelConfig, optim_cfg: OptimConfig, schema: FeatureSchema, device: torch.device
) -> DLRM:
    """A DLRM (or MeLU) for ``schema``'s fields.

    Raises:
        ConfigError: on an unknown arch or inconsistent layer sizes.
    """
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
    interaction = build_interaction(model_cfg, schema.num_sparse)
    return DLRM(
        sparse_arch=SparseArch(build_embedding(model_cfg, optim_cfg, schema, device)),
        dense_arch=DenseArch(schema.num_dense, model_cfg.bottom_mlp),
        interaction_arch=interaction,
        over_arch=OverArch(interaction.output_dim, model_cfg.top_mlp),
    ).to(device)


def build_interaction(model_cfg: ModelConfig, num_sparse: int) -> InteractionArch | DCNv2InteractionArch:
    """The interaction arch ``model.interaction`` names, for F = ``num_sparse`` fields.

    Raises:
        ConfigError: an unknown interaction.
    """
    dim, backend = model_cfg.embedding_dim, model_cfg.interaction_backend
    if model_cfg.interaction == "dot":
        return InteractionArch(num_sparse, dim, backend=backend)
    if model_cfg.interaction == "dcnv2":
        return DCNv2InteractionArch(
            num_sparse, dim, model_cfg.dcn_layers, model_cfg.dcn_rank, backend=backend
        )
    raise ConfigError(f"model.interaction must be 'dot' or 'dcnv2', got {model_cfg.interaction!r}")


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
