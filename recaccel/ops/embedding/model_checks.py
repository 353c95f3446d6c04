"""The deferred bounds check over a whole model: what a training loop calls at log steps."""

from __future__ import annotations

from torch import nn

from recaccel.ops.embedding.module import PackedEmbeddingBag


def check_deferred_ids(model: nn.Module) -> None:
    """Raises the deferred bounds check's error of any batch the packed embeddings inside
    ``model`` looked up so far (waiting for the counts: one host synchronization).

    For a training loop's log steps; checkpoints (``state_dict``) and the switch to
    evaluation (``eval()``) check by themselves. Without a :class:`PackedEmbeddingBag`
    using the deferred check this does nothing.

    Raises:
        InvalidIdError: an id outside its table, or malformed offsets, in a looked-up batch.
    """
    for module in model.modules():
        if isinstance(module, PackedEmbeddingBag):
            module.check_ids()
