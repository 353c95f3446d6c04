"""A trained DLRM as a state dict of TorchRec's ``torchrec.models.dlrm.DLRM`` (or
``DLRM_DCN`` for ``model.interaction = "dcnv2"``), plus the constructor arguments to
rebuild that model.

The arches line up one to one, so the export renames and never recomputes:

==========================================  ==================================================
recaccel                                    TorchRec
==========================================  ==================================================
``sparse_arch.embedding.<t>.weight``        ``sparse_arch.embedding_bag_collection.embedding_bags.<t>.weight``
``dense_arch.model.<2i>`` (Linear, ReLU)    ``dense_arch.model._mlp.<i>._linear``
``over_arch.model.<2i>``, i < last          ``over_arch.model.0._mlp.<i>._linear``
``over_arch.model.<2*last>`` (logit)        ``over_arch.model.1``
``interaction_arch.u[l]`` [K, r]            ``inter_arch.crossnet.W_kernels.<l>``
``interaction_arch.v[l]`` [r, K]            ``inter_arch.crossnet.V_kernels.<l>``
``interaction_arch.b[l]`` [K]               ``inter_arch.crossnet.bias.<l>``
==========================================  ==================================================

The dot interaction needs no permutation: both take the strict upper triangle of the
[F+1, F+1] Gram matrix of [dense vector, field 1, ..., field F] row-major
(``torch.triu_indices(F+1, F+1, 1)``) after the dense vector, so the top MLP's input
columns mean the same thing; TorchRec orders its fields by table, and the export lists
one table per field in the model's field order. DCN-v2 computes
``x0 * (W (V x) + b) + x`` in both.

TorchRec's DLRM returns logits [B, 1]; recaccel's [B].

Shapes: B batch, F sparse fields, D embedding dim, K = (F+1)D, r DCN rank.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from recaccel.errors import ConfigError
from recaccel.export.load import LoadedRun, check_arch

FORMAT = "torchrec"
ARCHES = ("dlrm", "dlrm_dcn")


def torchrec_spec(loaded: LoadedRun) -> dict[str, Any]:
    """The TorchRec constructor arguments of ``loaded``'s model (JSON-ready).

    Raises:
        ConfigError: a model TorchRec's DLRM cannot express (MeLU, no dense features, a
            one-layer top MLP).
    """
    check_arch(loaded, ARCHES, FORMAT)
    cfg = loaded.cfg.model
    if loaded.num_dense == 0:
        raise ConfigError(
            "--format torchrec: the data has no dense features (the bottom MLP is a learned constant), "
            "which TorchRec's DLRM cannot express (its DenseArch needs dense_in_features >= 1); "
            "use --format torch_export"
        )
    if len(cfg.top_mlp) < 2:
        raise ConfigError(
            f"--format torchrec: model.top_mlp={cfg.top_mlp} has one layer; TorchRec's OverArch needs at least "
            "two (hidden layers, then the logit); use --format torch_export"
        )
    spec: dict[str, Any] = {
        "format": FORMAT,
        "class": "torchrec.models.dlrm." + ("DLRM_DCN" if loaded.arch == "dlrm_dcn" else "DLRM"),
        "tables": [
            {
                "name": name,
                "num_embeddings": rows,
                "embedding_dim": cfg.embedding_dim,
                "feature_names": [name],
                "pooling": cfg.pooling.upper(),
            }
            for name, rows in loaded.fields
        ],
        "dense_in_features": loaded.num_dense,
        "dense_arch_layer_sizes": list(cfg.bottom_mlp),
        "over_arch_layer_sizes": list(cfg.top_mlp),
    }
    if loaded.arch == "dlrm_dcn":
        spec["dcn_num_layers"] = cfg.dcn_layers
        spec["dcn_low_rank_dim"] = cfg.dcn_rank
    spec["output"] = (
        "logit [B, 1]: apply sigmoid for a click probability"
        if loaded.label_kind == "binary"
        else ("rating [B, 1]")
    )
    spec["source"] = {
        "run_dir": str(loaded.cfg.train.out_dir),
        "checkpoint": str(loaded.checkpoint),
        "step": loaded.step,
    }
    return spec


def torchrec_state_dict(loaded: LoadedRun) -> dict[str, Tensor]:
    """``loaded``'s parameters under TorchRec's names (float32, CPU, contiguous).

    Raises:
        ConfigError: as :func:`torchrec_spec`.
    """
    torchrec_spec(loaded)  # the same refusals
    model = loaded.model
    out: dict[str, Tensor] = {}
    for name, weight in loaded.table_weights().items():
        out[f"sparse_arch.embedding_bag_collection.embedding_bags.{name}.weight"] = weight
    for i, linear in enumerate(_linears(model.dense_arch.model)):
        _put_linear(out, f"dense_arch.model._mlp.{i}._linear", linear)
    over = _linears(model.over_arch.model)
    for i, linear in enumerate(over[:-1]):
        _put_linear(out, f"over_arch.model.0._mlp.{i}._linear", linear)
    _put_linear(out, "over_arch.model.1", over[-1])
    if loaded.arch == "dlrm_dcn":
        inter = model.interaction_arch
        for layer in range(inter.u.shape[0]):
            out[f"inter_arch.crossnet.W_kernels.{layer}"] = _plain(inter.u[layer])
            out[f"inter_arch.crossnet.V_kernels.{layer}"] = _plain(inter.v[layer])
            out[f"inter_arch.crossnet.bias.{layer}"] = _plain(inter.b[layer])
    return out


def build_torchrec_model(spec: dict[str, Any]) -> nn.Module:
    """TorchRec's DLRM (or DLRM_DCN) as ``spec`` (from :func:`torchrec_spec`, or the JSON
    written beside an exported state dict) describes it, freshly initialized on the CPU.

    Raises:
        ModuleNotFoundError: TorchRec is not installed.
    """
    from torchrec.models.dlrm import DLRM, DLRM_DCN
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    tables = [
        EmbeddingBagConfig(
            name=t["name"],
            num_embeddings=t["num_embeddings"],
            embedding_dim=t["embedding_dim"],
            feature_names=list(t["feature_names"]),
            pooling=PoolingType[t["pooling"]],
        )
        for t in spec["tables"]
    ]
    args = {
        "embedding_bag_collection": EmbeddingBagCollection(tables=tables),
        "dense_in_features": spec["dense_in_features"],
        "dense_arch_layer_sizes": spec["dense_arch_layer_sizes"],
        "over_arch_layer_sizes": spec["over_arch_layer_sizes"],
    }
    if spec["class"].endswith("DLRM_DCN"):
        return DLRM_DCN(
            **args, dcn_num_layers=spec["dcn_num_layers"], dcn_low_rank_dim=spec["dcn_low_rank_dim"]
        )
    return DLRM(**args)


def _linears(seq: nn.Sequential) -> list[nn.Linear]:
    return [m for m in seq if isinstance(m, nn.Linear)]


def _put_linear(out: dict[str, Tensor], prefix: str, linear: nn.Linear) -> None:
    out[f"{prefix}.weight"] = _plain(linear.weight)
    out[f"{prefix}.bias"] = _plain(linear.bias)


def _plain(t: Tensor) -> Tensor:
    return t.detach().float().cpu().contiguous().clone()
