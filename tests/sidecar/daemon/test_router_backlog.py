"""A peer that does not read its replies, or sends faster than the loop serves. At most ``reply_backlog``
replies wait for it on each socket, the rest are dropped and counted (ZMQ), or its completion socket is
closed (the replies waiting there dropped and counted); ZMQ reads at most ``request_backlog`` requests of it
ahead of the loop; a flood holds no other task of the loop. Real sockets, an in-process daemon on
``FakePort``, small backlogs."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import zmq

from sidecar.daemon.app import Daemon
from sidecar.daemon.router import REQUEST_BACKLOG, TAKES_PER_YIELD
from sidecar.ops.config import Config
from sidecar.standins.fake_transfer import FakePort
from sidecar.wire import protocol as p

BACKLOG = 50
HELLO = p.Hello(protocol_version=p.PROTOCOL_VERSION, package_version="test")


@contextlib.asynccontextmanager
async def serving(tmp_path, requests: int = BACKLOG):
    """A started daemon whose router lets ``BACKLOG`` replies wait for a peer, and ``requests`` from it; its
    ZMQ endpoint."""
    path = f"{tmp_path}/gpu0.sock"
    daemon = Daemon(Config(socket=f"ipc://{path}", metrics_port=-1), make_port=lambda _c: FakePort())
    daemon.router.reply_backlog, daemon.router.request_backlog = BACKLOG, requests
    await daemon.start()
    try:
        yield daemon, f"ipc://{path}"
    finally:
        await daemon.shutdown(0)


def sample(daemon: Daemon, name: str, **labels: str) -> float:
    value = daemon.metrics.registry.get_sample_value(name, labels)
    assert value is not None, name
    return value


def dropped(daemon: Daemon, reason: str = "backlog") -> float:
    return sample(daemon, "kv_sidecar_replies_dropped_total", reason=reason)


async def until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def dealer(ctx: zmq.Context, endpoint: str, routing_id: bytes) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.setsockopt(zmq.RCVHWM, 1)  # hold as little as the client side may: the daemon holds the rest
    sock.connect(endpoint)
    return sock


def ask(sock: zmq.Socket, msg, timeout_s: float = 5.0):
    sock.send(p.encode(msg))
    assert sock.poll(int(timeout_s * 1000)), f"no answer to {type(msg).__name__}"
    return p.decode_to_shim(sock.recv())


def drain(sock: zmq.Socket, quiet_ms: int = 300) -> list[p.ToShim]:
    got = []
    while sock.poll(quiet_ms):
        got.append(p.decode_to_shim(sock.recv()))
    return got


def read_or_reset(sock: socket.socket) -> bytes:
    """One packet; b"" at the end, which is a reset when the daemon closed with our packets unread."""
    try:
        return sock.recv(65536)
    except ConnectionResetError:
        return b""


def test_a_peer_that_never_reads_is_dropped_past_the_backlog_while_others_are_served(tmp_path):
    """Main: SNDHWM=0 queued every reply for a peer that never read them (~200 bytes an Error, without
    bound). Now the daemon's queue for it stops growing once full: every later reply is dropped and counted,
    each one accounted for (delivered once it reads, or counted), and another client is served throughout."""
    rounds, flood = 8, 2000

    async def main():
        async with serving(tmp_path) as (daemon, endpoint):
            ctx = zmq.Context()
            stuck, good = dealer(ctx, endpoint, b"stuck"), dealer(ctx, endpoint, b"good")
            sent = 0

            def invalid() -> float:
                return sample(daemon, "kv_sidecar_invalid_messages_total")

            async def flood_once() -> int:
                """``flood`` frames, each answered with an Error; how many of them went into a queue."""
                nonlocal sent
                before, lost = invalid(), dropped(daemon)
                await asyncio.to_thread(lambda: [stuck.send(b"\xc1") for _ in range(flood)])
                sent += flood
                await until(lambda: invalid() == before + flood)
                await asyncio.sleep(0.1)  # ZMQ's I/O thread moves what it can into the kernel's buffer
                return flood - int(dropped(daemon) - lost)

            try:
                assert isinstance(await asyncio.to_thread(ask, good, HELLO), p.Welcome)
                flooding = asyncio.ensure_future(flood_once())
                for nonce in range(5):  # served while the flood is worked through
                    pong = await asyncio.to_thread(ask, good, p.Ping(nonce=nonce))
                    assert isinstance(pong, p.Pong) and pong.nonce == nonce
                queued = [await flooding]
                while queued[-1] and len(queued) < rounds:
                    queued.append(await flood_once())
                assert queued[-1] == 0, f"the queue kept growing: {queued}"
                assert await flood_once() == 0  # full stays full: no reply more is held
                assert dropped(daemon) > 0 and dropped(daemon, "gone") == dropped(daemon, "error") == 0
                assert isinstance(await asyncio.to_thread(ask, good, p.Ping(nonce=9)), p.Pong)

                received = await asyncio.to_thread(drain, stuck)
                assert all(isinstance(m, p.Error) and "malformed" in m.reason for m in received)
                assert len(received) + dropped(daemon) == sent, "a reply neither delivered nor counted"
                assert BACKLOG <= len(received) < sent // 2, (len(received), sent)
                # read, it is served again
                assert isinstance(await asyncio.to_thread(ask, stuck, p.Ping(nonce=1)), p.Pong)
            finally:
                stuck.close(0)
                good.close(0)
                ctx.term()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_bound_shim_that_never_reads_its_completion_socket_is_cut_off_and_falls_back_to_zmq(tmp_path):
    """The completion socket queued without bound behind the kernel's buffer for a shim that did not read
    it. Now, with ``BACKLOG`` replies waiting, the connection is closed and those replies (and the one that
    did not fit) are dropped and counted; what the kernel held still reaches the shim, in order, then the
    close, and its replies go over ZMQ from then on."""

    async def main():
        async with serving(tmp_path) as (daemon, endpoint):
            ctx = zmq.Context()
            shim = dealer(ctx, endpoint, b"shim")
            fast = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                welcome = await asyncio.to_thread(ask, shim, HELLO)
                fast.settimeout(10)
                fast.connect(welcome.completion_socket)
                fast.send(p.encode(p.BindCompletions(routing_id=b"shim")))
                bound = p.decode_to_shim(await asyncio.to_thread(fast.recv, 65536))
                assert bound == p.CompletionsBound(ok=True)

                def abort_until_cut_off() -> int:
                    """Aborts over the completion socket (each answered there), none of it read; how many
                    went out before the daemon closed it."""
                    for i in range(100_000):
                        try:
                            fast.send(p.encode(p.Abort(req_id=f"r{i}")))
                        except OSError:
                            return i
                    raise AssertionError("never cut off")

                sent = await asyncio.to_thread(abort_until_cut_off)
                await until(lambda: not daemon.router.completions.bound(b"shim"))
                assert dropped(daemon) == BACKLOG + 1
                answered = []
                while data := await asyncio.to_thread(read_or_reset, fast):  # the kernel's, then the close
                    answered.append(p.decode_to_shim(data))
                assert all(isinstance(m, p.Aborted) and m.safe for m in answered)
                assert [m.req_id for m in answered] == [f"r{i}" for i in range(len(answered))], "out of order"
                assert len(answered) + BACKLOG + 1 <= sent
                assert isinstance(await asyncio.to_thread(ask, shim, p.Ping(nonce=3)), p.Pong)  # over ZMQ
                assert dropped(daemon, "gone") == dropped(daemon, "error") == 0
            finally:
                fast.close()
                shim.close(0)
                ctx.term()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_peer_that_sends_faster_than_the_loop_serves_is_held_back_and_loses_nothing(tmp_path):
    """Main: RCVHWM=0 let ZMQ read whatever a client sent into the daemon's memory while the loop worked
    through it (200,000 invalid 1 KB frames: 315 MB). Now ZMQ stops reading a peer ``BACKLOG`` requests
    ahead of the loop: its sends back up to it. Once the loop runs again every frame is served."""
    frame = b"\xc1" * 1024  # invalid: each answered with an Error, none read here

    async def main():
        async with serving(tmp_path) as (daemon, endpoint):
            ctx = zmq.Context()
            flood = dealer(ctx, endpoint, b"flood")
            flood.setsockopt(zmq.SNDHWM, 1)
            try:
                assert isinstance(await asyncio.to_thread(ask, flood, p.Ping(nonce=1)), p.Pong)
                before = sample(daemon, "kv_sidecar_invalid_messages_total")
                # Sent from the loop's own thread: the daemon takes nothing meanwhile, only ZMQ's I/O
                # thread reads, into its queue for this peer.
                sent, deadline = 0, time.monotonic() + 10
                while sent < 100_000 and time.monotonic() < deadline:
                    try:
                        flood.send(frame, zmq.NOBLOCK)
                    except zmq.Again:
                        if not flood.poll(200, zmq.POLLOUT):  # the I/O threads have moved all they will
                            break
                    else:
                        sent += 1
                assert sent < 2_000, f"{sent} frames of 1 KB queued for a loop that took none"
                await until(lambda: sample(daemon, "kv_sidecar_invalid_messages_total") == before + sent)
            finally:
                flood.close(0)
                ctx.term()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_flood_of_requests_does_not_hold_the_other_tasks_of_the_loop(tmp_path):
    """Main: awaiting a message ZMQ held already never yielded, so while a peer kept the socket full no other
    task ran (a flood of 300,000 frames: no /healthz tick for 12 s, then "event loop stalled"). Now the
    receive loop lets them in every ``TAKES_PER_YIELD`` messages."""
    frames = 3000

    async def main():
        async with serving(tmp_path, requests=REQUEST_BACKLOG) as (daemon, endpoint):
            ctx = zmq.Context()
            flood = dealer(ctx, endpoint, b"flood")
            flood.setsockopt(zmq.SNDHWM, 0)
            try:
                assert isinstance(await asyncio.to_thread(ask, flood, p.Ping(nonce=1)), p.Pong)
                before = sample(daemon, "kv_sidecar_invalid_messages_total")
                for _ in range(frames):  # from the loop's thread: all queued before the loop takes one
                    flood.send(b"\xc1", zmq.NOBLOCK)
                time.sleep(0.3)  # the loop held still while ZMQ's I/O threads carry them into its queue
                seen = []

                async def other_task():
                    while not seen or seen[-1] < before + frames:
                        seen.append(sample(daemon, "kv_sidecar_invalid_messages_total"))
                        await asyncio.sleep(0)

                await asyncio.wait_for(other_task(), 20)
                steps = [b - a for a, b in zip(seen, seen[1:], strict=False)]
                assert max(steps) <= 2 * TAKES_PER_YIELD, f"{max(steps)} messages taken while it waited"
            finally:
                flood.close(0)
                ctx.term()

    asyncio.run(asyncio.wait_for(main(), 60))

