"""The router's sessions: one per routing id, forgotten once there are too many and it holds nothing. Each
shim (re)start and each ``kv-sidecar doctor`` run connects with a new routing id and says Hello, and ZMQ
never tells the ROUTER that one left."""

from __future__ import annotations

import asyncio
import socket

from sidecar.daemon.completions import completion_path
from sidecar.daemon.router import MAX_SESSIONS, Router
from sidecar.ops.metrics import Metrics
from sidecar.wire import protocol as p
from tests.sidecar.daemon.test_logic import run, started

HELLO = p.Hello(protocol_version=p.PROTOCOL_VERSION, package_version="test")


def test_sessions_of_gone_connections_are_forgotten_and_one_that_speaks_again_starts_over():
    """Main: the router added a session per routing id and never removed one (2 x MAX_SESSIONS doctor runs
    left 2 x MAX_SESSIONS sessions). The shim that registered the caches stays through it all."""

    async def main():
        async with started() as h:
            router = h.daemon.router
            owner = router.session(b"shim")
            runs = [b"doctor-%d" % i for i in range(2 * MAX_SESSIONS)]
            for who in runs:
                h.send(HELLO, who)
            remembered = [who for who in runs if router.session(who) is not None]
            assert len(remembered) < MAX_SESSIONS
            assert remembered == runs[-len(remembered):], "not the longest idle forgotten"
            assert router.session(b"shim") is owner and owner.hello is not None
            h.pull("a")  # the owner, the oldest of all, pulls without a new Hello
            assert (await h.reply(p.Done, "a")).ok

            first = runs[0]
            h.send(p.Heartbeat(targets=[]), first)
            (error,) = [m for env, m in h.sent if env == [first] and isinstance(m, p.Error)]
            assert error.reason == "say Hello before Heartbeat"
            h.send(HELLO, first)
            h.send(p.Heartbeat(targets=[]), first)
            replies = [type(m) for env, m in h.sent if env == [first]]
            assert replies == [p.Welcome, p.Error, p.Welcome], replies

    run(main())


def test_a_session_bound_on_the_completion_socket_or_kept_by_the_daemon_stays(tmp_path):
    """Real sockets: a shim bound on the completion socket is live however idle, and one the daemon keeps
    (``keep``: it owns the caches, a pull of it is in flight) must not have to say Hello again."""
    path = f"{tmp_path}/gpu0.sock"
    kept = {b"busy"}

    async def main():
        router = Router(Metrics(), keep=lambda session: session.identity in kept, max_sessions=8)
        router.on(p.Hello, lambda _env, session, msg, _t: setattr(session, "hello", msg))
        router.on(p.Ping, lambda _env, _session, _msg, _t: None)
        router.bind(f"ipc://{path}", path, None, fast_completions=True, max_connections=4,
                    on_closed=lambda _rid: None)
        fast = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            for who in (b"bound", b"busy", b"idle"):
                router.dispatch([who], HELLO, 0.0)  # the longest idle of all
            fast.settimeout(10)
            fast.connect(completion_path(path))
            fast.send(p.encode(p.BindCompletions(routing_id=b"bound")))
            bound = p.decode_to_shim(await asyncio.to_thread(fast.recv, 65536))
            assert isinstance(bound, p.CompletionsBound) and bound.ok, bound
            for i in range(20):
                router.dispatch([b"doctor-%d" % i], p.Ping(nonce=i), float(i + 1))
            assert router.session(b"idle") is None
            assert router.session(b"bound").hello is not None and router.session(b"busy").hello is not None
            doctors = [i for i in range(20) if router.session(b"doctor-%d" % i) is not None]
            assert doctors == list(range(14, 20)), doctors  # the newest, beside the two that stay
        finally:
            fast.close()
            router.close()

    asyncio.run(asyncio.wait_for(main(), 30))
