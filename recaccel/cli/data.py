"""recaccel-data: generate and convert datasets."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from recaccel.cli.common import add_config_args, run_command, setup_logging
from recaccel.config import BadRowsPolicy, MovieLensScenario, ParquetCodec, choices
from recaccel.errors import ConfigError, DataError
from recaccel.output_paths import Read, check_output, check_output_dir, write_text_atomic

_OVERWRITE_HELP = (
    "replace what OUT_DIR already holds where this writes (its split folders, its report); never the source"
)


def data_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="recaccel-data", description="Generate and convert datasets.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_synth(sub)
    _add_criteo(sub)
    _add_movielens(sub)
    _add_melu(sub)
    _add_tasks(sub)
    _add_inspect(sub)
    _add_cache(sub)

    args = parser.parse_args(argv)
    setup_logging(args.verbose)

    def body() -> int:
        if args.command == "inspect":
            return _inspect(args)
        report = _DATA_COMMANDS[args.command](args)
        hidden = ("schema", "train_paths", "test_paths", "skipped_lines", "paths")
        print(json.dumps({k: v for k, v in report.items() if k not in hidden}, indent=2, default=str))
        return 0

    return run_command("recaccel-data", body)


def _add_synth(sub: argparse._SubParsersAction) -> None:
    """The ``synth`` subcommand: generate the [synth] config's dataset."""
    synth = sub.add_parser("synth", help="Criteo-like synthetic data with a planted model ([synth] config)")
    add_config_args(synth, required=False)
    synth.add_argument(
        "--overwrite",
        "--force",
        action="store_true",
        help="replace a dataset generated with another config, or other files in its split folders",
    )


def _add_criteo(sub: argparse._SubParsersAction) -> None:
    """The ``criteo`` subcommand: Criteo TSV to Parquet."""
    criteo = sub.add_parser("criteo", help="Criteo Kaggle/Terabyte TSV to Parquet")
    criteo.add_argument("src", help="TSV file (label, I1..I13, C1..C26)")
    criteo.add_argument("out_dir", help="output folder (train/ and test/ are written inside)")
    criteo.add_argument("--cardinality", type=int, default=100_000, help="hash buckets per categorical")
    criteo.add_argument(
        "--test-fraction", type=float, default=0.2, help="last fraction of rows kept for test"
    )
    criteo.add_argument(
        "--rows-per-row-group", type=int, default=65_536, help="rows per Parquet row group written"
    )
    criteo.add_argument(
        "--bad-rows",
        choices=choices(BadRowsPolicy),
        default="error",
        help="a malformed TSV line stops the conversion (error) or is dropped and counted (skip)",
    )
    criteo.add_argument("--overwrite", "--force", action="store_true", help=_OVERWRITE_HELP)
    _compression_arg(criteo)


def _add_movielens(sub: argparse._SubParsersAction) -> None:
    """The ``movielens`` subcommand: MovieLens 100K to task-grouped Parquet."""
    movielens = sub.add_parser("movielens", help="MovieLens 100K to task-grouped Parquet (user = task)")
    movielens.add_argument("src", help="folder with u.data, u.user, u.item, u.genre, u.occupation")
    movielens.add_argument("out_dir", help="output folder (train/ and test/ are written inside)")
    movielens.add_argument(
        "--scenario",
        default="new_users",
        choices=choices(MovieLensScenario),
        help="cold-start split: held-out users, items, both, or the latest ratings",
    )
    movielens.add_argument(
        "--test-fraction", type=float, default=0.2, help="share of users, items or ratings held out"
    )
    movielens.add_argument("--seed", type=int, default=0, help="seeds the held-out draw")
    movielens.add_argument("--binarize", action="store_true", help="label = rating >= 4 (clicks)")
    movielens.add_argument("--overwrite", "--force", action="store_true", help=_OVERWRITE_HELP)
    _compression_arg(movielens)


def _add_melu(sub: argparse._SubParsersAction) -> None:
    """The ``melu`` subcommand: MeLU's MovieLens 1M states to task-grouped Parquet."""
    melu = sub.add_parser("melu", help="MeLU's preprocessed MovieLens 1M states to task-grouped Parquet")
    melu.add_argument(
        "src", help="folder with *_state.json, *_state_y.json, users.dat, movies_extrainfos.dat"
    )
    melu.add_argument("out_dir", help="output folder (one folder per state)")
    melu.add_argument("--binarize", action="store_true", help="label = rating >= 4 (clicks)")
    melu.add_argument(
        "--protocol",
        choices=("all", "melu"),
        default="all",
        help="all: every user, reader splits; melu: 13..100 ratings, 10 fixed random query ratings",
    )
    melu.add_argument(
        "--min-ratings", type=int, help="drop users with fewer ratings (default: the protocol's)"
    )
    melu.add_argument(
        "--max-ratings", type=int, help="drop users with more ratings (default: the protocol's)"
    )
    melu.add_argument("--query-count", type=int, help="fixed random query ratings per user; 0 = none")
    melu.add_argument("--seed", type=int, default=0, help="seeds the query choice and the validation users")
    melu.add_argument(
        "--valid-fraction",
        type=float,
        default=0.0,
        help="share of warm_state users also written as warm_state_valid (rest: warm_state_train)",
    )
    melu.add_argument("--overwrite", "--force", action="store_true", help=_OVERWRITE_HELP)
    _compression_arg(melu)


def _add_tasks(sub: argparse._SubParsersAction) -> None:
    """The ``tasks`` subcommand: any Parquet regrouped by a task key."""
    tasks = sub.add_parser(
        "tasks",
        help="rewrite a Parquet dataset grouped by a task key (any Parquet with a [data.schema] config)",
    )
    tasks.add_argument(
        "src", help="Parquet file or folder (recaccel's, or any with --config's [data.schema])"
    )
    tasks.add_argument("out_dir", help="output folder of the task-grouped Parquet files")
    add_config_args(tasks, required=False)
    tasks.add_argument(
        "--task-key", help="column whose value names a row's task (default: data.schema.task_key)"
    )
    tasks.add_argument(
        "--timestamp", help="column ordering rows within a task (default: the schema's timestamp)"
    )
    tasks.add_argument(
        "--rows-per-row-group", type=int, default=8192, help="rows per Parquet row group written"
    )
    tasks.add_argument(
        "--memory-rows",
        "--memory",
        type=int,
        default=1_000_000,
        help="rows sorted in memory at once; more rows are sorted in runs spilled to disk and merged",
    )
    tasks.add_argument("--overwrite", "--force", action="store_true", help=_OVERWRITE_HELP)
    _compression_arg(tasks)


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    """The ``inspect`` subcommand: a Parquet's columns and a suggested [data.schema]."""
    inspect = sub.add_parser(
        "inspect", help="any Parquet's columns (type, nulls, distinct) and a suggested [data.schema]"
    )
    inspect.add_argument(
        "path",
        nargs="+",
        help=".parquet files or folders of them, read together (give the train and test data)",
    )
    inspect.add_argument("--label", help="the label column (default: a column named like one)")
    inspect.add_argument(
        "--write-schema",
        metavar="FILE",
        help="write the suggested [data.schema] TOML here, and its columns' vocabularies to FILE's .vocab.json",
    )
    inspect.add_argument("--force", action="store_true", help="replace an existing --write-schema file")
    inspect.add_argument(
        "--exact-limit",
        type=int,
        default=100_000,
        help="distinct values counted exactly per column; beyond, an estimate (shown with ~)",
    )
    inspect.add_argument(
        "--vocabulary-limit",
        type=int,
        default=100_000,
        help="columns with at most this many distinct values get an exact vocabulary (with --write-schema); "
        "more: a hash",
    )


def _add_cache(sub: argparse._SubParsersAction) -> None:
    """The ``cache`` subcommand: a dataset's decoded columns in memory-mappable files."""
    cache = sub.add_parser(
        "cache",
        help="decode a Parquet dataset once into a read-only cache folder that data.train / data.test "
        "can name (repeated epochs skip Parquet decoding)",
    )
    cache.add_argument(
        "src", help="Parquet file or folder (recaccel's, or any with --config's [data.schema])"
    )
    cache.add_argument("dst", help="the cache folder to write (absent or empty)")
    add_config_args(cache, required=False)
    cache.add_argument("--force", action="store_true", help="replace what DST holds")


def _cache(args: argparse.Namespace) -> dict[str, Any]:
    """Builds the cache under --config's [data.schema] and read policies (defaults without)."""
    from recaccel.config import load_config
    from recaccel.io.format.cache.build import build_cache
    from recaccel.io.format.decode import Policies

    data = load_config(args.config, args.overrides).data  # the defaults without --config
    reads = [Read(Path(args.src), "the data this command reads")]
    reads += [Read(Path(c), "a config file this command reads") for c in args.config or ()]
    check_output_dir(args.dst, (".",), flag="DST", force=args.force, reads=reads, force_flag="--force")
    return build_cache(
        args.src,
        args.dst,
        schema=data.schema,
        policies=Policies.from_config(data),
        unreadable=data.unreadable_files,
        force=args.force,
        progress=True,
    ).to_dict()


def _inspect(args: argparse.Namespace) -> int:
    """Prints each column's statistics and the suggested mapping (written to --write-schema)."""
    from recaccel.io.format.inspect import format_table, inspect_dataset, suggest_mapping, vocabularies
    from recaccel.io.format.vocabulary import text_digest, vocabulary_text

    vocab_file = None
    if args.write_schema:
        vocab_file = str(Path(args.write_schema).with_suffix(".vocab.json").resolve())
        reads = [Read(Path(p), "the data this command reads") for p in args.path]
        check_output(args.write_schema, flag="--write-schema", force=args.force, reads=reads)
        check_output(vocab_file, flag="--write-schema's vocabulary file", force=args.force, reads=reads)
    stats = inspect_dataset(
        args.path, exact_limit=max(1, args.exact_limit), vocabulary_limit=max(0, args.vocabulary_limit)
    )
    found = vocabularies(stats, args.label) if vocab_file else {}
    vocab_text = vocabulary_text(found) if found else None
    digest = text_digest(vocab_text) if vocab_text else None
    fragment = suggest_mapping(stats, args.label, vocabulary_file=vocab_file, vocabulary_sha256=digest)
    print(format_table(stats))
    print()
    print(fragment, end="")
    if args.write_schema:
        if vocab_text:
            write_text_atomic(vocab_file, vocab_text)
        write_text_atomic(args.write_schema, fragment)
        print(
            f"\n# written to {args.write_schema}: review it, then train with --config YOUR.toml --config {args.write_schema}"
        )
    return 0


def _compression_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compression",
        choices=choices(ParquetCodec),
        default="snappy",
        help="Parquet codec (snappy and lz4 decode at about the same speed now that ids are int32; none decodes fastest)",
    )


def _criteo(args: argparse.Namespace) -> dict[str, Any]:
    from recaccel.io.convert.criteo import convert_criteo

    _check_out_dir(
        args, ("train", "test", "criteo.json"), Read(Path(args.src), "the file this command reads")
    )
    return convert_criteo(
        args.src,
        args.out_dir,
        cardinality=args.cardinality,
        test_fraction=args.test_fraction,
        rows_per_row_group=args.rows_per_row_group,
        bad_rows=args.bad_rows,
        progress=True,
        overwrite=args.overwrite,
        compression=args.compression,
    ).to_dict()


def _movielens(args: argparse.Namespace) -> dict[str, Any]:
    from recaccel.io.convert.movielens import convert_movielens

    source = Read(Path(args.src), "the MovieLens folder this command reads", whole=False)
    _check_out_dir(args, ("train", "test", "movielens.json"), source)
    return convert_movielens(
        args.src,
        args.out_dir,
        scenario=args.scenario,
        test_fraction=args.test_fraction,
        seed=args.seed,
        binarize=args.binarize,
        overwrite=args.overwrite,
        compression=args.compression,
    ).to_dict()


def _melu(args: argparse.Namespace) -> dict[str, Any]:
    from recaccel.io.convert.melu import STATES, VALID_STATES, convert_melu

    splits = VALID_STATES if args.valid_fraction > 0 else ()
    source = Read(Path(args.src), "the MeLU folder this command reads", whole=False)
    _check_out_dir(args, (*STATES, *splits, "melu.json"), source)
    return convert_melu(
        args.src,
        args.out_dir,
        protocol=args.protocol,
        binarize=args.binarize,
        min_ratings=args.min_ratings,
        max_ratings=args.max_ratings,
        query_count=args.query_count,
        seed=args.seed,
        valid_fraction=args.valid_fraction,
        overwrite=args.overwrite,
        compression=args.compression,
    ).to_dict()


def _tasks(args: argparse.Namespace) -> dict[str, Any]:
    from recaccel.config import load_config
    from recaccel.io.convert.group_by_task import group_by_task

    mapping = load_config(args.config, args.overrides).data.schema if args.config or args.overrides else None
    task_key = args.task_key or (mapping.task_key if mapping is not None else None)
    if task_key is None:
        raise ConfigError("recaccel-data tasks needs --task-key (or data.schema.task_key in --config)")
    reads = [Read(Path(args.src), "the data this command reads")]
    reads += [Read(Path(c), "a config file this command reads") for c in args.config or ()]
    check_output_dir(args.out_dir, (".",), flag="out_dir", force=args.overwrite, reads=reads)
    return group_by_task(
        args.src,
        args.out_dir,
        task_key=task_key,
        timestamp=args.timestamp,
        schema=mapping,
        rows_per_row_group=args.rows_per_row_group,
        memory_rows=args.memory_rows,
        overwrite=args.overwrite,
        compression=args.compression,
        progress=True,
    ).to_dict()


def _synth(args: argparse.Namespace) -> dict[str, Any]:
    """Generates the [synth] dataset, or reuses it when synth.json shows the same config.

    Raises:
        DataError: if the folder holds data generated with another config (and not
            ``--overwrite``).
    """
    from recaccel.config import load_config
    from recaccel.io.convert.synth import generate_synthetic

    cfg = load_config(args.config, args.overrides).synth
    done = Path(cfg.out_dir) / "synth.json"
    if done.is_file() and not args.overwrite:
        saved = json.loads(done.read_text())
        differ = _synth_config_diff(saved.get("config") or {}, cfg)
        if not differ:
            print(f"{cfg.out_dir} is up to date (same [synth] config); not regenerating", file=sys.stderr)
            return saved["report"]
        raise DataError(
            f"was generated with another [synth] config (differs in: {', '.join(differ)}); "
            "pass --overwrite to regenerate it",
            path=str(cfg.out_dir),
        )
    reads = [Read(Path(c), "a config file this command reads") for c in args.config or ()]
    check_output_dir(
        cfg.out_dir, ("train", "test", "synth.json"), flag="synth.out_dir", force=args.overwrite, reads=reads
    )
    return generate_synthetic(cfg, progress=True, overwrite=args.overwrite).to_dict()


def _check_out_dir(args: argparse.Namespace, targets: tuple[str, ...], source: Read) -> None:
    """Refuses a converter's out_dir where its outputs (``targets`` in it) would replace the
    source, or hold files already (unless --overwrite); before any row is read."""
    check_output_dir(args.out_dir, targets, flag="out_dir", force=args.overwrite, reads=[source])


def _synth_config_diff(saved: dict[str, Any], cfg: Any) -> list[str]:
    """Keys where a saved [synth] config differs from ``cfg``; a key the saved one lacks
    (added to SynthConfig since) counts at its default. ``out_dir`` is this folder however
    it was written (relative to a config file or to the working directory)."""
    import dataclasses

    current = json.loads(json.dumps(dataclasses.asdict(cfg)))
    defaults = json.loads(json.dumps(dataclasses.asdict(type(cfg)())))
    keys = sorted((set(saved) | set(current)) - {"out_dir"})
    return [k for k in keys if k not in current or saved.get(k, defaults[k]) != current[k]]


_DATA_COMMANDS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "synth": _synth,
    "criteo": _criteo,
    "movielens": _movielens,
    "melu": _melu,
    "tasks": _tasks,
    "cache": _cache,
}
