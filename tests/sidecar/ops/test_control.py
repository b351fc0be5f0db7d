"""The ops commands' client of a daemon's socket (``sidecar.ops.control``), against a real ZMQ ROUTER."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import zmq

from sidecar.ops import control
from sidecar.wire import protocol as p


class StatusRouter:
    """The daemon's ROUTER socket, in a thread: answers Ping and Status as the daemon does, and records the
    routing id of every request (the daemon keeps a session per routing id). ``kill`` stands in for the
    SIGHUP: counted at once, its reload's outcome shows ``lag`` Status asks later. ``extra``: StatusReply
    fields of a daemon newer than the protocol here. ``delays``: seconds to hold each reply, in order."""

    def __init__(self, endpoint: str, *, pid: int = 41, lag: int = 2, outcome: str = "applied",
                 extra: dict[str, Any] | None = None) -> None:
        self.endpoint, self.pid, self.lag, self.outcome = endpoint, pid, lag, outcome
        self.extra = extra or {}
        self.sighups = 0
        self.reload: dict[str, Any] | None = None
        self.delays: list[float] = []
        self.answer: Callable[[Any], bytes] | None = None  # replaces the Status/Ping answer
        self.identities: list[bytes] = []  # one per request, in order
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def sessions(self) -> int:
        return len(set(self.identities))

    def kill(self, pid: int, sig: int) -> None:
        assert (pid, sig) == (self.pid, signal.SIGHUP)
        self.sighups += 1

    def _status(self, nonce: int) -> bytes:
        if self.sighups and self.outcome is not None:
            if self.lag > 0:
                self.lag -= 1
            else:
                self.reload = {"count": self.sighups, "outcome": self.outcome}
                self.outcome = None
        return msgspec.msgpack.encode({"type": "StatusReply", "nonce": nonce, "registered": False,
                                       "pid": self.pid, "reload": self.reload, "sighups": self.sighups,
                                       **self.extra})

    def _serve(self) -> None:
        held: list[tuple[float, list[bytes]]] = []
        while not self._stop.is_set():
            if self._sock.poll(10):
                identity, frame = self._sock.recv_multipart()
                self.identities.append(identity)
                msg = p.decode_to_daemon(frame)
                if self.answer is not None:
                    reply = self.answer(msg)
                elif isinstance(msg, p.Ping):
                    reply = p.encode(p.Pong(nonce=msg.nonce))
                else:
                    reply = self._status(msg.nonce)
                delay = self.delays.pop(0) if self.delays else 0.0
                held.append((time.monotonic() + delay, [identity, reply]))
            for due, frames in [h for h in held if h[0] <= time.monotonic()]:
                held.remove((due, frames))
                self._sock.send_multipart(frames)

    def __enter__(self) -> StatusRouter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()


def test_a_connections_requests_are_one_session(tmp_path):
    with StatusRouter(f"ipc://{tmp_path}/d.sock") as router, \
            control.DaemonConnection(router.endpoint) as conn:
        assert isinstance(conn.request(p.Ping(nonce=3), 2.0), p.Pong)
        replies = [control.ask_status(conn, 2.0) for _ in range(3)]
    assert [r.pid for r in replies] == [41] * 3
    assert (len(router.identities), router.sessions) == (4, 1)


def test_a_late_reply_does_not_answer_the_next_request(tmp_path):
    """A request that timed out resets the socket: its reply, come late, would answer the next one."""
    with StatusRouter(f"ipc://{tmp_path}/d.sock") as router, \
            control.DaemonConnection(router.endpoint) as conn:
        router.delays = [0.3]
        with pytest.raises(control.NoReply):
            control.ask_status(conn, 0.1)
        time.sleep(0.4)  # the first reply has gone out by now
        assert control.ask_status(conn, 2.0).pid == 41  # its own nonce: not UnexpectedReply
    assert router.sessions == 2


def test_an_error_or_another_reply_to_status_is_typed(tmp_path):
    with StatusRouter(f"ipc://{tmp_path}/d.sock") as router, \
            control.DaemonConnection(router.endpoint) as conn:
        router.answer = lambda msg: p.encode(p.Error(reason="unknown message type 'Status'"))
        with pytest.raises(control.StatusNotServed, match="unknown message type 'Status'"):
            control.ask_status(conn, 2.0)
        router.answer = lambda msg: p.encode(p.Pong(nonce=msg.nonce))
        with pytest.raises(control.UnexpectedReply) as other:
            control.ask_status(conn, 2.0)
        assert isinstance(other.value.reply, p.Pong)
