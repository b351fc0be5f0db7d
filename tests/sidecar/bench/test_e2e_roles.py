"""The bench's roles: which layers a byte check samples."""

from __future__ import annotations

from sidecar.bench.e2e_roles import spread


def test_spread_picks_first_middle_and_last_within_range() -> None:
    assert spread(36, 3) == [0, 18, 35] and spread(2, 3) == [0, 1] and spread(5, 1) == [0]
