"""The GPU targets of ``make gpu-check``, read off the benchmarks' results.

The targets are issue 24's (item 7: training speed per precision, DCN-v2, dense head;
items 2, 3, 5: interaction, DCN-v2 kernel, exact overlap; item 6: the host-table cache,
the data cost) and issue 25's (item 6: embedding kernels against the copy bandwidth, the
criteo step's lookup and sparse update) and issue 26's (item 3: the readers' rows/s per
schema over the io benchmark's worker counts, task batches against plain ones, the data
cost at 2%). The embedding targets judge the Triton backend:
the reference backend is the specification, not a fast path.

Each target is judged from the files the benchmarks wrote in one run (their JSON) against the ceilings :mod:`recaccel.bench.gpu_check.runner`
measured in the same run. A target whose figure is absent (benchmark skipped, failed,
or no case in the target's range) is ``"not measured"``, never guessed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from recaccel.bench.step.graphs import graphs_label

MET, NOT_MET, NOT_MEASURED = "met", "not met", "not measured"

# The range of shapes the embedding bandwidth targets hold over (inclusive).
EMBEDDING_RANGE = {"T": (26, 1000), "B": (16_384, 65_536), "D": (64, 128), "L": (1, 20)}
# The embedding candidate the bandwidth targets judge (the reference is the specification).
EMBEDDING_FAST = "triton"
TRAIN_FAST, TRAIN_EAGER = "recaccel", "eager"
# The pipelined step of the interleaving targets: train.pipeline=sync, one micro-batch, CUDA graphs.
PIPELINED = ("sync", 1, "on")


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
    """Worst, over the in-range cases, of the Triton backend's share of the copy bandwidth.

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
        ms = row.get(f"{EMBEDDING_FAST}_ms")
        if not ms:
            continue
        frac = row["MB_moved"] * 1e6 / (ms * 1e-3) / 1e9 / copy_gbps
        if worst is None or frac < worst[0]:
            worst = (frac, EMBEDDING_FAST, row)
    if worst is None:
        return None, ""
    frac, name, row = worst
    case = f"T={row['T']} B={row['B']} D={row['D']} L={row['L']}"
    return frac, f"{frac:.1%} ({name}, worst case {case})"


def interaction_speedup(results: Sequence[Mapping], key: str = "fwd_bwd_speedup") -> tuple:
    """Smallest speedup over eager (``key``: the dot interaction's ``fwd_speedup`` or
    ``fwd_bwd_speedup``; the cross network's ``gemm_fwd_bwd_speedup``, its default kernel's),
    and its shape."""
    rows = [r for r in results if r.get(key)]
    if not rows:
        return None, ""
    row = min(rows, key=lambda r: r[key])
    shape = f"B={row['batch']} F={row['fields']} D={row['dim']} {row.get('dtype', '')}".strip()
    return row[key], f"{row[key]:.2f}x (worst, {shape})"


def interaction_roofline(results: Sequence[Mapping]) -> tuple:
    """Smallest share of its byte roofline (the run's copy bandwidth) the fused dot
    interaction's forward + backward reaches, and its shape and precision."""
    rows = [r for r in results if r.get("triton_fwd_bwd_bw_frac") is not None]
    if not rows:
        return None, ""
    row = min(rows, key=lambda r: r["triton_fwd_bwd_bw_frac"])
    frac = row["triton_fwd_bwd_bw_frac"]
    shape = f"B={row['batch']} F={row['fields']} D={row['dim']} {row.get('precision', row.get('dtype', ''))}"
    return frac, f"{frac:.1%} (worst, {shape.strip()})"


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
    return f", {row['pipeline']}/{row.get('micro_batches')}/{graphs_label(row.get('cuda_graphs'))}"


def train_figure(results: Sequence[Mapping], preset: str, key: str, precision: str | None = None) -> tuple:
    """``key`` (``speedup_vs_eager`` or ``samples_per_s``) of recaccel's fastest device-data
    row (over its pipeline / micro-batch / CUDA-graph combinations, named in the figure),
    under ``precision`` when given (rows without the field are fp32: before the option)."""
    rows = [
        r
        for r in train_rows(results, TRAIN_FAST, preset, reader=False)
        if r.get(key) is not None and (precision is None or r.get("precision", "fp32") == precision)
    ]
    if not rows:
        return None, ""
    row = max(rows, key=lambda r: r.get("samples_per_s") or 0.0)
    value = float(row[key])
    text = f"{value / 1e6:.2f} M samples/s" if key == "samples_per_s" else f"{value:.2f}x eager"
    return value, f"{text} (batch {row.get('batch')}{_combination(row)}, {row.get('precision', 'fp32')})"


def lookup_and_update_ms(results: Sequence[Mapping], preset: str) -> tuple:
    """Smallest ``embedding_forward + sparse_update`` (ms) of recaccel's instrumented
    device-data rows on ``preset`` (a fused update merged into backward is not a figure)."""
    best = None
    for row in train_rows(results, TRAIN_FAST, preset, reader=False):
        phases = row.get("phases_ms") or {}
        parts = [phases.get("embedding_forward"), phases.get("sparse_update")]
        if all(isinstance(p, int | float) for p in parts):
            total = float(sum(parts))
            if best is None or total < best[0]:
                best = (total, row)
    if best is None:
        return None, ""
    total, row = best
    return total, f"{total:.2f} ms ({preset}, batch {row.get('batch')}, {row.get('precision', 'fp32')})"


def data_cost(results: Sequence[Mapping], preset: str = "bench_criteo_1hot") -> tuple:
    """Largest ``(reader step - device step) / reader step`` of recaccel on ``preset``, each
    reader row against the device row of the same combination and precision: the time the
    data path adds to a step (host blocking while the GPU is still busy is not a cost)."""
    device_ms = {
        (_combination(r), r.get("precision")): r["step_ms"]
        for r in train_rows(results, TRAIN_FAST, preset, reader=False)
        if r.get("step_ms")
    }
    worst = None
    for row in train_rows(results, TRAIN_FAST, preset, reader=True):
        key = (_combination(row), row.get("precision"))
        if not row.get("step_ms") or key not in device_ms:
            continue
        cost = (row["step_ms"] - device_ms[key]) / row["step_ms"]
        if worst is None or cost > worst[0]:
            worst = (cost, row)
    if worst is None:
        return None, ""
    cost, row = worst
    return cost, (
        f"{cost:.2%} of the reader step ({preset}{_combination(row)}, {row.get('precision', 'fp32')}: "
        f"{row['step_ms']:.2f} ms through the reader)"
    )


def io_best(results: Sequence[Mapping], schema: str, candidate: str = "plain") -> tuple:
    """Highest ``rows_per_s`` of ``candidate`` (a reader) on ``schema`` over the io
    benchmark's worker counts, and which count gave it."""
    rows = [r for r in results if r.get("schema") == schema and r.get("candidate") == candidate]
    rows = [r for r in rows if r.get("rows_per_s")]
    if not rows:
        return None, ""
    row = max(rows, key=lambda r: r["rows_per_s"])
    value = float(row["rows_per_s"])
    return value, f"{value / 1e6:.3g} M rows/s ({candidate}, workers={row['workers']})"


def io_tasks_share(results: Sequence[Mapping], schema: str = "criteo_1hot") -> tuple:
    """The task reader's best rows/s over the plain reader's best on ``schema``."""
    tasks, tasks_text = io_best(results, schema, "tasks")
    plain, plain_text = io_best(results, schema, "plain")
    if tasks is None or plain is None:
        return None, ""
    return tasks / plain, f"{tasks / plain:.2f}x: {tasks_text} over {plain_text}"


def dense_head_share(results: Sequence[Mapping], matmul_tflops: float | None) -> tuple:
    """Best ``dense_head_TFLOPs`` of recaccel's rows (MLPs + interaction, forward + backward)
    over the bf16 matmul rate of the same run; not measured while no row carries it."""
    rates = [(float(r["dense_head_TFLOPs"]), r) for r in results if r.get("dense_head_TFLOPs")]
    if not rates or not matmul_tflops:
        return None, ""
    rate, row = max(rates, key=lambda x: x[0])
    share = rate / matmul_tflops
    return (
        share,
        f"{share:.1%} ({rate:.0f} of {matmul_tflops:.0f} TFLOP/s, {_preset_name(row.get('preset'))})",
    )


def cache_train_share(result: Mapping) -> tuple:
    """``vs_device`` of cache_train's ``host`` row (10% of the rows cached)."""
    host = next((r for r in result.get("rows", []) if r.get("candidate") == "host"), None)
    if host is None or host.get("vs_device") is None:
        return None, ""
    value = float(host["vs_device"])
    return value, f"{value:.2f}x device samples/s ({host.get('samples_per_s', 0) / 1e6:.2f} M samples/s)"


def pipelined_speedup(results: Sequence[Mapping], preset: str) -> tuple:
    """``speedup_vs_off`` of recaccel's ``sync/1/on`` device-data row on ``preset`` (the
    same run's ``off/1/off`` over it); the reader's figure, when measured, is named too."""

    def find(reader: bool) -> Mapping | None:
        for row in train_rows(results, TRAIN_FAST, preset, reader):
            combination = (
                row.get("pipeline"),
                row.get("micro_batches"),
                graphs_label(row.get("cuda_graphs")),
            )
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


def markdown_rows(text: str) -> list[dict[str, str]]:
    """The rows of the first markdown table in ``text`` (header -> cell), as written by
    :func:`recaccel.bench.harness.report.markdown_table`."""
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


def evaluate(parts: Path, ceilings: Mapping) -> list[dict]:
    """Every target of issues 24, 25 and 26, judged from the result files in ``parts``.

    Args:
        parts: folder holding the benchmarks' JSON (``embedding``, ``interaction``,
            ``dcnv2``, ``train``, ``train_dcnv2``, ``cache_train``, ``io``).
        ceilings: this run's ``copy_GBps`` and ``matmul_TFLOPs``.

    Returns:
        One dict per target (:data:`TARGETS` order): target, threshold, value, figure,
        status, source.
    """

    def results(name: str, key: str = "results") -> list:
        return (_load_json(parts / f"{name}.json") or {}).get(key, [])

    emb, train = results("embedding"), results("train") + results("train_dcnv2")
    io = results("io")
    copy = ceilings.get("copy_GBps")
    figures: dict[str, Callable[[], tuple]] = {
        "embedding forward >= 80% of copy bandwidth (triton)": lambda: embedding_bandwidth(emb, "forward", copy),
        "embedding fwd+bwd+update >= 50% of copy bandwidth (triton)": lambda: embedding_bandwidth(
            emb, "fwd+bwd+update", copy
        ),
        "bench_criteo_1hot lookup + sparse update <= 1.0 ms": lambda: lookup_and_update_ms(train, "bench_criteo_1hot"),
        "interaction forward faster than eager at every shape": lambda: interaction_speedup(
            results("interaction"), "fwd_speedup"
        ),
        "interaction fwd+bwd >= 60% of its byte roofline (bf16, tf32)": lambda: interaction_roofline(
            results("interaction")
        ),
        "DCN-v2 cross fwd+bwd >= 1.5x eager (bf16)": lambda: interaction_speedup(
            results("dcnv2"), "gemm_fwd_bwd_speedup"
        ),
        "bench_criteo_1hot bf16 >= 12 M samples/s": lambda: train_figure(
            train, "bench_criteo_1hot", "samples_per_s", "bf16"
        ),
        "bench_criteo_1hot tf32 >= 8 M samples/s": lambda: train_figure(
            train, "bench_criteo_1hot", "samples_per_s", "tf32"
        ),
        "bench_wide bf16 >= 0.8 M samples/s": lambda: train_figure(train, "bench_wide", "samples_per_s", "bf16"),
        "bench_dcnv2_mlperf >= 3 M samples/s": lambda: train_figure(train, "bench_dcnv2_mlperf", "samples_per_s"),
        "dense head >= 50% of the bf16 matmul rate": lambda: dense_head_share(train, ceilings.get("matmul_TFLOPs")),
        "bench_criteo_1hot sync + CUDA graphs >= 1.15x off": lambda: pipelined_speedup(train, "bench_criteo_1hot"),
        "bench_wide sync + CUDA graphs >= 1.15x off": lambda: pipelined_speedup(train, "bench_wide"),
        "host tables at 10% cached >= 60% of all-device samples/s": lambda: cache_train_share(
            _load_json(parts / "cache_train.json") or {}
        ),
        "data cost < 2% of step time": lambda: data_cost(train),
        "criteo_1hot schema reader >= 12 M rows/s": lambda: io_best(io, "criteo_1hot"),
        "wide schema (500 fields) reader >= 1.5 M rows/s": lambda: io_best(io, "wide"),
        "criteo_1hot from the pre-decoded cache >= 12 M rows/s": lambda: io_best(io, "criteo_1hot", "plain_cache"),
        "task batches >= 0.5x plain rows/s": lambda: io_tasks_share(io),
    }  # fmt: skip
    rows = []
    for name, threshold, higher, source in TARGETS:
        rows.append(_row(name, threshold, *figures[name](), source, higher=higher))
    return rows


def mark_not_run(rows: Sequence[Mapping], not_run: Mapping[str, str]) -> list[dict]:
    """``rows`` with each target whose result file's step did not run in this run (``not_run``:
    step -> why, e.g. ``"part steps"``) read ``"not measured (why)"``, whatever files lie in
    the folder: a part never judges the other part's targets."""
    out = []
    for row in rows:
        step = Path(str(row.get("source", ""))).stem
        if step in not_run:
            row = {**row, "value": None, "figure": "-", "status": f"{NOT_MEASURED} ({not_run[step]})"}
        out.append(dict(row))
    return out


# (target, threshold, higher is better, result file): the order of the summary's table.
TARGETS: tuple[tuple[str, float, bool, str], ...] = (
    ("embedding forward >= 80% of copy bandwidth (triton)", 0.80, True, "embedding.json"),
    ("embedding fwd+bwd+update >= 50% of copy bandwidth (triton)", 0.50, True, "embedding.json"),
    ("bench_criteo_1hot lookup + sparse update <= 1.0 ms", 1.0, False, "train.json"),
    ("interaction forward faster than eager at every shape", 1.0, True, "interaction.json"),
    ("interaction fwd+bwd >= 60% of its byte roofline (bf16, tf32)", 0.60, True, "interaction.json"),
    ("DCN-v2 cross fwd+bwd >= 1.5x eager (bf16)", 1.5, True, "dcnv2.json"),
    ("bench_criteo_1hot bf16 >= 12 M samples/s", 12e6, True, "train.json"),
    ("bench_criteo_1hot tf32 >= 8 M samples/s", 8e6, True, "train.json"),
    ("bench_wide bf16 >= 0.8 M samples/s", 0.8e6, True, "train.json"),
    ("bench_dcnv2_mlperf >= 3 M samples/s", 3e6, True, "train_dcnv2.json"),
    ("dense head >= 50% of the bf16 matmul rate", 0.5, True, "train.json"),
    ("bench_criteo_1hot sync + CUDA graphs >= 1.15x off", 1.15, True, "train.json"),
    ("bench_wide sync + CUDA graphs >= 1.15x off", 1.15, True, "train.json"),
    ("host tables at 10% cached >= 60% of all-device samples/s", 0.6, True, "cache_train.json"),
    ("data cost < 2% of step time", 0.02, False, "train.json"),
    ("criteo_1hot schema reader >= 12 M rows/s", 12e6, True, "io.json"),
    ("wide schema (500 fields) reader >= 1.5 M rows/s", 1.5e6, True, "io.json"),
    ("criteo_1hot from the pre-decoded cache >= 12 M rows/s", 12e6, True, "io.json"),
    ("task batches >= 0.5x plain rows/s", 0.5, True, "io.json"),
)
