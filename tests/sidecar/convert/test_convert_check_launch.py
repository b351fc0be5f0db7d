"""The daemon's lean check (``check_launch``, ``PlaneSet.convert_arrays``) refuses exactly what the public
``check_request`` refuses (in the same words) and builds the same job; its source checks are remembered
(``SourceMemo``) only for a source with every checked property the same."""

from __future__ import annotations

import dataclasses
import itertools
import re
import warnings

import numpy as np
import pytest
import torch

from sidecar.convert import PlaneSet
from sidecar.convert.checks import (
    CheckedIds,
    SourceMemo,
    aligned16,
    check_launch,
    check_request,
    checked_ids,
    launch_ids,
)

H, N, D, LAYERS, BLOCKS = 2, 16, 64, 3, 8
ROW = H * N * D


WIDTH = 6  # staging rows
STAGE = LAYERS * WIDTH * 2 * ROW + 2 * ROW  # elements of staging (and one spare row), before the planes


def _arena():
    """A staging area then the planes, in ONE allocation, so a source can be made to overlap a plane."""
    arena = torch.zeros(STAGE + 2 * LAYERS * BLOCKS * ROW, dtype=torch.bfloat16)
    stage = arena[: LAYERS * WIDTH * 2 * ROW].view(LAYERS, WIDTH, 2 * ROW)
    planes = arena[STAGE:].view(LAYERS, 2, BLOCKS, ROW)
    ps = PlaneSet([planes[i, 0] for i in range(LAYERS)], [planes[i, 1] for i in range(LAYERS)], num_heads=H,
                  block_size=N, head_size=D)
    return arena, ps, stage


IDS = [[3, 1, 5], [], [0], [7, 0, 2, 4, 6, 1], [-1, 2, 3], [8, 1, 2], [2, 2, 4], [1, 2]]
LAYER_RANGES = [None, (0, 3), (1, 2), (2, 2), (0, 4)]
INDEX = ["none", "ok", "high", "negative", "short"]


def _sources(arena, stage):
    """Named sources for layers [first, last): good ones and each way to be wrong."""
    def make(first, last, m):
        n = last - first
        return {
            "none": None,
            "rows_m": stage[first:last, :m],
            "rows_all": stage[first:last],
            "layers_off": stage[: n + 1, :m] if n + 1 <= LAYERS else stage[:1, :m],
            "page_off": stage[first:last, :m, : ROW],
            "dtype_off": stage[first:last, :m].view(torch.float16),
            "over_plane": arena[STAGE - ROW :].as_strided((n, m, 2 * ROW), (m * 2 * ROW, 2 * ROW, 1)),
            "every_other_row": stage[first:last, ::2],
            # pass every check, but 16-byte vectors do not fit: the reference converts them
            "base_off_16": arena.as_strided((n, m, 2 * ROW), stage.stride(), first * stage.stride(0) + 1),
            "row_stride_off_x": arena.as_strided((n, m, 2 * ROW), (stage.stride(0), 2 * ROW + 1, 1),
                                                 first * stage.stride(0)),
        }
    return make


def _index(kind, m, width):
    rng = np.random.default_rng(m + width)
    rows = rng.integers(0, max(1, width), size=m).astype(np.int64)
    if kind == "high" and m:
        rows[-1] = width
    if kind == "negative" and m:
        rows[0] = -1
    if kind == "short":
        rows = rows[:-1] if m else np.zeros(1, np.int64)
    return rows


def _outcome(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except ValueError as exc:
        return exc


def _same_job(a, b):
    assert torch.equal(a.ids, b.ids) and a.ids.dtype == b.ids.dtype == torch.int64
    assert aligned16(a) == aligned16(b) == aligned16(dataclasses.replace(b, src_aligned16=None))
    assert a.k_planes == b.k_planes and a.v_planes == b.v_planes
    np.testing.assert_array_equal(a.plane_rows, b.plane_rows)
    assert (a.src_rows is None) == (b.src_rows is None)
    if a.src_rows is not None:
        np.testing.assert_array_equal(a.src_rows, b.src_rows)
        assert a.srcs.data_ptr() == b.srcs.data_ptr() and a.srcs.shape == b.srcs.shape
        assert a.srcs.stride() == b.srcs.stride() and a.srcs.dtype == b.srcs.dtype
    assert (a.src_index is None) == (b.src_index is None)
    if a.src_index is not None:
        assert torch.equal(a.src_index, b.src_index)


@pytest.mark.parametrize("layers", LAYER_RANGES, ids=str)
def test_lean_check_refuses_and_accepts_exactly_as_the_public_one(layers):
    arena, ps, stage = _arena()
    memo = SourceMemo()
    first, last = layers if layers is not None else (0, LAYERS)
    accepted = refused = unaligned = 0
    for ids, kind in itertools.product(IDS, INDEX):
        m = len(ids)
        make = _sources(arena, stage)(first, min(max(last, first + 1), LAYERS), m)
        for name, src in make.items():
            width = stage.shape[1] if src is None else src.shape[1]
            rows = None if kind == "none" else _index(kind, m, width)
            for _ in range(2):  # the second time the memo remembers the source (when it passed)
                public = _outcome(check_request, ps.planes, torch.tensor(ids, dtype=torch.int64), src, layers,
                                  src_index=None if rows is None else torch.from_numpy(rows))
                lean = _outcome(check_launch, ps.planes, np.array(ids, dtype=np.int64), src, layers, memo,
                                src_index=rows)
                what = (ids, name, kind, layers)
                assert isinstance(public, ValueError) == isinstance(lean, ValueError), (what, public, lean)
                if isinstance(public, ValueError):
                    assert str(public) == str(lean), what  # the same words for the same problem
                    refused += 1
                else:
                    _same_job(public, lean)
                    accepted += 1
                    unaligned += not aligned16(lean)
    assert refused
    assert (accepted and unaligned) or layers in [(2, 2), (0, 4)]  # those ranges are refused whatever else


def test_a_refused_source_is_never_remembered():
    arena, ps, stage = _arena()
    memo = SourceMemo()
    bad = arena[STAGE:].as_strided((LAYERS, 2, 2 * ROW), (2 * ROW, 2 * ROW, 1))  # inside the planes
    for _ in range(3):
        with pytest.raises(ValueError, match="overlap"):
            check_launch(ps.planes, np.array([1, 2]), bad, None, memo)
    assert len(memo) == 0
    check_launch(ps.planes, np.array([1, 2]), stage[:, :2], None, memo)
    assert len(memo) == 1


def test_same_address_and_shape_but_other_strides_is_checked_again():
    arena, ps, stage = _arena()
    memo = SourceMemo()
    good = stage[:, :2]
    check_launch(ps.planes, np.array([1, 2]), good, None, memo)
    # the same first byte and shape, a layer stride that walks on into the planes
    back = arena.as_strided(good.shape, (2 * good.stride(0), good.stride(1), 1), good.storage_offset())
    assert back.data_ptr() == good.data_ptr() and back.shape == good.shape
    with pytest.raises(ValueError, match="overlap"):
        check_launch(ps.planes, np.array([1, 2]), back, None, memo)
    with pytest.raises(ValueError, match="overlap"):
        check_request(ps.planes, torch.tensor([1, 2]), back, None)


def test_the_memo_keeps_a_bounded_number_of_sources():
    _, ps, stage = _arena()
    memo = SourceMemo(capacity=3)
    for m in range(1, 7):
        check_launch(ps.planes, np.arange(m), stage[:, :m], None, memo)
    assert len(memo) == 3


@pytest.mark.parametrize(("ids", "why"), [
    (np.array([1.0, 2.0]), "integer"),
    (np.array([[1, 2]]), "1-D"),
    ([1, 2], "numpy array"),
    (torch.tensor([1, 2]), "numpy array"),
    (np.array([2**63], dtype=np.uint64), "beyond int64"),
])
def test_lean_check_refuses_ids_that_are_not_an_int_array(ids, why):
    _, ps, _ = _arena()
    with pytest.raises(ValueError, match=why):
        check_launch(ps.planes, ids, None, None, SourceMemo())


def test_lean_check_refuses_a_source_list_and_an_index_without_source():
    _, ps, stage = _arena()
    with pytest.raises(ValueError, match="torch.Tensor"):
        check_launch(ps.planes, np.array([1]), list(stage[:, :1].unbind(0)), None, SourceMemo())
    with pytest.raises(ValueError, match="needs a src"):
        check_launch(ps.planes, np.array([1]), None, None, SourceMemo(), src_index=np.array([0]))


def test_unsigned_and_narrow_ids_are_accepted_as_int64():
    _, ps, _ = _arena()
    for dtype in (np.uint8, np.int16, np.uint32, np.int32):
        job = check_launch(ps.planes, np.array([5, 0, 3], dtype=dtype), None, None, SourceMemo())
        assert job.ids.dtype == torch.int64 and job.ids.tolist() == [5, 0, 3]


def test_read_only_ids_and_rows_are_taken_without_a_warning():
    """The daemon's id arrays are shared read-only (loop and poster): the job copies them instead of letting
    torch share memory it warns it could write."""
    _, ps, stage = _arena()
    ids, rows = np.array([5, 0, 3]), np.array([2, 0, 1])
    ids.flags.writeable = rows.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        job = check_launch(ps.planes, ids, stage[:, :WIDTH], None, SourceMemo(), src_index=rows)
    assert job.ids.tolist() == [5, 0, 3] and job.src_index.tolist() == [2, 0, 1]


@pytest.mark.parametrize("mode", ["in_place", "staged", "indexed"])
def test_convert_arrays_writes_what_convert_writes(mode):
    gen = torch.Generator().manual_seed(4)
    base = torch.randint(-(2**15), 2**15 - 1, (LAYERS, 2, BLOCKS, ROW), generator=gen, dtype=torch.int16)
    span = torch.randint(-(2**15), 2**15 - 1, (LAYERS, 5, 2 * ROW), generator=gen, dtype=torch.int16)
    ids = np.array([6, 1, 3])
    rows = np.array([4, 0, 2]) if mode == "indexed" else None
    src = None if mode == "in_place" else (span if mode == "indexed" else span[:, :3]).view(torch.bfloat16)
    out = []
    for lean in (False, True):
        c = base.clone().view(torch.bfloat16)
        ps = PlaneSet([c[i, 0] for i in range(LAYERS)], [c[i, 1] for i in range(LAYERS)], num_heads=H,
                      block_size=N, head_size=D)
        for layers in [(0, 1), (1, 3)]:
            part = None if src is None else src[layers[0] : layers[1]]
            if lean:
                ps.convert_arrays(ids, src=part, layers=layers, src_index=rows)
            else:
                ps.convert(torch.from_numpy(ids), src=part, layers=layers,
                           src_index=None if rows is None else torch.from_numpy(rows))
        out.append(c.view(torch.int16))
    assert not torch.equal(out[0], base)
    assert torch.equal(out[0], out[1])


def _id_verdict(ids: list[int], num_blocks: int) -> str | None:
    """The id rules in plain Python: the error ``_check_id_values`` must raise, or None."""
    if ids and (min(ids) < 0 or max(ids) >= num_blocks):
        bad = min(ids) if min(ids) < 0 else max(ids)
        return f"block_ids holds {bad}, out of range [0, {num_blocks})"
    repeated = sorted(i for i in set(ids) if ids.count(i) > 1)
    return f"block_ids holds duplicates, e.g. {repeated[0]}" if repeated else None


@pytest.mark.parametrize("seed", range(4))
def test_id_check_takes_increasing_ids_without_a_sort_and_refuses_the_same(seed):
    """The increasing shortcut (no sort) and the sorted path refuse exactly what the rules refuse, in the same
    words: increasing, repeated, descending, out of range at either end, empty and single ids."""
    from sidecar.convert.checks import _check_id_values

    rng = np.random.default_rng(seed)
    for _ in range(400):
        n, limit = int(rng.integers(0, 12)), int(rng.integers(1, 16))
        shape = rng.integers(4)
        if shape == 0:  # increasing (the shortcut), sometimes past the limit or below 0
            ids = np.sort(rng.choice(np.arange(-2, limit + 3), min(n, limit + 5), replace=False))
        elif shape == 1:  # repeats
            ids = rng.integers(-1, limit + 1, n)
        elif shape == 2:  # decreasing
            ids = np.sort(rng.choice(limit + 2, min(n, limit + 2), replace=False))[::-1]
        else:  # increasing but for one adjacent repeat
            ids = np.sort(rng.choice(limit, min(n, limit), replace=False))
            if ids.size:
                ids = np.insert(ids, int(rng.integers(ids.size)), ids[int(rng.integers(ids.size))])
                ids.sort()
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        want = _id_verdict(ids.tolist(), limit)
        if want is None:
            _check_id_values(ids, limit)
        else:
            with pytest.raises(ValueError, match=re.escape(want)):
                _check_id_values(ids, limit)


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_source_row_check_refuses_exactly_the_rows_outside(dtype):
    """The one-pass check of int64 rows (and min / max for others) against the rule, the extremes included;
    the error names the lowest row when one is negative, else the highest."""
    from sidecar.convert.checks import _check_source_rows

    rng = np.random.default_rng(5)
    info = np.iinfo(dtype)
    for _ in range(2000):
        available = int(rng.integers(1, 40))
        edges = np.array([info.min, -2, -1, 0, available - 1, available, available + 1, info.max],
                         dtype=np.int64)
        rows = np.concatenate([rng.integers(0, available, int(rng.integers(0, 6))),
                               rng.choice(edges, int(rng.integers(0, 3)))]).astype(dtype)
        lo, hi = (int(rows.min()), int(rows.max())) if rows.size else (0, 0)
        if not rows.size or (lo >= 0 and hi < available):
            _check_source_rows(rows, available)
            continue
        bad = lo if lo < 0 else hi
        with pytest.raises(ValueError, match=re.escape(f"src_index holds {bad}, out of range")):
            _check_source_rows(rows, available)


@pytest.mark.parametrize("ids", IDS, ids=str)
def test_checked_ids_refuse_what_a_launch_refuses_and_launch_the_same_job(ids):
    """``checked_ids`` is ``launch_ids``' check, once: the same refusals in the same words, and a launch
    handed the result builds the job a launch of the raw ids builds."""
    _, ps, stage = _arena()
    raw = np.array(ids, dtype=np.int64)
    once = _outcome(checked_ids, ps.planes, raw)
    direct = _outcome(launch_ids, ps.planes, raw)
    assert isinstance(once, ValueError) == isinstance(direct, ValueError)
    if isinstance(direct, ValueError):
        assert str(once) == str(direct)
        return
    assert once.size == len(ids) and once.num_blocks == BLOCKS
    for src in (None, stage[:, : len(ids)]):
        _same_job(check_launch(ps.planes, once, src, None, SourceMemo()),
                  check_launch(ps.planes, raw, src, None, SourceMemo()))


def test_checked_ids_are_a_read_only_copy_and_are_not_checked_again(monkeypatch):
    """Changing the array they were made from changes nothing; they cannot be written; a launch takes them
    without a second pass (the point: one check a request, not one a layer group)."""
    from sidecar.convert import checks

    _, ps, _ = _arena()
    raw = np.array([3, 1, 5], dtype=np.int64)
    once = checked_ids(ps.planes, raw)
    raw[0] = 99
    assert once.ids.tolist() == [3, 1, 5]
    with pytest.raises(ValueError, match="read-only"):
        once.ids[0] = 99
    passes = []
    real = checks._check_id_values
    monkeypatch.setattr(checks, "_check_id_values", lambda *a: passes.append(a) or real(*a))
    assert launch_ids(ps.planes, once) is once.ids
    assert check_launch(ps.planes, once, None, None, SourceMemo()).ids.tolist() == [3, 1, 5]
    assert passes == []
    frozen = np.array([4, 0], dtype=np.int64)
    frozen.flags.writeable = False  # as the daemon's pairs are: nobody can change them, so no copy
    assert checked_ids(ps.planes, frozen).ids is frozen


def test_ids_checked_for_a_larger_cache_are_refused():
    """Checked against more blocks than these planes hold, an id may be past their end: refused, naming both
    counts. Checked against fewer, every id still fits: taken."""
    _, ps, _ = _arena()
    wider = CheckedIds(ids=np.array([BLOCKS + 3]), num_blocks=BLOCKS + 4)
    with pytest.raises(ValueError, match=f"checked for {BLOCKS + 4} blocks; these planes hold {BLOCKS}"):
        launch_ids(ps.planes, wider)
    few = torch.zeros(2, BLOCKS - 2, ROW, dtype=torch.bfloat16)
    narrower = PlaneSet([few[0]], [few[1]], num_heads=H, block_size=N, head_size=D)
    assert launch_ids(ps.planes, checked_ids(narrower.planes, np.array([0, 5]))).tolist() == [0, 5]
