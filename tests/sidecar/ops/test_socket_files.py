"""The socket file: never taken from a daemon that still listens, and removed only by the daemon that bound
it. Real unix sockets in a temporary directory."""

from __future__ import annotations

import os
import socket

import pytest

from sidecar.ops.socket_files import bind_socket_file, refuse_if_served, unlink_own


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
