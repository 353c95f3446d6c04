"""Seconds per GPU test file: the weights gpu-check balances its pytest groups by, and their measurement.

Balancing by test count put the slow files together on the H200 (one group of 6 files
ended in 47 s, three were killed at 91 s), so the groups are dealt by seconds:
``test_seconds.json`` beside this module holds each file's seconds on the H200, and a
file not in it weighs its GPU-test count times the median seconds per test of the files
that are. Each pytest group writes a junit XML; after the step, the per-test times are
summed per file and written, in the same format, as ``test_seconds.json`` into the parts
tarball: the committed figures with every file that finished in this run replaced by its
measured seconds. A group still running at the budget is interrupted first (pytest then
writes its XML); the file it was in keeps its committed figure, as do the files it never
reached. Committing that file makes the next session's balance measured.

Format::

    {"device": "...", "files": {"tests/x/test_y.py": {"seconds": 12.3, "source": "..."}}}
"""

from __future__ import annotations

import json
import statistics
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

COMMITTED = Path(__file__).with_name("test_seconds.json")
# The weight of a test when no file's seconds are known at all.
DEFAULT_SECONDS_PER_TEST = 1.0


def load_seconds(path: Path = COMMITTED) -> dict:
    """The seconds file at ``path`` (``{"device", "files"}``); an empty one when it is absent or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"device": "", "files": {}}
    files = data.get("files") if isinstance(data, dict) else None
    return (
        {"device": data.get("device", ""), "files": files}
        if isinstance(files, dict)
        else {"device": "", "files": {}}
    )


def file_seconds(data: Mapping) -> dict[str, float]:
    """``file -> seconds`` of a seconds file's entries that carry a number, zero included (a
    file whose GPU tests all skipped where it was measured, e.g. those needing TorchRec)."""
    out = {}
    for name, entry in data.get("files", {}).items():
        seconds = entry.get("seconds") if isinstance(entry, Mapping) else None
        if isinstance(seconds, int | float) and not isinstance(seconds, bool) and seconds >= 0:
            out[name] = float(seconds)
    return out


def weights(files: Sequence[tuple[str, int]], known: Mapping[str, float]) -> list[tuple[str, float]]:
    """Each GPU test file with its weight in seconds: its known seconds, else its test count
    times the median seconds per test of the known files among ``files``."""
    counts = dict(files)
    # A file measured at 0 s (its tests skipped there) says nothing about a test's time.
    rates = [known[f] / counts[f] for f in counts if known.get(f, 0) > 0 and counts[f] > 0]
    per_test = statistics.median(rates) if rates else DEFAULT_SECONDS_PER_TEST
    return [(name, known.get(name, count * per_test)) for name, count in files]


def _file_of(case: ET.Element, files: Sequence[str]) -> str | None:
    """The test file of a junit ``testcase``: the one of ``files`` its ``file`` attribute (xunit1,
    relative to pytest's rootdir) ends, else the longest of ``files`` whose module path starts
    its ``classname`` (``tests.ops.test_x.TestY``)."""
    if case.get("file"):
        file = case.get("file", "").replace("\\", "/")
        return next((f for f in files if f == file or f.endswith("/" + file)), file)
    classname = case.get("classname", "")
    matches = [
        f for f in files if classname == f.removesuffix(".py").replace("/", ".") or
        classname.startswith(f.removesuffix(".py").replace("/", ".") + ".")
    ]  # fmt: skip
    return max(matches, key=len) if matches else None


def _xml_seconds(path: Path, files: Sequence[str]) -> dict[str, float]:
    """Per test file, in the order the file first appears, its test cases' summed ``time`` in one
    junit XML; empty when the file is absent or does not parse (a killed pytest leaves none)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    totals: dict[str, float] = {}
    for case in root.iter("testcase"):
        name = _file_of(case, files)
        if name is not None:
            totals[name] = totals.get(name, 0.0) + float(case.get("time") or 0.0)
    return totals


def junit_seconds(
    xml_paths: Iterable[Path], files: Iterable[str], interrupted: Iterable[Path] = ()
) -> dict[str, float]:
    """Per test file, the sum of its test cases' ``time`` over the junit XML files that exist
    and parse. Of an ``interrupted`` group's XML (pytest stopped at the budget) the last file
    with a test case is left out: the XML has no record of the test stopped, so that file may
    be part run (when the stop came at the next file's first test, a whole file's figure is
    left out: the committed one stays, never a partial sum)."""
    files, cut = list(files), {Path(p) for p in interrupted}
    totals: dict[str, float] = {}
    for path in xml_paths:
        found = _xml_seconds(Path(path), files)
        if Path(path) in cut and found:
            found.pop(list(found)[-1])
        for name, seconds in found.items():
            totals[name] = totals.get(name, 0.0) + seconds
    return {name: round(seconds, 2) for name, seconds in sorted(totals.items())}


def measured_file(committed: Mapping, measured: Mapping[str, float], device: str, run: str) -> dict:
    """The seconds file to commit after a run: ``committed`` with each file of ``measured``
    replaced by its figure, sourced to ``run`` on ``device``."""
    files = {name: dict(entry) for name, entry in committed.get("files", {}).items()}
    for name, seconds in measured.items():
        files[name] = {"seconds": seconds, "source": f"measured: sum of its junit test times, {run}"}
    return {"device": device or committed.get("device", ""), "files": dict(sorted(files.items()))}


def write_measured(
    out: Path,
    xml_paths: Sequence[Path],
    files: Iterable[str],
    device: str,
    run: str,
    interrupted: Iterable[Path] = (),
) -> dict:
    """Writes :func:`measured_file` of this run's junit XML to ``out``; returns the per-file seconds measured."""
    measured = junit_seconds(xml_paths, files, interrupted)
    out.write_text(json.dumps(measured_file(load_seconds(), measured, device, run), indent=2) + "\n")
    return measured
