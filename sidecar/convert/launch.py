"""Starting a request's page conversion: on the CPU (in the caller's thread) or on the daemon's own stream."""

from __future__ import annotations

from typing import Any

import numpy as np

from sidecar.wire.formats import PageFormat


def conversion_planes(caches: Any, fmt: PageFormat) -> Any:
    """The caches' planes as a checked ``PlaneSet``: each conversion then checks only its ids and source."""
    from sidecar.convert import PlaneSet

    return PlaneSet(
        caches.k_planes,
        caches.v_planes,
        num_heads=fmt.num_heads,
        block_size=fmt.block_size,
        head_size=fmt.head_size,
    )


def convert_blocks(
    caches: Any, block_ids: np.ndarray, fmt: PageFormat, src: Any, layers: tuple[int, int] | None = None
) -> None:
    """Convert a request's blocks in layers ``[first, last)`` (default all) on the current stream or the CPU.
    ``src``: None to convert in place, else the staged pages of exactly those layers."""
    import torch

    if caches.plane_set is None:  # made at registration for a shuffled cache; here for anything else
        caches.plane_set = conversion_planes(caches, fmt)
    caches.plane_set.convert(
        torch.from_numpy(np.ascontiguousarray(block_ids, dtype=np.int64)), src=src, layers=layers
    )


def launch_gpu(
    stream: Any,
    caches: Any,
    block_ids: np.ndarray,
    fmt: PageFormat,
    src: Any,
    layers: tuple[int, int] | None = None,
) -> Any:
    """Queue the conversion on the daemon's own stream (never the decoder's) and return its event."""
    import torch

    with torch.cuda.stream(stream):
        convert_blocks(caches, block_ids, fmt, src, layers)
        event = torch.cuda.Event()
        event.record(stream)
    return event
