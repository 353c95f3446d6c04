"""The GPU targets of ``make gpu-check``, read off the benchmarks' results.

Each target is judged from the files the benchmarks wrote in one run (their JSON, and
the io benchmark's markdown table) against the ceilings :mod:`recaccel.bench.gpu_check`
measured in the same run. A target whose figure is absent (benchmark skipped, failed,
or no case in the target's range) is ``"not measured"``, never guessed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

MET, NOT_MET, NOT_MEASURED = "met", "not met", "not measured"

# The range of shapes the embedding bandwidth targets hold over (inclusive).
EMBEDDING_RANGE = {"T": (26, 1000), "B": (16_384, 65_536), "D": (64, 128), "L": (1, 20)}
# Embedding candidates that are not recaccel's own packed kernels.
NOT_PACKED = ("per_table", "fbgemm")
TRAIN_FAST, TRAIN_EAGER = "recaccel", "eager"
# The pipelined step of the interleaving targets: train.pipeline=sync, one micro-batch, CUDA graphs.
PIPELINED = ("sync", 1, True)


def _load_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _row(target: str, threshold: float, value: float | None, figure: str, source: str, higher=True) -> dict:
    if value is None:
        status = NOT_MEASURED
    else:
        status = MET if (value >= threshold if higher else value < threshold) else NOT_MET
    return {
        "target": target,
        "threshold": threshold,
        "value": value,
        "figure": figure if value is not None else "-",
        "status": status,
        "source": source,
    }


def _in_range(row: Mapping) -> bool:
    return all(lo <= row.get(key, -1) <= hi for key, (lo, hi) in EMBEDDING_RANGE.items())


def embedding_bandwidth(results: Sequence[Mapping], mode: str, copy_gbps: float | None) -> tuple:
    """Worst, over the in-range cases, of the best packed candidate's share of the copy bandwidth.

    Args:
        results: the embedding benchmark's rows (``T, B, D, L, mode, <name>_ms, MB_moved``).
        mode: ``"forward"`` or ``"fwd+bwd+update"``.
        copy_gbps: device-to-device copy bandwidth (read + write) of this run, GB/s.

    Returns:
        (fraction or None, a figure naming the candidate and case).
    """
    if not copy_gbps:
        return None, ""
    worst = None
    for row in results:
        if row.get("mode") != mode or not _in_range(row) or not row.get("MB_moved"):
            continue
        fracs = {
            key.removesuffix("_ms"): row["MB_moved"] * 1e6 / (ms * 1e-3) / 1e9 / copy_gbps
            for key, ms in row.items()
            if key.endswith("_ms") and ms and key.removesuffix("_ms") not in NOT_PACKED
        }
        if not fracs:
            continue
        name = max(fracs, key=fracs.get)
        if worst is None or fracs[name] < worst[0]:
            worst = (fracs[name], name, row)
    if worst is None:
        return None, ""
    frac, name, row = worst
    case = f"T={row['T']} B={row['B']} D={row['D']} L={row['L']}"
    return frac, f"{frac:.1%} ({name}, worst case {case})"


def interaction_speedup(results: Sequence[Mapping]) -> tuple:
    """Smallest forward+backward speedup of the fused interaction over eager, and its shape."""
    rows = [r for r in results if r.get("fwd_bwd_speedup")]
    if not rows:
        return None, ""
    row = min(rows, key=lambda r: r["fwd_bwd_speedup"])
    shape = f"B={row['batch']} F={row['fields']} D={row['dim']} {row.get('dtype', '')}".strip()
    return row["fwd_bwd_speedup"], f"{row['fwd_bwd_speedup']:.2f}x (worst, {shape})"


def _preset_name(value) -> str:
    return Path(str(value)).stem


def _is_reader_row(row: Mapping) -> bool:
    """Whether a train-benchmark row fed its steps through the Parquet reader (not device data)."""
    texts = [str(v).lower() for k, v in row.items() if k not in ("preset", "device") and isinstance(v, str)]
    return any("reader" in t or "parquet" in t for t in texts)


def train_rows(results: Sequence[Mapping], candidate: str, preset: str, reader: bool) -> list[Mapping]:
    """The train benchmark's rows of ``candidate`` on ``preset`` (device data, or through the reader)."""
    return [
        r
        for r in results
        if r.get("candidate") == candidate
        and _preset_name(r.get("preset")) == preset
        and _is_reader_row(r) == reader
    ]


def _combination(row: Mapping) -> str:
    if row.get("pipeline") is None:
        return ""
    return f", {row['pipeline']}/{row.get('micro_batches')}/{'on' if row.get('cuda_graphs') else 'off'}"


def train_figure(results: Sequence[Mapping], preset: str, key: str) -> tuple:
    """``key`` (``speedup_vs_eager`` or ``samples_per_s``) of recaccel's fastest device-data
    row (over its pipeline / micro-batch / CUDA-graph combinations, named in the figure)."""
    rows = [r for r in train_rows(results, TRAIN_FAST, preset, reader=False) if r.get(key) is not None]
    if not rows:
        return None, ""
    row = max(rows, key=lambda r: r.get("samples_per_s") or 0.0)
    value = float(row[key])
    text = f"{value / 1e6:.2f} M samples/s" if key == "samples_per_s" else f"{value:.2f}x eager"
    return value, f"{text} (batch {row.get('batch')}{_combination(row)})"


def pipelined_speedup(results: Sequence[Mapping], preset: str) -> tuple:
    """``speedup_vs_off`` of recaccel's ``sync/1/on`` device-data row on ``preset`` (the
    same run's ``off/1/off`` over it); the reader's figure, when measured, is named too."""

    def find(reader: bool) -> Mapping | None:
        for row in train_rows(results, TRAIN_FAST, preset, reader):
            combination = (row.get("pipeline"), row.get("micro_batches"), row.get("cuda_graphs"))
            if combination == PIPELINED and row.get("speedup_vs_off"):
                return row
        return None

    row = find(reader=False)
    if row is None:
        return None, ""
    value = float(row["speedup_vs_off"])
    text = f"{value:.2f}x off/1/off (device data, batch {row.get('batch')}"
    reader = find(reader=True)
    if reader is not None:
        text += f"; through the reader {float(reader['speedup_vs_off']):.2f}x"
    return value, text + ")"


def _data_wait_key(phases: Mapping) -> str | None:
    keys = [k for k in phases if "data" in k.lower() and "wait" in k.lower()]
    return keys[0] if keys else None


def train_data_wait(results: Sequence[Mapping]) -> tuple:
    """Largest data-wait share of step time of recaccel's rows through the reader."""
    worst = None
    for row in results:
        if row.get("candidate") != TRAIN_FAST or not _is_reader_row(row) or not row.get("step_ms"):
            continue
        key = _data_wait_key(row.get("phases_ms") or {})
        if key is None:
            continue
        frac = row["phases_ms"][key] / row["step_ms"]
        if worst is None or frac > worst[0]:
            worst = (frac, row)
    if worst is None:
        return None, ""
    frac, row = worst
    return frac, f"{frac:.2%} of step time ({_preset_name(row.get('preset'))}, through the reader)"


def markdown_rows(text: str) -> list[dict[str, str]]:
    """The rows of the first markdown table in ``text`` (header -> cell), as written by
    :func:`recaccel.bench.common.markdown_table`."""
    lines = [ln.strip() for ln in text.splitlines()]
    for i, line in enumerate(lines[:-1]):
        if line.startswith("|") and lines[i + 1].startswith("|---"):
            header = [c.strip() for c in line.strip("|").split("|")]
            rows = []
            for body in lines[i + 2 :]:
                if not body.startswith("|"):
                    break
                rows.append(dict(zip(header, (c.strip() for c in body.strip("|").split("|")))))
            return rows
    return []


def io_data_wait(text: str) -> tuple:
    """The io benchmark's data-wait fraction of its training run (debug DLRM through the loader)."""
    for row in markdown_rows(text):
        if row.get("candidate", "").startswith("debug_dlrm_train"):
            try:
                frac = float(row.get("data_wait_fraction", ""))
            except ValueError:
                return None, ""
            return frac, f"{frac:.2%} of training time ({row['candidate']}, io benchmark)"
    return None, ""


def evaluate(parts: Path, ceilings: Mapping) -> list[dict]:
    """Every target of the issue, judged from the result files in ``parts``.

    Args:
        parts: folder holding ``embedding.json``, ``interaction.json``, ``train.json``, ``io.md``.
        ceilings: this run's ``copy_GBps`` (and ``matmul_TFLOPs``).

    Returns:
        One dict per target: target, threshold, value, figure, status, source.
    """
    emb = (_load_json(parts / "embedding.json") or {}).get("results", [])
    inter = (_load_json(parts / "interaction.json") or {}).get("results", [])
    train = (_load_json(parts / "train.json") or {}).get("results", [])
    copy = ceilings.get("copy_GBps")
    rows = []
    for mode, share in (("forward", 0.70), ("fwd+bwd+update", 0.40)):
        value, figure = embedding_bandwidth(emb, mode, copy)
        rows.append(
            _row(f"embedding {mode} >= {share:.0%} of copy bandwidth", share, value, figure, "embedding.json")
        )
    value, figure = interaction_speedup(inter)
    rows.append(_row("interaction fwd+bwd >= 2x eager", 2.0, value, figure, "interaction.json"))
    specs: list[tuple[str, float, Callable[[], tuple]]] = [
        (
            "bench_criteo_1hot >= 3x eager",
            3.0,
            lambda: train_figure(train, "bench_criteo_1hot", "speedup_vs_eager"),
        ),
        (
            "bench_criteo_1hot >= 6 M samples/s",
            6e6,
            lambda: train_figure(train, "bench_criteo_1hot", "samples_per_s"),
        ),
        ("bench_wide >= 10x eager", 10.0, lambda: train_figure(train, "bench_wide", "speedup_vs_eager")),
        (
            "bench_criteo_1hot sync + CUDA graphs >= 1.3x off",
            1.3,
            lambda: pipelined_speedup(train, "bench_criteo_1hot"),
        ),
        ("bench_wide sync + CUDA graphs >= 1.5x off", 1.5, lambda: pipelined_speedup(train, "bench_wide")),
    ]
    for name, threshold, figure_of in specs:
        rows.append(_row(name, threshold, *figure_of(), "train.json"))
    value, figure = train_data_wait(train)
    source = "train.json"
    if value is None:
        io_md = parts / "io.md"
        value, figure = io_data_wait(io_md.read_text()) if io_md.is_file() else (None, "")
        source = "io.md"
    rows.append(_row("data wait < 1% of step time", 0.01, value, figure, source, higher=False))
    return rows
