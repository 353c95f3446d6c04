"""Which head parameters a task adapts, and the head as a function of them.

A meta-learnable model (recaccel's DLRM and MeLU) exposes ``embed(sparse)`` and
``head(dense, pooled)`` built from three arches::

    head(dense, pooled) = over_arch(interaction_arch(dense_arch(dense), pooled))

``interaction_arch`` records the field count and dim (``num_sparse``, ``dim``); its
parameters, if any (DCN-v2's cross layers), are meta-parameters every task shares: the
outer loop trains them, no mode adapts them. The adapt modes (``MetaConfig.adapt``):

- ``top_mlp``: the over-arch parameters; the dense arch and the interaction run once
  per meta step, outside the inner loop.
- ``head``: dense-arch and over-arch parameters; only the interaction is shared
  work (no task adapts it, so it runs on all T*N rows at once).
- ``head_and_embedding_shift``: ``head`` plus a per-task additive correction of the
  pooled embeddings, an [F, D] tensor starting at zero in every task.

Shapes: T tasks, N rows of a task, Dd dense inputs, Dh dense-arch outputs, F fields,
D embedding dim, K interaction outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call

from recaccel.config import AdaptMode, choices
from recaccel.errors import ConfigError
from recaccel.meta.functional import batched_mlp, mlp_layers

ADAPT_MODES = choices(AdaptMode)
SHIFT = "embedding_shift"  # name of the per-task pooled-embedding correction
_ARCHES = ("dense_arch", "interaction_arch", "over_arch")


@dataclass(frozen=True)
class AdaptPlan:
    """The adapted parameters of a mode, by model-level name.

    Attributes:
        mode: one of :data:`ADAPT_MODES`.
        dense_names: adapted ``dense_arch.*`` parameters (empty in ``top_mlp`` mode or
            when the dense arch has none).
        over_names: adapted ``over_arch.*`` parameters.
        shift: whether :data:`SHIFT` is adapted.
    """

    mode: AdaptMode
    dense_names: tuple[str, ...]
    over_names: tuple[str, ...]
    shift: bool

    @property
    def names(self) -> tuple[str, ...]:
        """Every adapted tensor's name, the shift last."""
        return self.dense_names + self.over_names + ((SHIFT,) if self.shift else ())

    @property
    def hidden_static(self) -> bool:
        """The dense arch is shared by all tasks, so it runs once outside the inner loop."""
        return not self.dense_names

    @property
    def features_static(self) -> bool:
        """The interaction output is shared by all tasks (only the over arch adapts)."""
        return self.hidden_static and not self.shift


def adapt_plan(model: nn.Module, mode: AdaptMode) -> AdaptPlan:
    """Resolves an adapt mode against a model's arches.

    Raises:
        ConfigError: unknown mode, or the model lacks the arches meta-learning needs.
    """
    if mode not in ADAPT_MODES:
        raise ConfigError(f"meta.adapt must be one of {ADAPT_MODES}, got {mode!r}")
    missing = [a for a in _ARCHES if not isinstance(getattr(model, a, None), nn.Module)]
    if missing or not callable(getattr(model, "embed", None)):
        raise ConfigError(
            f"{type(model).__name__} cannot be meta-learned: it needs embed() and the modules {_ARCHES}, "
            f"missing {missing or ['embed']}"
        )
    over = tuple(f"over_arch.{n}" for n, _ in model.over_arch.named_parameters())
    dense = (
        () if mode == "top_mlp" else tuple(f"dense_arch.{n}" for n, _ in model.dense_arch.named_parameters())
    )
    return AdaptPlan(mode, dense, over, mode == "head_and_embedding_shift")


def shift_shape(model: nn.Module) -> tuple[int, int]:
    """(F, D) of the embedding shift, from ``model.interaction_arch``."""
    arch = model.interaction_arch
    if not hasattr(arch, "num_sparse") or not hasattr(arch, "dim"):
        raise ConfigError(
            f"adapt='head_and_embedding_shift' needs {type(arch).__name__} to record num_sparse and dim"
        )
    return int(arch.num_sparse), int(arch.dim)


def _strip(params: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    cut = len(prefix) + 1
    return {n[cut:]: v for n, v in params.items() if n.startswith(prefix + ".")}


class TaskHead:
    """The head of one model as a function of adapted parameters.

    Row blocks are dicts with the tensors a mode needs: ``features`` [.., N, K] when
    :attr:`AdaptPlan.features_static`, else ``pooled`` [.., N, F, D] and either
    ``hidden`` [.., N, Dh] (dense arch shared) or ``dense`` [.., N, Dd]; plus
    ``labels`` and ``mask`` [.., N].

    Args:
        model: the meta-learned model.
        plan: from :func:`adapt_plan`.
        batched: also prepare :meth:`batched` (needs Linear/ReLU MLP arches).
    """

    def __init__(self, model: nn.Module, plan: AdaptPlan, batched: bool) -> None:
        self.model = model
        self.plan = plan
        if batched:
            self.over_layers = mlp_layers(model.over_arch, "over_arch")
            self.dense_layers = mlp_layers(model.dense_arch, "dense_arch") if plan.dense_names else []

    def shared_rows(self, dense: Tensor, pooled: Tensor) -> dict[str, Tensor]:
        """The work every task shares, done once on all rows.

        Args:
            dense: [B, Dd] dense features of every support and query row.
            pooled: [B, F, D] their pooled embeddings.

        Returns:
            ``features`` [B, K], or ``hidden`` [B, Dh] and ``pooled``, or ``dense`` and
            ``pooled``, as the plan needs.
        """
        if self.plan.features_static:
            return {"features": self.model.interaction_arch(self.model.dense_arch(dense), pooled)}
        if self.plan.hidden_static:
            return {"hidden": self.model.dense_arch(dense), "pooled": pooled}
        return {"dense": dense, "pooled": pooled}

    def batched(self, params: dict[str, Tensor], block: dict[str, Tensor]) -> Tensor:
        """Predictions [T, N] of T tasks, parameters stacked [T, ...] (see the class doc)."""
        features = block.get("features")
        if features is None:
            hidden = block.get("hidden")
            if hidden is None:
                hidden = batched_mlp(block["dense"], self.dense_layers, params)
            pooled = block["pooled"]
            if self.plan.shift:
                pooled = pooled + params[SHIFT].unsqueeze(1)
            t, n = pooled.shape[:2]
            # No parameters: one call on all T*N rows, with the model's own backend.
            features = self.model.interaction_arch(hidden.flatten(0, 1), pooled.flatten(0, 1)).view(t, n, -1)
        # A padded interaction's zero columns meet no weight here (the stored [out, in] is used).
        width = getattr(self.model.interaction_arch, "output_dim", features.shape[-1])
        return batched_mlp(features[..., :width], self.over_layers, params).squeeze(-1)

    def per_task(self, params: dict[str, Tensor], block: dict[str, Tensor]) -> Tensor:
        """Predictions [N] of one task through the model's own modules (``functional_call``)."""
        features = block.get("features")
        if features is None:
            hidden = block.get("hidden")
            if hidden is None:
                hidden = functional_call(
                    self.model.dense_arch, _strip(params, "dense_arch"), (block["dense"],)
                )
            pooled = block["pooled"] + params[SHIFT] if self.plan.shift else block["pooled"]
            features = self.model.interaction_arch(hidden, pooled)
        return functional_call(self.model.over_arch, _strip(params, "over_arch"), (features,))


def initial_params(model: nn.Module, plan: AdaptPlan, like: Tensor) -> dict[str, Tensor]:
    """The shared starting point of every task: the model's parameters and a zero shift.

    Args:
        model: the model.
        plan: the adapted names.
        like: a tensor with the dtype and device of the pooled embeddings [.., F, D].
    """
    named = dict(model.named_parameters())
    params = {n: named[n] for n in plan.dense_names + plan.over_names}
    if plan.shift:
        params[SHIFT] = torch.zeros(like.shape[-2:], dtype=like.dtype, device=like.device, requires_grad=True)
    return params
