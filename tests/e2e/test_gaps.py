"""End to end, staged reads of scattered blocks with gap coalescing: real prefill emulator, real daemon over
real NIXL (host memory, UCX), decoder stand-in painted with a canary.

Gap blocks are other requests' KV: they must land in staging only. Every request is checked bit for bit, its
blocks painted back with the canary when handed back, and at the end every byte of the decoder's memory must
be the canary again (nothing written outside a request's own blocks); the daemon must really have read gaps.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest

from sidecar.standins.demo import sample, scrape
from sidecar.standins.faults import REMOTE_FMT, SHAPE, Rig

pytestmark = pytest.mark.e2e

PAGE = REMOTE_FMT.page_bytes


def test_scattered_blocks_with_gaps_are_bit_exact_and_write_nothing_else(tmp_path: Path) -> None:
    extra = "\n".join([
        'pull_mode = "staged"',
        f"staging_bytes = {SHAPE.layers * PAGE * 512}",
        "gap_coalescing = true",
        "read_descriptor_us = 8.0",
        "read_gbps = 200.0",  # 16 KiB pages: gaps of up to 97 blocks are worth reading
        "gap_pool_share = 0.5",
    ])
    rig = Rig(str(tmp_path), daemon_extra=extra)
    try:
        rig.start_emulator()
        rig.start_daemon()
        rig.start_decoder()
        before = scrape(rig.daemon.metrics_url)
        results = {}
        # churn: runs of blocks in an order no sort recovers; density 0.5: ascending ids, half of a span
        for name, kw in (("churn", {"order": "churn"}), ("density", {"order": "ascending", "density": 0.5})):
            res = rig.batch(12, wave=4, tokens=(40, 400), new_kw=kw, timeout_s=60.0)
            results[name] = res
            assert res.ok == 12 and not res.failed and not res.unanswered, (
                name,
                res.as_dict(),
                rig.daemon_log(),
            )
            assert res.mismatched == [], (name, res.mismatched)
        after = scrape(rig.daemon.metrics_url)
        rig.stop_writers()  # then a late write is caught however late it came
        assert rig.canary_violations() == [], rig.daemon_log()
        gap = sample(after, "kv_sidecar_gap_bytes_read_total") - sample(
            before, "kv_sidecar_gap_bytes_read_total"
        )
        assert gap > 0 and gap % PAGE == 0, gap
        ok = sample(after, "kv_sidecar_requests_total", outcome="ok") - sample(
            before, "kv_sidecar_requests_total", outcome="ok"
        )
        assert ok == 24
    finally:
        rig.close()
