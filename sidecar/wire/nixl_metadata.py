"""NIXL's agent metadata, read without NIXL: what a stock prefill publishes inside its handshake.

vLLM's handshake carries ``NixlAgentMetadata.agent_metadata``, the bytes of the prefill agent's
``get_agent_metadata()``. NIXL 1.5 writes them with its own serializer (``nixlSerDes``, ai-dynamo/nixl
``src/utils/serdes/serdes.cpp``): the intro ``nixlSerDes|``, then entries of tag, little-endian u64 length,
value and ``|``, in a fixed order (``nixlAgent::getLocalMD``, ``nixlLocalSection::serialize``,
``nixlDescList::serialize``)::

    Agent=<name>  Conns=<u64 n>  n x (t=<backend>  c=<connection info>)
    ""=MemSection  nixlSecElms=<u64 m>
    up to m x (bknd=<backend>  nixlDList=nixlSDList  t=<u32 memory type>  n=<u64 k>
               k x (""=<u64 addr, u64 len, u64 device id, the backend's key for the region>))

For UCX the connection info is the worker's address and a region's key is ``ucp_rkey_pack``'s output:
together what a UCP endpoint needs to read the region (``sidecar.nixl.ucx``). Every entry is checked in
order; anything else is refused naming the entry, never guessed.
"""

from __future__ import annotations

import struct

import msgspec

INTRO = b"nixlSerDes|"
MEM_TYPES = ("DRAM", "VRAM", "BLK", "OBJ", "FILE")  # nixl_mem_t, in its order (nixl_types.h)
# ucs_memory_type_t, in its order (UCX 1.2x ucs/memory/memory_type.h): the packed key's memory type.
UCS_MEMORY_TYPES = (
    "host",
    "cuda",
    "cuda_managed",
    "rocm",
    "rocm_managed",
    "rdma",
    "ze_host",
    "ze_device",
    "ze_managed",
)


class NixlMetadataError(ValueError):
    """The bytes are not NIXL 1.5 agent metadata as this reader knows it; ``field`` names the entry."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class Region(msgspec.Struct, frozen=True):
    """One registered range and its backend's key for it (UCX: the packed remote key)."""

    addr: int
    length: int
    device_id: int
    key: bytes

    def holds(self, addr: int, length: int) -> bool:
        return self.addr <= addr and addr + length <= self.addr + self.length


class MemSection(msgspec.Struct, frozen=True):
    """A backend's regions of one memory type."""

    backend: str
    mem_type: str
    regions: tuple[Region, ...]


class AgentMetadata(msgspec.Struct, frozen=True):
    name: str
    connections: dict[str, bytes]  # backend -> its connection info (UCX: the worker address)
    sections: tuple[MemSection, ...]

    def region_at(self, addr: int, length: int = 1, backend: str = "UCX") -> tuple[str, Region]:
        """(memory type, region) of the ``backend`` region holding ``[addr, addr + length)``."""
        for section in self.sections:
            if section.backend == backend:
                for region in section.regions:
                    if region.holds(addr, length):
                        return section.mem_type, region
        raise NixlMetadataError("addr", f"no {backend} region holds {length} bytes at {addr:#x}")


class PackedKey(msgspec.Struct, frozen=True):
    """``ucp_rkey_pack``'s output: the memory type and one transport key per remote memory domain."""

    mem_type: str
    transport_keys: dict[int, bytes]  # remote memory domain index -> its key


class _Entries:
    """The serializer's entries, read in order."""

    def __init__(self, data: bytes) -> None:
        if not data.startswith(INTRO):
            raise NixlMetadataError("intro", f"does not start with {INTRO!r}")
        self._data = data
        self._at = len(INTRO)

    @property
    def done(self) -> bool:
        return self._at == len(self._data)

    def value(self, tag: bytes) -> bytes:
        data, at = self._data, self._at
        name = tag.decode() or '""'
        if data[at : at + len(tag)] != tag:
            raise NixlMetadataError(name, f"expected at byte {at}, found {data[at : at + 12]!r}")
        at += len(tag)
        if at + 8 > len(data):
            raise NixlMetadataError(name, "the bytes end inside its length")
        (size,) = struct.unpack_from("<Q", data, at)
        at += 8
        if at + size + 1 > len(data) or data[at + size : at + size + 1] != b"|":
            raise NixlMetadataError(name, f"{size} bytes do not fit, or do not end with '|'")
        self._at = at + size + 1
        return data[at : at + size]

    def text(self, tag: bytes) -> str:
        raw = self.value(tag)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            raise NixlMetadataError(tag.decode(), f"{raw[:16]!r} is not UTF-8 text") from None

    def number(self, tag: bytes, size: int = 8) -> int:
        raw = self.value(tag)
        if len(raw) != size:
            raise NixlMetadataError(tag.decode(), f"{len(raw)} bytes, expected a {size}-byte number")
        return int.from_bytes(raw, "little")


def read_agent_metadata(data: bytes) -> AgentMetadata:
    """The agent's name, each backend's connection info and every registered region with its key."""
    entries = _Entries(bytes(data))
    name = entries.text(b"Agent")
    connections = {}
    for _ in range(entries.number(b"Conns")):
        backend = entries.text(b"t")
        connections[backend] = entries.value(b"c")
    if entries.value(b"") != b"MemSection":
        raise NixlMetadataError("MemSection", "the memory sections' marker is missing")
    sections = []
    # The count includes backends that publish nothing remote; their sections are left out: stop at the end.
    for _ in range(entries.number(b"nixlSecElms")):
        if entries.done:
            break
        sections.append(_section(entries))
    if not entries.done:
        raise NixlMetadataError("end", "bytes after the last memory section")
    return AgentMetadata(name, connections, tuple(sections))


def read_agent_name(data: bytes) -> str:
    """The agent's name alone (the first entry): what NIXL loads the metadata under, read before it does."""
    return _Entries(bytes(data)).text(b"Agent")


def _section(entries: _Entries) -> MemSection:
    backend = entries.text(b"bknd")
    kind = entries.value(b"nixlDList")
    if kind != b"nixlSDList":
        raise NixlMetadataError("nixlDList", f"{kind!r} is not a list of registered regions")
    mem = entries.number(b"t", 4)
    if mem >= len(MEM_TYPES):
        raise NixlMetadataError("t", f"unknown memory type {mem}")
    regions = []
    for _ in range(entries.number(b"n")):
        raw = entries.value(b"")
        if len(raw) < 24:
            raise NixlMetadataError("region", f"{len(raw)} bytes, shorter than address, length and device")
        addr, length, device = struct.unpack_from("<QQQ", raw)
        regions.append(Region(addr, length, device, raw[24:]))
    return MemSection(backend, MEM_TYPES[mem], tuple(regions))


def read_packed_key(data: bytes) -> PackedKey:
    """A UCX 1.2x packed remote key (``ucp_rkey_pack_memh``): u64 memory-domain map, u8 memory type, then
    per domain in the map a u8 size and its key; what follows (system device, distances) is not read."""
    if len(data) < 9:
        raise NixlMetadataError("key", f"{len(data)} bytes, shorter than a packed key's header")
    md_map, mem = struct.unpack_from("<QB", data)
    if mem >= len(UCS_MEMORY_TYPES):
        raise NixlMetadataError("key.mem_type", f"unknown UCS memory type {mem}")
    keys, at = {}, 9
    for md in range(64):
        if md_map >> md & 1:
            if at >= len(data) or at + 1 + data[at] > len(data):
                raise NixlMetadataError("key", f"memory domain {md}'s key runs past the end")
            keys[md] = data[at + 1 : at + 1 + data[at]]
            at += 1 + data[at]
    return PackedKey(UCS_MEMORY_TYPES[mem], keys)
