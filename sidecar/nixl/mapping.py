"""Mapped reads: a prefill rank's registered KV pages mapped into this process, so the conversion kernel reads
them itself (``docs/converting-read.md``). No NIXL READ, no staging: each byte moves once.

The prefill's handshake already carries what UCX needs (its agent metadata: the worker's address and each
region's packed key, ``sidecar.wire.nixl_metadata``). We open our own UCP endpoint to that worker
(``sidecar.nixl.ucx``), unpack the keys of the regions that hold its layers and ask UCX for a local pointer
(``ucp_rkey_ptr``). On NVIDIA, cuda_ipc opens the prefill's CUDA IPC handle and maps its VRAM; host memory
and ROCm's rocm_ipc do not map (UCX says so, and the caller reads the usual way).

``mapping_layout`` (pure) says whether a prefill's published geometry fits one ``[layers, blocks, page]``
source tensor (one region per layer, equal pages and strides, layers evenly spaced); ``map_pages`` does the
mapping and keeps what holds it open. The mapping lives until ``close``: the caller must close it only when
no kernel still reads through it.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from sidecar.nixl.errors import MappingUnavailable
from sidecar.nixl.geometry import RemoteRegions


@dataclass(frozen=True)
class MappingLayout:
    """Where the prefill's pages lie, in bytes from the first layer's base."""

    layers: int
    blocks: int
    page_bytes: int
    block_stride: int
    layer_stride: int  # 0 with one layer

    @property
    def span(self) -> int:
        """Bytes from the first layer's base to the end of the last layer's last page."""
        return (self.layers - 1) * self.layer_stride + (self.blocks - 1) * self.block_stride + self.page_bytes

    @property
    def layer_span(self) -> int:
        """Bytes of one layer's pages, from its base."""
        return (self.blocks - 1) * self.block_stride + self.page_bytes


def mapping_layout(regions: RemoteRegions, layers: int, page_bytes: int, elem_bytes: int) -> MappingLayout:
    """The one-tensor layout of a prefill's pages, or ``MappingUnavailable`` naming the field that does not
    fit it (then the request reads the usual way)."""
    if regions.num_regions != layers:
        raise MappingUnavailable(
            f"{regions.num_regions} regions for {layers} layers: a mapped read needs one region (of whole "
            "pages) per layer",
            "kv_caches_base_addr",
        )
    for name, values in (
        ("block_lens", regions.block_len),
        ("block_strides", regions.block_stride),
        ("region_num_blocks", regions.num_blocks),
    ):
        if (values != values[0]).any():
            raise MappingUnavailable(f"not the same in every layer: {sorted(set(values.tolist()))[:4]}", name)
    if int(regions.block_len[0]) != page_bytes:
        raise MappingUnavailable(
            f"block_len {int(regions.block_len[0])} != page bytes {page_bytes}", "block_lens"
        )
    base = regions.base.astype(np.int64)
    layer_stride = int(base[1] - base[0]) if layers > 1 else 0
    if layers > 1 and (layer_stride <= 0 or (np.diff(base) != layer_stride).any()):
        raise MappingUnavailable("the layers are not evenly spaced in ascending order", "kv_caches_base_addr")
    block_stride = int(regions.block_stride[0])
    for name, value in (
        ("kv_caches_base_addr", layer_stride),
        ("block_strides", block_stride),
        ("block_lens", page_bytes),
    ):
        if value % elem_bytes:
            raise MappingUnavailable(
                f"{value} bytes is not a whole number of {elem_bytes}-byte elements", name
            )
    return MappingLayout(layers, int(regions.num_blocks[0]), page_bytes, block_stride, layer_stride)


class _DeviceMemory:
    """Memory at a raw device pointer, for ``torch.as_tensor`` (the CUDA array interface)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 3,
        }


def memory_view(ptr: int, nbytes: int, device: int | None) -> Any:
    """The bytes at ``ptr`` as a uint8 tensor: device memory on ``cuda:device``, else host memory."""
    import torch

    if device is None:
        return torch.from_numpy(np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr)))
    return torch.as_tensor(_DeviceMemory(ptr, nbytes), device=f"cuda:{device}")


class MappedPages:
    """A prefill rank's pages mapped here: ``source(dtype)`` is ``[layers, blocks, page elements]``, row
    ``b`` of layer ``l`` the prefill's kernel block ``b``. Holds the UCP worker, endpoint and keys.

    ``fence``: records and returns an event after every kernel queued so far that may read through the
    mapping (the daemon's conversion stream), or None; ``close`` waits for that event instead of the whole
    device, whose other work may wait on the host (a conversion behind a closed gate, whose gate is opened by
    the loop that may be the one closing)."""

    def __init__(self, worker: Any, memory: Any, layout: MappingLayout, device: int | None,
                 fence: Callable[[], Any] | None = None) -> None:
        self._worker = worker
        self._memory = memory  # uint8, from the first layer's base
        self.layout = layout
        self.device = device
        self._fence = fence
        self._views: dict[Any, Any] = {}

    def source(self, dtype: Any) -> Any:
        """The pages as a strided ``[layers, blocks, page]`` tensor of ``dtype`` (made once per dtype)."""
        view = self._views.get(dtype)
        if view is None:
            lay = self.layout
            e = self._memory.view(dtype).element_size()
            view = self._memory.view(dtype).as_strided(
                (lay.layers, lay.blocks, lay.page_bytes // e),
                (lay.layer_stride // e, lay.block_stride // e, 1),
            )
            self._views[dtype] = view
        return view

    def close(self) -> None:
        """Unmap (destroy the keys) and close the endpoint, once every kernel that may read through the
        mapping has finished (one may still, a prefill replaced mid-request): the fence's event, without a
        fence every kernel this process queued on the device."""
        self._views.clear()
        self._memory = None
        if self.device is None:
            self._worker.close()
            return
        import torch

        with torch.cuda.device(self.device):  # cuda_ipc closes its handles in the device's context
            fence = None if self._fence is None else self._fence()
            if fence is None:
                torch.cuda.synchronize()
            else:
                fence.synchronize()
            self._worker.close()


def map_pages(
    agent_metadata: bytes,
    regions: RemoteRegions,
    layout: MappingLayout,
    device: int | None,
    ucp: Any = None,
    fence: Callable[[], Any] | None = None,
) -> MappedPages:
    """Map the prefill's pages (``layout``, from ``mapping_layout``) into this process. On a GPU, call it in
    a thread whose current device is ``device``. ``MappingUnavailable`` when any layer does not map.
    ``fence``: as ``MappedPages``'."""
    from sidecar.nixl.ucx import UcpWorker, UcxError
    from sidecar.wire.nixl_metadata import NixlMetadataError, read_agent_metadata

    try:
        agent = read_agent_metadata(agent_metadata)
    except NixlMetadataError as exc:
        raise MappingUnavailable(f"unreadable agent metadata: {exc.reason}", exc.field) from None
    address = agent.connections.get("UCX")
    if address is None:
        raise MappingUnavailable(
            f"the prefill has no UCX backend ({sorted(agent.connections)})", "agent_metadata"
        )
    try:
        worker = UcpWorker(ucp)
    except UcxError as exc:
        raise MappingUnavailable(f"UCX: {exc}", "ucx") from None
    try:
        ep = worker.connect(address)
        keys: dict[bytes, Any] = {}
        first = None
        for layer in range(layout.layers):
            base = int(regions.base[layer])
            _, region = agent.region_at(base, layout.layer_span)
            key = keys.get(region.key)
            if key is None:
                key = keys[region.key] = ep.unpack(region.key)
            ptr = key.ptr(base)
            if first is None:
                first = ptr
            elif ptr - first != layer * layout.layer_stride:
                raise MappingUnavailable(
                    f"layer {layer} maps {ptr - first:#x} bytes after layer 0, not "
                    f"{layer * layout.layer_stride:#x} as published",
                    "kv_caches_base_addr",
                )
        memory = memory_view(first, layout.span, device)
    except MappingUnavailable:
        worker.close()
        raise
    except (UcxError, NixlMetadataError) as exc:
        with contextlib.suppress(Exception):
            worker.close()
        raise MappingUnavailable(str(exc), getattr(exc, "field", None) or "ucp_rkey_ptr") from None
    except Exception:  # torch refusing the pointer, say: what is open must not outlive the failure
        with contextlib.suppress(Exception):
            worker.close()
        raise
    return MappedPages(worker, memory, layout, device, fence)
