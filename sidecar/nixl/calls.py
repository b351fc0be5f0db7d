"""How the NIXL agent's parts call NIXL: one thread inside it at a time, every failure a typed error.

NIXL's agent is not safe for two threads at once at its default ``sync_mode`` (measured: a segfault in
``check_xfer_state``, ``sidecar.bench.nixl_threads``), and at ``STRICT``/``RW`` a second thread's call waits
for the first anyway, so every call goes through one lock of ours (``NixlTransfer.lock``, shared by its
parts): ``Serialized`` takes it around each call into NIXL, ``locked`` around a part's method as a whole.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import Any

from sidecar.nixl.errors import TransferError, map_nixl_error


def nixl_call(what: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except TransferError:
        raise
    except Exception as exc:  # noqa: BLE001 - every NIXL failure becomes a typed error
        raise map_nixl_error(exc, what) from exc


def init_cuda_context(device: int) -> None:
    """Create the CUDA/HIP context before the NIXL agent: UCX probes memory types through the current
    context, and an agent made without one takes VRAM for host memory and refuses to register it (seen on
    the H200: "VRAM memory is detected as host by UCX")."""
    import torch

    # UCX's memory-type cache learns ranges from the allocations it intercepts; memory mapped through
    # cudaIpcOpenMemHandle is not among them and was taken for host memory on the H200. Ask the driver.
    os.environ.setdefault("UCX_MEMTYPE_CACHE", "n")
    torch.cuda.set_device(device)
    torch.zeros(1, device=f"cuda:{device}")


def locked(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run a part's method under its ``lock`` (the agent's) as a whole: the Python state it reads and
    changes (peers, their prepared handles and geometries, destinations) stays consistent with another
    thread's post."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return method(self, *args, **kwargs)

    return call


class Serialized:
    """The NIXL agent with every method call taken under ``lock`` (one thread inside NIXL at a time)."""

    def __init__(self, agent: Any, lock: threading.RLock) -> None:
        self._agent = agent
        self._lock = lock

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._agent, name)
        if not callable(attr):
            return attr
        lock = self._lock

        def call(*args: Any, **kwargs: Any) -> Any:
            with lock:
                return attr(*args, **kwargs)

        return call
