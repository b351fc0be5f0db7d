"""Conversion limits: slicing plans, the operator knob, and that slicing never changes the bytes (CPU)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from sidecar.convert import PlaneSet
from sidecar.convert.launch import ConversionLimits, convert_blocks, limits_for, plan_slices
from sidecar.wire.formats import AITER_SHUFFLED


@pytest.mark.parametrize("first,last", [(0, 1), (0, 3), (2, 5)])
@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("cap", [0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 40, 100])
def test_plan_slices_cover_each_pair_once(first, last, m, cap):
    plan = plan_slices((first, last), m, cap)
    seen = [(lay, b) for l0, l1, b0, b1 in plan for lay in range(l0, l1) for b in range(b0, b1)]
    assert sorted(seen) == [(lay, b) for lay in range(first, last) for b in range(m)]
    for l0, l1, b0, b1 in plan:
        assert first <= l0 < l1 <= last and 0 <= b0 < b1 <= m
        assert cap == 0 or (l1 - l0) * (b1 - b0) <= cap
        assert b1 - b0 == m or l1 - l0 == 1  # partial block runs only within one layer
    if cap == 0 or cap >= (last - first) * m:
        assert len(plan) == 1


def test_plan_slices_empty():
    assert plan_slices((0, 0), 4, 2) == [] and plan_slices((0, 2), 0, 2) == []


def test_limits_for():
    assert limits_for(0).unbounded
    assert limits_for(40, pairs_per_us=25).max_slice_pairs == 1000
    assert limits_for(0.001, pairs_per_us=1).max_slice_pairs == 1
    with pytest.raises(ValueError):
        limits_for(-1)
    with pytest.raises(ValueError):
        ConversionLimits(max_ctas=-1)
    assert ConversionLimits().tuning() is None
    t = ConversionLimits(max_ctas=33).tuning()
    assert t.in_place == "pipe" and t.pipe_max_programs == 33 and t.oop_max_programs == 33


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("limits", [ConversionLimits(max_slice_pairs=1), ConversionLimits(max_slice_pairs=5),
                                    ConversionLimits(max_slice_pairs=9, max_ctas=2)])
def test_sliced_conversion_gives_the_same_bytes(staged, limits):
    layers, nb, m, h, n, d = 3, 12, 7, 2, 16, 16
    row = h * n * d
    gen = torch.Generator().manual_seed(7)
    base = torch.randint(-(2**15), 2**15 - 1, (layers, 2, nb, row), generator=gen, dtype=torch.int16)
    src = torch.randint(-(2**15), 2**15 - 1, (layers, m, 2 * row), generator=gen, dtype=torch.int16)
    ids = np.random.default_rng(2).permutation(nb)[:m]
    out = []
    for lim in (None, limits):
        c = base.clone().view(torch.bfloat16)
        ps = PlaneSet([c[i, 0] for i in range(layers)], [c[i, 1] for i in range(layers)], num_heads=h,
                      block_size=n, head_size=d)
        convert_blocks(types.SimpleNamespace(plane_set=ps), ids, AITER_SHUFFLED,
                       src.view(torch.bfloat16) if staged else None, None, lim)
        out.append(c.view(torch.int16))
    assert not torch.equal(out[0], base)  # it converted something
    assert torch.equal(out[0], out[1])


@pytest.mark.parametrize("ids,match", [
    ([2, 2], "duplicates"),  # one id per slice: each slice alone passed, and block 2 was converted twice
    ([0, 99], "out of range"),  # the bad id in the second slice: the first was written before the refusal
])
def test_a_sliced_conversion_checks_the_whole_request_before_writing(ids, match):
    h, n, d, nb = 1, 16, 16, 4
    row = h * n * d
    c = torch.randint(-(2**15), 2**15 - 1, (2, nb, row), generator=torch.Generator().manual_seed(3),
                      dtype=torch.int16)
    before = c.clone()
    planes = c.view(torch.bfloat16)
    ps = PlaneSet([planes[0]], [planes[1]], num_heads=h, block_size=n, head_size=d)
    with pytest.raises(ValueError, match=match):
        convert_blocks(types.SimpleNamespace(plane_set=ps), np.array(ids), AITER_SHUFFLED, None, None,
                       ConversionLimits(max_slice_pairs=1))
    assert torch.equal(c, before)


@pytest.mark.parametrize("shape", [(1, 2, 512), (2, 4, 512), (1, 4, 512, 1)],
                         ids=["rows short", "layers more", "four dims"])
def test_a_sliced_conversion_checks_the_source_before_writing(shape):
    """A source the unsliced launch refuses is refused before the first slice writes: each slice checks only
    its own cut, and a short source used to let the first slices convert before a later one found it."""
    h, n, d, nb = 1, 16, 16, 4
    c = torch.zeros((2, nb, h * n * d), dtype=torch.int16)
    planes = c.view(torch.bfloat16)
    ps = PlaneSet([planes[0]], [planes[1]], num_heads=h, block_size=n, head_size=d)
    src = torch.ones(shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="src shape"):
        convert_blocks(types.SimpleNamespace(plane_set=ps), np.arange(nb), AITER_SHUFFLED, src, None,
                       ConversionLimits(max_slice_pairs=1))
    assert not c.any()

