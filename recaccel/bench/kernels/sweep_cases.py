"""The cases and candidate configs of ``recaccel-bench kernels``: the shapes swept (GPU
and tiny CPU ones), each case's seeded batch, and the configs tried for the forward and
the backward + fused update kernels."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from recaccel.bench.kernels.embedding_cases import state_floats_per_row
from recaccel.sparse import SparseFeatures

OPTIMIZER = "rowwise_adagrad"  # the fused update the sweep times (the presets' sparse optimizer)
SUBTILES = (4, 16)  # chunks per backward program tried around the best one-chunk config
PIECE_LENS = (32, 128)  # most occurrences per piece tried for the piece-lane backward
LANE_VALUES_PER_THREAD = 16  # a lane block's float32 sums per thread (sm_90: 78-126 registers, no spills)
_ROUNDING_SEED = 12345


@dataclasses.dataclass(frozen=True)
class KernelCase:
    """One shape: T tables of R rows, B bags each of L ids (0: uniform 0..40), ids uniform or Zipf.

    Attributes:
        kernel: ``"forward"`` or ``"backward"`` (backward + fused update).
        tables: T.
        batch: B.
        dim: D.
        length: Ids per bag; 0 for lengths uniform in 0..40.
        dtype: Row dtype name (``float32``, ``bfloat16``).
        zipf: Ids Zipf-distributed (hot rows) instead of uniform.
        rows: R, rows per table.
    """

    kernel: str
    tables: int
    batch: int
    dim: int
    length: int
    dtype: str
    zipf: bool = False
    rows: int = 20000

    @property
    def name(self) -> str:
        length = "var" if self.length == 0 else self.length
        ids = "_zipf" if self.zipf else ""
        kernel = {"forward": "fwd", "backward": "bwd"}[self.kernel]
        return f"{kernel}_T{self.tables}_B{self.batch}_D{self.dim}_L{length}{ids}_{self.dtype}"

    @property
    def mean_len(self) -> float:
        return self.length if self.length else 20.0

    @property
    def density(self) -> int:
        """The backward key's bucket: occurrences per row of the pack (T*R rows)."""
        from recaccel.ops.embedding.triton.backward_config import density_bucket

        return density_bucket(round(self.tables * self.batch * self.mean_len), self.tables * self.rows)


def _cases(kernel: str, zipf_backward: bool) -> list[KernelCase]:
    """The sweep's shapes for one kernel, most important first (the gpu-check cases lead)."""
    z = zipf_backward and kernel == "backward"
    k = kernel
    return [
        KernelCase(k, 26, 16384, 128, 1, "float32", z),
        KernelCase(k, 26, 16384, 128, 20, "float32", z),
        KernelCase(k, 26, 65536, 128, 1, "float32", z),
        KernelCase(k, 26, 16384, 128, 1, "bfloat16", z),
        KernelCase(k, 26, 16384, 128, 20, "bfloat16", z),
        KernelCase(k, 500, 4096, 32, 1, "float32", z, rows=2000),
        KernelCase(k, 26, 16384, 64, 20, "float32", z),
        KernelCase(k, 26, 16384, 256, 20, "float32", z),
        KernelCase(k, 26, 16384, 16, 20, "float32", z),
        KernelCase(k, 26, 16384, 32, 0, "float32", z),
        KernelCase(k, 26, 16384, 128, 20, "float32", not z),
        KernelCase(k, 26, 65536, 128, 20, "bfloat16", z),
    ]


def gpu_cases() -> list[KernelCase]:
    """Forward and backward cases interleaved, so a run cut short has the leading ones of both."""
    fwd, bwd = _cases("forward", False), _cases("backward", True)
    return [case for pair in zip(fwd, bwd, strict=True) for case in pair]


CPU_CASES = [
    KernelCase("forward", 2, 8, 16, 0, "float32", rows=50),
    KernelCase("backward", 2, 8, 16, 3, "float32", zipf=True, rows=50),
]


@dataclasses.dataclass
class Candidate:
    """One config of a case: its fields and the call that runs it once.

    Attributes:
        fields: The config's integer fields (what the tuning table stores).
        run: Runs the kernel once with this config and returns its output to compare.
        timed: What is timed, when not ``run`` (e.g. the update in place, without copies).
    """

    fields: dict[str, int]
    run: Callable[[], torch.Tensor]
    timed: Callable[[], object] | None = None


def _zipf_ids(rows: int, count: int, gen: torch.Generator, alpha: float = 1.05) -> torch.Tensor:
    """``count`` ids in 0..rows-1, row ``k`` with weight ``1/(k+1)^alpha`` (inverse CDF)."""
    p = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** alpha
    cdf = torch.cumsum(p / p.sum(), 0)
    u = torch.rand(count, generator=gen, dtype=torch.float64)
    return torch.searchsorted(cdf, u).clamp_(max=rows - 1)


def make_batch(case: KernelCase, device: torch.device, seed: int = 0):
    """(weight [T*R, D], batch, local features) of a case, seeded."""
    from recaccel.ops.embedding.packing import LocalFeatures

    gen = torch.Generator().manual_seed(seed)
    bags = case.tables * case.batch
    if case.length:
        lengths = torch.full((bags,), case.length, dtype=torch.int64)
    else:
        lengths = torch.randint(0, 41, (bags,), generator=gen)
    count = int(lengths.sum())
    if case.zipf:
        ids = _zipf_ids(case.rows, count, gen)
    else:
        ids = torch.randint(0, case.rows, (count,), generator=gen)
    keys = [f"t{i}" for i in range(case.tables)]
    sf = SparseFeatures.from_lengths(keys, ids, lengths).to(device)
    weight = torch.randn(case.tables * case.rows, case.dim, generator=gen).to(
        device, getattr(torch, case.dtype)
    )
    offsets = [t * case.rows for t in range(case.tables)]
    local = LocalFeatures.build(list(range(case.tables)), offsets, [False] * case.tables, case.tables, device)
    return weight, sf, local


def config_name(fields: dict[str, int]) -> str:
    """A config's short name in the tables: ``bb8_w4_u2``."""
    short = {"block_bags": "bb", "num_warps": "w", "unroll": "u", "block_occ": "occ", "subtiles": "st",
             "piece_len": "pl", "block_pieces": "bp"}  # fmt: skip
    return "_".join(f"{short[k]}{v}" for k, v in fields.items() if k in short)


def forward_sweep(case: KernelCase) -> list[dict[str, int]]:
    """BLOCK_BAGS x warps x UNROLL within the tile kernel's register budget (UNROLL 1 for L=1).

    At most 128 sum and in-flight row values per thread: sm90_report compiles BLOCK_BAGS 64,
    D 128, UNROLL 1, 4 warps (128) to 237 registers without spills, UNROLL 2 at 2 warps
    (384) to 255 registers and 852 bytes of spill stores.
    """
    from recaccel.ops.embedding.triton.forward import forward_config

    block_d = 1 << (case.dim - 1).bit_length()
    long_threshold = forward_config(case.dim, case.mean_len, getattr(torch, case.dtype)).long_threshold
    unrolls = (1,) if case.length == 1 else (1, 2, 4)
    return [
        {"block_bags": bb, "num_warps": w, "unroll": u, "long_threshold": long_threshold}
        for bb in (16, 32, 64, 128)
        for w in (2, 4, 8)
        for u in unrolls
        if bb * block_d <= 8192 and bb * block_d * u <= 16384 and bb * block_d * (1 + u) <= 128 * 32 * w
    ]


def backward_sweep(case: KernelCase, base: dict[str, int] | None = None) -> list[dict[str, int]]:
    """The occurrence tiles' configs (:func:`tile_sweep`), then the piece lanes'
    (:func:`lane_sweep`)."""
    return tile_sweep(case, base) + lane_sweep(case)


def tile_sweep(case: KernelCase, base: dict[str, int] | None = None) -> list[dict[str, int]]:
    """One-chunk configs, then programs of ``SUBTILES`` chunks at the one-chunk BLOCK_OCC of
    ``base`` (the device's tuned entry) with its warps and 4 (4 configs).

    Without a tuned tile entry (None, or a lane entry), the one-chunk configs are BLOCK_OCC
    x warps with a 512..4096-value tile and at most 32 values per thread (a value, its scan
    flag and the scan's temporaries: 4096 at 4 warps takes 191-255 registers), and the
    multi-chunk ones sit at the heuristic default; with one, only its one-chunk config: the
    sweep refines around what an earlier run found, and its budget goes to the lanes.
    """
    from recaccel.ops.embedding.triton.backward import tile_config

    if base is None or "block_occ" not in base:
        block_d = 1 << (case.dim - 1).bit_length()
        one_chunk = [
            {"block_occ": occ, "num_warps": w}
            for occ in (8, 16, 32, 64, 128, 256)
            for w in (2, 4, 8)
            if (512 <= occ * block_d <= 4096 and occ * block_d <= 32 * 32 * w)
            or (occ == 8 and occ * block_d > 4096)
        ]
        occ, warps, _ = tile_config(case.dim)
    else:
        occ, warps = base["block_occ"], base["num_warps"]
        one_chunk = [{"block_occ": occ, "num_warps": warps}]
    longer = [
        {"block_occ": occ, "num_warps": w, "subtiles": st} for w in sorted({warps, 4}) for st in SUBTILES
    ]
    return one_chunk + longer


def lane_sweep(case: KernelCase) -> list[dict[str, int]]:
    """``PIECE_LENS`` x (lanes, warps) x UNROLL 1, 2: lanes sized so that a block's sums are
    ``LANE_VALUES_PER_THREAD`` float32 per thread at 4 and 8 warps (sm_90, D=128: 16 lanes
    at 4 warps and 32 at 8 compile to 78-126 registers, no spills, 16-byte row loads)."""
    block_d = 1 << (case.dim - 1).bit_length()
    shapes = []
    for w in (4, 8):
        lanes = LANE_VALUES_PER_THREAD * 32 * w // block_d
        if 4 <= lanes <= 128:
            shapes.append((lanes, w))
    return [
        {"piece_len": pl, "block_pieces": lanes, "unroll": u, "num_warps": w}
        for pl in PIECE_LENS
        for lanes, w in shapes
        for u in (1, 2)
    ]


def backward_config(fields: dict[str, int]):
    """The launch configuration a sweep entry names: piece lanes where it has ``piece_len``."""
    from recaccel.ops.embedding.triton.backward import TileConfig
    from recaccel.ops.embedding.triton.piece_lanes import LaneConfig

    if "piece_len" in fields:
        return LaneConfig(fields["piece_len"], fields["block_pieces"], fields["unroll"], fields["num_warps"])
    return TileConfig(fields["block_occ"], fields["num_warps"], fields.get("subtiles", 1))


def forward_candidates(case: KernelCase, device: torch.device) -> tuple[dict[str, Candidate], int]:
    """The forward's default (first) and swept configs, and the case's bytes moved."""
    from recaccel.ops.embedding.triton.forward import ForwardConfig, embedding_bag_forward, forward_config

    weight, sf, local = make_batch(case, device)
    out = torch.empty(case.batch, case.tables, case.dim, device=device)
    default = dataclasses.asdict(forward_config(case.dim, case.mean_len, weight.dtype))

    def candidate(fields: dict[str, int]) -> Candidate:
        config = ForwardConfig(**fields)
        return Candidate(
            fields, lambda: embedding_bag_forward(weight, sf, local, case.batch, out=out, config=config)
        )

    configs = {"default": candidate(default)}
    configs.update({config_name(f): candidate(f) for f in forward_sweep(case) if f != default})
    num_ids, bags = sf.values.numel(), case.tables * case.batch
    nbytes = num_ids * case.dim * weight.element_size() + num_ids * 8 + (bags + 1) * 8 + bags * case.dim * 4
    return configs, nbytes


def backward_candidates(case: KernelCase, device: torch.device) -> tuple[dict[str, Candidate], int]:
    """The backward update's default (first) and swept configs (occurrence tiles and piece
    lanes), and the bytes moved.

    Each candidate's check run updates a fresh copy of the same initial state and returns
    the updated rows and Adagrad state; timing repeats the kernels alone on another copy.
    """
    from recaccel.ops.embedding.optimizers import init_states
    from recaccel.ops.embedding.packing import gather_pack_ids
    from recaccel.ops.embedding.row_groups import group_by_row
    from recaccel.ops.embedding.specs import SparseOptimConfig
    from recaccel.ops.embedding.triton import tuning
    from recaccel.ops.embedding.triton.backward import launch_backward, tile_config
    from recaccel.ops.embedding.triton.pieces import build_pieces

    weight, sf, local = make_batch(case, device)
    ids = gather_pack_ids(sf, local, case.batch, with_bags=True)
    groups = group_by_row(ids.rows, weight.shape[0])
    keys, bags = groups.sorted_rows, ids.bags.index_select(0, groups.order)  # as fused_update reads them
    grad_out = torch.randn(case.batch, case.tables, case.dim, generator=torch.Generator().manual_seed(1)).to(
        device
    )
    momentum = init_states(OPTIMIZER, weight.shape[0], case.dim, device)["momentum1"]
    optim = SparseOptimConfig(lr=0.01, eps=1e-8)
    lr = torch.full((1,), optim.lr, dtype=torch.float32, device=device)
    hyper = (lr, optim.eps, optim.beta1, optim.beta2, 1 - optim.beta1, 1 - optim.beta2, 0.0, 1.0, 1.0)
    stochastic_seed = _ROUNDING_SEED if weight.dtype != torch.float32 else 0

    pieces: dict[int, object] = {}  # the lanes' pieces, cut once per length: a training step
    # cuts them in the batch's preparation, on the preparing stream, not in the timed update

    def update(w: torch.Tensor, m: torch.Tensor, fields: dict[str, int]) -> None:
        config = backward_config(fields)
        cut = None
        if "piece_len" in fields:
            if fields["piece_len"] not in pieces:
                pieces[fields["piece_len"]] = build_pieces(keys, fields["piece_len"])
            cut = pieces[fields["piece_len"]]
        launch_backward(
            w, m, m, keys, bags, None, grad_out, case.batch, 1, hyper, stochastic_seed, config, cut
        )  # fmt: skip

    def candidate(fields: dict[str, int]) -> Candidate:
        def run() -> torch.Tensor:
            w, m = weight.clone(), momentum.clone()
            update(w, m, fields)
            return torch.cat([w.float().flatten(), m])

        return Candidate(fields, run)

    occ, warps, _ = tile_config(case.dim)
    default = {"block_occ": occ, "num_warps": warps}
    configs = {"default": candidate(default)}
    key = tuning.backward_key(case.dim, case.dtype, case.density)
    tuned = tuning.lookup(device, key) or tuning.lookup(device, tuning.backward_key(case.dim, case.dtype))
    configs.update({config_name(f): candidate(f) for f in backward_sweep(case, tuned) if f != default})
    timed_w, timed_m = weight.clone(), momentum.clone()
    for c in configs.values():  # timing updates one copy in place: no clone inside the timed call
        c.timed = lambda f=c.fields: update(timed_w, timed_m, f)
    unique = int(torch.unique(keys).numel())
    index_bytes = keys.numel() * 8 + (case.tables * case.batch + 1) * 8
    row_bytes = case.dim * weight.element_size() + state_floats_per_row(OPTIMIZER, case.dim) * 4
    nbytes = case.batch * case.tables * case.dim * 4 + index_bytes + 2 * unique * row_bytes
    return configs, nbytes
