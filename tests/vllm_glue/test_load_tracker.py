"""Worker-half load bookkeeping: what vLLM is told, and when (pure logic)."""

from __future__ import annotations

import pytest

from vllm_glue.load_tracker import LoadTracker


def test_done_ok_is_finished_once() -> None:
    t = LoadTracker()
    t.started("r1", [4, 5], True, deadline=100.0)
    assert t.take_results().finished == set()
    assert t.done("r1", True, timings={"transfer": 0.01}, received_at=1.0)
    res = t.take_results()
    assert res.finished == {"r1"} and res.failed == set()
    assert t.take_bad_blocks() == set()
    assert not t.done("r1", True)  # duplicate ignored
    assert t.take_results().finished == set()


def test_failed_load_reports_failed_and_its_blocks_in_the_same_step() -> None:
    t = LoadTracker()
    t.started("r1", [4, 5], True, deadline=100.0)
    t.done("r1", False, reason="handshake: refused")
    res = t.take_results()
    assert res.finished == {"r1"} and res.failed == {"r1"}
    assert t.take_bad_blocks() == {4, 5}
    assert t.take_bad_blocks() == set()
    assert t.outcomes[-1].reason == "handshake: refused"


def test_notify_only_pulls_are_never_reported() -> None:
    t = LoadTracker()
    t.started("r1", [], False, deadline=100.0)
    t.done("r1", True)
    t.started("r2", [], False, deadline=100.0)
    t.done("r2", False, reason="x")
    res = t.take_results()
    assert res.finished == set() and res.failed == set()


def test_abort_waits_for_safe_confirmation_and_reports_without_failure() -> None:
    t = LoadTracker()
    t.started("r1", [8], True, deadline=100.0)
    assert t.abort_requested("r1")
    assert not t.abort_requested("r1")  # told once
    assert not t.aborted("r1", safe=False)  # something may still write: keep holding
    assert t.take_results().finished == set()
    assert t.aborted("r1", safe=True)
    res = t.take_results()
    assert res.finished == {"r1"} and res.failed == set()
    assert t.take_bad_blocks() == set()
    assert not t.done("r1", True)  # a late Done changes nothing


def test_abort_of_completed_load_is_not_sent() -> None:
    t = LoadTracker()
    t.started("r1", [8], True, deadline=100.0)
    t.done("r1", True)
    assert not t.abort_requested("r1")
    assert not t.aborted("r1", safe=True)
    assert t.take_results().finished == {"r1"}


def test_done_after_abort_request_releases_without_failure() -> None:
    t = LoadTracker()
    t.started("r1", [8], True, deadline=100.0)
    t.abort_requested("r1")
    t.done("r1", False, reason="aborted")
    res = t.take_results()
    assert res.finished == {"r1"} and res.failed == set()


def test_deadline_plus_grace_fails_the_load() -> None:
    t = LoadTracker(grace_s=5.0)
    t.started("r1", [1], True, deadline=100.0)
    t.started("r2", [2], True, deadline=200.0)
    assert t.expire(104.9) == []
    assert t.expire(105.1) == ["r1"]
    res = t.take_results()
    assert res.failed == {"r1"}
    assert t.outstanding() == {"r2"}


def test_lost_daemon_fails_everything_outstanding() -> None:
    t = LoadTracker()
    t.started("r1", [1], True, deadline=100.0)
    t.started("r2", [2, 3], True, deadline=100.0)
    assert sorted(t.fail_all("disconnected")) == ["r1", "r2"]
    res = t.take_results()
    assert res.failed == {"r1", "r2"} == res.finished
    assert t.take_bad_blocks() == {1, 2, 3}


def test_second_load_for_same_request_is_refused() -> None:
    t = LoadTracker()
    t.started("r1", [1], True, deadline=100.0)
    with pytest.raises(ValueError, match="already"):
        t.started("r1", [2], True, deadline=100.0)


def test_lost_connection_orphans_only_its_own_loads() -> None:
    t = LoadTracker()
    t.started("old", [1], True, deadline=100.0, epoch=1)
    t.started("new", [2], True, deadline=100.0, epoch=2)
    t.started("unsent", [3], True, deadline=100.0)
    assert t.lost(1, "disconnected") == ["old"]
    assert t.take_results().finished == set() and t.take_bad_blocks() == set()  # held, not released
    assert t.orphans() == {"old"}


def test_done_from_another_connection_is_ignored() -> None:
    t = LoadTracker()
    t.started("r", [1], True, deadline=100.0, epoch=2)
    assert not t.done("r", True, epoch=1)
    assert not t.done("r", True, epoch=3)  # not an orphan: only its own connection answers it
    assert t.done("r", True, epoch=2)


def test_orphan_released_by_safe_abort_on_a_later_connection_as_failed() -> None:
    t = LoadTracker()
    t.started("r", [5, 6], True, deadline=100.0, epoch=1)
    t.lost(1, "lost")
    assert t.aborts_owed(2) == ["r"] and t.aborts_owed(2) == ["r"]  # owed until sent
    t.abort_sent("r", 2)
    assert t.aborts_owed(2) == []  # once per connection
    assert t.aborts_owed(3) == ["r"]
    assert not t.aborted("r", safe=False, epoch=3)
    assert t.aborted("r", safe=True, reason="not in flight", epoch=3)
    res = t.take_results()
    assert res.finished == {"r"} and res.failed == {"r"} and t.take_bad_blocks() == {5, 6}


def test_orphan_done_ok_still_fails_and_gone_releases_at_once() -> None:
    t = LoadTracker()
    t.started("a", [1], True, deadline=100.0, epoch=1)
    t.started("b", [2], True, deadline=100.0, epoch=1)
    t.started("c", [3], True, deadline=100.0, epoch=2)
    t.lost(1, "lost")
    assert t.done("a", True, epoch=2)
    assert not t.outcomes[-1].ok
    assert t.gone(frozenset({1}), "daemon exited") == ["b"]
    res = t.take_results()
    assert res.failed == {"a", "b"} and t.take_bad_blocks() == {1, 2}
    assert t.outstanding() == {"c"}


def test_an_abort_that_could_not_be_sent_stays_owed_on_its_connection() -> None:
    t = LoadTracker()
    t.started("r", [1], True, deadline=100.0, epoch=2)
    t.started("s", [2], True, deadline=100.0, epoch=2)
    assert t.abort_requested("r") and t.aborts_owed(2) == ["r"]  # until abort_sent: the send failed
    assert t.aborts_owed(3) == []  # a later connection: only once 2's Lost has made it an orphan
    t.abort_sent("r", 2)
    assert t.aborts_owed(2) == []
    t.lost(2, "lost")
    assert t.aborts_owed(3) == ["r", "s"]


def test_orphan_expires_at_deadline_plus_grace() -> None:
    t = LoadTracker(grace_s=1.0)
    t.started("r", [1], True, deadline=10.0, epoch=1)
    t.lost(1, "lost")
    assert t.expire(10.5) == []
    assert t.expire(11.5) == ["r"]


def test_vllm_abort_of_orphan_is_not_sent_and_released_without_failure() -> None:
    t = LoadTracker()
    t.started("r", [1], True, deadline=100.0, epoch=1)
    t.lost(1, "lost")
    assert not t.abort_requested("r")  # the orphan path sends the Abort on the next connection
    assert t.aborted("r", safe=True, epoch=2)
    res = t.take_results()
    assert res.finished == {"r"} and res.failed == set()
    t.started("u", [2], True, deadline=100.0)
    assert t.release_unsent("u", "not ready")


def test_an_unsafe_done_holds_the_blocks_until_the_daemon_is_gone() -> None:
    """Done(safe=False): a transfer into the blocks could not be stopped. vLLM gets them back only once that
    daemon exited; an Abort's unsafe answer changes nothing, and a duplicate Done is not its end."""
    t = LoadTracker()
    t.started("r", [5, 6], True, deadline=100.0, epoch=1)
    assert t.done("r", False, reason="transfer: x; blocks unsafe", epoch=1, safe=False)
    assert t.take_results().finished == set() and t.take_bad_blocks() == set()
    assert t.outstanding() == {"r"} and t.orphans() == {"r"}
    assert t.aborts_owed(1) == []  # its own connection already answered
    assert not t.aborted("r", safe=False, epoch=2)  # the same daemon, after a reconnect
    assert t.gone(frozenset({1}), "daemon exited") == ["r"]
    res = t.take_results()
    assert res.finished == {"r"} and res.failed == {"r"} and t.take_bad_blocks() == {5, 6}
    assert "could not stop a transfer" in t.outcomes[-1].reason


def test_an_unsafe_done_expires_at_deadline_plus_grace() -> None:
    t = LoadTracker(grace_s=1.0)
    t.started("r", [1], True, deadline=10.0, epoch=1)
    t.done("r", False, reason="x", epoch=1, safe=False)
    assert t.expire(10.5) == [] and t.expire(11.5) == ["r"]


def test_what_a_long_running_engine_keeps_does_not_grow_with_the_loads_it_served() -> None:
    """vLLM's worker calls transfer_results and load_errors every step and never reads ``outcomes`` (only
    the stand-ins do, clearing them): every load ever answered stayed there, its timings and reason with
    it, for the life of the engine."""
    t = LoadTracker()
    for i in range(20_000):
        t.started(f"r{i}", [i % 64], True, deadline=100.0, epoch=1)
        t.done(f"r{i}", i % 2 == 0, reason=None if i % 2 == 0 else "x", timings={"transfer": 0.01},
               epoch=1)
        t.take_results()
        t.take_bad_blocks()
    assert t.outstanding() == frozenset()
    assert len(t.outcomes) <= 4096, f"{len(t.outcomes)} outcomes kept after 20,000 loads"
    assert t.outcomes[-1].req_id == "r19999"  # the latest are kept, for logs and tests
