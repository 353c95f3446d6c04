"""The embedding lookup of a step written straight into a CUDA-graphed head's input.

A :class:`~recaccel.train.model.dense_head.GraphedHead` replays from one static input
buffer; copying the pooled embeddings [B, F, D] there costs a read and a write of the
whole tensor per step (872 MB each way at B=65536, F=26, D=128). :func:`embed_for_head`
asks the head for that buffer and has the packed embedding write its result there
(:mod:`recaccel.ops.embedding.lookup_out`), so the replay finds its input in place.

The buffer is the head's until the backward of its last graphed call has run, so only a
lookup whose result is the very next head call's input may use it: the plain step's
(lookup, head, backward). A pipeline that looks the next batch up before this step's
backward (semi-sync) calls the objective's ``embed`` instead, which never does.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from recaccel.models.dlrm import DLRM
from recaccel.ops.embedding import PackedEmbeddingBag
from recaccel.sparse import SparseFeatures


def head_buffer(model: nn.Module, head: Callable, dense: Tensor, sparse: SparseFeatures) -> Tensor | None:
    """The head's input buffer for this batch's pooled embeddings, or None where the
    lookup cannot write there (not a graphed head, not recaccel's DLRM lookup through a
    packed embedding of one dim, or a call the head would not replay)."""
    pooled_buffer = getattr(head, "pooled_buffer", None)
    if pooled_buffer is None or not isinstance(model, DLRM) or type(model).embed is not DLRM.embed:
        return None
    embedding = model.sparse_arch.embedding
    if not isinstance(embedding, PackedEmbeddingBag):
        return None
    dims = {t.dim for t in embedding.tables}
    if len(dims) != 1:
        return None
    shape = (dense.shape[0], len(model.sparse_arch.features), dims.pop())
    # The fused update uses the pooled gradient up inside backward() and keeps nothing (and
    # this lookup's result feeds only the head call that follows): the graph may lend it.
    lend = embedding.mode == "fused"
    device = sparse.values.device
    dtype = model.sparse_arch.pooled_dtype(device.type)  # what model.embed would return now
    return pooled_buffer(dense, shape, dtype, device, lend_gradient=lend)


def embed_for_head(model: nn.Module, head: Callable, dense: Tensor, sparse: SparseFeatures) -> Tensor:
    """Pooled embeddings [B, F, D] of ``sparse`` for the head call that follows at once:
    in the head's input buffer where it has one (:func:`head_buffer`), else as
    ``model.embed`` gives them (bit for bit the same values either way)."""
    buffer = head_buffer(model, head, dense, sparse)
    if buffer is None:
        return model.embed(sparse)
    return model.sparse_arch(sparse, out=buffer)  # DLRM.embed, into the buffer
