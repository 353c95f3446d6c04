"""Kernel-only benchmark and config sweep of the bag-tile embedding forward.

One command on a lent GPU (about 2-4 minutes on an H100/H200; ``--quick`` times only the
default config)::

    python -m recaccel.bench.forward_tiles --out "$OUT/forward_tiles.json"

Per case (the gpu-check embedding cases, fp32 and bf16 rows) it checks the default
config's output against the reference lookup, then times the forward launch alone (CUDA
events, interleaved, median) for the default config and every candidate of
:func:`candidate_configs`, and reports GB/s in the embedding benchmark's byte accounting
(each id's row read once, ids and offsets read, the pooled output written) and as a share
of the device-to-device copy bandwidth measured in the same run. The JSON is rewritten
after every case, so a run cut short keeps what it measured; its ``best`` entries are what
:data:`recaccel.ops.embedding.triton.forward.FORWARD_TABLE` takes. ``--device cpu`` runs one
tiny case under the Triton interpreter (a smoke test, no meaningful time).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from pathlib import Path

import torch

from recaccel.bench.common import measure_copy_bandwidth, time_interleaved
from recaccel.ops.embedding.packing import gather_pack_ids
from recaccel.ops.embedding.reference import reference_lookup

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ForwardCase:
    """One forward shape: T tables of R rows, B bags each of L ids (L=0: uniform 0..40)."""

    tables: int
    batch: int
    dim: int
    length: int
    dtype: str
    rows: int = 20000

    @property
    def name(self) -> str:
        length = "var" if self.length == 0 else self.length
        return f"T{self.tables}_B{self.batch}_D{self.dim}_L{length}_{self.dtype}"


GPU_CASES = [
    ForwardCase(26, 16384, 128, 1, "float32"),
    ForwardCase(26, 16384, 128, 20, "float32"),
    ForwardCase(26, 65536, 128, 1, "float32"),
    ForwardCase(100, 16384, 64, 20, "float32"),
    ForwardCase(26, 16384, 128, 1, "bfloat16"),
    ForwardCase(26, 16384, 128, 20, "bfloat16"),
    ForwardCase(26, 16384, 32, 0, "float32"),
    ForwardCase(26, 16384, 256, 20, "float32"),
    ForwardCase(500, 4096, 32, 1, "float32"),
]
CPU_CASES = [ForwardCase(2, 8, 16, 0, "float32", rows=50)]


def candidate_configs(dim: int):
    """The sweep: BLOCK_BAGS x warps x UNROLL within the tile kernel's register budget."""
    from recaccel.ops.embedding.triton.forward import ForwardConfig

    block_d = 1 << (dim - 1).bit_length()
    for block_bags in (8, 16, 32, 64, 128):
        for num_warps in (2, 4, 8):
            for unroll in (1, 2, 4):
                if block_bags * block_d <= 8192 and block_bags * block_d * unroll <= 16384:
                    yield ForwardConfig(block_bags, num_warps, unroll, 256)


def make_case(case: ForwardCase, device: torch.device, seed: int = 0):
    """(weight [T*R, D], batch, local features) of a case, seeded: the tuning run's batch
    (:func:`recaccel.bench.kernels.make_batch`) with uniform ids."""
    from recaccel.bench.kernels import KernelCase, make_batch

    shape = KernelCase("forward", case.tables, case.batch, case.dim, case.length, case.dtype, rows=case.rows)
    return make_batch(shape, device, seed)


def bytes_moved(case: ForwardCase, num_ids: int, element_size: int) -> int:
    """Minimum forward traffic: each id's row once, ids and offsets, the float32 output."""
    bags = case.tables * case.batch
    return num_ids * case.dim * element_size + num_ids * 8 + (bags + 1) * 8 + bags * case.dim * 4


def run_case(case: ForwardCase, device: torch.device, copy_gbs: float, quick: bool) -> dict:
    """Checks the default config against the reference, then times each config."""
    from recaccel.ops.embedding.triton.forward import embedding_bag_forward, forward_config

    weight, sf, local = make_case(case, device)
    out = embedding_bag_forward(weight, sf, local, case.batch)
    want = reference_lookup(weight, gather_pack_ids(sf, local, case.batch), case.batch, case.tables)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    mean_len = sf.values.numel() / (case.tables * case.batch)
    configs = {"default": forward_config(case.dim, mean_len, weight.dtype)}
    if not quick:
        configs.update(
            {f"bb{c.block_bags}_w{c.num_warps}_u{c.unroll}": c for c in candidate_configs(case.dim)}
        )
    runs = {
        name: (lambda c=c: embedding_bag_forward(weight, sf, local, case.batch, out=out, config=c))
        for name, c in configs.items()
    }
    repeats, warmup = (20, 3) if device.type == "cuda" else (1, 1)
    ms = time_interleaved(runs, repeats, warmup, device)
    nbytes = bytes_moved(case, sf.values.numel(), weight.element_size())
    results = {
        name: {
            "ms": t,
            "gb_s": nbytes / (t * 1e-3) / 1e9,
            "pct_copy": 100 * nbytes / (t * 1e-3) / 1e9 / copy_gbs,
            **dataclasses.asdict(configs[name]),
        }
        for name, t in ms.items()
    }
    best = min(results, key=lambda n: results[n]["ms"])
    log.info("%s: default %.1f%% of copy, best %s %.1f%%", case.name, results["default"]["pct_copy"], best,
             results[best]["pct_copy"])  # fmt: skip
    return {"case": dataclasses.asdict(case), "bytes": nbytes, "configs": results, "best": best}


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; see the module docstring."""
    parser = argparse.ArgumentParser(
        prog="python -m recaccel.bench.forward_tiles", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", required=True, help="JSON file, rewritten after every case")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="time only the default config")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module is imported
    elif not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")
    copy_gbs = measure_copy_bandwidth(device)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
              "copy_gb_s": copy_gbs, "cases": []}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for case in GPU_CASES if device.type == "cuda" else CPU_CASES:
        report["cases"].append(run_case(case, device, copy_gbs, args.quick))
        out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
