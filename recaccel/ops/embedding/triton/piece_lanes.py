"""Triton packed embedding backward and fused sparse update as piece lanes.

The second backward design beside the occurrence tiles of
:mod:`~recaccel.ops.embedding.triton.backward` (the tuning run picks one per device and
shape). It reduces a row's gradient the way the forward pools a bag: lanes walk the
row's occurrences in order and sum their gradient rows in registers, no scan.

The sorted occurrences (``RowGroups.order``) form segments, one per unique row. Each
segment is cut into pieces of at most ``PIECE_LEN`` occurrences counted from its start
(:mod:`~recaccel.ops.embedding.triton.pieces`, on the device without a host
synchronisation), so a hot row with 36k occurrences becomes many pieces on many lanes
while a row with fewer occurrences is one piece.

Kernels (launcher :func:`launch_lanes`):

- ``_piece_lanes_kernel``: lane ``l`` of a program takes piece ``q = blk*BLOCK_PIECES + l``
  and walks its occurrences ``UNROLL`` at a time (``BLOCK_PIECES * UNROLL`` gradient rows in
  flight, 16-byte loads), the sum kept in float32 registers, in occurrence order. A piece
  that is its whole segment updates its row at once (``row_update``'s rules: SGD, row-wise
  Adagrad, Adam, stochastic rounding of 16-bit rows, or the gradient store; the rows
  are loaded before the walk, their latency overlapping the gradient rows'). A piece of a
  longer segment writes its sum to a partial slot instead, and the segment's first piece
  records its start in ``owner[start // PIECE_LEN]``. Programs loop over blocks of
  pieces (grid: one resident wave of programs; the pieces' count read on the device).
- ``_piece_combine_kernel``: for each recorded segment, sums its pieces' partials in
  piece order (``CHUNK`` per step, a fixed reduction tree within a step) and updates the row.

Partial slots: piece ``q`` starting at occurrence ``s`` of a split segment writes slot
``2 * (s // PIECE_LEN) + is_last``. No two split pieces share a slot: a piece that is
not its segment's last is ``PIECE_LEN`` long, so at most one starts in a window of
``PIECE_LEN`` occurrences, and two last pieces in one window would need the second
segment's full piece before it to fit in the room after the first (less than a window).
The buffer is ``2 * cdiv(N, PIECE_LEN)`` rows, written only where a segment is split.

Machine code on sm_90 (``../shared/tools/sm90_report.py
recaccel.ops.embedding.triton.piece_lanes:_piece_lanes_kernel --sig <every runtime
parameter, keys_ptr=*i32> --const stride_gd=1 MODE=<m> STOCHASTIC=<s> HAS_SCALE=0
PIECE_LEN=64 BLOCK_PIECES=<lanes> BLOCK_D=128 UNROLL=<u> --aligned <pointers, dim,
stride_w, stride_gb, stride_gf> --num-warps <w>``); D=128 float32 rows, row-wise Adagrad
unless named:

==================================  ======  ===============  ===============  ============
lanes / unroll / warps              regs    spills (st / ld)  programs per SM  ld.global.v4
==================================  ======  ===============  ===============  ============
16 / 1 / 4                          126     0 / 0            4                8
16 / 2 / 4                          146     0 / 0            3                12
32 / 1 / 8                          126     0 / 0            2                8
32 / 2 / 8                          146     0 / 0            1                12
16 / 1 / 4, Adam, bf16 rows         190     0 / 0            2                14
16 / 1 / 4, gradient store          96      0 / 0            5                4
64 / 1 / 4, D=32                    128     0 / 0            4                8
==================================  ======  ===============  ===============  ============

16-byte loads of the gradient and weight rows, no atomics. The lanes' index vectors are
``[BLOCK_PIECES, 1]`` columns: as 1-D vectors inside the nested loops, Triton 3.6's layout
pass fails on sm_90 beyond 16 lanes (mismatched slice layouts).

Every row is written by exactly one program, no atomics: two runs are bitwise equal for
a given configuration and D (which fixes the combine's ``CHUNK``). ``UNROLL`` and the grid
change no bit (a piece is summed occurrence by occurrence in order); ``BLOCK_PIECES`` and
the warps change none of the gradient store, SGD or Adam (element-wise), while row-wise
Adagrad's sum of g^2 over D is reduced in the block's thread layout, which they set. A
row of at most ``PIECE_LEN`` occurrences is summed in sorted occurrence order: bitwise a
float32 loop over them.

They run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (set before
this module is imported).

Shapes: B batch, S features of the pack, D dim, R packed rows, N occurrences of the
pack, P pieces, W windows (``cdiv(N, PIECE_LEN)``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from recaccel.errors import ConfigError
from recaccel.ops.embedding.triton.pieces import Pieces, build_pieces
from recaccel.ops.embedding.triton.row_update import (
    FIXUP_WARPS,
    _load_rows,
    _update_rows,
    partials_per_step,
)

COMBINE_WINDOWS = 128  # windows one combine program scans
# Lane programs loop over the blocks of pieces, so the grid is one resident wave: more
# would idle the first wave's SMs at the end, fewer leave rows out of flight. Until a
# configuration's compiled kernel tells its registers, 8 warps per SM (any kernel of at
# most 255 registers fits); then the SM's register file and thread limit decide.
SAFE_WARPS_PER_SM = 8
SM_REGISTERS = 65536  # sm_80 / sm_90 (H100, H200)
SM_THREADS = 2048  # sm_80 / sm_90 (1536 on sm_86 / sm_89: a grid there may be a bit long)


class LaneConfig(NamedTuple):
    """Launch configuration of the piece-lane kernel.

    The partial buffer takes ``2 * cdiv(N, piece_len) * next_pow2(D) * 4`` bytes (at
    ``piece_len`` 32, D=128 and criteo's 1.7M ids: 54 MB; at 1: 1.7 GB): the sweep tries 32
    and 128.

    Attributes:
        piece_len: Most occurrences per piece (a longer row is split over pieces).
        block_pieces: Pieces (lanes) per block of a program.
        unroll: Occurrences per lane loaded per loop step.
        num_warps: Warps per program.
    """

    piece_len: int
    block_pieces: int
    unroll: int
    num_warps: int


def check_lane_config(config: LaneConfig) -> None:
    """One line naming the values when the kernel cannot take them (a hand-edited table)."""
    pow2 = config.block_pieces >= 1 and not config.block_pieces & (config.block_pieces - 1)
    if config.piece_len < 1 or not pow2 or config.unroll < 1 or config.num_warps < 1:
        raise ConfigError(
            f"piece-lane backward: {config}: piece_len, unroll and num_warps must be at least 1 "
            "and block_pieces a power of two"
        )


@triton.jit
def _piece_sums(
    bags_ptr,
    scale_ptr,
    grad_out_ptr,
    start,  # int64 [BLOCK_PIECES] first occurrence of each lane's piece
    length,  # int64 [BLOCK_PIECES] occurrences (0: no piece)
    batch_size,
    cols,
    col_mask,
    stride_gb,
    stride_gf,
    stride_gd,
    HAS_SCALE: tl.constexpr,
    BLOCK_PIECES: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """Each lane's sum of its piece's scaled output-gradient rows, in occurrence order:
    float32 [BLOCK_PIECES, BLOCK_D]."""
    acc = tl.zeros([BLOCK_PIECES, BLOCK_D], dtype=tl.float32)
    max_len = tl.max(length, axis=0)
    # [BLOCK_PIECES, 1] columns in acc's layout: 1-D lane vectors inside the nested loops
    # trip Triton 3.6's layout pass on sm_90 (mismatched slice layouts past 16 lanes).
    start = start[:, None]
    length = length[:, None]
    pos = 0
    while pos < max_len:  # a while loop: the interpreter cannot take tensor range bounds
        for u in tl.static_range(UNROLL):
            on = (pos + u) < length
            occ = tl.where(on, start + pos + u, 0)  # occurrence 0 exists: no mask needed
            bag = tl.load(bags_ptr + occ)
            j = bag // batch_size
            b = bag % batch_size
            g = tl.load(
                grad_out_ptr + b * stride_gb + j * stride_gf + cols[None, :] * stride_gd,
                mask=on & col_mask[None, :],
                other=0.0,
            ).to(tl.float32)
            if HAS_SCALE:
                g = g * tl.load(scale_ptr + occ, mask=on, other=0.0)
            acc += g
        pos += UNROLL
    return acc


@triton.jit(do_not_specialize=["seed"])  # a new seed every update: no recompiles
def _piece_lanes_kernel(
    weight_ptr,  # float32/bfloat16/float16 [R, D] updated in place; float32 [U, D] out (MODE 3)
    m1_ptr,  # float32 [R] (row-wise Adagrad) or [R, D] (Adam)
    m2_ptr,  # float32 [R, D] (Adam)
    keys_ptr,  # int32 or int64 [N] non-decreasing: destination row of each sorted occurrence
    bags_ptr,  # int64 [N] bag of each sorted occurrence
    scale_ptr,  # float32 [N] (read only if HAS_SCALE)
    grad_out_ptr,  # float32, bfloat16 or float16 [B, S, D], any strides
    piece_start_ptr,  # int64 [N+1] (build_pieces)
    num_pieces_ptr,  # int64 [1] P
    part_ptr,  # float32 [2W, BLOCK_D] partial sums of split segments' pieces
    owner_ptr,  # int64 [W] start of the split segment whose first piece starts in the window, else -1
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
    PIECE_LEN: tl.constexpr,
    BLOCK_PIECES: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UNROLL: tl.constexpr,
):
    lr = tl.load(lr_ptr)
    num_pieces = tl.load(num_pieces_ptr)
    lanes = tl.arange(0, BLOCK_PIECES)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < dim
    blk = tl.program_id(0).to(tl.int64)
    while blk * BLOCK_PIECES < num_pieces:
        q = blk * BLOCK_PIECES + lanes
        live = q < num_pieces
        start = tl.load(piece_start_ptr + q, mask=live, other=0)
        end = tl.load(piece_start_ptr + q + 1, mask=live, other=0)
        # The rows' keys, and the rows a whole piece updates, are loaded before the walk:
        # their latency overlaps the gradient rows' instead of following it.
        key = tl.load(keys_ptr + start, mask=live, other=0)
        before = tl.load(keys_ptr + start - 1, mask=live & (start > 0), other=-1)
        end_safe = tl.where(live & (end < num_occ), end, 0)
        after = tl.where(live & (end < num_occ), tl.load(keys_ptr + end_safe), -1)
        # Keys are >= 0, so -1 marks "no occurrence" before the first or after the last.
        opens = before != key
        closes = after != key
        whole = live & opens & closes
        w = _load_rows(weight_ptr, key, whole, cols, col_mask, stride_w, MODE)
        acc = _piece_sums(
            bags_ptr, scale_ptr, grad_out_ptr, start, end - start, batch_size, cols, col_mask,
            stride_gb, stride_gf, stride_gd, HAS_SCALE, BLOCK_PIECES, BLOCK_D, UNROLL,
        )  # fmt: skip
        _update_rows(
            weight_ptr, m1_ptr, m2_ptr, key, acc, w, whole, cols, col_mask, dim, stride_w, lr, eps, beta1,
            beta2, one_minus_beta1, one_minus_beta2, weight_decay, bias_c1, bias_c2, seed, MODE, STOCHASTIC,
        )  # fmt: skip
        split = live & ~whole
        window = start // PIECE_LEN
        slot = 2 * window + closes.to(tl.int64)
        tl.store(part_ptr + slot[:, None] * BLOCK_D + cols[None, :], acc, mask=split[:, None])
        tl.store(owner_ptr + window, start, mask=split & opens)
        blk += tl.num_programs(0)


@triton.jit
def _segment_partials(keys_ptr, part_ptr, first, key, num_occ, cols, PIECE_LEN: tl.constexpr,
                      BLOCK_D: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    """Sum of the partials of the split segment of ``key`` starting at occurrence ``first``,
    in piece order: float32 [BLOCK_D]."""
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    k = 0
    inside_count = CHUNK
    while inside_count == CHUNK:  # the chunk's pieces were all in the segment: more may follow
        pstart = first + (k + tl.arange(0, CHUNK)).to(tl.int64) * PIECE_LEN
        inside = (pstart < num_occ) & (tl.load(keys_ptr + pstart, mask=pstart < num_occ, other=-1) == key)
        nxt = pstart + PIECE_LEN
        goes_on = tl.load(keys_ptr + nxt, mask=inside & (nxt < num_occ), other=-1) == key
        slot = 2 * (pstart // PIECE_LEN) + (~goes_on).to(tl.int64)
        parts = tl.load(part_ptr + slot[:, None] * BLOCK_D + cols[None, :], mask=inside[:, None], other=0.0)
        acc += tl.sum(parts, axis=0)
        inside_count = tl.sum(goes_on.to(tl.int32), axis=0)
        k += CHUNK
    return acc


@triton.jit(do_not_specialize=["seed"])
def _piece_combine_kernel(
    weight_ptr,
    m1_ptr,
    m2_ptr,
    keys_ptr,
    part_ptr,
    owner_ptr,
    num_occ,
    num_windows,
    dim,
    stride_w,
    lr_ptr,  # float32 [1] the learning rate (a device scalar: a captured step replays its updates)
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
    PIECE_LEN: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHUNK: tl.constexpr,
    WINDOWS: tl.constexpr,
):
    lr = tl.load(lr_ptr)
    ws = tl.program_id(0).to(tl.int64) * WINDOWS + tl.arange(0, WINDOWS)
    owners = tl.load(owner_ptr + ws, mask=ws < num_windows, other=-1)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < dim
    one = tl.zeros([1], dtype=tl.int64)
    for i in range(WINDOWS):
        first = tl.max(tl.where(tl.arange(0, WINDOWS) == i, owners, -1), axis=0)
        if first >= 0:
            key = tl.load(keys_ptr + first).to(tl.int64)
            acc = _segment_partials(keys_ptr, part_ptr, first, key, num_occ, cols, PIECE_LEN, BLOCK_D, CHUNK)
            rows, live = key + one, one == 0
            w = _load_rows(weight_ptr, rows, live, cols, col_mask, stride_w, MODE)
            _update_rows(
                weight_ptr, m1_ptr, m2_ptr, rows, acc[None, :], w, live, cols, col_mask, dim, stride_w,
                lr, eps, beta1, beta2, one_minus_beta1, one_minus_beta2, weight_decay, bias_c1, bias_c2, seed,
                MODE, STOCHASTIC,
            )  # fmt: skip


def _programs_per_sm(registers: int, num_warps: int) -> int:
    """Programs of ``num_warps`` warps at ``registers`` per thread that one SM holds at once."""
    threads = 32 * num_warps
    return max(1, min(SM_REGISTERS // (max(registers, 1) * threads), SM_THREADS // threads))


class LaneGrid:
    """The lane kernel's grid: one resident wave per SM, learned per compiled kernel.

    A launch's signature (device, dtypes, mode, configuration) maps to its compiled
    kernel's programs per SM once that kernel has run (its register count); before, the
    safe ``SAFE_WARPS_PER_SM``. The grid changes no bit of the result: every piece is
    summed by one lane and written to its own row or slot whatever program takes it.
    """

    def __init__(self) -> None:
        self._per_sm: dict[tuple, int] = {}

    def programs(self, signature: tuple, num_occ: int, config: LaneConfig, device: torch.device) -> int:
        """Programs for ``num_occ`` occurrences: at most one per block of pieces (P <= N)."""
        blocks = triton.cdiv(num_occ, config.block_pieces)
        if device.type != "cuda":
            return min(blocks, 4)  # the interpreter runs programs one after another
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        per_sm = self._per_sm.get(signature, max(1, SAFE_WARPS_PER_SM // config.num_warps))
        return min(blocks, sms * per_sm)

    def learn(self, signature: tuple, compiled: object, config: LaneConfig) -> None:
        """Records the compiled kernel's programs per SM (a launch's return; None when interpreted)."""
        registers = getattr(compiled, "n_regs", None)
        if signature not in self._per_sm and isinstance(registers, int) and registers > 0:
            self._per_sm[signature] = _programs_per_sm(registers, config.num_warps)


LANE_GRID = LaneGrid()  # like Triton's kernel cache: one per process, filled by launches


def launch_lanes(
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
    config: LaneConfig,
    pieces: Pieces | None = None,
) -> None:
    """Runs the lane kernel and then the combine kernel over ``keys.numel() > 0`` sorted
    occurrences; the arguments are those of the occurrence tiles' launcher
    (``hyper``: lr, eps, beta1, beta2, 1 - beta1, 1 - beta2, weight_decay, bias_c1, bias_c2; lr
    a float32 [1] device tensor),
    and ``pieces``: :func:`build_pieces` of ``keys`` at ``config.piece_len`` when already made."""
    check_lane_config(config)
    num_occ, dim = keys.numel(), target.shape[1]
    block_d = triton.next_power_of_2(dim)
    pieces = build_pieces(keys, config.piece_len) if pieces is None else pieces
    num_windows = triton.cdiv(num_occ, config.piece_len)
    part = torch.empty(2 * num_windows, block_d, dtype=torch.float32, device=target.device)
    owner = torch.full((num_windows,), -1, dtype=torch.int64, device=target.device)
    stochastic = target.dtype in (torch.bfloat16, torch.float16)
    signature = (
        target.device,
        target.dtype,
        grad_out.dtype,
        keys.dtype,
        mode,
        scale is None,
        config,
        dim,
    )
    programs = LANE_GRID.programs(signature, num_occ, config, target.device)
    compiled = _piece_lanes_kernel[(programs,)](
        target, m1, m2, keys, bags, bags if scale is None else scale, grad_out, pieces.start, pieces.count,
        part, owner, num_occ, batch_size, dim, target.stride(0),
        grad_out.stride(0), grad_out.stride(1), grad_out.stride(2), *hyper, seed,
        MODE=mode, STOCHASTIC=stochastic, HAS_SCALE=scale is not None, PIECE_LEN=config.piece_len,
        BLOCK_PIECES=config.block_pieces, BLOCK_D=block_d, UNROLL=config.unroll, num_warps=config.num_warps,
    )  # fmt: skip
    LANE_GRID.learn(signature, compiled, config)
    if num_occ > config.piece_len:  # else no segment is split
        _piece_combine_kernel[(triton.cdiv(num_windows, COMBINE_WINDOWS),)](
            target, m1, m2, keys, part, owner, num_occ, num_windows, dim, target.stride(0), *hyper, seed,
            MODE=mode, STOCHASTIC=stochastic, PIECE_LEN=config.piece_len, BLOCK_D=block_d,
            CHUNK=partials_per_step(block_d), WINDOWS=COMBINE_WINDOWS, num_warps=FIXUP_WARPS,
        )  # fmt: skip
