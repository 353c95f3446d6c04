"""Data path benchmarks: Parquet readers against raw pyarrow, reader workers, the vmapped meta step."""

__all__: list[str] = []
