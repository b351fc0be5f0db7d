"""``bench e2e``'s report: the must-show arithmetic."""

import pytest

from sidecar.bench import e2e, e2e_report


def test_must_show_arithmetic() -> None:
    cell = e2e.Cell(4096, 8, "direct", "random", 256, nbytes=10**9)
    cell.bare_s, cell.sidecar_s = [0.010, 0.011, 0.012], [0.0120, 0.0126, 0.02]
    ms = e2e_report.must_show(cell, peer_gbps=120.0)
    assert ms["nixl_over_peer"] == pytest.approx((1e9 / 0.011 / 1e9) / 120.0)
    assert ms["nixl_at_least_0.8_peer"] is False  # 90.9 GB/s < 96
    assert ms["sidecar_limit_s"] == pytest.approx(1.05 * 0.011 + 8 * 0.2e-3)
    assert ms["sidecar_within_limit"] is True  # 12.6 ms <= 13.15 ms
    assert e2e_report.must_show(cell, peer_gbps=100.0)["nixl_at_least_0.8_peer"] is True
