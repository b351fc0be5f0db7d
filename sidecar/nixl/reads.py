"""Posting a request's READs from one prefill rank and checking them until done (``NixlReads``, each pull a
``ReadOp``): descriptors built from the pair's geometry, posted in layer groups, polled, released, aborted,
and the one completion notification owed to the rank.

Completion notification: a request's reads from one prefill rank may be split into several transfers
(one per layer group, so conversion can start early). NIXL delivers a notification attached to a READ
when THAT transfer completes, and transfers may complete out of order, so attaching it to the last one
posted could free the prefill's blocks while an earlier transfer still reads them. We therefore never
attach it: after every transfer of the rank is DONE we send exactly one ``send_notif`` — the same call
that abort and full-prefix-hit requests use, so there is one path for all three.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sidecar.nixl.calls import locked, nixl_call
from sidecar.nixl.errors import (
    RemoteRefused,
    RequestRefused,
    TransferError,
    TransferFailed,
    TransferTimeout,
)
from sidecar.nixl.geometry import (
    BlockPairs,
    DescIndices,
    GeometryError,
    Mode,
    PairGeometry,
    StagingPool,
)
from sidecar.nixl.local_memory import Destination, LocalMemory
from sidecar.nixl.notifications import Notifier
from sidecar.nixl.remote_peers import Peer, RemotePeers
from sidecar.nixl.runs import Descs, layer_group_bounds

log = logging.getLogger("kv_sidecar.nixl")


@dataclass(eq=False)
class ReadOp:
    """One request's reads from one prefill rank, and the single completion notification owed to it."""

    peer: Peer
    remote_request_id: str
    readers: int
    deadline: float  # monotonic
    handles: list[Any] = field(default_factory=list)
    done_flags: list[bool] = field(default_factory=list)
    sealed: bool = False  # no more transfers will be added
    notified: bool = False
    finished: bool = False
    error: TransferError | None = None
    notify_error: TransferError | None = None
    started_at: float = field(default_factory=time.monotonic)
    done_at: float | None = None
    descriptors: int = 0
    nbytes: int = 0
    layer_ranges: list[tuple[int, int]] = field(default_factory=list)  # [first, last) layers of each handle
    landed: list[tuple[int, int]] = field(default_factory=list)  # ranges seen DONE, for the caller to take


class NixlReads:
    """The agent's reads: into ``memory``'s destinations, from ``peers``' prefill ranks, each rank told once
    through ``notifier``."""

    def __init__(
        self,
        agent: Any,
        lock: threading.RLock,
        memory: LocalMemory,
        peers: RemotePeers,
        notifier: Notifier,
    ) -> None:
        self.agent = agent  # the serialized NIXL agent
        self.lock = lock
        self._memory = memory
        self._peers = peers
        self._notifier = notifier

    def prepare(self, peer: Peer, dest: Destination, mode: Mode) -> tuple[Any, Any]:
        """Prepared (local, remote) dlists for index-form reads: NIXL's one-time work per remote and mode."""
        geo = self._peers.geometry(peer, dest, mode)
        local = self._memory.local_handle(dest, geo.local_table())
        remote = self._peers.remote_handle(peer, mode, geo)
        return local, remote

    def start(
        self, peer: Peer, remote_request_id: str, *, readers: int = 1, timeout_s: float = 30.0
    ) -> ReadOp:
        """A pull of one request from one prefill rank; add transfers, then ``seal`` and ``poll``."""
        self._notifier.check(remote_request_id, readers)  # refuse now, not when owed
        return ReadOp(
            peer=peer,
            remote_request_id=remote_request_id,
            readers=readers,
            deadline=time.monotonic() + timeout_s,
        )

    def _post(self, pull: ReadOp, make, what: str, count: int, nbytes: int) -> None:
        if pull.sealed or pull.finished:
            raise TransferFailed("the pull is sealed; no more transfers", "pull")
        try:
            handle = nixl_call(what, make)
        except TransferError as exc:
            self._fail(pull, exc)
            raise
        pull.handles.append(handle)
        pull.done_flags.append(False)
        pull.done_flags[-1] = self._state(pull, "transfer", self.agent.transfer, handle)
        pull.descriptors += count
        pull.nbytes += nbytes

    def _refuse_unloaded(self, pull: ReadOp) -> None:
        """Fail the pull if NIXL let its peer go: its old regions may now lie in the prefill's newer
        registration (fail closed rather than read them)."""
        if pull.peer.unloaded:
            exc = TransferFailed(
                f"prefill {pull.peer.engine_id} rank {pull.peer.tp_rank} re-registered or restarted since "
                "this pull's handshake: its old regions are not read",
                "remote_registration_generation",
            )
            self._fail(pull, exc)
            raise exc

    def read_indices(
        self,
        pull: ReadOp,
        dest: Destination,
        mode: Mode,
        local_idx: np.ndarray,
        remote_idx: np.ndarray,
        nbytes: int = 0,
    ) -> None:
        """Post one READ of prepared-table rows (a layer group of ``DescIndices``)."""
        if local_idx.size == 0:
            return
        local_h, remote_h = self.prepare(pull.peer, dest, mode)
        li, ri = np.ascontiguousarray(local_idx, np.int32), np.ascontiguousarray(remote_idx, np.int32)
        self._post(
            pull,
            lambda: self.agent.make_prepped_xfer("READ", local_h, li, remote_h, ri),
            "make_prepped_xfer",
            li.size,
            nbytes,
        )

    def read_descs(self, pull: ReadOp, local: np.ndarray, remote: np.ndarray, local_mem_type: str) -> None:
        """Post one READ of explicit Nx3 descriptors (staged or merged runs)."""
        if local.shape[0] == 0:
            return
        agent, peer = self.agent, pull.peer

        def make():
            ld = agent.get_xfer_descs(np.ascontiguousarray(local, np.uint64), local_mem_type)
            rd = agent.get_xfer_descs(np.ascontiguousarray(remote, np.uint64), peer.regions.mem_type)
            if ld is None or rd is None:
                raise TransferFailed("NIXL rejected the descriptor arrays", "descs")
            return agent.initialize_xfer("READ", ld, rd, peer.agent_name)

        self._post(pull, make, "initialize_xfer", int(local.shape[0]), int(local[:, 1].sum()))

    @staticmethod
    def table(
        geo: PairGeometry,
        mode: Mode,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        remote_num_tokens: int | None,
        pool: StagingPool | None,
        slots: np.ndarray | None,
        gaps: Any = None,
        pairs: BlockPairs | None = None,
    ) -> DescIndices | Descs:
        """A request's descriptors against ``geo`` (from ``pairs`` when given: the ids are not paired again);
        raises GeometryError naming the field."""
        if geo.source is not None:  # a head slice (heterogeneous TP): explicit descriptors in every mode
            return geo.sliced_descs(local_block_ids, remote_block_ids, remote_num_tokens, slots, pairs=pairs)
        if mode == "staged":
            if pool is None or slots is None:
                raise GeometryError("pool", "a staged pull needs a pool and slots")
            return geo.staged_descs(
                remote_block_ids,
                slots,
                local_block_ids=local_block_ids,
                remote_num_tokens=remote_num_tokens,
                gaps=gaps,
                pairs=pairs,
            )
        return geo.indices(local_block_ids, remote_block_ids, remote_num_tokens, pairs=pairs)

    @locked
    def pull(
        self,
        peer: Peer,
        dest: Destination,
        mode: Mode,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        remote_request_id: str,
        *,
        readers: int = 1,
        layer_groups: int = 1,
        timeout_s: float = 30.0,
        remote_num_tokens: int | None = None,
        pool: StagingPool | None = None,
        slots: np.ndarray | None = None,
        gaps: Any = None,
        table: DescIndices | Descs | None = None,
        pairs: BlockPairs | None = None,
    ) -> ReadOp:
        """Build the request's descriptors (unless ``table`` gives them, from :meth:`table`; from ``pairs``,
        the ids' checked pairing, when given) and post them in ``layer_groups`` READs; returns the sealed
        pull.
        ``gaps`` (staged): a ``spans.GapRead`` or ``SpanGaps`` of blocks read into staging only, to merge
        runs.

        Staged mode reads into ``pool`` (see ``LocalMemory.staging``) at ``slots[layer, i]``. With no block to
        read (a full local prefix hit) nothing is posted and the pull completes with just the notification."""
        pull = self.start(peer, remote_request_id, readers=readers, timeout_s=timeout_s)
        self._refuse_unloaded(pull)  # once, under the lock no unload can take meanwhile
        try:
            geo = self._peers.geometry(peer, dest, mode, pool)
        except RemoteRefused as exc:  # this pairing cannot be read: the prefill frees the blocks now
            self._fail(pull, exc)
            raise
        try:
            if table is None:
                table = self.table(
                    geo, mode, local_block_ids, remote_block_ids, remote_num_tokens, pool, slots, gaps, pairs
                )
        except GeometryError as exc:
            # Nothing will be read: tell the prefill now rather than let the blocks wait for the lease.
            self._fail(pull, RequestRefused(exc.reason, exc.field))
            raise pull.error from exc  # type: ignore[misc]
        try:
            self._post_groups(pull, geo, table, dest, mode, pool, layer_groups)
        except Exception as exc:  # whatever the error: what it posted may still hold handles, untold
            exc.read = pull  # type: ignore[attr-defined]  # failed midway: the caller stops it
            raise
        self.seal(pull)
        return pull

    def _post_groups(self, pull: ReadOp, geo: PairGeometry, table: Any, dest: Destination, mode: Mode,
                     pool: StagingPool | None, layer_groups: int) -> None:
        for a, b in layer_group_bounds(geo.layers, layer_groups):
            posted = len(pull.handles)
            if isinstance(table, Descs):
                loc, rem = table.layer_slice(a, b)
                mem = pool.mem_type if mode == "staged" else dest.registration.mem_type  # type: ignore[union-attr]
                self.read_descs(pull, loc, rem, mem)
            else:
                li, ri = table.layer_slice(a, b)
                self.read_indices(pull, dest, mode, li, ri, nbytes=self._index_bytes(geo, li.size))
            if len(pull.handles) > posted:
                pull.layer_ranges.append((a, b))
                if pull.done_flags[-1]:  # a transport that copies while posting (shm) is DONE at once
                    pull.landed.append((a, b))

    @staticmethod
    def _index_bytes(geo: PairGeometry, count: int) -> int:
        unit = int(geo.local.block_len[0])
        return unit * count

    def seal(self, pull: ReadOp) -> None:
        """No more transfers for this pull: once all are done, its notification may go."""
        pull.sealed = True

    def _state(self, pull: ReadOp, what: str, call: Any, handle: Any) -> bool:
        """Post or check one transfer; True when it is DONE. A NIXL error fails the whole pull."""
        try:
            state = nixl_call(what, call, handle)
        except TransferError as exc:
            self._fail(pull, exc)
            raise
        if state == "ERR":
            exc = TransferFailed(f"{what} returned ERR")
            self._fail(pull, exc)
            raise exc
        return state == "DONE"

    def poll(self, pull: ReadOp, now: float | None = None, *, notify: bool = True) -> bool:
        """Non-blocking: True once every transfer is DONE and the one notification has been sent (with
        ``notify=False`` the caller sends it with :meth:`notify_read`, e.g. after launching work on the data).

        The DONE handles stay with the pull until :meth:`release`: releasing a handle of thousands of
        descriptors takes time the caller can spend after it has answered (the daemon releases after Done).

        Raises RemoteDisconnected / TransferFailed / TransferTimeout (the pull is then aborted: handles
        released and, where the peer is alive, the notification sent so the prefill frees its blocks)."""
        if pull.finished:
            if pull.error is not None:
                raise pull.error
            return True
        now = time.monotonic() if now is None else now
        for i, handle in enumerate(pull.handles):
            if pull.done_flags[i]:
                continue
            pull.done_flags[i] = self._state(pull, "check_xfer_state", self.agent.check_xfer_state, handle)
            if pull.done_flags[i] and i < len(pull.layer_ranges):
                pull.landed.append(pull.layer_ranges[i])  # its layers may be converted while others read
        if pull.sealed and all(pull.done_flags):
            pull.done_at = now
            if notify:
                self._notify_once(pull)  # every read is DONE: the prefill may free its blocks now
            pull.finished = True
            return True
        if now > pull.deadline:
            exc = TransferTimeout(
                f"pull of {pull.remote_request_id!r} from {pull.peer.address} rank "
                f"{pull.peer.tp_rank} missed its deadline"
            )
            self._fail(pull, exc)
            raise exc
        return False

    def notify_read(self, pull: ReadOp) -> None:
        """The finished pull's one notification, if :meth:`poll` was told not to send it."""
        self._notify_once(pull)

    def wait(self, pull: ReadOp, *, sleep_s: float = 0.0005, release: bool = True) -> ReadOp:
        """Blocking helper for benches and tests: poll with a short sleep (no hot spin on small hosts), then
        release the handles unless told not to."""
        while not self.poll(pull):
            time.sleep(sleep_s)
        if release:
            self.release(pull)
        return pull

    @locked
    def release(self, pull: ReadOp) -> bool:
        """Release a pull's transfer handles that have ended (all of them after :meth:`poll` said done). True
        when none is left, i.e. nothing can still write into the destination; else call again later."""
        return self._release(pull)

    @locked
    def abort(self, pull: ReadOp) -> bool:
        """Stop a pull: release its transfers that have ended, then send its notification so the prefill
        frees the blocks. Returns True when nothing can still write into local memory (every handle released);
        False while a transfer is still in progress (call again: it ends, or its peer is found gone)."""
        if not pull.finished:
            pull.error = pull.error or TransferFailed("aborted")
            pull.finished = True
        safe = self._release(pull)
        self._notify_once(pull)
        return safe

    def _release(self, pull: ReadOp) -> bool:
        """Release the pull's transfers that have ended (DONE or ERR); True when none is left. One still in
        progress is kept for a later call: NIXL cancels it on release, but over UCX's tcp transport a stalled
        prefill's reply still landed in local memory after that (test_agent's stalled-read tests), so only a
        transfer that has ended cannot write any more."""
        safe = True
        kept = []
        for i, handle in enumerate(pull.handles):
            ended = i < len(pull.done_flags) and pull.done_flags[i]
            if not ended:
                try:
                    ended = self.agent.check_xfer_state(handle) != "PROC"
                except Exception:  # noqa: BLE001 - failed, or never posted: nothing of it is in flight
                    ended = True
            if ended:
                try:
                    self.agent.release_xfer_handle(handle)
                    continue
                except Exception as exc:  # noqa: BLE001 - keep it for a retry
                    log.warning("could not release a transfer of %r: %s", pull.remote_request_id, exc)
            kept.append(handle)
            safe = False
        pull.handles = kept
        pull.done_flags = [False] * len(kept)
        return safe

    def _notify_once(self, pull: ReadOp) -> None:
        if pull.notified:
            return
        pull.notified = True  # exactly once, even if the send fails
        try:
            self._notifier.notify(pull.peer, pull.remote_request_id, pull.readers)
        except TransferError as exc:
            pull.notify_error = exc
            log.warning(
                "completion notification for %r to %s failed: %s",
                pull.remote_request_id,
                pull.peer.address,
                exc,
            )

    def _fail(self, pull: ReadOp, exc: TransferError) -> None:
        pull.error = exc
        pull.finished = True
        self._release(pull)
        self._notify_once(pull)
