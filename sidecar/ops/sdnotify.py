"""systemd's sd_notify protocol without libsystemd: one datagram to $NOTIFY_SOCKET.

The daemon calls ``ready()`` once it can accept caches (socket bound, NIXL agent up) and ``stopping()``
when it begins to shut down. Outside systemd (no $NOTIFY_SOCKET) every call is a no-op returning False.
"""

from __future__ import annotations

import logging
import os
import socket

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
