"""The router: the shims' ZMQ ROUTER socket and completion socket, their sessions, and a handler table.

Every frame is decoded into a typed message (``sidecar.wire.protocol``) or answered with an ``Error``;
a valid message goes to the handler registered for its type. A handler that raises is answered with an
``Error`` too: one bad message never stops the daemon. Replies to a shim go over its completion socket
when it bound one (``completions.py``), else over ZMQ.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from sidecar.daemon.completions import MAX_BACKLOG_BYTES, CompletionSocket, completion_path
from sidecar.daemon.jobs import Session
from sidecar.ops.errors import StartupError
from sidecar.ops.metrics import Metrics
from sidecar.ops.ratelog import RateLimitedLog
from sidecar.ops.socket_files import MAX_UNIX_PATH, FileId, bind_socket_file, refuse_if_served, unlink_own
from sidecar.wire import protocol as p

log = logging.getLogger("kv_sidecar.router")

Handler = Callable[[list[bytes], Session, Any, float], None]

# The largest message a shim may send: a Pull for a million blocks is ~10 MB. A larger frame makes ZMQ drop
# the connection rather than hand us something that would block the loop while it is decoded.
MAX_MESSAGE_BYTES = 64 << 20
# Awaiting a message ZMQ already holds does not yield to the loop: a peer that keeps the socket full (a flood
# of frames, each refused in ~30 us) held every other task (pulls, polls, the /healthz tick) for as long as
# it lasted, 12 s for 300,000 frames. The receive loop lets them in after this many messages.
TAKES_PER_YIELD = 64
CLOSE_LINGER_MS = 500  # at close, how long answers still queued for a shim may take to go out
# Sessions remembered: ZMQ does not tell a ROUTER that a peer left, and each shim (re)start and doctor run
# comes with a new routing id. Past this many, the longest idle that hold nothing are forgotten.
MAX_SESSIONS = 1024
# Replies queued for one peer that does not read them: ZMQ's SNDHWM per connection (ROUTER_MANDATORY makes
# a full queue an EAGAIN we count, not a silent drop), and on the completion socket behind the kernel's
# buffer (then the connection is closed: completions.py). A shim is owed at most one reply per message it
# sent whose answer it has not read yet: a Done per Pull (the decoder's loads at once: thousands at most,
# bounded by vLLM's running requests and KV cache; the daemon works max_inflight + max_queued, 320 by
# default, and answers the rest at once), an Aborted per Abort, a few control replies. 16,384 is 4x a
# decoder of 2,048 loads each pulled and aborted, and ZMQ holds the shim's own RCVHWM (1,000) and the
# kernel's buffer beyond it. A peer that never reads holds at most that many replies of the daemon's memory
# per connection: ~2 MB of ~130-byte Errors, ~6 MB of ~380-byte Dones, ~100 MB should every reply quote a
# 4,096-character reason.
REPLY_BACKLOG = 16384
# Requests from one peer that the loop has not taken yet: ZMQ's RCVHWM per connection. Past it ZMQ stops
# reading that connection until the loop catches up (nothing is lost; a shim's NOBLOCK send fails at once,
# as to a daemon it cannot reach). RCVHWM=0 let a client that sends faster than the loop answers grow the
# daemon without bound: 200,000 invalid 1 KB frames, sent in 0.5 s and refused in 6 s, took 315 MB. A
# shim's requests in flight are bounded as its replies are.
REQUEST_BACKLOG = REPLY_BACKLOG


class Router:
    """Sockets, sessions and dispatch. ``on(MessageType, handler)`` before ``bind``. ``keep(session)`` says
    whether the daemon still needs a session (it owns the caches, a pull of it is in flight): such a one,
    and one bound on the completion socket, is never forgotten."""

    def __init__(
        self,
        metrics: Metrics,
        *,
        keep: Callable[[Session], bool] = lambda _session: False,
        max_sessions: int = MAX_SESSIONS,
        reply_backlog: int = REPLY_BACKLOG,
        request_backlog: int = REQUEST_BACKLOG,
    ) -> None:
        """``reply_backlog``: replies queued for a peer that does not read them before more are dropped (ZMQ)
        or its connection is closed (completion socket); ``request_backlog``: requests queued from a peer
        before ZMQ stops reading it. Both read at ``bind``."""
        self._metrics = metrics
        self._ratelog = RateLimitedLog(log, on_suppressed=metrics.logs_suppressed.inc)
        self._handlers: dict[type, Handler] = {}
        self._sessions: dict[bytes, Session] = {}
        self._keep = keep
        self._max_sessions = max_sessions
        self.reply_backlog = reply_backlog
        self.request_backlog = request_backlog
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._path = ""
        self._path_id: FileId | None = None
        self.completions: CompletionSocket | None = None

    def on(self, kind: type, handler: Handler) -> None:
        self._handlers[kind] = handler

    def session(self, identity: bytes) -> Session | None:
        return self._sessions.get(identity)

    def bind(
        self,
        endpoint: str,
        path: str,
        gid: int | None,
        *,
        fast_completions: bool,
        max_connections: int,
        on_closed: Callable[[bytes], None],
    ) -> None:
        refuse_if_served(endpoint, path)  # again: one may have started meanwhile
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.SNDHWM, self.reply_backlog)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply that cannot be queued raises: counted, not lost
        sock.setsockopt(zmq.RCVHWM, self.request_backlog)
        try:
            self._path_id = bind_socket_file(lambda: sock.bind(endpoint), path, gid)
        except (zmq.ZMQError, OSError, StartupError) as exc:
            # a bound-but-unclosed ROUTER would hang shutdown in ctx.term()
            sock.close(0)
            self._ctx.term()
            self._ctx = None
            if isinstance(exc, StartupError):
                raise
            raise StartupError("socket", f"cannot bind {endpoint}: {exc}") from None
        self._sock, self._path = sock, path
        if fast_completions:
            done_path = completion_path(path)
            if len(done_path.encode()) > MAX_UNIX_PATH:
                log.warning(
                    "completion socket disabled: %s is longer than a unix socket path may be", done_path
                )
                return
            self.completions = CompletionSocket(
                done_path,
                asyncio.get_running_loop(),
                self._may_bind_completions,
                self._send_over_zmq,
                group_gid=gid,
                max_connections=max_connections,
                on_refused=self._connection_refused,
                on_closed=on_closed,
                on_request=self._on_completion_request,
                max_backlog=self.reply_backlog,
                on_backlog=self._completions_cut_off,
            )

    def _connection_refused(self, why: str) -> None:
        self._metrics.connections_refused.inc()
        self._ratelog.log("refused", logging.WARNING, "completion socket: connection refused: %s", why)

    def _completions_cut_off(self, routing_id: bytes, dropped: int) -> None:
        self._metrics.reply_dropped("backlog", dropped)
        self._ratelog.log(
            "completions-backlog",
            logging.WARNING,
            "completion socket of %r closed: it left %d replies unread behind the kernel's buffer (at most "
            "%d, or %d bytes); they are dropped. A live shim binds and registers again",
            routing_id, dropped, self.reply_backlog, MAX_BACKLOG_BYTES,
        )

    def _may_bind_completions(self, routing_id: bytes) -> str | None:
        session = self._sessions.get(routing_id)
        if session is None or session.hello is None:
            return "routing_id: no shim with this routing id has said Hello on the main socket"
        return None

    def _on_completion_request(self, routing_id: bytes, payload: bytes, received: float) -> None:
        """A packet from a bound completion socket: a Pull, Heartbeat or Abort, else an Error back there."""
        envelope = [routing_id]
        try:
            msg = p.decode_on_completions(payload)
        except p.DecodeError as exc:
            self._metrics.invalid_messages.inc()
            kind, req_id = _peek(payload)
            self._ratelog.log(
                "invalid", logging.WARNING, "invalid completion-socket message (%s): %s", kind or "?", exc
            )
            self.send(envelope, p.Error(reason=str(exc), in_reply_to=kind, req_id=req_id))
            return
        if isinstance(msg, p.BindCompletions):
            self._metrics.invalid_messages.inc()
            reason = "already bound: only one BindCompletions travels on this socket"
            self.send(envelope, p.Error(reason=reason, in_reply_to="BindCompletions"))
            return
        self.dispatch(envelope, msg, received)

    async def receive_loop(self) -> None:
        assert self._sock is not None
        taken = 0
        while True:
            taken += 1
            if taken % TAKES_PER_YIELD == 0:
                await asyncio.sleep(0)
            frames = await self._sock.recv_multipart()
            received = time.monotonic()
            if len(frames) == 2:
                envelope, payload = frames[:1], frames[1]
            elif len(frames) == 3 and frames[1] == b"":
                envelope, payload = frames[:2], frames[2]
            else:
                self._metrics.invalid_messages.inc()
                self.send(
                    frames[:1],
                    p.Error(reason=f"expected one message frame after the identity, got {len(frames) - 1}"),
                )
                continue
            try:
                msg = p.decode_to_daemon(payload)
            except p.DecodeError as exc:
                self._metrics.invalid_messages.inc()
                kind, req_id = _peek(payload)
                self._ratelog.log("invalid", logging.WARNING, "invalid message (%s): %s", kind or "?", exc)
                self.send(envelope, p.Error(reason=str(exc), in_reply_to=kind, req_id=req_id))
                continue
            self.dispatch(envelope, msg, received)

    def dispatch(self, envelope: list[bytes], msg: p.ToDaemon, received: float) -> None:
        """Hand one decoded message to its handler (the receive loop's second half; tests call it too)."""
        session = self._sessions.get(envelope[0])
        if session is None:
            session = self._new_session(envelope[0])
        session.last_seen = received
        try:
            self._handlers[type(msg)](envelope, session, msg, received)
        except Exception as exc:  # noqa: BLE001 - one bad message never stops the daemon
            log.exception("handling %s", type(msg).__name__)
            self.send(
                envelope,
                p.Error(
                    reason=f"internal error: {exc}",
                    in_reply_to=type(msg).__name__,
                    req_id=getattr(msg, "req_id", None),
                ),
            )

    def _new_session(self, identity: bytes) -> Session:
        """A routing id not seen, or forgotten: a new session, which must say Hello like any other."""
        if len(self._sessions) >= self._max_sessions:
            self._forget_idle()
        session = self._sessions[identity] = Session(identity)
        return session

    def _forget_idle(self) -> None:
        """Make room for one session by forgetting the longest idle that hold nothing."""
        before = len(self._sessions)
        for session in sorted(self._sessions.values(), key=lambda s: s.last_seen):
            if len(self._sessions) < self._max_sessions:
                break
            if not self._holds(session):
                del self._sessions[session.identity]
        if len(self._sessions) < before:
            log.debug("forgot %d idle shim sessions", before - len(self._sessions))

    def _holds(self, session: Session) -> bool:
        bound = self.completions is not None and self.completions.bound(session.identity)
        return bound or self._keep(session)

    def send(self, envelope: list[bytes], msg: p.ToShim) -> None:
        if self._sock is None:
            return
        if isinstance(msg, p.Done):
            msg = msgspec.structs.replace(msg, sent_at_ns=time.monotonic_ns())
        data = p.encode(msg)
        if len(envelope) == 1 and self.completions is not None and self.completions.send(envelope[0], data):
            return
        self._send_frames([*envelope, data])

    def _send_over_zmq(self, routing_id: bytes, data: bytes) -> None:
        self._send_frames([routing_id, data])

    def _send_frames(self, frames: list[bytes]) -> None:
        if self._sock is None:
            return
        try:
            fut = self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._not_sent(frames[0], exc)
            return
        if not isinstance(fut, asyncio.Future):
            return
        if fut.done():  # NOBLOCK: tried at once (no send ever waits behind another), so counted at once
            self._check_sent(frames[0], fut)
        else:
            fut.add_done_callback(functools.partial(self._check_sent, frames[0]))

    def _check_sent(self, identity: bytes, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            self._not_sent(identity, fut.exception())

    def _not_sent(self, identity: bytes, exc: BaseException) -> None:
        """A reply ZMQ did not take: counted, and logged at most once per ``RateLimitedLog`` interval. Never
        raises: the pipeline answers a pull before it releases what the pull held."""
        if isinstance(exc, zmq.Again):
            self._metrics.reply_dropped("backlog")
            self._ratelog.log(
                "zmq-backlog",
                logging.WARNING,
                "reply to %r dropped: %d replies it has not read wait already; a peer that does not read "
                "its socket loses its answers",
                identity, self.reply_backlog,
            )
        elif isinstance(exc, zmq.ZMQError) and exc.errno == zmq.EHOSTUNREACH:
            self._metrics.reply_dropped("gone")
            self._ratelog.log("zmq-gone", logging.INFO, "reply to %r dropped: it has disconnected", identity)
        else:
            self._metrics.reply_dropped("error")
            self._ratelog.log("zmq-error", logging.WARNING, "could not send a reply to %r: %s", identity, exc)

    def close(self) -> None:
        if self.completions is not None:
            self.completions.close()
            self.completions = None
        if self._sock is not None:
            self._sock.close(linger=CLOSE_LINGER_MS)  # the last answers still go out
            self._sock = None
            unlink_own(self._path, self._path_id)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None


def _peek(payload: bytes) -> tuple[str | None, str | None]:
    """Best effort: the type and req_id of an invalid message, so the Error can name the request."""
    kind, req_id = p.peek(payload)
    return _short(kind), _short(req_id)


def _short(value: Any) -> str | None:
    """``value`` if a str no valid message would refuse as too long (an Error echoing it must stay small)."""
    return value if isinstance(value, str) and len(value) <= p.MAX_ID_CHARS else None
