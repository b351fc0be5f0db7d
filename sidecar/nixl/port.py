"""``NixlPort``: the daemon's ``TransferPort`` on a real NIXL agent and vLLM's side channel."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sidecar.daemon.port import Admission, PeerTarget, ReadMode, Runner
from sidecar.nixl import tp
from sidecar.nixl.admission import AdmissionRules, admit_remote, resolve_remote_format
from sidecar.nixl.agent import NixlTransfer, TransferSettings
from sidecar.nixl.errors import MappingUnavailable, RemoteRefused, TransferError
from sidecar.nixl.geometry import BlockPairs, LocalRegions, StagingPool, regions_per_layer
from sidecar.nixl.mapping import MappedPages, map_pages, mapping_layout
from sidecar.nixl.reads import ReadOp
from sidecar.nixl.remote_peers import NotifyOnlyPeer, Peer
from sidecar.wire import prefill as vllm_wire

log = logging.getLogger("kv_sidecar.nixl")


@dataclass(eq=False)
class ReadGroup:
    """One request's reads from several prefill ranks (heterogeneous TP), seen by the daemon as one read:
    a layer range has landed once every rank's read of it has."""

    ops: list[ReadOp]
    landed: list[tuple[int, int]] = field(default_factory=list)
    _want: Counter = field(default_factory=Counter)
    _seen: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self._want = Counter(r for op in self.ops for r in op.layer_ranges)

    @property
    def finished(self) -> bool:
        return all(op.finished for op in self.ops)

    @property
    def layer_ranges(self) -> list[tuple[int, int]]:
        """Every layer range posted (each rank posts the same ones), in post order."""
        return list(dict.fromkeys(r for op in self.ops for r in op.layer_ranges))

    @property
    def done_at(self) -> float | None:
        times = [op.done_at for op in self.ops]
        return None if None in times else max(times)  # type: ignore[type-var]

    @property
    def nbytes(self) -> int:
        return sum(op.nbytes for op in self.ops)

    @property
    def handles(self) -> bool:
        return any(op.handles for op in self.ops)

    @property
    def error(self) -> Exception | None:
        return next((op.error for op in self.ops if op.error is not None), None)

    def take_landed(self) -> None:
        for op in self.ops:
            while op.landed:
                r = op.landed.pop(0)
                self._seen[r] += 1
                if self._seen[r] == self._want[r]:
                    self.landed.append(r)


async def _run(run: Runner | None, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` where ``run`` runs it (the daemon's poster thread), else here."""
    return fn(*args) if run is None else await run(fn, *args)


def _members(peers: Any) -> tuple[Any, ...]:
    """The prefill ranks of a ``PeerSet`` (or a lone peer)."""
    return tuple(getattr(peers, "peers", (peers,)))


def admit_rank(
    target: PeerTarget, admission: Admission, reply: Any, remote_mem_type: str
) -> tuple[Any, Any, tp.SourceSlice | None]:
    """Every check of one prefill rank's handshake reply, pure: at another TP the head slice this decoder
    rank reads of it (``tp.rank_read``: the view it negotiates against), then ``admit_remote``. The plan,
    the remote regions and the slice (None at the same TP); RemoteRefused naming the field. ``kv-sidecar
    doctor`` makes the same call."""
    source, view = None, None
    if target.remote_tp != target.local_tp:
        source, view = _slice(target, admission, reply)
    rules = AdmissionRules(
        remote_formats=admission.rules,
        conversion_enabled=admission.conversion_enabled,
        allow_lossy_fp8=admission.allow_lossy_fp8,
    )
    plan, regions = admit_remote(
        reply.metadata,
        address=target.address,
        local_format=admission.local_format,
        layers=admission.layers,
        rules=rules,
        remote_mem_type=remote_mem_type,
        remote_hash=reply.compatibility_hash,
        local_factors=admission.compat_factors or None,
        check_identity=admission.check_identity,
        expected_engine_id=target.engine_id,
        view=view,
    )
    return plan, regions, source


def _slice(target: PeerTarget, admission: Admission, reply: Any) -> tuple[tp.SourceSlice, Any]:
    """The head slice this decoder rank reads of a prefill rank at another TP, and its view format."""
    tag = getattr(reply.metadata, "page_format", None)
    declared = resolve_remote_format(target.address, admission.rules, tag)
    read = tp.rank_read(
        declared,
        admission.local_format,
        local_tp=target.local_tp,
        local_rank=target.local_rank,
        remote_tp=target.remote_tp,
        remote_rank=target.tp_rank,
    )
    if not isinstance(read, tp.RankRead):
        raise RemoteRefused(read.reason, read.field)
    return read.source, read.view


class NixlPort:
    """A thin adapter: one ``NixlTransfer`` (the agent) plus the handshake over the prefill's side channel."""

    def __init__(self, settings: TransferSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.agent = NixlTransfer(settings, clock)
        self.local_mem_type = "DRAM" if settings.cuda_device is None else "VRAM"
        # (agent, remote request id) already notified by a read that failed while posting: the daemon's
        # own notification for that request must not go out a second time.
        self._spent: dict[tuple[str, str], None] = {}

    def register(self, ranges: Sequence[tuple[int, int, int]], mem_type: str) -> Any:
        return self.agent.register(ranges, mem_type)

    def deregister(self, registration: Any) -> None:
        self.agent.deregister(registration)

    def destination(self, registration: Any, regions: LocalRegions) -> Any:
        return self.agent.destination(registration, regions)

    def staging(self, registration: Any, pool: StagingPool) -> StagingPool:
        return self.agent.staging(registration, pool)

    async def connect(self, target: PeerTarget, admission: Admission, run: Runner | None = None) -> Peer:
        replies = await vllm_wire.fetch_handshake_async(
            target.host,
            target.port,
            [(0, target.tp_rank)],
            timeout_s=admission.timeout_s,
            expected_engine_id=target.engine_id,
        )
        reply = replies[(0, target.tp_rank)]
        source, count = None, tp.notif_count(local_tp=target.local_tp, remote_tp=target.remote_tp)
        metadata = reply.metadata.agent_metadata
        try:
            # a prefill listing no region_mem_types is taken to be on this host's kind of memory
            plan, regions, source = admit_rank(target, admission, reply, self.local_mem_type)
        except RemoteRefused as exc:
            exc.peer = await _run(run, self._notify_only_peer, target, metadata, count)
            raise
        return await _run(run, self._load, target, metadata, plan, regions, source, count)

    def _load(
        self, target: PeerTarget, metadata: bytes, plan: Any, regions: Any, source: Any, count: int
    ) -> Peer:
        """``connect``'s transport call for an admitted rank (``RemotePeers.add_peer``: a notify-only load of
        the same metadata becomes the peer's, the rank's others go)."""
        return self.agent.add_peer(
            engine_id=target.engine_id,
            tp_rank=target.tp_rank,
            generation=target.generation,
            address=target.address,
            agent_metadata=metadata,
            plan=plan,
            regions=regions,
            source=source,
            notif_count=count,
        )

    def _notify_only_peer(
        self, target: PeerTarget, agent_metadata: bytes, count: int = 1
    ) -> NotifyOnlyPeer | None:
        """``connect``'s transport call for a refused rank: its agent loaded (or found) to be notified."""
        try:
            return self.agent.load_notify_only(
                engine_id=target.engine_id,
                tp_rank=target.tp_rank,
                address=target.address,
                agent_metadata=agent_metadata,
                notif_count=count,
            )
        except TransferError:
            return None  # NIXL cannot load it: the prefill's lease frees the blocks

    def let_go_notify_only(self, idle_s: float) -> int:
        return self.agent.let_go_notify_only(idle_s)

    def remove_peer(self, peer: Peer) -> None:
        self.agent.remove_peer(peer)

    def map_pages(self, peer: Peer, dtype: Any, fence: Callable[[], Any] | None = None) -> Any:
        if peer.unloaded:  # NIXL let it go: its old regions may now be a newer registration's (not kept:
            # a mapping made before stays in ``peer.mapping``, for ``remove_peer`` to close)
            raise MappingUnavailable(
                f"prefill {peer.engine_id} rank {peer.tp_rank} re-registered or restarted since it was "
                "admitted: its old regions are not mapped",
                "remote_registration_generation",
            )
        if isinstance(peer.mapping, MappingUnavailable):
            raise peer.mapping
        if peer.mapping is None:
            fmt = peer.plan.remote
            try:
                if peer.source is not None:
                    raise MappingUnavailable(
                        "a head slice of a prefill rank at another TP is read, not mapped", "remote_tp_size"
                    )
                layers = peer.regions.num_regions // regions_per_layer(fmt)
                layout = mapping_layout(peer.regions, layers, fmt.page_bytes, fmt.elem_bytes)
                device = self.agent.settings.cuda_device
                peer.mapping = map_pages(peer.agent_metadata, peer.regions, layout, device, fence=fence)
            except MappingUnavailable as exc:
                peer.mapping = exc
                raise
        return peer.mapping.source(dtype)

    def unmap_pages(self, peer: Peer) -> None:
        mapping, peer.mapping = peer.mapping, None
        if isinstance(mapping, MappedPages):
            mapping.close()

    def blocks(
        self,
        peer: Any,
        dest: Any,
        mode: ReadMode,
        local_ids: Sequence[int],
        remote_ids: Sequence[int],
        remote_num_tokens: int | None,
    ) -> BlockPairs:
        geo = self.agent.geometry(_members(peer)[0], dest, "plain" if mode == "plain" else "direct")
        return geo.blocks(local_ids, remote_ids, remote_num_tokens)

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
    ) -> ReadOp | ReadGroup:
        """The request's reads from each prefill rank of ``peer`` (a ``PeerSet`` or one peer); each rank gets
        its own notification ``id:n`` once its reads are DONE (or stopped). ``pairs``: the ids' pairing from
        ``blocks``, so it is not made again here; every rank's geometry checks it fits that rank."""
        with self.agent.hold():  # every rank's read as one unit against the other thread's agent calls
            members = _members(peer)
            tables: list[Any] = [None] * len(members)
            if len(members) > 1:  # every rank's descriptors before anything is posted or notified
                tables = [
                    self.agent.table(self.agent.geometry(m, dest, mode, pool), mode, local_ids, remote_ids,
                                     remote_num_tokens, pool, slots, gaps, pairs)
                    for m in members
                ]
            ops: list[ReadOp] = []
            for i, m in enumerate(members):
                try:
                    ops.append(self.agent.pull(
                        m, dest, mode, local_ids, remote_ids, remote_request_id, readers=m.notif_count,
                        layer_groups=layer_groups, timeout_s=timeout_s, remote_num_tokens=remote_num_tokens,
                        pool=pool, slots=slots, gaps=gaps, table=tables[i], pairs=pairs,
                    ))
                except Exception as exc:
                    # a TransferError's pull told its rank; any other error's did not
                    told = isinstance(exc, TransferError) or isinstance(getattr(exc, "read", None), ReadOp)
                    rest = members[i + 1 :] if told else members[i:]
                    self._fail_ranks(exc, ops, members, rest, remote_request_id)
                    raise
            return ops[0] if len(ops) == 1 else ReadGroup(ops)

    def _fail_ranks(
        self, exc: Exception, ops: list[ReadOp], members: Sequence[Any], rest: Sequence[Any], request_id: str
    ) -> None:
        """A rank's post failed (its pull notified it if it raised a TransferError; else it is in ``rest``):
        stop the posted ranks' reads, which notifies them, and notify ``rest``, every rank exactly once. The
        posted reads ride on ``exc``, whatever its type, for the caller's stop; a notification that cannot be
        sent (the prefill is often gone by now) is logged, never raised over ``exc``, which would lose them.
        """
        for op in ops:
            self.agent.abort(op)
        if ops:  # whatever ``exc`` is: without them the caller would stop nothing while a READ may write
            failed = getattr(exc, "read", None)
            group = ReadGroup(ops + ([failed] if isinstance(failed, ReadOp) else []))
            exc.read = group  # type: ignore[attr-defined]  # every rank's handles: the caller stops them
        for m in members:  # before the sends: whatever they do, the daemon's own notify skips every rank
            self._spent[(m.agent_name, request_id)] = None
        while len(self._spent) > 4096:
            self._spent.pop(next(iter(self._spent)))
        for m in rest:
            try:
                self._notify_one(m, request_id)
            except Exception as err:  # noqa: BLE001 - the post's own failure is what the caller must see
                log.warning("cannot notify prefill rank %d of %s after a failed read: %s", m.tp_rank,
                            request_id, err)

    def poll(self, read: ReadOp | ReadGroup, now: float, *, notify: bool = True) -> bool:
        if isinstance(read, ReadOp):
            return self.agent.poll(read, now, notify=notify)
        try:
            done = [self.agent.poll(op, now, notify=notify) for op in read.ops]
        finally:
            read.take_landed()
        return all(done)

    def notify_read(self, read: ReadOp | ReadGroup) -> None:
        for op in read.ops if isinstance(read, ReadGroup) else [read]:
            self.agent.notify_read(op)

    def abort(self, read: ReadOp | ReadGroup) -> bool:
        if isinstance(read, ReadOp):
            return self.agent.abort(read)
        return all([self.agent.abort(op) for op in read.ops])

    def release(self, read: ReadOp | ReadGroup) -> bool:
        if isinstance(read, ReadOp):
            return self.agent.release(read)
        return all([self.agent.release(op) for op in read.ops])

    def notify(self, peer: Any, remote_request_id: str) -> None:
        """Tell every prefill rank of ``peer`` to free the request's blocks (``id:n``, n its count). A rank
        that cannot be told does not keep the others from it (each frees its own blocks); the first failure
        is raised once every rank was tried."""
        failed: Exception | None = None
        for m in _members(peer):
            if (m.agent_name, remote_request_id) in self._spent:
                del self._spent[(m.agent_name, remote_request_id)]
                continue  # a failed read already told it
            try:
                self._notify_one(m, remote_request_id)
            except Exception as exc:  # noqa: BLE001 - raised below, after the other ranks
                failed = failed or exc
        if failed is not None:
            raise failed

    def _notify_one(self, peer: Peer | NotifyOnlyPeer, remote_request_id: str) -> None:
        if isinstance(peer, NotifyOnlyPeer):
            self.agent.mark_used(peer)
        self.agent.notify_agent(peer.agent_name, remote_request_id, peer.notif_count)

    def heartbeat(self, peer: Peer, remote_request_ids: Sequence[str]) -> None:
        self.agent.heartbeat(peer, remote_request_ids)

    def progress(self) -> None:
        """TransferError if NIXL fails: the daemon's progress loop logs it and goes on (best effort; a real
        fault surfaces on the transfers)."""
        self.agent.progress()

    def hold(self, blocking: bool = True) -> Any:
        return self.agent.hold(blocking)

    def thread_init(self) -> None:
        self.agent.thread_init()

    def close(self) -> None:
        self.agent.close()
