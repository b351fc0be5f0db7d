"""The lease rule (pure): what we can vouch for, heartbeats that extend it, and late ones that cannot."""

from __future__ import annotations

import pytest

from sidecar.daemon.leases import LeaseTracker


def test_lease_tracker_rule():
    lt = LeaseTracker(30.0, margin_s=2.0, heartbeat_interval_s=5.0)
    assert lt.extension_s == 20.0  # vLLM: kv_lease_duration * 2 // 3
    lt.seen("a", 100.0)
    lt.seen("a", 120.0)  # a later start changes nothing
    assert lt.check("a", 127.9) and not lt.check("a", 128.0)
    assert lt.due(104.0) == [] and lt.due(105.0) == ["a"]
    lt.heartbeat_sent(["a"], 110.0)  # extends to 110 + 20 - 2 = 128: no gain yet
    assert lt.vouched_until("a") == 128.0
    lt.heartbeat_sent(["a"], 125.0)
    assert lt.vouched_until("a") == 143.0 and lt.check("a", 142.0)
    lt.heartbeat_sent(["a"], 150.0)  # after it lapsed: proves nothing
    assert not lt.check("a", 150.0) and lt.vouched_until("a") == 143.0
    assert lt.due(151.0) == []  # a lost request is not heartbeated
    assert not lt.check("never-seen", 0.0)
    lt.heartbeat_sent(["never-seen"], 0.0)
    assert "never-seen" not in lt
    lt.forget("a")
    assert len(lt) == 0 and not lt.check("a", 100.0)
    with pytest.raises(ValueError):
        LeaseTracker(1.0, margin_s=1.0)


def test_lease_tracker_chains_heartbeats_indefinitely():
    lt = LeaseTracker(30.0, margin_s=2.0, heartbeat_interval_s=5.0)
    lt.seen("r", 0.0)
    t = 0.0
    while t < 300.0:
        t += 5.0
        assert lt.due(t) == ["r"] and lt.check("r", t)
        lt.heartbeat_sent(lt.due(t), t)
    assert lt.check("r", t + 17.9) and not lt.check("r", t + 18.0)




def test_an_earlier_start_reported_later_is_what_counts():
    """A shim Heartbeat names the request at 105; its Pull then says the lease started at 100. The lease is
    counted from 100, and heartbeats sent meanwhile count again against that (a late one proves nothing)."""
    lt = LeaseTracker(30.0, margin_s=2.0, heartbeat_interval_s=5.0)
    lt.seen("a", 105.0)
    assert lt.vouched_until("a") == 133.0
    lt.seen("a", 100.0)
    assert lt.vouched_until("a") == 128.0 and not lt.check("a", 129.0)
    lt.seen("a", 110.0)  # a later start changes nothing
    assert lt.vouched_until("a") == 128.0

    lt.seen("b", 140.0)
    lt.heartbeat_sent(["b"], 166.0)  # in time for a lease from 140 (until 168): until 184
    assert lt.vouched_until("b") == 184.0
    lt.seen("b", 130.0)  # the lease ran from 130: until 158, so the beat at 166 was too late
    assert lt.vouched_until("b") == 158.0
    lt.seen("c", 140.0)
    lt.heartbeat_sent(["c"], 150.0)
    lt.seen("c", 135.0)  # until 163; the beat at 150 was in time: 150 + 20 - 2 = 168
    assert lt.vouched_until("c") == 168.0
    lt.forget("c")
    lt.seen("c", 200.0)  # forgotten: a new request of the same id starts afresh
    assert lt.vouched_until("c") == 228.0
