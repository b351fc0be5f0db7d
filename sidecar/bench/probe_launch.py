"""Where the CPU time of one conversion launch goes on a GPU (exploratory; bench/results/launch-probe-*.json).

Times the daemon's path (``PlaneSet.convert`` on its own stream, then an event) and, alone, each part of it:
the request check, the Launcher's device tables, the kernel launch, the stream context, the event; and, for
scale, a bare torch launch and small host-to-device copies. Usage on a GPU machine:
``OUT=/tmp python3 sidecar/bench/probe_launch.py`` (writes $OUT/probe.json).
"""

from __future__ import annotations

import json
import os
import statistics
import time

import numpy as np
import torch
import triton

from sidecar.convert import PlaneSet
from sidecar.convert import triton_kernel as tk
from sidecar.convert.checks import check_request

L, H, D, N, NB, M = 36, 8, 128, 16, 4096, 256
dev = torch.device("cuda:0")
row = H * N * D
ks = [torch.zeros((NB, row), dtype=torch.bfloat16, device=dev) for _ in range(L)]
vs = [torch.zeros((NB, row), dtype=torch.bfloat16, device=dev) for _ in range(L)]
ps = PlaneSet(ks, vs, num_heads=H, block_size=N, head_size=D)
ps.warm_up()
stage = torch.zeros((L, M, 2 * row), dtype=torch.bfloat16, device=dev)
ids_np = np.random.default_rng(0).choice(np.arange(1, NB), M, replace=False).astype(np.int64)
stream = torch.cuda.Stream(dev)
out: dict[str, object] = {}


def t(name, fn, iters=300):  # noqa: ANN001, ANN201
    """Median µs of ``fn()`` (20 untimed calls first; a device sync every 32 calls, not timed)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    xs = []
    for i in range(iters):
        t0 = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t0)
        if i % 32 == 31:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    out[name] = round(statistics.median(xs) * 1e6, 1)
    print(f"{name:50s} {out[name]:8.1f} us", flush=True)


ids_t = torch.from_numpy(ids_np)
for g, (lo, hi) in (("all36", (0, 36)), ("grp3", (0, 3))):
    src = stage[lo:hi]
    t(f"check_request inplace {g}", lambda: check_request(ps.planes, ids_t, None, (lo, hi)))  # noqa: B023
    t(f"check_request staged {g}", lambda: check_request(ps.planes, ids_t, src, (lo, hi)))  # noqa: B023
    job_i = check_request(ps.planes, ids_t, None, (lo, hi))
    job_s = check_request(ps.planes, ids_t, src, (lo, hi))
    t(f"Launcher() init inplace {g}", lambda: tk.Launcher(job_i))  # noqa: B023
    t(f"Launcher() init staged {g}", lambda: tk.Launcher(job_s))  # noqa: B023
    li, ls = tk.Launcher(job_i), tk.Launcher(job_s)
    with torch.cuda.stream(stream):
        t(f"kernel launch only inplace {g}", li)
        t(f"kernel launch only staged {g}", ls)

    def full(src_=None, lo=lo, hi=hi):  # noqa: ANN001, ANN202
        with torch.cuda.stream(stream):
            ids = torch.from_numpy(np.ascontiguousarray(ids_np, dtype=np.int64))
            ps.convert(ids, src=src_, layers=(lo, hi))
            e = torch.cuda.Event()
            e.record(stream)

    t(f"daemon path inplace {g}", lambda: full(None))  # noqa: B023
    t(f"daemon path staged {g}", lambda: full(src))  # noqa: B023

a = torch.zeros(16, device=dev)
with torch.cuda.stream(stream):
    t("torch add_ small (one bare launch)", lambda: a.add_(1))
t("stream ctx enter/exit", lambda: torch.cuda.stream(stream).__enter__() or None)


def ev() -> None:
    e = torch.cuda.Event()
    e.record(stream)


t("Event()+record", ev)
t("pageable H2D 256 int64 non_blocking", lambda: ids_t.to(dev, non_blocking=True))
t(
    "pageable H2D 36x6 int64 non_blocking",
    lambda: torch.from_numpy(np.zeros((36, 6), np.int64)).to(dev, non_blocking=True),
)


def pinned() -> torch.Tensor:
    h = torch.empty(256 + 216, dtype=torch.int64, pin_memory=True)
    h.numpy()[:256] = ids_np
    return h.to(dev, non_blocking=True)


t("pinned (caching host alloc) fill + H2D 472 int64", pinned)
t("torch.from_numpy(ids)", lambda: torch.from_numpy(np.ascontiguousarray(ids_np, dtype=np.int64)))
out["triton"] = triton.__version__
out["torch"] = torch.__version__
print("triton", out["triton"], "torch", out["torch"])
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "probe.json"), "w") as f:
    json.dump(out, f, indent=1)
