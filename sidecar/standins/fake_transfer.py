"""``FakePort``: an in-process ``TransferPort`` for unit tests of the daemon's logic (no NIXL, no sockets).

It keeps the real port's contract (the objects it returns carry the fields the daemon reads) and lets a
test decide what the prefill side does: hold handshakes, refuse or time them out, land a read's layer groups
one at a time and in any order, fail a read, lose a peer, or answer at once. It moves no bytes: a test that
needs real bytes uses the real port (tests/e2e, tests/sidecar/daemon/test_serve.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sidecar.daemon.port import Admission, PeerTarget, ReadMode, Runner
from sidecar.nixl import tp
from sidecar.nixl.errors import (
    MappingUnavailable,
    RemoteDisconnected,
    RemoteRefused,
    RequestRefused,
    TransferFailed,
    TransferTimeout,
)
from sidecar.nixl.geometry import BlockPairs, LocalRegions, PairRule, StagingPool, regions_per_layer
from sidecar.nixl.runs import layer_group_bounds
from sidecar.wire import prefill as vllm_wire
from sidecar.wire.formats import STANDARD, Plan, negotiate


@dataclass(eq=False)
class FakePeer:
    engine_id: str
    tp_rank: int
    address: str
    generation: int
    plan: Plan
    removed: bool = False
    notif_count: int = 1  # the n of "id:n" this prefill rank expects
    unloaded: bool = False  # as NIXL's: replaced by another admission (a test sets it)


@dataclass(eq=False)
class FakeRead:
    """One request's reads: ``groups`` not yet landed, in the order the test will land them."""

    peer: Any  # a PeerSet of FakePeers (or one)
    remote_request_id: str
    deadline: float
    groups: list[tuple[int, int]]
    mode: str
    slots: Any = None
    gaps: Any = None  # the GapRead a staged read was posted with
    pairs: Any = None  # the BlockPairs it was posted with (None: it paired the ids itself)
    layer_ranges: list[tuple[int, int]] = field(default_factory=list)  # every group posted, in post order
    landed: list[tuple[int, int]] = field(default_factory=list)
    finished: bool = False
    done_at: float | None = None
    handles: list[Any] = field(default_factory=list)
    nbytes: int = 0
    error: Exception | None = None
    aborted: bool = False
    notified: bool = False


class FakePort:
    """A scriptable prefill side. By default handshakes pass and reads land whole on the first poll."""

    def __init__(self, remote_format: Any = None) -> None:
        self.local_mem_type = "DRAM"
        self.remote_format = remote_format  # None: the decoder's own format with STANDARD kind
        self.auto_land = True  # land every group on the first poll; False: the test calls land()
        self.reverse = False  # auto-land groups last first (out of order)
        self.handshake_gate: asyncio.Event | None = None  # set: handshakes wait for it
        self.refuse_handshake: str | None = None  # a field name: connect refuses naming it
        self.fail_handshake = False  # connect times out, as with an unreachable prefill
        self.fail_reads = False  # poll raises TransferFailed
        self.disconnect_reads = False  # poll raises RemoteDisconnected
        self.stuck_abort = 0  # abort() reports unsafe this many times first
        self.connects = 0
        self.peers: list[FakePeer] = []
        self.reads: list[FakeRead] = []
        self.notified: list[str] = []  # one entry per notification, per prefill rank told
        self.notifications: list[tuple[str, int, int]] = []  # (remote request id, prefill rank, n of "id:n")
        self.heartbeats: list[list[str]] = []
        self.heartbeat_ranks: list[tuple[int, list[str]]] = []  # (prefill rank, ids) per heartbeat
        self.targets: list[PeerTarget] = []  # every connect's target
        self.registrations = 0
        # read() runs on the daemon's poster thread: with post_gate set it holds the port (as a NIXL post
        # holds the agent) until the test sets the event, then fails the post if fail_post.
        self.post_gate: threading.Event | None = None
        self.fail_post = False
        self.fail_post_keeps_handles = False  # with fail_post: the failed post leaves a handle to stop
        self.post_threads: list[str] = []  # the thread each read() ran on
        self.held_skips = 0  # hold(blocking=False) calls answered False (a post was in progress)
        self._lock = threading.RLock()
        self.spent: set[str] = set()
        self.pairings = 0  # blocks() calls: the daemon pairs each job once
        self.mapped: Any = None  # map_pages' answer: a [layers, blocks, page] tensor; None: nothing maps
        self.map_calls: list[str] = []  # the thread of each map_pages call
        self.fences: list[Any] = []  # the fence each map_pages call was handed
        self.unmapped: list[FakePeer] = []  # unmap_pages calls
        self.load_threads: list[str] = []  # the thread each connect's load ran on
        self.removal_threads: list[str] = []  # the thread each remove_peer ran on
        self.let_go_calls: list[tuple[float, str]] = []  # (idle_s, thread) of each let_go_notify_only
        # inside the transport, in the order they got there: "read <remote request id>", "load <engine id>"
        self.transport_order: list[str] = []

    # -- local memory
    def register(self, ranges: Sequence[tuple[int, int, int]], mem_type: str) -> Any:
        self.registrations += 1
        return ("registration", tuple(ranges), mem_type)

    def deregister(self, registration: Any) -> None:
        self.registrations -= 1

    def destination(self, registration: Any, regions: LocalRegions) -> Any:
        return ("destination", regions)

    def staging(self, registration: Any, pool: StagingPool) -> StagingPool:
        return pool

    # -- prefills
    async def connect(self, target: PeerTarget, admission: Admission, run: Runner | None = None) -> FakePeer:
        self.connects += 1
        self.targets.append(target)
        count = tp.notif_count(local_tp=target.local_tp, remote_tp=target.remote_tp)
        if self.handshake_gate is not None:
            await self.handshake_gate.wait()
        if self.fail_handshake:
            raise vllm_wire.HandshakeTimeout(target.address, 0, target.tp_rank, admission.timeout_s)
        if self.refuse_handshake is not None:
            exc = RemoteRefused("refused by the fake prefill", self.refuse_handshake)
            exc.peer = FakePeer(target.engine_id, target.tp_rank, target.address, 0, None, notif_count=count)
            raise exc
        local = admission.local_format
        remote = self.remote_format or (
            local if local.kind != "aiter_shuffled" else _with_kind(local, STANDARD)
        )
        if target.remote_tp != target.local_tp:  # the real rule: the head slice this decoder rank reads
            read = tp.rank_read(remote, local, local_tp=target.local_tp, local_rank=target.local_rank,
                                remote_tp=target.remote_tp, remote_rank=target.tp_rank)
            if not isinstance(read, tp.RankRead):
                exc = RemoteRefused(read.reason, read.field)
                exc.peer = FakePeer(
                    target.engine_id, target.tp_rank, target.address, 0, None, notif_count=count
                )
                raise exc
            remote = read.view
        plan = negotiate(
            remote,
            local,
            conversion_enabled=admission.conversion_enabled,
            allow_lossy_fp8=admission.allow_lossy_fp8,
        )
        if not isinstance(plan, Plan):
            raise RemoteRefused(plan.reason, plan.field)
        peer = FakePeer(target.engine_id, target.tp_rank, target.address, target.generation, plan,
                        notif_count=count)
        return self._load(peer) if run is None else await run(self._load, peer)

    def _load(self, peer: FakePeer) -> FakePeer:
        """``connect``'s transport half, as NIXL's load of a prefill's agent: a post in progress holds it."""
        with self._lock:
            self.load_threads.append(threading.current_thread().name)
            self.transport_order.append(f"load {peer.engine_id}")
            self.peers.append(peer)
        return peer

    def remove_peer(self, peer: FakePeer) -> None:
        with self._lock:  # as NIXL's: a post in progress holds it
            self.removal_threads.append(threading.current_thread().name)
            peer.removed = True

    def map_pages(self, peer: FakePeer, dtype: Any, fence: Any = None) -> Any:
        """``mapped`` (a test's tensor standing for the prefill's pages), else ``MappingUnavailable``."""
        self.map_calls.append(threading.current_thread().name)
        self.fences.append(fence)
        if self.mapped is None:
            raise MappingUnavailable("the fake prefill maps nothing", "ucp_rkey_ptr")
        return self.mapped.view(dtype)

    def unmap_pages(self, peer: FakePeer) -> None:
        self.unmapped.append(peer)

    # -- reads
    def blocks(
        self,
        peer: Any,
        dest: Any,
        mode: ReadMode,
        local_ids: Sequence[int],
        remote_ids: Sequence[int],
        remote_num_tokens: int | None,
    ) -> BlockPairs:
        self.pairings += 1
        local, remote = np.asarray(local_ids, dtype=np.int64), np.asarray(remote_ids, dtype=np.int64)
        n = min(local.size, remote.size)  # tail pairing, as the real port's (no range check)
        return BlockPairs(local[local.size - n :], remote[remote.size - n :], _rule(peer, dest))

    def read(
        self,
        peer: Any,
        dest: Any,
        mode: ReadMode,
        local_ids: Sequence[int],
        remote_ids: Sequence[int],
        remote_request_id: str,
        *,
        layer_groups: int,
        timeout_s: float,
        remote_num_tokens: int | None,
        pool: StagingPool | None = None,
        slots: np.ndarray | None = None,
        gaps: Any = None,
        pairs: BlockPairs | None = None,
    ) -> FakeRead:
        self.post_threads.append(threading.current_thread().name)
        with self._lock:
            self.transport_order.append(f"read {remote_request_id}")
            if self.post_gate is not None:
                self.post_gate.wait(10.0)
            if pairs is not None and (not isinstance(pairs, BlockPairs) or pairs.rule != _rule(peer, dest)):
                # as NixlPort: a pairing made for another geometry is refused, and the prefill told at once
                self._tell(peer, remote_request_id)
                self.spent.add(remote_request_id)
                raise RequestRefused("the pairs were made for another geometry", "pairs")
            if self.fail_post:  # the real port notified the failed rank already; so does the fake
                self._tell(peer, remote_request_id)
                self.spent.add(remote_request_id)
                exc = TransferFailed("the fake post failed midway")
                if self.fail_post_keeps_handles:  # as NixlTransfer.pull: what it posted rides on the error
                    kept = FakeRead(peer, remote_request_id, time.monotonic() + timeout_s, [], mode, slots,
                                    gaps, finished=True, handles=[object()], error=exc, notified=True)
                    self.reads.append(kept)
                    exc.read = kept
                raise exc
        if slots is not None:
            layers = int(slots.shape[0])
        else:
            layers = dest[1].num_regions // regions_per_layer(_members(peer)[0].plan.local)
        groups = layer_group_bounds(layers, layer_groups)
        if self.reverse:
            groups.reverse()
        deadline = time.monotonic() + timeout_s
        read = FakeRead(peer, remote_request_id, deadline, groups, mode, slots, gaps, pairs, list(groups))
        read.handles = [object() for _ in groups]
        if pool is not None and slots is not None:  # what a real staged read's descriptors would cover
            read.nbytes = (slots.size + (0 if gaps is None else gaps.size)) * pool.slot_bytes
        self.reads.append(read)
        return read

    def land(self, read: FakeRead, index: int = 0) -> None:
        """Land one pending layer group (by its position among those still pending)."""
        read.landed.append(read.groups.pop(index))

    def poll(self, read: FakeRead, now: float, *, notify: bool = True) -> bool:
        if read.finished:
            if read.error is not None:
                raise read.error
            return True
        if self.fail_reads or self.disconnect_reads:
            if self.disconnect_reads:
                read.error = RemoteDisconnected("check_xfer_state: remote agent disconnected")
            else:
                read.error = TransferFailed("the fake prefill failed the READ")
            self._end(read)
            raise read.error
        if self.auto_land:
            while read.groups:
                self.land(read)
        if not read.groups:
            read.done_at = now
            self._end(read, notify)
            return True
        if now > read.deadline:
            read.error = TransferTimeout("the fake read missed its deadline")
            self._end(read)
            raise read.error
        return False

    def _end(self, read: FakeRead, notify: bool = True) -> None:
        read.finished = True
        if notify:
            self.notify_read(read)

    def notify_read(self, read: FakeRead) -> None:
        if not read.notified:
            read.notified = True
            self._tell(read.peer, read.remote_request_id)

    def abort(self, read: FakeRead) -> bool:
        if self.stuck_abort > 0:
            self.stuck_abort -= 1
            return False
        read.aborted = True
        read.handles = []
        if not read.finished:
            self._end(read)
        self.notify_read(read)
        return True

    def release(self, read: FakeRead) -> bool:
        read.handles = []
        return True

    def notify(self, peer: Any, remote_request_id: str) -> None:
        if remote_request_id in self.spent:  # as NixlPort: a failed post told the prefill already
            self.spent.discard(remote_request_id)
            return
        self._tell(peer, remote_request_id)

    def _tell(self, peer: Any, remote_request_id: str) -> None:
        for m in _members(peer):
            self.notified.append(remote_request_id)
            self.notifications.append((remote_request_id, m.tp_rank, m.notif_count))

    def let_go_notify_only(self, idle_s: float) -> int:
        with self._lock:
            self.let_go_calls.append((idle_s, threading.current_thread().name))
        return 0

    def heartbeat(self, peer: Any, remote_request_ids: Sequence[str]) -> None:
        self.heartbeats.append(list(remote_request_ids))
        self.heartbeat_ranks.append((peer.tp_rank, list(remote_request_ids)))

    def progress(self) -> None:
        pass

    @contextlib.contextmanager
    def hold(self, blocking: bool = True) -> Iterator[bool]:
        got = self._lock.acquire(blocking)
        if not got:
            self.held_skips += 1
        try:
            yield got
        finally:
            if got:
                self._lock.release()

    def thread_init(self) -> None:
        pass

    def close(self) -> None:
        pass


def _rule(peer: Any, dest: Any) -> PairRule:
    """The fake's pairing rule (plain tail pairing, no range check) for a peer and a destination."""
    regions = dest[1]
    block_size = _members(peer)[0].plan.remote.block_size
    return PairRule(1, 1, block_size, int(regions.num_blocks.min()), np.iinfo(np.int64).max)


def _members(peer: Any) -> tuple[Any, ...]:
    return tuple(getattr(peer, "peers", (peer,)))


def _with_kind(fmt: Any, kind: str) -> Any:
    import msgspec

    return msgspec.structs.replace(fmt, kind=kind, layout="LBHNC")
