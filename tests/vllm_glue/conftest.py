"""Fixtures the shim's socket tests share."""

from __future__ import annotations

import pytest


@pytest.fixture
def address(tmp_path) -> str:
    """An ipc endpoint of this test's own (the scripted daemon binds it)."""
    return f"ipc://{tmp_path}/d.sock"
