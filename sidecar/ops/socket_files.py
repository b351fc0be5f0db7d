"""The daemon's socket file: a private directory, its group, its mode, and never stealing a live daemon's.

A directory the daemon did not create (a shared 1777 /tmp, systemd's RuntimeDirectory) is never changed:
its owner chose its mode. Only a directory created here is made 0700 (0750 with the socket group).
"""

from __future__ import annotations

import contextlib
import errno
import grp
import logging
import os
import socket
import stat
from collections.abc import Callable

from sidecar.daemon.errors import Refused
from sidecar.ops.config import MAX_UNIX_PATH
from sidecar.ops.errors import StartupError

log = logging.getLogger("kv_sidecar.socket_files")

__all__ = ["MAX_UNIX_PATH", "bind_socket_file", "refuse_if_served", "remove_stale_socket", "resolve_group",
           "secure_socket_dir", "unlink_own"]


def secure_socket_dir(path: str, group_gid: int | None) -> bool:
    """Make sure the socket's directory exists; one created here is owner-only (0700), or 0750 with the
    group. An existing directory is left exactly as it is. True if it was created here.

    StartupError (one line, naming ``socket``) for a path too long for a unix socket or a directory that
    cannot be made (a file in the way, no permission); naming ``socket_group`` for a directory that cannot
    be given to the group, after removing what was created here.
    """
    n = len(path.encode())
    if n > MAX_UNIX_PATH:
        raise StartupError("socket", f"the path is {n} bytes, a unix socket path may have at most "
                                     f"{MAX_UNIX_PATH}: {path}")
    directory = os.path.dirname(path) or "."
    top = _make_directory(directory)
    if top is not None:
        try:
            os.chmod(directory, 0o750 if group_gid is not None else 0o700)  # makedirs' mode obeys the umask
            if group_gid is not None:
                _give_group(directory, group_gid)
        except BaseException:
            _remove_made(os.path.abspath(directory), top)
            raise
        return True
    mode = stat.S_IMODE(os.stat(directory).st_mode)
    if mode & 0o002 and not mode & stat.S_ISVTX:
        log.warning("socket directory %s is world-writable without the sticky bit: anyone may replace "
                    "the socket", directory)
    if group_gid is not None and os.stat(directory).st_gid != group_gid and not mode & 0o001:
        log.warning("socket directory %s (mode %o) may not be reachable by socket_group %d", directory,
                    mode, group_gid)
    return False


def _make_directory(directory: str) -> str | None:
    """Create ``directory`` (and its missing parents) if it is missing: the highest one created (absolute),
    or None when none was."""
    if os.path.isdir(directory):
        return None
    top = _first_missing(os.path.abspath(directory))
    try:
        os.makedirs(directory, mode=0o700)
    except FileExistsError:
        if not os.path.isdir(directory):
            raise StartupError("socket", f"{directory} exists and is not a directory") from None
        return None  # another process made it meanwhile
    except OSError as e:
        raise StartupError("socket", f"cannot create the directory {directory}: {e.strerror}") from None
    return top


def _first_missing(directory: str) -> str:
    """The highest directory on the way to the absolute ``directory`` that does not exist."""
    top, parent = directory, os.path.dirname(directory)
    while parent != top and not os.path.exists(parent):
        top, parent = parent, os.path.dirname(parent)
    return top


def _remove_made(directory: str, top: str) -> None:
    """Remove ``directory`` and its parents up to ``top``: what ``_make_directory`` created."""
    while True:
        with contextlib.suppress(OSError):
            os.rmdir(directory)
        if directory == top or not directory.startswith(top):
            return
        directory = os.path.dirname(directory)


def _give_group(path: str, gid: int) -> None:
    """chown ``path`` to ``socket_group``: only root or a member of that group may."""
    try:
        os.chown(path, -1, gid)
    except OSError as e:
        raise StartupError("socket_group", f"cannot give {path} to group {gid}: {e.strerror} (the daemon's "
                                           "user must be a member of that group)") from None


def resolve_group(name: str) -> int:
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise Refused("socket_group", f"no group named {name!r}") from None


def refuse_if_served(endpoint: str, path: str) -> None:
    """Binding an ipc path steals it from a live daemon: refuse while anything listens on it (a stale socket
    is simply replaced). A listening unix socket takes a connection into its backlog even while its daemon's
    loop is busy (starting, registering caches, shutting down), so this asks the kernel, not the daemon."""
    if not _socket_at(path):
        return
    if _listening(path):
        raise RuntimeError(f"another kv-sidecar already serves {endpoint}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def remove_stale_socket(path: str) -> None:
    """Remove the socket a dead daemon left at ``path`` (the caller knows nobody serves it)."""
    if _socket_at(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _socket_at(path: str) -> bool:
    """Whether a socket is at ``path`` (False: nothing is). Anything else there is a StartupError naming
    ``socket``: a typo in the path must not cost someone's file, and a symbolic link is never followed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise StartupError("socket", f"cannot look at {path}: {e.strerror}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise StartupError("socket", f"{path} exists and is {_kind(st.st_mode)}, not a socket: remove it "
                                     "or pick another socket path")
    return True


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return kind
    return "a special file"


def _listening(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False  # a socket nobody listens on
    except OSError as exc:
        # a full backlog (EAGAIN, or the timeout) still means someone listens; anything else (another
        # socket type, no permission) is no daemon of ours
        return exc.errno == errno.EAGAIN or isinstance(exc, TimeoutError)
    finally:
        s.close()
    return True


FileId = tuple[int, int]  # (st_dev, st_ino): which file a path names now


def bind_socket_file(bind: Callable[[], None], path: str, group_gid: int | None) -> FileId:
    """Run ``bind`` (which creates the socket file ``path``) so the file is 0600, or 0660 with the group;
    returns the file's id, for ``unlink_own``. StartupError naming ``socket_group`` when the file cannot be
    given to the group (the file is removed)."""
    old = os.umask(0o117 if group_gid is not None else 0o177)  # the socket file is born with its final mode
    try:
        bind()
    finally:
        os.umask(old)
    os.chmod(path, 0o660 if group_gid is not None else 0o600)
    st = os.stat(path)
    own = st.st_dev, st.st_ino
    if group_gid is not None:
        try:
            _give_group(path, group_gid)
        except StartupError:
            unlink_own(path, own)
            raise
    return own


def unlink_own(path: str, own: FileId | None) -> None:
    """Remove the socket file at ``path`` if it is still the one this daemon bound: after a stall, another
    daemon may have replaced it, and removing that one would leave it serving a path nobody can reach."""
    with contextlib.suppress(FileNotFoundError):
        st = os.stat(path)
        if own is not None and (st.st_dev, st.st_ino) == own:
            os.unlink(path)
