"""The lease rule (pure): what we can vouch for, heartbeats that extend it, and late ones that cannot."""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace

import pytest

from sidecar.daemon.leases import Leases, LeaseTracker

R0, R1 = ("prefill", 0), ("prefill", 1)  # two ranks of one prefill (its TP larger than the decoder's)
ONE = [R0]


def test_lease_tracker_rule():
    lt = LeaseTracker(30.0, margin_s=2.0, heartbeat_interval_s=5.0)
    assert lt.extension_s == 20.0  # vLLM: kv_lease_duration * 2 // 3
    lt.seen("a", 100.0)
    lt.seen("a", 120.0)  # a later start changes nothing
    assert lt.check("a", 127.9, ONE) and not lt.check("a", 128.0, ONE)
    assert not lt.due("a", R0, 104.0) and lt.due("a", R0, 105.0)
    lt.heartbeat_sent(["a"], 110.0, R0)  # extends to 110 + 20 - 2 = 128: no gain yet
    assert lt.vouched_until("a", ONE) == 128.0
    lt.heartbeat_sent(["a"], 125.0, R0)
    assert lt.vouched_until("a", ONE) == 143.0 and lt.check("a", 142.0, ONE)
    lt.heartbeat_sent(["a"], 150.0, R0)  # after it lapsed: proves nothing
    assert not lt.check("a", 150.0, ONE) and lt.vouched_until("a", ONE) == 143.0
    assert not lt.due("a", R0, 151.0)  # a lost request is not heartbeated
    assert not lt.check("never-seen", 0.0, ONE)
    lt.heartbeat_sent(["never-seen"], 0.0, R0)
    assert "never-seen" not in lt
    lt.forget("a")
    assert len(lt) == 0 and not lt.check("a", 100.0, ONE)
    with pytest.raises(ValueError):
        LeaseTracker(1.0, margin_s=1.0)


def test_lease_tracker_chains_heartbeats_indefinitely():
    lt = LeaseTracker(30.0, margin_s=2.0, heartbeat_interval_s=5.0)
    lt.seen("r", 0.0)
    t = 0.0
    while t < 300.0:
        t += 5.0
        assert lt.due("r", R0, t) and lt.check("r", t, ONE)
        lt.heartbeat_sent(["r"], t, R0)
    assert lt.check("r", t + 17.9, ONE) and not lt.check("r", t + 18.0, ONE)


def test_each_prefill_rank_holds_its_own_lease():
    """A heartbeat that reached rank 0 renews rank 0's lease only: rank 1 frees the request's blocks on its
    own clock, so the request is vouched for until the earliest rank's end. Before, one lease per request
    was renewed by any rank's heartbeat, and a read from rank 1 could follow its reuse of the blocks."""
    lt = LeaseTracker(30.0, margin_s=2.0, heartbeat_interval_s=5.0)
    lt.seen("r", 100.0)
    lt.heartbeat_sent(["r"], 125.0, R0)  # rank 1's heartbeat failed
    assert lt.vouched_until("r", [R0]) == 143.0 and lt.vouched_until("r", [R1]) == 128.0
    assert lt.vouched_until("r", [R0, R1]) == 128.0 and not lt.check("r", 128.0, [R0, R1])
    assert lt.due("r", R1, 125.0) and not lt.due("r", R0, 125.0)  # rank 1 still owes its beat
    lt.heartbeat_sent(["r"], 126.0, R1)
    assert lt.vouched_until("r", [R0, R1]) == 143.0




def test_an_earlier_start_reported_later_is_what_counts():
    """A shim Heartbeat names the request at 105; its Pull then says the lease started at 100. The lease is
    counted from 100, and heartbeats sent meanwhile count again against that (a late one proves nothing)."""
    lt = LeaseTracker(30.0, margin_s=2.0, heartbeat_interval_s=5.0)
    lt.seen("a", 105.0)
    assert lt.vouched_until("a", ONE) == 133.0
    lt.seen("a", 100.0)
    assert lt.vouched_until("a", ONE) == 128.0 and not lt.check("a", 129.0, ONE)
    lt.seen("a", 110.0)  # a later start changes nothing
    assert lt.vouched_until("a", ONE) == 128.0

    lt.seen("b", 140.0)
    lt.heartbeat_sent(["b"], 166.0, R0)  # in time for a lease from 140 (until 168): until 184
    assert lt.vouched_until("b", ONE) == 184.0
    lt.seen("b", 130.0)  # the lease ran from 130: until 158, so the beat at 166 was too late
    assert lt.vouched_until("b", ONE) == 158.0
    lt.seen("c", 140.0)
    lt.heartbeat_sent(["c"], 150.0, R0)
    lt.seen("c", 135.0)  # until 163; the beat at 150 was in time: 150 + 20 - 2 = 168
    assert lt.vouched_until("c", ONE) == 168.0
    lt.forget("c")
    lt.seen("c", 200.0)  # forgotten: a new request of the same id starts afresh
    assert lt.vouched_until("c", ONE) == 228.0


class _RankOneUnreachable:
    """A port whose heartbeats reach prefill rank 0 only."""

    @contextlib.contextmanager
    def hold(self, blocking: bool = True):
        yield True

    def heartbeat(self, peer, ids) -> None:
        if peer.tp_rank == 1:
            raise RuntimeError("rank 1 unreachable")


def test_a_heartbeat_that_failed_for_one_rank_vouches_nothing_for_it():
    metrics = SimpleNamespace(heartbeats_sent=SimpleNamespace(inc=lambda: None))
    leases = Leases(LeaseTracker(30.0, margin_s=2.0), _RankOneUnreachable(), metrics, sent=lambda: None)
    t0 = time.monotonic() - 25.0  # the lease started 25 s ago: vouched for until t0 + 28
    leases.seen("r", t0)
    leases.send(R0, SimpleNamespace(tp_rank=0), ["r"])
    leases.send(R1, SimpleNamespace(tp_rank=1), ["r"])
    assert leases.vouched_until("r", [R0]) > t0 + 40
    assert leases.vouched_until("r", [R0, R1]) == t0 + 28.0  # rank 1 frees the blocks on its own lease
