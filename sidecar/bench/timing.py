"""Timing a call on a device (``bench convert``, ``bench map``): CUDA events on a GPU, the CPU's clock."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

# The device spins this long before each timed call, so the call's launch is queued while the device is
# busy and the events time the device's work alone (a Python launch of 20-50 µs would otherwise be counted
# against a 0.3 ms kernel, and not against torch's 5 µs copy launch).
LEAD_S = 0.5e-3


def device_timer(device: Any, warmup: int, reps: int) -> Callable[[Callable[[], Any]], float]:
    """Seconds of ``fn`` after a warm-up: median of CUDA-event times of the device's work on a GPU (the launch
    hidden behind a spin, ``LEAD_S``), best wall time on the CPU. ``device``: a ``torch.device``."""
    import torch

    lead_cycles = 0

    def cuda_time(fn):
        nonlocal lead_cycles
        if not lead_cycles:
            lead_cycles = _cycles_for(LEAD_S)
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
            torch.cuda._sleep(lead_cycles)
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


def _cycles_for(seconds: float) -> int:
    """``torch.cuda._sleep`` cycles that spin the current device for about ``seconds``."""
    import torch

    probe = 1_000_000
    torch.cuda._sleep(probe)  # the first one may pay for loading the kernel
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    per_s = probe / max(1e-6, start.elapsed_time(end) / 1e3)
    return max(1, int(per_s * seconds))
