"""Unlink the decoder's /dev/shm cache files once the process that owns them is gone, however it goes.

vLLM's API server SIGKILLs EngineCore (and its process tree) at shutdown, so the connector's ``shutdown`` and
``atexit`` often never run and the 64 MiB-to-GiB file would stay in /dev/shm. The file must outlive a daemon
restart (the daemon maps it again), so it cannot be unlinked at registration either. A detached reaper (double
fork: not in the engine's process tree) waits on a pidfd for the owner's exit and unlinks the files.
"""

from __future__ import annotations

import subprocess
import sys

_REAPER = r"""
import os, select, sys, time
pid, paths = int(sys.argv[1]), sys.argv[2:]
if os.fork():
    os._exit(0)
os.setsid()
try:
    fd = os.pidfd_open(pid)
    select.select([fd], [], [])
except (AttributeError, OSError):  # no pidfd (old kernel) or the owner already exited
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        except PermissionError:
            pass
        time.sleep(1.0)
for p in paths:
    try:
        os.unlink(p)
    except OSError:
        pass
"""


def unlink_when_gone(pid: int, paths: list[str]) -> None:
    """Start the reaper for ``paths`` (owned by ``pid``); returns once it is detached."""
    if not paths:
        return
    proc = subprocess.Popen(
        [sys.executable, "-c", _REAPER, str(pid), *paths],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=True,
    )
    proc.wait(timeout=30)  # the first fork exits at once; the reaper lives on, detached
