"""``python -m sidecar.bench.nixl_threads``: do NIXL's Python calls release the GIL, and may two threads
share one agent? Real NIXL over UCX, DRAM, a prefill-like target in a second process.

Part 1 (GIL): a Python thread counts in a loop while the main thread makes one NIXL call on a
``--descs``-descriptor READ (scattered, so nothing merges). ``share`` is the counter's progress during the
call over its progress alone for as long: about 0 means the call holds the GIL throughout, about 1 (or
more, with the GIL free and a core to spare) that it releases it. A call of about a millisecond reads 0
either way (the counter thread does not wake in time): meter long calls (``--descs 200000 --unit 256``).

Part 2 (threads): one thread posts and waits on big READs while another polls a second READ's state and
sends notifications on the same agent, at the agent's ``sync_mode``; every read is checked byte for byte.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

TARGET = r"""
import sys, numpy as np
from nixl._api import nixl_agent, nixl_agent_config
n = int(sys.argv[1])
buf = (np.arange(n, dtype=np.uint64) * 2654435761 % 1000003).astype(np.uint8)
ag = nixl_agent("nt-target", nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))
ag.register_memory(ag.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM"))
sys.stdout.write(ag.get_agent_metadata().hex() + " " + str(buf.ctypes.data) + "\n")
sys.stdout.flush()
sys.stdin.read()
"""


class Counter(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.n = 0
        self.stop = False

    def run(self) -> None:
        while not self.stop:
            self.n += 1


def rate(counter: Counter, seconds: float) -> float:
    n0, t0 = counter.n, time.perf_counter()
    time.sleep(seconds)
    return (counter.n - n0) / (time.perf_counter() - t0)


def timed(counter: Counter, alone: float, fn: Any) -> tuple[Any, dict[str, float]]:
    n0, t0 = counter.n, time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    return out, {"ms": dt * 1e3, "share": (counter.n - n0) / (alone * dt) if dt > 0 else 0.0}


def gil_part(ag: Any, remote: str, base: int, local: np.ndarray, descs: int, unit: int) -> dict[str, Any]:
    order = np.arange(descs, dtype=np.uint64)[::-1].copy()  # reversed: no two neighbours merge
    loc = np.stack([np.full(descs, local.ctypes.data, np.uint64) + order * unit,
                    np.full(descs, unit, np.uint64), np.zeros(descs, np.uint64)], 1)
    rem = np.stack([np.uint64(base) + np.arange(descs, dtype=np.uint64) * unit,
                    np.full(descs, unit, np.uint64), np.zeros(descs, np.uint64)], 1)
    counter = Counter()
    counter.start()
    sys.setswitchinterval(0.0005)
    alone = rate(counter, 0.3)
    out: dict[str, Any] = {"counter_per_s_alone": alone}
    ld, out["get_xfer_descs"] = timed(counter, alone, lambda: ag.get_xfer_descs(loc, "DRAM"))
    rd = ag.get_xfer_descs(rem, "DRAM")
    h, out["initialize_xfer"] = timed(counter, alone, lambda: ag.initialize_xfer("READ", ld, rd, remote))
    state, out["transfer"] = timed(counter, alone, lambda: ag.transfer(h))
    polls, n0, t0 = 0, counter.n, time.perf_counter()
    while state == "PROC":
        state = ag.check_xfer_state(h)
        polls += 1
    dt = time.perf_counter() - t0
    out["check_xfer_state_loop"] = {"ms": dt * 1e3, "calls": polls,
                                    "share": (counter.n - n0) / (alone * dt) if dt > 0 else None}
    ag.release_xfer_handle(h)
    lh = ag.prep_xfer_dlist("NIXL_INIT_AGENT", loc, "DRAM")
    rh = ag.prep_xfer_dlist(remote, rem, "DRAM")
    idx = np.arange(descs, dtype=np.int32)
    h2, out["make_prepped_xfer"] = timed(counter, alone,
                                         lambda: ag.make_prepped_xfer("READ", lh, idx, rh, idx))
    state, out["transfer_prepped"] = timed(counter, alone, lambda: ag.transfer(h2))
    while state == "PROC":
        state = ag.check_xfer_state(h2)
    _, out["release_xfer_handle"] = timed(counter, alone, lambda: ag.release_xfer_handle(h2))
    # controls: one C call that holds the GIL throughout (sorted), one that releases it (sleep)
    _, out["control_sorted"] = timed(counter, alone, lambda: sorted(range(3_000_000, 0, -1)))
    _, out["control_sleep"] = timed(counter, alone, lambda: time.sleep(0.02))
    counter.stop = True
    counter.join()
    ag.release_dlist_handle(lh)
    ag.release_dlist_handle(rh)
    return out


def threads_part(ag: Any, remote: str, base: int, local: np.ndarray, descs: int, unit: int,
                 expect: np.ndarray, seconds: float) -> dict[str, Any]:
    """Thread A posts big READs into the first half of ``local``; thread B polls small READs into the second
    half and sends notifications, at the same time, on the same agent."""
    half = local.nbytes // 2
    errors: list[str] = []
    stats = {"big_reads": 0, "small_reads": 0, "notifs": 0, "bad_bytes": 0}
    stop = time.monotonic() + seconds
    small_ms: list[float] = []

    def reads(offset: int, n: int, key: str) -> None:
        loc = np.stack([local.ctypes.data + offset + np.arange(n, dtype=np.uint64)[::-1] * unit,
                        np.full(n, unit, np.uint64), np.zeros(n, np.uint64)], 1)
        rem = np.stack([np.uint64(base) + np.arange(n, dtype=np.uint64) * unit,
                        np.full(n, unit, np.uint64), np.zeros(n, np.uint64)], 1)
        want = expect[: n * unit].reshape(n, unit)[::-1].reshape(-1)
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            try:
                view = local[offset: offset + n * unit]
                view[:] = 0
                h = ag.initialize_xfer("READ", ag.get_xfer_descs(loc, "DRAM"), ag.get_xfer_descs(rem, "DRAM"),
                                       remote)
                state = ag.transfer(h)
                while state == "PROC":
                    state = ag.check_xfer_state(h)
                    if key == "small_reads":
                        ag.send_notif(remote, b"nt-notif")
                        stats["notifs"] += 1
                ag.release_xfer_handle(h)
                if state != "DONE":
                    errors.append(f"{key}: {state}")
                    return
                stats["bad_bytes"] += int(np.count_nonzero(view != want))
                stats[key] += 1
                if key == "small_reads":
                    small_ms.append((time.perf_counter() - t0) * 1e3)
            except Exception as exc:  # noqa: BLE001 - recorded: this is what the experiment asks
                errors.append(f"{key}: {type(exc).__name__}: {exc}")
                return

    a = threading.Thread(target=reads, args=(0, descs, "big_reads"))
    b = threading.Thread(target=reads, args=(half, 64, "small_reads"))
    a.start()
    b.start()
    a.join()
    b.join()
    lat = sorted(small_ms) or [float("nan")]
    return {**stats, "errors": errors[:5], "small_read_ms": {"p50": lat[len(lat) // 2],
            "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))], "max": lat[-1]}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--descs", type=int, default=20_000)
    ap.add_argument("--unit", type=int, default=2048, help="bytes per descriptor")
    ap.add_argument("--sync-mode", default="NONE", choices=["NONE", "STRICT", "RW"])
    ap.add_argument("--num-threads", type=int, default=0, help="the initiator's UCX worker threads")
    ap.add_argument("--threads-s", type=float, default=3.0, help="length of part 2 (0: skip)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    size = args.descs * args.unit
    target = subprocess.Popen([sys.executable, "-c", TARGET, str(size)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        md_hex, base = target.stdout.readline().split()  # type: ignore[union-attr]
        mode = getattr(nixl_thread_sync_t, f"NIXL_THREAD_SYNC_{args.sync_mode}")
        conf = nixl_agent_config(enable_prog_thread=False, backends=["UCX"], sync_mode=mode,
                                 num_threads=args.num_threads)
        ag = nixl_agent("nt-initiator", conf)
        local = np.zeros(2 * size, np.uint8)
        ag.register_memory(ag.get_reg_descs([(local.ctypes.data, local.nbytes, 0, "")], "DRAM"))
        remote = ag.add_remote_agent(bytes.fromhex(md_hex))
        remote = remote.decode() if isinstance(remote, bytes) else remote
        ag.make_connection(remote)
        time.sleep(0.5)
        expect = (np.arange(size, dtype=np.uint64) * 2654435761 % 1000003).astype(np.uint8)
        result: dict[str, Any] = {"descs": args.descs, "unit": args.unit, "sync_mode": args.sync_mode,
                                  "num_threads": args.num_threads}
        result["gil"] = gil_part(ag, remote, int(base), local, args.descs, args.unit)
        if args.threads_s > 0:
            result["threads"] = threads_part(ag, remote, int(base), local, args.descs, args.unit, expect,
                                             args.threads_s)
    finally:
        target.stdin.close()  # type: ignore[union-attr]
        target.wait(10)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
