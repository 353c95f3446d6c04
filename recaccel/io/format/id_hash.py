"""Hashing raw ids into buckets: integer ids and string ids of a ``[data.schema]`` mapping.

``hash = N`` on a sparse column maps each id to a bucket in ``0 .. N-1``, the same on
every row group, file, run and machine (a serving system can compute it too):

- an integer id ``x`` (its 64 two's-complement bits): ``splitmix64_63(x) mod N``, the
  id hash of :func:`recaccel.hashing.splitmix64_63` (``mix64(x + GAMMA) >> 1``);
- a string (its UTF-8 bytes) or binary value of L bytes, read as W = ceil(L / 8)
  little-endian 64-bit words w_0 .. w_{W-1} (the last one zero-padded)::

      h = mix64(L + GAMMA)
      h = mix64((h ^ w_j) + GAMMA)   for j = 0 .. W-1
      bucket = (h >> 1) mod N

  all modulo 2**64 (:func:`string_bucket` is this, one string at a time).

The vectorized forms work on Arrow arrays and handle every row at once (strings: one
numpy pass per word position).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from recaccel.hashing import GAMMA, mix64

_MASK = 2**64 - 1


def hash_int_ids(ids: np.ndarray, buckets: int) -> np.ndarray:
    """Integer ids (any integer dtype) [n] -> int64 buckets [n] in ``[0, buckets)``."""
    words = np.asarray(ids).astype(np.int64, copy=False).view(np.uint64)
    h = mix64(words + np.uint64(GAMMA)) >> np.uint64(1)
    return (h % np.uint64(buckets)).astype(np.int64)


def string_bucket(value: str | bytes, buckets: int) -> int:
    """The bucket of one string or bytes value (the reference of :func:`hash_strings`)."""
    data = value.encode() if isinstance(value, str) else bytes(value)
    h = _mix_int((len(data) + GAMMA) & _MASK)
    for j in range(0, len(data), 8):
        word = int.from_bytes(data[j : j + 8].ljust(8, b"\0"), "little")
        h = _mix_int(((h ^ word) + GAMMA) & _MASK)
    return (h >> 1) % buckets


def _mix_int(x: int) -> int:
    return int(mix64(np.array([x], dtype=np.uint64))[0])


def hash_strings(arr: pa.Array, buckets: int) -> np.ndarray:
    """A string, large_string, binary or large_binary array [n] -> int64 buckets [n]
    (a null's bucket is meaningless: the caller keeps the null)."""
    n = len(arr)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    large = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=np.int64 if large else np.int32)[arr.offset : arr.offset + n + 1]
    offsets = offsets.astype(np.int64)
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, dtype=np.uint8)
    lengths = offsets[1:] - offsets[:-1]
    if arr.null_count:  # a null's offsets may span anything: hash it as empty
        lengths = np.where(arr.is_null().to_numpy(zero_copy_only=False), 0, lengths)
    words = (lengths + 7) // 8
    word_start = np.zeros(n, dtype=np.int64)
    np.cumsum(words[:-1], out=word_start[1:])
    # Every value zero-padded to whole words, values one after another.
    padded = np.zeros(int(words.sum()) * 8, dtype=np.uint8)
    total = int(lengths.sum())
    if total:
        owner = np.repeat(np.arange(n, dtype=np.int64), lengths)
        within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        padded[word_start[owner] * 8 + within] = data[offsets[owner] + within]
    flat = padded.view("<u8")
    gamma = np.uint64(GAMMA)
    h = mix64(lengths.astype(np.uint64) + gamma)
    for j in range(int(words.max())):  # one pass per word position, over the values that long
        active = np.flatnonzero(words > j)
        h[active] = mix64((h[active] ^ flat[word_start[active] + j]) + gamma)
    return ((h >> np.uint64(1)) % np.uint64(buckets)).astype(np.int64)
