"""The socket file: never taken from a daemon that still listens, and removed only by the daemon that bound
it. Real unix sockets in a temporary directory."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import pytest

from sidecar.ops.errors import StartupError
from sidecar.ops.socket_files import bind_socket_file, refuse_if_served, remove_stale_socket, unlink_own


def test_a_listening_daemon_keeps_its_socket_even_while_it_does_not_answer(tmp_path):
    """A live daemon whose loop is busy (registering caches, shutting down) answers no Ping in time; the old
    check took that for a stale file, removed it, and the second daemon served the path instead."""
    path = str(tmp_path / "gpu0.sock")
    busy = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    busy.bind(path)
    busy.listen(1)  # never accepts, never answers
    try:
        with pytest.raises(RuntimeError, match="another kv-sidecar already serves"):
            refuse_if_served(f"ipc://{path}", path)
        assert os.path.exists(path)
    finally:
        busy.close()


def test_a_stale_socket_file_is_replaced(tmp_path):
    path = str(tmp_path / "gpu0.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)
    dead.close()  # a crashed daemon: the file stays, nobody listens
    refuse_if_served(f"ipc://{path}", path)
    assert not os.path.exists(path)


def test_only_the_daemon_that_bound_the_file_removes_it(tmp_path):
    """A daemon finishing its shutdown after another replaced its socket must not remove the new one."""
    path = str(tmp_path / "gpu0.sock")
    first = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    own = bind_socket_file(lambda: first.bind(path), path, None)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    os.unlink(path)
    second = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    second.bind(path)  # the next daemon's file
    try:
        unlink_own(path, own)
        assert os.path.exists(path)
        unlink_own(path, (os.stat(path).st_dev, os.stat(path).st_ino))
        assert not os.path.exists(path)
        unlink_own(path, own)  # gone already: nothing to do
    finally:
        first.close()
        second.close()


def _not_a_socket(tmp_path, kind: str) -> str:
    """``gpu0.sock`` as something other than a socket: a typo'd path naming someone's file."""
    path = tmp_path / "gpu0.sock"
    if kind == "regular file":
        path.write_text("someone's notes")
    elif kind == "directory":
        path.mkdir()
    else:  # a symbolic link to a stale socket: the link is what the path names, and is not a socket
        dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        dead.bind(str(tmp_path / "stale.sock"))
        dead.close()
        path.symlink_to(tmp_path / "stale.sock")
    return str(path)


def _kept(tmp_path, path: str, kind: str, before: os.stat_result) -> None:
    assert os.lstat(path).st_ino == before.st_ino
    if kind == "regular file":
        assert Path(path).read_text() == "someone's notes"
    if kind == "symbolic link":
        assert os.path.exists(tmp_path / "stale.sock")


KINDS = ["regular file", "directory", "symbolic link"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_file_at_the_socket_path_is_an_error_not_a_stale_socket(tmp_path, kind):
    """A regular file answers connect() with ECONNREFUSED like a stale socket: the old check took it for one
    and deleted it (a typo in ``socket`` cost someone's file)."""
    path = _not_a_socket(tmp_path, kind)
    before = os.lstat(path)
    refused = rf"^socket: {re.escape(path)} exists and is a {kind}, not a socket"
    with pytest.raises(StartupError, match=refused):
        refuse_if_served(f"ipc://{path}", path)
    _kept(tmp_path, path, kind, before)


@pytest.mark.parametrize("kind", KINDS)
def test_only_a_socket_is_removed_as_stale(tmp_path, kind):
    """The completion socket's path (``<socket>.done``) was unlinked whatever it was."""
    path = _not_a_socket(tmp_path, kind)
    before = os.lstat(path)
    with pytest.raises(StartupError) as e:
        remove_stale_socket(path)
    assert e.value.key == "socket"
    _kept(tmp_path, path, kind, before)


def test_a_stale_socket_is_removed_and_nothing_there_is_fine(tmp_path):
    path = str(tmp_path / "gpu0.sock.done")
    remove_stale_socket(path)  # nothing there
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    dead.bind(path)
    dead.close()
    remove_stale_socket(path)
    assert not os.path.exists(path)

