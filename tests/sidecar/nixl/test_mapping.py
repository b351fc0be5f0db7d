"""``sidecar.nixl.mapping``: which published geometries fit one mapped source tensor (pure, every refusal
naming its field), and against a real prefill emulator on this host: host memory does not map, and
``map_pages`` says so as ``MappingUnavailable`` with UCX's reason, leaving nothing open."""

from __future__ import annotations

import types

import numpy as np
import pytest

from sidecar.nixl.errors import MappingUnavailable
from sidecar.nixl.geometry import RemoteRegions
from sidecar.nixl.mapping import MappingLayout, map_pages, mapping_layout
from sidecar.wire import prefill as wire
from tests.sidecar.nixl.test_ucx import FMT, LAYERS, emu

__all__ = ["emu"]  # a fixture, used by name

PAGE = 4096


def _regions(bases, lens=PAGE, strides=PAGE, blocks=10) -> RemoteRegions:
    n = len(bases)

    def arr(v):
        return np.full(n, v, np.int64) if np.isscalar(v) else np.asarray(v, np.int64)

    return RemoteRegions(
        base=np.asarray(bases, np.uint64),
        block_len=arr(lens),
        block_stride=arr(strides),
        num_blocks=arr(blocks),
        device_id=0,
        layout="LBHNC",
        block_size=16,
        blocks_per_logical=1,
        mem_type="VRAM",
    )


def test_evenly_spaced_layers_of_whole_pages_fit_one_tensor():
    lay = mapping_layout(_regions([1 << 20, (1 << 20) + 50 * PAGE, (1 << 20) + 100 * PAGE]), 3, PAGE, 2)
    assert lay == MappingLayout(
        layers=3, blocks=10, page_bytes=PAGE, block_stride=PAGE, layer_stride=50 * PAGE
    )
    assert lay.span == 100 * PAGE + 9 * PAGE + PAGE
    assert lay.layer_span == 10 * PAGE


def test_one_layer_has_no_layer_stride():
    assert mapping_layout(_regions([1 << 20]), 1, PAGE, 2).layer_stride == 0


@pytest.mark.parametrize(
    ("regions", "layers", "field"),
    [
        (_regions([1 << 20, 2 << 20]), 1, "kv_caches_base_addr"),  # two regions for one layer (split K/V)
        (_regions([1 << 20, 2 << 20, 4 << 20]), 3, "kv_caches_base_addr"),  # not evenly spaced
        (_regions([2 << 20, 1 << 20]), 2, "kv_caches_base_addr"),  # descending
        (_regions([1 << 20, 2 << 20], lens=[PAGE, PAGE // 2], strides=PAGE), 2, "block_lens"),
        (_regions([1 << 20, 2 << 20], strides=[PAGE, 2 * PAGE]), 2, "block_strides"),
        (_regions([1 << 20, 2 << 20], blocks=[10, 11]), 2, "region_num_blocks"),
        (_regions([1 << 20, 2 << 20], lens=PAGE // 2, strides=PAGE), 2, "block_lens"),  # half pages
        (_regions([1 << 20, (1 << 20) + 3]), 2, "kv_caches_base_addr"),  # not whole elements apart
        (_regions([1 << 20, 2 << 20], strides=PAGE + 1), 2, "block_strides"),
    ],
)
def test_geometries_that_do_not_fit_are_refused_naming_the_field(regions, layers, field):
    with pytest.raises(MappingUnavailable) as info:
        mapping_layout(regions, layers, PAGE, 2)
    assert info.value.field == field


def test_metadata_that_is_not_nixls_is_refused_naming_its_entry():
    lay = mapping_layout(_regions([1 << 20]), 1, PAGE, 2)
    with pytest.raises(MappingUnavailable) as info:
        map_pages(b"not nixl metadata", _regions([1 << 20]), lay, None)
    assert info.value.field == "intro"


def test_host_memory_of_a_real_prefill_does_not_map_and_says_why(emu):
    meta = wire.fetch_handshake(emu.ready.side_channel_host, emu.ready.side_channel_port)[(0, 0)].metadata
    regions = RemoteRegions.from_metadata(meta, default_mem_type="DRAM")
    lay = mapping_layout(regions, LAYERS, FMT.page_bytes, FMT.elem_bytes)
    with pytest.raises(MappingUnavailable) as info:
        map_pages(meta.agent_metadata, regions, lay, None)
    assert info.value.field == "ucp_rkey_ptr"
    assert "unreachable" in info.value.reason.lower()


def test_a_prefill_without_ucx_is_refused_naming_agent_metadata(emu, monkeypatch):
    from sidecar.wire import nixl_metadata

    meta = wire.fetch_handshake(emu.ready.side_channel_host, emu.ready.side_channel_port)[(0, 0)].metadata
    real = nixl_metadata.read_agent_metadata(meta.agent_metadata)
    monkeypatch.setattr(
        nixl_metadata,
        "read_agent_metadata",
        lambda _b: types.SimpleNamespace(connections={"GDS": b""}, sections=real.sections),
    )
    regions = RemoteRegions.from_metadata(meta, default_mem_type="DRAM")
    lay = mapping_layout(regions, LAYERS, FMT.page_bytes, FMT.elem_bytes)
    with pytest.raises(MappingUnavailable) as info:
        map_pages(meta.agent_metadata, regions, lay, None)
    assert info.value.field == "agent_metadata"


# -- NixlPort.map_pages / unmap_pages: what it refuses and remembers (the port's logic, no NIXL agent) -------


class _Closable:
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1

    def source(self, dtype):
        return ("source", dtype)


def _port_and_peer(**peer_fields):
    from sidecar.nixl.port import NixlPort
    from sidecar.wire.formats import STANDARD, PageFormat

    port = NixlPort.__new__(NixlPort)  # the mapping calls read only the agent's settings
    port.agent = types.SimpleNamespace(settings=types.SimpleNamespace(cuda_device=None))
    fmt = PageFormat(
        kind=STANDARD, layout="LBHNC", dtype="bfloat16", num_heads=2, block_size=16, head_size=64
    )
    bases = [(1 << 20) + i * 64 * fmt.page_bytes for i in range(3)]
    fields = dict(plan=types.SimpleNamespace(remote=fmt), source=None, mapping=None, agent_metadata=b"x",
                  unloaded=False, engine_id="prefill-0", tp_rank=0)
    fields.update(peer_fields)
    peer = types.SimpleNamespace(
        regions=_regions(bases, lens=fmt.page_bytes, strides=fmt.page_bytes), **fields
    )
    return port, peer


def test_the_port_refuses_a_head_slice_naming_remote_tp_size_and_remembers_it(monkeypatch):
    import sidecar.nixl.port as port_mod

    calls = []
    monkeypatch.setattr(port_mod, "map_pages", lambda *a: calls.append(a))
    port, peer = _port_and_peer(source=object())
    with pytest.raises(MappingUnavailable) as first:
        port.map_pages(peer, "bf16")
    assert first.value.field == "remote_tp_size" and peer.mapping is first.value
    with pytest.raises(MappingUnavailable) as again:
        port.map_pages(peer, "bf16")
    assert again.value is first.value and calls == []  # remembered: never tried to map


def test_the_port_maps_once_then_answers_from_the_mapping_and_unmaps_it(monkeypatch):
    import sidecar.nixl.port as port_mod

    made = []

    def fake_map(metadata, regions, layout, device, fence=None):
        made.append((metadata, layout.layers, device, fence))
        return mapped

    def fence():
        return None

    mapped = _Closable()
    monkeypatch.setattr(port_mod, "map_pages", fake_map)
    monkeypatch.setattr(port_mod, "MappedPages", _Closable)
    port, peer = _port_and_peer()
    assert port.map_pages(peer, "bf16", fence) == ("source", "bf16")
    assert port.map_pages(peer, "fp16", fence) == ("source", "fp16")
    assert made == [(b"x", 3, None, fence)]  # the mapping keeps the fence its unmapping waits for
    port.unmap_pages(peer)
    assert mapped.closed == 1 and peer.mapping is None
    port.unmap_pages(peer)  # nothing held: nothing to do
    assert mapped.closed == 1


def test_the_port_passes_a_layout_refusal_on_and_remembers_it():
    port, peer = _port_and_peer()
    page = peer.plan.remote.page_bytes
    peer.regions = _regions([1 << 20, 2 << 20, 4 << 20], lens=page, strides=page)  # layers not evenly spaced
    with pytest.raises(MappingUnavailable) as info:
        port.map_pages(peer, "bf16")
    assert info.value.field == "kv_caches_base_addr" and peer.mapping is info.value
    port.unmap_pages(peer)  # a refusal is not a mapping: nothing closed, and it is forgotten
    assert peer.mapping is None


def test_the_port_maps_no_peer_nixl_let_go_and_keeps_the_mapping_it_had(monkeypatch):
    """A peer unloaded by a newer registration or a restarted prefill: its old regions may now hold the newer
    registration's pages, so nothing is mapped for it; a mapping made before stays for ``remove_peer`` (a
    conversion launched before may still read it) and is not replaced by the refusal."""
    import sidecar.nixl.port as port_mod

    calls = []
    monkeypatch.setattr(port_mod, "map_pages", lambda *a, **kw: calls.append(a))
    port, peer = _port_and_peer(unloaded=True)
    with pytest.raises(MappingUnavailable) as info:
        port.map_pages(peer, "bf16")
    assert info.value.field == "remote_registration_generation" and calls == [] and peer.mapping is None
    held = _Closable()
    monkeypatch.setattr(port_mod, "MappedPages", _Closable)
    port, peer = _port_and_peer(unloaded=True, mapping=held)
    with pytest.raises(MappingUnavailable):
        port.map_pages(peer, "bf16")
    assert peer.mapping is held and held.closed == 0


def test_a_mapping_that_fails_after_the_keys_are_unpacked_closes_them(monkeypatch):
    """The keys are unpacked (on a GPU cuda_ipc has opened the prefill's memory), then the view of it fails
    with neither UCX's error nor the metadata's (torch refusing the pointer, say). Before, the worker, its
    endpoint and keys stayed open for good: nobody held them to close, and the prefill's memory stayed
    mapped (allocated) after it exited. Now they are closed and the failure passed on."""
    import sidecar.nixl.mapping as mapping_mod
    import sidecar.nixl.ucx as ucx_mod
    from sidecar.wire import nixl_metadata

    closed = []

    class Key:
        def ptr(self, addr):
            return addr

    class Endpoint:
        def unpack(self, key):
            return Key()

    class Worker:
        def __init__(self, ucp=None):
            pass

        def connect(self, address):
            return Endpoint()

        def close(self):
            closed.append(True)

    region = types.SimpleNamespace(key=b"key")
    agent = types.SimpleNamespace(connections={"UCX": b"worker"}, region_at=lambda addr, n: ("VRAM", region))
    monkeypatch.setattr(ucx_mod, "UcpWorker", Worker)
    monkeypatch.setattr(nixl_metadata, "read_agent_metadata", lambda _b: agent)

    def refuse(ptr, nbytes, device):
        raise RuntimeError("the pointer is not device memory")

    monkeypatch.setattr(mapping_mod, "memory_view", refuse)
    regions = _regions([1 << 20, (1 << 20) + 50 * PAGE])
    with pytest.raises(RuntimeError, match="not device memory"):
        map_pages(b"metadata", regions, mapping_layout(regions, 2, PAGE, 2), 0)
    assert closed == [True]
