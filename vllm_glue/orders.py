"""What the scheduler half tells the worker half each step: pulls to start, aborts, heartbeats. Plain data.

vLLM hands these to the workers inside the per-step connector metadata (in process, or through its own
executor channel when workers are separate processes), so they are small frozen msgspec Structs of builtins.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from sidecar.wire import protocol as p
from sidecar.wire.protocol import BlockId

# what msgpack carries (an int past it fails the encode, in the middle of vLLM's step)
Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]

REQUIRED_REMOTE_KEYS = (
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
)


class RemoteRef(msgspec.Struct, frozen=True):
    """Where a request's prefilled pages are: one prefill engine, its request id and its logical block ids."""

    engine_id: str
    host: str
    port: int
    request_id: str
    block_ids: list[BlockId]  # checked here, so a bad id fails the load before anything is sent
    tp_size: int = 1
    registration_generation: Count = 0
    num_tokens: Count | None = None

    def __post_init__(self) -> None:
        # Checked now as the Heartbeat target it becomes, under the daemon's rules: a bad value then fails
        # this request's load, not the step's Heartbeat for every request (one bad target refuses it all).
        p.HeartbeatTarget(remote_engine_id=self.engine_id, remote_host=self.host, remote_port=self.port,
                          remote_request_ids=[self.request_id], remote_tp_size=self.tp_size,
                          remote_registration_generation=self.registration_generation)


class PullOrder(msgspec.Struct, frozen=True):
    """Start one pull. ``awaiting`` False: vLLM is not waiting (full local hit, or cleanup): notify the
    prefill only.

    ``lease_started_at_ns``: ``time.monotonic_ns()`` when the scheduler first saw the request (0: unknown).
    """

    req_id: str
    remote: RemoteRef
    local_block_ids: list[int]
    awaiting: bool
    lease_started_at_ns: int = 0


class HeartbeatOrder(msgspec.Struct, frozen=True):
    """Renew the lease of these prefill requests on one engine (``generation``: the newest registration
    generation they name, 0 if none does)."""

    engine_id: str
    host: str
    port: int
    tp_size: int
    remote_request_ids: list[str]
    generation: Count = 0


class StepOrders(msgspec.Struct, frozen=True):
    """One step's work for the worker half; pulls are applied before aborts.

    ``scheduler_clock_ns``: the scheduler's ``time.monotonic_ns()`` when it built them (0: unknown), so a
    worker on another node (another monotonic clock) can carry each pull's lease start over to its own.
    """

    pulls: list[PullOrder] = []
    aborts: list[str] = []
    heartbeats: list[HeartbeatOrder] = []
    scheduler_clock_ns: int = 0

    def is_empty(self) -> bool:
        return not (self.pulls or self.aborts or self.heartbeats)


class InvalidParams(ValueError):
    """kv_transfer_params this shim cannot act on; the text names the key."""


def parse_remote(params: Mapping[str, Any]) -> RemoteRef:
    """The prefill reference in a decoder request's kv_transfer_params, or InvalidParams naming the key."""
    missing = [k for k in REQUIRED_REMOTE_KEYS if params.get(k) is None]
    if missing:
        raise InvalidParams(f"kv_transfer_params lacks {', '.join(missing)}")
    groups = params["remote_block_ids"]
    if not isinstance(groups, (list, tuple)) or any(not isinstance(g, (list, tuple)) for g in groups):
        raise InvalidParams(f"remote_block_ids must be a list of block-id lists, got {groups!r}")
    if len(groups) != 1:
        raise InvalidParams(
            f"remote_block_ids has {len(groups)} KV-cache groups; only one (non-hybrid models) is supported"
        )
    pp_size = params.get("pp_size") or 1
    if pp_size != 1:
        raise InvalidParams(f"pp_size {pp_size}: prefills with pipeline parallelism are not supported")
    try:
        return _ref(params, list(groups[0]), params.get("remote_num_tokens"))
    except msgspec.ValidationError as e:
        raise InvalidParams(f"kv_transfer_params: {e}") from None


def notify_ref(params: Mapping[str, Any]) -> RemoteRef | None:
    """The prefill to tell to free a request's blocks when its params cannot be read from (``parse_remote``
    refused them: several KV-cache groups, pipeline parallelism, a bad block list): its address and request
    id, no blocks. None when those are not usable either (then the prefill's lease frees the blocks)."""
    try:
        return _ref(params, [], None)
    except msgspec.ValidationError:
        return None


def _ref(params: Mapping[str, Any], block_ids: list[Any], num_tokens: Any) -> RemoteRef:
    """The RemoteRef of ``params`` with these blocks, checked (msgspec.ValidationError naming the field)."""
    return msgspec.convert(
        {
            "engine_id": params.get("remote_engine_id"),
            "host": params.get("remote_host"),
            "port": params.get("remote_port"),
            "request_id": params.get("remote_request_id"),
            "block_ids": block_ids,
            "tp_size": params.get("tp_size") or 1,
            "registration_generation": params.get("remote_registration_generation") or 0,
            "num_tokens": num_tokens,
        },
        RemoteRef,
        strict=True,
    )
