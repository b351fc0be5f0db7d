"""The scheduler half's bookkeeping, as NixlConnector's consumer does it, without vLLM imports (pure logic).

It decides which requests wait for an async load, pairs their freshly allocated blocks with the prefill's
list, keeps every prefill lease alive from the moment a request is first seen, and holds an aborted request's
blocks until the worker half reports that nothing can still write into them. ``request`` objects are vLLM's
``Request`` (only ``request_id``, ``kv_transfer_params`` and ``prompt_token_ids`` are read); ``blocks`` is a
``KVCacheBlocks``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from vllm_glue.orders import (
    HeartbeatOrder,
    InvalidParams,
    PullOrder,
    RemoteRef,
    StepOrders,
    notify_ref,
    parse_remote,
)

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 30


class _Tracked:
    __slots__ = ("engine_id", "host", "port", "tp_size", "remote_request_id", "generation")

    def __init__(self, remote: RemoteRef) -> None:
        self.engine_id, self.host, self.port = remote.engine_id, remote.host, remote.port
        self.tp_size, self.remote_request_id = remote.tp_size, remote.request_id
        self.generation = remote.registration_generation


class SchedulerBook:
    """Per-engine-core state of the scheduler half. Not thread-safe: vLLM calls it from the scheduler loop."""

    def __init__(
        self,
        *,
        lease_s: float = DEFAULT_LEASE_S,
        backoff_tokens: int = 0,
        kv_groups: int = 1,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """``kv_groups``: the decoder's KV-cache groups (the sidecar reads one; with more, every remote
        prefill is computed locally and the prefill told to free its blocks)."""
        self.kv_groups = kv_groups
        # Stock vLLM: heartbeat period is the decoder's kv_lease_duration // 6 (5 s by default).
        self.heartbeat_interval_s = max(0, int(lease_s) // 6)
        self.backoff_tokens = backoff_tokens
        self._clock, self._wall = clock, wall
        self._last_heartbeat = float("-inf")
        self._heartbeats: dict[str, _Tracked] = {}  # local req id -> its prefill
        self._pending_pulls: list[PullOrder] = []
        self._pending_aborts: list[str] = []
        self._loading: set[str] = set()  # awaiting loads not yet seen in finished_recving
        self._first_seen_ns: dict[str, int] = {}  # when each remote-prefill request was first seen

    # ------------------------------------------------------------------------------------------- queries

    def loads_in_flight(self) -> frozenset[str]:
        return frozenset(self._loading)

    def heartbeat_targets(self) -> list[HeartbeatOrder]:
        """Every tracked prefill request, grouped by engine, with the newest registration generation its
        requests name (what the engine's next pulls read)."""
        by_engine: dict[str, tuple[_Tracked, list[str], int]] = {}
        for t in self._heartbeats.values():
            first, ids, generation = by_engine.get(t.engine_id, (t, [], 0))
            ids.append(t.remote_request_id)
            by_engine[t.engine_id] = (first, ids, max(generation, t.generation))
        return [
            HeartbeatOrder(t.engine_id, t.host, t.port, t.tp_size, ids, generation)
            for t, ids, generation in by_engine.values()
        ]

    # ------------------------------------------------------------------------------------------- vLLM hooks

    def on_new_request(self, request: Any) -> None:
        """Start heartbeating a decoder request's prefill lease (running since the prefill finished)."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        try:
            remote = parse_remote(params)
        except InvalidParams:
            return  # reported (and recomputed locally) at get_num_new_matched_tokens
        self._heartbeats[request.request_id] = _Tracked(remote)
        # The lease has been running at least since the request reached this decoder's API server (its
        # arrival_time, wall clock): tokenizing and queueing before the scheduler sees it count against it.
        age = max(0.0, self._wall() - getattr(request, "arrival_time", self._wall()))
        now = self._clock()
        if age > now:
            # Older than the monotonic clock reaches (a stepped wall clock, a bogus arrival_time): a negative
            # start would fail the Pull's own check, so count the lease from now, as for an unknown arrival.
            log.warning(
                "request %s: arrival_time is %.0f s ago by the wall clock, past the monotonic clock "
                "(%.0f s); its prefill lease is counted from now",
                request.request_id,
                age,
                now,
            )
            age = 0.0
        self._first_seen_ns.setdefault(request.request_id, int((now - age) * 1e9))
        log.debug(
            "request %s: remote prefill %s at %s:%d, lease running (arrived %.3f s ago)",
            request.request_id,
            remote.request_id,
            remote.host,
            remote.port,
            age,
        )

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens to load, async) — the whole prompt less the backoff and the local prefix hit."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        try:
            parse_remote(params)
        except InvalidParams as e:
            log.warning("request %s: %s; computing its prompt locally", request.request_id, e)
            return 0, False
        if self.kv_groups != 1:  # checked here: at allocation, a load vLLM waits for could only fail
            log.warning("request %s: the decoder has %d KV-cache groups, the sidecar reads one; computing "
                        "its prompt locally", request.request_id, self.kv_groups)
            return 0, False
        num_prompt = len(request.prompt_token_ids or ())
        if self.backoff_tokens and num_prompt > self.backoff_tokens:
            num_prompt -= self.backoff_tokens
        count = num_prompt - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Queue the pull of a request vLLM just allocated blocks for (once per request)."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        # Only one transfer per request, as in stock vLLM.
        params["do_remote_prefill"] = False
        try:
            remote = parse_remote(params)
        except InvalidParams:  # computed locally (get_num_new_matched_tokens said so): free the prefill
            self._stop_heartbeat(request.request_id)
            self._notify_only(request.request_id, notify_ref(params))
            return
        awaiting = num_external_tokens > 0
        local = unhashed_block_ids(blocks) if awaiting else []
        log.debug(
            "request %s: %d block(s) allocated, load of %d token(s) queued",
            request.request_id,
            len(local),
            num_external_tokens,
        )
        if len(local) > len(remote.block_ids):
            # vLLM allocates for the whole prompt and the prefill's list covers it, so this is a mismatch
            # upstream (a longer prompt here). Pulled as it is: the daemon refuses it naming
            # local_block_ids, so the load fails and kv_load_failure_policy applies. (Pulling only the last
            # blocks once left the first ones unwritten and reported them loaded.)
            log.error(
                "request %s: %d local blocks but the prefill sent %d; its load will be refused",
                request.request_id,
                len(local),
                len(remote.block_ids),
            )
        self._queue_pull(request.request_id, remote, local, awaiting)

    def build_step(self) -> StepOrders:
        """This step's orders; heartbeats ride along every heartbeat_interval_s, as stock vLLM sends them."""
        heartbeats: list[HeartbeatOrder] = []
        if self._heartbeats:
            now = self._clock()
            if now - self._last_heartbeat >= self.heartbeat_interval_s:
                self._last_heartbeat = now
                heartbeats = self.heartbeat_targets()
        clock_ns = int(self._clock() * 1e9) if self._pending_pulls else 0
        orders = StepOrders(
            pulls=self._pending_pulls,
            aborts=self._pending_aborts,
            heartbeats=heartbeats,
            scheduler_clock_ns=clock_ns,
        )
        self._pending_pulls, self._pending_aborts = [], []
        return orders

    def update_connector_output(self, finished_recving: Iterable[str] | None) -> None:
        for req_id in finished_recving or ():
            self._loading.discard(req_id)
            self._stop_heartbeat(req_id)

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """(hold the blocks, no params). Held while a load may still write; the worker reports the end."""
        req_id = request.request_id
        self._stop_heartbeat(req_id)
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            # Finished before it was ever allocated (e.g. aborted while waiting): let the prefill free its
            # blocks.
            params["do_remote_prefill"] = False
            try:
                remote: RemoteRef | None = parse_remote(params)
            except InvalidParams:
                remote = notify_ref(params)
            self._notify_only(req_id, remote)
            return False, None
        self._first_seen_ns.pop(req_id, None)
        if req_id in self._loading:
            self._pending_aborts.append(req_id)
            return True, None
        return False, None

    # ------------------------------------------------------------------------------------------- internals

    def _queue_pull(self, req_id: str, remote: RemoteRef, local: list[int], awaiting: bool) -> None:
        started = self._first_seen_ns.pop(req_id, 0)
        self._pending_pulls.append(PullOrder(req_id, remote, list(local), awaiting, started))
        if awaiting:
            self._loading.add(req_id)

    def _notify_only(self, req_id: str, remote: RemoteRef | None) -> None:
        """A pull of no blocks, so the prefill frees the request's blocks now rather than at its lease's
        end (None: not even an address to tell; its lease frees them)."""
        if remote is None:
            self._first_seen_ns.pop(req_id, None)
            return
        self._queue_pull(req_id, remote, [], awaiting=False)

    def _stop_heartbeat(self, req_id: str) -> None:
        self._heartbeats.pop(req_id, None)


def unhashed_block_ids(blocks: Any) -> list[int]:
    """The request's blocks without a prefix-cache hit, in order (group 0; one group is all this shim
    supports).
    """
    getter = getattr(blocks, "get_unhashed_block_ids_all_groups", None)
    groups = getter() if getter is not None else (blocks.get_unhashed_block_ids(),)
    if len(groups) != 1:
        raise InvalidParams(f"{len(groups)} KV-cache groups; the sidecar shim supports one")
    return list(groups[0])
