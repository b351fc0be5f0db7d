"""The daemon's completion socket, against a real ``kv-sidecar serve``: raw SOCK_SEQPACKET and ZMQ clients."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import tempfile
import time

import msgspec
import pytest
import zmq

from sidecar.cli import spawn_serve
from sidecar.daemon.completions import CompletionSocket, completion_path
from sidecar.wire import ipc
from sidecar.wire import protocol as p
from sidecar.wire.formats import PageFormat


class Client:
    """A shim's two sockets to the daemon: the ZMQ DEALER (with a routing id) and the completion socket."""

    def __init__(self, endpoint: str, routing_id: bytes = b"shim-test") -> None:
        self.ctx = zmq.Context()
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.ROUTING_ID, routing_id)
        self.dealer.connect(endpoint)
        self.routing_id = routing_id
        self.fast: socket.socket | None = None

    def hello(self) -> p.Welcome:
        self.dealer.send(p.encode(p.Hello(protocol_version=p.PROTOCOL_VERSION, package_version="t")))
        welcome = self.recv_zmq()
        assert isinstance(welcome, p.Welcome), welcome
        return welcome

    def recv_zmq(self, timeout_s: float = 10.0) -> p.ToShim:
        assert self.dealer.poll(int(timeout_s * 1000)), "nothing on the ZMQ socket"
        return p.decode_to_shim(self.dealer.recv())

    def connect_fast(self, path: str) -> socket.socket:
        self.fast = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.fast.settimeout(10)
        self.fast.connect(path)
        return self.fast

    def recv_fast(self) -> p.ToShim | None:
        assert self.fast is not None
        data = self.fast.recv(65536)
        return p.decode_to_shim(data) if data else None

    def bind(self, path: str) -> p.ToShim | None:
        self.connect_fast(path).send(p.encode(p.BindCompletions(routing_id=self.routing_id)))
        return self.recv_fast()

    def close(self) -> None:
        if self.fast is not None:
            self.fast.close()
        self.dealer.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    directory = tmp_path_factory.mktemp("completions")
    endpoint = f"ipc://{directory}/run/gpu.sock"
    proc = spawn_serve(["--socket", endpoint, "--metrics-port", "-1"])
    yield endpoint
    assert proc.stop() == 0
    assert not os.path.exists(completion_path(endpoint.removeprefix("ipc://"))), "socket file left behind"


@pytest.fixture
def client(daemon):
    made: list[Client] = []

    def make(routing_id: bytes = b"shim-test") -> Client:
        made.append(Client(daemon, routing_id))
        return made[-1]

    yield make
    for c in made:
        c.close()


def test_welcome_offers_an_owner_only_socket_and_binding_moves_the_replies_there(daemon, client):
    c = client(b"shim-moves")
    welcome = c.hello()
    path = welcome.completion_socket
    assert path == completion_path(daemon.removeprefix("ipc://"))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_ISSOCK(os.stat(path).st_mode)
    assert c.bind(path) == p.CompletionsBound(ok=True)
    c.dealer.send(p.encode(p.Ping(nonce=7)))
    pong = c.recv_fast()
    assert isinstance(pong, p.Pong) and pong.nonce == 7
    assert not c.dealer.poll(100), "a bound shim's reply also went over ZMQ"
    # Errors too: one ordered stream.
    c.dealer.send(b"\x91")
    err = c.recv_fast()
    assert isinstance(err, p.Error) and "Expected `object`" in err.reason


def test_garbage_on_a_bound_socket_is_answered_with_an_error_and_the_binding_stays(client):
    c = client(b"shim-twice")
    path = c.hello().completion_socket
    assert c.bind(path) == p.CompletionsBound(ok=True)
    for packet, needle in [
        (b"\xc1", "malformed"),
        (b"anything", "Expected `object`"),
        (p.encode(p.BindCompletions(routing_id=b"shim-twice")), "already bound"),
        (p.encode(p.Hello(protocol_version=p.PROTOCOL_VERSION, package_version="t")), "main (ZMQ) socket"),
        (p.encode(p.Ping(nonce=3)), "main (ZMQ) socket"),
        (p.encode(p.Welcome(protocol_version=3, package_version="t", device="cpu")), "travels daemon→shim"),
    ]:
        c.fast.send(packet)
        err = c.recv_fast()
        assert isinstance(err, p.Error) and needle in err.reason, (packet, err)
    c.dealer.send(p.encode(p.Ping(nonce=1)))
    assert isinstance(c.recv_fast(), p.Pong)


def _pull(req_id: str, **kw) -> p.Pull:
    values = {
        "req_id": req_id,
        "remote_engine_id": "prefill-0",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_request_id": f"r-{req_id}",
        "remote_block_ids": p.pack_block_ids([1, 2]),
        "local_block_ids": p.pack_block_ids([3, 4]),
        "timeout_s": 5.0,
        **kw,
    }
    return p.Pull(**values)


def test_pull_heartbeat_and_abort_over_the_completion_socket_are_served_there(client):
    """Protocol 3: a bound shim's requests travel on the completion socket and are answered there (this
    daemon has no caches, so the Pull is refused by the pipeline: it went all the way through it)."""
    c = client(b"shim-requests")
    assert c.bind(c.hello().completion_socket) == p.CompletionsBound(ok=True)
    sent = time.monotonic_ns()
    c.fast.send(p.encode(_pull("fast-1", sent_at_ns=sent)))
    done = c.recv_fast()
    assert isinstance(done, p.Done) and done.req_id == "fast-1" and not done.ok, done
    assert "caches" in done.reason
    delivery = done.timings["delivery"]
    assert 0 < delivery < (time.monotonic_ns() - sent) / 1e9
    c.fast.send(p.encode(p.Heartbeat(targets=[])))  # no reply
    c.fast.send(p.encode(p.Abort(req_id="never-pulled")))
    aborted = c.recv_fast()
    assert aborted == p.Aborted(req_id="never-pulled", safe=True, reason=aborted.reason) and aborted.safe
    assert not c.dealer.poll(100), "a reply to a completion-socket request went over ZMQ"


def test_a_malformed_pull_on_the_completion_socket_gets_an_error_naming_it(client):
    c = client(b"shim-bad-pull")
    assert c.bind(c.hello().completion_socket) == p.CompletionsBound(ok=True)
    fields = msgspec.to_builtins(_pull("bad-1"), builtin_types=(bytes,))
    bad = msgspec.msgpack.encode({**fields, "remote_port": 0})
    c.fast.send(bad)
    err = c.recv_fast()
    assert isinstance(err, p.Error) and err.in_reply_to == "Pull" and err.req_id == "bad-1", err
    assert "remote_port" in err.reason
    c.fast.send(p.encode(_pull("good-1")))  # and the next one is served
    done = c.recv_fast()
    assert isinstance(done, p.Done) and done.req_id == "good-1"
    assert "delivery" not in done.timings  # no send time given, none claimed


def _register_cuda(**handle) -> bytes:
    """A RegisterCaches frame of one CUDA IPC buffer whose handle carries ``handle``'s fields."""
    cuda = {"device": 0, "handle": b"h" * 66, "storage_size_bytes": 8192, "storage_offset_bytes": 0,
            "ref_counter_handle": b"/torch_1_2_3", "ref_counter_offset": 0, **handle}
    fmt = PageFormat(kind="standard", layout="LBHNC", dtype="bfloat16", num_heads=1, block_size=16,
                     head_size=128)
    layer = ipc.LayerView(name="l0", buffer_index=0, offset_bytes=0, shape=[2, 1, 16, 256],
                          strides=[4096, 4096, 256, 1], dtype="bfloat16")
    return msgspec.msgpack.encode({"type": "RegisterCaches", "page_format": msgspec.to_builtins(fmt),
                                   "buffers": [{"kind": "cuda", "nbytes": 8192, "device": "cuda:0",
                                                "cuda": cuda}],
                                   "layers": [msgspec.to_builtins(layer)]})


@pytest.mark.parametrize(("handle", "field"), [
    ({"ref_counter_offset": 2**40}, "ref_counter_offset"),  # torch's deleter would write at that slot
    ({"storage_offset_bytes": -4096}, "storage_offset_bytes"),
])
def test_a_cuda_handle_out_of_bounds_is_refused_naming_the_field_and_the_daemon_serves_on(
        client, handle, field):
    c = client(b"shim-cuda-handle")
    c.hello()
    c.dealer.send(_register_cuda(**handle))
    err = c.recv_zmq()
    assert isinstance(err, p.Error) and err.in_reply_to == "RegisterCaches", err
    assert f"$.buffers[0].cuda.{field}" in err.reason, err.reason
    c.dealer.send(p.encode(p.Ping(nonce=11)))
    pong = c.recv_zmq()
    assert isinstance(pong, p.Pong) and pong.nonce == 11


def _register_shm(shm: ipc.ShmBuffer, factors: dict) -> bytes:
    """A RegisterCaches frame of one layer in ``shm`` (64 KiB) whose compat_factors are ``factors``."""
    fmt = PageFormat(kind="aiter_shuffled", layout="LHBNC", dtype="bfloat16", num_heads=2, block_size=16,
                     head_size=64)
    layer = ipc.LayerView(name="l0", buffer_index=0, offset_bytes=0, shape=[8, 2, 16, 128],
                          strides=[2048, 16384, 128, 1], dtype="bfloat16")
    return msgspec.msgpack.encode({"type": "RegisterCaches", "page_format": msgspec.to_builtins(fmt),
                                   "buffers": [msgspec.to_builtins(shm.description)],
                                   "layers": [msgspec.to_builtins(layer)], "compat_factors": factors})


def test_compat_factors_json_cannot_hash_are_refused_at_registration_naming_them(client):
    """bytes (or a dict with an int key) registered fine, then every handshake's hash raised TypeError."""
    c = client(b"shim-factors")
    c.hello()
    shm = ipc.create_shm_buffer(65536)
    try:
        for factors in ({"model": b"m"}, {"spec": {1: "a", "b": 2}}):
            c.dealer.send(_register_shm(shm, {"attn_backend_name": "X", **factors}))
            err = c.recv_zmq()
            assert isinstance(err, p.Error) and err.in_reply_to == "RegisterCaches", err
            assert "compat_factors[" in err.reason, err.reason
        c.dealer.send(_register_shm(shm, {"attn_backend_name": "X", "model": "m"}))
        assert isinstance(c.recv_zmq(), p.Registered)
        c.dealer.send(p.encode(p.Unregister()))
        assert isinstance(c.recv_zmq(), p.Unregistered)
    finally:
        shm.close()


def test_a_pull_whose_reply_would_outgrow_a_packet_is_refused_in_one(client):
    """A 70 KB remote_host failed its handshake with a reason quoting it: a Done the shim's 64 KiB read cut,
    so the request hung to its deadline (~300 KB: EMSGSIZE, and the completion connection dropped)."""
    c = client(b"shim-long-host")
    assert c.bind(c.hello().completion_socket) == p.CompletionsBound(ok=True)
    shm = ipc.create_shm_buffer(65536)
    try:
        c.dealer.send(_register_shm(shm, {"attn_backend_name": "X"}))  # so that the Pull gets to a handshake
        assert isinstance(c.recv_fast(), p.Registered)
        # past the 5 s handshake timeout, whose reason quoted the address
        fields = msgspec.to_builtins(_pull("long-host", timeout_s=8.0), builtin_types=(bytes,))
        c.dealer.send(msgspec.msgpack.encode({**fields, "remote_host": "h" * 70_000}))  # past a packet: ZMQ
        err = c.recv_fast()
        assert isinstance(err, p.Error) and err.req_id == "long-host", err
        assert "remote_host must be at most 255 characters" in err.reason
        c.dealer.send(p.encode(p.Unregister()))
        assert isinstance(c.recv_fast(), p.Unregistered)
    finally:
        shm.close()


@pytest.mark.parametrize("size", [100_000, 300_000])
def test_a_reply_quoting_a_huge_field_still_fits_the_shims_read(client, size):
    c = client(b"shim-huge-type")
    assert c.bind(c.hello().completion_socket) == p.CompletionsBound(ok=True)
    c.dealer.send(msgspec.msgpack.encode({"type": "T" * size, "req_id": "r" * size}))
    data = c.fast.recv(65536 + 1)
    assert len(data) <= 65536
    err = p.decode_to_shim(data)
    assert isinstance(err, p.Error) and "unknown message type 'TTT" in err.reason, err
    assert len(err.reason) == p.MAX_REASON_CHARS and err.reason.endswith(" characters in all]")
    assert err.in_reply_to is None and err.req_id is None  # too long to be a message's: not echoed
    c.dealer.send(p.encode(p.Ping(nonce=5)))
    pong = c.recv_fast()
    assert isinstance(pong, p.Pong) and pong.nonce == 5


def test_a_reply_longer_than_a_packet_goes_over_zmq():
    """The last guard: whatever the daemon would send past what the shim reads of a packet takes ZMQ."""

    async def main(path):
        fell_back = []
        loop = asyncio.get_running_loop()
        cs = CompletionSocket(path, loop, may_bind=lambda _rid: None,
                              fallback=lambda rid, data: fell_back.append((rid, data)), max_backlog=16)
        shim = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            shim.connect(path)
            shim.setblocking(False)
            shim.send(p.encode(p.BindCompletions(routing_id=b"rid")))
            bound = await loop.sock_recv(shim, 65536)
            assert p.decode_to_shim(bound) == p.CompletionsBound(ok=True)
            assert not cs.send(b"rid", b"x" * 65537)
            assert cs.send(b"rid", b"y" * 65536)
            assert await loop.sock_recv(shim, 65536) == b"y" * 65536
            assert cs.bound(b"rid") and not fell_back
        finally:
            shim.close()
            cs.close()

    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(asyncio.wait_for(main(os.path.join(tmp, "c.sock")), 10))


def test_a_pull_before_binding_is_refused_as_a_bind(daemon, client):
    raw = client(b"shim-unbound")
    raw.hello()
    raw.connect_fast(completion_path(daemon.removeprefix("ipc://"))).send(p.encode(_pull("early")))
    answer = raw.recv_fast()
    assert isinstance(answer, p.CompletionsBound) and not answer.ok and "BindCompletions" in answer.reason


@pytest.mark.parametrize(
    ("packet", "needle"),
    [
        (b"\xc1", "malformed"),
        (p.encode(p.Ping()), "not a completion-socket message"),
        (p.encode(p.BindCompletions(routing_id=b"shim-nobody")), "routing_id: no shim with this routing id"),
        (b"\x82\xa4type\xafBindCompletions\xaarouting_id\xc4\x01\x00", "zero byte"),
    ],
)
def test_a_bad_bind_is_refused_with_a_reason_and_the_daemon_keeps_serving(daemon, client, packet, needle):
    raw = client(b"shim-raw")
    raw.connect_fast(completion_path(daemon.removeprefix("ipc://"))).send(packet)
    answer = raw.recv_fast()
    assert isinstance(answer, p.CompletionsBound) and not answer.ok and needle in answer.reason, answer
    assert raw.recv_fast() is None, "a refused connection is closed"
    ok = client(b"shim-after")
    assert ok.bind(ok.hello().completion_socket) == p.CompletionsBound(ok=True)


def test_a_closed_completion_socket_falls_back_to_zmq(client):
    c = client(b"shim-closes")
    assert c.bind(c.hello().completion_socket) == p.CompletionsBound(ok=True)
    c.fast.close()
    c.fast = None
    for nonce in range(3):  # the first send may find the socket still open: it must not be lost either way
        c.dealer.send(p.encode(p.Ping(nonce=nonce)))
        pong = c.recv_zmq()
        assert isinstance(pong, p.Pong) and pong.nonce == nonce


def test_rebinding_replaces_the_old_connection(client):
    c = client(b"shim-rebind")
    path = c.hello().completion_socket
    assert c.bind(path) == p.CompletionsBound(ok=True)
    old = c.fast
    assert c.bind(path) == p.CompletionsBound(ok=True)
    assert old.recv(65536) == b"", "the replaced connection is closed"
    old.close()
    c.dealer.send(p.encode(p.Ping(nonce=9)))
    pong = c.recv_fast()
    assert isinstance(pong, p.Pong) and pong.nonce == 9


def test_disabled_fast_completions_offer_no_socket(tmp_path):
    endpoint = f"ipc://{tmp_path}/run/gpu.sock"
    proc = spawn_serve(["--socket", endpoint, "--metrics-port", "-1", "--fast-completions", "false"])
    c = Client(endpoint)
    try:
        assert c.hello().completion_socket == ""
        assert not os.path.exists(completion_path(endpoint.removeprefix("ipc://")))
        c.dealer.send(p.encode(p.Ping(nonce=3)))
        pong = c.recv_zmq()
        assert isinstance(pong, p.Pong) and pong.nonce == 3
    finally:
        c.close()
        assert proc.stop() == 0


def test_a_protocol_2_shim_is_refused_with_both_versions_named(daemon, client):
    c = client(b"shim-old")
    c.dealer.send(p.encode(p.Hello(protocol_version=2, package_version="old")))
    err = c.recv_zmq()
    assert isinstance(err, p.Error) and err.in_reply_to == "Hello", err
    assert "protocol_version" in err.reason and "2" in err.reason and str(p.PROTOCOL_VERSION) in err.reason
    refused = c.bind(completion_path(daemon.removeprefix("ipc://")))  # nor may it send Pulls there
    assert isinstance(refused, p.CompletionsBound) and not refused.ok and "said Hello" in refused.reason
