"""The fault matrix's rig: one prefill emulator, one daemon and one canary-painted decoder per test."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import pytest

from sidecar.standins.faults import Rig


@contextlib.contextmanager
def open_rig(work: str, **kw: Any) -> Iterator[Rig]:
    """Started and registered; ends with the canary check (no late or foreign write anywhere)."""
    r = Rig(work, **kw)
    try:
        r.start_emulator()
        r.start_daemon()
        r.start_decoder()
        yield r
        if r.decoder is not None:
            r.stop_writers()  # then a late write is caught however late it came, not only within a pause
            assert r.canary_violations() == [], r.daemon_log()
    finally:
        r.close()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    with open_rig(str(tmp_path)) as r:
        yield r
