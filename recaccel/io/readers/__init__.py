"""Streaming readers: resumable, sharded, shuffling iterables of batches over Parquet.

:class:`BatchReader` yields :class:`~recaccel.sparse.Batch` es of rows and
:class:`TaskReader` yields :class:`~recaccel.sparse.TaskBatch` es of whole tasks; both
run on :mod:`recaccel.io.readers.engine` (epoch order, sharding, position, counters),
take their read settings as one :class:`ReadOptions` (with a :class:`Shard`) and
implement the :class:`Reader` protocol.
"""

from recaccel.io.readers.engine import Position, ShardedReader
from recaccel.io.readers.options import ReadOptions, Shard
from recaccel.io.readers.protocol import Reader
from recaccel.io.readers.rows import BatchReader
from recaccel.io.readers.tasks import TaskReader

__all__ = ["BatchReader", "Position", "ReadOptions", "Reader", "Shard", "ShardedReader", "TaskReader"]
