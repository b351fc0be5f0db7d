"""The shim's client of its kv-sidecar daemon: one ZMQ DEALER owned by a background I/O thread.

The caller (vLLM's engine thread, or the decoder stand-in) never blocks on the daemon: ``send`` hands a
message to the I/O thread and returns; replies (Done, Aborted, Error) are collected with the monotonic time
they arrived and taken with ``poll_events``. The thread says Hello and registers the caches whenever it
(re)connects, and reports a lost daemon as an event, so outstanding loads fail instead of hanging. When the
daemon's Welcome offers a completion socket, the thread binds it before registering and takes every reply
from there (one unix packet instead of ZMQ's four thread hops; see ``sidecar/daemon/completions.py``); once
registered, it sends Pulls, Heartbeats and Aborts there too, straight from the caller's thread when no
earlier one waits in the inbox (one syscall, no hop to the I/O thread; ZMQ carries the rest, and everything
when the socket could not be bound). The daemon takes that socket's end for the shim's, so once bound, its
breaking ends the connection as a ZMQ disconnect does, and the thread says Hello and registers again. A
Pull's ``sent_at_ns`` is stamped in ``send``, so its Done says how long it took to reach the daemon
(``timings["delivery"]``); the worker adds the Done's own trip back (``"return"``).
Importable without vLLM and without torch.

Epochs: each connection to a daemon gets a number. ``send`` returns the epoch a message goes out on, every
reply and loss carries the epoch it belongs to, and a message queued for an epoch that has ended is never
sent on the next one (a Pull gets a local failed Done instead). So a loss fails only what was sent on that
connection, whenever the engine thread gets to it. The daemon's process is watched through a pidfd (its pid
from SO_PEERCRED on the completion socket, so it is right across pid namespaces): ``Gone`` says when the
process that served some epochs has exited and can no longer write into any block.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from sidecar.wire import protocol as p
from vllm_glue.sched_hint import request_short_slice

log = logging.getLogger(__name__)

_STOP = b"\x00stop"
_REGISTER = b"\x00register"
_DATA = b"\x01"  # then the 8-byte epoch the caller sent it for, then the message
_FAST_DATA = b"\x02"  # the same, for a message that may travel on the completion socket
_EPOCH = struct.Struct("!Q")
_UP = getattr(zmq, "EVENT_HANDSHAKE_SUCCEEDED", zmq.EVENT_CONNECTED)
_FAST_TYPES = (p.Pull, p.Heartbeat, p.Abort)
# Larger packets go over ZMQ: the daemon reads at most this much of one (a Pull of ~8,140 blocks fits:
# packed ids take 8 bytes a block).
_FAST_MAX = 65536


class NotReady(RuntimeError):
    """The daemon is not connected and registered; the text says why."""


@dataclass(frozen=True)
class Reply:
    """A message from the daemon (Done, Aborted, Error, Pong) and ``time.monotonic_ns()`` at its arrival."""

    message: p.ToShim
    received_at_ns: int
    epoch: int = 0  # the connection it came on (or, for a local failure, the one its message was for)


@dataclass(frozen=True)
class Lost:
    """Connection ``epoch`` dropped (or its registration failed): what was sent on it gets no reply there.

    The daemon may still be running what it got: a load sent on ``epoch`` is not safe to release yet.
    """

    reason: str
    received_at_ns: int
    epoch: int = 0


@dataclass(frozen=True)
class Gone:
    """The daemon process that served connections ``epochs`` has exited: nothing sent on them can write."""

    epochs: frozenset[int]
    reason: str
    received_at_ns: int


Event = Reply | Lost | Gone


class SidecarClient:
    """Connect to ``address`` (e.g. ``ipc:///run/kv-sidecar/gpu0.sock``), say Hello, register, then carry
    messages.

    States: ``connecting`` → ``ready`` (Welcome and Registered received) → ``lost`` on disconnect → back to
    ``ready`` when the daemon returns (Hello and RegisterCaches are sent again); a bound completion socket
    that breaks while ZMQ stays up is such a disconnect too, and Hello follows at once. ``failed`` when the
    daemon refused Hello or RegisterCaches, or did not answer in time (a late answer still completes the
    step): the reason stays in ``status_reason``.
    """

    def __init__(
        self,
        address: str,
        hello: p.Hello,
        register: p.RegisterCaches | None = None,
        *,
        reply_timeout_s: float = 10.0,
        register_timeout_s: float | None = None,
    ) -> None:
        """``register_timeout_s``: how long Registered may take (the daemon maps and registers the caches
        with NIXL meanwhile; default ``reply_timeout_s``)."""
        self.address = address
        self._hello = hello
        self._register = register
        self.reply_timeout_s = reply_timeout_s
        self.register_timeout_s = reply_timeout_s if register_timeout_s is None else register_timeout_s
        self._ctx = zmq.Context()
        self._inbox = f"inproc://kv-sidecar-client-{id(self):x}-{os.getpid()}"
        self._events: deque[Event] = deque()
        self._send_lock = threading.Lock()
        self._state = "connecting"
        self.status_reason = "not connected yet"
        self.welcome: p.Welcome | None = None
        self.registered: p.Registered | None = None
        self._changed = threading.Condition()
        self._bound = threading.Event()
        self._fast: socket.socket | None = None  # the completion socket, owned by the I/O thread
        self._zmq_pulls: set[str] = set()  # this connection's unanswered Pulls that went over ZMQ
        # Guards the completion socket's replacement and the epoch's change against a caller's direct send.
        self._fast_lock = threading.Lock()
        self._queued_fast = 0  # Pulls, Heartbeats, Aborts in the inbox not yet forwarded (under _fast_lock)
        self.sent_direct = 0  # messages the caller's thread sent straight over the completion socket
        self._epoch = 0  # the current connection's number; only the I/O thread changes it
        self._connected = False
        self._daemons: dict[int, tuple[int, set[int]]] = {}  # pidfd -> (daemon pid, epochs it served)
        self._thread = threading.Thread(target=self._run, name="kv-sidecar-client", daemon=True)
        self._thread.start()
        self._bound.wait()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(self._inbox)
        self._closed = False

    # ------------------------------------------------------------------------------------------- caller side

    @property
    def state(self) -> str:
        return self._state

    def is_ready(self) -> bool:
        return self._state == "ready"

    @property
    def epoch(self) -> int:
        """The current connection's number (0 before the first)."""
        return self._epoch

    @property
    def uses_completion_socket(self) -> bool:
        """Whether replies now come over the daemon's completion socket (else over ZMQ)."""
        return self._fast is not None

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until registered (True), or until the timeout or a refusal (False). For startup only."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._state != "ready":
                left = deadline - time.monotonic()
                if self._state == "failed" or left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def send(self, msg: p.ToDaemon) -> int:
        """Queue one message for the daemon and return the epoch it goes out on; NotReady if it is not
        registered (the caller fails the load). Should that connection end before the I/O thread sends it,
        it is not sent at all (a Pull then gets a local failed Done of that epoch)."""
        if self._closed:
            raise NotReady("client is closed")
        epoch = self._epoch
        if self._state != "ready":
            raise NotReady(f"kv-sidecar at {self.address} is {self._state}: {self.status_reason}")
        if not isinstance(msg, _FAST_TYPES):
            self._queue(_DATA + _EPOCH.pack(epoch) + p.encode(msg))
            return epoch
        if isinstance(msg, p.Pull) and not msg.sent_at_ns:
            msg = msgspec.structs.replace(msg, sent_at_ns=time.monotonic_ns())
        payload = p.encode(msg)
        if self._send_direct(payload, epoch):
            return epoch
        with self._fast_lock:
            self._queued_fast += 1
        try:
            self._queue(_FAST_DATA + _EPOCH.pack(epoch) + payload)
        except NotReady:
            with self._fast_lock:
                self._queued_fast -= 1
            raise
        return epoch

    def _queue(self, data: bytes) -> None:
        with self._send_lock:
            try:
                self._push.send(data, zmq.NOBLOCK)
            except zmq.Again:
                raise NotReady("client queue is full: the I/O thread is not keeping up") from None

    def _send_direct(self, payload: bytes, epoch: int) -> bool:
        """Send a Pull, Heartbeat or Abort from the caller's thread, one packet on the completion socket, when
        that keeps every order: nothing of its kind waits in the inbox, no Pull of this connection went over
        ZMQ, the connection is the caller's epoch and registered. False: queue it for the I/O thread."""
        with self._fast_lock:
            fast = self._fast
            if (
                fast is None
                or self._queued_fast
                or self._zmq_pulls
                or self._phase != "ready"
                or not self._connected
                or epoch != self._epoch
                or len(payload) > _FAST_MAX
            ):
                return False
            try:
                fast.send(payload)  # non-blocking: a full buffer is the I/O thread's to wait out
            except OSError:
                return False
            self.sent_direct += 1
            return True

    def set_registration(self, register: p.RegisterCaches) -> None:
        """Set (or replace) the caches to register; sent now if connected, and again after each reconnect."""
        self._register = register
        with self._send_lock:
            self._push.send(_REGISTER, zmq.NOBLOCK)

    def poll_events(self) -> list[Event]:
        """Every reply and loss collected since the last call, in arrival order."""
        out: list[Event] = []
        while self._events:
            out.append(self._events.popleft())
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # A full inbox (the I/O thread behind) would drop the stop: wait for room while the thread runs. A
        # dropped stop left it running until the join gave up, and the context was terminated under it.
        deadline = time.monotonic() + 5
        with self._send_lock, contextlib.suppress(zmq.ZMQError):
            while self._thread.is_alive() and time.monotonic() < deadline:
                if self._push.poll(50, zmq.POLLOUT):
                    self._push.send(_STOP, zmq.NOBLOCK)
                    break
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()) + 1)
        self._push.close(linger=0)
        self._ctx.term()

    # ------------------------------------------------------------------------------------------- I/O thread

    def _set_state(self, state: str, reason: str) -> None:
        with self._changed:
            self._state = state
            self.status_reason = reason
            self._changed.notify_all()

    def _run(self) -> None:
        why_not = request_short_slice()  # replies wake this thread: let it run at once on a busy host
        if why_not is not None:
            log.debug("kv-sidecar client I/O thread keeps the default time slice: %s", why_not)
        try:
            self._loop()
        except Exception as e:  # never die silently: the engine must see loads fail, not hang
            log.exception("kv-sidecar client I/O thread failed")
            self._set_state("failed", f"client I/O thread failed: {e!r}")
            self._events.append(Lost(self.status_reason, time.monotonic_ns(), self._epoch))
            self._bound.set()

    def _loop(self) -> None:
        inbox = self._ctx.socket(zmq.PULL)
        inbox.setsockopt(zmq.LINGER, 0)
        inbox.bind(self._inbox)
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        # Our own routing id, so the daemon can tie the completion socket to this connection.
        self._routing_id = b"shim-" + os.urandom(12).hex().encode()
        dealer.setsockopt(zmq.ROUTING_ID, self._routing_id)
        # Never queue messages for a daemon that is not there: a send then fails at once instead of later.
        dealer.setsockopt(zmq.IMMEDIATE, 1)
        # Hello only once the ZMTP handshake is through: before that IMMEDIATE refuses to send.
        monitor = dealer.get_monitor_socket(_UP | zmq.EVENT_DISCONNECTED)
        dealer.connect(self.address)
        self._bound.set()
        poller = zmq.Poller()
        for s in (inbox, dealer, monitor):
            poller.register(s, zmq.POLLIN)
        self._poller = poller
        self._phase, self._deadline = "idle", float("inf")
        try:
            while True:
                timeout_ms = (
                    None
                    if self._deadline == float("inf")
                    else max(0, int((self._deadline - time.monotonic()) * 1000))
                )
                ready = dict(poller.poll(timeout_ms))
                if monitor in ready:
                    ev = recv_monitor_message(monitor)
                    if ev["event"] == _UP:
                        self._new_connection(dealer)
                    elif ev["event"] == zmq.EVENT_DISCONNECTED and self._connected:
                        self._drain(dealer)
                        self._connected = False
                        self._close_fast()
                        self._phase, self._deadline = "idle", float("inf")
                        self._lose(f"kv-sidecar at {self.address} disconnected")
                for pidfd in [fd for fd in self._daemons if fd in ready]:
                    self._daemon_exited(pidfd)
                if self._fast is not None and self._fast.fileno() in ready:
                    self._on_fast(dealer)
                if dealer in ready:
                    while dealer.poll(0):
                        self._on_frame(dealer)
                if inbox in ready:
                    while inbox.poll(0):
                        data = inbox.recv()
                        if data == _STOP:
                            return
                        self._forward(dealer, data)
                if self._phase == "bind" and time.monotonic() >= self._deadline:
                    self._fast_failed(dealer, f"no CompletionsBound within {self.reply_timeout_s:g} s")
                if self._phase in ("hello", "register") and time.monotonic() >= self._deadline:
                    what, waited = ("Welcome", self.reply_timeout_s) if self._phase == "hello" else (
                        "Registered", self.register_timeout_s)
                    # failed for now, but the phase stays: a late reply still completes it (the daemon
                    # may have been slow, not gone; it would hold the caches registered for nobody)
                    self._set_state("failed", f"no {what} from kv-sidecar within {waited:g} s")
                    self._deadline = float("inf")
        finally:
            self._close_fast()
            for pidfd in list(self._daemons):
                os.close(pidfd)
            self._daemons.clear()
            dealer.disable_monitor()
            for s in (monitor, dealer, inbox):
                s.close(linger=0)

    def _forward(self, dealer: zmq.Socket, data: bytes) -> None:
        if data[:1] != _FAST_DATA:
            self._forward_one(dealer, data)
            return
        try:
            self._forward_one(dealer, data)
        finally:
            with self._fast_lock:
                self._queued_fast -= 1  # only now may the caller's thread send the next one directly

    def _forward_one(self, dealer: zmq.Socket, data: bytes) -> None:
        if data == _REGISTER:
            if self._phase == "ready" and self._register is not None:
                self._send_register(dealer)
            return
        (epoch,) = _EPOCH.unpack_from(data, 1)
        payload = data[1 + _EPOCH.size :]
        if epoch != self._epoch or not self._connected:
            # Its connection ended while it waited here: never hand it to another one (or another daemon).
            self._reply_failure(payload, epoch, "kv-sidecar connection was lost before the message went out")
            return
        if data[:1] == _FAST_DATA and self._route_fast(dealer, payload):
            return
        if epoch != self._epoch:  # the completion socket broke under that send, ending the connection
            reason = "kv-sidecar completion socket broke before the message went out"
            self._reply_failure(payload, epoch, reason)
            return
        try:
            dealer.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            self._reply_failure(payload, epoch, "kv-sidecar is not reachable (send would block)")

    def _route_fast(self, dealer: zmq.Socket, payload: bytes) -> bool:
        """A Pull, Heartbeat or Abort: True if it went over the completion socket, False to send it over ZMQ.

        An Abort never overtakes its Pull: when the Pull went over ZMQ (too large, sent while
        re-registering, or the socket was full), its Abort follows it there. False also when the send found
        the socket broken, which ended the connection: the caller checks the epoch."""
        if self._zmq_pulls:
            msg = _decoded(payload)
            if isinstance(msg, p.Abort) and msg.req_id in self._zmq_pulls:
                return False
        epoch = self._epoch
        if self._send_fast(dealer, payload):
            return True
        msg = _decoded(payload)
        if isinstance(msg, p.Pull) and epoch == self._epoch:  # not one the next connection must wait for
            self._zmq_pulls.add(msg.req_id)
        return False

    def _send_fast(self, dealer: zmq.Socket, payload: bytes) -> bool:
        """Send a Pull, Heartbeat or Abort over the completion socket; False: use ZMQ, unless the send found
        the socket broken (that ends the connection: see ``_fast_lost``)."""
        fast = self._fast
        if fast is None or self._phase != "ready" or len(payload) > _FAST_MAX:
            return False
        for _ in range(2):
            try:
                fast.send(payload)
                return True
            except BlockingIOError:
                # the daemon's receive buffer is full: wait a little for room, keeping the order
                select.select([], [fast], [], 1.0)
            except OSError as e:
                self._fast_lost(dealer, f"send failed: {e}")
                return False
        log.warning("kv-sidecar completion socket stayed full for 1 s; this message goes over ZMQ")
        return False

    def _new_connection(self, dealer: zmq.Socket) -> None:
        """Start the next epoch on the ZMQ connection: Hello, then bind and register again."""
        with self._fast_lock:
            self._epoch += 1
            self._zmq_pulls.clear()
        self._connected = True
        self._say_hello(dealer)

    def _say_hello(self, dealer: zmq.Socket) -> None:
        self._set_state("connecting", "waiting for Welcome")
        self._phase, self._deadline = "hello", time.monotonic() + self.reply_timeout_s
        with contextlib.suppress(zmq.Again):  # the reply deadline turns this into a clear failure
            dealer.send(p.encode(self._hello), zmq.NOBLOCK)

    def _send_register(self, dealer: zmq.Socket) -> None:
        assert self._register is not None
        self._set_state("connecting", "waiting for Registered")
        self._phase, self._deadline = "register", time.monotonic() + self.register_timeout_s
        with contextlib.suppress(zmq.Again):
            dealer.send(p.encode(self._register), zmq.NOBLOCK)

    def _on_frame(self, dealer: zmq.Socket) -> None:
        frames = dealer.recv_multipart()
        # a ROUTER may send an empty delimiter first
        self._on_payload(dealer, frames[-1], time.monotonic_ns())

    def _on_payload(self, dealer: zmq.Socket, payload: bytes, at: int) -> None:
        """One message from the daemon, from either socket."""
        try:
            msg = p.decode_to_shim(payload)
        except p.DecodeError as e:
            log.error("kv-sidecar sent an invalid frame: %s", e)
            return
        if isinstance(msg, p.Welcome) and self._phase == "hello":
            self.welcome = msg
            if msg.protocol_version != p.PROTOCOL_VERSION:
                self._refused(
                    f"protocol_version: daemon speaks {msg.protocol_version}, shim {p.PROTOCOL_VERSION}", at
                )
            elif msg.completion_socket:
                self._bind_fast(dealer, msg.completion_socket)
            else:
                self._after_welcome(dealer)
            return
        if isinstance(msg, p.CompletionsBound) and self._phase == "bind":
            if msg.ok:
                self._after_welcome(dealer)
            else:
                self._fast_failed(dealer, msg.reason or "refused")
            return
        if isinstance(msg, p.Registered) and self._phase == "register":
            self.registered = msg
            self._phase, self._deadline = "ready", float("inf")
            self._set_state("ready", "registered")
            return
        # an Error about Hello or RegisterCaches (or a frame it could not read) refuses the step; one about a
        # Heartbeat or Unregister sent before a reconnect does not
        refusal = msg.in_reply_to in (None, "Hello", "RegisterCaches") if isinstance(msg, p.Error) else False
        if refusal and msg.req_id is None and self._phase in ("hello", "register"):
            self._refused(f"kv-sidecar refused {msg.in_reply_to or 'a message'}: {msg.reason}", at)
            return
        if self._zmq_pulls and _ends_pull(msg):
            self._zmq_pulls.discard(msg.req_id)
        self._events.append(Reply(msg, at, self._epoch))

    def _after_welcome(self, dealer: zmq.Socket) -> None:
        if self._register is None:
            self._set_state("connecting", "connected; caches not registered yet")
            self._phase, self._deadline = "ready", float("inf")
        else:
            self._send_register(dealer)

    # Completion socket: bound between Welcome and RegisterCaches, so that every reply a Pull can get comes
    # in one ordered stream. Any trouble falls back to ZMQ (the daemon does the same on its side).

    def _bind_fast(self, dealer: zmq.Socket, path: str) -> None:
        self._close_fast()
        fast = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fast.settimeout(1.0)  # a full listen backlog must not stall this thread
        try:
            fast.connect(path)
            self._watch_daemon(fast)
            fast.send(p.encode(p.BindCompletions(routing_id=self._routing_id)))
        except OSError as e:
            fast.close()
            self._fast_failed(dealer, f"cannot connect to {path}: {e}")
            return
        fast.setblocking(False)
        with self._fast_lock:
            self._fast = fast
        self._poller.register(fast.fileno(), zmq.POLLIN)
        self._set_state("connecting", "binding the completion socket")
        self._phase, self._deadline = "bind", time.monotonic() + self.reply_timeout_s

    def _fast_failed(self, dealer: zmq.Socket, reason: str) -> None:
        log.warning("kv-sidecar completion socket not used (%s); replies come over ZMQ", reason)
        self._close_fast()
        self._after_welcome(dealer)

    def _on_fast(self, dealer: zmq.Socket) -> None:
        assert self._fast is not None
        while self._fast is not None:
            try:
                data = self._fast.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                data, why = b"", str(e)
            else:
                why = "closed by the daemon"
            if not data:
                if self._phase == "bind":
                    self._fast_failed(dealer, why)
                elif self._phase in ("register", "ready"):
                    self._fast_lost(dealer, why)
                else:
                    self._close_fast()
                return
            self._on_payload(dealer, data, time.monotonic_ns())

    def _drain(self, dealer: zmq.Socket) -> None:
        """Take what the daemon sent before the connection ended, before its loss is reported: a daemon that
        stops answers its last pulls, then closes both sockets, and those answers may still wait unread
        here (this thread may see the disconnect, or a send failing on the completion socket, first).
        Closing the completion socket unread lost them."""
        while dealer.poll(0):
            self._on_frame(dealer)
        fast = self._fast
        while fast is not None and fast is self._fast:
            try:
                data = fast.recv(65536)
            except OSError:  # nothing more to read now (BlockingIOError), or the socket broke
                return
            if not data:
                return
            self._on_payload(dealer, data, time.monotonic_ns())

    def _fast_lost(self, dealer: zmq.Socket, why: str) -> None:
        """The bound completion socket broke. To the daemon that is this shim gone: it fails the pulls and
        releases the caches after ``owner_grace_s``, and what it had not read from the socket is lost. So end
        this connection as a ZMQ disconnect does (its loads become orphans) and start the next on the same
        ZMQ connection: Hello, bind and register again."""
        reason = f"kv-sidecar at {self.address}: completion socket {why}"
        log.warning("%s; saying Hello and registering again", reason)
        self._drain(dealer)  # a send can find the socket broken before what the daemon sent there is read
        self._close_fast()
        self._lose(reason)
        self._new_connection(dealer)

    def _watch_daemon(self, fast: socket.socket) -> None:
        """Watch the process behind the completion socket (the daemon) with a pidfd, for ``Gone``."""
        creds = fast.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid = struct.unpack("3i", creds)[0]
        if pid <= 0:
            return  # not visible from our pid namespace: the deadlines still bound every load
        for _pid, epochs in (v for v in self._daemons.values() if v[0] == pid):
            epochs.add(self._epoch)
            return
        try:
            pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError) as e:  # no pidfd (old kernel or Python), or it is gone already
            log.debug("kv-sidecar daemon pid %d not watched: %s", pid, e)
            return
        self._daemons[pidfd] = (pid, {self._epoch})
        self._poller.register(pidfd, zmq.POLLIN)
        if select.select([pidfd], [], [], 0)[0]:
            self._daemon_exited(pidfd)

    def _daemon_exited(self, pidfd: int) -> None:
        pid, epochs = self._daemons.pop(pidfd)
        with contextlib.suppress(KeyError):
            self._poller.unregister(pidfd)
        os.close(pidfd)
        self._events.append(
            Gone(frozenset(epochs), f"kv-sidecar daemon (pid {pid}) exited", time.monotonic_ns())
        )

    def _close_fast(self) -> None:
        if self._fast is None:
            return
        with contextlib.suppress(KeyError):
            self._poller.unregister(self._fast.fileno())
        with self._fast_lock:
            self._fast.close()
            self._fast = None

    def _refused(self, reason: str, at: int) -> None:
        self._phase, self._deadline = "idle", float("inf")
        self._set_state("failed", reason)
        self._events.append(Lost(reason, at, self._epoch))

    def _lose(self, reason: str) -> None:
        self._set_state("lost", reason)
        self._events.append(Lost(reason, time.monotonic_ns(), self._epoch))

    def _reply_failure(self, data: bytes, epoch: int, reason: str) -> None:
        """A message that was not sent: a Pull gets a failed Done (of its epoch) so its load ends now, and
        holds nothing back (no Abort waits for it, no direct send waits for its answer).

        An Abort gets nothing: the load was sent, so the daemon may still be writing; the Lost of its
        connection and what follows (``Gone``, an Abort on the next connection, the deadline) release it.
        """
        try:
            msg = p.decode_to_daemon(data)
        except p.DecodeError:
            return
        if isinstance(msg, p.Pull):
            if epoch == self._epoch:
                self._zmq_pulls.discard(msg.req_id)
            self._events.append(
                Reply(p.Done(req_id=msg.req_id, ok=False, reason=reason), time.monotonic_ns(), epoch)
            )


def _ends_pull(msg: p.ToShim) -> bool:
    """Whether ``msg`` answers a Pull for good: its Done or Aborted, or an Error refusing it (the worker
    fails the load on the same Error)."""
    if isinstance(msg, (p.Done, p.Aborted)):
        return True
    return isinstance(msg, p.Error) and msg.req_id is not None and msg.in_reply_to in ("Pull", None)


def _decoded(payload: bytes) -> p.ToDaemon | None:
    try:
        return p.decode_to_daemon(payload)
    except p.DecodeError:
        return None
