"""Where the decoder's KV cache lies: its layer views, checked against a page format, as NIXL regions."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from sidecar.daemon.errors import Refused
from sidecar.nixl.geometry import GeometryError, LocalRegions, regions_per_layer
from sidecar.wire.formats import PageFormat
from sidecar.wire.ipc import LayerView


def natural_key(name: str) -> list[Any]:
    """'layers.10' after 'layers.9': vLLM registers regions in this numeric-aware name order."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _dense_tail(view: LayerView, first: int) -> bool:
    """Whether axes ``first..`` of the view are C-contiguous (one block's bytes are one run)."""
    expect = 1
    for size, stride in zip(reversed(view.shape[first:]), reversed(view.strides[first:]), strict=True):
        if size != 1 and stride != expect:
            return False
        expect *= size
    return True


def ordered_layers(layers: list[LayerView]) -> list[LayerView]:
    """Layers in model order (``layers.2`` before ``layers.10``), the order vLLM registers them with NIXL."""
    return sorted(layers, key=lambda v: natural_key(v.name))


def local_regions(
    layers: list[LayerView], buffer_ptrs: list[int], fmt: PageFormat, *, device_id: int, mem_type: str
) -> LocalRegions:
    """The NIXL destination regions of the decoder's layers (in natural name order), checked against ``fmt``.

    Plane formats (2 regions per layer: AITER shuffled under LHBNC) need vLLM's view ``[B, 2, ...]``: axis 0
    the block, axis 1 the K/V slot, the rest one dense plane-block. Whole-page formats need ``[B, ...]`` with
    one dense page per block.
    """
    per_layer = regions_per_layer(fmt)
    bases: list[int] = []
    block_len = fmt.plane_block_bytes if per_layer == 2 else fmt.page_bytes
    stride_bytes: int | None = None
    blocks: int | None = None
    for view in ordered_layers(layers):
        where = f"layers[{view.name}]"
        if view.dtype != fmt.dtype and not (
            view.elem_bytes == fmt.elem_bytes and view.dtype in ("uint8", "int8")
        ):
            raise Refused(
                "page_format.dtype", f"{where} has dtype {view.dtype}, the page format says {fmt.dtype}"
            )
        e = view.elem_bytes
        if per_layer == 2:
            if len(view.shape) < 3 or view.shape[1] != 2:
                raise Refused("layers.shape", f"{where} shape {view.shape}: K/V planes need [blocks, 2, ...]")
            tail = view.shape[2:]
            first_dense = 2
        elif per_layer == 1:
            if len(view.shape) < 2:
                raise Refused("layers.shape", f"{where} shape {view.shape}: need [blocks, ...]")
            tail = view.shape[1:]
            first_dense = 1
        else:
            raise Refused(
                "page_format.layout",
                f"{fmt.kind} pages under {fmt.layout} ({per_layer} regions per "
                "layer) cannot be a pull destination",
            )
        if int(np.prod(tail)) * e != block_len or not _dense_tail(view, first_dense):
            raise Refused(
                "layers.shape",
                f"{where} shape {view.shape} strides {view.strides}: one block is not "
                f"a dense {block_len}-byte run as {fmt} implies",
            )
        this_stride = view.strides[0] * e
        if this_stride < block_len:
            raise Refused("layers.strides", f"{where}: block stride {this_stride} bytes < block {block_len}")
        if stride_bytes is None:
            stride_bytes, blocks = this_stride, view.shape[0]
        elif (this_stride, view.shape[0]) != (stride_bytes, blocks):
            raise Refused(
                "layers.shape",
                f"{where}: {view.shape[0]} blocks with stride {this_stride}, other "
                f"layers have {blocks} with stride {stride_bytes}",
            )
        base = buffer_ptrs[view.buffer_index] + view.offset_bytes
        bases.append(base)
        if per_layer == 2:
            bases.append(base + view.strides[1] * e)
            if _planes_overlap(view.strides[0] * e, view.strides[1] * e, block_len, view.shape[0]):
                raise Refused("layers.strides", f"{where}: the K and V planes overlap")
    try:
        return LocalRegions.blocks(
            bases,
            block_len,
            int(blocks or 0),
            block_stride=stride_bytes,
            device_id=device_id,
            mem_type=mem_type,
        )
    except GeometryError as exc:
        raise Refused(exc.field, exc.reason) from exc


def _planes_overlap(block_stride: int, slot_stride: int, block_len: int, blocks: int) -> bool:
    """Whether some K block ``b*block_stride`` and V block ``slot_stride + b2*block_stride`` share bytes."""
    if block_stride == 0:
        return abs(slot_stride) < block_len
    k0 = slot_stride // block_stride
    return any(abs(slot_stride - k * block_stride) < block_len for k in (k0, k0 + 1) if abs(k) < blocks)
