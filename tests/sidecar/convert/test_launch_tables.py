"""The launch tables (sidecar/convert/tables.py): layout, packing, meta tables and their cache, pure logic."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from sidecar.convert.tables import ALIGN, META_COLUMNS, MetaCache, layout, meta_table, pack, upload


@pytest.mark.parametrize("count", [0, 1, 2, 3, 4])
def test_layout_every_size_list_up_to_four_segments_of_five(count):
    for sizes in itertools.product(range(6), repeat=count):
        starts, total = layout(list(sizes))
        assert len(starts) == count
        at = 0
        for start, size in zip(starts, sizes, strict=True):
            assert start % ALIGN == 0  # 16-byte aligned: no second Triton specialisation
            assert start == at  # tight: the next aligned place after the previous segment
            at = start + -(-size // ALIGN) * ALIGN
        assert total == at and total % ALIGN == 0


def test_layout_refuses_a_negative_size():
    with pytest.raises(ValueError, match="-1"):
        layout([3, -1])


@pytest.mark.parametrize("parts", [[[1], [5]], [[0], [3, 4]], [[7, 2], [], [1, 1, 1]], [[256, 256], [216]]])
def test_pack_writes_each_segment_back_to_back_and_leaves_padding(parts):
    rng = np.random.default_rng(len(parts))
    segments = [[rng.integers(-(2**62), 2**62, size=n, dtype=np.int64) for n in seg] for seg in parts]
    _, total = layout([sum(seg) for seg in parts])
    out = np.full(total, 7777, dtype=np.int64)
    spans = pack(segments, out)
    covered = np.zeros(total, dtype=bool)
    for (start, size), seg in zip(spans, segments, strict=True):
        want = np.concatenate(seg) if seg else np.zeros(0, np.int64)
        assert size == want.size
        np.testing.assert_array_equal(out[start : start + size], want)
        covered[start : start + size] = True
    assert (out[~covered] == 7777).all()


def test_pack_flattens_a_table_row_major():
    table = np.arange(12, dtype=np.int64).reshape(2, 6)
    out = np.zeros(14, dtype=np.int64)
    spans = pack([[np.array([9], np.int64)], [table]], out)
    assert spans == [(0, 1), (2, 12)]
    np.testing.assert_array_equal(out[2:], np.arange(12))


def test_pack_refuses_a_buffer_of_the_wrong_length():
    with pytest.raises(ValueError, match="layout needs"):
        pack([[np.zeros(3, np.int64)]], np.zeros(3, np.int64))


def _plane_rows(rng, layers, anchor, e):
    """Per-layer (K address, K stride, V address, V stride): addresses on element boundaries around anchor."""
    rows = np.empty((layers, 4), dtype=np.int64)
    rows[:, 0] = anchor + e * rng.integers(-(2**30), 2**30, size=layers)
    rows[:, 1] = rng.integers(1, 2**20, size=layers)
    rows[:, 2] = anchor + e * rng.integers(-(2**30), 2**30, size=layers)
    rows[:, 3] = rng.integers(1, 2**20, size=layers)
    return rows


GRID = list(itertools.product([1, 2, 36], [1, 2], [False, True]))


@pytest.mark.parametrize(("layers", "e", "staged"), GRID)
def test_meta_table_is_offsets_in_elements_from_the_anchor(layers, e, staged):
    rng = np.random.default_rng(layers * 10 + e)
    anchor = 1 << 40
    rows = _plane_rows(rng, layers, anchor, e)
    src = None
    if staged:
        src = np.stack([anchor + e * rng.integers(-(2**30), 2**30, size=layers),
                        rng.integers(1, 2**20, size=layers)], axis=1).astype(np.int64)
    got = meta_table(rows, src, anchor, e)
    assert got.shape == (layers, META_COLUMNS) and got.dtype == np.int64
    for layer in range(layers):  # one row at a time, in Python ints
        k, ks, v, vs = (int(x) for x in rows[layer])
        want = [(k - anchor) // e, ks, (v - anchor) // e, vs, 0, 0]
        if staged:
            want[4:] = [(int(src[layer, 0]) - anchor) // e, int(src[layer, 1])]
        assert got[layer].tolist() == want


def test_meta_cache_builds_once_and_never_returns_another_inputs_table():
    rng = np.random.default_rng(5)
    anchor = 1 << 40
    rows = _plane_rows(rng, 4, anchor, 2)
    src = np.array([[anchor + 2 * i * 1000, 64] for i in range(4)], dtype=np.int64)
    cache = MetaCache()
    first = cache.get(rows, src, anchor, 2)
    assert cache.get(rows.copy(), src.copy(), anchor, 2) is first  # equal inputs, any array objects
    assert (cache.hits, cache.misses) == (1, 1)
    np.testing.assert_array_equal(first, meta_table(rows, src, anchor, 2))
    with pytest.raises(ValueError):
        first[0, 0] = 1  # shared: read-only
    other_src = src.copy()
    other_src[3, 0] += 32
    other_rows = rows.copy()
    other_rows[0, 3] += 1
    variants = [(rows, None, anchor, 2), (rows, np.zeros_like(src), anchor, 2), (rows, other_src, anchor, 2),
                (other_rows, src, anchor, 2), (rows, src, anchor - 32, 2), (rows, src, anchor, 1),
                (rows[:3], src[:3], anchor, 2)]
    for args in variants:
        got = cache.get(*args)
        np.testing.assert_array_equal(got, meta_table(*args))
        assert got is not first
    assert cache.misses == 1 + len(variants)


def test_meta_cache_keeps_the_last_used():
    anchor = 1 << 40
    rows = [np.array([[anchor + 16 * i, 8, anchor + (1 << 20), 8]], dtype=np.int64) for i in range(4)]
    cache = MetaCache(capacity=2)
    a = cache.get(rows[0], None, anchor, 2)
    cache.get(rows[1], None, anchor, 2)
    assert cache.get(rows[0], None, anchor, 2) is a  # rows[0] used last: rows[1] is evicted next
    cache.get(rows[2], None, anchor, 2)
    assert len(cache) == 2
    assert cache.get(rows[0], None, anchor, 2) is a
    misses = cache.misses
    cache.get(rows[1], None, anchor, 2)
    assert cache.misses == misses + 1
    with pytest.raises(ValueError, match="capacity"):
        MetaCache(capacity=0)


def test_upload_on_the_cpu_gives_aligned_views_of_one_buffer():
    ids = np.array([5, 3, 9], dtype=np.int64)
    index = np.array([0, 2, 1], dtype=np.int64)
    table = np.arange(18, dtype=np.int64).reshape(3, 6)
    got_ids, got_meta = upload([[ids, index], [table]], torch.device("cpu"))
    assert got_ids.tolist() == [5, 3, 9, 0, 2, 1]  # the source rows right after the ids
    assert got_meta.tolist() == list(range(18))
    assert got_ids.dtype == got_meta.dtype == torch.int64
    assert got_ids.untyped_storage().data_ptr() == got_meta.untyped_storage().data_ptr()
    assert (got_meta.data_ptr() - got_ids.data_ptr()) % 16 == 0
    empty, = upload([[np.zeros(0, np.int64)]], torch.device("cpu"))
    assert empty.numel() == 0
