"""The daemon's socket file: a private directory, its group, its mode, and never stealing a live daemon's."""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import stat
from collections.abc import Callable

import zmq

from sidecar.daemon.errors import Refused
from sidecar.wire import protocol as p

log = logging.getLogger("kv_sidecar.socket_files")

MAX_UNIX_PATH = 107  # sun_path holds 108 bytes with the terminating NUL


def secure_socket_dir(path: str, group_gid: int | None) -> None:
    """Create the socket's directory owner-only (0700), or 0750 with the configured group."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o700, exist_ok=True)
    st = os.stat(directory)
    if st.st_uid == os.getuid():
        os.chmod(directory, 0o750 if group_gid is not None else 0o700)
        if group_gid is not None:
            os.chown(directory, -1, group_gid)
    elif stat.S_IMODE(st.st_mode) & 0o007:
        log.warning("socket directory %s is not ours and is world-accessible", directory)


def resolve_group(name: str) -> int:
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise Refused("socket_group", f"no group named {name!r}") from None


def refuse_if_served(endpoint: str, path: str) -> None:
    """Binding an ipc path steals it from a live daemon; ask first (a stale file is simply replaced)."""
    if not os.path.exists(path):
        return
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    try:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        s.send(p.encode(p.Ping(nonce=1)))
        if s.poll(300):
            raise RuntimeError(f"another kv-sidecar already serves {endpoint}")
    finally:
        s.close(0)
        ctx.term()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def bind_socket_file(bind: Callable[[], None], path: str, group_gid: int | None) -> None:
    """Run ``bind`` (which creates the socket file ``path``) so the file is 0600, or 0660 with the group."""
    old = os.umask(0o117 if group_gid is not None else 0o177)  # the socket file is born with its final mode
    try:
        bind()
    finally:
        os.umask(old)
    os.chmod(path, 0o660 if group_gid is not None else 0o600)
    if group_gid is not None:
        os.chown(path, -1, group_gid)
