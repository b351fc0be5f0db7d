"""The lease rule (pure): what we can vouch for, heartbeats that extend it, and late ones that cannot."""

from __future__ import annotations

import pytest

from sidecar.daemon.leases import LeaseTracker


def test_lease_tracker_rule():
    lt = LeaseTracker(30.0, margin_s=2.0, heartbeat_interval_s=5.0)
    assert lt.extension_s == 20.0  # vLLM: kv_lease_duration * 2 // 3
    lt.seen("a", 100.0)
    lt.seen("a", 120.0)  # the first sighting counts
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


