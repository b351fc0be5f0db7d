"""The floor under `kv-sidecar bench signal`: one-way latency of a bare pyzmq ROUTER→DEALER message over ipc://
versus a bare AF_UNIX SOCK_SEQPACKET, between two processes on this host, receiver blocked as the shim's is.

    python sidecar/bench/ipc_floor.py [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import platform
import socket
import sys
import tempfile
import time

from sidecar.bench.output import emit

N = 3000


def _zmq_server(addr: str) -> None:
    import zmq

    s = zmq.Context().socket(zmq.ROUTER)
    s.bind(addr)
    for _ in range(N):
        ident, _msg = s.recv_multipart()
        time.sleep(0.0005)  # let the receiver block, as the shim's thread does between Dones
        s.send_multipart([ident, str(time.monotonic_ns()).encode()])


def _unix_server(path: str) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(path)
    s.listen(1)
    c, _ = s.accept()
    for _ in range(N):
        c.recv(16)
        time.sleep(0.0005)
        c.send(str(time.monotonic_ns()).encode())


def _percentiles(us: list[float]) -> dict[str, float]:
    us.sort()
    return {"p50": round(us[len(us) // 2], 1), "p99": round(us[int(len(us) * 0.99)], 1)}


def zmq_floor(work: str) -> dict[str, float]:
    import zmq

    addr = f"ipc://{work}/floor.sock"
    server = mp.Process(target=_zmq_server, args=(addr,))
    server.start()
    d = zmq.Context().socket(zmq.DEALER)
    d.connect(addr)
    poller = zmq.Poller()
    poller.register(d, zmq.POLLIN)
    lat = []
    for _ in range(N):
        d.send(b"x")
        poller.poll(5000)
        sent = int(d.recv())
        lat.append((time.monotonic_ns() - sent) / 1000)
    server.join()
    return _percentiles(lat)


def unix_floor(work: str) -> dict[str, float]:
    path = f"{work}/floor.unix"
    server = mp.Process(target=_unix_server, args=(path,))
    server.start()
    c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for _ in range(500):
        try:
            c.connect(path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            time.sleep(0.01)
    lat = []
    for _ in range(N):
        c.send(b"x")
        sent = int(c.recv(64))
        lat.append((time.monotonic_ns() - sent) / 1000)
    server.join()
    return _percentiles(lat)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        result = {
            "bench": "ipc_floor",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": f"CPU ({os.cpu_count()} threads), {platform.machine()}",
            "command": " ".join(["python sidecar/bench/ipc_floor.py", *sys.argv[1:]]),
            "messages": N,
            "zmq_ipc_us": zmq_floor(work),
            "unix_seqpacket_us": unix_floor(work),
        }
    emit(result, args.out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
