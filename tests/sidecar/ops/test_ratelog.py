"""Rate-limited logging: one line per key per interval, and the count of those left out."""

from __future__ import annotations

import logging

from sidecar.ops import ratelog
from sidecar.ops.ratelog import RateLimitedLog


def test_one_line_per_key_per_interval_then_the_count(caplog, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(ratelog.time, "monotonic", lambda: now[0])
    left_out = []
    rl = RateLimitedLog(logging.getLogger("t"), interval_s=10.0, on_suppressed=lambda: left_out.append(1))
    with caplog.at_level(logging.INFO, logger="t"):
        assert rl.log("bad", logging.WARNING, "bad message %d", 1)
        assert not any(rl.log("bad", logging.WARNING, "bad message %d", i) for i in range(2, 1000))
        assert rl.log("other", logging.INFO, "another key")
        now[0] += 10.0
        assert rl.log("bad", logging.WARNING, "bad message %d", 1000)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "bad message 1",
        "another key",
        "bad message 1000 (and 998 more like it in the last 10 s)",
    ]
    assert len(left_out) == 998
