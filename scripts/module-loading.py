#!/usr/bin/env python3
"""What CUDA's module loading mode costs and what it does behind a closed gate. GPU only.

For each mode (``CUDA_MODULE_LOADING`` LAZY, torch's default, and EAGER), in a fresh process: the seconds to
initialise CUDA and run a first kernel, the device memory the process then holds, and whether a kernel's
first launch behind a closed gate (``sidecar.convert.gates``) blocks the host (the launch's milliseconds) or
holds up later work on another stream (the milliseconds an event recorded there waits), the gate opened by a
timer ``--hold-s`` after it closed.

    python3 scripts/module-loading.py [--out module-loading.json] [--hold-s 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

MODES = ("LAZY", "EAGER")


def probe(hold_s: float) -> dict[str, float]:
    """This process's numbers (its mode set by the caller's environment)."""
    t0 = time.monotonic()
    import torch

    pages = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
    pages.add_(1)
    torch.cuda.synchronize()
    init_s = time.monotonic() - t0
    free, total = torch.cuda.mem_get_info()
    from sidecar.convert.gates import Gates

    other, held = torch.cuda.Stream(), torch.cuda.Stream()
    gates = Gates(1)
    slot = gates.take()
    gates.close_on(held, slot)
    timer = threading.Timer(hold_s, gates.open, (slot,))
    timer.start()  # before the launch behind the gate: a module's first load may block it until then
    t0 = time.monotonic()
    with torch.cuda.stream(held):
        torch.ones(4, dtype=torch.float64, device="cuda:0").mul_(3)  # kernels this process never launched
    launch_ms = (time.monotonic() - t0) * 1e3
    with torch.cuda.stream(other):
        pages.add_(1)
    event = torch.cuda.Event()
    event.record(other)
    t0 = time.monotonic()
    event.synchronize()
    waited_ms = (time.monotonic() - t0) * 1e3
    timer.join()
    torch.cuda.synchronize()
    gates.give_back(slot)
    return {"init_s": init_s, "device_used_GiB": (total - free) / 2**30, "gated_launch_ms": launch_ms,
            "other_stream_waited_ms": waited_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="module-loading.json")
    ap.add_argument("--hold-s", type=float, default=2.0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(probe(args.hold_s)))
        return
    rows = {}
    for mode in MODES:
        env = {**os.environ, "CUDA_MODULE_LOADING": mode}
        got = subprocess.run([sys.executable, __file__, "--child", "--hold-s", str(args.hold_s)], env=env,
                             capture_output=True, text=True, timeout=120, check=True)
        rows[mode] = json.loads(got.stdout.strip().splitlines()[-1])
        print(mode, rows[mode], flush=True)
    import torch

    out = {"bench": "module loading", "date": time.strftime("%Y-%m-%d"),
           "device": torch.cuda.get_device_name(0), "command": " ".join(["python3", *sys.argv]),
           "hold_s": args.hold_s, "modes": rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
