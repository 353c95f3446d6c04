"""The device cache of host-placed embedding tables (``model.embedding_placement = "host"``).

A pack of tables placed on the host keeps its rows and optimizer state in host memory
(pinned on CUDA) and a device cache of C of its rows; every prepared batch makes its rows
resident (missing rows gathered on the host into a staging buffer and copied in one
transfer, dirty victims written back first) and locks them while it is in the window;
the reference and Triton kernels then look up and update the cache, the ids rewritten as
slots. Training gives the device placement's parameters.

- :mod:`~recaccel.ops.embedding.cache.options`: :class:`CacheOptions` (size, policy, window).
- :mod:`~recaccel.ops.embedding.cache.slots`: the id -> slot map, slot counters, locks.
- :mod:`~recaccel.ops.embedding.cache.policy`: victim order (LRU / LFU, tie-breaks).
- :mod:`~recaccel.ops.embedding.cache.host_store`: host tensors, staging, transfers,
  the host memory check.
- :mod:`~recaccel.ops.embedding.cache.pack`: :class:`~recaccel.ops.embedding.cache.pack.CachedPack`,
  the pack backend of a host-placed pack; :mod:`~recaccel.ops.embedding.cache.prepared`:
  its preparation of a batch; :mod:`~recaccel.ops.embedding.cache.counters`: its statistics.
"""

from recaccel.ops.embedding.cache.options import POLICIES, CacheOptions

__all__ = ["POLICIES", "CacheOptions"]
