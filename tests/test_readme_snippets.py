"""What the README tells a new user to run: its Python snippet trains into a run directory
of its own (not make run's), and every DCN-v2 preset in configs/ is named there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from recaccel.config import load_config

REPO_ROOT = Path(__file__).resolve().parents[1]

README = (REPO_ROOT / "README.md").read_text()


def _make_run_config() -> str:
    """The config ``make run`` trains with (its recaccel-train line in the Makefile)."""
    target = (REPO_ROOT / "Makefile").read_text().split("\nrun:", 1)[1].split("\n\n", 1)[0]
    return re.search(r"recaccel-train --config (\S+)", target).group(1)


def test_the_readme_python_snippet_trains_outside_make_runs_run_directory():
    calls = re.findall(r"recaccel\.load_config\((.*?)\)\n", README)
    assert calls, "the README's Python snippet no longer calls recaccel.load_config"
    make_run = _run_dir(load_config(REPO_ROOT / _make_run_config()).train.out_dir)
    for call in calls:
        path, overrides = ast.literal_eval(f"({call})")
        snippet = load_config(REPO_ROOT / path, overrides)  # run from the repository's root
        assert _run_dir(snippet.train.out_dir) != make_run, call


def _run_dir(out_dir: str) -> Path:
    """Where a run directory lands when the command runs in the repository's root."""
    return (REPO_ROOT / out_dir).resolve()


def test_the_readme_names_every_dcnv2_preset():
    presets = [
        p
        for p in sorted((REPO_ROOT / "configs").glob("*.toml"))
        if load_config(p).model.interaction == "dcnv2"
    ]
    assert len(presets) >= 2
    for preset in presets:
        assert f"`configs/{preset.name}`" in README, preset.name
