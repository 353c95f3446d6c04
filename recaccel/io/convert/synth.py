"""Synthetic Criteo-like data with a planted ground-truth model.

Rows look like preprocessed Criteo: ``num_dense`` float32 features (log1p of
log-normal counts) and ``num_sparse`` categorical fields whose ids are Zipf-skewed
(exponent ``zipf_a``, truncated to the field's cardinality) over a per-field random
permutation, so the hot ids are scattered through the table. The last
``multi_hot_fields`` fields are bags of 1..``max_bag`` ids (or of the fixed sizes
``bag_sizes``, one per multi-hot field).

Labels come from a planted model that a DLRM with sum-pooled embeddings, dot
interaction and MLPs can represent exactly::

    V_f    = sum of the latent vectors [k] of the ids in field f's bag   (sum pooling)
    bias   = sum over fields and bag members of a per-id scalar
    inter  = sum_{f<g} <V_f, V_g> = (|sum_f V_f|^2 - sum_f |V_f|^2) / 2
    logit  = c + a_b * bias + a_i * inter + a_d * (w . dense)
    label ~ Bernoulli(sigmoid(logit))

The scales ``a_*`` are set on a calibration sample so that the three terms carry
fixed shares of the variance and the logit has standard deviation ``signal_scale``;
``c`` is set so that the mean click probability is :data:`TARGET_CTR`. Knowing the
true probabilities gives the Bayes-optimal AUC and logloss of the test split, the
ceiling any trained model can reach.

Every random draw comes from ``numpy.random.SeedSequence(cfg.seed)`` split into
independent streams (model, calibration, train rows, test rows), so output is a
deterministic function of the config, and the test split does not depend on
``train_rows``. Memory: the per-id tables take ``sum(cardinalities) * (12 + 4k)`` bytes
(plus 8 bytes per id of each distinct cardinality for its CDF); rows are generated and
written in chunks of at most ``_CHUNK_CELLS`` values, whatever the row counts.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from tqdm.auto import tqdm

from recaccel.config import SynthConfig
from recaccel.errors import ConfigError, DataError
from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.io.format.writer import DatasetWriter
from recaccel.metrics import binary_auc, binary_logloss
from recaccel.output_paths import write_text_atomic

TARGET_CTR = 0.25
# Shares of the logit variance carried by the per-id biases, the pairwise field
# interactions and the dense linear term (renormalized over the terms present).
_VARIANCE_SHARES = {"bias": 0.3, "inter": 0.5, "dense": 0.2}
_CALIBRATION_ROWS = 4096
# Bound on the float cells (rows x fields x (k+1)) generated at once.
_CHUNK_CELLS = 1 << 23
_MAX_CHUNK_ROWS = 65_536


@dataclass
class SynthRows:
    """A block of generated (or read back) rows in array form.

    Attributes:
        dense: float32 [n, Dd].
        single: int64 [n, Fs] ids of the single-hot fields (the first Fs fields).
        bags: one ``(values int64 [N_f], offsets int64 [n+1])`` per multi-hot field.
    """

    dense: np.ndarray
    single: np.ndarray
    bags: list[tuple[np.ndarray, np.ndarray]]

    @property
    def num_rows(self) -> int:
        return self.dense.shape[0]


@dataclass(frozen=True)
class PlantedModel:
    """The ground-truth click model of a synthetic dataset.

    Attributes:
        schema: The dataset schema (fields in order: Fs single-hot, then multi-hot).
        field_offsets: int64 [F+1]; field f's ids live at rows
            ``field_offsets[f] .. field_offsets[f+1]`` of the per-id tables.
        bias: float32 [N] per-id scalar terms, N = sum of cardinalities.
        latent: float32 [N, k] per-id latent vectors.
        dense_weight: float64 [Dd] linear weights on the dense features.
        bias_scale: Scale a_b of the summed bias term.
        inter_scale: Scale a_i of the pairwise interaction term.
        dense_scale: Scale a_d of the dense term.
        intercept: Logit offset c.
    """

    schema: FeatureSchema
    field_offsets: np.ndarray
    bias: np.ndarray
    latent: np.ndarray
    dense_weight: np.ndarray
    bias_scale: float = 1.0
    inter_scale: float = 1.0
    dense_scale: float = 1.0
    intercept: float = 0.0

    def terms(self, rows: SynthRows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Unscaled (bias, interaction, dense) terms, each float64 [n]."""
        n, num_single = rows.num_rows, rows.single.shape[1]
        k = self.latent.shape[1]
        gidx = rows.single + self.field_offsets[None, :num_single]
        bias = np.take(self.bias, gidx).sum(axis=1, dtype=np.float64)
        vecs = np.take(self.latent, gidx, axis=0)  # [n, Fs, k]
        total = vecs.sum(axis=1, dtype=np.float64)  # [n, k]
        sq = np.einsum("nfk,nfk->n", vecs, vecs, dtype=np.float64)
        for j, (values, offsets) in enumerate(rows.bags):
            g = values + self.field_offsets[num_single + j]
            row_of = np.repeat(np.arange(n), np.diff(offsets))
            bias += np.bincount(row_of, weights=self.bias[g], minlength=n)
            pooled = np.stack(
                [np.bincount(row_of, weights=self.latent[g, d], minlength=n) for d in range(k)], axis=1
            )  # sum pooling [n, k]
            total += pooled
            sq += np.einsum("nk,nk->n", pooled, pooled)
        inter = 0.5 * (np.einsum("nk,nk->n", total, total) - sq)
        dense = rows.dense.astype(np.float64) @ self.dense_weight
        return bias, inter, dense

    def logits(self, rows: SynthRows) -> np.ndarray:
        """True logits float64 [n] of the rows."""
        bias, inter, dense = self.terms(rows)
        return self.intercept + self.bias_scale * bias + self.inter_scale * inter + self.dense_scale * dense

    def logits_from_table(self, table: pa.Table) -> np.ndarray:
        """True logits float64 [n] of rows read back from a dataset's Parquet files.

        Raises:
            DataError: if a column is missing or an id is out of range.
        """
        return self.logits(rows_from_table(self.schema, table))


def rows_from_table(schema: FeatureSchema, table: pa.Table) -> SynthRows:
    """Converts an Arrow table with ``schema``'s columns to :class:`SynthRows`.

    Raises:
        DataError: naming the column that is missing or holds an out-of-range id.
    """
    for name in schema.column_names():
        if name not in table.column_names:
            raise DataError("column is missing", column=name)
    n = table.num_rows
    dense = np.zeros((n, schema.num_dense), dtype=np.float32)
    for j, name in enumerate(schema.dense):
        dense[:, j] = table.column(name).to_numpy()
    singles, bags = [], []
    for field in schema.sparse:
        col = table.column(field.name).combine_chunks()
        if field.multi_hot:
            values = col.flatten().to_numpy().astype(np.int64)
            lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
            offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
            bags.append((values, offsets))
        else:
            values = col.to_numpy().astype(np.int64)
            singles.append(values)
        if values.size and (values.min() < 0 or values.max() >= field.cardinality):
            bad = values[(values < 0) | (values >= field.cardinality)][0]
            raise DataError(f"id {bad} outside 0..{field.cardinality - 1}", column=field.name)
    single = np.stack(singles, axis=1) if singles else np.zeros((n, 0), dtype=np.int64)
    return SynthRows(dense, single, bags)


@dataclass(frozen=True)
class _RowSampler:
    """Draws Criteo-like rows: dense log-normal counts and Zipf-skewed ids.

    A field's id is ``perm[field_offsets[f] + rank]`` where rank is drawn by inverse CDF
    from the truncated Zipf law of the field's cardinality; fields of equal cardinality
    share one (cache-resident) CDF.
    """

    field_offsets: np.ndarray  # int64 [F+1]
    perm: np.ndarray  # int64 [N]: rank -> id, per field
    cdfs: dict[int, np.ndarray]  # cardinality -> float64 [cardinality] Zipf CDF
    single_groups: list[tuple[int, np.ndarray]]  # (cardinality, single-hot field indices)
    dense_mu: np.ndarray  # [Dd]
    dense_sigma: np.ndarray  # [Dd]
    num_single: int
    max_bag: int
    bag_sizes: tuple[int, ...] = ()  # per multi-hot field a fixed size; () = uniform 1..max_bag

    def _ranks(self, u: np.ndarray, card: int) -> np.ndarray:
        # u < 1 == cdf[-1], so the rank is always < card.
        return np.searchsorted(self.cdfs[card], u, side="right")

    def sample(self, rng: np.random.Generator, n: int) -> SynthRows:
        z = rng.standard_normal((n, self.dense_mu.size))
        counts = np.floor(np.exp(self.dense_mu + self.dense_sigma * z))
        dense = np.log1p(counts).astype(np.float32)
        u = rng.random((n, self.num_single))
        ranks = np.empty((n, self.num_single), dtype=np.int64)
        for card, fields in self.single_groups:
            ranks[:, fields] = self._ranks(u[:, fields], card)
        single = self.perm[ranks + self.field_offsets[None, : self.num_single]]
        bags = []
        for f in range(self.num_single, self.field_offsets.size - 1):
            if self.bag_sizes:
                lengths = np.full(n, self.bag_sizes[f - self.num_single], dtype=np.int64)
            else:
                lengths = rng.integers(1, self.max_bag + 1, size=n)
            start, card = self.field_offsets[f], int(self.field_offsets[f + 1] - self.field_offsets[f])
            values = self.perm[start + self._ranks(rng.random(int(lengths.sum())), card)]
            bags.append((values, np.concatenate([[0], np.cumsum(lengths)])))
        return SynthRows(dense, single, bags)


def synth_schema(cfg: SynthConfig) -> FeatureSchema:
    """The schema of ``cfg``'s dataset: dense ``I1..``, sparse ``C1..`` (the last
    ``multi_hot_fields`` multi-hot), binary ``label``.

    Raises:
        ConfigError: if the config is inconsistent.
    """
    _validate(cfg)
    cards = list(cfg.cardinalities) or [cfg.cardinality] * cfg.num_sparse
    first_multi = cfg.num_sparse - cfg.multi_hot_fields
    sparse = tuple(SparseField(f"C{f + 1}", c, multi_hot=f >= first_multi) for f, c in enumerate(cards))
    return FeatureSchema(dense=tuple(f"I{j + 1}" for j in range(cfg.num_dense)), sparse=sparse)


def _validate(cfg: SynthConfig) -> None:
    checks = [
        (cfg.train_rows > 0, f"synth.train_rows must be > 0, got {cfg.train_rows}"),
        (cfg.test_rows > 0, f"synth.test_rows must be > 0, got {cfg.test_rows}"),
        (cfg.num_dense >= 0, f"synth.num_dense must be >= 0, got {cfg.num_dense}"),
        (cfg.num_sparse >= 0, f"synth.num_sparse must be >= 0, got {cfg.num_sparse}"),
        (cfg.num_dense + cfg.num_sparse > 0, "synth needs at least one dense or sparse feature"),
        (
            not cfg.cardinalities or len(cfg.cardinalities) == cfg.num_sparse,
            f"synth.cardinalities has {len(cfg.cardinalities)} entries, expected num_sparse={cfg.num_sparse}",
        ),
        (cfg.cardinalities or cfg.cardinality > 0, f"synth.cardinality must be > 0, got {cfg.cardinality}"),
        (
            all(c > 0 for c in cfg.cardinalities),
            f"synth.cardinalities must all be > 0, got {cfg.cardinalities}",
        ),
        (
            0 <= cfg.multi_hot_fields <= cfg.num_sparse,
            f"synth.multi_hot_fields must be in 0..num_sparse={cfg.num_sparse}, got {cfg.multi_hot_fields}",
        ),
        (cfg.max_bag >= 1, f"synth.max_bag must be >= 1, got {cfg.max_bag}"),
        (cfg.zipf_a >= 0, f"synth.zipf_a must be >= 0, got {cfg.zipf_a}"),
        (cfg.signal_dim >= 1, f"synth.signal_dim must be >= 1, got {cfg.signal_dim}"),
        (cfg.signal_scale >= 0, f"synth.signal_scale must be >= 0, got {cfg.signal_scale}"),
        (cfg.rows_per_row_group > 0, f"synth.rows_per_row_group must be > 0, got {cfg.rows_per_row_group}"),
        (cfg.rows_per_file > 0, f"synth.rows_per_file must be > 0, got {cfg.rows_per_file}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def _streams(cfg: SynthConfig) -> dict[str, np.random.Generator]:
    seeds = np.random.SeedSequence(cfg.seed).spawn(4)
    return {name: np.random.default_rng(s) for name, s in zip(("model", "calib", "train", "test"), seeds)}


def _build(cfg: SynthConfig) -> tuple[_RowSampler, PlantedModel]:
    """Draws the per-id tables and the row sampler, then calibrates the logit."""
    schema = synth_schema(cfg)
    rng = _streams(cfg)["model"]
    cards = schema.cardinalities
    offsets = np.concatenate([[0], np.cumsum(cards, dtype=np.int64)]).astype(np.int64)
    total = int(offsets[-1])
    perm = np.empty(total, dtype=np.int64)
    cdfs: dict[int, np.ndarray] = {}
    for f, card in enumerate(cards):
        if card not in cdfs:
            c = np.cumsum(np.arange(1, card + 1, dtype=np.float64) ** -cfg.zipf_a)
            c /= c[-1]
            c[-1] = 1.0
            cdfs[card] = c
        perm[offsets[f] : offsets[f + 1]] = rng.permutation(card)
    num_single = cfg.num_sparse - cfg.multi_hot_fields
    single_cards = np.asarray(cards[:num_single], dtype=np.int64)
    sampler = _RowSampler(
        field_offsets=offsets,
        perm=perm,
        cdfs=cdfs,
        single_groups=[(int(c), np.flatnonzero(single_cards == c)) for c in np.unique(single_cards)],
        dense_mu=rng.uniform(-1.0, 3.0, cfg.num_dense),
        dense_sigma=rng.uniform(0.5, 1.5, cfg.num_dense),
        num_single=num_single,
        max_bag=cfg.max_bag,
        bag_sizes=tuple(cfg.bag_sizes),
    )
    raw = PlantedModel(
        schema=schema,
        field_offsets=offsets,
        bias=rng.standard_normal(total, dtype=np.float32),
        latent=rng.standard_normal((total, cfg.signal_dim), dtype=np.float32),
        dense_weight=rng.standard_normal(cfg.num_dense),
    )
    return sampler, _calibrate(raw, sampler, cfg)


def _calibrate(raw: PlantedModel, sampler: _RowSampler, cfg: SynthConfig) -> PlantedModel:
    """Sets the term scales and the intercept on a calibration sample (see module doc)."""
    rng = _streams(cfg)["calib"]
    parts = [raw.terms(sampler.sample(rng, n)) for n in _chunk_sizes(_CALIBRATION_ROWS, _chunk_rows(cfg))]
    terms = {name: np.concatenate([p[i] for p in parts]) for i, name in enumerate(("bias", "inter", "dense"))}
    stds = {name: float(t.std()) for name, t in terms.items()}
    present = {name: share for name, share in _VARIANCE_SHARES.items() if stds[name] > 1e-12}
    norm = sum(present.values())
    scales = {
        name: (cfg.signal_scale * np.sqrt(present[name] / norm) / stds[name] if name in present else 0.0)
        for name in _VARIANCE_SHARES
    }
    z = sum(scales[name] * (terms[name] - terms[name].mean()) for name in terms)
    shift = _solve_intercept(np.asarray(z, dtype=np.float64), TARGET_CTR)
    centre = sum(scales[name] * terms[name].mean() for name in terms)
    return dataclasses.replace(
        raw,
        bias_scale=float(scales["bias"]),
        inter_scale=float(scales["inter"]),
        dense_scale=float(scales["dense"]),
        intercept=float(shift - centre),
    )


def _solve_intercept(z: np.ndarray, ctr: float) -> float:
    """The c with mean(sigmoid(c + z)) == ctr, by bisection (the mean is increasing in c)."""
    lo, hi = -50.0, 50.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if _sigmoid(mid + z).mean() < ctr:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.exp(-np.logaddexp(0.0, -x))


def _chunk_rows(cfg: SynthConfig) -> int:
    bags = sum(cfg.bag_sizes) if cfg.bag_sizes else cfg.multi_hot_fields * cfg.max_bag
    ids_per_row = cfg.num_sparse - cfg.multi_hot_fields + bags
    cells_per_row = ids_per_row * (cfg.signal_dim + 1) + cfg.num_dense
    return int(np.clip(_CHUNK_CELLS // max(1, cells_per_row), 1, _MAX_CHUNK_ROWS))


def _chunk_sizes(rows: int, chunk: int) -> list[int]:
    return [min(chunk, rows - start) for start in range(0, rows, chunk)]


def build_planted_model(cfg: SynthConfig) -> PlantedModel:
    """The planted model that :func:`generate_synthetic` uses for ``cfg`` (deterministic)."""
    return _build(cfg)[1]


@dataclass
class SynthReport:
    """What :func:`generate_synthetic` wrote and how well the planted model does.

    Attributes:
        out_dir: The dataset directory.
        train_paths: Parquet files of the train split, in order.
        test_paths: Parquet files of the test split, in order.
        train_rows: Rows in the train split.
        test_rows: Rows in the test split.
        schema: The dataset schema.
        train_ctr: Mean label of the train split.
        test_ctr: Mean label of the test split.
        planted_ctr: Mean true click probability on the test split.
        bayes_auc: AUC of the true probabilities on the test labels.
        bayes_logloss: Logloss of the true probabilities on the test labels.
        constant_logloss: Test logloss of always predicting ``train_ctr``.
    """

    out_dir: str
    train_paths: list[str]
    test_paths: list[str]
    train_rows: int
    test_rows: int
    schema: FeatureSchema
    train_ctr: float
    test_ctr: float
    planted_ctr: float
    bayes_auc: float
    bayes_logloss: float
    constant_logloss: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def generate_synthetic(cfg: SynthConfig, progress: bool = False, *, overwrite: bool = False) -> SynthReport:
    """Writes ``<out_dir>/{train,test}/part-*.parquet`` and ``<out_dir>/synth.json``.

    Args:
        cfg: What to generate (see :class:`recaccel.config.SynthConfig`).
        progress: Show a progress bar over the generated rows.
        overwrite: Replace existing ``part-*.parquet`` files in the split directories.

    Returns:
        The report, also written to ``synth.json``.

    Raises:
        ConfigError: if the config is inconsistent.
        DataError: if a split directory already holds part files and not ``overwrite``.
    """
    sampler, model = _build(cfg)
    streams = _streams(cfg)
    out = Path(cfg.out_dir)
    sizes = {"train": cfg.train_rows, "test": cfg.test_rows}
    clicks = {"train": 0.0, "test": 0.0}
    # Only the test split's labels and logits are kept (for the Bayes metrics).
    test_labels: list[np.ndarray] = []
    test_logits: list[np.ndarray] = []
    chunk = _chunk_rows(cfg)
    # Both writers open before anything is written, so an existing dataset fails early.
    writers = {
        split: DatasetWriter(
            out / split,
            model.schema,
            cfg.rows_per_row_group,
            cfg.rows_per_file,
            overwrite=overwrite,
            compression=cfg.compression,
        )
        for split in sizes
    }
    with (
        writers["train"],
        writers["test"],
        tqdm(total=sum(sizes.values()), unit="rows", disable=not progress, desc="synth") as bar,
    ):
        for split, rows in sizes.items():
            rng = streams[split]
            for n in _chunk_sizes(rows, chunk):
                block = sampler.sample(rng, n)
                z = model.logits(block)
                y = (rng.random(n) < _sigmoid(z)).astype(np.float32)
                writers[split].write(_columns(block, y, model.schema))
                clicks[split] += float(y.sum())
                if split == "test":
                    test_labels.append(y)
                    test_logits.append(z)
                bar.update(n)
    y_test = torch.from_numpy(np.concatenate(test_labels))
    z_test = torch.from_numpy(np.concatenate(test_logits))
    p_test = torch.sigmoid(z_test)
    train_ctr = clicks["train"] / cfg.train_rows
    report = SynthReport(
        out_dir=str(out),
        train_paths=[str(p) for p in writers["train"].paths],
        test_paths=[str(p) for p in writers["test"].paths],
        train_rows=cfg.train_rows,
        test_rows=cfg.test_rows,
        schema=model.schema,
        train_ctr=train_ctr,
        test_ctr=clicks["test"] / cfg.test_rows,
        planted_ctr=float(p_test.mean()),
        bayes_auc=binary_auc(z_test, y_test),
        bayes_logloss=binary_logloss(p_test, y_test),
        constant_logloss=binary_logloss(torch.full_like(p_test, train_ctr), y_test),
    )
    saved = {"report": report.to_dict(), "config": dataclasses.asdict(cfg)}
    write_text_atomic(out / "synth.json", json.dumps(saved, indent=2))
    return report


def _columns(rows: SynthRows, labels: np.ndarray, schema: FeatureSchema) -> dict:
    """A block as the ``columns`` mapping of :class:`DatasetWriter`."""
    cols: dict = {schema.label: labels}
    cols.update({name: np.ascontiguousarray(rows.dense[:, j]) for j, name in enumerate(schema.dense)})
    num_single = rows.single.shape[1]
    for f, field in enumerate(schema.sparse):
        if field.multi_hot:
            cols[field.name] = rows.bags[f - num_single]
        else:
            cols[field.name] = np.ascontiguousarray(rows.single[:, f])
    return cols
