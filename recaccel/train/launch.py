"""Launching hybrid runs: ``recaccel-train --nproc N`` re-executes itself under torchrun.

``recaccel-train --nproc 2 --config c.toml --set parallel.mode=hybrid`` runs, in a child
process::

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m recaccel.cli \\
        --config c.toml --set parallel.mode=hybrid

i.e. torchrun starts two workers on this host, each running ``recaccel.cli`` with the
same arguments minus ``--nproc``; torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``
and the rendezvous address, and :class:`~recaccel.train.hybrid.HybridParallel` joins
the process group from them. If one worker fails, torchrun stops the others and exits
non-zero. Several hosts: run torchrun yourself on each (``--nnodes``,
``--rdzv-endpoint``), e.g. ``torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d
--rdzv-endpoint host0:29500 -m recaccel.cli --config c.toml``.

Only rank 0 writes the run directory's config.toml, log.jsonl and metrics.json and
shows a progress bar; every rank writes its shards of each checkpoint.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import NoReturn

from recaccel.config import Config
from recaccel.errors import ConfigError


def under_torchrun() -> bool:
    """True in a process torchrun (or another launcher) started as one of several ranks."""
    return os.environ.get("RANK") is not None and os.environ.get("WORLD_SIZE") is not None


def torchrun_command(nproc: int, argv: Sequence[str], module: str = "recaccel.cli") -> list[str]:
    """The command that runs ``python -m module *argv`` as ``nproc`` ranks on this host.

    Raises:
        ConfigError: ``nproc`` < 1.
    """
    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}")
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", f"--nproc-per-node={nproc}",
        "-m", module, *argv,
    ]


def check_launch(cfg: Config, nproc: int) -> None:
    """Checks before launching ``nproc`` ranks that the config trains in hybrid mode.

    Raises:
        ConfigError: ``nproc`` < 1, or ``parallel.mode`` is not ``hybrid``.
    """
    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}")
    if cfg.parallel.mode != "hybrid":
        raise ConfigError(
            f"--nproc {nproc} runs one process per rank, which needs parallel.mode=hybrid "
            f"(got {cfg.parallel.mode!r}); add --set parallel.mode=hybrid"
        )


def relaunch(nproc: int, argv: Sequence[str]) -> int:
    """Runs this command line again as ``nproc`` torchrun ranks and waits for them.

    Args:
        nproc: number of processes (one per device).
        argv: the command-line arguments to forward, without ``--nproc``.

    Returns:
        torchrun's exit status (non-zero when any rank failed).

    Raises:
        ConfigError: already running under torchrun (a rank must not launch more ranks).
    """
    if under_torchrun():
        raise ConfigError("--nproc given inside a torchrun worker; drop --nproc when launching with torchrun")
    env = dict(os.environ)
    # One intra-op thread pool per rank would oversubscribe the host's cores.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return subprocess.run(torchrun_command(nproc, argv), env=env, check=False).returncode


def exit_rank(code: int) -> NoReturn:
    """Ends a torchrun rank process with exit status ``code``, skipping interpreter teardown.

    When a rank returns, its results are on disk (checkpoint shards, and on rank 0 the
    closed log and metrics.json). Tearing the interpreter down after a gloo process group
    and Arrow's thread pool have run can abort intermittently ("terminate called without
    an active exception", exit -6): native worker threads re-enter the finalizing
    interpreter or are destroyed while joinable (pytorch/pytorch#179291,
    apache/arrow#34314 and #39862). torchrun would then report the finished run as failed,
    so a rank flushes its streams and logs and leaves with ``os._exit``.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def strip_nproc(argv: Sequence[str]) -> list[str]:
    """``argv`` without its ``--nproc N`` / ``--nproc=N`` options."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--nproc":
            skip = True
            continue
        if arg.startswith("--nproc="):
            continue
        out.append(arg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m recaccel.train.launch --nproc N <recaccel-train arguments>``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m recaccel.train.launch",
        description="Run recaccel-train as N torchrun ranks on this host.",
    )
    parser.add_argument("--nproc", type=int, required=True, help="number of ranks (processes)")
    args, rest = parser.parse_known_args(argv)
    return relaunch(args.nproc, rest)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
