"""Exceptions shared by every recaccel package.

The CLI prints any :class:`RecaccelError` as one line and exits non-zero, so every
message must say what is wrong and where (file, column, row group, key or value).
"""

from __future__ import annotations


class RecaccelError(Exception):
    """Base class of every error recaccel raises on bad user input."""


class ConfigError(RecaccelError):
    """A config key is unknown, ill-typed or inconsistent."""


class DataError(RecaccelError):
    """Input data is missing, unreadable or violates its schema.

    Args:
        message: What is wrong.
        path: The file, when known.
        column: The column, when known.
        row_group: The Parquet row group index, when known.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        column: str | None = None,
        row_group: int | None = None,
    ) -> None:
        where = []
        if path is not None:
            where.append(f"file {path}")
        if row_group is not None:
            where.append(f"row group {row_group}")
        if column is not None:
            where.append(f"column {column!r}")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)
        self.path = path
        self.column = column
        self.row_group = row_group
