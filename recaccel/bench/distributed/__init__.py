"""Multi-process benchmarks: bytes per hybrid step, a slowed rank under each straggler policy."""

__all__: list[str] = []
