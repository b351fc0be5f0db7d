"""The decoder's KV caches as the daemon holds them: mapped from a RegisterCaches, registered with NIXL."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sidecar.daemon.cache_layout import local_regions, ordered_layers
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
    users: int = 0


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
        for b in imported:
            b.close()
        raise


def conversion_planes(caches: Caches, fmt: PageFormat) -> Any:
    """The caches' planes as a checked ``PlaneSet``: each conversion then checks only its ids and source."""
    from sidecar.convert import PlaneSet

    return PlaneSet(
        caches.k_planes,
        caches.v_planes,
        num_heads=fmt.num_heads,
        block_size=fmt.block_size,
        head_size=fmt.head_size,
    )


def register_caches(transfer: Any, caches: Caches) -> None:
    """Register the mapped buffers with NIXL and make them a pull destination (call on the loop thread)."""
    regions = caches.regions
    ranges = [(b.data_ptr(), b.nbytes, regions.device_id) for b in caches.imported if b.nbytes]
    caches.registration = transfer.register(ranges, regions.mem_type)
    try:
        caches.destination = transfer.destination(caches.registration, regions)
    except Exception:
        transfer.deregister(caches.registration)
        raise


def close_caches(caches: Caches) -> None:
    caches.plane_set = None  # it holds views of the mappings too
    caches.k_planes.clear()
    caches.v_planes.clear()
    if not all([b.close() for b in caches.imported]):
        log.warning("some cache mappings are still referenced; they unmap when the last view goes")
