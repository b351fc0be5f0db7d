"""The daemon's completion socket, against a real ``kv-sidecar serve``: raw SOCK_SEQPACKET and ZMQ clients."""

from __future__ import annotations

import os
import socket
import stat

import pytest
import zmq

from sidecar.cli import spawn_serve
from sidecar.daemon.completions import completion_path
from sidecar.wire import protocol as p


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


def test_a_second_packet_is_answered_with_an_error_and_the_binding_stays(client):
    c = client(b"shim-twice")
    path = c.hello().completion_socket
    assert c.bind(path) == p.CompletionsBound(ok=True)
    c.fast.send(b"anything")
    err = c.recv_fast()
    assert isinstance(err, p.Error) and "already bound" in err.reason
    c.dealer.send(p.encode(p.Ping(nonce=1)))
    assert isinstance(c.recv_fast(), p.Pong)


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
