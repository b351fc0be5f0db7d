"""Issue 15 item 8: a daemon connection that drops fails only the loads sent on it, and the blocks of those
loads go back to vLLM only once nothing can write into them. Real ZMQ ipc against the scripted ROUTER peer
of test_client.py (and a peer in a subprocess, killed with SIGKILL, for the pidfd path)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import zmq

from sidecar.wire import protocol as p
from tests.vllm_glue.test_client import DaemonEnd, FastPeer, bind_and_register, register_msg
from vllm_glue.client import NotReady, Reply, SidecarClient
from vllm_glue.orders import PullOrder, RemoteRef, StepOrders
from vllm_glue.worker import WorkerHalf


def order(req_id: str, blocks: list[int], **remote: Any) -> PullOrder:
    """A pull of ``blocks`` from a prefill at 127.0.0.1:5600 (``remote``: more RemoteRef fields)."""
    ref = RemoteRef(engine_id="e", host="127.0.0.1", port=5600, request_id=f"{req_id}-p", block_ids=[1],
                    **remote)
    return PullOrder(req_id=req_id, remote=ref, local_block_ids=blocks, awaiting=True)


def connected(address: str, peer: DaemonEnd) -> WorkerHalf:
    """A worker half registered with ``peer`` (answered here, so not through the blocking ``connect``)."""
    w = WorkerHalf(address, pull_timeout_s=30.0, grace_s=1.0, register_timeout_s=5.0)
    w.client = SidecarClient(address, w._hello, register_msg())
    peer.welcome_and_register()
    assert w.client.wait_ready(5)
    return w


@contextlib.contextmanager
def session(address: str) -> Iterator[tuple[DaemonEnd, WorkerHalf]]:
    """A scripted daemon and a worker half registered with it, both closed on the way out."""
    peer = DaemonEnd(address)
    w = connected(address, peer)
    try:
        yield peer, w
    finally:
        w.shutdown()
        peer.close()


def wait_until(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def recv_all(peer: DaemonEnd, n: int) -> list[p.ToDaemon]:
    return [peer.recv() for _ in range(n)]


def test_reconnect_before_the_next_step_fails_only_the_old_connections_loads(address: str) -> None:
    """Today's main: the queued Lost fails r2 too (sent after the reconnect) and r2's Done is 'unknown'."""
    peer = DaemonEnd(address)
    w = connected(address, peer)
    try:
        w.start_step(StepOrders(pulls=[order("r1", [3, 4])]))
        assert isinstance(peer.recv(), p.Pull)
        peer.close()  # the daemon restarts while the engine idles: no collect() in between
        wait_until(lambda: not w.client.is_ready())
        peer = DaemonEnd(address)
        peer.welcome_and_register()
        assert w.client.wait_ready(5)
        w.start_step(StepOrders(pulls=[order("r2", [5, 6])]))
        got = peer.recv()
        assert isinstance(got, p.Pull) and got.req_id == "r2"
        peer.send(p.Done(req_id="r2", ok=True))
        finished: set[str] = set()
        failed: set[str] = set()
        bad: set[int] = set()

        def step() -> bool:
            res = w.transfer_results()
            finished.update(res.finished)
            failed.update(res.failed)
            bad.update(w.load_errors())
            return "r2" in finished

        wait_until(step)
        assert "r2" not in failed, "a load sent after the reconnect was failed by the old connection loss"
        # r1 went to the old connection: the shim asks the new one to abort it; the new daemon never saw it.
        ab = peer.recv()
        assert isinstance(ab, p.Abort) and ab.req_id == "r1"
        assert "r1" not in finished, "r1 released before the daemon confirmed nothing writes"
        peer.send(p.Aborted(req_id="r1", safe=True, reason="not in flight"))
        wait_until(lambda: step() and "r1" in finished)
        assert "r1" in failed and bad == {3, 4}
    finally:
        w.shutdown()
        peer.close()


def test_blocks_of_a_dropped_load_are_held_while_the_same_daemon_could_write(address: str) -> None:
    """Today's main: r1 is failed (blocks handed back) at the first step after the drop, while the daemon
    that got its Pull is still alive and may write."""
    peer = DaemonEnd(address)
    w = connected(address, peer)
    try:
        w.start_step(StepOrders(pulls=[order("r1", [7])]))
        assert isinstance(peer.recv(), p.Pull)
        peer.sock.close(linger=0)  # a transient drop: the same process (this one) keeps running
        wait_until(lambda: not w.client.is_ready())
        time.sleep(0.1)
        res = w.transfer_results()
        assert "r1" not in res.finished and w.load_errors() == set()
        peer.sock = peer.ctx.socket(zmq.ROUTER)
        peer.sock.setsockopt(zmq.LINGER, 0)
        peer.sock.bind(address)
        peer.welcome_and_register()
        assert w.client.wait_ready(5)
        w.transfer_results()  # the step that sends the orphan's Abort on the new connection
        ab = peer.recv()
        assert isinstance(ab, p.Abort) and ab.req_id == "r1"
        w.start_step(StepOrders(pulls=[order("r2", [8])]))
        assert isinstance(peer.recv(), p.Pull)
        peer.send(p.Aborted(req_id="r1", safe=False, reason="still transferring"))
        peer.send(p.Done(req_id="r2", ok=True))  # a marker: once r2 is finished, r1's answer was applied
        finished: set[str] = set()
        wait_until(lambda: "r2" in finished or finished.update(w.transfer_results().finished))
        assert "r1" not in finished, "released on an unsafe Aborted"
        peer.send(p.Done(req_id="r1", ok=True))  # the job ended: it can no longer write
        wait_until(lambda: "r1" in (res := w.transfer_results()).finished and "r1" in res.failed)
        assert w.load_errors() == {7}
    finally:
        w.shutdown()
        peer.close()


def test_a_not_ready_among_the_orphans_aborts_costs_none_of_them_their_abort(address: str) -> None:
    """The first orphan's Abort meets NotReady (a full client queue, or the connection going again): every
    orphan was marked as aborted on the new connection before any was sent, so none was, and each waited for
    its deadline."""
    peer = DaemonEnd(address)
    w = connected(address, peer)
    try:
        w.start_step(StepOrders(pulls=[order("r1", [3]), order("r2", [4])]))
        recv_all(peer, 2)
        peer.sock.close(linger=0)  # a transient drop: the same daemon keeps running
        wait_until(lambda: not w.client.is_ready())
        peer.sock = peer.ctx.socket(zmq.ROUTER)
        peer.sock.setsockopt(zmq.LINGER, 0)
        peer.sock.bind(address)
        peer.welcome_and_register()
        assert w.client.wait_ready(5)
        send, refused = w.client.send, []

        def refuse_the_first(msg: p.ToDaemon) -> int:
            if not refused:
                refused.append(msg)
                raise NotReady("client queue is full: the I/O thread is not keeping up")
            return send(msg)

        w.client.send = refuse_the_first
        w.transfer_results()  # the Lost makes both orphans; the first Abort is refused
        assert refused == [p.Abort(req_id="r1")]
        w.transfer_results()  # the next step sends both
        assert {peer.recv().req_id, peer.recv().req_id} == {"r1", "r2"}
    finally:
        w.shutdown()
        peer.close()


def test_message_queued_for_an_ended_connection_is_never_sent_on_the_next(address: str) -> None:
    from vllm_glue.client import _DATA, _EPOCH
    peer = DaemonEnd(address)
    w = connected(address, peer)
    try:
        old = w.client.epoch
        peer.close()
        wait_until(lambda: not w.client.is_ready())
        peer = DaemonEnd(address)
        peer.welcome_and_register()
        assert w.client.wait_ready(5)
        w.client.poll_events()
        pull = p.Pull(req_id="r9", remote_engine_id="e", remote_host="h", remote_port=1,
                      remote_request_id="x", remote_block_ids=p.pack_block_ids([1]),
                      local_block_ids=p.pack_block_ids([2]))
        with w.client._send_lock:  # as if queued by send() just before the drop
            w.client._push.send(_DATA + _EPOCH.pack(old) + p.encode(pull))
        evs: list = []
        wait_until(lambda: evs.extend(w.client.poll_events()) or evs)
        (ev,) = evs
        assert isinstance(ev, Reply) and ev.epoch == old and ev.message.req_id == "r9" and not ev.message.ok
        assert not peer.sock.poll(200), "a message for the old connection reached the new daemon"
    finally:
        w.shutdown()
        peer.close()


def test_loads_of_a_dropped_completion_socket_end_at_once_and_later_loads_succeed(
    address: str, tmp_path
) -> None:
    """The daemon drops the completion socket with r2 unread in it: the shim registers again, and the loads
    of the dropped connection end as the re-registration and the orphans' Aborts answer them. They used to
    wait for their deadline plus the grace (r2's Pull was lost), and later loads were refused (the daemon
    releases the caches of a shim whose completion socket is gone)."""
    peer = FastPeer(address, f"{tmp_path}/d.sock.done")
    w = WorkerHalf(address, pull_timeout_s=30.0, grace_s=1.0, register_timeout_s=5.0)
    w.client = SidecarClient(address, w._hello, register_msg())
    try:
        bind_and_register(peer, w.client)
        w.start_step(StepOrders(pulls=[order("r1", [3]), order("r2", [4])]))
        assert peer.recv_fast().req_id == "r1"  # r2 stays unread in the socket
        t0 = time.monotonic()
        peer.fast.close()
        peer.welcome()
        peer.accept_bind()
        peer.send_fast(p.CompletionsBound(ok=True))
        assert isinstance(peer.recv(), p.RegisterCaches)
        # as the daemon does: the re-registration fails the jobs of the old caches, then answers
        peer.send_fast(p.Done(req_id="r1", ok=False, reason="caches re-registered by the shim"))
        peer.send_fast(p.Registered(generation=2, registered_bytes=4096, num_layers=1))
        assert w.client.wait_ready(5)
        finished: set[str] = set()
        failed: set[str] = set()

        def step() -> set[str]:
            res = w.transfer_results()
            finished.update(res.finished)
            failed.update(res.failed)
            return finished

        step()  # sends the orphan's Abort on the new connection
        ab = peer.recv_fast()
        assert ab == p.Abort(req_id="r2")
        peer.send_fast(p.Aborted(req_id="r2", safe=True, reason="not in flight (never seen)"))
        wait_until(lambda: {"r1", "r2"} <= step())
        assert time.monotonic() - t0 < 10.0  # not the 30 s deadline
        assert failed == {"r1", "r2"} and w.load_errors() == {3, 4}
        w.start_step(StepOrders(pulls=[order("r3", [5])]))
        assert peer.recv_fast().req_id == "r3"
        peer.send_fast(p.Done(req_id="r3", ok=True))
        wait_until(lambda: "r3" in step())
        assert "r3" not in failed
    finally:
        w.shutdown()
        peer.close()


def test_answers_the_daemon_sent_before_it_went_are_not_lost_with_the_connection(
    address: str, tmp_path
) -> None:
    """A daemon stopping gracefully answers its last pulls, then closes both sockets. When the client's I/O
    thread got to the ZMQ disconnect before the completion socket (a busy engine thread holds the GIL), it
    closed that socket unread: r's Done(ok) was dropped, r held as an orphan and then failed, though its
    bytes had landed (a request lost to kv_load_failure_policy "fail")."""
    from vllm_glue.client import _EPOCH, _FAST_DATA

    peer = FastPeer(address, f"{tmp_path}/d.sock.done")
    w = WorkerHalf(address, pull_timeout_s=30.0, grace_s=1.0, register_timeout_s=5.0)
    w.client = SidecarClient(address, w._hello, register_msg())
    try:
        bind_and_register(peer, w.client)
        w.start_step(StepOrders(pulls=[order("r", [3])]))
        assert peer.recv_fast().req_id == "r"
        client = w.client
        beat = p.encode(p.Heartbeat(targets=[]))
        with client._fast_lock:  # the I/O thread sends the Heartbeat, then waits here: a busy moment
            client._queued_fast += 1
            with client._send_lock:
                client._push.send(_FAST_DATA + _EPOCH.pack(client.epoch) + beat)
            assert isinstance(peer.recv_fast(), p.Heartbeat)
            peer.send_fast(p.Done(req_id="r", ok=True, timings={"end_to_end": 0.001}))
            peer.fast.close()  # the daemon stops: its completion socket and its ZMQ socket close
            peer.fast = None
            peer.sock.close(linger=0)
            time.sleep(0.3)  # the disconnect is waiting for the I/O thread too
        _assert_finished_not_failed(w, "r")
    finally:
        w.shutdown()
        peer.close()


def test_answers_waiting_when_a_send_finds_the_completion_socket_closed_are_not_lost(
    address: str, tmp_path
) -> None:
    """The daemon answers r, then closes the completion socket (it stops, or cuts the shim off; what it
    sent stays readable). When the I/O thread's next send there found the socket broken before it read r's
    Done, it closed the socket unread: r's Done(ok) was dropped and r held as an orphan, then failed."""
    from vllm_glue.client import _EPOCH, _FAST_DATA

    peer = FastPeer(address, f"{tmp_path}/d.sock.done")
    w = WorkerHalf(address, pull_timeout_s=30.0, grace_s=1.0, register_timeout_s=5.0)
    w.client = SidecarClient(address, w._hello, register_msg())
    try:
        bind_and_register(peer, w.client)
        w.start_step(StepOrders(pulls=[order("r", [3])]))
        assert peer.recv_fast().req_id == "r"
        client, epoch = w.client, w.client.epoch
        beat = _FAST_DATA + _EPOCH.pack(epoch) + p.encode(p.Heartbeat(targets=[]))
        with client._fast_lock:  # the I/O thread sends the first Heartbeat, then waits here: a busy moment
            client._queued_fast += 2
            with client._send_lock:
                client._push.send(beat)
                client._push.send(beat)
            assert isinstance(peer.recv_fast(), p.Heartbeat)
            peer.send_fast(p.Done(req_id="r", ok=True, timings={"end_to_end": 0.001}))
            peer.fast.close()  # the second Heartbeat finds it closed, before r's Done is read
            peer.fast = None
        assert isinstance(peer.recv(), p.Hello)  # the client ended the connection: that send failed
        assert client.epoch == epoch + 1
        _assert_finished_not_failed(w, "r")
    finally:
        w.shutdown()
        peer.close()


def _assert_finished_not_failed(w: WorkerHalf, req_id: str) -> None:
    """``req_id``'s load is reported finished within 2 s, and not failed: its Done(ok) was not lost."""
    finished: set[str] = set()
    failed: set[str] = set()

    def step() -> bool:
        res = w.transfer_results()
        finished.update(res.finished)
        failed.update(res.failed)
        return req_id in finished

    with contextlib.suppress(AssertionError):
        wait_until(step, 2.0)
    assert req_id in finished, (
        f"{req_id}'s Done was dropped with the connection (orphans: {w.tracker.orphans()})"
    )
    assert req_id not in failed and w.load_errors() == set()


_PEER = textwrap.dedent(
    """
    import socket, sys, time, zmq
    from sidecar.wire import protocol as p
    addr, path = sys.argv[1], sys.argv[2]
    ctx = zmq.Context(); r = ctx.socket(zmq.ROUTER); r.bind(addr)
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); lst.bind(path); lst.listen(4)
    ident, hello = r.recv_multipart()
    r.send_multipart([ident, p.encode(p.Welcome(protocol_version=p.PROTOCOL_VERSION, package_version="t",
                                                 device="cpu", completion_socket=path))])
    fast, _ = lst.accept(); fast.recv(65536); fast.send(p.encode(p.CompletionsBound(ok=True)))
    r.recv_multipart()
    fast.send(p.encode(p.Registered(generation=1, registered_bytes=1, num_layers=1)))
    assert isinstance(p.decode_on_completions(fast.recv(65536)), p.Pull)  # protocol 3: on the fast socket
    print("pulled", flush=True)
    time.sleep(60)
    """
)


def test_killed_daemon_fails_its_loads_at_once(address: str, tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", _PEER, address, f"{tmp_path}/d.done"],
                            stdout=subprocess.PIPE, text=True, env=env)
    w = WorkerHalf(address, pull_timeout_s=30.0, grace_s=1.0, register_timeout_s=10.0)
    try:
        assert w.connect(register_msg())
        assert w.client.uses_completion_socket
        w.start_step(StepOrders(pulls=[order("r1", [9])]))
        assert proc.stdout.readline().strip() == "pulled"
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        wait_until(lambda: "r1" in w.transfer_results().failed, 10)
        assert time.monotonic() - t0 < 10.0  # the pidfd, not the 30 s deadline
        assert w.load_errors() == {9}
        assert "exited" in w.tracker.outcomes[-1].reason
    finally:
        proc.kill()
        proc.wait()
        w.shutdown()
