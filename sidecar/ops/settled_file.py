"""A file read only once it has settled: the same bytes as written, never a rewrite caught half way.

An editor or a config tool rewriting a file in place (truncate, then write) would otherwise hand a reader a
partial file that may still parse (a TOML cut at a line is TOML). The file's stamps (``FileStamp``) are taken
before the read, after it and ``SETTLE_S`` later; the read stands when none differs. The daemon's config
(``sidecar.ops.config``) is read this way, at start-up and on every SIGHUP.
"""

from __future__ import annotations

import os
import stat
import time
from typing import Literal, NamedTuple

# A read stands once the file stays unchanged this long after it ...
SETTLE_S = 0.05
# ... and is made again while the file keeps changing, for at most about this long; then it is refused.
SETTLE_BOUND_S = 1.0


class Unsettled(ValueError):
    """The file kept changing for the whole bound (its text names the path and what changed)."""


class FileStamp(NamedTuple):
    """What stat says of a file that writing it, or replacing it by a rename, changes."""

    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int
    device: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileStamp:
        return cls(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


Settle = Literal["settled", "retry", "unsettled"]


def changed(a: FileStamp, b: FileStamp) -> list[str]:
    """The fields of two stamps of one path that differ (an inode or device: the file was replaced)."""
    return [name for name, x, y in zip(FileStamp._fields, a, b, strict=True) if x != y]


def settle_verdict(before: FileStamp, after: FileStamp, later: FileStamp, *, out_of_time: bool) -> Settle:
    """Whether bytes read between the stamps ``before`` and ``after``, with ``later`` taken SETTLE_S after
    the read, are the file as written: settled when no stamp differs (nothing wrote or replaced the file from
    before the read to SETTLE_S after it); else read again, or give up once ``out_of_time``."""
    if before == after == later:
        return "settled"
    return "unsettled" if out_of_time else "retry"


def _stamp(path: str) -> FileStamp:
    return FileStamp.of(os.stat(path))


def read_settled(path: str, *, wait_missing: bool = False) -> bytes:
    """The bytes of ``path`` once a read of them is settled (``settle_verdict``): read, then wait SETTLE_S to
    see the file unchanged; read again while it changes, for up to SETTLE_BOUND_S. Blocks for SETTLE_S at
    least: not on the event loop (the daemon's SIGHUP reads in a thread). A path that is not a regular file
    (a FIFO, ``<(...)``, a device) is read once, to its end: a pipe reopened would be drained, or wait for a
    writer that is gone, and its stamps change with each write it carries. ``wait_missing`` (a reload): a
    path that does not exist is looked for again within the same bound, as an editor that renames the old
    file away before writing the new one leaves it missing for a moment."""
    deadline = time.monotonic() + SETTLE_BOUND_S
    while True:
        try:
            st = os.stat(path)
            if not stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    return f.read()
            before = FileStamp.of(st)
            with open(path, "rb") as f:
                data = f.read()
            after = _stamp(path)
            time.sleep(SETTLE_S)
            later = _stamp(path)
        except FileNotFoundError:
            if not wait_missing or time.monotonic() >= deadline:
                raise
            time.sleep(SETTLE_S)
            continue
        verdict = settle_verdict(before, after, later, out_of_time=time.monotonic() >= deadline)
        if verdict == "settled":
            return data
        if verdict == "unsettled":
            what = ", ".join(changed(before, after) or changed(after, later))
            raise Unsettled(
                f"{path} changed while being read (still changing after {SETTLE_BOUND_S:g} s: "
                f"{what}); write it atomically: write a temp file, then rename it over this one"
            )
