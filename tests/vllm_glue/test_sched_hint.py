"""The short-slice request, read back from the kernel (/proc/thread-self/sched)."""

from __future__ import annotations

import os
import platform
import threading

import pytest

from vllm_glue.sched_hint import MIN_SLICE_NS, request_short_slice


def _slice_ns() -> int | None:
    with open("/proc/thread-self/sched") as f:
        for line in f:
            if line.startswith("se.slice"):
                return int(line.split(":")[1])
    return None


def test_short_slice_is_granted_for_the_calling_thread_only():
    if not os.path.exists("/proc/thread-self/sched") or _slice_ns() is None:
        pytest.skip("this kernel does not report se.slice")
    got: dict = {}

    def worker() -> None:
        got["before"] = _slice_ns()
        got["why_not"] = request_short_slice(2 * MIN_SLICE_NS)
        got["after"] = _slice_ns()
        got["nice"] = os.getpriority(os.PRIO_PROCESS, 0)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    release = tuple(int(x) for x in platform.release().split("-")[0].split(".")[:2])
    if release < (6, 12):
        pytest.skip(f"kernel {platform.release()} predates per-task slices ({got})")
    assert got["why_not"] is None, got
    assert got["after"] == 2 * MIN_SLICE_NS != got["before"]
    assert got["nice"] == os.getpriority(os.PRIO_PROCESS, 0)  # the thread's nice value is kept
    assert _slice_ns() != 2 * MIN_SLICE_NS  # this (main) thread is untouched


def test_an_unknown_machine_is_reported_not_raised(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "vax")
    assert request_short_slice() == f"not supported on {os.uname().sysname} vax"
