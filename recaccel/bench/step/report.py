"""Reporting of ``recaccel-bench train``: speedups, the CPU target, tables, the plot, JSON.

Shapes: none (rows are dicts, one per candidate, preset, data mode and combination).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from recaccel.bench.harness.report import markdown_table
from recaccel.bench.step.candidates import BASELINE, PHASES, Combination
from recaccel.bench.step.eager import EAGER_SPARSE_OPTIMIZERS
from recaccel.bench.step.graphs import graphs_label
from recaccel.plotting import pyplot, save_figure

if TYPE_CHECKING:
    from recaccel.bench.step.data import Preset
    from recaccel.bench.step.measure import Timing


def timeline_path(out: str | Path, preset: str) -> Path:
    """The timeline PNG of ``preset``, beside the markdown ``out``."""
    out = Path(out)
    return out.with_name(f"{out.stem}_timeline_{preset}.png")


def precision_timeline(path: Path, precision: str) -> Path:
    """The timeline PNG ``path`` of one precision mode, when a run times several."""
    return path.with_name(f"{path.stem}_{precision}{path.suffix}")


def precision_notes(precisions: Sequence[str], device: torch.device) -> list[str]:
    """What each precision mode of the run means for every candidate, and on CPU that
    ``tf32`` runs as ``fp32``."""
    notes = [
        "precision (train.precision, the rows' precision column): every candidate of a mode runs under the same "
        "setting, a fair baseline: the TF32 switch (torch.backends.cuda.matmul.allow_tf32 and cudnn.allow_tf32) "
        "on for tf32, off for fp32 and bf16, over the mode's whole pass; bf16 adds torch.autocast(bfloat16) "
        "around every candidate's dense forward (recaccel's objective; eager's and compiled's MLPs, interaction "
        "and loss; the lookups stay float32): " + ", ".join(precisions)
    ]
    if device.type != "cuda" and "tf32" in precisions:
        notes.append(
            f"tf32 on {device.type}: runs as fp32 (TF32 is a CUDA tensor-core mode; CPU matmuls ignore it)"
        )
    return notes


CPU_SLOWDOWN_LIMIT = 0.95
"""The CPU target: no combination slower than ``off/1/off`` by more than 5%."""


def cpu_target_note(rows: list[dict]) -> str:
    """The CPU target judged on this run: recaccel's slowest combination against its
    ``off/1/off`` (same preset and mode)."""
    timed = [r for r in rows if r["candidate"] == "recaccel" and r.get("speedup_vs_off") is not None]
    others = [r for r in timed if combination_key(r) != BASELINE.key]
    if not others:
        return "CPU target (no mode slower than off by more than 5%): not measured (no other combination ran)"
    worst = min(others, key=lambda r: r["speedup_vs_off"])
    verdict = "met" if worst["speedup_vs_off"] >= CPU_SLOWDOWN_LIMIT else "not met"
    return (
        f"CPU target (no mode slower than off by more than 5%, i.e. speedup_vs_off >= {CPU_SLOWDOWN_LIMIT}): "
        f"{verdict}; the slowest is {combination_label(worst)} on {worst['preset']} "
        f"({', '.join(str(k) for k in _group(worst)[1:] if k)}) at "
        f"{worst['speedup_vs_off']:.3f}x off/1/off"
    )


def _group(row: dict) -> tuple:
    """What a row's speedups are within: its preset, data mode and precision mode."""
    return row["preset"], row["mode"], row.get("precision")


def speedups(rows: list[dict]) -> None:
    """Sets ``speedup_vs_eager`` (eager's step time over the row's, same preset, mode and
    precision) and, on recaccel's rows, ``speedup_vs_off`` (recaccel ``off/1/off``'s over
    the row's, same preset, mode and precision: the same run, on the same data)."""

    def base_of(candidate: str, combination: bool) -> dict:
        return {
            _group(r): r["step_ms"]
            for r in rows
            if r["candidate"] == candidate
            and r["step_ms"]
            and (not combination or combination_key(r) == BASELINE.key)
        }

    eager, off = base_of("eager", False), base_of("recaccel", True)
    for r in rows:
        group = _group(r)
        base = eager.get(group)
        r["speedup_vs_eager"] = base / r["step_ms"] if base and r["step_ms"] else None
        base = off.get(group) if r["candidate"] == "recaccel" else None
        r["speedup_vs_off"] = base / r["step_ms"] if base and r["step_ms"] else None
    data_costs(rows)


def _same_step(row: dict) -> tuple:
    """What a reader row is compared with in device mode: everything but the data mode."""
    return (row["preset"], row.get("precision"), row["candidate"], *combination_key(row))


def data_costs(rows: list[dict]) -> None:
    """Sets ``data_cost`` on reader rows: (reader step - device step) / reader step, the
    device row being the same candidate, combination, preset and precision (None without
    one): the share of a step the data path adds (issue 26's target: < 2%)."""
    device = {_same_step(r): r["step_ms"] for r in rows if r["mode"] == "device" and r["step_ms"]}
    for r in rows:
        base = device.get(_same_step(r)) if r["mode"] == "reader" else None
        r["data_cost"] = (r["step_ms"] - base) / r["step_ms"] if base and r["step_ms"] else None


def combination_key(row: dict) -> tuple:
    """(pipeline, micro_batches, graphs) of a row; graphs as :func:`graphs_label` says."""
    graphs = row.get("cuda_graphs")
    return row.get("pipeline"), row.get("micro_batches"), None if graphs is None else graphs_label(graphs)


_SHORT = {
    "embedding_forward": "emb_fwd",
    "interaction": "interaction",
    "mlps": "mlps",
    "backward": "backward",
    "sparse_update": "sparse_upd",
    "dense_optimizer": "dense_opt",
    "data_wait": "data_wait",
}


def combination_label(row: dict) -> str | None:
    """``pipeline/micro_batches/graphs`` of a recaccel or reference row, else None."""
    if row.get("pipeline") is None:
        return None
    return f"{row['pipeline']}/{row['micro_batches']}/{graphs_label(row['cuda_graphs'])}"


def row_label(row: dict) -> str:
    """The candidate, with its combination unless it is ``off/1/off``."""
    label = combination_label(row)
    return row["candidate"] if label in (None, BASELINE.label) else f"{row['candidate']} {label}"


def table_rows(rows: list[dict]) -> list[dict]:
    """Result rows flattened for the markdown table (phases as ``<phase>_ms`` columns)."""
    out = []
    for r in rows:
        flat = {k: r.get(k) for k in ("preset", "mode", "precision", "candidate")}
        flat["combination"] = combination_label(r)
        flat.update({k: r[k] for k in ("batch", "samples_per_s", "step_ms")})
        flat["speedup_vs_eager"] = r["speedup_vs_eager"]
        flat["speedup_vs_off"] = r.get("speedup_vs_off")
        for phase in PHASES:
            value = r["phases_ms"].get(phase)
            if isinstance(value, str):
                value = "merged" if value.startswith("merged") else "-"  # not instrumented, or no wait
            flat[f"{_SHORT[phase]}_ms"] = value
        flat["data_wait_frac"] = r.get("data_wait_fraction")
        flat["data_cost"] = r.get("data_cost")
        if r["status"] != "ok":
            flat["candidate"] = f"{r['candidate']} (skipped)"
        out.append(flat)
    return out


def plot_results(rows: list[dict], path: str | Path) -> Path:
    """Samples/s per candidate for each preset and mode (left), stacked phases (right)."""
    plt = pyplot()
    ok = [r for r in rows if r["status"] == "ok"]
    groups = list(dict.fromkeys(_group(r) for r in ok))
    names = list(dict.fromkeys(row_label(r) for r in ok))
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(10.0, 2.2 * len(groups) + 6), 6.0))
    width = 0.8 / max(len(names), 1)
    for k, name in enumerate(names):
        values = {_group(r): r["samples_per_s"] for r in ok if row_label(r) == name}
        left.bar(
            [g + k * width for g in range(len(groups))],
            [values.get(g, 0.0) for g in groups],
            width,
            label=name,
        )
    left.set_xticks(
        [g + 0.4 - width / 2 for g in range(len(groups))],
        ["\n".join(map(str, g)) for g in groups],
        fontsize=7,
    )
    left.set_yscale("log")  # presets differ by orders of magnitude
    left.set_ylabel("samples / s (log scale)")
    left.set_title("Training throughput")
    left.legend(fontsize=7)
    phased = [r for r in ok if isinstance(r["phases_ms"].get("backward"), float)]
    labels = [f"{r['preset']} {r['mode']} {r.get('precision')} {row_label(r)}" for r in phased]
    bottom = [0.0] * len(phased)
    for phase in PHASES:
        values = [v if isinstance(v := r["phases_ms"].get(phase), float) else 0.0 for r in phased]
        right.bar(range(len(phased)), values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values)]
    right.set_xticks(range(len(phased)), labels, fontsize=6, rotation=90)
    right.set_ylabel("ms per step (instrumented)")
    right.set_title("Phases (device synchronised between phases)")
    right.legend(fontsize=6)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)


def write_json(path: str | Path, env: dict, rows: list[dict], notes: list[str]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"env": env, "results": rows, "notes": notes}, indent=2))


def combination_rows(rows: list[dict]) -> list[dict]:
    """recaccel's rows, one per preset, mode and combination: step time, samples/s, the
    speedup over ``off/1/off`` of the same run, or why the combination was skipped."""
    out = []
    mine = [r for r in rows if r["candidate"] == "recaccel"]
    groups = list(dict.fromkeys(_group(r) for r in mine))
    for r in sorted(mine, key=lambda r: groups.index(_group(r))):
        out.append(
            {
                "preset": r["preset"],
                "mode": r["mode"],
                "precision": r.get("precision"),
                "pipeline": r["pipeline"],
                "micro_batches": r["micro_batches"],
                "cuda_graphs": graphs_label(r["cuda_graphs"]),
                "step_ms": r["step_ms"],
                "samples_per_s": r["samples_per_s"],
                "speedup_vs_off": r["speedup_vs_off"],
                "status": r["status"] if r["status"] == "ok" else f"skipped: {r['reason']}",
            }
        )
    return out


def combinations_section(rows: list[dict], out: Path) -> str:
    """The markdown of recaccel's combinations and the timelines written beside ``out``."""
    table = combination_rows(rows)
    if not table:
        return ""
    parts = ["", "## recaccel: pipeline / micro-batches / CUDA graphs", "", markdown_table(table)]
    pictures: dict[Path, str] = {}  # one per preset, or one per preset and precision mode
    for preset, precision in dict.fromkeys((r["preset"], r.get("precision")) for r in rows):
        whole = timeline_path(out, preset)
        pictures[whole] = preset
        pictures[precision_timeline(whole, str(precision))] = f"{preset}, {precision}"
    for picture, what in pictures.items():
        if picture.is_file():
            parts += [f"Timeline ({what}): ![{picture.name}]({picture.name})", ""]
    return "\n".join(parts)


def method_notes(
    presets: Sequence[Preset], timing: Timing, device: torch.device, combinations: Sequence[Combination]
) -> list[str]:
    """The method notes of the markdown: timing, phases, data modes, combinations, eager's optimizers."""
    sparse = {p.cfg.optim.sparse for p in presets}
    clock = "(CUDA events)" if device.type == "cuda" else "(perf_counter)"
    return [
        f"timing: {timing.warmup_blocks * timing.block} warm-up steps, then {timing.samples} timed samples of "
        f"{timing.block} consecutive steps each {clock}; step_ms = the median sample's time per step; "
        "samples_per_s = batch / step_ms; device mode times the candidates interleaved (one block of each "
        "per repeat, order rotating), reader mode one candidate after another.",
        f"phases: median of {timing.phase_steps} instrumented steps with the device synchronised between "
        "phases (a separate pass: the sum, instrumented_step_ms, exceeds step_ms by the lost overlap); "
        "mlps = bottom MLP + top MLP + loss; a phase a candidate does not run on its own says what it is "
        "part of; recaccel's pipelined combinations are not instrumented.",
        "device mode: batches of the preset's synthetic data read once and rotated on the device; reader mode: "
        "BatchReader (Parquet) + DeviceLoader per candidate, with data.workers resolved as the trainer does for "
        "the preset's dataset, synth.train_rows rows, of which the benchmark reads a cut "
        "(reader_workers: the reader processes, 0 = decoded in the training process; on a GPU host "
        "reader processes decode buffers ahead, so a short run may time batches decoded during its warm-up: "
        "recaccel-bench io measures the reader's sustained rows/s), data_wait = mean host time blocked on the next "
        "batch over the timed steps, data_wait_fraction = total wait / total step time; data_cost = "
        "(reader step_ms - device step_ms) / reader step_ms, against the device row of the same candidate, "
        "combination, preset and precision (the time the data path adds to a step; target < 2% on a GPU).",
        "recaccel combinations (pipeline/micro_batches/cuda_graphs): "
        + ", ".join(c.label for c in combinations)
        + "; each steps through the trainer's own loop (SingleProcess.steps: BatchPipeline, build_step, "
        "build_head), all on one shared model; speedup_vs_off = recaccel off/1/off's step_ms over the "
        "row's, same preset and mode of this run. With device data the batches are already on the "
        "device, so sync can only hide the input preparation (routing, bounds check, sort), not a copy.",
        "eager's sparse optimizer: "
        + "; ".join(f"optim.sparse={s} -> {EAGER_SPARSE_OPTIMIZERS[s]}" for s in sorted(sparse))
        + "; its dense optimizer is recaccel's (optim.dense).",
    ] + (
        [
            "step_peak_mb (CUDA): the most a few consecutive steps allocate beyond what was allocated before them."
        ]
        if device.type == "cuda"
        else []
    )
