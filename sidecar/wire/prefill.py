"""The wire of a stock vLLM prefill's NixlConnector (v14, v15): pure codecs and the side-channel client.

Pinned by docs/reference/vllm-0.33-nixl-protocol.md and checked against the vLLM 0.32.0/0.33.0 wheels:
``NixlAgentMetadata`` is the same 21 fields in both versions; v15 only adds ``remote_registration_generation``
to ``kv_transfer_params``. Both dataclasses travel as msgpack maps keyed by field name, every field present.

Size: two pinned wire versions and their client; kept together so a version bump is one diff.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from collections.abc import Iterable, Mapping
from typing import Annotated, Any

import msgspec
import zmq

GET_META_MSG = b"get_meta_msg"
HEARTBEAT_PREFIX = "HB:"
# A pull prefill treats these prefixes as commands, not request ids (pull_worker._get_new_notifs).
RESERVED_ID_PREFIXES = ("HB:", "PUSH_REG:")
DEFAULT_HANDSHAKE_TIMEOUT_S = 5.0
# A side-channel reply frame larger than this is refused: ZMQ (MAXMSGSIZE) drops the connection instead of
# handing it over. The emulator's reply (sidecar/standins/emulator.py) is 8.3 KB for 128 layers, 5.6 KB for
# 80; a vLLM prefill's agent blob adds a packed UCX key or two per registered region (hundreds of bytes each),
# so a real one stays far below a MiB. Unbounded, a hostile prefill's 194 MB reply was decoded whole (2.1 GB).
MAX_HANDSHAKE_REPLY_BYTES = 8 << 20
CONNECTOR_VERSIONS = (14, 15)
LATEST_CONNECTOR_VERSION = 15
MEM_TYPES = ("DRAM", "VRAM")

# Entries of any list or map in NixlAgentMetadata (regions, their members, packed layouts), checked from the
# msgpack header before an element is built. A prefill has one region per layer (a head plane or a K/V plane
# per layer under LHBNC), far below this. Unbounded, 8 MiB of empty arrays in region_members decoded into
# ~0.5 GB of Python lists (and seconds on the loop) before admission refused the field.
MAX_REGIONS = 1 << 16

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]
HexDigest = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
_Bounded = msgspec.Meta(max_length=MAX_REGIONS)


# --- errors ---


class WireError(ValueError):
    """A message from or for a vLLM peer is malformed; ``field`` names the offending field."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class HandshakeRefused(WireError):
    """A side-channel reply arrived but is refused (bad frames, bad metadata, wrong engine)."""

    def __init__(self, field: str, reason: str, address: str = "") -> None:
        super().__init__(field, f"{reason} (from {address})" if address else reason)
        self.address = address


class IdentityMismatch(WireError):
    """The remote's compatibility hash differs from ours once the backend name is set aside."""


class HandshakeDropped(ConnectionError):
    """The side channel's connection dropped while a reply was awaited: a reply frame over the bound (ZMQ
    refuses it by dropping the connection) or a prefill that closed it. Transient, like a timeout."""

    def __init__(self, address: str, pp_rank: int, tp_rank: int) -> None:
        super().__init__(
            f"the connection to {address} dropped before the handshake reply for (pp={pp_rank}, "
            f"tp={tp_rank}) came: a reply frame over {MAX_HANDSHAKE_REPLY_BYTES} bytes (refused), or the "
            "prefill closed it"
        )
        self.address = address
        self.pp_rank = pp_rank
        self.tp_rank = tp_rank


class HandshakeTimeout(TimeoutError):
    """No reply from a prefill's side channel within the bound."""

    def __init__(self, address: str, pp_rank: int, tp_rank: int, timeout_s: float) -> None:
        super().__init__(
            f"no handshake reply from {address} for (pp={pp_rank}, tp={tp_rank}) within {timeout_s:g} s"
        )
        self.address = address
        self.pp_rank = pp_rank
        self.tp_rank = tp_rank
        self.timeout_s = timeout_s


_AT_FIELD = re.compile(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)")
_MISSING_FIELD = re.compile(r"missing required field `([^`]+)`")


def _wire_error(exc: msgspec.MsgspecError, container: str) -> WireError:
    """Translate a msgspec decoding error into a WireError naming the field (or the container if none)."""
    text = str(exc)
    m = _MISSING_FIELD.search(text) or _AT_FIELD.search(text)
    return WireError(m.group(1) if m else container, text)


# --- handshake ---


class NixlHandshakePayload(msgspec.Struct, frozen=True):
    """Frame 1 of a side-channel reply; ``agent_metadata_bytes`` is a msgpack ``NixlAgentMetadata``."""

    compatibility_hash: HexDigest
    agent_metadata_bytes: Annotated[bytes, msgspec.Meta(min_length=1)]


class NixlAgentMetadata(msgspec.Struct, frozen=True, kw_only=True):
    """vLLM's NixlAgentMetadata (connector v14 == v15), fields in wire order.

    Required: the fields vLLM gives no default plus the per-region geometry a reader relies on
    (``region_num_blocks``, ``region_mem_types``); vLLM's defaults for the rest.
    """

    engine_id: NonEmptyStr
    agent_metadata: Annotated[bytes, msgspec.Meta(min_length=1)]
    kv_caches_base_addr: Annotated[list[NonNegInt], _Bounded]
    device_id: NonNegInt
    num_blocks: NonNegInt
    block_lens: Annotated[list[PosInt], _Bounded]
    block_strides: Annotated[list[PosInt], _Bounded]
    kv_cache_layout: NonEmptyStr
    block_size: PosInt
    ssm_sizes: tuple[NonNegInt, NonNegInt]
    attn_backend_name: NonEmptyStr
    physical_blocks_per_logical_kv_block: PosInt
    region_num_blocks: Annotated[list[NonNegInt], _Bounded]
    region_group_ids: Annotated[list[int], _Bounded] | None = None
    region_names: Annotated[list[str], _Bounded] | None = None
    region_mem_types: Annotated[list[str], _Bounded]
    dcp_size: PosInt = 1
    pcp_size: PosInt = 1
    ple_block_len: NonNegInt | None = None
    region_members: Annotated[list[Annotated[list[str], _Bounded]], _Bounded] = []
    packed_member_layouts: Annotated[dict[str, tuple[int, int]], _Bounded] = {}

    @property
    def num_regions(self) -> int:
        return len(self.kv_caches_base_addr)


_PAYLOAD_DECODER = msgspec.msgpack.Decoder(NixlHandshakePayload)
_METADATA_DECODER = msgspec.msgpack.Decoder(NixlAgentMetadata)
_FLOAT_DECODER = msgspec.msgpack.Decoder(float)
_REQUEST_DECODER = msgspec.msgpack.Decoder(tuple[bytes, NonNegInt, NonNegInt])
_ENCODER = msgspec.msgpack.Encoder()


def check_agent_metadata(meta: NixlAgentMetadata) -> NixlAgentMetadata:
    """Refuse per-region lists that disagree in length, strides below lens, or unknown memory types."""
    n = len(meta.kv_caches_base_addr)
    if n == 0:
        raise WireError("kv_caches_base_addr", "no regions advertised")
    per_region = {
        "block_lens": meta.block_lens,
        "block_strides": meta.block_strides,
        "region_num_blocks": meta.region_num_blocks,
        "region_mem_types": meta.region_mem_types,
        "region_group_ids": meta.region_group_ids,
        "region_names": meta.region_names,
    }
    for name, values in per_region.items():
        if values is not None and len(values) != n:
            raise WireError(name, f"has {len(values)} entries for {n} regions (kv_caches_base_addr)")
    for i, (length, stride) in enumerate(zip(meta.block_lens, meta.block_strides, strict=True)):
        if stride < length:
            raise WireError("block_strides", f"region {i}: stride {stride} < block_len {length}")
    for i, mem in enumerate(meta.region_mem_types):
        if mem not in MEM_TYPES:
            raise WireError("region_mem_types", f"region {i}: {mem!r} is not one of {MEM_TYPES}")
    return meta


def decode_agent_metadata(data: bytes) -> NixlAgentMetadata:
    """Strictly decode the inner metadata map; unknown keys are ignored, anything wrong is a WireError."""
    try:
        meta = _METADATA_DECODER.decode(data)
    except msgspec.MsgspecError as exc:
        raise _wire_error(exc, "agent_metadata_bytes") from None
    return check_agent_metadata(meta)


def decode_handshake_payload(data: bytes) -> NixlHandshakePayload:
    """Strictly decode frame 1 of a reply (the inner metadata stays encoded)."""
    try:
        return _PAYLOAD_DECODER.decode(data)
    except msgspec.MsgspecError as exc:
        raise _wire_error(exc, "handshake_payload") from None


def encode_agent_metadata(meta: NixlAgentMetadata) -> bytes:
    """Bytes identical to vLLM's default msgspec encoding of its NixlAgentMetadata dataclass."""
    return _ENCODER.encode(meta)


def encode_handshake_payload(compatibility_hash: str, agent_metadata_bytes: bytes) -> bytes:
    """Bytes identical to vLLM's encoding of its NixlHandshakePayload dataclass."""
    return _ENCODER.encode(NixlHandshakePayload(compatibility_hash, agent_metadata_bytes))


def _check_rank(name: str, value: object) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def encode_handshake_request(pp_rank: int, tp_rank: int) -> bytes:
    """The request frame ``(b"get_meta_msg", pp_rank, tp_rank)``; bad ranks raise ValueError here."""
    return _ENCODER.encode((GET_META_MSG, _check_rank("pp_rank", pp_rank), _check_rank("tp_rank", tp_rank)))


def decode_handshake_request(frame: bytes) -> tuple[int, int]:
    """(pp_rank, tp_rank) of a request frame; anything a stock prefill would choke on is a WireError."""
    try:
        tag, pp_rank, tp_rank = _REQUEST_DECODER.decode(frame)
    except msgspec.MsgspecError as exc:
        raise WireError("handshake_request", str(exc)) from None
    if tag != GET_META_MSG:
        raise WireError("handshake_request", f"tag {tag!r} is not {GET_META_MSG!r}")
    return pp_rank, tp_rank


def encode_clock_frame(perf_counter: float | None = None) -> bytes:
    """Frame 2 of a reply: the prefill's perf_counter as a msgpack float64."""
    return _ENCODER.encode(time.perf_counter() if perf_counter is None else float(perf_counter))


class HandshakeReply(msgspec.Struct, frozen=True):
    """One decoded side-channel reply for (pp_rank, tp_rank)."""

    pp_rank: int
    tp_rank: int
    compatibility_hash: str
    metadata: NixlAgentMetadata
    remote_perf_counter: float
    rtt_s: float


def decode_handshake_reply(
    frames: list[bytes],
    pp_rank: int = 0,
    tp_rank: int = 0,
    rtt_s: float = 0.0,
    expected_engine_id: str | None = None,
) -> HandshakeReply:
    """Check the 2 reply frames and decode both levels; refusals are WireErrors naming the field."""
    if len(frames) != 2:
        raise WireError("reply_frames", f"expected exactly 2 frames, got {len(frames)}")
    payload = decode_handshake_payload(frames[0])
    try:
        remote_perf = _FLOAT_DECODER.decode(frames[1])
    except msgspec.MsgspecError as exc:
        raise WireError("remote_perf_counter", str(exc)) from None
    meta = decode_agent_metadata(payload.agent_metadata_bytes)
    if expected_engine_id is not None and meta.engine_id != expected_engine_id:
        raise WireError(
            "engine_id", f"remote sent {meta.engine_id!r}, kv_transfer_params said {expected_engine_id!r}"
        )
    return HandshakeReply(pp_rank, tp_rank, payload.compatibility_hash, meta, remote_perf, rtt_s)


# --- side-channel client ---


def side_channel_address(host: str, port: int) -> str:
    """``tcp://host:port`` as vLLM's make_zmq_path builds it (IPv6 in brackets)."""
    if not host:
        raise ValueError("host must be non-empty")
    if type(port) is not int or not 0 < port < 65536:
        raise ValueError(f"port must be an int in 1..65535, got {port!r}")
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _check_targets(ranks: Iterable[tuple[int, int]], timeout_s: float) -> list[tuple[int, int]]:
    targets = [(_check_rank("pp_rank", pp), _check_rank("tp_rank", tp)) for pp, tp in ranks]
    if not targets:
        raise ValueError("ranks must name at least one (pp_rank, tp_rank)")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    return targets


def _configure_req(sock: zmq.Socket, address: str, timeout_s: float) -> zmq.Socket:
    """Options and connect; returns a monitor socket reporting each time the connection drops."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_HANDSHAKE_REPLY_BYTES)
    ms = max(1, int(timeout_s * 1000))
    sock.setsockopt(zmq.RCVTIMEO, ms)
    sock.setsockopt(zmq.SNDTIMEO, ms)
    if address.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    # A REQ socket never resends, so a request whose connection dropped (how ZMQ refuses a reply past
    # MAXMSGSIZE) would only wait out its timeout: the monitor tells the wait to stop at once.
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(address)
    return monitor


def _close(sock: zmq.Socket, monitor: zmq.Socket) -> None:
    monitor.close(linger=0)
    sock.close(linger=0)


def _drain(monitor: zmq.Socket) -> None:
    """Forget drops reported before this request: it goes out on the connection made since."""
    while monitor.poll(0):
        monitor.recv_multipart()


def _await_reply(sock: zmq.Socket, monitor: zmq.Socket, timeout_s: float) -> list[bytes] | None:
    """The reply's frames; None when the connection dropped first. zmq.Again once ``timeout_s`` passed."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        ready = dict(poller.poll(max(1, int(left * 1000))))
        if sock in ready:
            return sock.recv_multipart()
        if monitor in ready:
            return None
    raise zmq.Again()


def _accept_reply(
    frames: list[bytes], pp: int, tp: int, rtt_s: float, expected_engine_id: str | None, address: str
) -> HandshakeReply:
    """decode_handshake_reply, its WireError raised as the client's HandshakeRefused."""
    try:
        return decode_handshake_reply(frames, pp, tp, rtt_s, expected_engine_id)
    except WireError as exc:
        raise HandshakeRefused(exc.field, exc.reason, address) from None


def fetch_handshake(
    host: str,
    port: int,
    ranks: Iterable[tuple[int, int]] = ((0, 0),),
    *,
    timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
    expected_engine_id: str | None = None,
    context: zmq.Context | None = None,
) -> dict[tuple[int, int], HandshakeReply]:
    """Blocking handshake: one REQ socket, one request per (pp, tp), each reply bounded by ``timeout_s``."""
    targets = _check_targets(ranks, timeout_s)
    address = side_channel_address(host, port)
    ctx = context or zmq.Context.instance()
    out: dict[tuple[int, int], HandshakeReply] = {}
    sock = ctx.socket(zmq.REQ)
    monitor = _configure_req(sock, address, timeout_s)
    try:
        for pp, tp in targets:
            start = time.perf_counter()
            _drain(monitor)
            try:
                sock.send(encode_handshake_request(pp, tp))
                frames = _await_reply(sock, monitor, timeout_s)
            except zmq.Again:
                raise HandshakeTimeout(address, pp, tp, timeout_s) from None
            if frames is None:
                raise HandshakeDropped(address, pp, tp)
            rtt = time.perf_counter() - start
            out[(pp, tp)] = _accept_reply(frames, pp, tp, rtt, expected_engine_id, address)
    finally:
        _close(sock, monitor)
    return out


async def fetch_handshake_async(
    host: str,
    port: int,
    ranks: Iterable[tuple[int, int]] = ((0, 0),),
    *,
    timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
    expected_engine_id: str | None = None,
    context: Any = None,
) -> dict[tuple[int, int], HandshakeReply]:
    """The same handshake on the running asyncio (or uvloop) loop, through zmq.asyncio."""
    import zmq.asyncio

    targets = _check_targets(ranks, timeout_s)
    address = side_channel_address(host, port)
    ctx = context or zmq.asyncio.Context.instance()
    out: dict[tuple[int, int], HandshakeReply] = {}
    sock = ctx.socket(zmq.REQ)
    monitor = _configure_req(sock, address, timeout_s)
    try:
        for pp, tp in targets:
            start = time.perf_counter()
            await _drain_async(monitor)
            try:
                await asyncio.wait_for(sock.send(encode_handshake_request(pp, tp)), timeout_s)
                frames = await _await_reply_async(sock, monitor, timeout_s)
            except (TimeoutError, zmq.Again):
                raise HandshakeTimeout(address, pp, tp, timeout_s) from None
            if frames is None:
                raise HandshakeDropped(address, pp, tp)
            rtt = time.perf_counter() - start
            out[(pp, tp)] = _accept_reply(frames, pp, tp, rtt, expected_engine_id, address)
    finally:
        _close(sock, monitor)
    return out


async def _drain_async(monitor: Any) -> None:
    while await monitor.poll(0):
        await monitor.recv_multipart()


async def _await_reply_async(sock: Any, monitor: Any, timeout_s: float) -> list[bytes] | None:
    """``_await_reply`` on the loop: the frames, None on a drop, asyncio.TimeoutError past the bound."""
    reply = asyncio.ensure_future(sock.recv_multipart())
    dropped = asyncio.ensure_future(monitor.recv_multipart())
    try:
        done, _ = await asyncio.wait((reply, dropped), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for fut in (reply, dropped):
            fut.cancel()
    if reply in done:
        return reply.result()
    if dropped in done:
        return None
    raise TimeoutError


# --- notifications and heartbeats ---


def validate_request_id(request_id: object, field: str = "remote_request_id") -> str:
    """A prefill request id that is safe in a notification or heartbeat, else ValueError (WireError)."""
    if not isinstance(request_id, str) or not request_id:
        raise WireError(field, f"must be a non-empty str, got {request_id!r}")
    try:
        request_id.encode("utf-8")
    except UnicodeEncodeError:
        raise WireError(field, f"{request_id!r} is not encodable as UTF-8") from None
    if "," in request_id:
        raise WireError(field, f"{request_id!r} contains ',' (the heartbeat separator)")
    if request_id.startswith(RESERVED_ID_PREFIXES):
        raise WireError(field, f"{request_id!r} starts with a reserved prefix {RESERVED_ID_PREFIXES}")
    return request_id


def encode_notification(remote_request_id: str, n: int) -> bytes:
    """``f"{remote_request_id}:{n}"``, n = readers of this prefill rank; validated (a bad one crashes P)."""
    validate_request_id(remote_request_id)
    if type(n) is not int or n < 1:
        raise WireError("n", f"reader count must be an int >= 1, got {n!r}")
    return f"{remote_request_id}:{n}".encode()


def encode_heartbeat(ids: Iterable[str]) -> bytes:
    """``b"HB:" + b",".join(ids)``, every id validated, at least one (a lone str is one id)."""
    ids = list(ids) if not isinstance(ids, str) else [ids]
    if not ids:
        raise WireError("heartbeat", "needs at least one request id")
    return (HEARTBEAT_PREFIX + ",".join(validate_request_id(i) for i in ids)).encode()


class CompletionNotif(msgspec.Struct, frozen=True):
    """A parsed ``"{id}:{n}"`` notification."""

    request_id: str
    n: int


class HeartbeatNotif(msgspec.Struct, frozen=True):
    """A parsed ``"HB:id1,id2"`` heartbeat."""

    request_ids: tuple[str, ...]


def parse_notification(msg: bytes) -> CompletionNotif | HeartbeatNotif:
    """Parse as stock P does, but refuse (WireError "notification") what our encoders would never send."""
    try:
        text = msg.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WireError("notification", f"not UTF-8: {exc}") from None
    if text.startswith(HEARTBEAT_PREFIX):
        ids = tuple(text[len(HEARTBEAT_PREFIX) :].split(","))
        for i in ids:
            validate_request_id(i, "notification")
        return HeartbeatNotif(ids)
    request_id, sep, count = text.rpartition(":")
    if not sep:
        raise WireError("notification", f"{text!r} has no ':'")
    if not count.isascii() or not count.isdigit() or int(count) < 1:
        raise WireError("notification", f"reader count {count!r} in {text!r} is not an int >= 1")
    validate_request_id(request_id, "notification")
    return CompletionNotif(request_id, int(count))


# --- kv_transfer_params ---


class KVTransferParams(msgspec.Struct, frozen=True, kw_only=True):
    """What a prefill's ``request_finished`` returns, keys in its order (v15; v14 lacks the generation)."""

    do_remote_prefill: bool
    do_remote_decode: bool = False
    remote_block_ids: list[list[NonNegInt]]
    remote_engine_id: NonEmptyStr
    remote_request_id: NonEmptyStr
    remote_host: NonEmptyStr
    remote_port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    tp_size: PosInt
    dcp_size: PosInt = 1
    pp_size: PosInt = 1
    remote_num_tokens: NonNegInt | None = None
    remote_blocks_expiry_time: float | None = None
    # v15 only; vLLM reads a missing one as 0 (never handshaked at any generation).
    remote_registration_generation: NonNegInt = 0
    transfer_mode: str = "pull"
    remote_prefill_cached_tokens: NonNegInt = 0


def check_kv_transfer_params(params: KVTransferParams) -> KVTransferParams:
    """Refuse params a puller cannot act on, naming the field."""
    if not params.do_remote_prefill:
        raise WireError("do_remote_prefill", "is false: not a prefill's response, nothing to pull")
    if params.transfer_mode != "pull":
        raise WireError("transfer_mode", f"{params.transfer_mode!r} is not 'pull'")
    validate_request_id(params.remote_request_id)
    return params


def parse_kv_transfer_params(data: bytes | str | Mapping[str, Any]) -> KVTransferParams:
    """Parse JSON text/bytes or an already-decoded mapping; extra keys (e.g. prompt_token_ids) are ignored."""
    try:
        if isinstance(data, (bytes, bytearray, memoryview, str)):
            params = msgspec.json.decode(data, type=KVTransferParams)
        else:
            params = msgspec.convert(data, KVTransferParams, strict=True)
    except msgspec.MsgspecError as exc:
        raise _wire_error(exc, "kv_transfer_params") from None
    return check_kv_transfer_params(params)


def kv_transfer_params_to_dict(
    params: KVTransferParams, version: int = LATEST_CONNECTOR_VERSION
) -> dict[str, Any]:
    """The dict a stock prefill of connector ``version`` returns, keys in its order."""
    if version not in CONNECTOR_VERSIONS:
        raise ValueError(f"connector version must be one of {CONNECTOR_VERSIONS}, got {version!r}")
    out = msgspec.to_builtins(params)
    ordered = {name: out[name] for name in KVTransferParams.__struct_fields__}
    if version < 15:
        del ordered["remote_registration_generation"]
    return ordered


# --- model identity ---


def compatibility_hash(factors: Mapping[str, Any]) -> str:
    """vLLM's hash_factors: sha256 of the sorted-key JSON of the factors."""
    return hashlib.sha256(json.dumps(dict(factors), sort_keys=True).encode()).hexdigest()


def check_model_identity(
    remote_hash: str, local_factors: Mapping[str, Any], remote_backend_name: str
) -> None:
    """Refuse a remote whose hash differs from ours once our backend name is replaced by the remote's."""
    factors = dict(local_factors)
    if "attn_backend_name" not in factors:
        raise IdentityMismatch("compatibility_hash", "local factors lack attn_backend_name")
    factors["attn_backend_name"] = remote_backend_name
    expected = compatibility_hash(factors)
    if remote_hash != expected:
        raise IdentityMismatch(
            "compatibility_hash",
            f"remote {remote_hash} != local {expected} (with attn_backend_name={remote_backend_name!r}): "
            "different vLLM/connector version, model, dtype, heads, layers, cache dtype, HMA or spec config",
        )
