"""A Pull's path: queue → handshake → lease check → read (converting groups as they land) → Done.
With ``pull_mode = "mapped"`` and a prefill whose pages map, the read is the conversion itself
(``mapped.py``).

``Pipeline._path`` is the whole happy path in one short function; everything that can go wrong raises
(``Refused``, ``Failed``) or cancels the job's task (deadline, Abort, shutdown), and ``_run`` turns that into
the one answer every accepted Pull gets. Before answering, ``_quiesce`` makes sure nothing can still write
into the job's blocks (or, mapped, read the prefill's), and that the prefill is told it may free them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from sidecar.daemon.caches import CacheRegistry, Caches
from sidecar.daemon.conversion import Conversions
from sidecar.daemon.errors import Failed, PeerLost, Refused, reason_of
from sidecar.daemon.jobs import SHUTTING_DOWN, Ending, Job, JobTable, Outcome, Session, Stage
from sidecar.daemon.leases import Leases
from sidecar.daemon.mapped import MappedReads
from sidecar.daemon.peers import Peers
from sidecar.daemon.port import PeerSet, PeerTarget, ReadMode
from sidecar.daemon.read_plan import gap_cost, layer_groups_for, staged_descriptors
from sidecar.daemon.reads import Reads
from sidecar.daemon.staging import PoolTooSmall, Staged, Staging
from sidecar.nixl.tp import read_ranks
from sidecar.ops.config import Config
from sidecar.ops.metrics import Metrics
from sidecar.ops.ratelog import RateLimitedLog
from sidecar.wire import protocol as p
from sidecar.wire.formats import PageFormat

log = logging.getLogger("kv_sidecar.pipeline")
UNSAFE_REMEMBERED = 4096  # unsafe answers kept for later Aborts (each one is a stuck transfer: rare)
ABORTED_UNSEEN_REMEMBERED = 4096  # Aborts of req_ids not (yet) pulled, kept to refuse a Pull arriving late


class Pipeline:
    """Accepts Pulls and Aborts, runs each job through the parts, and answers it exactly once."""

    def __init__(
        self,
        *,
        config: Callable[[], Config],
        jobs: JobTable,
        caches: CacheRegistry,
        peers: Peers,
        leases: Leases,
        reads: Reads,
        staging: Staging | None,
        conversions: Conversions,
        mapped: MappedReads,
        send: Callable[[list[bytes], p.ToShim], None],
        metrics: Metrics,
        spawn: Callable[[Any], asyncio.Task],
        stopping: Callable[[], bool],
    ) -> None:
        self._config = config
        self._jobs = jobs
        self._caches = caches
        self._peers = peers
        self._leases = leases
        self._reads = reads
        self._staging = staging
        self._conversions = conversions
        self._mapped = mapped
        self._send = send
        self._metrics = metrics
        self._spawn = spawn
        self._stopping = stopping
        self._ratelog = RateLimitedLog(log, on_suppressed=metrics.logs_suppressed.inc)
        # req_ids answered with blocks unsafe (a transfer NIXL would not stop), newest last: a later Abort
        # for one (the shim's, after a reconnect) must not be told "not in flight" as if nothing could write
        self._unsafe: OrderedDict[str, None] = OrderedDict()
        # req_ids the registering shim aborted before their Pull was seen, newest last: the shim reads an
        # Abort's answer as "its blocks are free", so a Pull overtaken by its own Abort (the two sockets are
        # read independently) must never be read into them
        self._aborted_unseen: OrderedDict[str, None] = OrderedDict()

    # -- the way in

    def on_pull(self, envelope: list[bytes], session: Session, msg: p.Pull, received: float) -> None:
        foreign = self._foreign(session, msg)
        if foreign is not None:
            self._metrics.foreign_messages.inc()
            self._metrics.refused("session")
            self._answer_now(envelope, msg, Outcome.REFUSED, f"session: {foreign}")
            return
        if msg.req_id in self._aborted_unseen:
            del self._aborted_unseen[msg.req_id]
            reason = "aborted: the shim's Abort of this request arrived before its Pull; nothing read"
            self._not_taken(envelope, session, msg, Outcome.ABORTED, reason)
            return
        if msg.req_id in self._jobs:
            self._metrics.invalid_messages.inc()
            reason = f"req_id {msg.req_id!r} is already in flight"
            self._send(envelope, p.Error(reason=reason, in_reply_to="Pull", req_id=msg.req_id))
            return
        if self._stopping():  # told through a cached or running handshake only: none is made now
            reason = f"{SHUTTING_DOWN}: not accepting pulls"
            self._not_taken(envelope, session, msg, Outcome.FAILED, reason, handshake=False)
            return
        full = self._jobs.full()
        if full is not None:
            self._not_taken(envelope, session, msg, Outcome.REFUSED, full)
            return
        cfg = self._config()
        timeout = self._jobs.timeout_for(msg, cfg.default_timeout_s, cfg.max_timeout_s)
        deadline = self._jobs.deadline_for(msg, received, timeout)
        if deadline <= received:
            # the shim has given up on it, or is about to, and may have handed its blocks back to vLLM
            late = received - msg.sent_at_ns / 1e9
            self._not_taken(
                envelope,
                session,
                msg,
                Outcome.EXPIRED,
                f"deadline: {timeout:g} s had passed when the Pull arrived ({late:.1f} s after the shim sent "
                "it); nothing read",
            )
            return
        job = self._jobs.add(msg, envelope, session, received, timeout, deadline, self._run)
        current = self._caches.current  # what ``_foreign`` checked the session against
        job.registration = current.generation if current is not None else 0
        assert job.task is not None
        job.task.add_done_callback(lambda task: self._cancelled_before_start(job, task))
        self._metrics.in_flight.set(len(self._jobs))
        started = msg.lease_started_at_ns / 1e9 if msg.lease_started_at_ns else received
        self._leases.seen(msg.remote_request_id, min(started, received))

    def _foreign(self, session: Session, msg: p.Pull) -> str | None:
        """Why this session may not pull into the registered caches, or None. Only the shim that
        registered them may: any other connection could name blocks the decoder never gave it."""
        if session.hello is None:
            return "say Hello (and RegisterCaches) before Pull"
        caches = self._caches.current
        if caches is not None and not caches.owned_by(session):
            return "the caches were registered by another shim connection"
        return None

    def on_abort(self, envelope: list[bytes], session: Session, msg: p.Abort, received: float) -> None:
        job = self._jobs.get(msg.req_id)
        if job is not None and not job.session.same_shim(session):
            self._metrics.foreign_messages.inc()
            reason = f"req_id {msg.req_id!r} was pulled by another shim connection"
            self._send(envelope, p.Error(reason=f"session: {reason}", in_reply_to="Abort", req_id=msg.req_id))
            return
        if job is None:
            if msg.req_id in self._unsafe:
                reason = "answered with its blocks unsafe: a transfer could not be stopped"
                self._send(envelope, p.Aborted(req_id=msg.req_id, safe=False, reason=reason))
                return
            if self._caches.current is not None and self._caches.current.owned_by(session):
                self._aborted_unseen[msg.req_id] = None
                while len(self._aborted_unseen) > ABORTED_UNSEEN_REMEMBERED:
                    self._aborted_unseen.popitem(last=False)
            reason = "not in flight (already answered or never seen)"
            self._send(envelope, p.Aborted(req_id=msg.req_id, safe=True, reason=reason))
            return
        job.abort_envelope = envelope  # answered with Aborted (not Done) once the job is quiet
        self._jobs.cancel(job, Ending(Outcome.ABORTED, "aborted by the shim"))

    def _not_taken(
        self,
        envelope: list[bytes],
        session: Session,
        msg: p.Pull,
        outcome: Outcome,
        reason: str,
        handshake: bool = True,
    ) -> None:
        """Answer a Pull of the caches' owner that will not be read (overloaded, expired, aborted first, or
        shutting down), and tell its prefill ranks to free the blocks now rather than hold them for the rest
        of their lease: the shim sends no notification of its own for a load that failed. Told through a
        cached or running handshake (also once the caches are released, as at shutdown), or (``handshake``,
        with caches to be admitted against) one made just for this."""
        self._answer_now(envelope, msg, outcome, reason)
        caches = self._caches.current if handshake else None
        for target in _read_targets(msg, session, refuse=False):
            self._peers.notify_unread(target, caches, msg.remote_request_id)

    def _answer_now(self, envelope: list[bytes], msg: p.Pull, outcome: Outcome, reason: str) -> None:
        self._metrics.answered(outcome.value)
        self._send(envelope, p.Done(req_id=msg.req_id, ok=False, reason=reason))

    # -- the path

    async def _path(self, job: Job) -> Ending:
        msg, cfg = job.msg, self._config()
        job.timings["accept"] = time.monotonic() - job.received  # the loop's latency before the job ran
        await self._jobs.wait_turn(job)
        caches = self._hold_caches(job)
        if max(msg.num_local_blocks, msg.num_remote_blocks) > caches.max_blocks:
            raise Refused(
                "local_block_ids",
                f"{msg.num_local_blocks} local / {msg.num_remote_blocks} remote block ids, "
                f"the registered caches hold {caches.max_blocks} blocks",
            )
        targets = _targets(job)  # every prefill rank this decoder rank reads (several when its TP is larger)
        job.enter(Stage.HANDSHAKE)
        handshakes = []
        for target in targets:
            entry, handshake = self._peers.acquire(target, caches)
            job.peer_entries.append(entry)
            handshakes.append(handshake)
        job.peer = PeerSet(_admitted(handshakes) or await self._handshakes(handshakes))
        for target, peer in zip(targets, job.peer.peers, strict=True):
            if 0 < target.generation < peer.generation:
                # The prefill registered its cache again (sleep/wake) after this request's prefill: its
                # blocks were in the older registration, and the same ids now name other bytes.
                raise Failed(
                    f"remote_registration_generation: the pull names the prefill's registration "
                    f"{target.generation}, but {peer.engine_id} rank {peer.tp_rank} has registered again "
                    f"({peer.generation}) since; its blocks are gone, not read"
                )
        if not self._leases.check(msg.remote_request_id, time.monotonic(), _ranks(job)):
            raise Failed(
                f"lease: cannot vouch for {msg.remote_request_id!r} any more (lease {cfg.lease_s:g} s, "
                "no heartbeat in time); not reading blocks the prefill may have reused"
            )
        job.enter(Stage.TRANSFER)
        mode = self._mode(job.peer.plan.convert)
        if mode == "mapped":
            source = await self._mapped.source(job)
            if source is not None:
                return await self._convert_mapped(job, caches, source)
            mode = self._usual_mode()
        converting = await self._post(job, caches, mode, cfg.layer_groups)
        posted = time.monotonic()
        job.timings["post"] = posted - job.stage_started
        if converting and self._conversions.on_gpu:  # launches made ready while the bytes are on their way
            self._conversions.prepare(job, job.read.layer_ranges)
        await self._reads.wait(job)  # layer groups convert as they land, while later ones still read
        done_at = job.read.done_at or time.monotonic()
        job.timings["read"] = done_at - posted
        if done_at >= self._leases.vouched_until(msg.remote_request_id, _ranks(job)):
            raise Failed(
                f"lease: the read of {msg.remote_request_id!r} ended after its lease could have "
                "lapsed; its bytes cannot be trusted"
            )
        if converting:
            job.enter(Stage.CONVERT)  # what is left of the conversion once the last byte has landed
            await self._conversions.finish(job, len(caches.layers))
        return Ending(Outcome.OK)

    @staticmethod
    async def _handshakes(handshakes: list[asyncio.Task]) -> tuple[Any, ...]:
        """The admitted peers, once every handshake is through."""
        gathered = asyncio.gather(*handshakes)
        # Shielded so an aborted pull leaves shared handshakes running; one that then fails has nobody
        # awaiting it, so retrieve its outcome here (each handshake's own waiters still see the error).
        gathered.add_done_callback(_retrieve)
        return tuple(await asyncio.shield(gathered))

    def _hold_caches(self, job: Job) -> Caches:
        caches = self._caches.current
        if caches is None:
            raise Refused("caches", "no caches registered (RegisterCaches first)")
        if caches.retiring:
            raise Refused("caches", "the caches are being released (unregistered, registered again, or their "
                          "shim went away); nothing read")
        if caches.generation != job.registration:
            # registered while the job waited for its first step or its turn: its block ids name the
            # caches it was accepted for (or none), not these, and these may be another shim's
            raise Refused(
                "caches",
                f"the caches were registered again after this Pull arrived (generation "
                f"{job.registration or 'none'} then, {caches.generation} now); nothing read",
            )
        caches.users += 1
        job.caches = caches
        return caches

    def _mode(self, convert: bool) -> ReadMode:
        if not convert:
            return "plain"
        mode = self._config().pull_mode
        return self._usual_mode() if mode == "auto" else mode

    def _usual_mode(self) -> ReadMode:
        """``auto``'s choice, and where a mapped read is not possible: staged when there is a pool (``_post``
        still reads a request the pool cannot hold direct)."""
        return "staged" if self._staging is not None else "direct"

    async def _convert_mapped(self, job: Job, caches: Caches, source: Any) -> Ending:
        """The mapped path's read: the conversion out of the prefill's mapped pages (``mapped.py``); the
        prefill is notified by ``_quiesce``, once the conversion has ended."""
        job.pairs = self._reads.blocks(job, "mapped")
        self._metrics.read_mode("mapped")
        job.enter(Stage.CONVERT)
        await self._mapped.convert(job, source, len(caches.layers))
        rid = job.msg.remote_request_id
        if time.monotonic() >= self._leases.vouched_until(rid, _ranks(job)):
            raise Failed(
                f"lease: the conversion of {rid!r} ended after its lease could have lapsed; its bytes "
                "cannot be trusted"
            )
        return Ending(Outcome.OK)

    async def _post(self, job: Job, caches: Caches, mode: ReadMode, layer_groups: int) -> bool:
        """Take staging slots if staged, prepare the conversion, post the reads; True if it converts."""
        job.pairs = self._reads.blocks(job, mode)  # staged and direct reads pair blocks alike
        pool = slots = src = staged = None
        layers, blocks = len(caches.layers), job.pairs.count
        fmt = job.peer.plan.remote
        by_name = self._config().pull_mode == "staged"  # else auto's promise: read, direct if need be
        if mode == "staged" and not by_name:
            mode = self._fitting_mode(job, fmt.page_bytes, layers * blocks)
        if mode == "staged":
            if self._staging is None:
                raise Refused("pull_mode", "staged reads need a staging pool (staging_bytes = 0)")
            try:
                staged = await self._take_span(job, fmt, layers, job.pairs.remote)
            except PoolTooSmall as exc:  # slots kept out meanwhile (while it waited) left it no room
                self._log_kept_out(job, exc, "refused" if by_name else "read direct")
                if by_name:
                    raise
                mode = "direct"
            else:
                if staged.waited is not None:
                    self._metrics.gap_span_waited(staged.waited)
                pool, slots, job.slots = staged.pool, staged.slots, staged.run
                src = self._staging.source(job.slots, caches.page_format, layers, staged.width)
        self._metrics.read_mode(mode)
        layer_groups = layer_groups_for(layer_groups, layers * blocks * fmt.page_bytes)
        converting = bool(job.peer.plan.convert and blocks)
        if converting:
            self._conversions.begin(job, src, job.peer.plan, None if staged is None else staged.source_index)
        gaps = None if staged is None else staged.gaps
        inline = self._inline(job, mode, layers)
        await self._reads.post(job, mode, layer_groups, pool, slots, gaps, inline=inline)
        if staged is not None:
            job.gap_bytes = staged.gap_bytes(fmt.page_bytes)
        return converting

    def _fitting_mode(self, job: Job, page_bytes: int, slots: int) -> ReadMode:
        """Staged, unless the pool could never hold the request (the whole pool, or what can still come free
        around slots kept out): then direct (slow, but read), as auto promises. Only ``pull_mode =
        "staged"``, asked for by name, refuses such a request."""
        assert self._staging is not None
        if self._staging.holds(page_bytes, slots):
            return "staged"
        if self._staging.kept_out:
            self._log_kept_out(job, None, "read direct")
            return "direct"
        self._ratelog.log(
            "staging_bytes", logging.WARNING,
            "pull %s read direct: it needs %d staging slots of %d bytes, the pool (staging_bytes %d) holds "
            "%d; raise staging_bytes to read requests this long staged",
            job.req_id, slots, page_bytes, self._staging.nbytes, self._staging.nbytes // page_bytes,
        )
        return "direct"

    def _log_kept_out(self, job: Job, exc: PoolTooSmall | None, what: str) -> None:
        """Say (rate-limited) that a pull was refused or read direct because slots kept out of the pool (a
        read that could not be stopped may still write them) leave it no room."""
        assert self._staging is not None
        if exc is not None and not exc.kept_out:
            return
        self._ratelog.log(
            "staging_kept_out", logging.WARNING,
            "pull %s %s: %d staging slots are held by a read that could not be stopped, lent to no pull "
            "until NIXL releases it; the rest of the pool cannot hold this pull (a restart frees them)",
            job.req_id, what, self._staging.kept_out,
        )

    def _inline(self, job: Job, mode: ReadMode, layers: int) -> bool:
        """Post on the loop (config ``inline_post_max_descriptors``): a short staged read, the daemon's only
        pull, from a prefill of this decoder's TP (a head-sliced read posts a descriptor per slice)."""
        limit = self._config().inline_post_limit
        if not limit or mode != "staged" or len(self._jobs) != 1:
            return False
        if len(job.peer.peers) != 1 or job.msg.remote_tp_size != job.session.tp_size:
            return False
        return staged_descriptors(job.pairs.remote, layers) <= limit

    async def _take_span(self, job: Job, fmt: PageFormat, layers: int, remote: np.ndarray) -> Staged:
        """The job's staging slots in remote-address order, with the gaps worth reading (config). ``remote``:
        the remote kernel blocks its read pairs with the local ones (checked by the port's pairing)."""
        cfg, msg, peers = self._config(), job.msg, job.peer.peers
        # A head-sliced read (unequal TP) reads only the request's own pages: no gaps through its slices.
        same_tp = len(peers) == 1 and msg.remote_tp_size == job.session.tp_size
        cost = gap_cost(cfg, peers[0]) if same_tp else None
        return await self._staging.take_span(fmt, layers, remote, cost, cfg.gap_pool_share)

    # -- the way out

    async def _run(self, job: Job) -> None:
        try:
            ending = await self._path(job)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            ending = job.stop or Ending(Outcome.FAILED, "cancelled")
        except Refused as exc:
            ending = Ending(Outcome.REFUSED, str(exc), exc.field)
        except PeerLost as exc:
            for entry in job.peer_entries:
                self._peers.drop(entry)
            ending = Ending(Outcome.FAILED, str(exc))
        except Exception as exc:  # noqa: BLE001 - every failure becomes a Done(ok=False)
            if not isinstance(exc, Failed):
                log.warning("pull %s failed: %s: %s", job.req_id, type(exc).__name__, exc)
            ending = Ending(Outcome.FAILED, reason_of(exc), getattr(exc, "field", None))
        finally:
            job.settled = True
        ending.safe = await self._quiesce(job)
        self._answer(job, ending)

    def _cancelled_before_start(self, job: Job, task: asyncio.Task) -> None:
        """A task cancelled before its first step never ran ``_run``: answer its job here."""
        if task.cancelled() and self._jobs.is_current(job) and not job.settled:
            job.settled = True
            ending = job.stop or Ending(Outcome.FAILED, "cancelled")

            async def settle() -> None:
                ending.safe = await self._quiesce(job)
                self._answer(job, ending)

            self._spawn(settle())

    async def _quiesce(self, job: Job) -> bool:
        """Make sure nothing can still write into the job's blocks; tell the prefill what we will not read."""
        safe = True
        rid = job.msg.remote_request_id
        # first: a mapped conversion reads the prefill's blocks until its event, so it must end before the
        # prefill is told it may reuse them (staged and direct ones read only our own memory)
        await self._conversions.settle(job)
        if job.read is not None:
            safe = await self._reads.stop(job)
        elif job.peer is not None:
            # no read posted (a mapped pull, or one stopped before its post): still let the prefill free the
            # blocks, right after the answer (which need not wait for NIXL's send), before its peer may go
            self._peers.notify_soon(job.peer, rid, job.peer_entries)
        elif job.peer_entries:
            # stopped during the handshakes, or after they ended but before this job resumed from them
            for entry in job.peer_entries:
                self._peers.notify_when_admitted(entry, rid)
        else:
            # stopped or refused before its handshake began: the prefill holds the blocks for its lease, so
            # tell it through a cached handshake, or (unless shutting down) one made just for this
            caches = None if self._stopping() else self._caches.current
            for target in _targets(job, refuse=False):
                self._peers.notify_unread(target, caches, rid)
        return safe

    def _answer(self, job: Job, ending: Ending) -> None:
        """Answer the job exactly once and release what it held."""
        if not self._jobs.retire(job):
            return
        self._metrics.in_flight.set(len(self._jobs))
        now = time.monotonic()
        job.enter(Stage.DONE, now)
        kept = None  # staging slots kept out until the read's handles are all released
        if job.slots is not None and self._staging is not None:
            if ending.safe:
                self._staging.give(job.slots)
            else:  # a READ into them could not be stopped: never lend them again while it may write
                log.error("pull %s: staging slots %s kept out of use (a transfer could not be stopped)",
                          job.req_id, job.slots)
                kept = job.slots
                self._staging.keep_out(kept)
            job.slots = None
        caches, entries, read = job.caches, job.peer_entries, job.read
        job.caches, job.peer_entries = None, []
        staging = self._staging

        def let_go() -> None:
            """After the read's handles are released: only then may its caches or peers go."""
            written_late = read is not None and bool(read.handles)  # NIXL kept some: they may still write
            if caches is not None:
                if written_late:
                    caches.written_late = True
                caches.users -= 1
            if kept is not None and staging is not None and not written_late:
                # every transfer ended and was released (the rule ``Reads.stop`` calls safe): none writes
                log.warning("pull %s: staging slots %s back in use (its transfers were released after all)",
                            job.req_id, kept)
                staging.let_in(kept)
            for entry in entries:
                self._peers.release(entry)

        self._leases.forget(job.msg.remote_request_id)
        timings = {k: v for k, v in job.timings.items() if k != Stage.DONE.value}
        timings["end_to_end"] = now - job.received
        if job.msg.sent_at_ns:  # the shim's send time: one host, one monotonic clock
            timings["delivery"] = max(0.0, job.received - job.msg.sent_at_ns / 1e9)
        if job.abort_envelope is not None:
            ending.outcome = Outcome.ABORTED
        # Counted before the answer goes out, so whoever holds the answer sees it counted. Only refusals: a
        # failure's error may name a field too (the NIXL layer's do), and an aborted pull was not refused.
        if ending.outcome is Outcome.REFUSED and ending.field:
            self._metrics.refused(ending.field)
        if ending.outcome is Outcome.REFUSED:
            self._ratelog.log(
                f"refused:{ending.field}", logging.INFO, "pull %s refused: %s", job.req_id, ending.reason
            )
        self._metrics.answered(ending.outcome.value)
        if ending.outcome is Outcome.OK and (job.read is not None or job.mapped_bytes):
            # the read's bytes include gap blocks (other requests' KV): counted on their own
            nbytes = job.mapped_bytes if job.read is None else getattr(job.read, "nbytes", 0)
            self._metrics.bytes_pulled.inc(nbytes - job.gap_bytes)
            self._metrics.gap_bytes_read.inc(job.gap_bytes)
        if not ending.safe:
            self._unsafe[job.req_id] = None
            while len(self._unsafe) > UNSAFE_REMEMBERED:
                self._unsafe.popitem(last=False)
        elif self._unsafe:
            self._unsafe.pop(job.req_id, None)
        if job.abort_envelope is not None:
            self._send(
                job.abort_envelope,
                p.Aborted(
                    req_id=job.req_id,
                    safe=ending.safe,
                    reason=None if ending.safe else "transfers not released",
                ),
            )
        else:
            ok = ending.outcome is Outcome.OK
            reason = ending.reason
            if not ending.safe:
                reason = f"{reason}; blocks unsafe: a transfer could not be stopped"
            t0 = time.monotonic()
            self._send(
                job.envelope,
                p.Done(req_id=job.req_id, ok=ok, reason=None if ok else reason, timings=timings,
                       safe=ending.safe),
            )
            timings["signal"] = time.monotonic() - t0
        self._reads.release(job, let_go)
        self._metrics.observe(timings)
        log.debug("pull %s: %s %s %s", job.req_id, ending.outcome.value, ending.reason or "", timings)


def _targets(job: Job, refuse: bool = True) -> list[PeerTarget]:
    """The prefill ranks the job reads (vLLM's TP mapping); unless ``refuse`` is False, a TP ratio that does
    not divide raises Refused naming remote_tp_size (then nothing is read, and no rank is named)."""
    return _read_targets(job.msg, job.session, refuse)


def _read_targets(msg: p.Pull, session: Session, refuse: bool) -> list[PeerTarget]:
    """``_targets`` of a Pull from ``session``."""
    ranks = read_ranks(local_tp=session.tp_size, local_rank=session.rank, remote_tp=msg.remote_tp_size)
    if not isinstance(ranks, tuple):
        if refuse:
            raise Refused(ranks.field, ranks.reason)
        return []
    return [
        PeerTarget(
            engine_id=msg.remote_engine_id,
            tp_rank=rank,
            host=msg.remote_host,
            port=msg.remote_port,
            generation=msg.remote_registration_generation,
            remote_tp=msg.remote_tp_size,
            local_tp=session.tp_size,
            local_rank=session.rank,
        )
        for rank in ranks
    ]


def _ranks(job: Job) -> list[tuple[str, int]]:
    """The prefill ranks the job reads, (engine id, rank): each holds its blocks on a lease of its own."""
    return [entry.key for entry in job.peer_entries]


def _admitted(handshakes: list[asyncio.Task]) -> tuple[Any, ...] | None:
    """The peers when every handshake has already succeeded (the usual case: they are cached), else None.
    Awaiting finished handshakes would still cost the job a few loop turns behind every queued callback."""
    if all(h.done() and not h.cancelled() and h.exception() is None for h in handshakes):
        return tuple(h.result() for h in handshakes)
    return None


def _retrieve(fut: asyncio.Future) -> None:
    """Mark a finished future's exception as seen (asyncio logs unseen ones at ERROR when it is collected)."""
    if not fut.cancelled():
        fut.exception()
