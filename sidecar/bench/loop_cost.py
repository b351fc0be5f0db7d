"""The daemon loop thread's CPU per pull, without a GPU: bursts of Pulls, back to back or after idling.

A ``Daemon`` runs in this process on ``FakePort`` (the CPU twin's stand-in prefill, whose pages are a CPU
tensor "mapped" here), so a pull takes the mapped path: receipt, pairing, the conversion's hand-off, the
answer and the prefill's notification. With ``--daemon-set pull_mode='"staged"'`` and a ``staging_bytes`` it
takes the staged path instead (span and slots, the post's hand-off to the poster thread, the read's poll, the
release), against FakePort's reads; ``--remote-order`` picks the prefill's blocks of a pull, scattered or back
to back. The conversion itself is left out (it runs on a worker thread here
and on the GPU in production), and so is what a GPU launch costs, so the numbers are the loop's Python
around the launch. Each Pull goes in as the completion socket hands it over: msgpack bytes, decoded, then
dispatched; replies are collected instead of sent.

For each cell (blocks per pull x pulls per burst x idle between bursts) it reports the loop thread's CPU
(``time.thread_time``) per pull from a burst's first Pull to its last Done, p50 and p90 over the bursts, the
queue stage of each Done (p50 / p99: a Pull's wait for the loop behind the others of its burst, issue 12's
queue target), each Pull's receipt by its place in the burst (p50: decode, checks, its job made), and the
Python function calls per pull (one more pass under ``cProfile``). Equal calls with unequal CPU mean the same
work ran slower: what idling does to a host's caches, not more code. Only cells of one run compare; for a
before/after, run it from each tree in turn, more than once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any
from unittest import mock

import numpy as np
import torch

from sidecar.bench.e2e_common import BenchError, daemon_settings, toml_values
from sidecar.bench.e2e_report import command_line
from sidecar.bench.output import emit
from sidecar.daemon import conversion
from sidecar.daemon.app import Daemon
from sidecar.ops import config
from sidecar.standins.fake_transfer import FakePort
from sidecar.wire import ipc
from sidecar.wire import protocol as p
from sidecar.wire.formats import PageFormat

HEADS, BLOCK_SIZE, HEAD_SIZE, LAYERS = 1, 16, 64, 4
PLANE = HEADS * BLOCK_SIZE * HEAD_SIZE  # elements of one block's K (or V) plane
FORMAT = PageFormat(kind="aiter_shuffled", layout="LHBNC", dtype="bfloat16", num_heads=HEADS,
                    block_size=BLOCK_SIZE, head_size=HEAD_SIZE)
WARMUP_BURSTS = 5
# an in-process daemon on mapped pulls: no socket bound, no metrics endpoint, room for any burst
BASE_CONFIG = {"socket": "ipc:///nonexistent/kvs.sock", "metrics_port": -1, "pull_mode": "mapped",
               "max_inflight": 64}


@contextlib.contextmanager
def _without_conversion() -> Iterator[None]:
    """The CPU twin's converter made a no-op: the loop's cost only (the kernel is not the loop's)."""
    with mock.patch.object(conversion, "convert_blocks", lambda *a, **k: None):
        yield


class LoopRig:
    """A daemon on FakePort with registered caches of ``num_blocks`` blocks, Pulls in, replies counted."""

    def __init__(self, num_blocks: int, settings: dict[str, Any] | None = None) -> None:
        self.num_blocks = num_blocks
        self.port = FakePort()
        self.port.mapped = torch.zeros(LAYERS, num_blocks, 2 * PLANE, dtype=torch.bfloat16)
        cfg = config.build({**BASE_CONFIG, **(settings or {})}, "--daemon-set")
        self.daemon = Daemon(cfg, make_port=lambda _c: self.port, bind=False, reload=None)
        self.daemon.router.send = self._record
        self.shm = ipc.create_shm_buffer(LAYERS * 2 * num_blocks * PLANE * 2)
        self.done = 0
        self.timings: list[dict[str, float]] = []  # each Done's stage timings, in the order they came
        self.failed: list[str] = []
        self.registered = asyncio.Event()
        self._until: tuple[int, asyncio.Future] | None = None  # (a Done count, set once it is reached)

    def _record(self, envelope: list[bytes], msg: Any) -> None:
        if isinstance(msg, p.Registered):
            self.registered.set()
        elif isinstance(msg, p.Done):
            self.done += 1
            self.timings.append(msg.timings or {})
            if not msg.ok:
                self.failed.append(f"{msg.req_id}: {msg.reason}")
            if self._until is not None and self.done >= self._until[0]:
                self._until[1].set_result(None)
                self._until = None
        elif isinstance(msg, p.Error):
            self.failed.append(msg.reason)

    async def start(self) -> None:
        await self.daemon.start()
        self._dispatch(p.Hello(protocol_version=p.PROTOCOL_VERSION, package_version="bench"))
        b = self.num_blocks
        layers = [
            ipc.LayerView(name=f"model.layers.{i}.self_attn.attn", buffer_index=0,
                          offset_bytes=i * 2 * b * PLANE * 2, shape=[b, 2, BLOCK_SIZE, HEADS * HEAD_SIZE],
                          strides=[PLANE, b * PLANE, HEADS * HEAD_SIZE, 1], dtype="bfloat16")
            for i in range(LAYERS)
        ]
        self._dispatch(p.RegisterCaches(buffers=[self.shm.description], layers=layers, page_format=FORMAT))
        await asyncio.wait_for(self.registered.wait(), 30)

    async def stop(self) -> None:
        await self.daemon.shutdown(0)
        self.shm.close()

    def _dispatch(self, msg: Any) -> None:
        self.daemon.router.dispatch([b"shim"], msg, time.monotonic())

    def answered(self, count: int) -> asyncio.Future:
        """Done once ``count`` Dones came in all told (a future, so the loop sleeps meanwhile)."""
        fut = asyncio.get_running_loop().create_future()
        self._until = (count, fut)
        return fut

    def receive(self, payload: bytes) -> None:
        """One Pull as the completion socket hands it over: bytes, decoded, dispatched."""
        self.daemon.router.dispatch([b"shim"], p.decode_on_completions(payload), time.monotonic())


ORDERS = ("random", "contiguous")


def payloads(
    count: int, blocks: int, burst: int, num_blocks: int, seed: int, order: str = "random"
) -> list[bytes]:
    """Encoded Pulls: each burst's pulls own disjoint local blocks; remote blocks scattered over the prefill's
    ``num_blocks`` (``random``) or back to back, as a fresh prefill hands them out (``contiguous``)."""
    if order not in ORDERS:
        raise ValueError(f"order {order!r} is not one of {ORDERS}")
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        j = i % burst
        local = np.arange(j * blocks, (j + 1) * blocks)
        remote = rng.permutation(num_blocks)[:blocks] if order == "random" else local
        out.append(p.encode(p.Pull(
            req_id=f"q{i}", remote_engine_id="prefill-0", remote_host="127.0.0.1", remote_port=5600,
            remote_request_id=f"r{i}", remote_block_ids=p.pack_block_ids(remote),
            local_block_ids=p.pack_block_ids(local), remote_num_tokens=blocks * BLOCK_SIZE,
        )))
    return out


async def _bursts(rig: LoopRig, data: list[bytes], burst: int, idle_s: float,
                  profile: cProfile.Profile | None = None,
                  receipts: list[list[float]] | None = None) -> list[float]:
    """Thread CPU per pull of each burst after the warm-up ones; with ``receipts`` (one list per place in
    the burst), each Pull's receipt too: its decode and dispatch, wall seconds."""
    per_pull = []
    for b in range(len(data) // burst):
        timed = b >= WARMUP_BURSTS
        answered = rig.answered(rig.done + burst)
        if profile is not None and timed:
            profile.enable()  # the burst only: what runs while idle is not a pull's
        t0 = time.thread_time()
        for i, payload in enumerate(data[b * burst:(b + 1) * burst]):
            r0 = time.perf_counter()
            rig.receive(payload)
            if timed and receipts is not None:
                receipts[i].append(time.perf_counter() - r0)
        await asyncio.wait_for(answered, 30)
        if timed:
            per_pull.append((time.thread_time() - t0) / burst)
        if profile is not None:
            profile.disable()
        if idle_s:
            await asyncio.sleep(idle_s)
    return per_pull


async def cell(blocks: int, burst: int, idle_ms: float, bursts: int, seed: int,
               settings: dict[str, Any] | None = None, order: str = "random") -> dict[str, Any]:
    """One cell: timed bursts, then a profiled pass of as many for the calls per pull."""
    num_blocks = max(2048, burst * blocks)
    rig = LoopRig(num_blocks, settings)
    await rig.start()
    try:
        n = (bursts + WARMUP_BURSTS) * burst
        data = payloads(2 * n, blocks, burst, num_blocks, seed, order)
        receipts: list[list[float]] = [[] for _ in range(burst)]
        with _without_conversion():
            per_pull = await _bursts(rig, data[:n], burst, idle_ms / 1e3, receipts=receipts)
            dones = rig.timings[WARMUP_BURSTS * burst:n]  # the timed bursts of the first pass
            profile = cProfile.Profile()
            await _bursts(rig, data[n:], burst, idle_ms / 1e3, profile)
        calls = pstats.Stats(profile).total_calls  # type: ignore[attr-defined]
    finally:
        await rig.stop()
    us = sorted(x * 1e6 for x in per_pull)
    queue = sorted(t.get("queue", 0.0) * 1e3 for t in dones)
    return {
        "blocks": blocks, "remote_order": order, "burst": burst, "idle_ms": idle_ms, "bursts": len(us),
        "cpu_us_per_pull_p50": round(statistics.median(us), 1),
        "cpu_us_per_pull_p90": round(us[int(0.9 * (len(us) - 1))], 1),
        "calls_per_pull": round(calls / (bursts * burst), 1),
        # each Done's queue stage: how long a Pull waited for the loop behind the others of its burst
        "queue_ms_p50": round(statistics.median(queue), 3),
        "queue_ms_p99": round(queue[int(0.99 * (len(queue) - 1))], 3),
        # a Pull's receipt (decode, checks, its job and task made) by its place in the burst, p50 over the
        # bursts: the first after an idle gap pays for the code gone cold, the others find it warm
        "receipt_us_p50_by_place": [round(statistics.median(r) * 1e6, 1) for r in receipts],
        "failed": len(rig.failed), "first_failure": rig.failed[0] if rig.failed else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kv-sidecar bench loop", description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", default="256,1024", help="blocks per pull, comma-separated (4k, 16k tokens)")
    ap.add_argument("--bursts-of", default="1,8", help="pulls per burst, comma-separated")
    ap.add_argument("--idle-ms", default="0,20", help="idle between bursts, comma-separated (0: none)")
    ap.add_argument("--bursts", type=int, default=200, help="timed bursts per cell (after 5 untimed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--remote-order", choices=ORDERS, default="random",
                    help="the prefill's blocks of a pull: scattered over its pool, or back to back")
    ap.add_argument("--daemon-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a daemon config key for every cell (TOML value), e.g. poll_linger_s=0.05")
    ap.add_argument("--out", default=None, help="write the JSON here too")
    args = ap.parse_args(argv)
    try:  # refused here, naming the key, rather than in the first cell
        settings = toml_values(daemon_settings(args.daemon_set))
        config.build({**BASE_CONFIG, **settings}, "--daemon-set")
    except (BenchError, config.ConfigError) as exc:
        print(f"kv-sidecar bench loop: {exc}", file=sys.stderr)
        return 2
    import uvloop  # the loop ``kv-sidecar serve`` runs on

    cells = [
        uvloop.run(
            cell(int(blocks), int(burst), float(idle), args.bursts, args.seed, settings, args.remote_order)
        )
        for blocks in args.blocks.split(",")
        for burst in args.bursts_of.split(",")
        for idle in args.idle_ms.split(",")
    ]
    result = {
        "bench": "loop",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command_line(),
        "host": {"cpus": os.cpu_count()},
        "daemon_set": settings,
        "what": __doc__.split("\n")[0],
        "cells": cells,
    }
    emit(result, args.out)
    return 1 if any(c["failed"] for c in cells) else 0


if __name__ == "__main__":
    raise SystemExit(main())
