"""Run merging (``runs.py``): merged descriptors at the edges, and the per-request shortcut against
``merge_runs`` over random staging spans."""

from __future__ import annotations

import numpy as np

from sidecar.nixl.runs import layer_group_bounds, layer_uniform_runs, merge_runs
from sidecar.nixl.spans import span_slots


def test_merge_runs_edges():
    ra = np.array([[100, 110, 120, 200]], np.uint64)
    la = np.array([[0, 10, 30, 40]], np.uint64)
    d = merge_runs(ra, la, np.array([10]), 1, 2)
    assert d.remote.tolist() == [[100, 20, 1], [120, 10, 1], [200, 10, 1]]
    assert d.local.tolist() == [[0, 20, 2], [30, 10, 2], [40, 10, 2]]
    e = merge_runs(np.empty((2, 0), np.uint64), np.empty((2, 0), np.uint64), np.array([1, 1]), 0, 0)
    assert e.count == 0 and e.layer_rows.tolist() == [0, 0, 0]


def _staged_case(rng, layers, n, stride_gap, uniform_slots):
    unit = 4096
    stride = unit + stride_gap
    base = (np.arange(layers, dtype=np.uint64) + 1) * np.uint64(1 << 32)
    ids = np.sort(rng.choice(4 * n + 8, n, replace=False)).astype(np.int64)
    if rng.random() < 0.3:  # runs: a contiguous stretch
        ids = np.arange(n, dtype=np.int64) + int(rng.integers(0, 50))
    width = n + int(rng.integers(0, 5))
    pos = np.sort(rng.choice(width, n, replace=False)).astype(np.int64)
    if uniform_slots:
        slots = span_slots(int(rng.integers(0, 100)), layers, width, pos)
    else:
        slots = rng.permutation(layers * width)[: layers * n].reshape(layers, n).astype(np.int64)
    return base, np.full(layers, stride, np.int64), np.full(layers, unit, np.int64), ids, slots


def test_layer_uniform_runs_equal_merge_runs_on_every_staging_span():
    """The staged descriptors computed on the ids once are merge_runs's, row for row, over 600 random
    spans (contiguous, sparse, strided regions, shifted per-layer slot runs); anything else is left to
    merge_runs."""
    rng = np.random.default_rng(12)
    checked = 0
    for case in range(600):
        layers, n = int(rng.integers(1, 6)), int(rng.integers(1, 40))
        uniform = case % 5 != 0
        base, stride, unit, ids, slots = _staged_case(rng, layers, n, int(rng.choice([0, 0, 512])), uniform)
        pool_base, slot_bytes = 1 << 40, int(rng.choice([4096, 4096, 8192]))
        got = layer_uniform_runs(base, stride, unit, ids, slots, pool_base, slot_bytes, 3, 5)
        ra = base[:, None] + ids.astype(np.uint64)[None, :] * stride.astype(np.uint64)[:, None]
        la = np.uint64(pool_base) + slots.astype(np.uint64) * np.uint64(slot_bytes)
        want = merge_runs(ra, la, unit, 3, 5)
        shifted = (slots == slots[0] + (slots[:, :1] - slots[0, 0])).all()
        if not shifted:
            assert got is None
            continue
        checked += 1
        assert got is not None
        assert np.array_equal(got.local, want.local) and np.array_equal(got.remote, want.remote)
        assert np.array_equal(got.layer_rows, want.layer_rows)
    assert checked > 400


def test_layer_uniform_runs_leave_unequal_regions_to_merge_runs():
    rng = np.random.default_rng(3)
    base, stride, unit, ids, slots = _staged_case(rng, 3, 8, 0, True)
    stride[1] += 64
    assert layer_uniform_runs(base, stride, unit, ids, slots, 1 << 40, 4096, 0, 0) is None
    base, stride, unit, ids, slots = _staged_case(rng, 3, 8, 0, True)
    unit[2] //= 2
    assert layer_uniform_runs(base, stride, unit, ids, slots, 1 << 40, 4096, 0, 0) is None


def test_back_to_back_blocks_into_back_to_back_slots_are_one_descriptor_a_layer():
    """The shortcut for a fresh prefill's blocks in an in-order span gives merge_runs's rows; near misses
    (a hole in the ids or the slots, a padded stride, a slot of another size) take the general path, which
    must agree too."""
    rng = np.random.default_rng(5)
    for case in range(300):
        layers, n, unit = int(rng.integers(1, 6)), int(rng.integers(1, 40)), 4096
        ids = np.arange(n, dtype=np.int64) + int(rng.integers(0, 50))
        width = n + int(rng.integers(0, 3))
        first = int(rng.integers(0, 100))
        pos = np.arange(n, dtype=np.int64)
        stride, slot_bytes = unit, unit
        miss = case % 4
        if miss == 1 and n > 1:
            ids[int(rng.integers(1, n)) :] += 1  # a hole between two remote blocks
        elif miss == 2 and n > 1 and width > n:
            pos[int(rng.integers(1, n)) :] += 1  # a hole between two slots
        elif miss == 3:
            stride, slot_bytes = (unit + 512, unit) if rng.random() < 0.5 else (unit, 2 * unit)
        base = (np.arange(layers, dtype=np.uint64) + 1) * np.uint64(1 << 32)
        strides, units = np.full(layers, stride, np.int64), np.full(layers, unit, np.int64)
        slots = span_slots(first, layers, width, pos)
        got = layer_uniform_runs(base, strides, units, ids, slots, 1 << 40, slot_bytes, 3, 5)
        ra = base[:, None] + ids.astype(np.uint64)[None, :] * np.uint64(stride)
        la = np.uint64(1 << 40) + slots.astype(np.uint64) * np.uint64(slot_bytes)
        want = merge_runs(ra, la, units, 3, 5)
        assert got is not None
        assert np.array_equal(got.local, want.local) and np.array_equal(got.remote, want.remote)
        assert np.array_equal(got.layer_rows, want.layer_rows)
        if miss == 0:
            assert got.count == layers  # one descriptor a layer


def test_layer_group_bounds_cover_every_layer_once_as_evenly_as_whole_layers_allow():
    """Every (layers, groups) up to 128 layers, groups past the layer count and below one included: the
    groups tile [0, layers) in order and their sizes differ by at most one. Exact in integers: the float cut
    the posts used before (``np.linspace``) put a boundary one layer early now and then (30 layers in 22
    groups: 14, not 15, after the eleventh)."""
    for layers in range(1, 129):
        for groups in range(-1, layers + 3):
            bounds = layer_group_bounds(layers, groups)
            g = max(1, min(groups, layers))
            assert len(bounds) == g
            assert [a for a, _ in bounds] == [0] + [b for _, b in bounds[:-1]] and bounds[-1][1] == layers
            sizes = [b - a for a, b in bounds]
            assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert layer_group_bounds(30, 22)[10:12] == [(13, 15), (15, 16)]
