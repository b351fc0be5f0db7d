"""systemd's sd_notify protocol without libsystemd: one datagram to $NOTIFY_SOCKET.

The daemon calls ``ready()`` once it can accept caches (socket bound, NIXL agent up) and ``stopping()``
when it begins to shut down; under a unit with ``WatchdogSec=``, a ``Watchdog`` thread sends ``WATCHDOG=1``
while the daemon is healthy (as /healthz says), so systemd restarts a stuck one. Outside systemd (no
$NOTIFY_SOCKET) every call is a no-op returning False.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping

log = logging.getLogger("kv_sidecar.sdnotify")
NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"


def notify_address(value: str) -> str:
    """The AF_UNIX address for a $NOTIFY_SOCKET value; a leading '@' names the abstract namespace."""
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    raise ValueError(f"NOTIFY_SOCKET {value!r} is neither an absolute path nor an abstract name ('@...')")


def notify(state: str, *, environ: dict[str, str] | None = None) -> bool:
    """Send ``state`` (e.g. "READY=1", newline-separated assignments) to systemd; False when not under it,
    or when the socket cannot be reached (logged once per call, never raised: as libsystemd, a notification
    that cannot go out must not stop the daemon, or its shutdown)."""
    value = (os.environ if environ is None else environ).get(NOTIFY_SOCKET_ENV, "")
    if not value:
        return False
    try:
        address = notify_address(value)
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except (OSError, ValueError) as exc:
        log.warning("sd_notify %s not sent: %s", state.split("\n", 1)[0], exc)
        return False
    return True


def ready(status: str | None = None) -> bool:
    """Tell systemd the daemon is up: Type=notify units leave 'activating' only now."""
    return notify("READY=1" + (f"\nSTATUS={status}" if status else ""))


def stopping(status: str | None = None) -> bool:
    """Tell systemd the daemon is shutting down (draining in-flight pulls)."""
    return notify("STOPPING=1" + (f"\nSTATUS={status}" if status else ""))


def status(text: str) -> bool:
    """Free-form status line shown by `systemctl status`."""
    return notify(f"STATUS={text}")


def watchdog_period_s(environ: Mapping[str, str] | None = None) -> float | None:
    """How often to send WATCHDOG=1: half of the unit's ``WatchdogSec=`` ($WATCHDOG_USEC), as
    sd_watchdog_enabled(3) advises; None without a watchdog, or when $WATCHDOG_PID names another process."""
    env = os.environ if environ is None else environ
    try:
        usec = int(env.get("WATCHDOG_USEC", "0"))
        pid = int(env.get("WATCHDOG_PID", "0") or 0)
    except ValueError:
        log.warning("WATCHDOG_USEC / WATCHDOG_PID not integers: systemd's watchdog not fed")
        return None
    if usec <= 0 or (pid and pid != os.getpid()):
        return None
    return usec / 2e6


RECHECKS_PER_PERIOD = 10  # how often per period the watchdog looks again at an unhealthy daemon


class Watchdog:
    """A thread that sends WATCHDOG=1 every ``period_s`` while ``healthy()`` says so. It holds back while the
    daemon is unhealthy (a stalled loop, a NIXL call stuck past ``poster_stall_s``, a loop ended), looking
    again every tenth of a period: systemd restarts the unit once ``WatchdogSec=`` passes without one. A
    thread, so it reads the same verdict as /healthz whatever the event loop is doing."""

    def __init__(self, period_s: float, healthy: Callable[[], tuple[bool, str]]) -> None:
        self.period_s = period_s
        self._healthy = healthy
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-sidecar-watchdog", daemon=True)
        self.sent = 0
        self.withheld = 0

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        fed = True
        wait = self.period_s
        while not self._stop.wait(wait):
            ok, why = self._healthy()
            if ok:
                self.sent += notify("WATCHDOG=1")
            else:
                self.withheld += 1
                if fed:
                    log.error("systemd watchdog not fed while unhealthy (%s): the unit restarts once "
                              "WatchdogSec passes", why)
            fed = ok
            # Unhealthy: look again soon and feed as soon as it recovers. A full period later would be past
            # WatchdogSec (two periods) since the last feed: one unlucky check would restart the unit.
            wait = self.period_s if ok else self.period_s / RECHECKS_PER_PERIOD
