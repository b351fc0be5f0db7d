"""The shared block id checks (``sidecar.wire.block_ids``) against the same rules in plain Python, on every
array of up to four ids drawn from a small range around the edges, for int64, int32 and uint32 ids."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from sidecar.wire.block_ids import consecutive, increasing, read_only, repeat_in_sorted, within

VALUES = (-(2**31), -2, -1, 0, 1, 2, 3, 4, 2**31 - 1)


def _arrays(dtype):
    info = np.iinfo(dtype)
    values = [v for v in VALUES if info.min <= v <= info.max]
    for n in range(5):
        for ids in itertools.product(values, repeat=n):
            yield list(ids), np.array(ids, dtype=dtype)


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint32])
def test_each_answer_matches_the_rule(dtype):
    for ids, arr in _arrays(dtype):
        assert increasing(arr) == all(a < b for a, b in itertools.pairwise(ids)), ids
        assert consecutive(arr) == (len(ids) > 0 and all(b == a + 1 for a, b in itertools.pairwise(ids))), ids
        repeats = [v for v in set(ids) if ids.count(v) > 1]
        assert repeat_in_sorted(np.sort(arr)) == (min(repeats) if repeats else None), ids
        for limit in (0, 1, 3, 4, 5, 2**31):
            assert within(arr, limit) == all(0 <= v < limit for v in ids), (ids, limit)


def test_int64_extremes_are_outside_any_limit_below_them():
    extremes = np.array([np.iinfo(np.int64).min, np.iinfo(np.int64).max], dtype=np.int64)
    assert not within(extremes[:1], 2**62)  # read as uint64 it is 2**63: above the limit, as it must be
    assert not within(extremes[1:], 2**62)
    assert within(np.array([5], dtype=np.int64), 6)


def test_read_only_copies_only_what_someone_could_still_write():
    owned = np.array([3, 1, 2])
    owned.flags.writeable = False
    assert read_only(owned) is owned
    view = owned[1:]
    assert read_only(view) is view  # read-only all the way down
    writable = np.array([3, 1, 2])
    behind = writable[:]
    behind.flags.writeable = False  # read-only itself, but its base is not
    for ids in (writable, behind):
        got = read_only(ids)
        assert got is not ids and not got.flags.writeable and got.tolist() == ids.tolist()
        writable[0] = 9
        assert got[0] == 3
        writable[0] = 3
