"""``sidecar.wire.nixl_metadata`` on the bytes a real NIXL 1.5 agent publishes (DRAM over UCX, this host),
and on every way those bytes can be cut short or corrupted: a clear ``NixlMetadataError``, nothing else."""

from __future__ import annotations

import contextlib
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.wire.nixl_metadata import (
    INTRO,
    NixlMetadataError,
    read_agent_metadata,
    read_agent_name,
    read_packed_key,
)


@pytest.fixture(scope="module")
def agent():
    """A real NIXL agent with two DRAM buffers registered: its name, the buffers and its metadata bytes."""
    from nixl._api import nixl_agent, nixl_agent_config

    a = nixl_agent("metadata-test", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    buffers = [np.zeros(65536, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)]
    reg = a.register_memory([(b.ctypes.data, b.nbytes, 0, "") for b in buffers], "DRAM")
    yield "metadata-test", buffers, a.get_agent_metadata()
    a.deregister_memory(reg)


def test_a_real_agents_metadata_reads_back_its_name_worker_and_regions(agent):
    name, buffers, data = agent
    md = read_agent_metadata(data)
    assert md.name == name
    assert set(md.connections) == {"UCX"} and len(md.connections["UCX"]) > 16  # the UCP worker's address
    (section,) = md.sections
    assert (section.backend, section.mem_type) == ("UCX", "DRAM")
    got = sorted((r.addr, r.length, r.device_id) for r in section.regions)
    assert got == sorted((b.ctypes.data, b.nbytes, 0) for b in buffers)
    for region in section.regions:
        key = read_packed_key(region.key)
        assert key.mem_type == "host" and key.transport_keys  # at least one memory domain can reach it


def test_the_agent_name_alone_is_read_from_the_first_entry_and_a_cut_one_refused(agent):
    """``read_agent_name`` reads what NIXL loads the metadata under, and only that: what follows the name
    is not read, a cut inside it is refused."""
    name, _, data = agent
    end = len(INTRO) + len(b"Agent") + 8 + len(name) + 1
    assert read_agent_name(data) == name and read_agent_name(data[:end]) == name
    for n in range(end):
        with pytest.raises(NixlMetadataError):
            read_agent_name(data[:n])


def test_region_at_finds_the_region_holding_a_range_and_refuses_one_outside(agent):
    _, buffers, data = agent
    md = read_agent_metadata(data)
    big = buffers[0]
    mem, region = md.region_at(big.ctypes.data + 100, 1000)
    assert mem == "DRAM" and region.addr == big.ctypes.data
    with pytest.raises(NixlMetadataError) as exc:
        md.region_at(big.ctypes.data + big.nbytes - 10, 20)  # runs past its end
    assert exc.value.field == "addr"
    with pytest.raises(NixlMetadataError):
        md.region_at(big.ctypes.data, 1, backend="POSIX")


def test_every_truncation_is_refused_naming_an_entry_but_one(agent):
    """NIXL counts sections it then leaves out (backends that publish nothing remote), so bytes that end right
    after the section count read as an agent with no sections; a cut anywhere else is refused."""
    data = agent[2]
    after_count = data.index(b"nixlSecElms") + len(b"nixlSecElms") + 8 + 8 + 1
    read = []
    for n in range(len(data)):
        try:
            md = read_agent_metadata(data[:n])
        except NixlMetadataError as exc:
            assert exc.field and exc.reason
            continue
        read.append(n)
        assert md.sections == ()
    assert read == [after_count]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_corrupted_bytes_are_read_or_refused_never_crash(agent, data):
    raw = bytearray(agent[2])
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    with contextlib.suppress(NixlMetadataError):  # any other exception fails the test
        read_agent_metadata(bytes(raw))


def _entry(tag: bytes, value: bytes) -> bytes:
    return tag + struct.pack("<Q", len(value)) + value + b"|"


def _metadata(sections: bytes, count: int = 1, tail: bytes = b"") -> bytes:
    head = (
        _entry(b"Agent", b"a")
        + _entry(b"Conns", struct.pack("<Q", 1))
        + _entry(b"t", b"UCX")
        + _entry(b"c", b"w")
    )
    return (
        INTRO
        + head
        + _entry(b"", b"MemSection")
        + _entry(b"nixlSecElms", struct.pack("<Q", count))
        + sections
        + tail
    )


def _section(mem: int, regions: list[bytes], kind: bytes = b"nixlSDList") -> bytes:
    body = _entry(b"bknd", b"UCX") + _entry(b"nixlDList", kind) + _entry(b"t", struct.pack("<I", mem))
    return body + _entry(b"n", struct.pack("<Q", len(regions))) + b"".join(_entry(b"", r) for r in regions)


def test_a_hand_built_section_of_each_memory_type_reads_back():
    region = struct.pack("<QQQ", 0x1000, 4096, 3) + b"KEY"
    for mem, name in enumerate(("DRAM", "VRAM", "BLK", "OBJ", "FILE")):
        (section,) = read_agent_metadata(_metadata(_section(mem, [region]))).sections
        assert (
            section.mem_type == name
            and section.regions[0].device_id == 3
            and section.regions[0].key == b"KEY"
        )
    # backends that publish nothing remote are counted but written as nothing: the reader stops at the end
    assert len(read_agent_metadata(_metadata(_section(0, [region]), count=3)).sections) == 1


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (b"nixlSerDes" + b"x" * 40, "intro"),
        (_metadata(_section(5, [])), "t"),
        (_metadata(_section(0, [], kind=b"nixlDList")), "nixlDList"),
        (_metadata(_section(0, [b"short"])), "region"),
        (_metadata(_section(0, []), tail=b"extra"), "end"),
        (INTRO + _entry(b"Agent", b"a") + _entry(b"Conns", b"\x01"), "Conns"),
        (
            INTRO + _entry(b"Agent", b"a") + _entry(b"Conns", struct.pack("<Q", 0)) + _entry(b"", b"Other"),
            "MemSection",
        ),
    ],
)
def test_what_is_not_nixl_15_metadata_is_refused_naming_the_entry(data, field):
    with pytest.raises(NixlMetadataError) as exc:
        read_agent_metadata(data)
    assert exc.value.field == field


def test_packed_keys_read_their_memory_type_and_each_domains_key():
    key = struct.pack("<QB", 0b101, 1) + bytes([2]) + b"ab" + bytes([0]) + bytes([255])
    got = read_packed_key(key)
    assert got.mem_type == "cuda" and got.transport_keys == {0: b"ab", 2: b""}
    # every UCS memory type UCX 1.2x can pack, in its enum's order, the last one included
    assert read_packed_key(struct.pack("<QB", 0, 3)).mem_type == "rocm"
    assert read_packed_key(struct.pack("<QB", 0, 8)).mem_type == "ze_managed"


@pytest.mark.parametrize(
    ("key", "field"),
    [
        (b"\x01" * 8, "key"),  # shorter than the header
        (struct.pack("<QB", 1, 42), "key.mem_type"),
        (struct.pack("<QB", 1, 0) + bytes([9]) + b"abc", "key"),  # its key runs past the end
        (struct.pack("<QB", 0b11, 0) + bytes([0]), "key"),  # the second domain is missing
    ],
)
def test_broken_packed_keys_are_refused(key, field):
    with pytest.raises(NixlMetadataError) as exc:
        read_packed_key(key)
    assert exc.value.field == field
