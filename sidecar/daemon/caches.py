"""The decoder's KV caches as the daemon holds them: mapped from a RegisterCaches, registered with NIXL."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sidecar.convert.launch import conversion_planes
from sidecar.daemon.layer_regions import local_regions, ordered_layers
from sidecar.nixl.geometry import LocalRegions, regions_per_layer
from sidecar.wire import ipc as ipc_mod
from sidecar.wire import protocol as p
from sidecar.wire.formats import PageFormat

log = logging.getLogger("kv_sidecar.caches")


@dataclass(eq=False)
class Caches:
    """The decoder's imported caches, registered with NIXL."""

    generation: int
    owner: bytes
    page_format: PageFormat
    compat_factors: dict[str, Any]
    imported: list[ipc_mod.ImportedBuffer]
    layers: list[ipc_mod.LayerView]  # natural order
    regions: LocalRegions
    registration: Any
    destination: Any
    nbytes: int
    k_planes: list[Any] = field(default_factory=list)  # 2-D [blocks, plane elems] per layer, for conversion
    v_planes: list[Any] = field(default_factory=list)
    plane_set: Any = None  # sidecar.convert.PlaneSet over k_planes/v_planes: checked planes for conversion
    reencode_sets: dict[tuple, Any] = field(default_factory=dict)  # fp8 re-encode PlaneSets, by scales
    graphs: Any = None  # sidecar.convert.graphs.GraphLaunches over plane_set (GPU, made at first use)
    users: int = 0
    # a READ into them was answered unsafe and its handles were not released: it may still write, so they are
    # never deregistered nor unmapped (a late write would land in whatever is mapped at that address next)
    written_late: bool = False
    # being let go (unregistered, replaced, their shim gone): their pulls are being cancelled, so a pull that
    # would take them now must not (it was never cancelled, and their release would wait for it)
    retiring: bool = False

    owner_session: Any = None  # the jobs.Session that registered them

    def owned_by(self, session: Any) -> bool:
        """Whether ``session`` (or a reconnected connection of the same shim) registered these caches."""
        if self.owner == session.identity:
            return True
        return self.owner_session is not None and self.owner_session.same_shim(session)

    @functools.cached_property
    def max_blocks(self) -> int:
        """The most block ids one request can name: every kernel block of one region (fixed at registration:
        asked once per Pull)."""
        return int(self.regions.num_blocks.max())


def map_caches(
    owner: bytes,
    msg: p.RegisterCaches,
    *,
    device: str,
    gpu: int | None,
    next_generation: Callable[[], int],
) -> Caches:
    """Map the buffers and check every view against the page format (no NIXL); release on failure.

    ``next_generation()`` is called once the views check out, so a refused registration uses no number.
    """
    ipc_mod.check_layers(msg.layers, msg.buffers)
    imported, views = ipc_mod.import_caches(msg.buffers, msg.layers, expect_device=device)
    try:
        mem = "DRAM" if gpu is None else "VRAM"
        dev = 0 if gpu is None else gpu
        layers = ordered_layers(msg.layers)
        regions = local_regions(
            layers, [b.data_ptr() for b in imported], msg.page_format, device_id=dev, mem_type=mem
        )
        caches = Caches(
            generation=next_generation(),
            owner=owner,
            page_format=msg.page_format,
            compat_factors=dict(msg.compat_factors),
            imported=imported,
            layers=layers,
            regions=regions,
            registration=None,
            destination=None,
            nbytes=sum(b.nbytes for b in imported),
        )
        if regions_per_layer(msg.page_format) == 2:
            for view in layers:
                t = views[view.name]
                # .view, not .reshape: a copy would silently convert somewhere else
                caches.k_planes.append(t.select(1, 0).view(t.shape[0], -1))
                caches.v_planes.append(t.select(1, 1).view(t.shape[0], -1))
        if caches.k_planes and msg.page_format.kind == "aiter_shuffled":
            caches.plane_set = conversion_planes(caches, msg.page_format)
            if gpu is not None:  # compile in the registration's worker thread, not in a request on the loop
                t0 = time.monotonic()
                caches.plane_set.warm_up()
                ms = (time.monotonic() - t0) * 1e3
                log.info("conversion kernels ready for %s (%.0f ms)", msg.page_format, ms)
        return caches
    except BaseException:
        del views
        ipc_mod.close_imported(imported)
        raise


def register_caches(port: Any, caches: Caches) -> None:
    """Register the mapped buffers with NIXL and make them a pull destination (call on the loop thread)."""
    regions = caches.regions
    ranges = [(b.data_ptr(), b.nbytes, regions.device_id) for b in caches.imported if b.nbytes]
    caches.registration = port.register(ranges, regions.mem_type)
    try:
        caches.destination = port.destination(caches.registration, regions)
    except Exception:
        port.deregister(caches.registration)
        raise


def close_caches(caches: Caches) -> None:
    caches.plane_set = None  # it holds views of the mappings too
    caches.graphs = None  # so do its graphs' kernels
    caches.reencode_sets.clear()
    caches.k_planes.clear()
    caches.v_planes.clear()
    if not ipc_mod.close_imported(caches.imported):
        log.warning("some cache mappings are still referenced; they unmap when the last view goes")


class CacheRegistry:
    """The decoder's caches as currently registered (one registration at a time), and their generation."""

    def __init__(self, port: Any, device: str, gpu: int | None) -> None:
        self._port = port
        self._device = device
        self._gpu = gpu
        self._generation = 0
        self.current: Caches | None = None

    def _next_generation(self) -> int:
        self._generation += 1
        return self._generation

    async def map(self, session: Any, msg: p.RegisterCaches) -> Caches:
        """Import and check a registration's buffers in a worker thread (no NIXL yet)."""
        caches = await asyncio.to_thread(
            map_caches,
            session.identity,
            msg,
            device=self._device,
            gpu=self._gpu,
            next_generation=self._next_generation,
        )
        caches.owner_session = session
        return caches

    def install(self, caches: Caches) -> None:
        """Register mapped caches with NIXL (on the loop thread) and make them current; the caller has
        released the previous ones. On failure the mapping is closed and the error raised."""
        try:
            register_caches(self._port, caches)
        except Exception:
            close_caches(caches)
            raise
        self.current = caches

    def retire(self) -> None:
        """No pull may take the current caches from now on: call before cancelling their pulls."""
        if self.current is not None:
            self.current.retiring = True

    async def release(self) -> Caches | None:
        """Release the current caches once no job holds them; returns what was released."""
        caches, self.current = self.current, None
        if caches is None:
            return None
        while caches.users:  # a job still finishing (it holds views into the buffers)
            await asyncio.sleep(0.001)
        if caches.written_late:
            log.error("cache generation %d stays registered and mapped: a transfer into it could not be "
                      "stopped", caches.generation)
            return caches
        with contextlib.suppress(Exception):
            self._port.deregister(caches.registration)
        close_caches(caches)
        log.info("released cache generation %d", caches.generation)
        return caches
