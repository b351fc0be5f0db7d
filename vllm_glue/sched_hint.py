"""Ask Linux's EEVDF scheduler for a short time slice for the calling thread (best effort).

The shim's I/O thread sleeps almost always and wakes for each reply from the daemon. On a busy host a woken
thread of the default slice (about 1.4 ms here) may wait for the running task's slice to end before it runs:
that wait was the whole millisecond tail of the completion signal (``kv-sidecar bench signal``; the time from
the packet reaching the socket to the thread reading it). A short slice request (Linux 6.12+, no privilege
needed, ``sched_attr.sched_runtime`` for SCHED_OTHER) gives the thread an earlier deadline, so its wake-ups
preempt at once; it uses little CPU, so nothing else loses. Older kernels ignore the request or refuse it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct

# sched_setattr(2) has no wrapper in Python or glibc.
_SYS_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274, "ppc64le": 355, "s390x": 345}
SCHED_OTHER = 0
MIN_SLICE_NS = 100_000  # the kernel's lower bound for a requested slice


def request_short_slice(slice_ns: int = MIN_SLICE_NS) -> str | None:
    """Request ``slice_ns`` for the calling thread; None on success, else why not (never raises)."""
    number = _SYS_SCHED_SETATTR.get(platform.machine())
    if os.uname().sysname != "Linux" or number is None:
        return f"not supported on {os.uname().sysname} {platform.machine()}"
    # struct sched_attr, first version (48 bytes): size, policy, flags, nice (kept), priority, runtime (the
    # slice), deadline, period
    attr = ctypes.create_string_buffer(
        struct.pack("IIQiIQQQ", 48, SCHED_OTHER, 0, os.getpriority(os.PRIO_PROCESS, 0), 0, slice_ns, 0, 0)
    )
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(number, 0, attr, 0) == 0:  # pid 0: the calling thread
            return None
        err = ctypes.get_errno()
    except (OSError, AttributeError) as exc:
        return str(exc)
    return f"sched_setattr: {errno.errorcode.get(err, err)} ({os.strerror(err)})"
