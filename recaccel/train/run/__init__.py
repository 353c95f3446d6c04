"""The run around the loop: its directory and lock, run log, console and loggers, the
profiler, the embedding caches' meter and the sanity pass before step 0."""

__all__ = ["cache_meter", "console", "loggers", "profiling", "run_lock", "runlog", "sanity"]
