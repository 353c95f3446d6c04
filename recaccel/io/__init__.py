"""Data: the Parquet format, the streaming readers, the offline converters, the loader.

- :mod:`recaccel.io.format`: schema, columns, row-group decoding with the bad-input
  policies, the writer, the task-grouped claim (imports nothing else from io);
- :mod:`recaccel.io.readers`: :class:`~recaccel.io.readers.BatchReader` and
  :class:`~recaccel.io.readers.TaskReader` on one engine, the
  :class:`~recaccel.io.readers.Reader` protocol (import only format);
- :mod:`recaccel.io.convert`: synthetic, Criteo, MovieLens, MeLU, group-by-task
  (import only format);
- :mod:`recaccel.io.loader`: :class:`~recaccel.io.loader.DeviceLoader`, prefetching a
  Reader's batches to the device through the pinned buffers of
  :mod:`recaccel.io.host_buffer`.

Nothing is imported eagerly: ``import recaccel.io`` loads no reader, converter or torch.
"""

__all__ = ["convert", "format", "host_buffer", "loader", "readers"]
