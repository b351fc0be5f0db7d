"""Control channel of the prefill emulator: msgspec-typed messages, a blocking client, a subprocess launcher.

This is a test/operator side door, not part of vLLM's wire: it asks the emulator to "finish a prefill"
(returning exactly the kv_transfer_params a stock prefill returns) and reports what the emulator saw.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from typing import Any, Literal

import msgspec
import zmq

RequestState = Literal["pending", "freed_by_notif", "expired_and_reused"]


# --- requests ---


class NewRequest(msgspec.Struct, tag="new_request", kw_only=True, forbid_unknown_fields=True):
    """Finish a prefill of ``num_tokens`` (or ``num_blocks`` full logical blocks) and hold its blocks."""

    num_tokens: int | None = None
    num_blocks: int | None = None
    external_id: str | None = None
    # "random": blocks drawn from the free pool in random order (scattered, unsorted); "ascending": sorted;
    # "contiguous": the lowest free ids in order (a fresh vLLM free queue: adjacent blocks, runs merge);
    # "churn": what vLLM's free queue hands out after a busy engine's churn (sidecar.bench.block_orders).
    order: Literal["random", "ascending", "contiguous", "churn"] = "random"
    # With "ascending" or "contiguous": the blocks fill this share of their span (1.0: no gaps).
    density: float = 1.0
    # Test knob: this request's lease instead of the emulator's --lease.
    lease_s: float | None = None


class RequestStatus(msgspec.Struct, tag="status", forbid_unknown_fields=True):
    request_id: str


class Stats(msgspec.Struct, tag="stats", forbid_unknown_fields=True):
    pass


class Shutdown(msgspec.Struct, tag="shutdown", forbid_unknown_fields=True):
    pass


ControlRequest = NewRequest | RequestStatus | Stats | Shutdown


# --- replies ---


class NewRequestReply(msgspec.Struct, tag="new_request_reply"):
    kv_transfer_params: dict[str, Any]
    # Generation of each kernel block of remote_block_ids[0] (kernel order), for expected_page.
    kernel_block_ids: list[int]
    block_generations: list[int]
    num_tokens: int


class RequestStatusReply(msgspec.Struct, tag="status_reply"):
    request_id: str
    state: RequestState
    # Per prefill TP rank: notifications counted so far, and the N they announced (0 before the first).
    notif_counts: list[int]
    expected_n: list[int]
    ranks_done: list[bool]
    heartbeats: int
    late_notifications: int
    lease_deadlines_s: list[float]  # seconds from now, per rank (negative once expired)


class StatsReply(msgspec.Struct, tag="stats_reply"):
    handshakes_served: int = 0
    handshake_wrong_tag: int = 0
    malformed_handshakes: int = 0
    notifications: int = 0
    malformed_notifications: int = 0
    late_notifications: int = 0
    inconsistent_n: int = 0
    heartbeats: int = 0
    heartbeat_unknown_ids: int = 0
    requests_created: int = 0
    requests_freed_by_notif: int = 0
    requests_expired: int = 0
    blocks_reused: int = 0
    free_blocks: int = 0
    malformed_samples: list[str] = []


class Ack(msgspec.Struct, tag="ack"):
    pass


class ErrorReply(msgspec.Struct, tag="error"):
    field: str
    reason: str


ControlReply = NewRequestReply | RequestStatusReply | StatsReply | Ack | ErrorReply

REQUEST_DECODER = msgspec.msgpack.Decoder(ControlRequest)
REPLY_DECODER = msgspec.msgpack.Decoder(ControlReply)
ENCODER = msgspec.msgpack.Encoder()


class ReadyInfo(msgspec.Struct, frozen=True):
    """The one JSON line the emulator prints on stdout (and writes to --ready-file) once it serves."""

    event: Literal["ready"]
    pid: int
    side_channel_host: str
    side_channel_port: int
    control: str
    engine_id: str
    connector_version: int
    tp_size: int
    compatibility_hash: str
    compat_factors: dict[str, Any]


class ControlError(RuntimeError):
    """The emulator refused a control request, or did not answer in time."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


# --- client ---


class EmulatorClient:
    """Blocking REQ client of the control channel; one outstanding request at a time."""

    def __init__(self, address: str, timeout_s: float = 10.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.address)
            self._sock = sock
        return self._sock

    def call(self, request: ControlRequest, timeout_s: float | None = None) -> ControlReply:
        """One request and its reply, waited for ``timeout_s`` (default: the client's)."""
        sock = self._socket()
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        sock.setsockopt(zmq.RCVTIMEO, int(wait_s * 1000))
        sock.send(ENCODER.encode(request))
        try:
            reply = REPLY_DECODER.decode(sock.recv())
        except zmq.Again:
            self.close()  # a REQ that missed its reply cannot send again
            raise ControlError("control", f"no reply from {self.address} within {wait_s} s") from None
        if isinstance(reply, ErrorReply):
            raise ControlError(reply.field, reply.reason)
        return reply

    def new_request(self, num_tokens: int | None = None, **kw: Any) -> NewRequestReply:
        return self.call(NewRequest(num_tokens=num_tokens, **kw))

    def status(self, request_id: str) -> RequestStatusReply:
        return self.call(RequestStatus(request_id))

    def stats(self) -> StatsReply:
        return self.call(Stats())

    def shutdown(self, timeout_s: float | None = None) -> None:
        self.call(Shutdown(), timeout_s)

    def wait_state(self, request_id: str, state: RequestState, timeout_s: float) -> RequestStatusReply:
        """Poll status until ``state`` or the deadline (then ControlError with the last status)."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.status(request_id)
            if st.state == state:
                return st
            if time.monotonic() > deadline:
                raise ControlError("state", f"{request_id} still {st.state!r} after {timeout_s} s: {st}")
            time.sleep(0.01)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None


# --- subprocess ---


class EmulatorProcess:
    """A running ``python -m sidecar.standins.emulator`` subprocess, its ready line and a control client."""

    def __init__(self, proc: subprocess.Popen, ready: ReadyInfo) -> None:
        self.proc = proc
        self.ready = ready
        self.client = EmulatorClient(ready.control)

    def stop(self, timeout_s: float = 10.0) -> int:
        """Shut down via the control channel, then SIGTERM/SIGKILL this pid if needed, each step waited for
        at most ``timeout_s``; returns rc."""
        if self.proc.poll() is None:
            try:
                self.client.shutdown(timeout_s)
            except ControlError:
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        self.client.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the emulator (a prefill dying mid-read)."""
        self.proc.kill()
        self.proc.wait()
        self.client.close()

    def __enter__(self) -> EmulatorProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def spawn_emulator(
    args: list[str] = (), timeout_s: float = 60.0, env: dict[str, str] | None = None
) -> EmulatorProcess:
    """Start the emulator as a real subprocess and wait (no sleeping) for its ready line on stdout."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "sidecar.standins.emulator", *args],
        stdout=subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    deadline = time.monotonic() + timeout_s
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    buf = b""
    line = b""
    try:
        while not line:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise ControlError("ready", f"emulator not ready within {timeout_s} s")
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                raise ControlError("ready", f"emulator exited before ready (rc={proc.wait()})")
            buf += chunk
            *lines, buf = buf.split(b"\n")
            line = next((ln for ln in lines if ln.startswith(b'{"event":"ready"')), b"")
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        sel.close()
    return EmulatorProcess(proc, msgspec.json.decode(line, type=ReadyInfo))
