"""The daemon's completion socket: replies to a shim over one AF_UNIX SOCK_SEQPACKET connection.

A ZMQ message crosses four threads between two processes (sender, its I/O thread, the receiver's I/O thread,
the receiver); each wake-up costs tens of µs on a busy host, which put the completion signal's p50 at the
100 µs goal. One SEQPACKET packet is one syscall each side and keeps message boundaries. Once bound, the
connection carries the shim's Pulls, Heartbeats and Aborts too (``on_request``: the router validates and
dispatches them like ZMQ's), so a Pull's way in is as short as its Done's way out. ZMQ stays the channel for
the rest and the fallback: a shim that never binds, or whose connection breaks, uses it for everything.
Runs on the daemon's event loop (``add_reader``/``add_writer``); no threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import deque
from collections.abc import Callable

from sidecar.ops.socket_files import bind_socket_file, remove_stale_socket, unlink_own
from sidecar.wire import protocol as p

log = logging.getLogger("kv_sidecar.completions")

# A BindCompletions is < 300 bytes; a Pull of up to ~8,140 blocks fits (packed ids: 8 bytes a block, local
# and remote). A larger packet is cut here and answered with a decode error (the shim sends those over ZMQ).
# The shim reads as much of each reply, so a longer reply goes over ZMQ (reasons are cut well below it).
MAX_PACKET = 65536
READS_PER_WAKE = 64  # packets taken per readable callback before letting other sockets in
BIND_WITHIN_S = 5.0  # a connection that has not bound by then is closed (idle ones would hold fds)
ACCEPT_PAUSE_S = 0.1  # out of file descriptors: stop accepting this long instead of spinning
SEND_BUFFER = 1 << 20  # room for thousands of Done packets before a slow shim makes us queue
# What may wait behind the kernel's buffer for a shim that does not read, besides a count (``max_backlog``,
# the router's REPLY_BACKLOG): packets are up to MAX_PACKET long, so 16,384 of them could hold 1 GB, where
# 16,384 Dones of ~380 bytes are ~6 MB.
MAX_BACKLOG_BYTES = 32 << 20


def completion_path(zmq_socket_path: str) -> str:
    return zmq_socket_path + ".done"


class _Conn:
    """One accepted connection; ``routing_id`` once bound, ``pending`` while the kernel buffer is full."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.routing_id: bytes | None = None
        self.pending: deque[bytes] = deque()
        self.pending_bytes = 0


class CompletionSocket:
    """Listen at ``path``. ``may_bind(routing_id)`` says whether that ZMQ peer has said Hello (None) or why
    not (the reason sent back); ``fallback(routing_id, data)`` sends over ZMQ what a broken connection left
    unsent, so no reply is lost while the shim lives.

    A shim that leaves ``max_backlog`` replies (or ``MAX_BACKLOG_BYTES``) waiting behind the kernel's buffer
    is cut off: its connection is closed and those replies are dropped, not moved to ZMQ, and
    ``on_backlog(routing_id, dropped)`` is told. Its shim, if it lives, takes that as any broken completion
    socket (vllm_glue's client: Hello, bind and register again; the loads of the old connection end as the
    re-registration and their Aborts answer them, not at their deadlines); ``on_closed`` is told as for any
    close."""

    def __init__(
        self,
        path: str,
        loop: asyncio.AbstractEventLoop,
        may_bind: Callable[[bytes], str | None],
        fallback: Callable[[bytes, bytes], None],
        *,
        group_gid: int | None = None,
        max_connections: int = 64,
        on_refused: Callable[[str], None] | None = None,
        on_closed: Callable[[bytes], None] | None = None,
        on_request: Callable[[bytes, bytes, float], None] | None = None,
        max_backlog: int,
        on_backlog: Callable[[bytes, int], None] | None = None,
    ) -> None:
        self.path = path
        self._loop = loop
        self._may_bind = may_bind
        self._fallback = fallback
        self._max_connections = max_connections
        self._on_refused = on_refused or (lambda _why: None)
        self._on_closed = on_closed or (lambda _rid: None)
        self._on_request = on_request
        self._max_backlog = max_backlog
        self._on_backlog = on_backlog or (lambda _rid, _n: None)
        self._by_id: dict[bytes, _Conn] = {}
        self._conns: set[_Conn] = set()
        remove_stale_socket(path)  # the caller has checked that no live daemon serves this socket
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._path_id = bind_socket_file(lambda: self._listener.bind(path), path, group_gid)
        self._listener.listen(64)
        self._listener.setblocking(False)
        loop.add_reader(self._listener.fileno(), self._accept)

    def send(self, routing_id: bytes, data: bytes) -> bool:
        """Send one reply to a bound shim, in order. False when it has no completion socket (use ZMQ). True
        also when it is dropped, cutting the shim off: one that left too many unread."""
        conn = self._by_id.get(routing_id)
        if conn is None:
            return False
        if len(data) > MAX_PACKET:  # the shim reads no more of a packet: it would be cut (or EMSGSIZE)
            log.warning("a %d-byte reply to %r goes over ZMQ: past the %d bytes of a packet", len(data),
                        routing_id, MAX_PACKET)
            return False
        if conn.pending:  # keep order behind what waits for room
            if len(conn.pending) >= self._max_backlog or conn.pending_bytes + len(data) > MAX_BACKLOG_BYTES:
                self._cut_off(conn)
                return True
            conn.pending.append(data)
            conn.pending_bytes += len(data)
            return True
        try:
            conn.sock.send(data)
        except BlockingIOError:
            conn.pending.append(data)
            conn.pending_bytes += len(data)
            self._loop.add_writer(conn.sock.fileno(), self._flush, conn)
        except OSError as exc:  # the shim is gone or closed its end: it will hear from ZMQ
            self._drop(conn, f"send failed: {exc}")
            return False
        return True

    def bound(self, routing_id: bytes) -> bool:
        """Whether that shim has a completion connection now."""
        return routing_id in self._by_id

    def close(self) -> None:
        for conn in list(self._conns):
            self._drop(conn, None)
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_reader(self._listener.fileno())
        self._listener.close()
        unlink_own(self.path, self._path_id)

    # --------------------------------------------------------------------------------------- loop callbacks

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # EMFILE/ENFILE: the connection stays in the backlog and the listener stays readable, so
                # retrying at once would spin; pause accepting instead.
                self._on_refused(f"accept failed: {exc}")
                self._loop.remove_reader(self._listener.fileno())
                self._loop.call_later(ACCEPT_PAUSE_S, self._resume_accepting)
                return
            if len(self._conns) >= self._max_connections:
                with contextlib.suppress(OSError):
                    reason = f"max_connections: {self._max_connections} connections are open"
                    sock.send(p.encode(p.CompletionsBound(ok=False, reason=reason)))
                sock.close()
                self._on_refused(f"over max_connections ({self._max_connections})")
                continue
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
            conn = _Conn(sock)
            self._conns.add(conn)
            self._loop.add_reader(sock.fileno(), self._readable, conn)
            self._loop.call_later(BIND_WITHIN_S, self._unbound_timeout, conn)

    def _resume_accepting(self) -> None:
        with contextlib.suppress(ValueError, OSError):
            self._loop.add_reader(self._listener.fileno(), self._accept)

    def _unbound_timeout(self, conn: _Conn) -> None:
        if conn in self._conns and conn.routing_id is None:
            self._drop(conn, None)

    def _readable(self, conn: _Conn) -> None:
        for _ in range(READS_PER_WAKE):
            try:
                data = conn.sock.recv(MAX_PACKET)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._drop(conn, f"receive failed: {exc}")
                return
            if not data:
                self._drop(conn, None)
                return
            if conn.routing_id is not None and self._on_request is not None:
                # a request from a bound shim: the router answers it (Error included) through send()
                self._on_request(conn.routing_id, data, time.monotonic())
            else:
                self._answer_bind(conn, data)
            if conn not in self._conns:
                return

    def _answer_bind(self, conn: _Conn, data: bytes) -> None:
        reply, keep = self._on_packet(conn, data)
        try:
            conn.sock.send(p.encode(reply))
        except OSError as exc:
            self._drop(conn, f"send failed: {exc}")
            return
        if not keep:
            self._drop(conn, reply.reason)

    def _on_packet(self, conn: _Conn, data: bytes) -> tuple[p.CompletionsBound | p.Error, bool]:
        """Validate a packet from a shim: (the answer, whether the connection stays)."""
        if conn.routing_id is not None:
            return p.Error(reason="already bound: only one BindCompletions travels on this socket"), True
        try:
            msg = p.decode_bind(data)
        except p.DecodeError as exc:
            return p.CompletionsBound(ok=False, reason=str(exc)), False
        why_not = self._may_bind(msg.routing_id)
        if why_not is not None:
            return p.CompletionsBound(ok=False, reason=why_not), False
        old = self._by_id.get(msg.routing_id)
        if old is not None:
            self._drop(old, "replaced by a new binding")
        conn.routing_id = msg.routing_id
        self._by_id[msg.routing_id] = conn
        log.debug("completion socket bound for %r", msg.routing_id)
        return p.CompletionsBound(ok=True), True

    def _flush(self, conn: _Conn) -> None:
        while conn.pending:
            try:
                conn.sock.send(conn.pending[0])
            except BlockingIOError:
                return
            except OSError as exc:
                self._drop(conn, f"send failed: {exc}")
                return
            conn.pending_bytes -= len(conn.pending.popleft())
        self._loop.remove_writer(conn.sock.fileno())

    def _cut_off(self, conn: _Conn) -> None:
        """Close the connection of a shim that does not read, dropping its replies (this one too)."""
        assert conn.routing_id is not None  # only a bound connection has replies queued
        dropped = len(conn.pending) + 1
        conn.pending.clear()
        conn.pending_bytes = 0
        self._on_backlog(conn.routing_id, dropped)
        self._drop(conn, None)

    def _drop(self, conn: _Conn, reason: str | None) -> None:
        if conn not in self._conns:
            return
        self._conns.discard(conn)
        if conn.routing_id is not None and self._by_id.get(conn.routing_id) is conn:
            del self._by_id[conn.routing_id]
        if reason:
            log.warning("completion socket of %r closed: %s", conn.routing_id, reason)
        fd = conn.sock.fileno()
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_reader(fd)
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_writer(fd)
        conn.sock.close()
        if conn.routing_id is not None:
            while conn.pending:
                self._fallback(conn.routing_id, conn.pending.popleft())
            conn.pending_bytes = 0
            if self._by_id.get(conn.routing_id) is None and reason != "replaced by a new binding":
                self._on_closed(conn.routing_id)
