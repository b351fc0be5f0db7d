"""The cache layout: decoder layer views checked against a page format and turned into NIXL regions."""

from __future__ import annotations

import msgspec
import pytest

from sidecar.daemon.errors import Refused
from sidecar.daemon.layer_regions import local_regions, natural_key
from sidecar.wire import ipc
from sidecar.wire.formats import PageFormat

H, N, D = 2, 16, 128  # KV heads, block size, head size
B = 32  # decoder blocks
STANDARD = PageFormat(kind="standard", layout="LBHNC", dtype="bfloat16", num_heads=H, block_size=N,
                      head_size=D)
SHUFFLED = PageFormat(kind="aiter_shuffled", layout="LHBNC", dtype="bfloat16", num_heads=H, block_size=N,
                      head_size=D)
PLANE = N * H * D  # elements of one plane-block


def _plane_views(base=1 << 20):
    return [ipc.LayerView(name=f"model.layers.{i}.attn", buffer_index=0, offset_bytes=i * 2 * B * PLANE * 2,
                          shape=[B, 2, N, H * D], strides=[PLANE, B * PLANE, H * D, 1], dtype="bfloat16")
            for i in (1, 0, 10, 2)]


def test_local_regions_of_vllm_shuffle_views_are_k_v_planes_in_name_order():
    views = _plane_views()
    regions = local_regions(views, [1 << 20], SHUFFLED, device_id=0, mem_type="DRAM")
    layer_bytes = 2 * B * PLANE * 2
    order = [0, 1, 2, 10]  # natural name order: layers.10 after layers.2
    expect = []
    for i in order:
        expect += [(1 << 20) + i * layer_bytes, (1 << 20) + i * layer_bytes + B * PLANE * 2]
    assert regions.base.tolist() == expect
    assert set(regions.block_len.tolist()) == {SHUFFLED.plane_block_bytes}
    assert set(regions.block_stride.tolist()) == {SHUFFLED.plane_block_bytes}
    assert set(regions.num_blocks.tolist()) == {B}


def test_local_regions_of_standard_pages_are_one_per_layer():
    strides = [H * N * 2 * D, N * 2 * D, 2 * D, 1]
    views = [ipc.LayerView(name=f"l.{i}", buffer_index=0, offset_bytes=i * B * STANDARD.page_bytes,
                           shape=[B, H, N, 2 * D], strides=strides, dtype="bfloat16") for i in range(3)]
    regions = local_regions(views, [4096], STANDARD, device_id=0, mem_type="DRAM")
    assert regions.base.tolist() == [4096 + i * B * STANDARD.page_bytes for i in range(3)]
    assert set(regions.block_len.tolist()) == {STANDARD.page_bytes}


@pytest.mark.parametrize(("change", "field", "needle"), [
    (dict(dtype="float16"), "page_format.dtype", "has dtype float16"),
    (dict(shape=[B, 3, N, H * D]), "layers.shape", "need [blocks, 2, ...]"),
    (dict(shape=[B, 2, N, H * D // 2]), "layers.shape", "is not a dense"),
    (dict(strides=[PLANE, B * PLANE, 1, N]), "layers.shape", "is not a dense"),
    (dict(strides=[PLANE // 2, B * PLANE, H * D, 1]), "layers.strides", "block stride"),
    (dict(strides=[2 * PLANE, PLANE // 2, H * D, 1]), "layers.strides", "K and V planes overlap"),
    (dict(strides=[PLANE, 3 * PLANE, H * D, 1]), "layers.strides", "K and V planes overlap"),
])
def test_local_regions_refuse_views_that_do_not_match_the_format(change, field, needle):
    views = [msgspec.structs.replace(v, **change) for v in _plane_views()]
    with pytest.raises(Refused) as info:
        local_regions(views, [1 << 20], SHUFFLED, device_id=0, mem_type="DRAM")
    assert info.value.field == field and needle in info.value.reason


def test_local_regions_refuse_layers_that_disagree():
    views = _plane_views()
    views[1] = msgspec.structs.replace(views[1], shape=[B // 2, 2, N, H * D])
    with pytest.raises(Refused, match="other layers have"):
        local_regions(views, [1 << 20], SHUFFLED, device_id=0, mem_type="DRAM")


def test_natural_key():
    names = ["m.layers.10.a", "m.layers.9.a", "m.layers.1.a"]
    assert sorted(names, key=natural_key) == ["m.layers.1.a", "m.layers.9.a", "m.layers.10.a"]
