"""Pairing helpers (``sidecar.nixl.pairing``): logical to kernel block ids, vLLM's per-group id lists."""

from __future__ import annotations

import pytest

from sidecar.nixl.pairing import GeometryError, kernel_block_ids, single_group


def test_kernel_block_ids_expansion():
    assert kernel_block_ids([2, 3], 1, "x").tolist() == [2, 3]
    assert kernel_block_ids([2, 3], 2, "x").tolist() == [4, 5, 6, 7]  # vLLM's docstring example
    assert kernel_block_ids([1, 5], 3, "x").tolist() == [3, 4, 5, 15, 16, 17]
    assert kernel_block_ids([], 4, "x").tolist() == []


def test_single_group():
    assert single_group([[1, 2]], "remote_block_ids") == [1, 2]
    assert single_group([1, 2], "remote_block_ids") == [1, 2]
    assert single_group([], "remote_block_ids") == []
    with pytest.raises(GeometryError) as e:
        single_group([[1], [2]], "remote_block_ids")
    assert e.value.field == "remote_block_ids"
