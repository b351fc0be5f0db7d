"""Timing a call on a device: CUDA events on a GPU, the clock on the CPU (``bench convert``, ``bench map``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def device_timer(device: Any, warmup: int, reps: int) -> Callable[[Callable[[], Any]], float]:
    """Seconds of ``fn`` after a warm-up: median of CUDA-event times on a GPU, best wall time on the CPU.
    ``device``: a ``torch.device``."""
    import torch

    def cuda_time(fn):
        # Warm up for at least `warmup` calls and 50 ms, so the clocks have left idle before timing.
        start = time.perf_counter()
        done = 0
        while done < warmup or time.perf_counter() - start < 0.05:
            fn()
            torch.cuda.synchronize()
            done += 1
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    def cpu_time(fn):
        # Best of reps: on a small shared host other processes only ever add time (preemption).
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    return cuda_time if device.type == "cuda" else cpu_time
