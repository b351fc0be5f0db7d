"""The fault matrix's rig: one prefill emulator, one daemon and one canary-painted decoder per test."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import pytest

from sidecar.standins.faults import Rig


@pytest.fixture
def rig(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Rig]:
    """Started and registered; every test ends with the canary check (no late or foreign write anywhere)."""
    marker = request.node.get_closest_marker("rig")
    r = Rig(str(tmp_path), **(marker.kwargs if marker else {}))
    r.start_emulator()
    r.start_daemon()
    r.start_decoder()
    try:
        yield r
        if r.decoder is not None:
            time.sleep(0.3)  # a late write has time to land before the check
            assert r.canary_violations() == [], r.daemon_log()
    finally:
        if r.decoder is not None:
            r.decoder.close()
        if r.daemon is not None:
            r.daemon.stop()
        if r.emu is not None:
            r.emu.stop()


