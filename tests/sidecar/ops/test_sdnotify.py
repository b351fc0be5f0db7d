"""sd_notify datagrams reach a real AF_UNIX socket, by path and in the abstract namespace."""

import contextlib
import os
import socket
import time
import uuid

import pytest

from sidecar.ops import sdnotify


def _receiver(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(5)
    return sock


def test_ready_reaches_a_path_socket(tmp_path, monkeypatch):
    path = str(tmp_path / "notify.sock")
    with _receiver(path) as rx:
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        assert sdnotify.ready() is True
        assert rx.recv(4096) == b"READY=1"


def test_abstract_namespace_socket(monkeypatch):
    name = f"kv-sidecar-test-{uuid.uuid4().hex}"
    with _receiver("\0" + name) as rx:
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.stopping("draining 2 pulls") is True
        assert rx.recv(4096) == b"STOPPING=1\nSTATUS=draining 2 pulls"


def test_status_and_ready_with_status(tmp_path, monkeypatch):
    path = str(tmp_path / "n.sock")
    with _receiver(path) as rx:
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        assert sdnotify.ready("socket bound, NIXL agent up")
        assert rx.recv(4096) == b"READY=1\nSTATUS=socket bound, NIXL agent up"
        assert sdnotify.status("3 requests in flight")
        assert rx.recv(4096) == b"STATUS=3 requests in flight"


def test_not_under_systemd_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.ready() is False
    assert sdnotify.notify("READY=1", environ={}) is False


def test_relative_notify_socket_is_rejected_with_a_reason():
    with pytest.raises(ValueError, match="NOTIFY_SOCKET"):
        sdnotify.notify_address("relative.sock")
    assert sdnotify.notify("READY=1", environ={"NOTIFY_SOCKET": "relative.sock"}) is False


def test_missing_socket_does_not_claim_success(tmp_path):
    missing = str(tmp_path / "gone.sock")
    assert not os.path.exists(missing)
    assert sdnotify.notify("READY=1", environ={"NOTIFY_SOCKET": missing}) is False


@pytest.mark.parametrize("value", ["/nonexistent/notify.sock", "relative/notify.sock"])
def test_an_unreachable_notify_socket_is_logged_not_raised(monkeypatch, caplog, value):
    """A stale or inherited $NOTIFY_SOCKET once made ready() raise: the daemon failed to start, and its
    shutdown raised again at stopping() before closing anything (socket files left behind)."""
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    assert sdnotify.ready() is False and sdnotify.stopping("draining") is False
    assert "sd_notify READY=1 not sent" in caplog.text


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, None),  # no WatchdogSec=
        ({"WATCHDOG_USEC": "60000000"}, 30.0),  # half of it, as sd_watchdog_enabled advises
        ({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": str(os.getpid())}, 30.0),
        ({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "1"}, None),  # another process's
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "sixty"}, None),
    ],
)
def test_the_watchdog_period_is_half_the_units(env, want):
    assert sdnotify.watchdog_period_s(env) == want


def test_the_watchdog_is_fed_only_while_healthy(tmp_path, monkeypatch, caplog):
    """WATCHDOG=1 goes out every period while healthy, none while not (systemd then restarts the unit), and
    again once healthy; each turn to unhealthy is logged once, with its reason."""
    path = str(tmp_path / "notify.sock")
    verdict = [(True, "ok")]
    with _receiver(path) as rx:
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        dog = sdnotify.Watchdog(0.02, lambda: verdict[0]).start()
        try:
            assert rx.recv(4096) == b"WATCHDOG=1"
            with caplog.at_level("ERROR", logger="kv_sidecar.sdnotify"):
                verdict[0] = (False, "event loop stalled: no tick for 6.0 s")
                while dog.withheld == 0:
                    time.sleep(0.005)
                rx.setblocking(False)
                with contextlib.suppress(BlockingIOError):  # what was sent before it saw the new verdict
                    while True:
                        rx.recv(4096)
                seen = dog.withheld
                rx.settimeout(0.3)
                with contextlib.suppress(TimeoutError):
                    rx.recv(4096)
                    pytest.fail("fed while unhealthy")
                assert dog.withheld > seen + 5  # it kept checking meanwhile
                assert caplog.text.count("not fed while unhealthy (event loop stalled") == 1
                rx.settimeout(5)
                verdict[0] = (True, "ok")
                assert rx.recv(4096) == b"WATCHDOG=1"
        finally:
            dog.stop()
    assert dog.sent >= 2


def test_a_daemon_unhealthy_at_one_check_is_fed_again_before_watchdogsec_passes(tmp_path, monkeypatch):
    """systemd restarts the unit once WatchdogSec (twice the period) passes without WATCHDOG=1. A daemon
    unhealthy at one check only (a loop stall of a few seconds that happened to span it) and healthy right
    after must be fed again within WatchdogSec, not a full period after the withheld check: that was always
    later than WatchdogSec after the last feed, so one brief stall restarted a healthy daemon."""
    path = str(tmp_path / "notify.sock")
    period = 0.5
    calls = []

    def healthy() -> tuple[bool, str]:
        calls.append(time.monotonic())
        return (False, "event loop stalled: no tick for 5.1 s") if len(calls) == 2 else (True, "ok")

    with _receiver(path) as rx:
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        dog = sdnotify.Watchdog(period, healthy).start()
        try:
            fed = []
            while len(fed) < 2:
                assert rx.recv(4096) == b"WATCHDOG=1"
                fed.append(time.monotonic())
        finally:
            dog.stop()
    assert dog.withheld >= 1
    gap = fed[1] - fed[0]
    assert gap < 2 * period, f"{gap:.2f} s between feeds: past WatchdogSec ({2 * period} s)"
