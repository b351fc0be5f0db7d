"""Size buckets and tables of the graph-replayed launch (``graph_tables``, pure logic, every size checked)."""

from __future__ import annotations

import numpy as np
import pytest

from sidecar.convert.graph_tables import EXACT_UP_TO, PAD_ID, STEPS_PER_OCTAVE, bucket, fill, table_layout
from sidecar.convert.tables import ALIGN, META_COLUMNS


def test_every_size_up_to_a_large_cache_gets_a_bucket_within_an_eighth():
    buckets = set()
    previous = 0
    for m in range(1, 70_000):
        b = bucket(m)
        assert b >= m, m
        assert b >= previous, m  # monotone: a larger request never gets a smaller grid
        previous = b
        if m <= EXACT_UP_TO:
            assert b == m
        else:
            assert b - m < m / STEPS_PER_OCTAVE, m
        assert bucket(b) == b, m  # a bucket is its own bucket
        buckets.add(b)
    # about 8 a doubling above the exact sizes: 16 exact, then 8 per octave up to 2**16 and one more
    assert len(buckets) <= EXACT_UP_TO + STEPS_PER_OCTAVE * 13 + 1


@pytest.mark.parametrize("m", [0, -1])
def test_no_bucket_for_an_empty_request(m):
    with pytest.raises(ValueError, match="at least one block"):
        bucket(m)


@pytest.mark.parametrize("b", [1, 2, 3, 16, 17, 288])
@pytest.mark.parametrize("layers", [1, 3, 36])
def test_layout_puts_rows_right_after_ids_and_meta_on_16_bytes(b, layers):
    rows_at, meta_at, total = table_layout(b, layers)
    assert rows_at == b  # the kernel reads source row i at ids + M + i
    assert meta_at >= 2 * b and meta_at % ALIGN == 0
    assert total >= meta_at + layers * META_COLUMNS and total % ALIGN == 0


def _request(rng, m, b, layers):
    ids = rng.permutation(1000)[:m].astype(np.int64)
    rows = rng.permutation(5 * m)[:m].astype(np.int64)
    meta = rng.integers(-(2**40), 2**40, size=(layers, META_COLUMNS), dtype=np.int64)
    return ids, rows, meta


@pytest.mark.parametrize("m", [1, 2, 5, 16, 17, 100, 255, 256, 257, 1000])
@pytest.mark.parametrize("layers", [1, 4, 36])
def test_fill_pads_with_the_first_block_and_its_row(m, layers):
    rng = np.random.default_rng(m * 100 + layers)
    b = bucket(m)
    ids, rows, want_meta = _request(rng, m, b, layers)
    table = np.full(table_layout(b, layers)[2], 7777, dtype=np.int64)
    fill(table, b, ids, rows, want_meta)
    got_ids, got_rows = table[:b], table[b : 2 * b]
    assert np.array_equal(got_ids[:m], ids) and np.array_equal(got_rows[:m], rows)
    # every padding pair is the first pair: it converts the request's first block from its own row again
    assert (got_ids[m:] == ids[0]).all() and (got_rows[m:] == rows[0]).all()
    assert set(got_ids.tolist()) == set(ids.tolist())  # never a block outside the request
    meta_at = table_layout(b, layers)[1]
    meta = table[meta_at : meta_at + layers * META_COLUMNS].reshape(layers, META_COLUMNS)
    assert np.array_equal(meta, want_meta)


@pytest.mark.parametrize("m", [1, 2, 5, 16, 17, 100, 255, 256, 257, 1000])
@pytest.mark.parametrize("layers", [1, 36])
def test_fill_in_place_pads_with_no_block_and_leaves_the_source_rows(m, layers):
    """In place a padding row must convert nothing (a block converted twice in place is scrambled): the ids
    past the request are PAD_ID, which no block has, and the unused source rows keep what they held."""
    rng = np.random.default_rng(m * 10 + layers)
    b = bucket(m)
    ids, _, meta = _request(rng, m, b, layers)
    table = np.full(table_layout(b, layers)[2], 7777, dtype=np.int64)
    fill(table, b, ids, None, meta)
    assert np.array_equal(table[:m], ids)
    assert (table[m:b] == PAD_ID).all() and PAD_ID < 0  # the in-place kernel skips negative ids
    assert (table[b : 2 * b] == 7777).all()
    meta_at = table_layout(b, layers)[1]
    got_meta = table[meta_at : meta_at + layers * META_COLUMNS].reshape(layers, META_COLUMNS)
    assert np.array_equal(got_meta, meta)


def test_fill_in_place_after_an_out_of_place_request_leaves_none_of_its_ids():
    """A graph's table is reused by requests of its key only, but the table itself must not care: an
    in-place fill over an out-of-place one pads with PAD_ID, not the earlier request's first id."""
    rng = np.random.default_rng(3)
    b, layers = bucket(40), 2
    table = np.zeros(table_layout(b, layers)[2], dtype=np.int64)
    fill(table, b, *_request(rng, 40, b, layers))
    ids = rng.permutation(1000)[:33].astype(np.int64)
    fill(table, b, ids, None, None)
    assert np.array_equal(table[:33], ids) and (table[33:b] == PAD_ID).all()


def test_fill_over_a_used_table_leaves_nothing_of_the_last_request():
    rng = np.random.default_rng(1)
    b, layers = bucket(200), 3
    table = np.zeros(table_layout(b, layers)[2], dtype=np.int64)
    fill(table, b, *_request(rng, 200, b, layers))
    second = _request(rng, 193, b, layers)
    fill(table, b, *second)
    ids, rows = second[0], second[1]
    assert set(table[:b].tolist()) == set(ids.tolist())
    assert set(table[b : 2 * b].tolist()) == set(rows.tolist())


@pytest.mark.parametrize(("m", "b", "rows_m"), [(0, 4, 0), (5, 4, 5), (3, 4, 2), (0, 4, None), (5, 4, None)])
def test_fill_refuses_what_does_not_fit(m, b, rows_m):
    table = np.zeros(table_layout(b, 2)[2], dtype=np.int64)
    ids = np.arange(m, dtype=np.int64)
    rows = None if rows_m is None else np.arange(rows_m, dtype=np.int64)
    with pytest.raises(ValueError, match="do not fit a bucket"):
        fill(table, b, ids, rows, np.zeros((2, META_COLUMNS), np.int64))


def test_fill_refuses_a_table_of_another_bucket():
    table = np.zeros(table_layout(8, 2)[2] + 2, dtype=np.int64)
    with pytest.raises(ValueError, match="a bucket of 8 needs"):
        fill(table, 8, np.arange(3, dtype=np.int64), np.arange(3, dtype=np.int64),
             np.zeros((2, META_COLUMNS), np.int64))


def test_fill_without_meta_keeps_the_meta_it_holds_and_rewrites_the_rest():
    """A launch whose meta its graph's table already holds passes None: only ids and rows change."""
    rng = np.random.default_rng(2)
    b, layers = bucket(300), 36
    table = np.zeros(table_layout(b, layers)[2], dtype=np.int64)
    first = _request(rng, 300, b, layers)
    fill(table, b, *first)
    ids, rows, _ = _request(rng, 290, b, layers)
    fill(table, b, ids, rows, None)
    meta_at = table_layout(b, layers)[1]
    meta = table[meta_at : meta_at + layers * META_COLUMNS].reshape(layers, META_COLUMNS)
    assert np.array_equal(meta, first[2])
    assert np.array_equal(table[:290], ids) and (table[290:b] == ids[0]).all()
    assert np.array_equal(table[b : b + 290], rows) and (table[b + 290 : 2 * b] == rows[0]).all()


def test_fill_without_meta_refuses_a_table_too_short_for_the_bucket():
    table = np.zeros(7, dtype=np.int64)
    with pytest.raises(ValueError, match="a bucket of 4 needs at least"):
        fill(table, 4, np.arange(4, dtype=np.int64), np.arange(4, dtype=np.int64), None)
