"""Scheduler-half bookkeeping against small fakes of vLLM's Request and KVCacheBlocks (pure logic)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import pytest

from vllm_glue.orders import InvalidParams, parse_remote
from vllm_glue.scheduler_book import SchedulerBook


def params(**over: Any) -> dict[str, Any]:
    p = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[7, 3, 9, 4]],
        "remote_engine_id": "eng-a",
        "remote_request_id": "cmpl-1-abc",
        "remote_host": "10.0.0.2",
        "remote_port": 5600,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 60,
        "remote_registration_generation": 1,
    }
    p.update(over)
    return p


@dataclass
class FakeRequest:
    request_id: str
    kv_transfer_params: dict[str, Any] | None
    prompt_token_ids: list[int] = field(default_factory=lambda: list(range(60)))


@dataclass
class FakeBlocks:
    groups: tuple[list[int], ...]

    def get_unhashed_block_ids_all_groups(self) -> tuple[list[int], ...]:
        return self.groups


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_remote_prefill_waits_for_whole_prompt_less_local_hit() -> None:
    book = SchedulerBook()
    req = FakeRequest("r1", params())
    assert book.get_num_new_matched_tokens(req, 0) == (60, True)
    assert book.get_num_new_matched_tokens(req, 32) == (28, True)
    assert book.get_num_new_matched_tokens(req, 60) == (0, False)
    assert book.get_num_new_matched_tokens(FakeRequest("r2", None), 0) == (0, False)
    assert book.get_num_new_matched_tokens(FakeRequest("r3", {"do_remote_decode": True}), 0) == (0, False)


def test_backoff_tokens_are_left_to_the_decoder() -> None:
    book = SchedulerBook(backoff_tokens=1)
    assert book.get_num_new_matched_tokens(FakeRequest("r1", params()), 0) == (59, True)


def test_invalid_params_compute_locally() -> None:
    book = SchedulerBook()
    missing = params()
    del missing["remote_host"]
    assert book.get_num_new_matched_tokens(FakeRequest("r1", missing), 0) == (0, False)
    two_groups = params(remote_block_ids=[[1], [2]])
    assert book.get_num_new_matched_tokens(FakeRequest("r2", two_groups), 0) == (0, False)
    assert book.get_num_new_matched_tokens(FakeRequest("r3", params(pp_size=2)), 0) == (0, False)


def test_alloc_queues_one_pull_with_unhashed_blocks_in_allocation_order() -> None:
    book = SchedulerBook()
    req = FakeRequest("r1", params())
    book.update_state_after_alloc(req, FakeBlocks(([12, 11, 10],)), 28)
    assert req.kv_transfer_params["do_remote_prefill"] is False
    # A second call (blocks allocated after the load) must not start another transfer.
    book.update_state_after_alloc(req, FakeBlocks(([12, 11, 10, 13],)), 0)
    orders = book.build_step()
    assert len(orders.pulls) == 1
    pull = orders.pulls[0]
    assert pull.req_id == "r1" and pull.awaiting
    assert pull.local_block_ids == [12, 11, 10]  # the daemon pairs them with the tail of the remote list
    assert pull.remote.block_ids == [7, 3, 9, 4]
    assert pull.remote.request_id == "cmpl-1-abc" and pull.remote.registration_generation == 1
    assert book.build_step().pulls == []  # cleared once handed to the workers
    assert book.loads_in_flight() == {"r1"}


def test_full_local_hit_notifies_the_prefill_without_waiting() -> None:
    book = SchedulerBook()
    req = FakeRequest("r1", params())
    book.update_state_after_alloc(req, FakeBlocks(([5, 6],)), 0)
    (pull,) = book.build_step().pulls
    assert not pull.awaiting and pull.local_block_ids == []
    assert book.loads_in_flight() == frozenset()


def test_heartbeats_from_first_sight_every_lease_sixth() -> None:
    clock = FakeClock()
    book = SchedulerBook(lease_s=30, clock=clock)
    book.on_new_request(FakeRequest("r1", params()))
    book.on_new_request(FakeRequest("r2", params(remote_request_id="cmpl-2-def")))
    book.on_new_request(
        FakeRequest("r3", params(remote_engine_id="eng-b", remote_port=5601, remote_request_id="cmpl-3"))
    )
    book.on_new_request(FakeRequest("plain", None))
    # Before any allocation (still waiting for decoder blocks) the leases are already being renewed.
    first = book.build_step().heartbeats
    assert {h.engine_id: sorted(h.remote_request_ids) for h in first} == {
        "eng-a": ["cmpl-1-abc", "cmpl-2-def"],
        "eng-b": ["cmpl-3"],
    }
    assert {(h.host, h.port) for h in first} == {("10.0.0.2", 5600), ("10.0.0.2", 5601)}
    clock.t += 4.9
    assert book.build_step().heartbeats == []
    clock.t += 0.1
    assert len(book.build_step().heartbeats) == 2


def test_heartbeats_stop_at_finished_recving_and_request_finished() -> None:
    clock = FakeClock()
    book = SchedulerBook(lease_s=6, clock=clock)  # period 1 s
    r1, r2 = FakeRequest("r1", params()), FakeRequest("r2", params(remote_request_id="cmpl-2"))
    for r in (r1, r2):
        book.on_new_request(r)
        book.update_state_after_alloc(r, FakeBlocks(([1],)), 16)
    book.build_step()
    book.update_connector_output({"r1"})
    clock.t += 1
    (hb,) = book.build_step().heartbeats
    assert hb.remote_request_ids == ["cmpl-2"]
    book.request_finished(r2)
    clock.t += 1
    assert book.build_step().heartbeats == []


def test_abort_during_load_holds_blocks_and_orders_an_abort() -> None:
    book = SchedulerBook()
    req = FakeRequest("r1", params())
    book.on_new_request(req)
    book.update_state_after_alloc(req, FakeBlocks(([4, 5],)), 20)
    book.build_step()
    assert book.request_finished(req) == (True, None)
    orders = book.build_step()
    assert orders.aborts == ["r1"] and orders.pulls == []
    # The worker reports it once nothing can write; then it is no longer held.
    book.update_connector_output({"r1"})
    assert book.loads_in_flight() == frozenset()


def test_finish_after_load_completed_frees_at_once() -> None:
    book = SchedulerBook()
    req = FakeRequest("r1", params())
    book.update_state_after_alloc(req, FakeBlocks(([4],)), 10)
    book.build_step()
    book.update_connector_output({"r1"})
    assert book.request_finished(req) == (False, None)
    assert book.build_step().aborts == []


def test_abort_before_allocation_releases_the_prefill_blocks() -> None:
    book = SchedulerBook()
    req = FakeRequest("r1", params())
    book.on_new_request(req)
    assert book.request_finished(req) == (False, None)
    (pull,) = book.build_step().pulls
    assert pull.local_block_ids == [] and not pull.awaiting  # notify-only: the prefill frees its blocks
    assert book.heartbeat_targets() == []


def test_a_heartbeat_names_the_newest_registration_its_engines_requests_name() -> None:
    """The daemon handshakes early with a prefill a heartbeat names; with the generation the pulls will name,
    a prefill that registered again (sleep/wake) is not handshaken with a second time by its first pull."""
    book = SchedulerBook()
    for rid, engine, generation in [("r1", "eng-a", 1), ("r2", "eng-a", 2), ("r3", "eng-b", None)]:
        book.on_new_request(FakeRequest(rid, params(remote_engine_id=engine, remote_request_id=f"cmpl-{rid}",
                                                    remote_registration_generation=generation)))
    targets = {t.engine_id: (t.remote_request_ids, t.generation) for t in book.heartbeat_targets()}
    assert targets == {"eng-a": (["cmpl-r1", "cmpl-r2"], 2), "eng-b": (["cmpl-r3"], 0)}


def test_abort_in_same_step_as_alloc_keeps_the_pull_then_aborts() -> None:
    book = SchedulerBook()
    req = FakeRequest("r1", params())
    book.update_state_after_alloc(req, FakeBlocks(([4],)), 10)
    assert book.request_finished(req) == (True, None)
    orders = book.build_step()
    assert [p.req_id for p in orders.pulls] == ["r1"] and orders.aborts == ["r1"]


def test_request_without_transfer_is_untouched() -> None:
    book = SchedulerBook()
    req = FakeRequest("r1", None)
    book.on_new_request(req)
    book.update_state_after_alloc(req, FakeBlocks(([1],)), 0)
    assert book.request_finished(req) == (False, None)
    assert book.build_step().is_empty()


def test_parse_remote_names_the_problem() -> None:
    with pytest.raises(InvalidParams, match="remote_engine_id"):
        parse_remote({**params(), "remote_engine_id": None})
    with pytest.raises(InvalidParams, match="port"):
        parse_remote(params(remote_port="5600"))
    with pytest.raises(InvalidParams, match=r"block_ids\[1\]"):
        parse_remote(params(remote_block_ids=[[7, -3, 9]]))
    assert parse_remote(params(tp_size=None)).tp_size == 1


@pytest.mark.parametrize("change,needle", [
    # each would pass type checks, then break the step: an int msgpack cannot carry raised OverflowError out
    # of start_step into vLLM, and a value the daemon refuses dropped the Heartbeat of every request
    (dict(remote_num_tokens=10**30), "num_tokens"),
    (dict(remote_registration_generation=2**64), "registration_generation"),
    (dict(tp_size=10**30), "remote_tp_size must be in 1..64"),
    (dict(tp_size=65), "remote_tp_size must be in 1..64"),
    (dict(remote_request_id="cmpl-a,b"), "must not contain ','"),
    (dict(remote_request_id="HB:cmpl-a"), "must not start with HB:"),
    (dict(remote_port=0), "remote_port must be in 1..65535"),
    (dict(remote_port=70000), "remote_port must be in 1..65535"),
    (dict(remote_host=""), "remote_host must not be empty"),
])
def test_parse_remote_refuses_values_the_daemon_would(change, needle) -> None:
    with pytest.raises(InvalidParams, match=re.escape(needle)):
        parse_remote(params(**change))


def test_pull_carries_when_the_lease_started_and_the_token_count() -> None:
    clock = FakeClock()
    book = SchedulerBook(clock=clock, wall=lambda: 5000.0)
    req = FakeRequest("r1", params())
    req.arrival_time = 4998.5  # reached the API server 1.5 s before the scheduler saw it
    book.on_new_request(req)
    clock.t += 3.0  # waited for decoder blocks meanwhile
    book.update_state_after_alloc(req, FakeBlocks(([1, 2],)), 60)
    (pull,) = book.build_step().pulls
    assert pull.lease_started_at_ns == int(998.5 * 10**9)
    assert pull.remote.num_tokens == 60


def test_more_local_blocks_than_the_prefill_sent_are_pulled_whole_for_the_daemon_to_refuse() -> None:
    """The shim used to pull only the last len(remote) local blocks and the load came back ok, with the
    first blocks never written and counted as loaded. Now every local block goes, and the daemon refuses
    the pairing (local_block_ids), so the load fails and vLLM's failure policy applies."""
    book = SchedulerBook()
    req = FakeRequest("r1", params(), prompt_token_ids=list(range(80)))
    book.on_new_request(req)
    assert book.get_num_new_matched_tokens(req, 0) == (80, True)
    book.update_state_after_alloc(req, FakeBlocks(([10, 11, 12, 13, 14],)), 80)
    (pull,) = book.build_step().pulls
    assert pull.local_block_ids == [10, 11, 12, 13, 14] and pull.remote.block_ids == [7, 3, 9, 4]


def test_a_decoder_with_several_kv_groups_computes_locally_and_frees_the_prefill() -> None:
    """Found out only at allocation, the group count raised InvalidParams out of update_state_after_alloc
    into vLLM's scheduler (an EngineCore crash), after the request was already waiting for a load."""
    book = SchedulerBook(kv_groups=2)
    req = FakeRequest("r1", params())
    book.on_new_request(req)
    assert book.get_num_new_matched_tokens(req, 0) == (0, False)
    book.update_state_after_alloc(req, FakeBlocks(([1, 2], [3, 4])), 0)
    (pull,) = book.build_step().pulls
    assert pull.local_block_ids == [] and not pull.awaiting  # the prefill is told to free its blocks


@pytest.mark.parametrize("change", [dict(remote_block_ids=[[1, 2], [3, 4]]), dict(pp_size=2),
                                    dict(remote_block_ids=[[7, -3]])])
def test_params_computed_locally_still_free_the_prefills_blocks(change) -> None:
    """Refused params (several groups, pipeline parallelism, a bad id) told the prefill nothing, at
    allocation or at finish: it held the blocks for its lease (with a hybrid model, every request's)."""
    book = SchedulerBook()
    req = FakeRequest("r1", params(**change))
    book.on_new_request(req)
    assert book.get_num_new_matched_tokens(req, 0) == (0, False)
    book.update_state_after_alloc(req, FakeBlocks(([5, 6],)), 0)
    (pull,) = book.build_step().pulls
    assert pull.local_block_ids == [] and not pull.awaiting and pull.remote.block_ids == []
    assert pull.remote.request_id == "cmpl-1-abc" and pull.remote.port == 5600
    aborted = FakeRequest("r2", params(**change))  # finished before it was ever allocated
    book.on_new_request(aborted)
    assert book.request_finished(aborted) == (False, None)
    (pull,) = book.build_step().pulls
    assert pull.req_id == "r2" and not pull.awaiting
    unusable = FakeRequest("r3", params(**change, remote_port=0))  # not even an address: the lease frees them
    book.update_state_after_alloc(unusable, FakeBlocks(([5],)), 0)
    assert book.build_step().pulls == []


def test_an_arrival_older_than_the_monotonic_clock_still_gives_a_pull_the_daemon_accepts() -> None:
    """The lease start is the monotonic clock less the request's wall-clock age. An age past what the
    monotonic clock holds (a wall clock stepped forward, a host booted minutes ago, an ``arrival_time``
    given by an offline caller) made it negative: the worker's Pull then failed its own check
    ("lease_started_at_ns must be >= 0"), so a healthy load failed and vLLM's failure policy applied."""
    from sidecar.wire import protocol as p

    clock = FakeClock()
    clock.t = 120.0  # monotonic: the host booted two minutes ago
    book = SchedulerBook(clock=clock, wall=lambda: 5000.0)
    req = FakeRequest("r1", params())
    req.arrival_time = 4000.0  # 1000 s ago by the wall clock
    book.on_new_request(req)
    book.update_state_after_alloc(req, FakeBlocks(([1, 2],)), 60)
    (pull,) = book.build_step().pulls
    assert 0 <= pull.lease_started_at_ns <= int(clock.t * 1e9)
    r = pull.remote
    p.Pull(  # as WorkerHalf.start_step builds it: raised ValueError on main
        req_id=pull.req_id, remote_engine_id=r.engine_id, remote_host=r.host, remote_port=r.port,
        remote_request_id=r.request_id, remote_block_ids=p.pack_block_ids(r.block_ids),
        local_block_ids=p.pack_block_ids(pull.local_block_ids), timeout_s=60.0,
        lease_started_at_ns=pull.lease_started_at_ns,
    )
