"""The hand-written DLRM ``recaccel-bench train`` compares recaccel with.

What a PyTorch user writes today, as TorchRec's unsharded ``EmbeddingBagCollection`` and
``InteractionArch`` do it: one ``nn.EmbeddingBag`` per table (sum pooling, sparse
gradients) looked up in a loop after splitting the batch's ids by field (one host read
of the field boundaries per batch, as ``KeyedJaggedTensor.to_dict`` does), the dot
interaction as ``bmm`` plus a gather of the upper triangle (or, for a DCN-v2 model, TorchRec's
``LowRankCrossNet`` loop: two ``F.linear`` and a multiply-add per layer), the same MLPs as
recaccel's arches, a torch optimizer for the tables and another for the MLPs.

:func:`check_same_function` proves, before anything is timed, that this model computes
recaccel's function: with recaccel's weights copied in, its logits equal recaccel's.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from recaccel.config import ModelConfig, OptimConfig, SparseOptimizer
from recaccel.errors import ConfigError, RecaccelError
from recaccel.ops.interaction import init_cross_weights
from recaccel.sparse import Batch, SparseFeatures

# recaccel's fused sparse optimizer -> the closest torch optimizer that takes sparse
# gradients (torch has no row-wise Adagrad: its Adagrad keeps one accumulator per element).
EAGER_SPARSE_OPTIMIZERS: dict[SparseOptimizer, str] = {
    "sgd": "torch.optim.SGD",
    "rowwise_adagrad": "torch.optim.Adagrad (element-wise; torch has no row-wise Adagrad)",
    "adam": "torch.optim.SparseAdam",
}


def _mlp(in_features: int, sizes: list[int], *, final_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, out in enumerate(sizes):
        layers.append(nn.Linear(in_features, out))
        if final_relu or i < len(sizes) - 1:
            layers.append(nn.ReLU())
        in_features = out
    return nn.Sequential(*layers)


def cross_shape(model: ModelConfig) -> tuple[int, int] | None:
    """(layers, rank) of a DCN-v2 model's cross network; None for the dot interaction."""
    return (model.dcn_layers, model.dcn_rank) if model.interaction == "dcnv2" else None


class EagerHead(nn.Module):
    """Bottom MLP, interaction (bmm + gather dot, or the DCN-v2 cross layers), top MLP: the
    model's dense part.

    Args:
        num_dense: Dd.
        num_sparse: F.
        bottom: bottom MLP sizes, ending in D.
        top: top MLP sizes, ending in 1.
        cross: (layers, rank) of a DCN-v2 cross network over [dense, pooled] (K = D*(F+1));
            None = the dot interaction.
    """

    def __init__(
        self,
        num_dense: int,
        num_sparse: int,
        bottom: list[int],
        top: list[int],
        cross: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        dim = bottom[-1]
        rows = num_sparse + 1
        self.cross = cross
        self.bottom = _mlp(num_dense, bottom, final_relu=True)
        width = dim + rows * (rows - 1) // 2
        if cross is not None:
            width = dim * rows
            u, v, b = init_cross_weights(width, *cross)
            self.u, self.v, self.b = nn.Parameter(u), nn.Parameter(v), nn.Parameter(b)
        self.top = _mlp(width, top, final_relu=False)
        pairs = torch.triu_indices(rows, rows, offset=1)  # (0,1), (0,2), ..., (F-1,F)
        self.register_buffer("pair_i", pairs[0], persistent=False)
        self.register_buffer("pair_j", pairs[1], persistent=False)

    def interact(self, dense: Tensor, pooled: Tensor) -> Tensor:
        """[B, D] and [B, F, D] -> [B, D + (F+1)F/2]: the dense vector, then every pair's dot
        product (DCN-v2: -> x_L [B, D*(F+1)])."""
        if self.cross is not None:
            x0 = torch.cat([dense, pooled.flatten(1)], dim=1)
            x = x0
            for layer in range(self.u.shape[0]):
                x = (
                    x0
                    * nn.functional.linear(
                        nn.functional.linear(x, self.v[layer]), self.u[layer], self.b[layer]
                    )
                    + x
                )
            return x
        x = torch.cat([dense.unsqueeze(1), pooled], dim=1)  # [B, F+1, D]
        gram = torch.bmm(x, x.transpose(1, 2))  # [B, F+1, F+1]
        return torch.cat([dense, gram[:, self.pair_i, self.pair_j]], dim=1)

    def forward(self, dense: Tensor, pooled: Tensor) -> Tensor:
        """Logits [B] from dense features [B, Dd] and pooled embeddings [B, F, D]."""
        return self.top(self.interact(self.bottom(dense), pooled)).squeeze(-1)


class EagerDLRM(nn.Module):
    """The hand-written DLRM: per-table bags and :class:`EagerHead`.

    Args:
        features: the F field names, in the model's order.
        cardinalities: rows of each field's table.
        num_dense: Dd (>= 1).
        bottom: bottom MLP sizes, ending in the embedding dim D.
        top: top MLP sizes, ending in 1.
        device: where the model lives.
        cross: (layers, rank) of a DCN-v2 interaction (:func:`cross_shape`); None = dot.
    """

    def __init__(
        self,
        features: list[str],
        cardinalities: list[int],
        num_dense: int,
        bottom: list[int],
        top: list[int],
        device: torch.device | str | None = None,
        cross: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        if num_dense < 1:
            raise ConfigError("train bench: the eager baseline needs dense features (num_dense >= 1)")
        self.features = list(features)
        dim = bottom[-1]
        self.bags = nn.ModuleList(
            nn.EmbeddingBag(n, dim, mode="sum", sparse=True, device=device) for n in cardinalities
        )
        with torch.no_grad():
            for bag, n in zip(self.bags, cardinalities):
                bag.weight.uniform_(-(n**-0.5), n**-0.5)  # recaccel's initial range
        self.head = EagerHead(num_dense, len(features), bottom, top, cross).to(device)

    def embed(self, sparse: SparseFeatures) -> Tensor:
        """Pooled embeddings [B, F, D], one ``nn.EmbeddingBag`` call per field."""
        sparse = sparse.reorder(self.features)
        b = sparse.batch_size
        # Field f's ids are values[bounds[f]:bounds[f+1]]: one host read for all fields.
        bounds = sparse.offsets[::b].tolist() if b > 0 else [0] * (len(self.features) + 1)
        pooled = []
        for f, bag in enumerate(self.bags):
            values = sparse.values[bounds[f] : bounds[f + 1]]
            offsets = sparse.offsets[f * b : (f + 1) * b] - bounds[f]
            pooled.append(bag(values, offsets))
        return torch.stack(pooled, dim=1)

    def forward(self, batch: Batch) -> Tensor:
        """Logits [B]."""
        return self.head(batch.dense, self.embed(batch.sparse))

    def embedding_parameters(self) -> list[nn.Parameter]:
        return [bag.weight for bag in self.bags]

    @torch.no_grad()
    def copy_from(self, model: nn.Module) -> None:
        """Takes a recaccel DLRM's weights (tables by field name, MLP layers in order).

        Raises:
            RuntimeError: the MLPs' layers differ (a different function).
        """
        tables = model.sparse_arch.embedding
        for name, bag in zip(self.features, self.bags):
            bag.weight.copy_(tables.table_state(name)["weight"])
        self.head.bottom.load_state_dict(model.dense_arch.model.state_dict())
        self.head.top.load_state_dict(model.over_arch.model.state_dict())
        if self.head.cross is not None:
            for name in ("u", "v", "b"):
                getattr(self.head, name).copy_(getattr(model.interaction_arch, name))


def sparse_optimizer(params: list[nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    """The torch optimizer of the tables' sparse gradients closest to ``cfg.sparse``
    (:data:`EAGER_SPARSE_OPTIMIZERS`), at ``cfg.sparse_lr``."""
    if cfg.sparse == "sgd":
        return torch.optim.SGD(params, lr=cfg.sparse_lr)
    if cfg.sparse == "adam":
        return torch.optim.SparseAdam(params, lr=cfg.sparse_lr, eps=cfg.eps)
    return torch.optim.Adagrad(params, lr=cfg.sparse_lr, eps=cfg.eps)


def same_logits(mine: Tensor, theirs: Tensor, failure: str, rtol: float = 1e-4, atol: float = 1e-5) -> float:
    """The largest ``|mine - theirs|``, once every logit is within ``atol + rtol * |theirs|``
    (fp32 tolerance) and finite.

    Raises:
        RecaccelError: ``failure``, then how far the logits are apart.
    """
    diff = (mine.double() - theirs.double()).abs()
    worst = float(diff.max()) if diff.numel() else 0.0
    within = bool((diff <= atol + rtol * theirs.double().abs()).all()) and bool(torch.isfinite(mine).all())
    if not within:
        raise RecaccelError(
            f"{failure}: logits differ by up to {worst:.3g} on a batch of {mine.numel()} rows "
            f"(tolerance {atol:g} + {rtol:g} * |logit|)"
        )
    return worst


def check_same_function(eager: EagerDLRM, reference: nn.Module, batch: Batch, what: str) -> float:
    """Copies ``reference``'s weights into ``eager`` and compares their logits on ``batch``.

    Returns:
        The largest absolute logit difference.

    Raises:
        RecaccelError: the logits differ beyond fp32 tolerance (the benchmark would time
            a different model).
    """
    eager.copy_from(reference)
    with torch.no_grad():
        mine, theirs = eager(batch), reference(batch)
    return same_logits(
        mine, theirs, f"train bench {what}: the eager baseline does not compute recaccel's function"
    )
