"""Pairing helpers (``sidecar.nixl.pairing``): logical to kernel block ids, vLLM's per-group id lists, the id
checks."""

from __future__ import annotations

import re

import numpy as np
import pytest

from sidecar.nixl.pairing import GeometryError, as_ids, check_range, kernel_block_ids, single_group


def test_kernel_block_ids_expansion():
    assert kernel_block_ids([2, 3], 1, "x").tolist() == [2, 3]
    assert kernel_block_ids([2, 3], 2, "x").tolist() == [4, 5, 6, 7]  # vLLM's docstring example
    assert kernel_block_ids([1, 5], 3, "x").tolist() == [3, 4, 5, 15, 16, 17]
    assert kernel_block_ids([], 4, "x").tolist() == []


def test_kernel_block_ids_refuse_ids_that_would_wrap():
    """2**62 x 4 wraps int64 to kernel ids 0-3, which a range check would pass."""
    with pytest.raises(GeometryError) as e:
        kernel_block_ids(np.array([2**62], np.int64), 4, "remote_block_ids")
    assert e.value.field == "remote_block_ids"
    big = np.iinfo(np.int64).max // 4 - 1
    assert kernel_block_ids(np.array([big], np.int64), 4, "x")[-1] == big * 4 + 3


def test_kernel_block_ids_check_logical_ids_against_the_cache_first():
    assert kernel_block_ids([0, 1], 4, "x", 8).tolist() == list(range(8))
    assert kernel_block_ids([5], 1, "x", 2).tolist() == [5]  # ratio 1: the caller's range check sees it
    for ids, needle in (([0, 2], "logical block id 2 outside [0, 2) (9 kernel blocks, 4 a block)"),
                        ([-1], "logical block id -1 outside")):
        with pytest.raises(GeometryError, match=re.escape(needle)) as e:
            kernel_block_ids(ids, 4, "remote_block_ids", 9)
        assert e.value.field == "remote_block_ids"


def test_single_group():
    assert single_group([[1, 2]], "remote_block_ids") == [1, 2]
    assert single_group([1, 2], "remote_block_ids") == [1, 2]
    assert single_group([], "remote_block_ids") == []
    with pytest.raises(GeometryError) as e:
        single_group([[1], [2]], "remote_block_ids")
    assert e.value.field == "remote_block_ids"


def test_as_ids_returns_int64_arrays_as_they_are_and_converts_or_refuses_the_rest():
    ids = np.array([3, 1, 2], dtype=np.int64)
    assert as_ids(ids, "x") is ids  # the daemon's unpacked ids: no copy
    assert as_ids([3, 1], "x").dtype == np.int64
    assert as_ids(np.array([3, 1], dtype=np.uint32), "x").tolist() == [3, 1]
    for bad in (np.array([[1, 2]], dtype=np.int64), np.array([1.0]), ["a"]):
        with pytest.raises(GeometryError, match="must be a flat list of integers"):
            as_ids(bad, "x")


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_check_range_refuses_exactly_the_ids_outside_and_names_one(dtype):
    """The unordered check (one uint64 pass for int64 ids, min and max otherwise) against the rule itself,
    on ids near both ends, the int64 extremes included."""
    rng = np.random.default_rng(3)
    info = np.iinfo(dtype)
    for _ in range(2000):
        limit = int(rng.integers(1, 40))
        pool = np.array([info.min, -(2**31), -2, -1, 0, 1, limit - 1, limit, limit + 1, 2**31 - 1, info.max],
                        dtype=np.int64)
        pool = pool[(pool >= info.min) & (pool <= info.max)]
        ids = np.concatenate([rng.integers(0, limit, int(rng.integers(0, 6))),
                              rng.choice(pool, int(rng.integers(0, 3)))])
        ids = rng.permutation(ids).astype(dtype)
        outside = [int(i) for i in ids if not 0 <= i < limit]
        if not outside:
            check_range(ids, limit, "remote_block_ids")
            continue
        with pytest.raises(GeometryError, match=f"remote_block_ids: block id {outside[0]} outside") as e:
            check_range(ids, limit, "remote_block_ids")
        assert e.value.field == "remote_block_ids"
