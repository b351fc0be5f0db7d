"""Local memory registered with NIXL (``LocalMemory``): the registrations, the destinations read into and
the staging pools, each checked to lie inside a registration (fail closed: never read outside it)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from sidecar.nixl.calls import init_cuda_context, locked, nixl_call
from sidecar.nixl.errors import TransferFailed
from sidecar.nixl.geometry import LocalRegions, StagingPool

if TYPE_CHECKING:
    from sidecar.nixl.remote_peers import RemotePeers

log = logging.getLogger("kv_sidecar.nixl")

LOCAL_AGENT = "NIXL_INIT_AGENT"


@dataclass(eq=False)
class Registration:
    """Local memory registered with NIXL: (addr, len, dev) ranges of one memory type."""

    ranges: np.ndarray  # (N, 3) uint64
    mem_type: str
    handle: Any

    def covers(self, start: np.ndarray, end: np.ndarray, device_id: int) -> bool:
        """Whether every [start, end) lies inside one registered range of ``device_id``."""
        r = self.ranges[self.ranges[:, 2] == np.uint64(device_id)]
        lo, hi = r[:, 0][None, :], (r[:, 0] + r[:, 1])[None, :]
        inside = (start[:, None] >= lo) & (end[:, None] <= hi)
        return bool(inside.any(axis=1).all())


@dataclass(eq=False)
class Destination:
    """Local regions (K/V planes or whole blocks) inside a registration, with their prepared local table."""

    registration: Registration
    regions: LocalRegions
    local_handle: Any = None


class LocalMemory:
    """The agent's registrations and the destinations inside them. A dropped destination's geometries, cached
    per peer, are forgotten through ``peers``."""

    def __init__(
        self,
        agent: Any,
        lock: threading.RLock,
        peers: RemotePeers,
        *,
        backends: Sequence[str],
        cuda_device: int | None,
    ) -> None:
        self.agent = agent  # the serialized NIXL agent
        self.lock = lock
        self._peers = peers
        self._backends = tuple(backends)
        self._cuda_device = cuda_device
        self._registrations: list[Registration] = []
        self._dests: dict[int, Destination] = {}

    @locked
    def register(self, ranges: Sequence[tuple[int, int, int]], mem_type: str) -> Registration:
        """Register local (addr, len, dev) ranges: planes (DRAM on CPU, VRAM on GPU) or a staging pool."""
        if not ranges:
            raise TransferFailed("nothing to register", "ranges")
        if self._cuda_device is not None:
            # The context is current per thread, and UCX checks the memory type in the calling thread.
            init_cuda_context(self._cuda_device)
        arr = np.asarray(ranges, dtype=np.uint64).reshape(-1, 3)
        descs = self.agent.get_reg_descs([(int(a), int(n), int(d), "") for a, n, d in arr], mem_type)
        if descs is None:
            raise TransferFailed(f"NIXL rejected the ranges as {mem_type}", "mem_type")
        handle = nixl_call(
            "register_memory", self.agent.register_memory, descs, backends=list(self._backends)
        )
        reg = Registration(ranges=arr, mem_type=mem_type, handle=handle)
        self._registrations.append(reg)
        return reg

    @locked
    def deregister(self, reg: Registration) -> None:
        for key in [k for k, d in self._dests.items() if d.registration is reg]:
            self._drop_destination(key)
        nixl_call("deregister_memory", self.agent.deregister_memory, reg.handle)
        self._registrations.remove(reg)

    @locked
    def destination(self, reg: Registration, regions: LocalRegions) -> Destination:
        """Local regions to read into; they must lie inside ``reg`` (fail closed, never read outside it)."""
        if regions.mem_type != reg.mem_type:
            raise TransferFailed(
                f"regions are {regions.mem_type}, the registration is {reg.mem_type}", "mem_type"
            )
        start = regions.base
        end = regions.base + ((regions.num_blocks - 1) * regions.block_stride + regions.block_len).astype(
            np.uint64
        )
        if not reg.covers(start, end, regions.device_id):
            raise TransferFailed("some local regions lie outside the registered memory", "local.regions")
        dest = Destination(registration=reg, regions=regions)
        self._dests[id(dest)] = dest
        return dest

    @locked
    def staging(self, reg: Registration, pool: StagingPool) -> StagingPool:
        """A staging pool to read into; it must lie inside ``reg``."""
        if pool.mem_type != reg.mem_type:
            raise TransferFailed(f"pool is {pool.mem_type}, the registration is {reg.mem_type}", "mem_type")
        start = np.array([pool.base], np.uint64)
        if not reg.covers(start, start + np.uint64(pool.slot_bytes * pool.num_slots), pool.device_id):
            raise TransferFailed("the staging pool lies outside the registered memory", "pool")
        return pool

    def local_handle(self, dest: Destination, table: np.ndarray) -> Any:
        """``dest``'s prepared local dlist of ``table`` (its regions' rows), prepared once."""
        if dest.local_handle is None:
            dest.local_handle = nixl_call(
                "prep local dlist", self.agent.prep_xfer_dlist, LOCAL_AGENT, table, dest.registration.mem_type
            )
        return dest.local_handle

    def _drop_destination(self, key: int) -> None:
        dest = self._dests.pop(key)
        if dest.local_handle is not None:
            self.agent.release_dlist_handle(dest.local_handle)
        self._peers.forget_destination(dest)

    def close(self) -> None:
        """Drop every destination and deregister every registration (best effort: a failure is logged)."""
        for key in list(self._dests):
            self._drop_destination(key)
        for reg in list(self._registrations):
            try:
                self.agent.deregister_memory(reg.handle)
            except Exception as exc:  # noqa: BLE001
                log.warning("deregister: %s", exc)
        self._registrations.clear()
