"""The fault rig's pure parts: which cause a failure reason counts under in the soak's report."""

from __future__ import annotations

import pytest

from sidecar.standins.faults import cause_of


@pytest.mark.parametrize("reason,cause", [
    ("transfer: transfer: remote agent disconnected (NIXL_ERR_REMOTE_DISCONNECT)", "prefill"),
    ("handshake: no handshake reply from tcp://127.0.0.1:5600 for (pp=0, tp=0) within 5 s", "prefill"),
    ("kv-sidecar at ipc:///x is lost: kv-sidecar at ipc:///x disconnected", "daemon_gone"),
    ("kv-sidecar daemon (pid 5) exited", "daemon_gone"),
    ("kv-sidecar connection was lost before the message went out", "daemon_gone"),
    ("kv-sidecar at ipc:///x is connecting: waiting for Welcome", "daemon_unavailable"),
    ("shutting down: not accepting pulls", "daemon_restart"),
    ("no answer from kv-sidecar within the deadline (+5 s grace)", "deadline"),
    ("something new", "other"),
    (None, "other"),
])
def test_cause_of(reason, cause) -> None:
    assert cause_of(reason) == cause
