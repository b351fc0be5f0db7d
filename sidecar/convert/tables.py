"""The small int64 tables a conversion launch hands its kernel, built on the host and sent in one copy.

A launch needs the block ids (and, with a source index, the source rows right after them) and the meta table
``[L, 6]`` = (K offset, K row stride, V offset, V row stride, src offset, src row stride), offsets in elements
from the anchor (the first layer's K plane). Only the ids change per request: a meta table is a function of
the planes' addresses, the source's addresses and the anchor, so ``MetaCache`` keeps it by exactly those
numbers, and a daemon builds each (layer range, staging view) table once. ``upload`` packs every table into
one pinned host buffer and sends it with one asynchronous host-to-device copy: a copy from pageable memory
first waits for everything already queued on the stream (earlier conversions) and stages through a bounce
buffer.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

# Segment starts are multiples of 2 int64 (16 bytes) from the buffer's start: Triton specialises a pointer
# argument on 16-byte alignment, so a table on an 8-byte boundary would compile another kernel variant.
ALIGN = 2
META_COLUMNS = 6


def layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """The start of each segment of ``sizes`` int64 in one buffer (each a multiple of ``ALIGN``) and the
    buffer's length."""
    starts, at = [], 0
    for size in sizes:
        if size < 0:
            raise ValueError(f"a segment of {size} elements")
        starts.append(at)
        at += -(-size // ALIGN) * ALIGN
    return starts, at


def meta_table(
    plane_rows: np.ndarray, src_rows: np.ndarray | None, anchor: int, elem_bytes: int
) -> np.ndarray:
    """int64 [L, 6] from per-layer (K address, K row stride, V address, V row stride) ``plane_rows`` and
    (source address, source row stride) ``src_rows`` (None: in place, zeros), addresses in bytes."""
    rows = np.zeros((len(plane_rows), META_COLUMNS), dtype=np.int64)
    if len(plane_rows):
        rows[:, 0] = (plane_rows[:, 0] - anchor) // elem_bytes
        rows[:, 1] = plane_rows[:, 1]
        rows[:, 2] = (plane_rows[:, 2] - anchor) // elem_bytes
        rows[:, 3] = plane_rows[:, 3]
        if src_rows is not None:
            rows[:, 4] = (src_rows[:, 0] - anchor) // elem_bytes
            rows[:, 5] = src_rows[:, 1]
    return rows


class MetaCache:
    """Meta tables by what they are computed from (so never stale), the last ``capacity`` used kept.
    Safe to share between threads (a daemon launches from its loop, a benchmark may pace from a worker)."""

    def __init__(self, capacity: int = 256) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._tables: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._tables)

    def get(
        self, plane_rows: np.ndarray, src_rows: np.ndarray | None, anchor: int, elem_bytes: int
    ) -> np.ndarray:
        """``meta_table`` of these arguments (read-only: a cached table is shared)."""
        key = (plane_rows.tobytes(), None if src_rows is None else src_rows.tobytes(), anchor, elem_bytes)
        with self._lock:
            found = self._tables.get(key)
            if found is not None:
                self._tables.move_to_end(key)
                self.hits += 1
                return found
            self.misses += 1
        table = meta_table(plane_rows, src_rows, anchor, elem_bytes)
        table.flags.writeable = False
        with self._lock:
            self._tables[key] = table
            if len(self._tables) > self.capacity:
                self._tables.popitem(last=False)
        return table


def pack(segments: Sequence[Sequence[np.ndarray]], out: np.ndarray) -> list[tuple[int, int]]:
    """Write each segment (its parts back to back, flattened) into ``out`` at ``layout``'s starts; returns
    each segment's (start, length). ``out`` must hold ``layout``'s length; padding is left as it is."""
    sizes = [sum(p.size for p in seg) for seg in segments]
    starts, total = layout(sizes)
    if out.shape != (total,):
        raise ValueError(f"out has shape {out.shape}, the layout needs ({total},)")
    _fill(out, starts, segments)
    return list(zip(starts, sizes, strict=True))


def _fill(out: np.ndarray, starts: list[int], segments: Sequence[Sequence[np.ndarray]]) -> None:
    for at, seg in zip(starts, segments, strict=True):
        for part in seg:
            out[at : at + part.size] = part.ravel()
            at += part.size


def upload(segments: Sequence[Sequence[np.ndarray]], device: torch.device) -> list[torch.Tensor]:
    """The segments as int64 tensors on ``device``: packed into one pinned host buffer and copied by one
    asynchronous copy on the current stream (never waits for queued work). On the CPU: one plain buffer.

    The pinned buffer goes back to PyTorch's caching host allocator when this returns; the allocator hands
    that block out again only after the copy's recorded event has completed."""
    _, total = layout([sum(p.size for p in seg) for seg in segments])
    on_gpu = device.type != "cpu"
    host = torch.empty(max(total, ALIGN), dtype=torch.int64, pin_memory=on_gpu)
    spans = pack(segments, host.numpy()[:total])
    buf = host.to(device, non_blocking=True) if on_gpu else host
    return [buf[start : start + size] for start, size in spans]
