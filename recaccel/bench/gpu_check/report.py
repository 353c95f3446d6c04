"""The files ``make gpu-check`` leaves in ``--out``, and its closing summary.

A lent GPU machine hands back at most 8 files from its output folder, so a part
leaves at most 7 (one to spare): ``gpu_check.md`` (everything, the benchmarks' reports
included), ``gpu_check.json`` (machine-readable), ``pytest.txt`` (the GPU test log,
part ``checks`` only), a tarball of every benchmark file and log (every plot and the
measured ``test_seconds.json`` included), and at most :data:`MAX_PLOTS` plots beside
them. The part ``steps`` names its files ``gpu_check_steps.*`` (``all``:
``gpu_check_all.*``), so the two parts' files can share one results folder; it leaves at
most 5, so the kernel tuning run's three files fit beside them in one command's 8.
"""

from __future__ import annotations

import json
import re
import shutil
import tarfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from recaccel.bench.harness.report import markdown_table

PYTEST_LOG = "pytest.txt"
MAX_PLOTS = 2
MAX_FILES = 7
_PYTEST_SUMMARY = re.compile(
    r"\b\d+ (passed|failed|skipped|errors?|deselected|xfailed|xpassed)\b|no tests ran"
)


def pytest_summary(log_text: str) -> str:
    """pytest's closing line (``"12 passed, 3 skipped, 400 deselected in 41.2s"``), or ``""``."""
    for line in reversed(log_text.splitlines()):
        if _PYTEST_SUMMARY.search(line):
            return line.strip(" =")
    return ""


def pytest_failures(log_text: str, limit: int = 40) -> list[str]:
    """The ``FAILED`` / ``ERROR`` lines of pytest's short summary (``-rfE``), at most ``limit``."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.startswith(("FAILED ", "ERROR "))]
    return lines[:limit] + ([f"... and {len(lines) - limit} more"] if len(lines) > limit else [])


def _fmt_ceilings(ceilings: Mapping) -> list[str]:
    out = []
    if ceilings.get("copy_GBps") is not None:
        out.append(f"device copy bandwidth (read + write): {ceilings['copy_GBps']:.1f} GB/s")
    if ceilings.get("matmul_TFLOPs") is not None:
        out.append(f"{ceilings['matmul']} matmul: {ceilings['matmul_TFLOPs']:.1f} TFLOP/s")
    out += [f"ceiling error: {e}" for e in ceilings.get("errors", [])]
    return out


def steps_table(steps: Sequence[Mapping]) -> str:
    """Markdown table of the steps: name, status, seconds, budget, note."""
    return markdown_table(
        [
            {
                "step": s["name"],
                "status": s["status"],
                "seconds": round(s.get("seconds", 0.0), 1),
                "budget_s": s.get("budget_s"),
                "note": s.get("note", ""),
            }
            for s in steps
        ]
    )


def targets_table(targets: Sequence[Mapping]) -> str:
    """Markdown table of the targets: target, figure, status."""
    return markdown_table(
        [{"target": t["target"], "figure": t["figure"], "status": t["status"]} for t in targets]
    )


def _pytest_line(report: Mapping) -> str:
    """pytest's summed closing line, or why there is none (the step ran in the other part)."""
    step = next((s for s in report["steps"] if s["name"] == "pytest"), {})
    if step.get("status") == "skipped":
        return f"not run ({step.get('note', '')})"
    return report["pytest"].get("summary") or "(no summary line)"


def summary_text(report: Mapping) -> str:
    """The closing summary printed last: ceilings, steps, pytest's line, the targets."""
    part = report.get("part", "all")
    lines = [f"== gpu-check summary (part {part}, {report['device']}: {report['env'].get('device', '')}) =="]
    lines += _fmt_ceilings(report["ceilings"])
    lines += ["", steps_table(report["steps"])]
    lines.append(f"pytest: {_pytest_line(report)}")
    lines += [f"  {f}" for f in report["pytest"].get("failures", [])[:10]]
    lines += ["", f"GPU targets (judged on {report['device']}):", targets_table(report["targets"])]
    lines.append(f"files in {report['out']}: {', '.join(report['files'])}")
    return "\n".join(lines)


def write_markdown(report: Mapping, parts: Path, path: Path) -> Path:
    """``gpu_check.md``: environment, ceilings, steps, pytest, targets, then every benchmark's report."""
    env = report["env"]
    text = [f"# make gpu-check ({report['device']}, part {report.get('part', 'all')})", ""]
    text += [f"- {k}: {v}" for k, v in env.items()]
    text += [f"- nvidia-smi: {report.get('nvidia_smi') or '-'}", "", "## Ceilings measured in this run", ""]
    text += [f"- {line}" for line in _fmt_ceilings(report["ceilings"])]
    text += ["", "## Steps", "", steps_table(report["steps"])]
    for step in report["steps"]:
        if step.get("command"):
            text += [f"- {step['name']}: `{step['command']}`"]
    text += ["", "## pytest", "", f"`{report['pytest'].get('command', '')}`", ""]
    text += [report["pytest"].get("summary") or "(no summary line)", ""]
    text += [f"- {f}" for f in report["pytest"].get("failures", [])]
    text += ["", "## GPU targets", "", targets_table(report["targets"])]
    for step in report["steps"]:
        md = parts / f"{step['name']}.md"
        if md.is_file():
            body = md.read_text().replace("\n# ", "\n### ")
            text += ["", f"## Benchmark: {step['name']}", "", body.removeprefix("# ")]
        elif step["status"] not in ("ok", "skipped") and step.get("tail"):
            text += ["", f"## {step['name']}: {step['status']}, last lines of its log", "", "```"]
            text += [step["tail"], "```"]
    path.write_text("\n".join(text) + "\n")
    return path


def stem_of(part: str | None) -> str:
    """The name the files of a part start with: ``gpu_check`` for ``checks`` (and ``--only``), else ``gpu_check_<part>``."""
    return "gpu_check" if part in (None, "checks") else f"gpu_check_{part}"


def chosen_plots(parts: Path, steps: Sequence[Mapping], limit: int = MAX_PLOTS) -> list[Path]:
    """The plots to leave beside the tarball: the steps' own plots (``<step>.png``) first, in
    step order, then the others by name; at most ``limit``."""
    plots = sorted(parts.glob("*.png"))
    own = [parts / f"{s['name']}.png" for s in steps if (parts / f"{s['name']}.png") in plots]
    return (own + [p for p in plots if p not in own])[:limit]


def finish(report: dict, parts: Path, out: Path, stem: str = "gpu_check") -> list[str]:
    """Writes the markdown and JSON, tars ``parts`` and removes it, keeps a few plots beside.

    Returns:
        The names of the files left in ``out`` by this run (at most :data:`MAX_FILES`).
    """
    markdown, json_name, tarball = f"{stem}.md", f"{stem}.json", f"{stem}_parts.tar.gz"
    plots = chosen_plots(parts, report["steps"])
    ran_pytest = any(s["name"] == "pytest" and s["status"] != "skipped" for s in report["steps"])
    files = [markdown, json_name, tarball] + (
        [PYTEST_LOG] if ran_pytest and (out / PYTEST_LOG).is_file() else []
    )
    files += [p.name for p in plots]
    report["files"] = files
    write_markdown(report, parts, out / markdown)
    (out / json_name).write_text(json.dumps(report, indent=2, default=str))
    with tarfile.open(out / tarball, "w:gz") as tar:
        for path in sorted(parts.iterdir()):
            tar.add(path, arcname=f"{stem}_parts/{path.name}")
    for plot in plots:
        shutil.copyfile(plot, out / plot.name)
    shutil.rmtree(parts)
    return files
