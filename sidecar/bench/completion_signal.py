"""``kv-sidecar bench signal``: how long a Done takes from the daemon's send to the shim's receiving thread.

Real processes: a prefill emulator (NIXL over UCX), ``kv-sidecar serve`` (the CPU twin), and in this process
the shim's own client (``vllm_glue.client.SidecarClient``: a DEALER on a background I/O thread that stamps
``time.monotonic_ns()`` when a reply arrives) over K/V planes in /dev/shm. ``--concurrency`` Pulls are kept in
flight (each a real read + conversion), so the signal is measured under load. The daemon stamps
``Done.sent_at_ns`` (monotonic, same host, same clock) just before the socket send; signal latency is
``received_at_ns - sent_at_ns``. Each channel in ``--channels`` gets its own daemon and prefill, one after the
other in this run: the completion socket (the default) and ZMQ alone (``fast_completions = false``), so their
ratio is measured side by side. Prints (and with ``--json`` writes) one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from typing import Any

import msgspec
import numpy as np

from sidecar import __version__
from sidecar.bench.e2e_common import BenchError, daemon_settings, toml_values
from sidecar.wire import ipc
from sidecar.wire import protocol as p
from sidecar.wire.formats import PageFormat

GOAL_P50_US = 100.0
GOAL_P99_US = 1000.0
CHANNELS = ("completion_socket", "zmq")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pulls", type=int, default=2000, help="Pulls measured (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=50, help="Pulls before measuring (handshake, caches)")
    parser.add_argument("--concurrency", type=int, default=32, help="Pulls kept in flight")
    parser.add_argument("--blocks", type=int, default=1, help="blocks per Pull (0: notification only)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        metavar="S",
        help="sys.setswitchinterval for this process (the shim's): how long the receiving "
        "thread may wait for the GIL held by the engine thread (Python's default 0.005)",
    )
    parser.add_argument(
        "--prefill-nice",
        type=int,
        default=10,
        metavar="N",
        help="nice value for the prefill emulator's threads: in production the prefill runs on "
        "another host, here it shares the cores (its NIXL progress thread spins) (default 10)",
    )
    parser.add_argument(
        "--prefill-progress-thread",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run the prefill emulator's NIXL progress thread, as a stock vLLM prefill does. It spins a "
        "core; on a decoder host the prefill is on another machine, so by default the stand-in drives NIXL "
        "from its loop instead and the load measured is the daemon's and the shim's own (default off)",
    )
    parser.add_argument(
        "--channels",
        default=",".join(CHANNELS),
        help="reply channels to measure, in this order: completion_socket (the daemon's default) and/or zmq "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs per channel; percentiles are medians over the runs"
    )
    parser.add_argument(
        "--idle-s",
        type=float,
        default=2.0,
        help="before the Pulls, how long the registered daemon's idle CPU is measured (s)",
    )
    parser.add_argument(
        "--daemon-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra daemon config (TOML value), e.g. poll_busy_s=0 or log_level='\"DEBUG\"'; repeatable",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the result here")


def _percentiles(values_ns: list[int]) -> dict[str, float]:
    a = np.asarray(values_ns, dtype=np.float64) / 1e3
    if a.size == 0:
        return {}
    return {
        "p50": round(float(np.percentile(a, 50)), 1),
        "p90": round(float(np.percentile(a, 90)), 1),
        "p99": round(float(np.percentile(a, 99)), 1),
        "p99.9": round(float(np.percentile(a, 99.9)), 1),
        "max": round(float(a.max()), 1),
        "mean": round(float(a.mean()), 1),
    }


def _renice(pid: int, nice: int) -> None:
    """setpriority on every thread of ``pid`` (on Linux PRIO_PROCESS with a pid reaches one thread only)."""
    if not nice:
        return
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)


def _new_request(client: Any, tokens: int) -> dict[str, Any]:
    """A finished prefill; if the emulator has not yet freed earlier requests' blocks, retry briefly."""
    from sidecar.standins.emulator_control import ControlError

    deadline = time.monotonic() + 10
    while True:
        try:
            return client.new_request(num_tokens=tokens).kv_transfer_params
        except ControlError as exc:
            if exc.field != "num_blocks" or time.monotonic() > deadline:
                raise
            time.sleep(0.001)


def serve_flags(items: list[str]) -> list[str]:
    """``--daemon-set KEY=VALUE`` settings (TOML values, as every bench takes them) as ``kv-sidecar serve``
    flags, whose values are strings as they are and JSON otherwise."""
    out: list[str] = []
    for key, value in toml_values(daemon_settings(items)).items():
        text = value if isinstance(value, str) else msgspec.json.encode(value).decode()
        out += ["--" + key.replace("_", "-"), text]
    return out


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _own_args() -> list[str]:
    """This benchmark's arguments, whether started as ``kv-sidecar bench signal`` or ``python -m``."""
    argv = sys.argv[1:]
    return argv[2:] if argv[:2] == ["bench", "signal"] else argv


def run(args: argparse.Namespace) -> int:
    channels = [c.strip() for c in args.channels.split(",") if c.strip()]
    unknown = sorted(set(channels) - set(CHANNELS))
    if unknown or not channels:
        raise SystemExit(f"--channels: unknown {unknown or 'empty'}; choose from {', '.join(CHANNELS)}")
    try:
        daemon_flags = serve_flags(args.daemon_set)
    except BenchError as exc:
        raise SystemExit(str(exc)) from None
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in channels}
    for _ in range(args.repeat):  # interleaved, so a drifting host load touches every channel alike
        for c in channels:
            runs[c].append(_measure(args, c, daemon_flags))
    measured = {c: _summary(r) for c, r in runs.items()}
    sig = measured[channels[0]]["signal_us"]
    result: dict[str, Any] = {
        "bench": "signal",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": f"CPU ({os.cpu_count()} threads), {platform.processor() or platform.machine()}",
        "command": " ".join(["kv-sidecar bench signal", *_own_args()]),
        "client": "vllm_glue.client.SidecarClient (its I/O thread stamps each reply on arrival)",
        "warmup": args.warmup,
        "concurrency": args.concurrency,
        "blocks_per_pull": args.blocks,
        "layers": args.layers,
        "repeat": args.repeat,
        "channel": channels[0],
        "signal_us": sig,
        "channels": measured,
        "goal": {
            "p50_us": GOAL_P50_US,
            "p99_us": GOAL_P99_US,
            "met": bool(sig) and sig["p50"] <= GOAL_P50_US and sig["p99"] <= GOAL_P99_US,
        },
        "gil_switch_interval_s": sys.getswitchinterval(),
        "prefill_nice": args.prefill_nice,
        "prefill_progress_thread": args.prefill_progress_thread,
        "host_cpus": os.cpu_count(),
        "load_average_1m_after": round(os.getloadavg()[0], 2),
    }
    if set(CHANNELS) <= measured.keys():
        fast, zmq_only = (measured[c]["signal_us"] for c in CHANNELS)
        result["zmq_over_completion_socket"] = {
            k: round(zmq_only[k] / fast[k], 2) for k in ("p50", "p99") if fast.get(k)
        }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if not any(m["failed"] for m in measured.values()) else 1


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each latency percentile as the median over the runs (and every run as measured)."""
    out: dict[str, Any] = {"failed": sum(r["failed"] for r in runs)}
    for key in ("signal_us", "pull_round_trip_us", "daemon_end_to_end_us", "delivery_us"):
        out[key] = {q: round(float(np.median([r[key][q] for r in runs])), 1) for q in runs[0][key]}
    out["runs"] = runs
    return out


def _measure(args: argparse.Namespace, channel: str, daemon_flags: list[str]) -> dict[str, Any]:
    """One daemon and prefill, ``args.pulls`` Pulls with replies over ``channel``; its latencies."""
    from sidecar.cli import spawn_serve
    from sidecar.standins.emulator_control import spawn_emulator
    from vllm_glue.client import Reply, SidecarClient

    n, h, d, layers = args.block_size, args.heads, args.head_size, args.layers
    remote = PageFormat(
        kind="standard", layout="LBHNC", dtype="bfloat16", num_heads=h, block_size=n, head_size=d
    )
    local = PageFormat(
        kind="aiter_shuffled", layout="LHBNC", dtype="bfloat16", num_heads=h, block_size=n, head_size=d
    )
    per_pull = max(args.blocks, 1)
    decoder_blocks = args.concurrency * per_pull + 1
    # the emulator frees a request's blocks when it polls the notification, a little after our Done
    prefill_blocks = 8 * args.concurrency * per_pull + 64
    plane = n * h * d
    workdir = tempfile.mkdtemp(prefix="kv-sidecar-bench-")
    endpoint = f"ipc://{workdir}/daemon.sock"
    remotes = json.dumps([{"match": "127.0.0.1:*", "page_format": msgspec.to_builtins(remote)}])
    emu = spawn_emulator(
        [
            "--layers",
            str(layers),
            "--heads",
            str(h),
            "--head-size",
            str(d),
            "--block-size",
            str(n),
            "--num-blocks",
            str(prefill_blocks),
            *([] if args.prefill_progress_thread else ["--no-progress-thread"]),
        ]
    )
    _renice(emu.proc.pid, args.prefill_nice)
    daemon = spawn_serve(
        [
            "--socket",
            endpoint,
            "--metrics-port",
            "-1",
            "--remotes",
            remotes,
            "--max-inflight",
            str(args.concurrency),
            "--log-level",
            "WARNING",
            "--fast-completions",
            "true" if channel == "completion_socket" else "false",
            *daemon_flags,
        ]
    )
    shm = ipc.create_shm_buffer(layers * 2 * decoder_blocks * plane * 2)
    views = [
        ipc.LayerView(
            name=f"model.layers.{i}.self_attn.attn",
            buffer_index=0,
            offset_bytes=i * 2 * decoder_blocks * plane * 2,
            shape=[decoder_blocks, 2, n, h * d],
            strides=[plane, decoder_blocks * plane, h * d, 1],
            dtype="bfloat16",
        )
        for i in range(layers)
    ]
    hello = p.Hello(protocol_version=p.PROTOCOL_VERSION, package_version=__version__, pid=os.getpid())
    register = p.RegisterCaches(
        buffers=[shm.description],
        layers=views,
        page_format=local,
        compat_factors=dict(emu.ready.compat_factors),
    )
    client = SidecarClient(endpoint, hello, register)
    signal_ns: list[int] = []
    round_trip_ns: list[int] = []
    delivery_ns: list[int] = []
    daemon_e2e_s: list[float] = []
    failures: list[str] = []
    try:
        if not client.wait_ready(60):
            raise RuntimeError(f"client not ready: {client.status_reason}")
        if client.uses_completion_socket != (channel == "completion_socket"):
            raise RuntimeError(f"the daemon did not set up the {channel} channel")
        free = list(range(1, decoder_blocks))  # block 0 stays unused
        idle0, t_idle = _cpu_s(daemon.proc.pid), time.monotonic()
        time.sleep(args.idle_s)
        idle_pct = 100 * (_cpu_s(daemon.proc.pid) - idle0) / (time.monotonic() - t_idle)
        cpu0 = {
            "daemon": _cpu_s(daemon.proc.pid),
            "prefill_emulator": _cpu_s(emu.proc.pid),
            "shim": _cpu_s(os.getpid()),
        }
        outstanding: dict[str, tuple[int, list[int]]] = {}
        total = args.warmup + args.pulls
        sent = done = 0
        t_start = time.monotonic()
        while done < total:
            while sent < total and len(outstanding) < args.concurrency:
                blocks = [free.pop() for _ in range(args.blocks)]
                kv = _new_request(emu.client, per_pull * n)
                req_id = f"sig-{sent}"
                pull = p.Pull(
                    req_id=req_id,
                    remote_engine_id=kv["remote_engine_id"],
                    remote_host=kv["remote_host"],
                    remote_port=kv["remote_port"],
                    remote_request_id=kv["remote_request_id"],
                    remote_block_ids=p.pack_block_ids(kv["remote_block_ids"][0]),
                    local_block_ids=p.pack_block_ids(blocks),
                    timeout_s=30.0,
                    remote_registration_generation=kv["remote_registration_generation"],
                    remote_num_tokens=kv["remote_num_tokens"],
                    lease_started_at_ns=time.monotonic_ns(),
                )
                outstanding[req_id] = (time.monotonic_ns(), blocks)
                client.send(pull)
                sent += 1
            events = client.poll_events()
            if not events:
                time.sleep(0.001)  # the receive stamps are taken on the client's thread, not here
                continue
            for ev in events:
                if not isinstance(ev, Reply):
                    raise RuntimeError(f"lost the daemon: {ev.reason}")
                msg = ev.message
                if not isinstance(msg, p.Done) or msg.req_id not in outstanding:
                    continue
                t_sent, blocks = outstanding.pop(msg.req_id)
                free.extend(blocks)
                done += 1
                if not msg.ok:
                    failures.append(f"{msg.req_id}: {msg.reason}")
                if done > args.warmup and msg.sent_at_ns:
                    signal_ns.append(ev.received_at_ns - msg.sent_at_ns)
                    round_trip_ns.append(ev.received_at_ns - t_sent)
                    daemon_e2e_s.append(msg.timings.get("end_to_end", 0.0))
                    if "delivery" in msg.timings:
                        delivery_ns.append(int(msg.timings["delivery"] * 1e9))
        wall = time.monotonic() - t_start
        cpu = {
            "daemon": _cpu_s(daemon.proc.pid) - cpu0["daemon"],
            "prefill_emulator": _cpu_s(emu.proc.pid) - cpu0["prefill_emulator"],
            "shim_and_bench": _cpu_s(os.getpid()) - cpu0["shim"],
        }
    finally:
        client.close()
        daemon.stop()
        emu.stop()
        shm.close()
    return {
        "pulls": len(signal_ns),
        "page_bytes": remote.page_bytes,
        "failed": len(failures),
        "failures_sample": failures[:5],
        "signal_us": _percentiles(signal_ns),
        "pull_round_trip_us": _percentiles(round_trip_ns),
        "daemon_end_to_end_us": _percentiles([int(s * 1e9) for s in daemon_e2e_s]),
        "delivery_us": _percentiles(delivery_ns),
        "daemon_idle_cpu_pct": round(idle_pct, 2),
        "pulls_per_s": round(total / wall, 1),
        "cpu_cores_busy": {k: round(v / wall, 2) for k, v in cpu.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kv-sidecar bench signal", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
