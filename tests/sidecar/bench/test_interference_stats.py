"""Pure math of the interference bench and the break-even model."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from sidecar.bench import interference_stats as st

intervals = hs.lists(hs.tuples(hs.floats(0, 100), hs.floats(0.001, 5)).map(lambda t: (t[0], t[0] + t[1])),
                     max_size=30)


@given(intervals, intervals)
@settings(max_examples=300, deadline=None)
def test_collided_matches_brute_force(steps, busy):
    want = [any(bs < e and be > s for bs, be in busy) for s, e in steps]
    assert st.collided(steps, busy) == want


def test_poisson_arrivals_rate_and_range():
    rng = np.random.default_rng(3)
    a = st.poisson_arrivals(50.0, 200.0, rng)
    assert all(0 <= x < 200 for x in a) and a == sorted(a)
    assert abs(len(a) / 200.0 - 50.0) < 2.0
    assert st.poisson_arrivals(0.0, 10.0, rng) == []
    with pytest.raises(ValueError):
        st.poisson_arrivals(-1.0, 1.0, rng)


def test_quantiles_ms():
    q = st.quantiles_ms([0.001 * i for i in range(1, 101)])
    assert q["n"] == 100 and q["max"] == pytest.approx(100.0) and q["p50"] == pytest.approx(50.5)
    assert math.isnan(st.quantiles_ms([])["p99"])


def test_interference_per_conversion():
    # 1000 steps grew by 0.01 ms on average with 20 conversions: 0.5 ms each
    assert st.interference_per_conversion_ms(1e-3, 1.01e-3, 1000, 20) == pytest.approx(0.5)
    assert st.interference_per_conversion_ms(1e-3, 2e-3, 10, 0) == 0.0


@given(hs.floats(0, 10), hs.floats(-5, 10), hs.floats(0.01, 5), hs.integers(1, 256))
def test_break_even_formula(kernel, inter, saved, batch):
    t = st.break_even_tokens(kernel, inter, saved, batch)
    assert t == pytest.approx((kernel + max(0.0, inter)) * batch / saved)
    # paying off: at t tokens the request's share of the savings equals the cost
    assert t * saved / batch == pytest.approx(kernel + max(0.0, inter), abs=1e-9)


@pytest.mark.parametrize("args", [(1, 0, 0, 32), (1, 0, 1, 0), (-1, 0, 1, 32)])
def test_break_even_refuses_bad_inputs(args):
    with pytest.raises(ValueError):
        st.break_even_tokens(*args)


def test_ratio():
    assert st.ratio(2.0, 1.0) == 2.0 and math.isnan(st.ratio(1.0, 0.0)) and math.isnan(st.ratio(math.nan, 1))
