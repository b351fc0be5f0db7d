#!/usr/bin/env python3
"""Where one in-place graph launch's per-call time goes, beside a copy of the same bytes. GPU only.

``bench convert``'s per-call ratio (a launch and a device sync, against a copy and a sync) split into its
pieces, medians over ``--reps`` calls on the Qwen3-8B shapes with ids random in 8,192 blocks: the host's
``prepare`` (of it, the id checks and the table fill) and ``fire`` (of it, the replay), the sync, and the
device's time for the replay (the table's copy and the kernel) against the copy's, timed by CUDA events.

    python3 scripts/convert-percall-pieces.py [--reps 200] [--out percall-pieces.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from sidecar.bench.convert import PRESETS, _random_bits
from sidecar.convert import PlaneSet
from sidecar.convert import graphs as graphs_module
from sidecar.convert.launch import make_stream

PIECES = ("prepare", "ids", "fill", "fire", "replay", "event", "sync", "total", "copy_launch", "copy_sync",
          "copy_total", "gpu_replay", "gpu_copy")


def _timed(into: list[float], fn):
    """``fn`` wrapped to add its wall time to ``into``."""

    def wrapper(*args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            into.append(time.perf_counter() - t0)

    return wrapper


def measure(name: str, reps: int, device: torch.device) -> dict[str, float]:
    s = PRESETS[name]
    gen = torch.Generator(device=device).manual_seed(0)
    cache_blocks = max(8192, s.blocks + s.blocks // 4)
    cache = _random_bits((s.layers, 2, cache_blocks, s.num_heads * s.block_size * s.head_size), device, gen)
    ids = torch.randperm(cache_blocks, generator=torch.Generator().manual_seed(0))[: s.blocks].numpy()
    planes = PlaneSet([cache[i, 0].view(torch.bfloat16) for i in range(s.layers)],
                      [cache[i, 1].view(torch.bfloat16) for i in range(s.layers)],
                      num_heads=s.num_heads, block_size=s.block_size, head_size=s.head_size)
    graphs = graphs_module.GraphLaunches(planes)
    stream = make_stream(device)
    a = _random_bits((s.request_bytes // 2,), device, gen)
    b = torch.empty_like(a)
    t: dict[str, list[float]] = {k: [] for k in PIECES}
    for _ in range(3):  # the first captures
        graphs.launch(stream, ids, None, (0, s.layers))
    torch.cuda.synchronize()
    real_ids, real_fill = graphs_module.launch_ids, graphs_module.fill
    graphs_module.launch_ids, graphs_module.fill = _timed(t["ids"], real_ids), _timed(t["fill"], real_fill)
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            prepared = graphs.prepare(ids, None, (0, s.layers), hold_limit=graphs.per_key)
            t1 = time.perf_counter()
            prepared.fire(stream)
            t2 = time.perf_counter()
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            pieces = (("prepare", t1 - t0), ("fire", t2 - t1), ("sync", t3 - t2), ("total", t3 - t0))
            for piece, seconds in pieces:
                t[piece].append(seconds)
            t0 = time.perf_counter()
            b.copy_(a)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            for piece, seconds in (("copy_launch", t1 - t0), ("copy_sync", t2 - t1), ("copy_total", t2 - t0)):
                t[piece].append(seconds)
    finally:
        graphs_module.launch_ids, graphs_module.fill = real_ids, real_fill
    entry = graphs._graphs[(s.layers, graphs_module.bucket(s.blocks), True)][0]
    for _ in range(reps):
        e = torch.cuda.Event()
        t0 = time.perf_counter()
        e.record(stream)
        t["event"].append(time.perf_counter() - t0)
    with torch.cuda.stream(stream):
        for _ in range(reps // 2):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            e0.record(stream)
            t0 = time.perf_counter()
            entry.graph.replay()
            t["replay"].append(time.perf_counter() - t0)
            e1.record(stream)
            torch.cuda.synchronize()
            t["gpu_replay"].append(e0.elapsed_time(e1) / 1e3)
            e0.record(stream)
            b.copy_(a)
            e1.record(stream)
            torch.cuda.synchronize()
            t["gpu_copy"].append(e0.elapsed_time(e1) / 1e3)
    us = {f"{k}_us": statistics.median(v) * 1e6 for k, v in t.items()}
    us["per_call_vs_copy_per_call"] = us["copy_total_us"] / us["total_us"]
    us["gpu_replay_vs_gpu_copy"] = us["gpu_copy_us"] / us["gpu_replay_us"]
    return us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-8b-4k,qwen3-8b-16k")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default="percall-pieces.json")
    args = ap.parse_args()
    rows = {}
    for name in args.shapes.split(","):
        rows[name] = measure(name, args.reps, torch.device("cuda"))
        print(name, {k: round(v, 3 if k.endswith("copy_per_call") or k.endswith("gpu_copy") else 1)
                     for k, v in rows[name].items()})
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
