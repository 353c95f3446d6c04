"""What every benchmark shares: interleaved timing, environment capture, markdown reports,
and the registry of ``recaccel-bench`` subcommands."""

__all__: list[str] = []
