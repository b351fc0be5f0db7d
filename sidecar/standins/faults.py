"""A fault-injection rig: real prefill emulator, real ``kv-sidecar serve``, decoder stand-in, canary.

The e2e fault matrix (``tests/e2e/faults/``) and the soak (``kv-sidecar bench soak``) drive it. The decoder is
this process (a :class:`~sidecar.standins.decoder.DecoderStandin`); the prefill and the daemon are
subprocesses that can be killed (SIGKILL), restarted (same side-channel port and engine id, or new ones) and
signalled at any point of a batch.

Canary: every decoder byte starts as ``CANARY``. A request's blocks are checked bit for bit when it succeeds;
whatever the outcome, they are painted with the canary again the moment the shim hands them back (as vLLM
would reuse them). So at the end the whole buffer must be canary again: a byte that is not was written after
its request ended (a late or foreign write), or by a pull nobody asked for.
"""

from __future__ import annotations

import os
import random
import resource
import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sidecar.standins.decoder import DecoderStandin, StandinShape, mismatched_blocks
from sidecar.wire.formats import STANDARD, PageFormat
from vllm_glue.orders import PullOrder, parse_remote

CANARY = 0xA5
LAYERS, HEADS, HEAD_SIZE, BLOCK = 2, 2, 128, 16
SHAPE = StandinShape(layers=LAYERS, heads=HEADS, head_size=HEAD_SIZE, block_size=BLOCK, num_blocks=512)
REMOTE_FMT = PageFormat(
    kind=STANDARD, layout="LBHNC", dtype="bfloat16", num_heads=HEADS, block_size=BLOCK, head_size=HEAD_SIZE
)
ENV = {"UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN", "UCX_LOG_LEVEL": "error"}
SEED = 0  # the emulator's page seed: the expected bytes of every request follow from it

# Reason text -> cause, first match wins (the shim's and the daemon's wording).
_CAUSES = (
    ("remote agent", "prefill"),  # NIXL's words for the prefill's agent going away
    ("shutting down", "daemon_restart"),
    ("exited", "daemon_gone"),
    ("disconnected", "daemon_gone"),
    ("connection was lost", "daemon_gone"),
    ("kv-sidecar at", "daemon_unavailable"),
    ("not registered", "daemon_unavailable"),
    ("deadline", "deadline"),
    ("abort", "aborted"),
    ("handshake", "prefill"),
    ("transfer", "prefill"),
    ("prefill", "prefill"),
    ("lease", "lease"),
    ("refused", "refused"),
)


def cause_of(reason: str | None) -> str:
    text = (reason or "").lower()
    return next((c for key, c in _CAUSES if key in text), "other")


@dataclass
class BatchResult:
    """How each pull of a batch ended: ok (bit-exact), failed with a reason, aborted, or never answered."""

    ok: int = 0
    failed: dict[str, str] = field(default_factory=dict)  # req_id -> reason
    aborted: int = 0
    unanswered: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    fault_s: float | None = None  # when the fault hit, seconds after the batch's first pull
    answered_after_fault_s: float | None = None  # when the last pull in flight at the fault was answered

    @property
    def causes(self) -> dict[str, int]:
        return dict(Counter(cause_of(r) for r in self.failed.values()))

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "failed": len(self.failed), "aborted": self.aborted, "causes": self.causes,
                "unanswered": self.unanswered, "mismatched": self.mismatched, "fault_s": self.fault_s,
                "answered_after_fault_s": self.answered_after_fault_s}


def process_stats(pid: int) -> dict[str, int]:
    """RSS (bytes) and open fds of a live process, from /proc."""
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return {"rss": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


class Rig:
    """One emulator, one daemon, one in-process decoder, all restartable; see the module docstring."""

    def __init__(self, work: str, *, daemon_extra: str = "", shape: StandinShape = SHAPE,
                 daemon_nofile: int | None = None) -> None:
        self.work = work
        self.shape = shape
        self.daemon_extra = daemon_extra
        self.daemon_nofile = daemon_nofile
        self.socket = f"ipc://{work}/d.sock"
        self.emulator_ready_file = os.path.join(work, "emu-ready.json")
        self.emu: Any = None
        self.daemon: Any = None
        self.decoder: DecoderStandin | None = None
        self._rng = random.Random(7)
        self._n = 0

    # ------------------------------------------------------------------------------------------- processes

    def start_emulator(self, *, port: int = 0, engine_id: str = "") -> Any:
        from sidecar.standins.emulator_control import spawn_emulator

        args = ["--layers", str(LAYERS), "--heads", str(HEADS), "--head-size", str(HEAD_SIZE),
                "--block-size", str(BLOCK), "--num-blocks", "4096", "--seed", str(SEED),
                "--control", f"ipc://{self.work}/emu-{uuid.uuid4().hex[:8]}.sock", "--no-progress-thread",
                "--port", str(port), "--ready-file", self.emulator_ready_file]
        if engine_id:
            args += ["--engine-id", engine_id]
        self.emu = spawn_emulator(args, 60.0, ENV)
        return self.emu

    def restart_emulator(self, *, same: bool = True) -> Any:
        """A new emulator process: on the same side-channel port and engine id, or on fresh ones."""
        old = self.emu.ready
        if self.emu.proc.poll() is None:
            self.emu.stop()
        return self.start_emulator(port=old.side_channel_port if same else 0,
                                   engine_id=old.engine_id if same else "")

    def kill_emulator(self) -> None:
        self.emu.kill()

    def start_daemon(self) -> Any:
        from sidecar.cli import spawn_serve

        fmt = REMOTE_FMT
        lines = [f'socket = "{self.socket}"', "metrics_port = 0", 'log_level = "INFO"', self.daemon_extra, "",
                 "[[remotes]]", 'match = "127.0.0.1:*"',
                 f'page_format = {{kind = "{fmt.kind}", layout = "{fmt.layout}", dtype = "{fmt.dtype}", '
                 f"num_heads = {fmt.num_heads}, block_size = {fmt.block_size}, head_size = {fmt.head_size}}}"]
        path = os.path.join(self.work, "d.toml")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(self.work, "d.log"), "ab") as log:
            self.daemon = spawn_serve(["--config", path], timeout_s=60.0, env=ENV, stderr=log)
        if self.daemon_nofile is not None:
            # set on the running daemon, hard limit too: it raises its soft limit to the hard one at start,
            # so a limit it inherited would never bite
            limit = self.daemon_nofile
            resource.prlimit(self.daemon.proc.pid, resource.RLIMIT_NOFILE, (limit, limit))
        return self.daemon

    def kill_daemon(self) -> None:
        self.daemon.proc.kill()
        self.daemon.proc.wait()

    def restart_daemon(self) -> Any:
        if self.daemon.proc.poll() is None:
            self.daemon.stop()
        return self.start_daemon()

    def daemon_stats(self) -> dict[str, int]:
        return process_stats(self.daemon.proc.pid)

    def daemon_log(self, lines: int = 40) -> str:
        try:
            with open(os.path.join(self.work, "d.log"), errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    # ------------------------------------------------------------------------------------------- decoder

    def start_decoder(
        self, *, register_timeout_s: float = 30.0, pull_timeout_s: float = 20.0
    ) -> DecoderStandin:
        """A fresh decoder, every byte painted with the canary, registered with the daemon."""
        factors = dict(self.emu.ready.compat_factors)
        self.decoder = DecoderStandin(self.socket, self.shape, compat_factors=factors,
                                      register_timeout_s=register_timeout_s, pull_timeout_s=pull_timeout_s)
        self.decoder.buffer.tensor.fill_(CANARY)
        if not self.decoder.register():
            raise RuntimeError(f"decoder not registered: {self.decoder.worker.client.status_reason}")
        return self.decoder

    def wait_ready(self, timeout_s: float = 20.0) -> bool:
        """Until the decoder's shim is registered again (after a daemon restart)."""
        assert self.decoder is not None and self.decoder.worker.client is not None
        return self.decoder.worker.client.wait_ready(timeout_s)

    def _paint(self, blocks: list[int]) -> None:
        import torch

        for layer in range(self.shape.layers):
            for plane in (self.decoder.k_plane(layer), self.decoder.v_plane(layer)):
                for b in blocks:
                    plane[b].view(torch.uint8).fill_(CANARY)

    def canary_violations(self) -> list[str]:
        """Every (layer, block, plane) holding a byte that is not the canary (call with no request open)."""
        import torch

        bad = []
        for layer in range(self.shape.layers):
            for name, plane in (("K", self.decoder.k_plane(layer)), ("V", self.decoder.v_plane(layer))):
                rows = (plane.contiguous().view(torch.uint8).view(self.shape.num_blocks, -1) != CANARY)
                for b in rows.any(dim=1).nonzero().flatten().tolist():
                    bad.append(f"layer {layer} block {b} {name} plane")
        return bad

    def stop_writers(self) -> None:
        """Stop the daemon and the emulator (both stops are idempotent): after this nothing can write into
        the decoder, so a canary check then sees every late write, however late."""
        if self.daemon is not None:
            self.daemon.stop()
        if self.emu is not None:
            self.emu.stop()

    def close(self) -> None:
        """Stop whatever is running: the decoder, then the daemon, then the emulator."""
        if self.decoder is not None:
            self.decoder.close()
        self.stop_writers()

    # ------------------------------------------------------------------------------------------- load

    def batch(
        self,
        n: int,
        *,
        wave: int = 8,
        fault: Callable[[], None] | None = None,
        fault_after_wave: int = 1,
        between_waves: Callable[[int], None] | None = None,
        abort_fraction: float = 0.0,
        tokens: tuple[int, int] = (1, 120),
        timeout_s: float = 40.0,
        new_kw: dict[str, Any] | None = None,
    ) -> BatchResult:
        """Create ``n`` requests at the prefill, pull them ``wave`` at a time without waiting between waves
        (so several waves are in flight), call ``fault`` right after wave ``fault_after_wave`` went out, then
        wait for every answer. Each success is checked bit for bit; every request's blocks are painted with
        the canary again when the shim hands them back. ``new_kw``: the prefill's block order (``order``,
        ``density``) for every request."""
        dec = self.decoder
        assert dec is not None
        pending: dict[str, tuple[PullOrder, Any]] = {}
        for _ in range(n):
            self._n += 1
            reply = self.emu.client.new_request(num_tokens=self._rng.randint(*tokens), **(new_kw or {}))
            local = dec.allocate(len(reply.kernel_block_ids))
            order = PullOrder(f"f{self._n}", parse_remote(reply.kv_transfer_params), local, True,
                              time.monotonic_ns())
            pending[order.req_id] = (order, reply)
        res = BatchResult()
        orders = [o for o, _ in pending.values()]
        t0 = time.monotonic()
        in_flight_at_fault: set[str] = set()
        left = set(pending)
        deadline = t0 + timeout_s
        for i in range(0, len(orders), wave):
            chunk = orders[i : i + wave]
            aborts = [o.req_id for o in orders[max(0, i - wave) : i] if o.req_id in left
                      and self._rng.random() < abort_fraction]
            dec.pull(chunk, aborts)
            self._collect(pending, left, res)
            if between_waves is not None:
                between_waves(i // wave)
            if fault is not None and i // wave + 1 == fault_after_wave:
                in_flight_at_fault = set(left)
                res.fault_s = time.monotonic() - t0
                fault()
        while left and time.monotonic() < deadline:
            self._collect(pending, left, res)
            if in_flight_at_fault and res.answered_after_fault_s is None and not in_flight_at_fault & left:
                res.answered_after_fault_s = time.monotonic() - t0 - (res.fault_s or 0.0)
            time.sleep(0.002)
        if in_flight_at_fault and res.answered_after_fault_s is None and not in_flight_at_fault & left:
            res.answered_after_fault_s = time.monotonic() - t0 - (res.fault_s or 0.0)
        res.unanswered = sorted(left)
        return res

    def _collect(self, pending: dict[str, tuple[PullOrder, Any]], left: set[str], res: BatchResult) -> None:
        dec = self.decoder
        dec.worker.collect()
        results = dec.worker.tracker.take_results()
        dec.worker.load_errors()
        outcomes = {o.req_id: o for o in dec.worker.tracker.outcomes}
        dec.worker.tracker.outcomes.clear()
        for req_id in results.finished:
            if req_id not in left:
                continue
            left.discard(req_id)
            order, reply = pending[req_id]
            out = outcomes.get(req_id)
            if out is not None and out.ok:
                bad = mismatched_blocks(dec, reply, order.local_block_ids, SEED, REMOTE_FMT)
                res.mismatched += [f"{req_id}: {b}" for b in bad]
                res.ok += 1
            elif req_id in results.failed:
                res.failed[req_id] = out.reason if out is not None else "failed (no outcome)"
            else:
                res.aborted += 1
            self._paint(order.local_block_ids)  # handed back to "vLLM": reused from now on
            dec.release(order.local_block_ids)


def send_signal(pid: int, signum: int = signal.SIGHUP) -> None:
    os.kill(pid, signum)


def loop_decoder(socket: str, emulator_ready_file: str) -> int:
    """A decoder that pulls batches of 16 until it is killed (the victim of a decoder kill -9)."""
    import msgspec

    from sidecar.standins.decoder import run_session
    from sidecar.standins.emulator_control import EmulatorClient, ReadyInfo

    with open(emulator_ready_file, "rb") as f:
        ready = msgspec.json.decode(f.read().strip(), type=ReadyInfo)
    emulator = EmulatorClient(ready.control)
    with DecoderStandin(socket, SHAPE, compat_factors=dict(ready.compat_factors)) as standin:
        if not standin.register():
            return 1
        print("registered", flush=True)
        for i in range(1, 1 << 30):
            run_session(standin, emulator, requests=16, seed=SEED, remote_fmt=REMOTE_FMT, tokens=(1, 120),
                        rng_seed=i, verify=False)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(loop_decoder(sys.argv[1], sys.argv[2]))
