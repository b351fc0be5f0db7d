"""The shim's daemon client over real ZMQ ipc sockets, against a scripted ROUTER peer speaking
sidecar.wire.protocol.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import msgspec
import pytest
import zmq

from sidecar.wire import protocol as p
from sidecar.wire.formats import PageFormat
from sidecar.wire.ipc import IpcBuffer, LayerView, ShmFile
from vllm_glue.client import Lost, NotReady, Reply, SidecarClient

FMT = PageFormat(
    kind="aiter_shuffled", layout="LHBNC", dtype="bfloat16", num_heads=2, block_size=16, head_size=64
)


def register_msg() -> p.RegisterCaches:
    buf = IpcBuffer(kind="shm", nbytes=4096, device="cpu", shm=ShmFile(path="/dev/shm/x", data_offset=0))
    layer = LayerView(
        name="l0",
        buffer_index=0,
        offset_bytes=0,
        shape=[1, 2, 16, 128],
        strides=[4096, 2048, 128, 1],
        dtype="bfloat16",
    )
    return p.RegisterCaches(buffers=[buf], layers=[layer], page_format=FMT, compat_factors={"model": "m"})


def hello() -> p.Hello:
    return p.Hello(protocol_version=p.PROTOCOL_VERSION, package_version="test", pid=1)


def pull(req_id: str) -> p.Pull:
    return p.Pull(
        req_id=req_id,
        remote_engine_id="e",
        remote_host="127.0.0.1",
        remote_port=5600,
        remote_request_id=f"{req_id}-remote",
        remote_block_ids=p.pack_block_ids([1, 2]),
        local_block_ids=p.pack_block_ids([3, 4]),
        timeout_s=5,
    )


class DaemonEnd:
    """A ROUTER the test drives step by step; every frame it gets is decoded as the daemon would."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.identity = b""

    def recv(self, timeout_s: float = 5.0) -> p.ToDaemon:
        assert self.sock.poll(int(timeout_s * 1000)), "peer got nothing"
        ident, data = self.sock.recv_multipart()
        self.identity = ident
        return p.decode_to_daemon(data)

    def send(self, msg: p.ToShim) -> None:
        self.sock.send_multipart([self.identity, p.encode(msg)])

    def welcome_until_register(self) -> p.RegisterCaches:
        """Answer the Hello; return the RegisterCaches that follows (not answered yet)."""
        assert isinstance(self.recv(), p.Hello)
        self.send(p.Welcome(protocol_version=p.PROTOCOL_VERSION, package_version="t", device="cpu"))
        reg = self.recv()
        assert isinstance(reg, p.RegisterCaches)
        return reg

    def welcome_and_register(self) -> p.RegisterCaches:
        reg = self.welcome_until_register()
        self.send(p.Registered(generation=1, registered_bytes=4096, num_layers=1))
        return reg

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def wait_events(client: SidecarClient, n: int, timeout_s: float = 5.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got += client.poll_events()
        time.sleep(0.005)
    return got


def test_hello_register_pull_done(address: str) -> None:
    peer = DaemonEnd(address)
    client = SidecarClient(address, hello(), register_msg())
    try:
        reg = peer.welcome_and_register()
        assert reg.page_format == FMT
        assert client.wait_ready(5)
        t0 = time.monotonic_ns()
        client.send(pull("r1"))
        got = peer.recv()
        assert isinstance(got, p.Pull) and p.unpack_block_ids(got.local_block_ids).tolist() == [3, 4]
        peer.send(p.Done(req_id="r1", ok=True, timings={"transfer": 0.002}))
        (ev,) = wait_events(client, 1)
        assert isinstance(ev, Reply) and isinstance(ev.message, p.Done) and ev.message.ok
        assert ev.received_at_ns >= t0
    finally:
        client.close()
        peer.close()


def test_daemon_down_refuses_sends_then_registers_when_it_appears(address: str) -> None:
    client = SidecarClient(address, hello(), register_msg(), reply_timeout_s=5)
    try:
        assert not client.wait_ready(0.2)
        with pytest.raises(NotReady, match="connecting"):
            client.send(pull("r1"))
        peer = DaemonEnd(address)
        try:
            peer.welcome_and_register()
            assert client.wait_ready(5)
            client.send(pull("r2"))
            assert isinstance(peer.recv(), p.Pull)
        finally:
            peer.close()
    finally:
        client.close()


def test_disconnect_is_reported_and_reconnect_reregisters(address: str) -> None:
    peer = DaemonEnd(address)
    client = SidecarClient(address, hello(), register_msg())
    try:
        peer.welcome_and_register()
        assert client.wait_ready(5)
        peer.close()
        (ev,) = wait_events(client, 1)
        assert isinstance(ev, Lost) and "disconnected" in ev.reason
        with pytest.raises(NotReady, match="lost"):
            client.send(pull("r1"))
        peer = DaemonEnd(address)
        peer.welcome_and_register()  # Hello and RegisterCaches again, unprompted
        assert client.wait_ready(5)
    finally:
        client.close()
        peer.close()


def test_refused_registration_fails_with_the_reason(address: str) -> None:
    peer = DaemonEnd(address)
    client = SidecarClient(address, hello(), register_msg())
    try:
        peer.welcome_until_register()
        peer.send(p.Error(reason="page_format: no plan", in_reply_to="RegisterCaches"))
        assert not client.wait_ready(5)
        assert client.state == "failed" and "page_format: no plan" in client.status_reason
        with pytest.raises(NotReady, match="page_format"):
            client.send(pull("r1"))
    finally:
        client.close()
        peer.close()


def test_a_slow_registration_fails_for_now_and_a_late_registered_completes_it(address: str) -> None:
    """Registering maps the caches and registers them with NIXL, which can outlast a reply timeout. The
    register timeout is its own (the connector's sidecar_register_timeout_s was never passed down), and a
    Registered after it makes the client ready: it used to be ignored, the shim 'failed' for good while the
    daemon held the caches registered."""
    peer = DaemonEnd(address)
    client = SidecarClient(address, hello(), register_msg(), reply_timeout_s=5.0, register_timeout_s=0.3)
    try:
        peer.welcome_until_register()
        t0 = time.monotonic()
        assert not client.wait_ready(5)
        assert time.monotonic() - t0 < 3.0  # the register timeout (0.3 s), not reply_timeout_s (5 s)
        assert client.state == "failed"
        assert "no Registered from kv-sidecar within 0.3 s" in client.status_reason
        peer.send(p.Registered(generation=1, registered_bytes=4096, num_layers=1))
        deadline = time.monotonic() + 5
        while not client.is_ready():
            assert time.monotonic() < deadline, client.status_reason
            time.sleep(0.01)
        assert client.registered is not None
    finally:
        client.close()
        peer.close()


def test_an_error_about_another_message_does_not_refuse_the_registration(address: str) -> None:
    """An Error about a Heartbeat (or Unregister) of the connection before arriving while RegisterCaches
    waits for its answer used to be taken as the registration's refusal."""
    peer = DaemonEnd(address)
    client = SidecarClient(address, hello(), register_msg())
    try:
        peer.welcome_until_register()
        peer.send(p.Error(reason="say Hello before Heartbeat", in_reply_to="Heartbeat"))
        peer.send(p.Registered(generation=1, registered_bytes=4096, num_layers=1))
        assert client.wait_ready(5), client.status_reason
    finally:
        client.close()
        peer.close()


def test_protocol_mismatch_fails(address: str) -> None:
    peer = DaemonEnd(address)
    client = SidecarClient(address, hello(), register_msg())
    try:
        assert isinstance(peer.recv(), p.Hello)
        peer.send(p.Welcome(protocol_version=p.PROTOCOL_VERSION + 1, package_version="t", device="cpu"))
        assert not client.wait_ready(5)
        assert "protocol_version" in client.status_reason
    finally:
        client.close()
        peer.close()


def test_invalid_frame_is_dropped_and_client_keeps_running(address: str) -> None:
    peer = DaemonEnd(address)
    client = SidecarClient(address, hello(), register_msg())
    try:
        peer.welcome_and_register()
        assert client.wait_ready(5)
        peer.sock.send_multipart([peer.identity, b"\x93garbage"])
        peer.send(p.Done(req_id="r9", ok=False, reason="x"))
        (ev,) = wait_events(client, 1)
        assert ev.message.req_id == "r9"
    finally:
        client.close()
        peer.close()


class FastPeer(DaemonEnd):
    """The scripted peer with a completion socket, as the daemon offers one
    (``sidecar/daemon/completions.py``)."""

    def __init__(self, address: str, path: str) -> None:
        super().__init__(address)
        self.path = path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(path)
        self.listener.listen(4)
        self.listener.settimeout(5)
        self.fast: socket.socket | None = None

    def welcome(self) -> None:
        assert isinstance(self.recv(), p.Hello)
        self.send(p.Welcome(protocol_version=p.PROTOCOL_VERSION, package_version="t", device="cpu",
                            completion_socket=self.path))

    def accept_bind(self) -> p.BindCompletions:
        self.fast, _ = self.listener.accept()
        self.fast.settimeout(5)
        return p.decode_bind(self.fast.recv(65536))

    def send_fast(self, msg: p.ToShim) -> None:
        assert self.fast is not None
        self.fast.send(p.encode(msg))

    def recv_fast(self) -> p.ToDaemon:
        assert self.fast is not None
        return p.decode_on_completions(self.fast.recv(65536))

    def close(self) -> None:
        if self.fast is not None:
            self.fast.close()
        self.listener.close()
        super().close()


def bind_and_register(peer: FastPeer, client: SidecarClient) -> p.BindCompletions:
    """Answer Hello, the binding and RegisterCaches as the daemon does (the completion socket carrying the
    answers) and return the binding; the client ends ready."""
    peer.welcome()
    bind = peer.accept_bind()
    peer.send_fast(p.CompletionsBound(ok=True))
    assert isinstance(peer.recv(), p.RegisterCaches)
    peer.send_fast(p.Registered(generation=1, registered_bytes=4096, num_layers=1))
    assert client.wait_ready(5)
    return bind


def test_completion_socket_is_bound_before_registering_and_carries_replies(address: str, tmp_path) -> None:
    peer = FastPeer(address, f"{tmp_path}/d.sock.done")
    client = SidecarClient(address, hello(), register_msg())
    try:
        peer.welcome()
        bind = peer.accept_bind()
        assert bind.routing_id == peer.identity  # ties the two sockets to one shim
        assert not peer.sock.poll(200), "RegisterCaches sent before the completion socket was bound"
        peer.send_fast(p.CompletionsBound(ok=True))
        assert isinstance(peer.recv(), p.RegisterCaches)
        peer.send_fast(p.Registered(generation=1, registered_bytes=4096, num_layers=1))
        assert client.wait_ready(5)
        before = time.monotonic_ns()
        direct = client.sent_direct
        client.send(pull("r1"))
        # Protocol 3: once bound and registered, Pulls, Heartbeats and Aborts take the completion socket too.
        got_pull = peer.recv_fast()
        assert isinstance(got_pull, p.Pull) and got_pull.req_id == "r1"
        assert before <= got_pull.sent_at_ns <= time.monotonic_ns()  # the shim's send time, for "delivery"
        client.send(p.Heartbeat(targets=[]))
        client.send(p.Abort(req_id="r1"))
        assert isinstance(peer.recv_fast(), p.Heartbeat)
        assert peer.recv_fast() == p.Abort(req_id="r1")
        assert client.sent_direct == direct + 3  # from this thread: no hop to the I/O thread
        client.send(p.Ping(nonce=5))  # the rest stays on ZMQ
        assert peer.recv() == p.Ping(nonce=5)
        assert not peer.sock.poll(100), "a completion-socket request also went over ZMQ"
        peer.send_fast(p.Done(req_id="r1", ok=True))
        peer.send(p.Done(req_id="r0", ok=False, reason="over zmq"))  # ZMQ still delivers (daemon's fallback)
        got = {ev.message.req_id: ev.message.ok for ev in wait_events(client, 2)}
        assert got == {"r1": True, "r0": False}
    finally:
        client.close()
        peer.close()


def test_a_completion_socket_the_daemon_closes_ends_the_connection_and_the_shim_registers_again(
    address: str, tmp_path
) -> None:
    """The daemon takes the completion socket's end for the shim's: it releases the caches after
    ``owner_grace_s``. The client used to stay ready on ZMQ alone, and every later Pull was refused."""
    peer = FastPeer(address, f"{tmp_path}/d.sock.done")
    client = SidecarClient(address, hello(), register_msg())
    try:
        first = bind_and_register(peer, client)
        old = client.epoch
        peer.fast.close()
        peer.fast = None
        again = bind_and_register(peer, client)  # Hello on the same ZMQ connection, bind, RegisterCaches
        assert again.routing_id == first.routing_id  # the same shim: the daemon keeps it the owner
        assert client.epoch == old + 1 and client.uses_completion_socket
        (ev,) = wait_events(client, 1)
        assert isinstance(ev, Lost) and ev.epoch == old and "completion socket closed" in ev.reason
        client.send(pull("r1"))
        assert peer.recv_fast().req_id == "r1"
    finally:
        client.close()
        peer.close()


def test_a_send_that_finds_the_completion_socket_broken_ends_the_connection(address: str, tmp_path) -> None:
    """A send can meet the broken socket before its end of file is read. The Pull was sent over ZMQ instead,
    and the client stayed ready without its completion socket."""
    peer = FastPeer(address, f"{tmp_path}/d.sock.done")
    client = SidecarClient(address, hello(), register_msg())
    try:
        bind_and_register(peer, client)
        broken = peer.fast
        broken.shutdown(socket.SHUT_RD)  # the daemon reads no more: the shim's sends fail, no end of file
        old, epoch = client.sent_direct, client.epoch
        assert client.send(pull("r1")) == epoch
        bind_and_register(peer, client)  # asserts that Hello, not the Pull, came over ZMQ first
        broken.close()
        assert client.sent_direct == old and client.epoch == epoch + 1
        lost, failed = wait_events(client, 2)
        assert isinstance(lost, Lost) and lost.epoch == epoch and "send failed" in lost.reason
        assert isinstance(failed, Reply) and failed.epoch == epoch and failed.message.req_id == "r1"
        assert not failed.message.ok and "completion socket broke" in failed.message.reason
        client.send(pull("r2"))
        assert peer.recv_fast().req_id == "r2" and client.sent_direct == old + 1
    finally:
        client.close()
        peer.close()


def test_an_abort_never_overtakes_its_pull(address: str, tmp_path) -> None:
    """A Pull too large for one completion-socket packet goes over ZMQ, and so does its Abort (sent over the
    completion socket it could reach the daemon first, find nothing in flight, and be answered safe while the
    Pull still writes); a small Pull and its Abort both take the completion socket."""
    peer = FastPeer(address, f"{tmp_path}/d.sock.done")
    client = SidecarClient(address, hello(), register_msg())
    try:
        peer.welcome()
        peer.accept_bind()
        peer.send_fast(p.CompletionsBound(ok=True))
        assert isinstance(peer.recv(), p.RegisterCaches)
        peer.send_fast(p.Registered(generation=1, registered_bytes=4096, num_layers=1))
        assert client.wait_ready(5)
        big = p.pack_block_ids(range(20_000))  # 80 KB
        client.send(p.Pull(**{**msgspec.structs.asdict(pull("big")), "remote_block_ids": big,
                              "local_block_ids": big}))
        direct = client.sent_direct
        client.send(p.Abort(req_id="big"))
        client.send(pull("small"))
        client.send(p.Abort(req_id="small"))
        got_big = peer.recv()
        assert isinstance(got_big, p.Pull) and got_big.req_id == "big" and got_big.sent_at_ns > 0
        assert peer.recv() == p.Abort(req_id="big")
        assert peer.recv_fast().req_id == "small"
        assert peer.recv_fast() == p.Abort(req_id="small")
        assert client.sent_direct == direct  # a ZMQ Pull unanswered: everything waits its turn in the inbox
        peer.send(p.Aborted(req_id="big", safe=True))
        (ev,) = wait_events(client, 1)
        assert ev.message.req_id == "big"
        client.send(p.Abort(req_id="big"))  # answered: a later Abort of that id may take the fast way
        assert peer.recv_fast() == p.Abort(req_id="big")
    finally:
        client.close()
        peer.close()


def test_a_refused_zmq_pull_no_longer_holds_back_direct_sends(address: str, tmp_path) -> None:
    """A Pull that went over ZMQ holds every later Pull, Heartbeat and Abort to the I/O thread's way until it
    is answered. An Error refusing it is its answer too; it used to hold them back for good."""
    peer = FastPeer(address, f"{tmp_path}/d.sock.done")
    client = SidecarClient(address, hello(), register_msg())
    try:
        bind_and_register(peer, client)
        big = p.pack_block_ids(range(20_000))  # 80 KB: over ZMQ
        client.send(p.Pull(**{**msgspec.structs.asdict(pull("big")), "remote_block_ids": big,
                              "local_block_ids": big}))
        assert peer.recv().req_id == "big"
        peer.send(p.Error(reason="session: not yours", in_reply_to="Abort", req_id="big"))  # not the Pull's
        wait_events(client, 1)
        direct = client.sent_direct
        client.send(pull("a"))
        assert peer.recv_fast().req_id == "a" and client.sent_direct == direct
        peer.send(p.Error(reason="invalid Pull: timeout_s", in_reply_to="Pull", req_id="big"))
        (ev,) = wait_events(client, 1)
        assert isinstance(ev.message, p.Error) and ev.message.req_id == "big"
        client.send(pull("b"))
        assert peer.recv_fast().req_id == "b" and client.sent_direct == direct + 1
    finally:
        client.close()
        peer.close()


def test_close_with_a_full_queue_stops_the_io_thread(address: str, tmp_path) -> None:
    """close() queued its stop without waiting: when the I/O thread was behind (a full client queue) the stop
    was dropped, close() waited out its 5 s join, then terminated the context under the running thread,
    which failed ("Context was terminated")."""
    import threading

    from vllm_glue.client import _EPOCH, _FAST_DATA

    peer = FastPeer(address, f"{tmp_path}/d.sock.done")
    client = SidecarClient(address, hello(), register_msg())
    try:
        bind_and_register(peer, client)
        client._fast_lock.acquire()  # the I/O thread sends a Heartbeat, then waits here: a busy moment
        client._queued_fast += 1
        with client._send_lock:
            client._push.send(_FAST_DATA + _EPOCH.pack(client.epoch) + p.encode(p.Heartbeat(targets=[])))
        threading.Timer(0.5, client._fast_lock.release).start()
        with pytest.raises(NotReady, match="queue is full"):
            for n in range(100_000):
                client.send(p.Ping(nonce=n))
        t0 = time.monotonic()
        closing = threading.Thread(target=client.close, daemon=True)
        closing.start()
        closing.join(10)
        took = time.monotonic() - t0
        assert not closing.is_alive() and not client._thread.is_alive()
        assert client.state != "failed", client.status_reason
        assert took < 3.0, f"close() took {took:.1f} s"
    finally:
        client.close()
        peer.close()


@pytest.mark.parametrize("how", ["refused", "no such socket", "silent"])
def test_unusable_completion_socket_falls_back_to_zmq(address: str, tmp_path, how: str) -> None:
    peer = FastPeer(address, f"{tmp_path}/d.sock.done")
    client = SidecarClient(address, hello(), register_msg(), reply_timeout_s=1.0)
    try:
        assert isinstance(peer.recv(), p.Hello)
        path = peer.path if how != "no such socket" else f"{tmp_path}/missing.done"
        peer.send(p.Welcome(protocol_version=p.PROTOCOL_VERSION, package_version="t", device="cpu",
                            completion_socket=path))
        if how == "refused":
            peer.accept_bind()
            peer.send_fast(p.CompletionsBound(ok=False, reason="routing_id: unknown"))
        elif how == "silent":
            peer.accept_bind()  # and never answer: the reply timeout falls back
        assert isinstance(peer.recv(), p.RegisterCaches)
        peer.send(p.Registered(generation=1, registered_bytes=4096, num_layers=1))
        assert client.wait_ready(5)
        client.send(pull("r1"))
        assert isinstance(peer.recv(), p.Pull)
        peer.send(p.Done(req_id="r1", ok=True))
        (ev,) = wait_events(client, 1)
        assert ev.message.req_id == "r1"
    finally:
        client.close()
        peer.close()


def test_client_imports_without_torch_or_vllm() -> None:
    code = (
        "import sys, vllm_glue.client, vllm_glue.worker, vllm_glue.scheduler_book; "
        "bad = [m for m in ('torch', 'vllm', 'nixl') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_zmq_pull_that_could_not_be_sent_does_not_hold_back_direct_sends(address: str, tmp_path) -> None:
    """A Pull too large for the completion socket meets a full ZMQ queue (the daemon reads no ZMQ): it gets
    a local failed Done, but its req_id stayed among the unanswered ZMQ Pulls, so no Pull, Heartbeat or
    Abort took the direct path again until a reconnect."""
    peer = FastPeer(address, f"{tmp_path}/d.sock.done")
    peer.sock.setsockopt(zmq.RCVHWM, 1)  # for the pipe the client's connection makes: little room here
    client = SidecarClient(address, hello(), register_msg())
    try:
        bind_and_register(peer, client)
        big = p.pack_block_ids(range(9_000))  # 72 KB: over ZMQ
        probes: list[str] = []
        failed: list = []
        for i in range(40):  # fill the client's ZMQ queue with Pings until a big Pull cannot go out
            probes.append(f"big{i}")
            probe = p.Pull(**{**msgspec.structs.asdict(pull(probes[-1])), "remote_block_ids": big,
                              "local_block_ids": big})
            for msg in [p.Ping(nonce=n) for n in range(2_000)] + [probe]:
                while True:
                    try:
                        client.send(msg)
                        break
                    except NotReady:  # the inbox is full: the I/O thread catches up
                        time.sleep(0.001)
            failed += [ev.message for ev in wait_events(client, 1, 0.3) if isinstance(ev, Reply)]
            if failed:
                break
        failed += [ev.message for ev in wait_events(client, 1, 0.3) if isinstance(ev, Reply)]
        assert failed and all(not m.ok and "send would block" in m.reason for m in failed)
        arrived: list[str] = []
        while peer.sock.poll(500):  # the daemon reads again: the big Pulls that went out are answered
            got = peer.recv()
            if isinstance(got, p.Pull):
                peer.send_fast(p.Done(req_id=got.req_id, ok=True))
                arrived.append(got.req_id)
        assert sorted(arrived + [m.req_id for m in failed]) == sorted(probes)
        assert len(wait_events(client, len(arrived))) == len(arrived)
        direct = client.sent_direct
        client.send(pull("small"))
        assert peer.recv_fast().req_id == "small"
        assert client.sent_direct == direct + 1, "a Pull that never went out still holds back direct sends"
    finally:
        client.close()
        peer.close()
