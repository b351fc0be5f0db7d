"""Where the completion signal's time goes: `kv-sidecar bench signal` on the completion socket, with the
kernel's receive timestamp (SO_TIMESTAMPNS) of every Done packet, splitting each latency into the daemon's
side (its stamp → the packet queued on the shim's socket) and the shim's side (queued → the I/O thread has
read it). Also the I/O thread's scheduler statistics (/proc/.../schedstat): CPU time, time runnable but
waiting, wake-ups.

    python sidecar/bench/signal_split.py [--concurrency N] [--pulls N] [--out FILE]

A diagnostic, not a product path: it replaces the shim client's completion-socket receive with one that reads
the timestamp (same work otherwise). Linux only.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import struct
import sys
import time

import numpy as np

from sidecar.bench import completion_signal as bench
from sidecar.bench.output import emit
from sidecar.wire import protocol as p
from vllm_glue import client as shim_client

SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux's value; Python does not name it
REALTIME_MINUS_MONOTONIC = time.time_ns() - time.monotonic_ns()
samples: list[tuple[int, int, int]] = []  # (daemon stamp, kernel queued, shim read), monotonic ns
sched: dict[str, list[int]] = {}


def _schedstat(tid: int) -> list[int]:
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        return [int(x) for x in f.read().split()]


def _patch() -> None:
    cls = shim_client.SidecarClient
    bind, init, close = cls._bind_fast, cls.__init__, cls.close

    def bind_fast(self, dealer, path):
        bind(self, dealer, path)
        if self._fast is not None:
            self._fast.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)

    def on_fast(self, dealer):
        while self._fast is not None:
            try:
                data, ancillary, _, _ = self._fast.recvmsg(65536, 256)
            except (BlockingIOError, InterruptedError):
                return
            at = time.monotonic_ns()
            if not data:
                self._close_fast()
                return
            queued = None
            for level, kind, raw in ancillary:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                    sec, nsec = struct.unpack("qq", raw[:16])
                    queued = sec * 10**9 + nsec - REALTIME_MINUS_MONOTONIC
            msg = p.decode_to_shim(data)
            if isinstance(msg, p.Done) and queued is not None and msg.sent_at_ns:
                samples.append((msg.sent_at_ns, queued, at))
            self._on_payload(dealer, data, at)

    def start(self, *args, **kwargs):
        init(self, *args, **kwargs)
        sched["tid"] = [self._thread.native_id]
        sched["start"] = _schedstat(self._thread.native_id)

    def stop(self):
        sched["end"] = _schedstat(sched["tid"][0])
        close(self)

    cls._bind_fast, cls._on_fast, cls.__init__, cls.close = bind_fast, on_fast, start, stop


def _pct(values: np.ndarray) -> dict[str, float]:
    return {f"p{q:g}": round(float(np.percentile(values, q)), 1) for q in (50, 90, 99, 99.9)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--pulls", type=int, default=3000)
    ap.add_argument("--out", help="write the JSON here too")
    args = ap.parse_args()
    _patch()
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    bench_args = parser.parse_args(["--pulls", str(args.pulls), "--concurrency", str(args.concurrency)])
    bench._measure(bench_args, "completion_socket")
    a = np.asarray(samples[bench_args.warmup :], dtype=np.float64)
    daemon_us, shim_us = (a[:, 1] - a[:, 0]) / 1e3, (a[:, 2] - a[:, 1]) / 1e3
    total = daemon_us + shim_us
    top = total >= np.percentile(total, 99)
    cpu, wait, wakeups = (e - s for e, s in zip(sched["end"], sched["start"], strict=True))
    result = {
        "bench": "signal_split",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": f"CPU ({os.cpu_count()} threads), {platform.machine()}, Linux {platform.release()}",
        "command": "python sidecar/bench/signal_split.py " + " ".join(sys.argv[1:]),
        "concurrency": args.concurrency,
        "dones": len(a),
        "daemon_stamp_to_kernel_queue_us": _pct(daemon_us),
        "kernel_queue_to_shim_read_us": _pct(shim_us),
        "total_us": _pct(total),
        "top_1pct_mean_us": {"daemon_side": round(float(daemon_us[top].mean()), 1),
                             "shim_side": round(float(shim_us[top].mean()), 1)},
        "shim_io_thread": {"cpu_ms": round(cpu / 1e6, 1), "runnable_waiting_ms": round(wait / 1e6, 1),
                           "timeslices": wakeups},
    }
    emit(result, args.out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
