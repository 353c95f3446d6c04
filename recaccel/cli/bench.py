"""recaccel-bench: run a benchmark by name."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from recaccel.cli.common import run_command, setup_logging


def bench_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="recaccel-bench", description="Kernel and pipeline benchmarks.")
    sub = parser.add_subparsers(dest="command", required=True)
    registry = _bench_registry()
    for name, (help_text, add_args, _) in registry.items():
        add_args(sub.add_parser(name, help=help_text))
    args = parser.parse_args(argv)
    setup_logging(False)
    command_line = shlex.join(["recaccel-bench", *(sys.argv[1:] if argv is None else argv)])

    def body() -> int:
        summary = Path(registry[args.command][2](args, command_line))
        print(summary.read_text())
        print(f"results written to {summary}")
        return 0

    return run_command("recaccel-bench", body)


def _bench_registry() -> dict[str, tuple[str, Callable, Callable]]:
    from recaccel.bench.harness import registry

    return registry.BENCHMARKS
