"""Pure math of the interference bench and the break-even model (no I/O, tested exhaustively).

Times are seconds on one host clock (CLOCK_MONOTONIC; the processes map their GPU events onto it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def poisson_arrivals(rate_per_s: float, seconds: float, rng: np.random.Generator) -> list[float]:
    """Arrival offsets in [0, seconds) of a Poisson process of ``rate_per_s`` (empty for rate 0)."""
    if rate_per_s < 0 or seconds < 0:
        raise ValueError(f"rate and seconds must be >= 0, got {rate_per_s}, {seconds}")
    out: list[float] = []
    if rate_per_s == 0:
        return out
    t = float(rng.exponential(1.0 / rate_per_s))
    while t < seconds:
        out.append(t)
        t += float(rng.exponential(1.0 / rate_per_s))
    return out


def quantiles_ms(values: Sequence[float]) -> dict[str, float]:
    """p50/p99/max/mean (ms) of durations in seconds; NaN for none."""
    if not len(values):
        return {"n": 0, "p50": math.nan, "p99": math.nan, "max": math.nan, "mean": math.nan}
    a = np.asarray(values, dtype=np.float64) * 1e3
    return {"n": int(a.size), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
            "max": float(a.max()), "mean": float(a.mean())}


def collided(steps: Sequence[tuple[float, float]], busy: Sequence[tuple[float, float]]) -> list[bool]:
    """For each step [start, end]: does it overlap (by more than a touch) any busy interval?"""
    if not busy:
        return [False] * len(steps)
    b = sorted(busy)
    starts = np.array([s for s, _ in b])
    # the latest end among intervals starting before each one: overlap test in O(log n) per step
    ends = np.maximum.accumulate(np.array([e for _, e in b]))
    out = []
    for s, e in steps:
        # last busy interval starting before the step ends
        i = int(np.searchsorted(starts, e, side="left")) - 1
        out.append(i >= 0 and ends[i] > s)
    return out


def interference_per_conversion_ms(base_mean_s: float, mean_s: float, steps: int, conversions: int) -> float:
    """Extra decode-step time one conversion caused (ms): the mean step's growth over the phase's steps."""
    if conversions <= 0:
        return 0.0
    return (mean_s - base_mean_s) * steps / conversions * 1e3


def break_even_tokens(kernel_ms: float, interference_ms: float, saved_ms_per_step: float,
                      batch: int) -> float:
    """Output tokens of a converted request after which converting paid off.

    Cost: the conversion's GPU time (``kernel_ms``) plus the extra decode-step time it caused
    (``interference_ms``; a negative measurement counts as 0). Gain: shuffled pages make a decode step
    ``saved_ms_per_step`` faster for the whole batch, so each of the ``batch`` requests is credited
    ``saved_ms_per_step / batch`` per output token. Break-even: cost / (saved / batch) tokens.
    """
    if saved_ms_per_step <= 0 or batch <= 0 or kernel_ms < 0:
        raise ValueError(f"need saved_ms_per_step > 0, batch > 0, kernel_ms >= 0, got {saved_ms_per_step}, "
                         f"{batch}, {kernel_ms}")
    return (kernel_ms + max(0.0, interference_ms)) * batch / saved_ms_per_step


def ratio(value: float, base: float) -> float:
    return value / base if base > 0 and math.isfinite(value) else math.nan
