"""The ops commands' client of a running daemon's socket (``doctor``, ``reload``): ask, wait for the answer.

Blocking, one request at a time, unlike the shim's client (``vllm_glue/client.py``: an I/O thread that says
Hello and registers caches). A :class:`DaemonConnection` is one DEALER: every request a command makes over it
reaches the daemon as one session (one routing id). A request whose reply does not come in time resets the
socket, so that reply, should it come late, never answers the next request.
"""

from __future__ import annotations

import os
from types import TracebackType

import zmq

from sidecar.wire import protocol as p


class NoReply(TimeoutError):
    """No reply within the request's bound (a stale socket file, or the daemon is stuck)."""


class StatusNotServed(Exception):
    """The daemon answered ``Status`` with an ``Error``: older than the message (the text: its reason)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class UnexpectedReply(Exception):
    """The daemon answered with another message than the request's reply (or another request's)."""

    def __init__(self, reply: object) -> None:
        super().__init__(repr(reply))
        self.reply = reply


def new_nonce() -> int:
    return int.from_bytes(os.urandom(4), "little")


class DaemonConnection:
    """One DEALER connected to ``endpoint``, made at the first request and closed by :meth:`close`."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.connect(self.endpoint)
            except zmq.ZMQError:
                sock.close(0)
                raise
            self._sock = sock
        return self._sock

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def request(self, msg: p.Message, timeout_s: float) -> p.ToShim:
        """Send ``msg``; its reply, decoded (DecodeError if it is none). NoReply after ``timeout_s``."""
        sock = self._socket()
        ms = int(timeout_s * 1000)
        sock.setsockopt(zmq.SNDTIMEO, max(ms, 0))  # a fresh DEALER queues at once; this bounds a reused one
        try:
            sock.send(p.encode(msg))
        except zmq.Again:
            self._reset()
            raise NoReply from None
        if not sock.poll(ms):
            self._reset()
            raise NoReply
        return p.decode_to_shim(sock.recv())

    def close(self) -> None:
        self._reset()
        self._ctx.term()

    def __enter__(self) -> DaemonConnection:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def ask_status(conn: DaemonConnection, timeout_s: float) -> p.StatusReply:
    """``Status`` → ``StatusReply`` (with the request's nonce). NoReply, DecodeError, zmq.ZMQError from the
    request; StatusNotServed when the daemon answers Error; UnexpectedReply when it answers anything else."""
    nonce = new_nonce()
    reply = conn.request(p.Status(nonce=nonce), timeout_s)
    if isinstance(reply, p.Error):
        raise StatusNotServed(reply.reason)
    if not isinstance(reply, p.StatusReply) or reply.nonce != nonce:
        raise UnexpectedReply(reply)
    return reply
