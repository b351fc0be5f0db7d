#!/usr/bin/env python3
"""Which host calls wait for GPU work held behind a closed gate (``sidecar.convert.gates``). GPU only.

Each probe closes a gate on one stream, queues a kernel behind it, then makes the call on a worker thread; the
call counts as blocked if it has not returned after ``--hold-s``, when the main thread opens the gate. A call
that blocks would deadlock a daemon whose loop (the thread that opens gates) made it with a gate closed.

    python3 scripts/gate-probe.py [--out gate-probe.json] [--hold-s 6] [NAME-PART...]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from sidecar.convert.gates import Gates


@triton.jit
def _add(p, n, V: tl.constexpr):
    i = tl.arange(0, 1024)
    tl.store(p + i, tl.load(p + i) + V, mask=i < n)


def probes(x: torch.Tensor, other: torch.cuda.Stream) -> dict[str, Callable[[], object]]:
    """The calls, each run on a fresh thread (its current stream is ``other`` where it launches work)."""
    dev = x.device
    seen = torch.cuda.CUDAGraph()
    with torch.cuda.stream(other):
        x.add_(1)  # the kernel captured below is loaded already
        seen.capture_begin(capture_error_mode="thread_local")
        x.add_(1)
        seen.capture_end()
    torch.cuda.synchronize()

    def capture() -> None:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(other):
            g.capture_begin(capture_error_mode="thread_local")
            x.mul_(1)
            g.capture_end()

    def on_other(fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            torch.cuda.set_stream(other)
            return fn()
        return run

    return {
        "graph capture+instantiate": capture,
        "graph replay (existing)": on_other(seen.replay),
        "event create+record": lambda: torch.cuda.Event().record(other),
        "pinned alloc (new size)": lambda: torch.empty(3 << 20, dtype=torch.uint8, pin_memory=True),
        "device alloc (new 1 GiB)": lambda: torch.empty(1 << 30, dtype=torch.uint8, device=dev),
        "triton first launch (new constexpr)": on_other(lambda: _add[(1,)](x, 100, V=7)),
        "torch kernel first use on other stream": on_other(lambda: torch.cumsum(x[:10], 0)),
        "h2d non_blocking from pinned": lambda: torch.ones(8, pin_memory=True).to(dev, non_blocking=True),
        "empty_cache (cudaFree)": torch.cuda.empty_cache,
        "stream create": torch.cuda.Stream,
    }


def probe(gates: Gates, held: torch.cuda.Stream, x: torch.Tensor, fn: Callable[[], object],
          hold_s: float) -> dict:
    slot = gates.take()
    gates.close_on(held, slot)
    with torch.cuda.stream(held):
        x.add_(1)
    behind = torch.cuda.Event()
    behind.record(held)
    errors: list[str] = []

    def run() -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported, not raised: the next probe still runs
            errors.append(repr(exc))

    worker = threading.Thread(target=run, daemon=True)
    t0 = time.perf_counter()
    worker.start()
    worker.join(hold_s)
    blocked = worker.is_alive()
    gates.open(slot)
    worker.join(30)
    took = time.perf_counter() - t0
    while not behind.query():
        time.sleep(0.001)
    gates.give_back(slot)
    return {"blocked": blocked, "seconds": round(took, 3), "error": errors[0] if errors else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("only", nargs="*", help="run only probes whose name holds one of these")
    ap.add_argument("--hold-s", type=float, default=6.0)
    ap.add_argument("--out", default="gate-probe.json")
    args = ap.parse_args()
    x = torch.zeros(1 << 20, device="cuda")
    gates, held, other = Gates(4), torch.cuda.Stream(), torch.cuda.Stream()
    result = {}
    for name, fn in probes(x, other).items():
        if args.only and not any(o in name for o in args.only):
            continue
        result[name] = r = probe(gates, held, x, fn, args.hold_s)
        print(f"{name:40s} {'BLOCKED' if r['blocked'] else 'ok':8s} {r['seconds']:.3f} s {r['error'] or ''}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
