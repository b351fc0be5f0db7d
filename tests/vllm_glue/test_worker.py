"""The worker half's step: one request's bad values fail that request's load, never vLLM's step or another
request's heartbeat, and an Abort that could not be sent goes out at a later step. Real ZMQ ipc against the
scripted ROUTER peer of test_client.py."""

from __future__ import annotations

import time

from sidecar.wire import protocol as p
from tests.vllm_glue.test_client import register_msg
from tests.vllm_glue.test_reconnect import order, session, wait_until
from tests.vllm_glue.test_scheduler_book import FakeBlocks, FakeRequest, params
from vllm_glue.orders import HeartbeatOrder, StepOrders
from vllm_glue.scheduler_book import SchedulerBook


def test_a_pull_that_cannot_be_encoded_fails_its_load_and_the_step_goes_on(address: str) -> None:
    """An int msgpack cannot carry (built past parse_remote's checks) raised OverflowError out of the step,
    into vLLM, with the load still tracked and the step's later pulls never sent."""
    with session(address) as (peer, w):
        w.start_step(StepOrders(pulls=[order("big", [3], num_tokens=10**30), order("ok", [4])]))
        got = peer.recv()
        assert isinstance(got, p.Pull) and got.req_id == "ok"
        res = w.transfer_results()
        assert "big" in res.finished and "big" in res.failed and w.load_errors() == {3}


def test_a_heartbeat_target_the_daemon_would_refuse_is_left_out_alone(address: str) -> None:
    """One target the daemon would refuse used to drop the step's whole Heartbeat: every prefill's leases."""
    with session(address) as (peer, w):
        good = HeartbeatOrder(engine_id="e", host="127.0.0.1", port=5600, tp_size=1, remote_request_ids=["a"])
        bad = HeartbeatOrder(engine_id="f", host="127.0.0.1", port=0, tp_size=1, remote_request_ids=["b"])
        w.start_step(StepOrders(heartbeats=[bad, good]))
        got = peer.recv()
        assert isinstance(got, p.Heartbeat)
        assert [(t.remote_engine_id, t.remote_request_ids) for t in got.targets] == [("e", ["a"])]


def test_a_heartbeat_carries_the_registration_generation_to_the_daemon(address: str) -> None:
    with session(address) as (peer, w):
        hb = HeartbeatOrder(engine_id="e", host="127.0.0.1", port=5600, tp_size=1, remote_request_ids=["a"],
                            generation=3)
        w.start_step(StepOrders(heartbeats=[hb]))
        got = peer.recv()
        assert isinstance(got, p.Heartbeat)
        assert [t.remote_registration_generation for t in got.targets] == [3]


def test_a_heartbeat_of_more_ids_than_one_message_takes_goes_out_whole_in_several(address: str) -> None:
    """The daemon takes at most MAX_HEARTBEAT_IDS request ids a Heartbeat: the shim splits a larger one."""
    n = p.MAX_HEARTBEAT_IDS + 10
    with session(address) as (peer, w):
        hb = HeartbeatOrder(engine_id="e", host="127.0.0.1", port=5600, tp_size=1,
                            remote_request_ids=[f"r{i}" for i in range(n)])
        w.start_step(StepOrders(heartbeats=[hb]))
        first, second = peer.recv(), peer.recv()
        ids = [rid for beat in (first, second) for t in beat.targets for rid in t.remote_request_ids]
        assert ids == hb.remote_request_ids


def test_an_unsafe_done_keeps_the_blocks_from_vllm(address: str) -> None:
    """Done(safe=False): the daemon could not stop a transfer into the blocks; vLLM must not get them back
    (to recompute into) while that daemon lives."""
    with session(address) as (peer, w):
        w.start_step(StepOrders(pulls=[order("r", [3, 4])]))
        assert isinstance(peer.recv(), p.Pull)
        peer.send(p.Done(req_id="r", ok=False, reason="transfer: x; blocks unsafe", safe=False))
        wait_until(lambda: w.transfer_results() is not None and "r" in w.tracker.orphans())
        res = w.transfer_results()
        assert "r" not in res.finished and w.load_errors() == set()


def test_a_done_with_its_send_time_says_how_long_its_way_back_took(address: str) -> None:
    """``return``: from the daemon's send of the Done to the shim's receipt, the mirror of the Pull's
    "delivery"; a Done without a send time claims none."""
    with session(address) as (peer, w):
        w.start_step(StepOrders(pulls=[order("r", [3, 4]), order("s", [5])]))
        assert isinstance(peer.recv(), p.Pull) and isinstance(peer.recv(), p.Pull)
        sent = time.monotonic_ns()
        peer.send(p.Done(req_id="r", ok=True, timings={"end_to_end": 0.001}, sent_at_ns=sent))
        peer.send(p.Done(req_id="s", ok=True, timings={"end_to_end": 0.001}))

        def both_in() -> bool:
            w.collect()
            return {o.req_id for o in w.tracker.outcomes} == {"r", "s"}

        wait_until(both_in)
        got = {o.req_id: o for o in w.tracker.outcomes}
        assert 0 < got["r"].timings["return"] <= (time.monotonic_ns() - sent) / 1e9
        assert got["r"].timings["end_to_end"] == 0.001
        assert "return" not in got["s"].timings


def test_an_abort_the_client_was_not_ready_for_goes_out_at_a_later_step(address: str) -> None:
    """vLLM aborted r while the client registered the caches again on the connection r's Pull went out on (no
    Lost follows): the Abort was dropped for good, and the daemon read on for a request vLLM had finished."""
    with session(address) as (peer, w):
        w.start_step(StepOrders(pulls=[order("r", [3])]))
        assert isinstance(peer.recv(), p.Pull)
        w.client.set_registration(register_msg())
        assert isinstance(peer.recv(), p.RegisterCaches) and not w.client.is_ready()
        w.start_step(StepOrders(aborts=["r"]))  # NotReady
        assert w.transfer_results().finished == set()
        peer.send(p.Registered(generation=2, registered_bytes=4096, num_layers=1))
        assert w.client.wait_ready(5)
        w.transfer_results()
        assert peer.recv() == p.Abort(req_id="r")
        w.transfer_results()  # once: the next message is this step's heartbeat, not the Abort again
        hb = HeartbeatOrder(engine_id="e", host="127.0.0.1", port=5600, tp_size=1, remote_request_ids=["r-p"])
        w.start_step(StepOrders(heartbeats=[hb]))
        assert isinstance(peer.recv(), p.Heartbeat)
        peer.send(p.Aborted(req_id="r", safe=True))
        finished: set[str] = set()
        failed: set[str] = set()

        def released() -> bool:
            res = w.transfer_results()
            finished.update(res.finished)
            failed.update(res.failed)
            return "r" in finished

        wait_until(released)
        assert failed == set() and w.load_errors() == set()  # vLLM's own abort: released, not failed


def test_a_pull_from_a_scheduler_on_another_host_carries_its_lease_start_in_this_hosts_clock(
    address: str,
) -> None:
    """The scheduler stamped the lease start with its own monotonic clock and the worker sent it on as is, so
    a worker on another node (multi-node TP: another boot, another clock) told its daemon a time from another
    clock: one far in the past, so the daemon could not vouch for the lease and refused every pull of that
    rank. The start goes out in the worker's clock: its age at the scheduler, counted back from now here."""
    sched_t = [5.0]  # the scheduler's node booted 5 s ago; this one long before
    book = SchedulerBook(clock=lambda: sched_t[0], wall=lambda: 5000.0)
    req = FakeRequest("r", params())
    req.arrival_time = 4998.5  # reached the API server 1.5 s before the scheduler saw it
    book.on_new_request(req)
    sched_t[0] += 3.0  # waited for decoder blocks meanwhile: the lease is 4.5 s old
    book.update_state_after_alloc(req, FakeBlocks(([3, 4],)), 60)
    orders = book.build_step()
    with session(address) as (peer, w):
        before = time.monotonic_ns()
        w.start_step(orders)
        after = time.monotonic_ns()
        got = peer.recv()
        assert isinstance(got, p.Pull) and got.req_id == "r"
        assert before - 4_500_000_000 <= got.lease_started_at_ns <= after - 4_500_000_000
