"""Presets and data of ``recaccel-bench train``: sizes per device, the synthetic dataset,
batches kept on the device, and the Parquet reader path.

A preset is an ordinary config file (``configs/bench_*.toml``): ``[synth]`` says what the
data looks like (it is generated with :func:`recaccel.io.convert.synth.generate_synthetic`),
``[data]`` the batch size and reader settings, ``[model]`` and ``[optim]`` the model
every candidate trains. Presets are sized for a GPU; on a CPU the benchmark scales them
down (:func:`scale_for_device`) and reports what it changed.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from recaccel.config import Config, load_config
from recaccel.errors import ConfigError
from recaccel.io.convert.synth import generate_synthetic, synth_schema
from recaccel.io.format.dataset import open_dataset
from recaccel.io.format.schema import FeatureSchema
from recaccel.io.loader import DeviceLoader
from recaccel.io.readers.rows import BatchReader
from recaccel.sparse import Batch, SparseFeatures
from recaccel.train.loop.setup import with_reader_workers

CONFIG_DIR = Path(__file__).resolve().parents[3] / "configs"
"""The repository's presets (a name that is not a path is looked up here)."""

DEFAULT_PRESETS = ("bench_criteo_1hot", "bench_wide", "bench_dcnv2_mlperf")

CPU_BATCH_DIVISOR = 64
"""On CPU a preset's batch is divided by this (at least :data:`CPU_MIN_BATCH`, at most the preset's)."""
CPU_MIN_BATCH = 64
CPU_TABLE_BYTES = 256 * 2**20
"""On CPU every table is capped so that all of a model's fp32 tables fit in this many
bytes if each had the cap's rows (bench_criteo_1hot: 20,164 rows, bench_wide: 4,194)."""


@dataclass(frozen=True)
class Preset:
    """A preset as the benchmark runs it.

    Attributes:
        name: the file's stem (``bench_criteo_1hot``).
        path: the config file.
        cfg: the config, scaled for the device and the command's overrides.
        scaled: what differs from the file, one phrase per change (empty: as written).
    """

    name: str
    path: Path
    cfg: Config
    scaled: tuple[str, ...]

    @property
    def schema(self) -> FeatureSchema:
        """The schema of the preset's synthetic data (and of the models' tables)."""
        return synth_schema(self.cfg.synth)

    @property
    def batch_size(self) -> int:
        return self.cfg.data.batch_size


def preset_path(name: str) -> Path:
    """The config file of a preset given by name (``configs/<name>.toml``) or path.

    Raises:
        ConfigError: neither a file nor a preset of ``configs/``.
    """
    path = Path(name)
    if path.is_file():
        return path
    named = CONFIG_DIR / f"{name.removesuffix('.toml')}.toml"
    if named.is_file():
        return named
    known = sorted(p.stem for p in CONFIG_DIR.glob("bench_*.toml"))
    raise ConfigError(
        f"train bench: preset {name!r} is neither a file nor one of configs/: {', '.join(known)}"
    )


def load_preset(
    name: str,
    device: torch.device,
    *,
    batch: int | None = None,
    cardinality_cap: int | None = None,
) -> Preset:
    """Reads a preset and sizes it for ``device``.

    Args:
        name: a preset name under ``configs/`` or a config file's path.
        device: where the benchmark runs; on CPU the batch and tables shrink
            (:func:`scale_for_device`).
        batch: the batch size, overriding the preset's and the CPU scaling.
        cardinality_cap: rows per table at most, overriding the CPU scaling.

    Raises:
        ConfigError: an unknown preset, an unreadable config, or one without dense
            features or sparse fields (the DLRM the benchmark trains needs both).
    """
    path = preset_path(name)
    cfg = load_config(path)
    if cfg.synth.num_dense == 0 or cfg.synth.num_sparse == 0:
        raise ConfigError(
            f"train bench: preset {path} needs dense and sparse features "
            f"(synth.num_dense={cfg.synth.num_dense}, synth.num_sparse={cfg.synth.num_sparse})"
        )
    cfg, scaled = scale_for_device(cfg, device, batch=batch, cardinality_cap=cardinality_cap)
    return Preset(path.stem, path, cfg, tuple(scaled))


def scale_for_device(
    cfg: Config, device: torch.device, *, batch: int | None = None, cardinality_cap: int | None = None
) -> tuple[Config, list[str]]:
    """The preset's config at the sizes the benchmark runs on ``device``.

    On CUDA the preset runs as written. On CPU the batch is divided by
    :data:`CPU_BATCH_DIVISOR` and every table capped at
    ``CPU_TABLE_BYTES / (F * D * 4)`` rows. ``batch`` and ``cardinality_cap`` override
    both.

    Returns:
        The scaled config and one phrase per change (``batch 65536 -> 1024``).
    """
    fields = cfg.synth.num_sparse
    cards = list(cfg.synth.cardinalities) or [cfg.synth.cardinality] * fields
    new_batch, cap = cfg.data.batch_size, None
    if device.type != "cuda":
        new_batch = min(cfg.data.batch_size, max(CPU_MIN_BATCH, cfg.data.batch_size // CPU_BATCH_DIVISOR))
        cap = max(1, CPU_TABLE_BYTES // (fields * cfg.model.embedding_dim * 4))
    new_batch = batch if batch is not None else new_batch
    cap = cardinality_cap if cardinality_cap is not None else cap
    new_cards = [min(c, cap) for c in cards] if cap is not None else cards
    scaled = []
    if new_batch != cfg.data.batch_size:
        scaled.append(f"batch {cfg.data.batch_size} -> {new_batch}")
    if new_cards != cards:
        capped = sum(n != c for n, c in zip(new_cards, cards))
        scaled.append(
            f"{capped} of {fields} tables capped at {cap} rows ({sum(cards):,} -> {sum(new_cards):,} rows)"
        )
    synth = dataclasses.replace(cfg.synth, cardinalities=new_cards)
    data = dataclasses.replace(
        cfg.data,
        batch_size=new_batch,
        shuffle_buffer_rows=max(cfg.data.shuffle_buffer_rows, new_batch),
    )
    return dataclasses.replace(cfg, synth=synth, data=data), scaled


def make_dataset(preset: Preset, rows: int, out_dir: Path) -> Path:
    """Generates ``rows`` training rows of the preset's synthetic data; returns the train folder.

    Row groups hold at most one batch, so the reader's shuffle buffer is filled from
    several of them as in a real run.
    """
    synth = dataclasses.replace(
        preset.cfg.synth,
        out_dir=str(out_dir),
        train_rows=rows,
        test_rows=min(preset.cfg.synth.test_rows, 1024),
        rows_per_row_group=min(preset.cfg.synth.rows_per_row_group, preset.batch_size),
        rows_per_file=max(min(preset.cfg.synth.rows_per_file, rows), 1),
    )
    generate_synthetic(synth)
    return out_dir / "train"


def rows_needed(batch: int, batches: int) -> int:
    """Rows that give ``batches`` full batches (one spare, so the shuffle's cut never runs short)."""
    return batch * (batches + 1)


def device_batches(data: Path, preset: Preset, count: int, device: torch.device) -> list[Batch]:
    """The first ``count`` batches of ``data``, read once and kept on ``device``."""
    reader = BatchReader.from_config(data, preset.cfg.data, train=True)
    batches = [b.to(device) for b in itertools.islice(reader, count)]
    if len(batches) < count:
        raise ConfigError(
            f"train bench: {data} holds {len(batches)} batches of {preset.batch_size}, need {count}"
        )
    return batches


class RotatingBatches:
    """The device-resident batches, handed out in turn (no data wait by construction)."""

    def __init__(self, batches: list[Batch]) -> None:
        self.batches = batches
        self._next = 0

    def next(self) -> Batch:
        batch = self.batches[self._next % len(self.batches)]
        self._next += 1
        return batch

    def pairs(self) -> Iterator[tuple[Batch, dict]]:
        """Endless (batch, position) pairs, the form the trainer's step loop takes (the
        position counts batches handed out: nothing resumes from it)."""
        while True:
            batch = self.next()
            yield batch, {"bench_batches": self._next}

    def close(self) -> None:
        pass


def reader_config(preset: Preset, data: Path, device: torch.device) -> Config:
    """The preset's config with ``data.workers = "auto"`` resolved as the trainer resolves it
    (:func:`~recaccel.train.loop.setup.with_reader_workers`) on ``device`` for the preset's
    dataset: its ``synth.train_rows`` rows, of which ``data`` is the benchmark's cut.

    The cut holds a few dozen batches; resolved for it, a many-field preset's few shuffle
    buffers gave no reader process, and the H200 (session 15) timed ``bench_wide`` decoding
    500 columns in the training process (11.1 ms a step through the reader against 6.7 ms
    on device data), which a run on the preset's data never does.
    """
    rows = max(open_dataset(data, preset.cfg.data.schema).num_rows, preset.cfg.synth.train_rows)
    return with_reader_workers(preset.cfg, device, rows)


class ReaderBatches:
    """Batches through the real input path: :class:`BatchReader` (Parquet) and
    :class:`DeviceLoader` (prefetch thread, pinned buffer, side-stream copy), with
    ``data.workers = "auto"`` resolved as the trainer resolves it on this device for the
    preset's dataset (:func:`reader_config`: reader processes on a GPU host), so the data
    wait is a real run's.

    Attributes:
        workers: the reader processes (0: decoded in this process).
        waits_ms: host time blocked in each ``next()`` (the data wait), in call order.
    """

    def __init__(self, data: Path, preset: Preset, device: torch.device) -> None:
        cfg = reader_config(preset, data, device)
        self.workers: int = cfg.data.workers
        reader = BatchReader.from_config(data, cfg.data, train=True)
        self._loader = DeviceLoader(reader, device, cfg.data.prefetch, backend=cfg.data.loader_backend)
        self._it: Iterator[tuple[Batch, dict]] = self._loader.iter_with_state()
        self.waits_ms: list[float] = []
        self._data = data

    def next_pair(self) -> tuple[Batch, dict]:
        """The next batch with the reader position after it (the device loader's pair).

        Raises:
            ConfigError: the dataset ran out (the benchmark generated too few rows).
        """
        start = time.perf_counter()
        try:
            pair = next(self._it)
        except StopIteration:
            raise ConfigError(f"train bench: {self._data} ran out of batches") from None
        self.waits_ms.append((time.perf_counter() - start) * 1e3)
        return pair

    def next(self) -> Batch:
        """The next batch (see :meth:`next_pair`)."""
        return self.next_pair()[0]

    def pairs(self) -> Iterator[tuple[Batch, dict]]:
        """The loader's (batch, reader position) pairs, as the trainer's step loop takes
        them (:meth:`DeviceLoader.iter_with_state`), each wait recorded."""
        while True:
            yield self.next_pair()

    def close(self) -> None:
        """Stops the loader's prefetch thread."""
        close = getattr(self._it, "close", None)
        if close is not None:
            close()


def random_batch(schema: FeatureSchema, rows: int, max_bag: int, seed: int, device: torch.device) -> Batch:
    """A batch of uniform random ids (multi-hot bags of 0..``max_bag`` ids, empty ones
    included) and normal dense features, for checking that two models agree."""
    gen = torch.Generator().manual_seed(seed)
    lengths, values = [], []
    for f in schema.sparse:
        n = (
            torch.randint(0, max_bag + 1, (rows,), generator=gen)
            if f.multi_hot
            else torch.ones(rows, dtype=torch.int64)
        )
        lengths.append(n)
        values.append(torch.randint(0, f.cardinality, (int(n.sum()),), generator=gen))
    sparse = SparseFeatures.from_lengths(schema.sparse_names, torch.cat(values), torch.cat(lengths))
    dense = torch.randn(rows, schema.num_dense, generator=gen)
    labels = (torch.rand(rows, generator=gen) < 0.25).float()
    return Batch(dense, sparse, labels).to(device)
