"""One's own model in a run (``recaccel.train(cfg, model=...)``): what it must provide.

A DLRM step looks the sparse features up, then runs the dense head on them
(:class:`~recaccel.train.model.objectives.DLRMObjective`), so a model is trained by recaccel
when it splits the same way. The contract, shapes B batch, Dd dense features, F sparse
fields, D embedding dim:

- ``prepare_sparse(sparse) -> sparse``: the batch's :class:`~recaccel.sparse.SparseFeatures`
  ready for ``embed`` (fields in the model's order; the train pipeline calls it ahead);
- ``embed(sparse) -> [B, F, D]``: pooled embeddings;
- ``head(dense [B, Dd], pooled [B, F, D]) -> logits [B]``.

A :class:`~recaccel.models.SparseArch` provides the first two (``prepare``, ``forward``)
over recaccel's embeddings with their fused sparse optimizer. Some settings read more:
``train.micro_batches > 1`` updates ``sparse_arch.embedding`` once per step; the meta
objectives (``train.mode = "meta"``, ``train.eval_tasks``) adapt ``dense_arch``,
``interaction_arch`` and ``over_arch``; ``train.compile`` / ``train.cuda_graphs`` need
a :class:`~recaccel.models.DLRM`; ``parallel.mode = "hybrid"`` shards the model's one
SparseArch. Everything the model holds is checkpointed (``state_dict``); a resumed or
evaluated run is given the same model again.

From a config (and so from the CLI), ``model.class_path = "package.module:Class"`` names
the model: ``Class(cfg, schema, device, **model.init_args)`` is built where recaccel
would build its DLRM, checked against the same contract. The name is in the run's
config.toml, so a resume or an evaluation of the run builds the same class again.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from recaccel.config import Config, show_value
from recaccel.errors import ConfigError

if TYPE_CHECKING:
    from recaccel.io.format.schema import FeatureSchema

# An nn.Module, or a callable building one for the data's schema on the run's device.
ModelSource = nn.Module | Callable[["FeatureSchema", torch.device], nn.Module]

CONTRACT = "embed(sparse) -> [B, F, D], head(dense, pooled) -> logits [B], prepare_sparse(sparse)"
META_ARCHES = ("sparse_arch", "dense_arch", "interaction_arch", "over_arch")


def model_source(cfg: Config, model: ModelSource | None) -> ModelSource | None:
    """The run's own model: ``model=`` as given, else the one ``model.class_path`` names,
    resolved and its ``model.init_args`` checked now, before any work (None: recaccel's).

    Raises:
        ConfigError: both name a model, or one line on what is wrong with the class path.
    """
    if not cfg.model.class_path:
        return model
    if model is not None:
        raise ConfigError(
            f"model= and config key model.class_path={cfg.model.class_path} both name the model; give one"
        )
    return ClassPathModel(cfg)


class ClassPathModel:
    """Builds ``model.class_path``'s model: ``Class(cfg, schema, device, **init_args)``.

    Args:
        cfg: the run's config; its class path is imported and the init args bound to
            the class's signature here, so a bad one is refused before any data is read.

    Raises:
        ConfigError: the module does not import, has no such attribute, names no
            callable, or the init args do not fit its signature.
    """

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.key = f"config key model.class_path={cfg.model.class_path}"
        self.target = _resolve(self.key, cfg.model.class_path)
        _bind(self.key, self.target, cfg)

    def __call__(self, schema: FeatureSchema, device: torch.device) -> nn.Module:
        module = self.target(self.cfg, schema, device, **self.cfg.model.init_args)
        if not isinstance(module, nn.Module):
            raise ConfigError(f"{self.key} built a {type(module).__name__}, not a torch nn.Module")
        try:
            check_user_model(module, self.cfg)
        except ConfigError as e:
            raise ConfigError(f"{self.key}: {e}") from None
        return module


def _resolve(key: str, class_path: str) -> Callable[..., Any]:
    """The callable ``package.module:Name`` names (``Name`` may be dotted: ``Outer.Inner``)."""
    module_name, _, qualname = class_path.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        where = "" if e.name == module_name else f" (importing it: {e})"
        raise ConfigError(
            f"{key}: no module {module_name!r}{where}; is it installed or its folder on PYTHONPATH?"
        ) from None
    except Exception as e:  # the user's module failed while importing: say how, in one line
        raise ConfigError(f"{key}: importing {module_name!r} failed: {type(e).__name__}: {e}") from None
    for part in qualname.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{key}: {getattr(target, '__name__', module_name)!r} has no {part!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{key} names a {type(target).__name__}, not a class")
    return target


def _bind(key: str, target: Callable[..., Any], cfg: Config) -> None:
    """Refuses init args the class does not take (or lacks required ones), before it is built."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # no introspectable signature (a builtin): found out when called
        return
    try:
        signature.bind(cfg, None, None, **cfg.model.init_args)
    except TypeError as e:
        raise ConfigError(
            f"config key model.init_args={show_value(cfg.model.init_args)} does not fit "
            f"{cfg.model.class_path}{signature}, called as (cfg, schema, device, **init_args): {e}"
        ) from None


def build_user_model(
    source: ModelSource, cfg: Config, schema: FeatureSchema, device: torch.device
) -> nn.Module:
    """The run's model from ``source``, checked against what ``cfg`` will call, on ``device``.

    Args:
        source: an ``nn.Module``, or a callable ``(schema, device) -> nn.Module``.
        cfg: the run's config (which settings read more than the contract).
        schema: the training data's feature schema (for a callable).
        device: the run's device.

    Raises:
        ConfigError: one line naming what the model lacks.
    """
    module = source if isinstance(source, nn.Module) else _call(source, schema, device)
    check_user_model(module, cfg)
    return module.to(device)


def _call(source: object, schema: FeatureSchema, device: torch.device) -> nn.Module:
    if not callable(source):
        raise ConfigError(
            f"model= must be an nn.Module or a callable (schema, device) -> nn.Module, got a {type(source).__name__}"
        )
    module = source(schema, device)
    if not isinstance(module, nn.Module):
        raise ConfigError(f"model= callable returned a {type(module).__name__}, not an nn.Module")
    return module


def check_user_model(module: nn.Module, cfg: Config) -> None:
    """Refuses a model without the methods and submodules ``cfg``'s run calls.

    Raises:
        ConfigError: one line naming the missing attributes and the setting that needs them.
    """
    name = type(module).__name__
    missing = [m for m in ("embed", "head", "prepare_sparse") if not callable(getattr(module, m, None))]
    if missing:
        raise ConfigError(f"model {name} has no {', '.join(missing)}: a model needs {CONTRACT}")
    if cfg.train.micro_batches > 1 and _get(module, "sparse_arch.embedding") is None:
        raise ConfigError(
            f"config key train.micro_batches={cfg.train.micro_batches} updates the model's sparse_arch.embedding "
            f"once per step; model {name} has none (use train.micro_batches=1)"
        )
    if cfg.train.mode == "meta" or cfg.train.eval_tasks:
        lacking = [a for a in META_ARCHES if not isinstance(getattr(module, a, None), nn.Module)]
        key = "train.mode=meta" if cfg.train.mode == "meta" else "train.eval_tasks=true"
        if lacking:
            raise ConfigError(
                f"config key {key} adapts a DLRM-shaped head ({', '.join(META_ARCHES)}); model {name} "
                f"has no {', '.join(lacking)}"
            )


def _get(module: nn.Module, dotted: str) -> object | None:
    for part in dotted.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module
