"""The staged-span planner: gap choice against brute force, layouts, slots and the cost fit."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from sidecar.nixl.spans import (
    GapRead,
    ReadCost,
    SpanGaps,
    count_runs,
    fit_read_cost,
    identity_rows,
    plan_gaps,
    plan_span,
    span_saving_us,
    span_slots,
    worth_waiting,
)

PAGE = 64 * 1024


@pytest.mark.parametrize(
    ("desc_us", "gbps"), [(0.0, 1.0), (8.0, 10.0), (8.0, 2000.0), (1.0, 0.5), (3.3, 7.7)]
)
def test_max_gap_blocks_is_the_largest_strictly_cheaper_gap(desc_us, gbps):
    cost = ReadCost(desc_us, gbps)
    for page in (1, 1000, PAGE, 10**6):
        k = cost.max_gap_blocks(page)
        assert k >= 0
        assert k == 0 or cost.bytes_us(k * page) < desc_us
        assert not cost.bytes_us((k + 1) * page) < desc_us


def test_exact_break_even_is_not_read():
    # 8 µs per descriptor, 1 GB/s: 8,000 bytes cost exactly one descriptor -> not cheaper, not read
    assert ReadCost(8.0, 1.0).max_gap_blocks(8000) == 0
    assert ReadCost(8.0, 1.0).max_gap_blocks(7999) == 1
    assert ReadCost(8.0, 1.0).max_gap_blocks(2000) == 3


@pytest.mark.parametrize(("desc_us", "gbps"), [(-1.0, 1.0), (1.0, 0.0), (1.0, -2.0), (float("nan"), 1.0)])
def test_bad_costs_are_refused(desc_us, gbps):
    with pytest.raises(ValueError):
        ReadCost(desc_us, gbps)


def _gaps(ids):
    return [(int(a), int(b)) for a, b in zip(ids[:-1], ids[1:], strict=True) if b - a > 1]


def brute_best(ids, limit, budget):
    """The most gaps (each one descriptor saved) within the budget, each at most ``limit`` long."""
    cand = [g for g in _gaps(ids) if g[1] - g[0] - 1 <= limit]
    best = 0
    for r in range(len(cand) + 1):
        for sub in itertools.combinations(cand, r):
            if sum(b - a - 1 for a, b in sub) <= budget:
                best = max(best, r)
    return best


def test_plan_gaps_saves_the_most_descriptors_exhaustively():
    rng = np.random.default_rng(0)
    cost = ReadCost(8.0, 1.0)  # 1,000-byte pages: gaps of up to 7 pages
    limit = cost.max_gap_blocks(1000)
    assert limit == 7
    checked = 0
    for _ in range(400):
        n = int(rng.integers(0, 9))
        ids = np.sort(rng.choice(40, size=n, replace=False)).astype(np.int64)
        for budget in (0, 1, 3, 6, 10, 100):
            got = plan_gaps(ids, 1000, cost, budget)
            assert got.size <= budget
            assert np.intersect1d(got, ids).size == 0
            # only whole gaps, each inside the limit
            every = np.union1d(ids, got)
            bridged = [g for g in _gaps(ids) if set(range(g[0] + 1, g[1])) <= set(got.tolist())]
            assert sum(b - a - 1 for a, b in bridged) == got.size
            assert all(b - a - 1 <= limit for a, b in bridged)
            saved = count_runs(ids) - count_runs(every)
            assert saved == len(bridged) == brute_best(ids, limit, budget)
            checked += 1
    assert checked == 2400


def test_no_cost_or_no_budget_means_no_gaps():
    ids = np.array([0, 2, 4])
    assert plan_gaps(ids, PAGE, None, 100).size == 0
    assert plan_gaps(ids, PAGE, ReadCost(8.0, 1.0), 0).size == 0
    assert plan_gaps(ids, 10**9, ReadCost(8.0, 1.0), 100).size == 0  # a page costs more than a descriptor


def test_plan_gaps_needs_sorted_unique_ids():
    with pytest.raises(ValueError, match="sorted and unique"):
        plan_gaps(np.array([3, 1, 5]), 1000, ReadCost(8.0, 1.0), 10)


def test_plan_span_lays_blocks_out_in_remote_order():
    rng = np.random.default_rng(1)
    cost = ReadCost(8.0, 1.0)
    for _ in range(300):
        n = int(rng.integers(0, 12))
        rk = rng.choice(60, size=n, replace=False).astype(np.int64)  # request order, scattered
        budget = int(rng.integers(0, 20))
        span = plan_span(rk, 1000, cost, budget)
        every = np.full(span.width, -1, np.int64)
        every[span.pos] = rk
        every[span.gap_pos] = span.gap_ids
        assert span.width == n + span.gap_blocks
        assert (every >= 0).all() and (np.diff(every) > 0).all()  # a permutation, ascending remote ids
        assert count_runs(every) <= count_runs(np.sort(rk))
        assert span.gap_blocks <= budget
        assert span.gap_ids.tolist() == plan_gaps(np.sort(rk), 1000, cost, budget).tolist()


@pytest.mark.parametrize("seed", range(40))
def test_plan_span_on_long_requests_matches_a_merge_of_the_sorted_ids(seed):
    """The slots ``plan_span`` computes from gap runs are where a sort of needed and gap ids puts them."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 400))
    rk = rng.choice(int(rng.integers(n, 6 * n)), size=n, replace=False).astype(np.int64)
    cost = ReadCost(8.0, float(rng.choice([0.05, 1.0, 20.0])))
    span = plan_span(rk, 1000, cost, int(rng.integers(0, 3 * n)))
    every = np.sort(np.concatenate([rk, span.gap_ids]))
    assert span.width == every.size
    assert span.pos.tolist() == np.searchsorted(every, rk).tolist()
    assert span.gap_pos.tolist() == np.searchsorted(every, span.gap_ids).tolist()


@pytest.mark.parametrize("seed", range(20))
def test_span_gaps_are_made_when_first_read_and_match_the_eager_gap_read(seed):
    """The loop plans the span; the gap ids and slots are spelled out by whoever reads them first (the
    poster thread), and are what an eager ``GapRead`` of the same span holds."""
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(2, 300))
    rk = rng.choice(3 * n, size=n, replace=False).astype(np.int64)
    span = plan_span(rk, 1000, ReadCost(8.0, 1.0), 3 * n)
    first, layers = int(rng.integers(0, 50)), int(rng.integers(1, 5))
    lazy = SpanGaps(span, first, layers)
    assert "gap_ids" not in vars(span) and "gap_pos" not in vars(span)  # nothing spelled out yet
    assert lazy.size == layers * span.gap_blocks == layers * span.gap_ids.size
    assert span.gap_runs == count_runs(span.gap_ids)  # two gaps never touch
    eager = GapRead(span.gap_ids, span_slots(first, layers, span.width, span.gap_pos))
    assert np.asarray(lazy.remote_ids).tolist() == eager.remote_ids.tolist()
    assert np.asarray(lazy.slots).tolist() == eager.slots.tolist()
    assert lazy.size == eager.size


def test_a_span_planned_with_a_cost_but_no_gaps_is_the_plain_plan():
    """``Staging.take_span`` keeps such a span instead of planning again without the cost."""
    rng = np.random.default_rng(2)
    for _ in range(300):
        n = int(rng.integers(0, 12))
        rk = rng.choice(60, size=n, replace=int(rng.integers(0, 2)) == 1).astype(np.int64)
        span = plan_span(rk, 1000, ReadCost(8.0, float(rng.choice([0.001, 1.0]))), int(rng.integers(0, 20)))
        if span.gap_blocks:
            continue
        plain = plan_span(rk, 1000, None, 0)
        assert span.width == plain.width and span.pos.tolist() == plain.pos.tolist()
        assert span.gap_ids.size == plain.gap_ids.size == 0


def test_plan_span_with_repeats_keeps_request_order():
    span = plan_span(np.array([5, 3, 5]), 1000, ReadCost(8.0, 1.0), 10)
    assert span.width == 3 and span.pos.tolist() == [0, 1, 2] and span.gap_blocks == 0


@pytest.mark.parametrize(("first", "layers", "width"), [(0, 1, 1), (7, 3, 5), (100, 4, 9)])
def test_span_slots_are_unique_and_inside_the_run(first, layers, width):
    pos = np.array(sorted(np.random.default_rng(width).choice(width, size=min(width, 4), replace=False)))
    s = span_slots(first, layers, width, pos)
    assert s.shape == (layers, pos.size)
    assert np.unique(s).size == s.size
    assert s.min() >= first and s.max() < first + layers * width
    assert ((s - first) // width == np.arange(layers)[:, None]).all()


def test_count_runs():
    assert count_runs(np.array([], np.int64)) == 0
    assert count_runs(np.array([4])) == 1
    assert count_runs(np.array([1, 2, 3, 7, 8, 10])) == 3


def test_fit_read_cost_recovers_the_constants():
    d = np.array([36, 36 * 4, 36 * 64, 9216, 9216, 500])
    b = np.array([6e8, 6e8, 6e8, 6e8, 1.5e8, 1e7])
    t = d * 8e-6 + b / 50e9
    cost = fit_read_cost(d, b, t)
    assert cost.descriptor_us == pytest.approx(8.0, rel=1e-6)
    assert cost.gbps == pytest.approx(50.0, rel=1e-6)
    assert type(cost.descriptor_us) is float and type(cost.gbps) is float  # not np.float64: printed plainly


def test_fit_read_cost_refuses_what_it_cannot_fit():
    with pytest.raises(ValueError, match="at least two"):
        fit_read_cost([1], [1], [1])
    with pytest.raises(ValueError, match="positive byte rate"):
        fit_read_cost([1, 2, 3], [10, 10, 30], [1e-6, 2e-6, -1e-3])


@pytest.mark.parametrize("seed", range(40))
def test_span_saving_counts_one_descriptor_per_gap_and_the_gaps_bytes(seed):
    rng = np.random.default_rng(seed)
    ids = rng.choice(200, size=int(rng.integers(2, 40)), replace=False).astype(np.int64)
    cost = ReadCost(float(rng.uniform(1, 20)), float(rng.uniform(0.01, 5)))
    page, layers = int(rng.choice([1000, PAGE])), int(rng.integers(1, 8))
    span = plan_span(ids, page, cost, int(rng.integers(0, 100)))
    every = np.sort(np.concatenate([ids, span.gap_ids]))
    saved = count_runs(np.sort(ids)) - count_runs(every)  # descriptors a layer, brute force
    want = layers * (saved * cost.descriptor_us - cost.bytes_us(span.gap_blocks * page))
    assert span_saving_us(span, layers, page, cost) == pytest.approx(want)
    assert span.gap_blocks == 0 or span_saving_us(span, layers, page, cost) > 0  # only gaps that pay are read


def test_worth_waiting_weighs_the_saving_against_freeing_the_missing_slots():
    span = plan_span(np.array([4, 7]), 4096, ReadCost(8.0, 1.4), 10)  # gap 5-6: 2 pages of 2.93 µs
    assert span.gap_ids.tolist() == [5, 6]
    saving = span_saving_us(span, 4, 4096, ReadCost(8.0, 1.4))
    assert saving == pytest.approx(4 * (8.0 - 2 * 4096 / 1400))
    assert worth_waiting(saving, 4096, ReadCost(8.0, 1.4), 0)  # the slots are free, only fragmented
    assert worth_waiting(saving, 4096, ReadCost(8.0, 1.4), 2)  # 5.9 µs to free two pages < 8.6 saved
    assert not worth_waiting(saving, 4096, ReadCost(8.0, 1.4), 4)  # 11.7 µs > 8.6


@pytest.mark.parametrize("n", [1, 2, 7, 256])
def test_back_to_back_ids_are_their_own_span(n):
    """The shortcut (no sort) gives what the sort would: row i for block i, no gaps."""
    span = plan_span(np.arange(40, 40 + n), PAGE, ReadCost(8.0, 0.001), 100)
    assert span.width == n and span.pos.tolist() == list(range(n)) and span.gap_blocks == 0
    # the shared identity rows: made once per length, and nobody may write into them
    assert span.pos is identity_rows(n) and not span.pos.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        span.pos[0] = 1


def test_near_misses_of_back_to_back_take_the_sorting_path():
    swapped = plan_span(np.array([40, 42, 41, 43]), PAGE, None, 0)  # same first, last and count
    assert swapped.pos.tolist() == [0, 2, 1, 3]
    repeated = plan_span(np.array([5, 5, 6]), PAGE, None, 0)  # first + n - 1 == last, not increasing
    assert repeated.pos.tolist() == [0, 1, 2] and repeated.width == 3
    gap = plan_span(np.array([1, 2, 4]), PAGE, ReadCost(8.0, 1000.0), 10)  # a hole: the gap is read
    assert gap.gap_ids.tolist() == [3] and gap.pos.tolist() == [0, 1, 3]
