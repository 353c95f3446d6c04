"""Triton packed embedding backward and fused sparse update as occurrence tiles.

One of two backward designs: :mod:`~recaccel.ops.embedding.triton.piece_lanes` is the
other, and :func:`launch_backward` runs whichever the launch configuration names
(:mod:`~recaccel.ops.embedding.triton.backward_config`: the device's tuning table picks
per shape). :func:`fused_update` takes the occurrences in sorted order from the batch's
preparation (:mod:`~recaccel.ops.embedding.triton.occurrences`) when they fit that
configuration, else gathers them.

The work is the pack's occurrences sorted by packed row (``RowGroups.order``), not its
unique rows: program ``t`` of :func:`_occurrence_tile_kernel` takes the span of
occurrences ``t*P .. (t+1)*P - 1`` of that order, ``P = BLOCK_OCC * SUBTILES``, whatever
the segment lengths, so a row with 36k occurrences spreads over many programs instead of
running alone. The program walks its span in ``SUBTILES`` chunks of ``BLOCK_OCC``, in order.

Per chunk (grid ``(cdiv(N_p, P),)``):

1. Load the ``BLOCK_OCC`` output-gradient rows of its occurrences (bag ``j*B + b`` is
   ``grad_out[b, j]``), times the occurrence's scale (id weight, ``1/L`` for mean); when
   the chunk's first occurrence continues the segment open at the previous chunk's end,
   add that segment's running sum (the carry, [BLOCK_D]) to its row.
2. Reduce the segments inside the chunk with a segmented inclusive scan
   (``tl.associative_scan`` over ``(flag, value)``, flag = a segment starts here): at the
   last occurrence of each segment the scan holds the segment's sum within the span; the
   value at the chunk's last occurrence is the next chunk's carry.
3. Apply the update (SGD, row-wise Adagrad, Adam; stochastic rounding for 16-bit rows,
   the rows loaded before the scan, as soon as the keys tell which the chunk updates,
   the rules of :func:`~recaccel.ops.embedding.optimizers.update_rows`), or store the
   gradient (autograd mode), for every segment that begins and ends in the span.
4. Write the span's partials for segments that cross its edges: ``head`` (the sum of its
   first segment when that began in an earlier span and ends here) and ``tail`` (the sum
   of its last segment when that continues into the next span).

Then :func:`_spanning_rows_kernel` (grid ``(T,)``, T spans; module ``row_update``): the
span where a spanning segment begins sums its ``tail``, the ``tail`` of every span the
segment covers whole, and the ``head`` of the span where it ends, in span order (``CHUNK``
spans per step, :func:`~recaccel.ops.embedding.triton.row_update.partials_per_step`, a
fixed reduction tree within a step), and applies the update to that row.

``SUBTILES`` 1 is the one-chunk kernel, without a loop (the code and bits it had before
programs walked chunks). With small chunks (BLOCK_OCC 8 at D=128: 16 occurrences per row
at L=20 cross most chunk edges) one chunk per program leaves most rows to the
spanning-row kernel, through partials in memory; a span of several chunks finishes them
itself and hands ``SUBTILES`` times fewer spans to the second kernel.

Machine code on sm_90 (D=128 float32 rows, row-wise Adagrad, BLOCK_OCC 8, contiguous
gradient), ``python ../shared/tools/sm90_report.py
recaccel.ops.embedding.triton.backward:_occurrence_tile_kernel --sig <every runtime
parameter; stride_gd specialised to 1 as at run time> --const stride_gd=1 MODE=1
STOCHASTIC=0 HAS_SCALE=0 BLOCK_OCC=8 BLOCK_D=128 SUBTILES=<s> --aligned <pointers, dim,
stride_w, stride_gb, stride_gf> --num-warps <w>``:

============  =========  ======  ==================  ================  ==============
SUBTILES      num_warps  regs    spills (st / ld B)  programs per SM   ld.global.v4
============  =========  ======  ==================  ================  ==============
1             2          93      0 / 0               11                8
1             4          53      0 / 0               9                 4
4 or 16       2          128     0 / 0               8                 8
4 or 16       4          72      0 / 0               7                 4
============  =========  ======  ==================  ================  ==============

16-byte loads of the gradient rows and of the weight rows in every case (half each), no
atomics. bfloat16 rows (stochastic rounding, ``weight_ptr=*bf16 STOCHASTIC=1``), 4 warps,
SUBTILES 1 / 4: 64 / 96 registers (row-wise Adagrad), 67 / 119 (Adam, ``MODE=2``), no spills. A ``tl.range(..., num_stages=2)`` loop would turn every load into ``cp.async``
(100 at 2 warps) at 155 / 105 registers and 16.8 KB of shared memory (3 stages: 252 /
128 registers, 25 KB); not taken without a GPU timing.

Every row is written by exactly one program and no atomics are used, so the result is
bitwise the same from run to run for a given ``(BLOCK_OCC, SUBTILES, num_warps)`` and D (which
fixes ``CHUNK``);
the summation order differs from the reference's (sequential per row), hence results
agree with it to float32 rounding, not bit for bit.

They run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (set before
this module is imported).

Shapes: B batch, S features of the pack, D dim, R packed rows, N_p occurrences (ids) of
the pack, U unique rows, T spans (tile programs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from recaccel.ops.embedding.optimizers import PackState, adam_bias_corrections
from recaccel.ops.embedding.packing import PackIds
from recaccel.ops.embedding.prepared import SortedOccurrences
from recaccel.ops.embedding.row_groups import RowGroups, group_by_row
from recaccel.ops.embedding.specs import SparseOptimConfig
from recaccel.ops.embedding.triton.backward_config import (
    BackwardConfig,
    TileConfig,
    check_tile_config,
    density_bucket,
    log_choice,
    resolve_config,
    tile_config,
)
from recaccel.ops.embedding.triton.occurrences import piece_len_of, pieces_of, sort_occurrences, usable
from recaccel.ops.embedding.triton.piece_lanes import LaneConfig, Pieces, launch_lanes
from recaccel.ops.embedding.triton.row_update import (
    FIXUP_WARPS,
    _load_rows,
    _spanning_rows_kernel,
    _update_rows,
    partials_per_step,
)

__all__ = [
    "BackwardConfig",
    "TileConfig",
    "embedding_bag_backward",
    "fused_update",
    "launch_backward",
    "resolve_config",
    "tile_config",
]

# MODE of the kernels: the sparse optimizers, or "store the row's gradient" (autograd mode).
_MODE_CODES = {"sgd": 0, "rowwise_adagrad": 1, "adam": 2}
_MODE_GRAD = 3


@triton.jit
def _segmented_add(flag_a, sum_a, flag_b, sum_b):
    """Combine of a segmented sum: a flag starts a new segment, so ``b`` drops ``a``'s sum."""
    return flag_a | flag_b, tl.where(flag_b != 0, sum_b, sum_a + sum_b)


@triton.jit
def _chunk_gradients(
    keys_ptr,
    bags_ptr,
    scale_ptr,
    grad_out_ptr,
    occ,  # int64 [BLOCK_OCC] sorted occurrence indices of the chunk
    valid,  # bool [BLOCK_OCC] occ < num_occ
    num_occ,
    batch_size,
    cols,
    col_mask,
    stride_gb,
    stride_gf,
    stride_gd,
    HAS_SCALE: tl.constexpr,
):
    """Keys of a chunk's occurrences and of their neighbours (-1: none), and the
    occurrences' scaled output-gradient rows, float32 [BLOCK_OCC, BLOCK_D]."""
    # Keys are >= 0, so -1 marks "no occurrence" on either side.
    key = tl.load(keys_ptr + occ, mask=valid, other=-1)
    prev = tl.load(keys_ptr + occ - 1, mask=valid & (occ > 0), other=-1)
    nxt = tl.load(keys_ptr + occ + 1, mask=occ + 1 < num_occ, other=-1)
    bag = tl.load(bags_ptr + occ, mask=valid, other=0)
    j = bag // batch_size
    b = bag % batch_size
    mask = valid[:, None] & col_mask[None, :]
    # A 16-bit pooled output's gradient is read as it is (half the bytes), summed in float32.
    g = tl.load(
        grad_out_ptr + b[:, None] * stride_gb + j[:, None] * stride_gf + cols[None, :] * stride_gd,
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    if HAS_SCALE:
        g = g * tl.load(scale_ptr + occ, mask=valid, other=0.0)[:, None]
    return key, prev, nxt, g


@triton.jit
def _tile_chunk(
    weight_ptr,
    m1_ptr,
    m2_ptr,
    keys_ptr,
    bags_ptr,
    scale_ptr,
    grad_out_ptr,
    part,  # float32 [2, BLOCK_D] pointers: the program's head / tail partials
    first,  # the chunk's first occurrence
    span_last,  # the program's last occurrence
    before,  # the key before the program's span (-1: none)
    carry,  # float32 [BLOCK_D] sum of the segment open at the previous chunk's end
    joined,  # whether carry is live (not the span's first chunk)
    num_occ,
    batch_size,
    dim,
    stride_w,
    stride_gb,
    stride_gf,
    stride_gd,
    lr,
    eps,
    beta1,
    beta2,
    one_minus_beta1,
    one_minus_beta2,
    weight_decay,
    bias_c1,
    bias_c2,
    seed,
    MODE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_OCC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CARRY: tl.constexpr,  # the span has more chunks: join carry in, return the new one
):
    """Steps 1-4 of the module's docstring for the ``BLOCK_OCC`` occurrences from ``first``;
    returns the scan's value at the chunk's last occurrence (the next chunk's carry)."""
    occ = first + tl.arange(0, BLOCK_OCC)
    valid = occ < num_occ
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < dim
    key, prev, nxt, g = _chunk_gradients(
        keys_ptr, bags_ptr, scale_ptr, grad_out_ptr, occ, valid, num_occ, batch_size, cols, col_mask,
        stride_gb, stride_gf, stride_gd, HAS_SCALE,
    )  # fmt: skip
    ends = valid & (key != nxt)
    began_here = key != before
    live = ends & began_here
    # The rows this chunk updates are known from the keys: loaded before the scan, their
    # latency overlaps the gradient rows' instead of following the scan.
    w = _load_rows(weight_ptr, key, live, cols, col_mask, stride_w, MODE)
    if CARRY:  # the segment open at the previous chunk's end goes on: its sum joins this row
        g = tl.where(((occ == first) & (key == prev) & joined)[:, None], g + carry[None, :], g)
    starts = tl.broadcast_to((key != prev).to(tl.int32)[:, None], (BLOCK_OCC, BLOCK_D))
    _, sums = tl.associative_scan((starts, g), 0, _segmented_add)
    _update_rows(
        weight_ptr, m1_ptr, m2_ptr, key, sums, w, live, cols, col_mask, dim, stride_w,
        lr, eps, beta1, beta2, one_minus_beta1, one_minus_beta2, weight_decay, bias_c1, bias_c2, seed, MODE, STOCHASTIC,
    )  # fmt: skip
    # Partials of the segments crossing the span's edges (at most one row each is unmasked).
    part = part + occ[:, None] * 0 + cols[None, :]
    tl.store(part, sums, mask=(ends & ~began_here)[:, None])
    tl.store(part + BLOCK_D, sums, mask=((occ == span_last) & (key == nxt))[:, None])
    if CARRY:
        carry = tl.sum(tl.where((occ == first + BLOCK_OCC - 1)[:, None], sums, 0.0), axis=0)
    return carry


@triton.jit(do_not_specialize=["seed"])  # a new seed every update: no recompiles
def _occurrence_tile_kernel(
    weight_ptr,  # float32/bfloat16/float16 [R, D] updated in place; float32 [U, D] out (MODE 3)
    m1_ptr,  # float32 [R] (row-wise Adagrad) or [R, D] (Adam)
    m2_ptr,  # float32 [R, D] (Adam)
    keys_ptr,  # int64 [N_p] non-decreasing: destination row of each sorted occurrence
    bags_ptr,  # int64 [N_p] bag of each sorted occurrence
    scale_ptr,  # float32 [N_p] (read only if HAS_SCALE)
    grad_out_ptr,  # float32, bfloat16 or float16 [B, S, D], any strides
    part_ptr,  # float32 [T, 2, BLOCK_D] head / tail partials of each span
    num_occ,
    batch_size,
    dim,
    stride_w,
    stride_gb,
    stride_gf,
    stride_gd,
    lr_ptr,  # float32 [1] the learning rate (a device scalar: a captured step replays its updates)
    eps,
    beta1,
    beta2,
    one_minus_beta1,  # 1 - beta, rounded once from float64 on the host (as the reference)
    one_minus_beta2,
    weight_decay,
    bias_c1,
    bias_c2,
    seed,
    MODE: tl.constexpr,  # 0 sgd, 1 row-wise adagrad, 2 adam, 3 store the gradient
    STOCHASTIC: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_OCC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SUBTILES: tl.constexpr,  # chunks of BLOCK_OCC occurrences per program (its span)
):
    lr = tl.load(lr_ptr)
    t = tl.program_id(0).to(tl.int64)
    start = t * (BLOCK_OCC * SUBTILES)
    span_last = tl.minimum(start + BLOCK_OCC * SUBTILES, num_occ) - 1
    before = tl.load(keys_ptr + start - 1, mask=start > 0, other=-1)  # last key of span t-1
    part = part_ptr + t * (2 * BLOCK_D)
    carry = tl.zeros([BLOCK_D], dtype=tl.float32)
    if SUBTILES == 1:  # no loop: the one-chunk kernel compiles as before (a loop of one costs registers)
        _tile_chunk(
            weight_ptr, m1_ptr, m2_ptr, keys_ptr, bags_ptr, scale_ptr, grad_out_ptr, part, start, span_last,
            before, carry, False, num_occ, batch_size, dim, stride_w, stride_gb, stride_gf, stride_gd,
            lr, eps, beta1, beta2, one_minus_beta1, one_minus_beta2, weight_decay, bias_c1, bias_c2, seed,
            MODE, STOCHASTIC, HAS_SCALE, BLOCK_OCC, BLOCK_D, False,
        )  # fmt: skip
    else:
        for c in tl.range(0, SUBTILES):  # chunks past num_occ (last program) are all masked
            carry = _tile_chunk(
                weight_ptr, m1_ptr, m2_ptr, keys_ptr, bags_ptr, scale_ptr, grad_out_ptr, part,
                start + c * BLOCK_OCC, span_last, before, carry, c > 0, num_occ, batch_size, dim, stride_w,
                stride_gb, stride_gf, stride_gd, lr, eps, beta1, beta2, one_minus_beta1, one_minus_beta2,
                weight_decay, bias_c1, bias_c2, seed, MODE, STOCHASTIC, HAS_SCALE, BLOCK_OCC, BLOCK_D, True,
            )  # fmt: skip


def launch_backward(
    target: Tensor,
    m1: Tensor,
    m2: Tensor,
    keys: Tensor,
    bags: Tensor,
    scale: Tensor | None,
    grad_out: Tensor,
    batch_size: int,
    mode: int,
    hyper: tuple[Tensor | float, ...],
    seed: int,
    config: BackwardConfig,
    pieces: Pieces | None = None,
) -> None:
    """Runs the backward over ``keys.numel() > 0`` sorted occurrences: the piece lanes for
    a :class:`LaneConfig` (``pieces`` when already made), else the tile kernel and then the
    spanning-row kernel; ``hyper`` is (lr, eps, beta1, beta2, 1 - beta1, 1 - beta2,
    weight_decay, bias_c1, bias_c2), ``lr`` a float32 [1] device tensor (:func:`lr_scalar`)."""
    if grad_out.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        grad_out = grad_out.to(torch.float32)
    if isinstance(config, LaneConfig):
        launch_lanes(
            target, m1, m2, keys, bags, scale, grad_out, batch_size, mode, hyper, seed, config, pieces
        )
        return
    block_occ, num_warps, subtiles = config
    check_tile_config(block_occ, subtiles)
    num_occ = keys.numel()
    dim = target.shape[1]
    block_d = triton.next_power_of_2(dim)
    span = block_occ * subtiles  # the spanning-row kernel's "tile" is a program's span
    num_tiles = triton.cdiv(num_occ, span)
    part = torch.empty(num_tiles, 2, block_d, dtype=torch.float32, device=target.device)
    stochastic = target.dtype in (torch.bfloat16, torch.float16)
    _occurrence_tile_kernel[(num_tiles,)](
        target, m1, m2, keys, bags, bags if scale is None else scale, grad_out, part,
        num_occ, batch_size, dim, target.stride(0),
        grad_out.stride(0), grad_out.stride(1), grad_out.stride(2), *hyper, seed,
        MODE=mode, STOCHASTIC=stochastic, HAS_SCALE=scale is not None,
        BLOCK_OCC=block_occ, BLOCK_D=block_d, SUBTILES=subtiles, num_warps=num_warps,
    )  # fmt: skip
    if num_tiles > 1:
        _spanning_rows_kernel[(num_tiles,)](
            target, m1, m2, keys, part, num_occ, num_tiles, dim, target.stride(0), *hyper, seed,
            MODE=mode, STOCHASTIC=stochastic, BLOCK_OCC=span, BLOCK_D=block_d,
            CHUNK=partials_per_step(block_d), num_warps=FIXUP_WARPS,
        )  # fmt: skip


def embedding_bag_backward(
    grad_out: Tensor,
    ids: PackIds,
    batch_size: int,
    groups: RowGroups | None = None,
    *,
    config: BackwardConfig | None = None,
    block_occ: int | None = None,
    num_warps: int | None = None,
    subtiles: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-unique-row weight gradient of one pack (autograd mode).

    Args:
        grad_out: [B, S, D] gradient of the pooled output.
        ids: The pack's ids, with ``bags``.
        batch_size: B.
        groups: ``group_by_row(ids.rows)`` when already made (a prepared batch).
        config: The kernels' launch configuration (default :func:`tile_config`).
        block_occ, num_warps, subtiles: Occurrence tiles with these fields
            (:func:`resolve_config`), when ``config`` is None.

    Returns:
        (rows int64 [U] sorted unique packed rows, grad float32 [U, D]).
    """
    groups = group_by_row(ids.rows) if groups is None else groups
    order, rows, segments = groups
    num_occ = order.numel()
    grad = torch.empty(rows.numel(), grad_out.shape[2], dtype=torch.float32, device=grad_out.device)
    if num_occ == 0:
        return rows, grad
    config = resolve_config(grad.shape[1], grad.dtype, grad.device, config, block_occ, num_warps, subtiles)
    # The kernels' destination is the unique row's slot u in grad: key = u per occurrence.
    slot = torch.arange(rows.numel(), device=rows.device)
    keys = torch.repeat_interleave(slot, segments[1:] - segments[:-1], output_size=num_occ)
    occ = sort_occurrences(ids, groups, None)  # its bags and scales (its keys are rows, not slots)
    hyper = (torch.zeros(1, dtype=torch.float32, device=grad.device), *(0.0,) * 6, 1.0, 1.0)
    launch_backward(
        grad, grad, grad, keys, occ.bags, occ.scale, grad_out, batch_size, _MODE_GRAD, hyper, 0, config
    )
    return rows, grad


def lr_scalar(state: PackState, lr: float) -> Tensor:
    """The learning rate as the update kernels read it: ``state.lr`` (float32 [1] on the
    weight's device), else one made from ``lr``."""
    if state.lr is not None:
        return state.lr
    return torch.full((1,), lr, dtype=torch.float32, device=state.weight.device)


def fused_update(
    state: PackState,
    optim: SparseOptimConfig,
    grad_out: Tensor,
    ids: PackIds,
    batch_size: int,
    groups: RowGroups | None = None,
    *,
    occurrences: SortedOccurrences | None = None,
    config: BackwardConfig | None = None,
    block_occ: int | None = None,
    num_warps: int | None = None,
    subtiles: int | None = None,
) -> None:
    """Applies the sparse optimizer to the rows a batch touched.

    Counts the step and draws the stochastic-rounding seed of 16-bit rows
    (``state.rounding_seed``) even for an empty batch, as the per-row path and the
    reference do; 16-bit rows are updated in float32 and stored back with stochastic
    rounding, the optimizer state is float32.

    Args:
        state: The pack's weight, optimizer state and step, updated in place.
        optim: Hyper-parameters.
        grad_out: [B, S, D] gradient of the pooled output.
        ids: The pack's ids, with ``bags``.
        batch_size: B.
        groups: ``group_by_row(ids.rows)`` when already made (a prepared batch).
        occurrences: The preparation's sorted occurrences
            (:func:`~recaccel.ops.embedding.triton.occurrences.sort_occurrences`), used
            when their pieces fit the resolved configuration, else made now.
        config: The kernels' launch configuration (default :func:`tile_config`).
        block_occ, num_warps, subtiles: Occurrence tiles with these fields
            (:func:`resolve_config`), when ``config`` is None.
    """
    state.step.add_(1)
    seed = 0 if state.rounding_seed is None else state.rounding_seed()
    groups = group_by_row(ids.rows) if groups is None else groups
    order = groups.order
    if order.numel() == 0:
        return
    weight = state.weight
    density = density_bucket(order.numel(), weight.shape[0])
    config = resolve_config(
        weight.shape[1], weight.dtype, weight.device, config, block_occ, num_warps, subtiles, density
    )
    log_choice(weight.shape[1], weight.dtype, density, config)
    if not usable(occurrences, config):
        occurrences = sort_occurrences(ids, groups, piece_len_of(config))
    bc1, bc2 = adam_bias_corrections(optim, state.step)
    hyper = (
        lr_scalar(state, optim.lr),
        optim.eps,
        optim.beta1,
        optim.beta2,
        1.0 - optim.beta1,
        1.0 - optim.beta2,
        optim.weight_decay,
        bc1,
        bc2,
    )
    m1 = state.states.get("momentum1", weight)
    m2 = state.states.get("momentum2", weight)
    mode = _MODE_CODES[state.optimizer]
    launch_backward(
        weight, m1, m2, occurrences.keys, occurrences.bags, occurrences.scale, grad_out, batch_size, mode,
        hyper, seed, config, pieces_of(occurrences),
    )  # fmt: skip
