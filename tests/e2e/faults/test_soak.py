"""The soak (``kv-sidecar bench soak``) as tests: 60 s in CI (e2e), 10 minutes on demand (soak).

Held means: every pull answered (ok, aborted, or failed with its reason), every success bit-exact, no canary
byte changed, the daemon's fds flat and its RSS within 10 % after warm-up.
"""

from __future__ import annotations

import pytest

from sidecar.bench.soak import soak


def check(report: dict) -> None:
    summary = {k: v for k, v in report.items() if k != "samples"}
    assert report["pulls"] > 0 and report["ok"] > 0, summary
    assert report["unanswered"] == 0, summary
    assert report["mismatched_blocks"] == 0, summary
    assert report["canary_violations"] == 0, summary
    assert report["ok"] + report["aborted"] + report["failed"] == report["pulls"], summary
    assert "other" not in report["failures_by_cause"], summary  # every failure names a known cause
    fds, rss = report["daemon_fds"], report["daemon_rss"]
    assert fds["after_warmup_max"] - fds["after_warmup_first"] <= 4, summary
    assert rss["after_warmup_max"] <= 1.1 * rss["after_warmup_first"], summary


@pytest.mark.e2e
def test_soak_60s(tmp_path) -> None:
    check(soak(str(tmp_path), 60.0, seed=3))


@pytest.mark.soak
@pytest.mark.timeout(900)  # the suite's 300 s default would end a 600 s soak before it reports
def test_soak_10min(tmp_path) -> None:
    check(soak(str(tmp_path), 600.0, seed=5))
