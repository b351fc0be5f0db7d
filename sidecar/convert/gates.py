"""Gates: GPU work queued while its input is still on its way, held on the GPU until the host opens its gate.

A gate is one 32-bit word of pinned, device-mapped host memory. ``close_on`` queues ``cuStreamWaitValue32``
(the CUDA driver's stream memory wait) on a stream: everything queued after it on that stream waits, on the
GPU, until the word holds ``OPEN``. ``open`` is one host store. So a conversion launch can be queued while
its bytes still read (the launch's host work off the critical path), and once they have landed only the
store is left: no driver call, nothing cold to wake on the host.

A gate must always be opened: work behind a closed gate never runs, its stream stays blocked, and the events
after it never complete. Slots are handed out by ``take`` and come back through ``give_back`` only once the
work behind the gate has run (the caller knows from its event).

While a gate is closed the thread that will open it must not call anything that waits for the device's
work: that call would wait for the work behind the gate, which waits for that thread. A CUDA graph's
instantiation does (``cudaGraphInstantiate``: the daemon hung in it, 2026-12-06), and so do a kernel's first
launch and ``cudaFree``. ``closed`` tells callers when to hold such calls back (``GraphLaunches`` captures no
graph then); for the calls nobody can foresee, another thread may ``force`` a gate open once the opener is
seen stuck, pointing the work behind it away first.

Needs a CUDA driver with the stream memory waits ``cuStreamWaitValue32_v2`` (the H100 hosts of 2026-12-06
had them); ``open_library`` says why when there are none.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

OPEN = 1
CLOSED = 0
_WAIT_EQ = 0x1  # CU_STREAM_WAIT_VALUE_EQ


class GatesUnavailable(RuntimeError):
    """This process cannot queue stream memory waits (no CUDA driver, or one without them)."""


def open_library() -> Any:
    """The CUDA driver library with ``cuStreamWaitValue32_v2`` and ``cuMemHostGetDevicePointer_v2`` typed;
    GatesUnavailable says why not."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise GatesUnavailable(f"no CUDA driver library: {exc}") from None
    for name in ("cuStreamWaitValue32_v2", "cuMemHostGetDevicePointer_v2"):
        if not hasattr(lib, name):
            raise GatesUnavailable(f"the CUDA driver has no {name}")
    lib.cuStreamWaitValue32_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    lib.cuStreamWaitValue32_v2.restype = ctypes.c_int
    get_pointer = lib.cuMemHostGetDevicePointer_v2
    get_pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    get_pointer.restype = ctypes.c_int
    return lib


class Gates:
    """``count`` gates in one pinned page. Their words are written by the host only; slots are taken and
    given back under a lock (a benchmark may queue from another thread than the daemon's loop)."""

    def __init__(self, count: int = 64, library: Any = None) -> None:
        import torch

        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        self._lib = library or open_library()
        try:
            self._host = torch.zeros(count, dtype=torch.int32, pin_memory=True)
        except RuntimeError as exc:  # a torch without the GPU's runtime cannot pin
            raise GatesUnavailable(f"no pinned memory: {exc}") from None
        self.words: np.ndarray = self._host.numpy()
        self.words[:] = OPEN  # a free gate is open: a slot is closed only when taken
        dptr = ctypes.c_uint64()
        err = self._lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), self._host.data_ptr(), 0)
        if err:
            raise GatesUnavailable(f"cuMemHostGetDevicePointer: CUDA error {err}")
        self._base = dptr.value
        self._free = list(range(count - 1, -1, -1))
        self._closed = 0
        self._takes = np.zeros(count, dtype=np.int64)  # times each slot was taken: ``force`` names one taking
        self._forced = np.zeros(count, dtype=bool)  # opened by ``force`` in its current taking
        self._lock = threading.Lock()

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def closed(self) -> int:
        """How many gates are closed now: while any is, GPU work is held and a call that waits for the device
        would wait for it."""
        return self._closed

    def take(self) -> int | None:
        """A free gate's slot, closed (None when every gate is out)."""
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
            self.words[slot] = CLOSED
            self._closed += 1
            self._takes[slot] += 1
            self._forced[slot] = False
        return slot

    def taking(self, slot: int) -> int:
        """Which taking of ``slot`` this is (``force`` names it, so that it never opens a later one)."""
        return int(self._takes[slot])

    def close_on(self, stream: Any, slot: int) -> None:
        """Queue the wait for ``slot``'s gate on ``stream``: what is queued after it waits until ``open``."""
        err = self._lib.cuStreamWaitValue32_v2(stream.cuda_stream, self._base + 4 * slot, OPEN, _WAIT_EQ)
        if err:
            raise GatesUnavailable(f"cuStreamWaitValue32: CUDA error {err}")

    def open(self, slot: int) -> bool:
        """Let the work behind ``slot``'s gate run: one store, under the lock so that every store before it
        (a disarmed table) is seen first, non-temporal ones included (a locked instruction orders them).
        False when ``force`` got there first: the work then ran (or runs) disarmed."""
        with self._lock:
            if self._forced[slot]:
                return False
            if self.words[slot] == CLOSED:
                self._closed -= 1
            self.words[slot] = OPEN
        return True

    def force(self, slot: int, taking: int, disarm: Callable[[], None]) -> bool:
        """For a thread other than the opener's, when that one is stuck: claim ``slot`` if it is still closed
        in ``taking``, ``disarm()`` the work behind it, then open it. Once claimed, ``open`` answers False.
        False when there was nothing to claim (opened already, or taken again since)."""
        with self._lock:
            if self.words[slot] != CLOSED or self._forced[slot] or self._takes[slot] != taking:
                return False
            self._forced[slot] = True
        try:
            disarm()
        finally:  # opened even if the disarm failed: a gate left closed holds its stream for good
            with self._lock:
                self._closed -= 1
                self.words[slot] = OPEN
        return True

    def is_open(self, slot: int) -> bool:
        return bool(self.words[slot] == OPEN)

    def give_back(self, slot: int) -> None:
        """``slot``, opened and with the work behind it run, is free again."""
        if self.words[slot] != OPEN:
            raise ValueError(f"gate {slot} is given back closed: the work behind it would never run")
        with self._lock:
            self._free.append(slot)
