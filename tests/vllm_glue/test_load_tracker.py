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
