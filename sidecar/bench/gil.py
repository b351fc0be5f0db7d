"""What the planning's numpy costs when another thread runs Python: alone, and beside a thread spinning in
Python, at the daemon's GIL switch interval and at CPython's default.

A numpy ufunc over more than ~500 elements lets go of the GIL; getting it back while another thread runs
Python waits up to the switch interval. The daemon's loop and its poster thread both plan reads in numpy,
so each such call on one thread can cost the other's time slice. This times, per request of ``--blocks``
blocks and ``--layers`` layers: one add over the ``[layers, n]`` slot matrix, the loop's staging slots
(the matrix ``span_slots`` against the compact ``SpanSlots``) and the poster's staged descriptors from
each (``PairGeometry.staged_descs``), checking both give the same descriptors. Medians in µs, as JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from sidecar.bench.e2e_report import command_line
from sidecar.bench.output import emit
from sidecar.bench.planning import geometries
from sidecar.nixl.spans import SpanSlots, plan_span, span_slots
from sidecar.ops.config import Config

CPYTHON_SWITCH_S = 0.005
GIL_SWITCH_S = Config().gil_switch_interval_us / 1e6  # the daemon's default


class Spinner:
    """A thread that runs Python until stopped: the other thread that wants the GIL."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, name="gil-spinner", daemon=True)

    def _spin(self) -> None:
        x = 0
        while not self._stop.is_set():
            for i in range(1000):
                x += i

    def __enter__(self) -> Spinner:
        self._thread.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def median_us(fn: Callable[[], Any], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return round(statistics.median(times), 2)


def calls(layers: int, blocks: int) -> dict[str, Callable[[], Any]]:
    """The timed calls for one request size; raises if the two slot forms give different descriptors."""
    _, staged, _ = geometries(layers, 8, 128, 16, max(8192, 4 * blocks), layers * blocks)
    ids = np.arange(1000, 1000 + blocks)
    pos = plan_span(ids, staged.pool.slot_bytes, None, 0).pos
    compact = SpanSlots(0, layers, blocks, pos)
    a, b = staged.staged_descs(ids, span_slots(0, layers, blocks, pos)), staged.staged_descs(ids, compact)
    if not (np.array_equal(a.local, b.local) and np.array_equal(a.remote, b.remote)):
        raise AssertionError("the matrix and the compact span gave different descriptors")
    matrix = np.arange(layers * blocks, dtype=np.int64)
    return {
        "add_over_matrix": lambda: matrix + 5000,
        "loop_slots_matrix": lambda: span_slots(0, layers, blocks, pos),
        "loop_slots_compact": lambda: SpanSlots(0, layers, blocks, pos),
        "poster_descs_matrix": lambda: staged.staged_descs(ids, span_slots(0, layers, blocks, pos)),
        "poster_descs_compact": lambda: staged.staged_descs(ids, compact),
    }


def measure(layers: int, blocks: int, reps: int) -> dict[str, Any]:
    timed = calls(layers, blocks)
    before = sys.getswitchinterval()
    out: dict[str, Any] = {"blocks": blocks, "alone": {k: median_us(f, reps) for k, f in timed.items()}}
    try:
        for label, interval in (("beside_python_daemon_interval", GIL_SWITCH_S),
                                ("beside_python_cpython_default", CPYTHON_SWITCH_S)):
            sys.setswitchinterval(interval)
            with Spinner():
                out[label] = {k: median_us(f, reps) for k, f in timed.items()}
    finally:
        sys.setswitchinterval(before)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kv-sidecar bench gil", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--blocks", default="256,1024", help="comma-separated blocks per request (4k, 16k tokens)")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--out", default=None, help="write the JSON here too")
    args = p.parse_args(argv)
    result = {
        "bench": "gil",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command_line(),
        "switch_intervals_s": {"daemon": GIL_SWITCH_S, "cpython_default": CPYTHON_SWITCH_S},
        "layers": args.layers,
        "runs": [measure(args.layers, int(b), args.reps) for b in args.blocks.split(",")],
    }
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
