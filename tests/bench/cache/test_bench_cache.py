"""recaccel-bench cache: the policies against hand-worked and exhaustive answers, the CLI's outputs."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from recaccel.bench.cache.policies import POLICIES, Trace, largest_need, simulate
from recaccel.bench.cache.traces import TraceSizes, criteo_trace, load_trace, movielens_trace, zipf_trace
from recaccel.cli import bench_main
from recaccel.errors import ConfigError

# Six rows, six batches. Worked by hand at capacity 3 (see each test); 10 rows requested.
HAND = [[0, 1], [2], [0, 3, 3], [1, 4], [2, 0], [1]]


def hand() -> Trace:
    return Trace.from_ids("hand", 6, HAND)


def test_lru_by_hand():
    # b0 fetch 0,1 | b1 fetch 2 | b2 hit 0, fetch 3 evicting 1 (last used 0, before 2's 1)
    # b3 fetch 1,4 evicting 2 (last 1) and 0 (last 2, ties 3, smaller id) | b4 fetch 0,2 evicting 3 and 1
    # (last 3, ties 4, smaller id) | b5 fetch 1 evicting 4: 9 transfers, 1 hit.
    out = simulate(hand(), 3, "lru")
    assert (out.requested, out.transferred) == (10, 9)
    assert out.hit_rate == pytest.approx(0.1)


def test_lfu_by_hand():
    # b2: 1 and 2 each used once; 1 less recently -> evict 1 | b3 fetch 1,4: 0 used twice stays,
    # evict 2 and 3 | b4 hit 0, fetch 2 evicting 4 (once) not 1 (twice) | b5 hit 1: 7 transfers.
    out = simulate(hand(), 3, "lfu")
    assert out.transferred == 7 and out.hit_rate == pytest.approx(0.3)


def test_belady_by_hand():
    # b2 fetch 3 evicting 2 (next use 4, vs 1's 3) | b3 hit 1, fetch 4 evicting 3 (never again)
    # | b4 hit 0, fetch 2 evicting 4 (never again) | b5 hit 1: 6 transfers.
    out = simulate(hand(), 3, "belady")
    assert out.transferred == 6 and out.hit_rate == pytest.approx(0.4)


def test_lookahead_by_hand():
    """k = 2 at capacity 4: batch 1's row 2 arrives with batch 0's rows; victims lie outside the window."""
    events = []
    out = simulate(
        hand(), 4, "lookahead", 2, observe=lambda i, f, e, r: events.append((f.tolist(), e.tolist()))
    )
    assert events == [([0, 1, 2], []), ([3], []), ([4], [2]), ([2], [3]), ([], []), ([], [])]
    assert out.transferred == 6 and out.hit_rate == pytest.approx(0.4)
    # k = 1 is fetch on demand with LRU beyond the batch
    assert simulate(hand(), 3, "lookahead", 1).transferred == simulate(hand(), 3, "lru").transferred


def test_infeasible_cells_carry_the_reason():
    # batches 2..3 look up {0, 1, 3, 4}: four rows
    out = simulate(hand(), 3, "lookahead", 2)
    assert out.hit_rate is None and out.transferred is None
    assert out.reason == "batches 2..3 need 4 rows > 3 cached"
    for policy in ("lru", "lfu", "belady"):
        out = simulate(hand(), 1, policy)
        assert out.hit_rate is None and out.reason == "batch 0 need 2 rows > 1 cached"
    assert largest_need(hand(), 2) == (2, 4)
    assert simulate(hand(), 2, "lru").hit_rate is not None  # exactly one batch's rows fits


def _optimum(trace: Trace, capacity: int) -> int:
    """Fewest transfers of any policy, prefetching included: every reachable cache content, exhaustively."""
    rows = range(trace.rows)
    best = {frozenset(): 0}
    for batch in trace.batches:
        need = frozenset(batch.tolist())
        nxt: dict[frozenset, int] = {}
        for held, cost in best.items():
            for size in range(len(need), capacity + 1):
                for extra in itertools.combinations([r for r in rows if r not in need], size - len(need)):
                    after = need | frozenset(extra)
                    c = cost + len(after - held)
                    nxt[after] = min(c, nxt.get(after, c))
        best = nxt
    return min(best.values())


def _random_trace(rng, rows: int, batches: int, most: int) -> Trace:
    ids = [rng.integers(0, rows, rng.integers(1, most + 1)) for _ in range(batches)]
    return Trace.from_ids("random", rows, ids)


def test_belady_is_the_exhaustive_optimum():
    rng = np.random.default_rng(0)
    for _ in range(12):
        trace = _random_trace(rng, 5, 7, 2)
        for capacity in (2, 3):
            assert simulate(trace, capacity, "belady").transferred == _optimum(trace, capacity)


def test_belady_beats_every_policy_and_none_beats_the_ceiling():
    rng = np.random.default_rng(1)
    for _ in range(30):
        trace = _random_trace(rng, int(rng.integers(4, 40)), int(rng.integers(3, 30)), 6)
        ceiling = 1 - trace.distinct / trace.requested
        for capacity in (6, 10, 24, 64):
            opt = simulate(trace, capacity, "belady").hit_rate
            assert opt <= ceiling + 1e-12
            for policy in POLICIES:
                for k in (1, 2, 4):
                    for beyond in ("lru", "lfu"):
                        rate = simulate(trace, capacity, policy, k, beyond=beyond).hit_rate
                        assert rate is None or rate <= opt + 1e-12, (policy, k, beyond, capacity)
                        if capacity >= trace.distinct and rate is not None:
                            assert rate == pytest.approx(ceiling)  # nothing is ever evicted


@pytest.mark.parametrize("beyond", ["lru", "lfu"])
def test_lookahead_never_evicts_a_row_its_window_needs(beyond):
    rng = np.random.default_rng(2)
    for _ in range(20):
        trace = _random_trace(rng, 30, 25, 5)
        for k, capacity in itertools.product((1, 2, 4), (12, 20)):
            seen = []

            def observe(i, fetched, evicted, resident, trace=trace, k=k, capacity=capacity, seen=seen):
                window = trace.window(i, k)
                assert not np.isin(evicted, window).any()
                assert np.isin(window, resident).all() and len(resident) <= capacity
                assert len(np.unique(resident)) == len(resident)
                seen.append(len(fetched))

            out = simulate(trace, capacity, "lookahead", k, beyond=beyond, observe=observe)
            if out.reason is None:
                assert out.transferred == sum(seen) and len(seen) == len(trace.batches)


def test_lookahead_with_lru_beyond_the_window_transfers_what_lru_does():
    """The finding the module docstring proves: the window only moves LRU's transfers earlier."""
    rng = np.random.default_rng(3)
    for _ in range(30):
        trace = _random_trace(rng, 40, 30, 6)
        for capacity in (8, 14, 25):
            lru = simulate(trace, capacity, "lru").transferred
            for k in (2, 3, 4):
                out = simulate(trace, capacity, "lookahead", k)
                assert out.transferred is None or out.transferred == lru


def test_bad_inputs_are_config_errors():
    with pytest.raises(ConfigError, match="policy"):
        simulate(hand(), 3, "fifo")
    with pytest.raises(ConfigError, match="lru or lfu"):
        simulate(hand(), 3, "lookahead", 2, beyond="belady")
    with pytest.raises(ConfigError, match=r"outside \[0, 6\)"):
        Trace.from_ids("bad", 6, [[0, 6]])
    with pytest.raises(ConfigError, match="unknown trace 'zipf-x'"):
        load_trace("zipf-x", TraceSizes(), None)


def test_zipf_traces_are_seeded_and_skewed():
    sizes = TraceSizes(zipf_rows=5000, zipf_batch=256, zipf_batches=20, seed=4)
    a, b = zipf_trace(1.05, sizes), zipf_trace(1.05, sizes)
    assert a.rows == 5000 and len(a.batches) == 20
    assert all(np.array_equal(x, y) for x, y in zip(a.batches, b.batches))
    assert all(x.max() < 5000 and x.min() >= 0 for x in a.batches)
    assert zipf_trace(1.2, sizes).distinct < a.distinct < zipf_trace(0.8, sizes).distinct


def test_real_trace_readers(tmp_path):
    crit = tmp_path / "criteo-kaggle-head10k"
    crit.mkdir()
    cats = [["aa", "", "bb", "aa", "cc"][i] for i in range(5)]
    lines = ["\t".join(["0"] + ["1"] * 13 + [c] + ["x"] * 25) for c in cats]
    (crit / "train_examples.txt").write_text("\n".join(lines) + "\n")
    trace = criteo_trace(1, tmp_path, 2)
    assert trace.rows == 4 and [b.tolist() for b in trace.batches] == [[0, 1], [1, 2], [3]]
    ml = tmp_path / "movielens-100k"
    ml.mkdir()
    (ml / "u.data").write_text("7\t10\t3\t1\n9\t10\t4\t2\n7\t11\t5\t3\n")
    assert [b.tolist() for b in movielens_trace("user", tmp_path, 2).batches] == [[0, 1], [0]]
    assert [b.tolist() for b in movielens_trace("item", tmp_path, 2).batches] == [[0], [1]]


def test_real_criteo_trace(shared_data):
    data = shared_data("criteo-kaggle-head10k", "train_examples.txt").parent
    trace = criteo_trace(3, data, 256)
    assert trace.rows == 5521 and len(trace.batches) == 40 and trace.requested > trace.distinct


def test_cli_writes_json_markdown_and_plot(tmp_path, capsys):
    out, js = tmp_path / "cache.md", tmp_path / "cache.json"
    argv = ["cache", "--traces", "zipf-1.05,movielens-user", "--fractions", "0.01,0.2", "--lookahead", "1,2"]
    argv += [
        "--zipf-rows",
        "2000",
        "--zipf-batch",
        "64",
        "--zipf-batches",
        "30",
        "--data",
        str(tmp_path / "none"),
    ]
    assert bench_main(argv + ["--out", str(out), "--json", str(js)]) == 0
    doc = json.loads(js.read_text())
    results = doc["results"]
    assert len(results) == 2 * (2 + 3)  # fractions x (k=1, k=2, lru, lfu, belady)
    for row in results:
        assert set(row) == {"trace", "cache_fraction", "lookahead", "policy", "hit_rate"}
        assert row["trace"] == "zipf-1.05" and row["policy"] in POLICIES
        assert (row["lookahead"] is None) == (row["policy"] != "lookahead")
    # 1% of 2000 rows = 20 < a batch's unique rows: infeasible, the reason at the top level
    small = [r for r in results if r["cache_fraction"] == 0.01]
    assert all(r["hit_rate"] is None for r in small)
    assert {(r["policy"], r["lookahead"]) for r in doc["infeasible"]} == {
        (r["policy"], r["lookahead"]) for r in small
    }
    assert all(0 < r["hit_rate"] < 1 for r in results if r["cache_fraction"] == 0.2)
    assert "movielens-user: skipped" in doc["skipped"][0]
    text = out.read_text()
    assert (
        "## zipf-1.05" in text
        and "| fraction | rows cached | lookahead k=1 | lookahead k=2 | lru | lfu | belady |" in text
    )
    assert (
        "infeasible: batch" in text and "movielens-user: skipped" in text and "recaccel-bench cache" in text
    )
    assert (tmp_path / "cache.png").stat().st_size > 0
    assert f"results written to {out}" in capsys.readouterr().out


def test_cli_with_no_trace_left_is_a_config_error(tmp_path, capsys):
    argv = ["cache", "--traces", "criteo-C3", "--data", str(tmp_path), "--out", str(tmp_path / "c.md")]
    assert bench_main(argv) == 2
    assert "no trace to replay" in capsys.readouterr().err
