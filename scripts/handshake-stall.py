#!/usr/bin/env python3
"""How long a new prefill's handshake holds the daemon's loop while another request's read is being posted.

CPU only, real processes: ``kv-sidecar serve`` (direct reads), a prefill emulator A holding scattered
requests (one descriptor per half page, many thousands a request: a post of tens of milliseconds on NIXL's
agent) and, each round, a fresh emulator B the daemon has never seen. A round pulls ``--a-pulls`` requests of
A back to back (their posts queue on the daemon's poster thread), waits ``--lead-ms`` so the first post has
begun, then pulls one block of B (a first handshake: NIXL loads B's agent) and
pings the daemon every ``--ping-ms`` until B's Done. Each Ping is answered on the loop, so the longest Pong
round trip of the round is how long the loop was held. Reported per round: that, A's posts and B's handshake
stage (from the Dones' timings).

Run it from two trees to compare them (the daemon is the one of the tree the script runs from):

    python3 scripts/handshake-stall.py --rounds 5 --out FILE
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import msgspec
import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sidecar.cli import spawn_serve  # noqa: E402
from sidecar.standins.emulator_control import spawn_emulator  # noqa: E402
from sidecar.wire import ipc  # noqa: E402
from sidecar.wire import protocol as p  # noqa: E402
from sidecar.wire.formats import PageFormat  # noqa: E402

LAYERS, HEADS, HEAD, BS = 8, 1, 64, 16
STD = PageFormat(kind="standard", layout="LBHNC", dtype="bfloat16", num_heads=HEADS, block_size=BS,
                 head_size=HEAD)
SHUF = PageFormat(kind="aiter_shuffled", layout="LHBNC", dtype="bfloat16", num_heads=HEADS, block_size=BS,
                  head_size=HEAD)
PLANE = BS * HEADS * HEAD  # elements of one block's K (or V) plane


def _emulator(blocks: int):
    return spawn_emulator(["--layers", str(LAYERS), "--heads", str(HEADS), "--head-size", str(HEAD),
                           "--block-size", str(BS), "--num-blocks", str(blocks), "--no-progress-thread"])


def _pull(kv: dict, req_id: str, local: list[int]) -> p.Pull:
    return p.Pull(req_id=req_id, remote_engine_id=kv["remote_engine_id"], remote_host=kv["remote_host"],
                  remote_port=kv["remote_port"], remote_request_id=kv["remote_request_id"],
                  remote_block_ids=p.pack_block_ids(kv["remote_block_ids"][0]),
                  local_block_ids=p.pack_block_ids(local), timeout_s=30.0,
                  remote_num_tokens=kv.get("remote_num_tokens"))


class DaemonSocket:
    """A DEALER speaking the daemon's protocol."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, msg: object) -> None:
        self.sock.send(p.encode(msg))

    def recv(self, timeout_s: float) -> object:
        if not self.sock.poll(int(timeout_s * 1000)):
            raise SystemExit(f"no reply from the daemon within {timeout_s} s")
        return p.decode_to_shim(self.sock.recv())

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _round(
    shim: DaemonSocket, emu_a, blocks: int, a_pulls: int, lead_ms: float, ping_ms: float, n: int
) -> dict:
    a = [emu_a.client.new_request(num_tokens=blocks * BS, order="random").kv_transfer_params
         for _ in range(a_pulls)]
    with _emulator(64) as emu_b:
        b = emu_b.client.new_request(num_tokens=BS).kv_transfer_params
        for i, kv in enumerate(a):
            shim.send(_pull(kv, f"a{n}.{i}", list(range(i * blocks, (i + 1) * blocks))))
        time.sleep(lead_ms / 1e3)
        shim.send(_pull(b, f"b{n}", [a_pulls * blocks]))
        sent: dict[int, float] = {}
        rtts: list[float] = []
        dones: dict[str, p.Done] = {}

        def take(msg: object) -> None:
            if isinstance(msg, p.Pong):
                rtts.append(time.perf_counter() - sent.pop(msg.nonce))
            elif isinstance(msg, p.Done):
                dones[msg.req_id] = msg

        nonce = 0
        deadline = time.monotonic() + 30
        while len(dones) < a_pulls + 1 and time.monotonic() < deadline:
            nonce += 1
            sent[nonce] = time.perf_counter()
            shim.send(p.Ping(nonce=nonce))
            end = time.perf_counter() + ping_ms / 1e3
            while (left := end - time.perf_counter()) > 0 and shim.sock.poll(max(1, round(left * 1e3))):
                take(shim.recv(1))
        while sent:  # the Pongs still out
            take(shim.recv(10))
    failed = [d for d in dones.values() if not d.ok]
    if len(dones) < a_pulls + 1 or failed:
        raise SystemExit(f"round {n}: {len(dones)} of {a_pulls + 1} answered, failed: {failed!r}")
    posts = [dones[f"a{n}.{i}"].timings["post"] for i in range(a_pulls)]
    return {
        "loop_held_ms_max": round(max(rtts) * 1e3, 3),
        "pong_ms_p50": round(statistics.median(rtts) * 1e3, 3),
        "pings": len(rtts),
        "a_post_ms": round(posts[0] * 1e3, 3) if a_pulls == 1 else [round(t * 1e3, 3) for t in posts],
        "b_handshake_ms": round(dones[f"b{n}"].timings.get("handshake", 0.0) * 1e3, 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=2048, help="blocks of each of A's requests (scattered)")
    ap.add_argument("--a-pulls", type=int, default=1, help="A's requests pulled back to back")
    ap.add_argument("--lead-ms", type=float, default=5.0, help="from A's Pull to B's")
    ap.add_argument("--ping-ms", type=float, default=1.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    local_blocks = args.a_pulls * args.blocks + 1
    layer_bytes = local_blocks * SHUF.page_bytes
    shm = ipc.create_shm_buffer(LAYERS * layer_bytes)
    remotes = json.dumps([{"match": "127.0.0.1:*", "page_format": msgspec.to_builtins(STD)}])
    with tempfile.TemporaryDirectory() as work, _emulator((args.a_pulls + 1) * args.blocks) as emu_a:
        endpoint = f"ipc://{work}/d.sock"
        serve = spawn_serve(["--socket", endpoint, "--metrics-port", "0", "--remotes", remotes,
                             "--pull-mode", "direct", "--handshake-timeout-s", "30"])
        shim = DaemonSocket(endpoint)
        try:
            shim.send(p.Hello(protocol_version=p.PROTOCOL_VERSION, package_version="bench"))
            assert isinstance(shim.recv(30), p.Welcome)
            layers = [ipc.LayerView(name=f"model.layers.{i}.self_attn.attn", buffer_index=0,
                                    offset_bytes=i * layer_bytes, shape=[local_blocks, 2, BS, HEADS * HEAD],
                                    strides=[PLANE, local_blocks * PLANE, HEADS * HEAD, 1], dtype="bfloat16")
                      for i in range(LAYERS)]
            shim.send(p.RegisterCaches(buffers=[shm.description], layers=layers, page_format=SHUF,
                                       compat_factors=dict(emu_a.ready.compat_factors)))
            assert isinstance(shim.recv(60), p.Registered)
            warm = emu_a.client.new_request(num_tokens=BS).kv_transfer_params  # A's handshake, cached
            shim.send(_pull(warm, "warm", [0]))
            assert shim.recv(30).ok
            rounds = [_round(shim, emu_a, args.blocks, args.a_pulls, args.lead_ms, args.ping_ms, n)
                      for n in range(args.rounds)]
        finally:
            shim.close()
            serve.stop()
            shm.close()
    result = {
        "command": " ".join(["python3", *sys.argv]),
        "host_cpus": os.cpu_count(),
        "a_pulls": args.a_pulls,
        "a_descriptors": LAYERS * args.blocks * 2,  # each of A's requests
        "rounds": rounds,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
