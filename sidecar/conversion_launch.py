"""Starting a request's page conversion: on the CPU (in the caller's thread) or on the daemon's own stream."""

from __future__ import annotations

from typing import Any

import numpy as np

from sidecar.caches import Caches
from sidecar.formats import PageFormat


def convert_blocks(
    caches: Caches, block_ids: np.ndarray, fmt: PageFormat, src: Any, layers: tuple[int, int] | None = None
) -> None:
    """Convert a request's blocks in layers ``[first, last)`` (default all) on the current stream or the CPU.
    ``src``: None to convert in place, else the staged pages of exactly those layers."""
    import torch

    from sidecar.convert import convert_layers_standard_to_shuffled

    first, last = layers if layers is not None else (0, len(caches.k_planes))
    convert_layers_standard_to_shuffled(
        caches.k_planes[first:last],
        caches.v_planes[first:last],
        torch.from_numpy(np.ascontiguousarray(block_ids, dtype=np.int64)),
        num_heads=fmt.num_heads,
        block_size=fmt.block_size,
        head_size=fmt.head_size,
        src=src,
    )


def launch_gpu(
    stream: Any,
    caches: Caches,
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
