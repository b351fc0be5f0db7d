"""``device_timer``: on a GPU the events time the device's work, not the Python launch before it; on the CPU
the best wall time."""

from __future__ import annotations

import time

import pytest
import torch

from sidecar.bench.timing import LEAD_S, device_timer


def test_cpu_time_is_the_best_of_the_runs():
    delays = iter([0.02, 0.005, 0.03])

    def fn():
        time.sleep(next(delays, 0.05))

    best = device_timer(torch.device("cpu"), warmup=0, reps=3)(fn)
    assert 0.005 <= best < 0.02


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_gpu_time_leaves_out_a_slow_launch():
    """A call that spends 0.2 ms of Python before a tiny kernel: timed without that 0.2 ms (the spin before
    the start event covers it), and timed with it once the Python outlasts the spin."""
    x = torch.zeros(1024, device="cuda")
    timer = device_timer(torch.device("cuda"), warmup=2, reps=10)

    def slow_launch(python_s: float):
        def fn():
            end = time.perf_counter() + python_s
            while time.perf_counter() < end:
                pass
            x.add_(1)

        return fn

    hidden = timer(slow_launch(0.2e-3))
    assert hidden < 0.1e-3, f"{hidden * 1e3:.3f} ms: the launch was timed"
    shown = timer(slow_launch(2 * LEAD_S + 0.5e-3))
    assert shown > LEAD_S, f"{shown * 1e3:.3f} ms: Python longer than the spin must show"
