"""Every message between the vLLM shim and its kv-sidecar daemon: versioned msgspec Structs, msgpack.

Transport: a ZMQ DEALER (shim) to the daemon's ROUTER on a local ``ipc://`` socket; each message is one
frame (the daemon also accepts a REQ-style empty delimiter frame and then replies with one). The ``type``
field tags the union; an unknown type or a bad field raises :class:`DecodeError` naming the problem.

Conversation: ``Hello`` → ``Welcome`` (or ``Error`` on a protocol mismatch), then ``RegisterCaches`` →
``Registered`` / ``Error``. Each accepted ``Pull`` is answered by exactly one ``Done`` (ok or not), or by
one ``Aborted`` when the shim aborted it, at the latest when its deadline passes (plus up to 5 s to stop its
transfers); a Pull refused at decoding, or naming a req_id already in flight, gets an ``Error`` instead.
``Abort`` → ``Aborted`` (``safe`` True once nothing can still write into the request's blocks; no ``Done``
follows an Aborted). ``Heartbeat`` gets no reply. ``Ping`` → ``Pong``. A
message the daemon cannot decode or serve gets ``Error``.

Completion socket: when ``Welcome.completion_socket`` names one, the shim may connect to it (an AF_UNIX
SOCK_SEQPACKET socket beside the ZMQ one, same permissions) and send ``BindCompletions`` with its routing id;
the daemon answers ``CompletionsBound`` there, and from then on sends every reply to that shim over it, in
order. A ZMQ message crosses four threads on its way, one SEQPACKET packet none: this is the completion
signal's fast path (``bench/results/ipc-floor-*.json``). Once bound, the shim sends its ``Pull``,
``Heartbeat`` and ``Abort`` messages over it too (protocol 3), one packet each, validated like any other;
the rest of the conversation (Hello, RegisterCaches, Unregister, Ping) stays on ZMQ, which is also the
fallback for everything when the completion socket is not bound or breaks. A Pull's ``sent_at_ns`` is
the shim's send time; the Done's ``timings["delivery"]`` is how long the Pull took to reach the daemon.

Block ids: a Pull carries its two id lists packed, each id a little-endian unsigned 32-bit integer
(:func:`pack_block_ids` / :func:`unpack_block_ids`, protocol 4). The daemon takes them with one
``np.frombuffer`` instead of building an array from a list of Python ints: at 1,024 ids that was ~90 µs of
its loop per Pull, packed ~11 (``bench/results/loop-cost-cpu-2026-12-04.json``).

Deadlines: a ``Pull`` carries ``timeout_s``, a duration. The daemon counts it from the Pull's ``sent_at_ns``
when the Pull carries one, as the shim counts its own deadline, and never from later than its receipt
(without ``sent_at_ns``: from the receipt). The socket is local, so the time in flight is microseconds, but
a starved or stalled daemon can leave a Pull in the socket for seconds, and the shim gives the request's
blocks back to vLLM once its deadline and a grace have passed: a Pull whose time ran out before it arrived
is answered ``expired`` at once, nothing read. ``sent_at_ns`` fields are ``time.monotonic_ns()`` of the
sender, comparable between processes of one host (one boot); elsewhere they are used only for measurements.
"""

from __future__ import annotations

import array
import math
import sys
from collections.abc import Iterable
from typing import Annotated, Any, Union

import msgspec
import numpy as np

from sidecar.wire.block_ids import increasing, repeat_in_sorted
from sidecar.wire.formats import PageFormat
from sidecar.wire.ipc import IpcBuffer, LayerView
from sidecar.wire.prefill import RESERVED_ID_PREFIXES

# 2: Welcome.completion_socket, BindCompletions / CompletionsBound.
# 3: Pull, Heartbeat and Abort also accepted on a bound completion socket; Pull.sent_at_ns set by the shim.
# 4: Pull's block ids packed (pack_block_ids) instead of msgpack arrays of ints.
# 5: Done.safe.
# 6: HeartbeatTarget.remote_registration_generation (a heartbeat's early handshake knows what it reads).
PROTOCOL_VERSION = 6
# TP sizes past this are refused: each prefill rank a decoder rank reads is a handshake (a ZMQ socket and a
# task), and a Pull's or Heartbeat's remote_tp_size comes from a client's kv_transfer_params.
MAX_TP_SIZE = 64
# Free text of a Pull or Heartbeat, bounded so that a reply quoting it (a failed handshake's reason names the
# prefill's address) stays far below one completion-socket packet (the shim reads 64 KiB at a time).
MAX_HOST_CHARS = 255  # a DNS name is at most 253; an IPv6 address with a zone index fits too
MAX_ID_CHARS = 1024  # request and engine ids (vLLM's: a uuid with a prefix or suffix)
# Request ids in one Heartbeat, and its targets; the shim sends more in several (``heartbeats``). Unbounded,
# a 34 MB Heartbeat of 4 M ids held the daemon's loop 11 to 25 s, then seconds a pass while they were
# tracked. Both lists are bounded as they are decoded (their length is read first): past 64 x 4,096 ids
# nothing is decoded at all, and the total is checked once the targets are.
MAX_HEARTBEAT_IDS = 4096
MAX_HEARTBEAT_TARGETS = 64
# A reply's reason is cut to this many characters when it is encoded: it may quote what a peer sent.
MAX_REASON_CHARS = 4096


class DecodeError(ValueError):
    """A frame that is not a valid message of the expected direction; the text says what is wrong."""


class _Msg(msgspec.Struct, tag_field="type", tag=True, forbid_unknown_fields=True, frozen=True):
    pass


def _text(name: str, value: str, limit: int = MAX_ID_CHARS) -> None:
    """Non-empty and at most ``limit`` characters."""
    if not value:
        raise ValueError(f"{name} must not be empty")
    if len(value) > limit:
        raise ValueError(f"{name} must be at most {limit} characters, got {len(value)}")


def _request_id(name: str, value: str) -> None:
    _text(name, value)
    # Prefill heartbeats join ids with "," (vLLM's "HB:" message); an id holding one would break that message.
    if "," in value:
        raise ValueError(f"{name} {value!r} must not contain ','")
    if value.startswith(RESERVED_ID_PREFIXES):  # its notification would read as a command, or be refused
        raise ValueError(f"{name} {value!r} must not start with {' or '.join(RESERVED_ID_PREFIXES)}")


def _tp_size(name: str, value: int) -> None:
    if not 1 <= value <= MAX_TP_SIZE:
        raise ValueError(f"{name} must be in 1..{MAX_TP_SIZE}, got {value}")


def _generation(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def _port(name: str, value: int) -> None:
    if not 0 < value < 65536:
        raise ValueError(f"{name} must be in 1..65535, got {value}")


# compat_factors nest no deeper than this: vLLM's are flat but for a config dict or two, and json.dumps meets
# Python's recursion limit long before msgspec's own nesting limit.
MAX_FACTOR_DEPTH = 32


def _json_value(path: str, value: Any, depth: int = 0) -> None:
    """Refuse, naming ``path``, what ``json.dumps(sort_keys=True)`` (vLLM's hash_factors) cannot serialise
    alike in every process: only str, int, bool, None, finite floats, lists and str-keyed dicts of them."""
    if value is None or isinstance(value, str | int):  # bool is an int
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path} must be a finite number, got {value}")
        return
    if depth >= MAX_FACTOR_DEPTH:
        raise ValueError(f"{path} nests deeper than {MAX_FACTOR_DEPTH} levels")
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _json_value(f"{path}[{i}]", item, depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{path} has the key {key!r} of type {type(key).__name__}, not str")
            _json_value(f"{path}[{key!r}]", item, depth + 1)
    else:
        raise ValueError(f"{path} is of type {type(value).__name__}, not a JSON value")


_ID = np.dtype("<u4")  # one packed block id
assert array.array("I").itemsize == _ID.itemsize, "pack_block_ids needs a 4-byte C unsigned int"
# A block id as vLLM hands it over (kv_transfer_params), checked before it is packed.
BlockId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]


def pack_block_ids(ids: Iterable[int]) -> bytes:
    """Block ids as a Pull carries them: 4 bytes each, little-endian unsigned. A negative id, one of 2**32
    or more, or a non-integer raises ValueError naming it."""
    try:
        packed = array.array("I", ids)  # a C unsigned int: 4 bytes wherever vLLM runs (checked at import)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"block ids must be integers in 0..2**32-1: {exc}") from None
    if sys.byteorder != "little":  # pragma: no cover - no big-endian host in use
        packed.byteswap()
    return packed.tobytes()


def unpack_block_ids(packed: bytes) -> np.ndarray:
    """The ids of :func:`pack_block_ids` as an int64 array (a new one, writeable)."""
    return np.frombuffer(packed, _ID).astype(np.int64)


def _packed_ids(name: str, value: Any) -> None:
    if not isinstance(value, bytes):
        raise TypeError(f"{name} must be bytes from pack_block_ids(), got {type(value).__name__}")
    if len(value) % _ID.itemsize:
        raise ValueError(f"{name} holds {len(value)} bytes, not a whole number of {_ID.itemsize}-byte ids")


# ------------------------------------------------------------------------------------------ shim → daemon


class Hello(_Msg):
    """First message of a shim worker: who it is and which protocol it speaks."""

    protocol_version: int
    package_version: str
    worker_rank: int = 0
    tp_size: int = 1
    pid: int = 0
    engine_id: str = ""

    def __post_init__(self) -> None:
        _tp_size("tp_size", self.tp_size)
        if not 0 <= self.worker_rank < self.tp_size:
            raise ValueError(f"worker_rank must be in 0..tp_size-1 ({self.tp_size - 1}), "
                             f"got {self.worker_rank}")


class RegisterCaches(_Msg):
    """The decoder's KV allocation(s) as IPC buffers, each layer's view into them, and its page format.

    ``compat_factors`` are the decoder's inputs to vLLM's NIXL compatibility hash (model, dtype, heads,
    ...); the daemon recomputes the hash with each remote's backend name to check model identity, so they
    must be JSON values (str, int, bool, None, finite floats, lists, str-keyed dicts).
    """

    buffers: list[IpcBuffer]
    layers: list[LayerView]
    page_format: PageFormat
    compat_factors: dict[str, Any] = {}

    def __post_init__(self) -> None:
        if not self.buffers:
            raise ValueError("buffers must not be empty")
        if not self.layers:
            raise ValueError("layers must not be empty")
        _json_value("compat_factors", self.compat_factors)
        for layer in self.layers:
            if layer.buffer_index >= len(self.buffers):
                raise ValueError(f"layers[{layer.name}].buffer_index {layer.buffer_index} is out of range "
                                 f"({len(self.buffers)} buffers)")


class Unregister(_Msg):
    """Release the imported caches (before vLLM frees them)."""


class HeartbeatTarget(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One prefill engine and the requests whose lease the decoder wants kept alive there."""

    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_request_ids: Annotated[list[str], msgspec.Meta(max_length=MAX_HEARTBEAT_IDS)]
    remote_tp_size: int = 1
    # the newest registration generation the requests' kv_transfer_params name (0: unknown), so the
    # handshake a heartbeat starts early is one the pulls of a re-registered prefill can read through
    remote_registration_generation: int = 0

    def __post_init__(self) -> None:
        _text("remote_engine_id", self.remote_engine_id)
        _text("remote_host", self.remote_host, MAX_HOST_CHARS)
        _port("remote_port", self.remote_port)
        _tp_size("remote_tp_size", self.remote_tp_size)
        _generation("remote_registration_generation", self.remote_registration_generation)
        for rid in self.remote_request_ids:
            _request_id("remote_request_ids[]", rid)


class Heartbeat(_Msg):
    """Keep these prefill leases alive (forwarded as vLLM ``HB:`` notifications). No reply. At most
    MAX_HEARTBEAT_TARGETS targets and MAX_HEARTBEAT_IDS request ids in all: :func:`heartbeats` splits more."""

    targets: Annotated[list[HeartbeatTarget], msgspec.Meta(max_length=MAX_HEARTBEAT_TARGETS)]

    def __post_init__(self) -> None:
        ids = sum(len(t.remote_request_ids) for t in self.targets)
        if ids > MAX_HEARTBEAT_IDS or len(self.targets) > MAX_HEARTBEAT_TARGETS:
            raise ValueError(f"a Heartbeat carries at most {MAX_HEARTBEAT_IDS} request ids for at most "
                             f"{MAX_HEARTBEAT_TARGETS} targets, got {ids} for {len(self.targets)}")


def heartbeats(targets: Iterable[HeartbeatTarget]) -> list[Heartbeat]:
    """``targets`` as few Heartbeats as MAX_HEARTBEAT_IDS allows, in order; a target with more ids than fit
    is split over several."""
    out: list[Heartbeat] = []
    batch: list[HeartbeatTarget] = []
    room = MAX_HEARTBEAT_IDS  # request ids the batch may still take

    def flush() -> None:
        nonlocal batch, room
        if batch:
            out.append(Heartbeat(targets=batch))
        batch, room = [], MAX_HEARTBEAT_IDS

    for target in targets:
        ids = target.remote_request_ids
        start = 0
        while True:
            if room == 0 or len(batch) == MAX_HEARTBEAT_TARGETS:
                flush()
            part = ids[start : start + room]
            batch.append(target if len(part) == len(ids) else msgspec.structs.replace(
                target, remote_request_ids=part))
            room -= len(part)
            start += len(part)
            if start >= len(ids):
                break
    flush()
    return out


class Pull(_Msg):
    """Read a request's pages from a prefill into ``local_block_ids`` and convert them; answered by one Done.

    ``remote_block_ids`` are the prefill's logical block ids in token order; ``local_block_ids`` pair with
    their tail (prefix-cached blocks lead); both packed by :func:`pack_block_ids`. ``timeout_s`` counts from
    ``sent_at_ns``, or the daemon's receipt if that is earlier or unset (None: the daemon's
    ``default_timeout_s``; "Deadlines" above). ``lease_started_at_ns``:
    ``time.monotonic_ns()`` when the shim first saw the request (its prefill lease was already running), so
    the daemon can tell how much lease is left; 0: the daemon counts from the first Heartbeat or Pull naming
    the request. ``remote_num_tokens`` is kv_transfer_params' value: with it, empty kernel blocks at the end
    of a logical block are not read.
    """

    req_id: str
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_request_id: str
    remote_block_ids: bytes
    local_block_ids: bytes
    timeout_s: float | None = None
    remote_tp_size: int = 1
    remote_registration_generation: int = 0
    remote_num_tokens: int | None = None
    lease_started_at_ns: int = 0
    sent_at_ns: int = 0

    def __post_init__(self) -> None:
        _text("req_id", self.req_id)
        _text("remote_engine_id", self.remote_engine_id)
        _text("remote_host", self.remote_host, MAX_HOST_CHARS)
        _port("remote_port", self.remote_port)
        _request_id("remote_request_id", self.remote_request_id)
        _packed_ids("remote_block_ids", self.remote_block_ids)
        _packed_ids("local_block_ids", self.local_block_ids)
        local = np.frombuffer(self.local_block_ids, _ID)
        if not increasing(local):  # increasing ids (the common case) are unique: one compare, no sort
            dup = repeat_in_sorted(np.sort(local))
            if dup is not None:
                raise ValueError(f"local_block_ids must not repeat a block (block {dup} does)")
        if self.timeout_s is not None and not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be a finite number > 0, got {self.timeout_s}")
        if self.remote_num_tokens is not None and self.remote_num_tokens < 0:
            raise ValueError(f"remote_num_tokens must be >= 0, got {self.remote_num_tokens}")
        if self.lease_started_at_ns < 0:
            raise ValueError(f"lease_started_at_ns must be >= 0, got {self.lease_started_at_ns}")
        _tp_size("remote_tp_size", self.remote_tp_size)
        _generation("remote_registration_generation", self.remote_registration_generation)

    @property
    def num_local_blocks(self) -> int:
        return len(self.local_block_ids) // _ID.itemsize

    @property
    def num_remote_blocks(self) -> int:
        return len(self.remote_block_ids) // _ID.itemsize


class Abort(_Msg):
    """Stop a Pull; the reply Aborted(safe=True) means nothing can still write into its blocks."""

    req_id: str

    def __post_init__(self) -> None:
        _text("req_id", self.req_id)


class Ping(_Msg):
    nonce: int = 0
    sent_at_ns: int = 0


class Status(_Msg):
    """What the daemon serves now (``kv-sidecar doctor`` asks; no Hello needed): answered with StatusReply."""

    nonce: int = 0


class BindCompletions(_Msg):
    """The only message on the completion socket, shim → daemon: "send my replies here". ``routing_id`` is the
    shim's ZMQ DEALER routing id, which must have said Hello on the main socket."""

    routing_id: bytes

    def __post_init__(self) -> None:
        if not 1 <= len(self.routing_id) <= 255 or self.routing_id[0] == 0:
            raise ValueError("routing_id must be 1..255 bytes, not starting with a zero byte (ZMQ's)")


# ------------------------------------------------------------------------------------------ daemon → shim


class Welcome(_Msg):
    """The daemon accepts the shim: its versions and the device it serves (``"cpu"`` or ``"cuda:N"``)."""

    protocol_version: int
    package_version: str
    device: str
    gpu: int | None = None
    pid: int = 0
    completion_socket: str = ""  # a SOCK_SEQPACKET path the shim may bind for its replies; "": none


class Registered(_Msg):
    generation: int
    registered_bytes: int
    num_layers: int


class Unregistered(_Msg):
    pass


class Done(_Msg):
    """The end of one Pull: ``ok`` only once every byte is converted.

    ``timings``, in seconds: the stages (queue, handshake, transfer, convert, end_to_end); within queue
    "accept" (the Pull's receipt until its job first ran); within transfer "post" (staging slots taken,
    descriptors built, READ posted; within it "poster_queue", waiting for the poster thread's earlier
    calls, and "poster", that thread's work on this post), "read" (posted until seen DONE) and, on a GPU,
    "launch_prep" (the launches' host work, done after the post while the bytes are on their way), "launch"
    (wall time spent starting the conversion kernels once they landed) and "launch_cpu" (the thread's CPU
    time in it); with more than one layer group, "landing_spread" (from the first group seen landed to the
    last: near 0 when they land together, so no group's conversion overlaps a later group's read).
    "delivery" (when the Pull carried ``sent_at_ns``): from the shim's send to the daemon's receipt of the
    Pull.

    ``safe`` False (a failed Done only): a transfer into the request's blocks could not be stopped, so the
    shim must not hand them back to vLLM yet; it holds them as it holds a dropped connection's, until that
    daemon exits or the pull's deadline plus the grace has passed.
    """

    req_id: str
    ok: bool
    reason: str | None = None
    timings: dict[str, float] = {}
    sent_at_ns: int = 0
    safe: bool = True


class Aborted(_Msg):
    """``safe`` True: no transfer can still write into the request's blocks, they may be reused."""

    req_id: str
    safe: bool
    reason: str | None = None


class CompletionsBound(_Msg):
    """Answer to BindCompletions, on the completion socket: from here on every reply travels there."""

    ok: bool
    reason: str | None = None


class Pong(_Msg):
    nonce: int = 0
    sent_at_ns: int = 0


# Status is asked by ``kv-sidecar doctor`` and ``kv-sidecar reload``, which may be older than the daemon they
# ask (a package downgraded, or a doctor from another image): its replies take unknown fields, so a newer
# daemon's additions are ignored rather than failing the check. No shim reads them.
class PeerStatus(msgspec.Struct, frozen=True):
    """One prefill rank the daemon has admitted: its side channel and identity, and its engine's TP size
    (the pulls' ``remote_tp_size``; a daemon older than the field: 1)."""

    address: str  # host:port of its NIXL side channel
    engine_id: str
    tp_rank: int
    tp_size: int = 1


class ReloadStatus(msgspec.Struct, frozen=True):
    """The outcome of the daemon's latest SIGHUP. ``outcome``: "applied" (``applied`` names the keys),
    "unchanged" (nothing live changed) or "refused" (``reason``; the running config is kept).
    ``restart_pending``: keys the file changes that only a restart applies."""

    count: int  # SIGHUPs the daemon had received when this reload's read began (this one's included)
    outcome: str
    reason: str = ""
    applied: list[str] = []
    restart_pending: list[str] = []


class StatusReply(_Msg, forbid_unknown_fields=False):
    """The caches registered now (``registered`` False: none; their fields empty then) and the prefill ranks
    the daemon holds admitted: those its next pull would read without a handshake (not one dropped, or
    admitted against older caches or config: the next pull naming it handshakes again). Also the daemon's
    ``pid`` and its latest reload (None: no SIGHUP yet; a daemon older than the fields: 0 and None)."""

    nonce: int
    registered: bool
    registered_bytes: int = 0
    num_layers: int = 0
    page_format: PageFormat | None = None
    compat_factors: dict[str, Any] = {}
    peers: list[PeerStatus] = []
    # the decoder's TP size and rank, from the Hello of the shim that registered the caches: with a peer's
    # tp_size, which head slice of a prefill at another TP this daemon reads (a daemon older than them: 1, 0)
    tp_size: int = 1
    tp_rank: int = 0
    pid: int = 0
    reload: ReloadStatus | None = None
    sighups: int = 0  # received so far: a reload whose ``count`` reaches past this read the file after now
    # which daemon this is: its device ("cpu", "cuda:N") and the config file it reads on SIGHUP (absolute; "":
    # none), so `kv-sidecar reload` signals only the daemon it means (a daemon older than them: "", "")
    device: str = ""
    config_file: str = ""


class Error(_Msg):
    """A message was rejected. ``in_reply_to`` is its type (None when it could not be decoded)."""

    reason: str
    in_reply_to: str | None = None
    req_id: str | None = None


ToDaemon = Union[Hello, RegisterCaches, Unregister, Heartbeat, Pull, Abort, Ping, Status]  # noqa: UP007
ToShim = Union[  # noqa: UP007
    Welcome, Registered, Unregistered, Done, Aborted, Pong, Error, CompletionsBound, StatusReply
]
Message = Union[ToDaemon, ToShim]  # noqa: UP007

_DAEMON_TYPES = frozenset(t.__name__ for t in ToDaemon.__args__)
_SHIM_TYPES = frozenset(t.__name__ for t in ToShim.__args__)
_encoder = msgspec.msgpack.Encoder()
_to_daemon = msgspec.msgpack.Decoder(ToDaemon)
_to_shim = msgspec.msgpack.Decoder(ToShim)
_any = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    """msgpack of ``msg``, its ``reason`` (if any) cut to MAX_REASON_CHARS: every reply passes here."""
    reason = getattr(msg, "reason", None)
    if reason is not None and len(reason) > MAX_REASON_CHARS:
        msg = msgspec.structs.replace(msg, reason=cut_reason(reason))
    return _encoder.encode(msg)


def cut_reason(reason: str) -> str:
    """``reason`` shortened to MAX_REASON_CHARS, saying how much was cut."""
    if len(reason) <= MAX_REASON_CHARS:
        return reason
    tail = f" [... cut, {len(reason)} characters in all]"
    return reason[: MAX_REASON_CHARS - len(tail)] + tail


def _decode(decoder: msgspec.msgpack.Decoder, data: bytes, direction: str) -> Any:
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as e:
        text = str(e)
        if "at `$.type`" in text or text == "Object missing required field `type`":
            raise DecodeError(f"not a {direction} message: {_message_type_problem(data, text)}") from None
        raise DecodeError(f"invalid {_peek_type(data) or 'message'}: {text}") from None
    except msgspec.DecodeError as e:
        raise DecodeError(f"malformed frame ({len(data)} bytes): {e}") from None
    except RecursionError:  # msgspec's own error for ~2,000 nested arrays: a frame, not the caller's fault
        raise DecodeError(f"malformed frame ({len(data)} bytes): nested too deep") from None


class _Head(msgspec.Struct):
    """A frame's ``type`` and ``req_id``, still encoded; every other field is skipped unread."""

    type: msgspec.Raw = msgspec.Raw()
    req_id: msgspec.Raw = msgspec.Raw()


_head = msgspec.msgpack.Decoder(_Head)
_str = msgspec.msgpack.Decoder(str)


def peek(data: bytes) -> tuple[str | None, str | None]:
    """Best effort: the ``type`` and ``req_id`` of a frame that did not decode (None where absent or not a
    str), so that its Error can name them. Nothing else of the frame is built: decoded whole, a 64 MiB
    array of zeros took 0.5 s and 600 MB per look, where its typed refusal takes microseconds."""
    try:
        head = _head.decode(data)
    except (msgspec.MsgspecError, RecursionError):
        return None, None
    return _raw_str(head.type), _raw_str(head.req_id)


def _raw_str(raw: msgspec.Raw) -> str | None:
    if not raw:
        return None
    try:
        return _str.decode(raw)
    except (msgspec.MsgspecError, RecursionError):
        return None


def _peek_type(data: bytes) -> str | None:
    return peek(data)[0]


def _message_type_problem(data: bytes, text: str) -> str:
    t = _peek_type(data)
    if t is None:
        return f"missing or non-string field 'type' ({text})"
    if t in _DAEMON_TYPES or t in _SHIM_TYPES:
        return f"message type {t!r} travels {'shim→daemon' if t in _DAEMON_TYPES else 'daemon→shim'}"
    return f"unknown message type {t!r}"


def decode_to_daemon(data: bytes) -> ToDaemon:
    """Decode a frame the daemon received; anything else raises DecodeError."""
    return _decode(_to_daemon, data, "shim→daemon")


def decode_to_shim(data: bytes) -> ToShim:
    """Decode a frame the shim received; anything else raises DecodeError."""
    return _decode(_to_shim, data, "daemon→shim")


_bind = msgspec.msgpack.Decoder(BindCompletions)


def decode_bind(data: bytes) -> BindCompletions:
    """Decode the shim's first packet on the completion socket."""
    try:
        return _decode(_bind, data, "completion-socket")
    except DecodeError:
        t = _peek_type(data)
        if t in FAST_REQUEST_TYPES:
            raise DecodeError(f"send BindCompletions first: a {t} travels here only once bound") from None
        raise


FastRequest = Union[Pull, Heartbeat, Abort, BindCompletions]  # noqa: UP007
FAST_REQUEST_TYPES = ("Pull", "Heartbeat", "Abort")
_fast_request = msgspec.msgpack.Decoder(FastRequest)


def decode_on_completions(data: bytes) -> FastRequest:
    """Decode a packet on a completion socket: a Pull, Heartbeat or Abort (or a repeated BindCompletions,
    which the caller refuses); a message that belongs on the main socket is named as such."""
    try:
        return _decode(_fast_request, data, "completion-socket")
    except DecodeError as exc:
        t = _peek_type(data)
        if t in _DAEMON_TYPES and t not in FAST_REQUEST_TYPES:
            raise DecodeError(
                f"message type {t!r} travels on the main (ZMQ) socket; the completion socket carries "
                f"{', '.join(FAST_REQUEST_TYPES)}"
            ) from None
        raise exc from None


def decode_any(data: bytes) -> Message:
    return _decode(_any, data, "kv-sidecar")


def type_name(msg: msgspec.Struct) -> str:
    return type(msg).__name__
