"""Mapping a RegisterCaches: the conversion planes are checked once, at registration, and released with it."""

from __future__ import annotations

import itertools

import pytest
import torch

from sidecar.daemon.caches import close_caches, map_caches
from sidecar.wire import ipc
from sidecar.wire import protocol as p
from sidecar.wire.formats import PageFormat

H, N, D, B, LAYERS = 2, 16, 64, 6, 3
PLANE = N * H * D  # elements per plane block


def fmt(kind: str) -> PageFormat:
    return PageFormat(kind=kind, layout="LHBNC", dtype="bfloat16", num_heads=H, block_size=N, head_size=D)


@pytest.fixture
def shm():
    buf = ipc.create_shm_buffer(LAYERS * 2 * B * PLANE * 2)
    yield buf
    buf.close()


def register(shm, kind: str) -> p.RegisterCaches:
    layers = [
        ipc.LayerView(
            name=f"model.layers.{i}.self_attn.attn",
            buffer_index=0,
            offset_bytes=i * 2 * B * PLANE * 2,
            shape=[B, 2, N, H * D],
            strides=[PLANE, B * PLANE, H * D, 1],
            dtype="bfloat16",
        )
        for i in range(LAYERS)
    ]
    return p.RegisterCaches(
        buffers=[shm.description], layers=layers, page_format=fmt(kind), compat_factors={}
    )


def test_a_shuffled_cache_gets_its_checked_planes_at_registration(shm):
    gen = itertools.count(1)
    caches = map_caches(b"shim", register(shm, "aiter_shuffled"), device="cpu", gpu=None,
                        next_generation=lambda: next(gen))
    try:
        planes = caches.plane_set.planes
        assert len(planes.k_planes) == LAYERS and planes.num_blocks == B
        base = caches.imported[0].data_ptr()
        for i in range(LAYERS):  # the same memory the shim described: layer i's K plane then its V plane
            assert planes.k_planes[i].data_ptr() == base + i * 2 * B * PLANE * 2
            assert planes.v_planes[i].data_ptr() == base + (i * 2 + 1) * B * PLANE * 2
        # a request converts in place through them: the pair of block 2 in layer 1 changes, nothing else
        mem = shm.tensor.view(torch.int16)
        mem.copy_(torch.arange(mem.numel(), dtype=torch.int32).to(torch.int16))
        before = mem.clone()
        caches.plane_set.convert(torch.tensor([2]), layers=(1, 2))
        changed = (mem != before).nonzero().flatten()
        k_block, v_block = (2 * B + 2) * PLANE, (2 * B + B + 2) * PLANE  # layer 1: K plane, then V plane
        in_pair = ((changed >= k_block) & (changed < k_block + PLANE)) | (
            (changed >= v_block) & (changed < v_block + PLANE)
        )
        assert changed.numel() and bool(in_pair.all())
    finally:
        close_caches(caches)
    assert caches.plane_set is None  # its views of the mapping are gone with it


def test_a_standard_cache_has_no_conversion_planes(shm):
    caches = map_caches(b"shim", register(shm, "standard"), device="cpu", gpu=None, next_generation=lambda: 1)
    try:
        assert caches.plane_set is None
    finally:
        close_caches(caches)
