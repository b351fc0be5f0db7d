"""Reads: posting a job's READs through the port, and the loop that polls them until they land.

Posting runs on one poster thread: NIXL's ``transfer()`` spends ~5-8 µs per descriptor with the GIL released
(``sidecar.bench.nixl_threads``), tens of ms for a scattered request, and on the loop every later Pull waited
behind it. The loop keeps receiving and planning Pulls meanwhile; a poll pass that finds the poster inside
the transport skips (the post itself moves UCX along) and the loop is woken when the post returns. A job
stopped while its post runs waits for the post, then stops what it posted (``post``), so nothing is written
after its answer. Aborts and the release of finished reads run on the poster thread too, and so do
notifications and heartbeats that find the transport busy (``Peers``, ``Leases``), a prefill's loading and
removal, and mappings: the loop never waits for a post. Those calls go ahead of the posts still queued (after
the one in progress), each kind in the order it was submitted, so a heartbeat or a new prefill's handshake
waits for one post at most, not for every request queued to post. One exception, config
``inline_post_max_descriptors``: a short staged read that is the daemon's only pull is posted on the loop
itself when the poster thread is idle and the transport free, since the two thread hand-offs would cost it
more than the post does.

``poll`` is one pass over every read in flight, run by the daemon's ``Poller`` (``polling.py``: hot while
reads are in flight, asleep when none is). A layer group seen DONE is handed to the conversion at once
(``on_landed``), so it converts while later groups still read; the prefill's notification of a finished read
goes out only after its last group's conversion was launched.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from sidecar.daemon.errors import Failed, PeerLost, Refused
from sidecar.daemon.jobs import Job
from sidecar.daemon.port import ReadMode, TransferPort
from sidecar.nixl.errors import RemoteDisconnected, RemoteRefused, TransferError
from sidecar.nixl.geometry import BlockPairs, GeometryError, StagingPool

log = logging.getLogger("kv_sidecar.reads")

# How long to wait for a stopped read's transfers to end (and be released) before calling its blocks unsafe.
# Under the shim's default grace (sidecar_grace_s, 5 s): a pull stopped at its deadline is then answered
# "blocks unsafe" before the shim gives up waiting and can only say "no answer".
RELEASE_GIVE_UP_S = 4.0
# A stopped job whose post has not returned this long after the stop is logged: its answer waits for the post
# (it may still write), and a post that never returns leaves the shim only its own deadline to go by.
POST_OVERDUE_S = 1.0
# How long after sending something on NIXL the progress loop keeps calling in (no progress thread).
PROGRESS_AFTER_SEND_S = 2.0


class Reads:
    """The reads in flight, and NIXL's progress when no progress thread drives it."""

    def __init__(
        self,
        port: TransferPort,
        wake: Callable[[], None],
        on_landed: Callable[[Job, int, int], None],
    ) -> None:
        self._port = port
        self._wake = wake
        self._on_landed = on_landed
        self._waiting: dict[Any, tuple[asyncio.Future, Job]] = {}  # read handle -> (its wait, its job)
        self._last_sent = 0.0
        self._sent_event: asyncio.Event | None = None
        # calls handed to the poster thread and returned from it; each counted by one thread only
        self._submitted = self._returned = 0
        # submitted (each with whether it is a post), handed over once this loop pass ends
        self._held_back: list[tuple[Callable[[], None], bool]] = []
        # handed over, not yet run: the poster thread takes any call before the next post
        self._calls: collections.deque[Callable[[], None]] = collections.deque()
        self._posts: collections.deque[Callable[[], None]] = collections.deque()
        self._call_began: float | None = None  # when the poster thread's call in progress began (None: idle)
        self._closed = False
        self._poster = ThreadPoolExecutor(
            1, thread_name_prefix="kv-sidecar-post", initializer=port.thread_init
        )

    def sent(self) -> None:
        """Something went out on NIXL (a notification, a heartbeat): keep UCX moving for a while."""
        self._last_sent = time.monotonic()
        if self._sent_event is not None:
            self._sent_event.set()

    def poster_busy_s(self) -> float:
        """How long the poster thread has been inside its call in progress (0.0 when idle). Read from any
        thread: /healthz's measure of a NIXL call that does not return."""
        began = self._call_began
        return 0.0 if began is None else max(0.0, time.monotonic() - began)

    def blocks(self, job: Job, mode: ReadMode) -> BlockPairs:
        """The checked kernel block pairs of the job's read (tail pairing, padding trimmed): the local blocks
        it writes and the remote blocks each reads. The post takes them from ``job.pairs``: once per job."""
        local_ids, remote_ids = job.id_arrays
        try:
            return self._port.blocks(
                job.peer,
                job.caches.destination,
                mode,
                local_ids,
                remote_ids,
                job.msg.remote_num_tokens,
            )
        except GeometryError as exc:
            raise Refused(exc.field, exc.reason) from None
        except RemoteRefused as exc:
            raise Refused(exc.field or "remote", exc.reason) from None

    async def post(
        self,
        job: Job,
        mode: ReadMode,
        layer_groups: int,
        pool: StagingPool | None,
        slots: np.ndarray | None,
        gaps: Any = None,
        *,
        inline: bool = False,
    ) -> None:
        """Post the job's READs on the poster thread (it must have its peer, caches, pairs and, when staged,
        its slots and gaps). Cancelled meanwhile (Abort, deadline, shutdown), it still waits for the post to
        return and keeps its read in ``job.read``, so ``stop`` can stop it before the job is answered.

        ``inline``: post here on the loop instead if the poster thread has nothing to do and the transport
        is free (a short read: two thread hand-offs cost more than its post)."""
        if inline and self._submitted == self._returned:
            with self._port.hold(blocking=False) as held:
                if held:
                    self._post_inline(job, mode, layer_groups, pool, slots, gaps)
                    return
        ran: list[float] = []  # when the poster thread began and ended this post
        submitted = time.monotonic()
        args = (ran, job, mode, layer_groups, pool, slots, gaps)
        fut = self._on_poster(self._post_timed, args, post=True)
        cancelled = False
        while True:
            try:
                job.read = await asyncio.shield(fut)
                break
            except asyncio.CancelledError:
                if not fut.done():
                    if not cancelled:
                        asyncio.get_running_loop().call_later(
                            POST_OVERDUE_S, _warn_if_posting, job, fut, ran, submitted
                        )
                    cancelled = True
                    continue  # the post goes on in its thread: wait for it, then stop what it posted
                cancelled = True
                if fut.cancelled():
                    raise
                error = fut.exception()
                # a post that failed in this pass still hands back what it had posted: its stop sees to it
                job.read = fut.result() if error is None else getattr(error, "read", None)
                break
            except Exception as exc:
                # What a failed post had posted is the job's read: its stop makes sure nothing still writes.
                job.read = getattr(exc, "read", None)
                if cancelled:  # a failed post told the prefill already; the stop's ending answers
                    break
                raise
        if len(ran) == 2:
            job.timings["poster_queue"] = ran[0] - submitted
            job.timings["poster"] = ran[1] - ran[0]
        if cancelled or job.read is None:  # None: stopped before its turn came, nothing posted
            raise asyncio.CancelledError

    def _post_inline(self, job: Job, *args: Any) -> None:
        """``post``'s work on the loop (``args`` as ``_post_now``'s after the job): nothing can cancel it
        midway, so only its outcome is handled."""
        began = time.monotonic()
        try:
            job.read = self._post_now(job, *args)
        except Exception as exc:
            job.read = getattr(exc, "read", None)  # what a failed post had posted: its stop sees to it
            raise
        finally:
            job.timings["poster_queue"] = 0.0
            job.timings["poster"] = time.monotonic() - began
        if job.read is None:  # stopped before it was posted: nothing was
            raise asyncio.CancelledError

    def on_poster(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """Run ``fn`` on the poster thread, after the call in progress and the calls (not posts) before it:
        a loop future of its result, settled in the one hop back that also wakes the poller (a pass that
        found the transport busy skipped the reads in flight). A call whose future was cancelled before its
        turn does not run."""
        return self._on_poster(fn, args)

    def _on_poster(self, fn: Callable[..., Any], args: tuple, post: bool = False) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def run() -> None:
            result = error = None
            if not fut.cancelled():  # pending -> done only: a stale read just runs a call nobody awaits
                self._call_began = time.monotonic()
                try:
                    result = fn(*args)
                except BaseException as exc:  # noqa: BLE001 - handed to whoever awaits the future
                    error = exc
                self._call_began = None
            self._back(loop, _settle, fut, result, error)

        self._submit(run, post)
        return fut

    def in_background(
        self, fn: Callable[..., Any], *args: Any, then: Callable[[], None] | None = None
    ) -> None:
        """Run ``fn`` on the poster thread as ``on_poster`` does, for calls nobody awaits (a release, a
        notification, an unmap): a failure is logged; ``then`` runs on the loop once ``fn`` has returned or
        failed."""
        loop = asyncio.get_running_loop()

        def run() -> None:
            self._call_began = time.monotonic()
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - nobody awaits this call: its failure is logged
                log.warning("poster thread (release, notify, unmap): %s: %s", type(exc).__name__, exc)
            self._call_began = None
            self._back(loop, then)

        self._submit(run)

    def _submit(self, run: Callable[[], None], post: bool = False) -> None:
        """Hand ``run`` to the poster thread (into the posts' queue if ``post``, else the calls'). Not
        ``run_in_executor``: its future chains to the executor's and comes back to the loop twice (130 more
        Python calls a staged pull, in bench/results ``loop-cpu-background-handoff-2026-12-05.json`` and
        ``loop-cpu-poster-futures-2026-12-05.json``), and a call it cancels before its turn never runs
        ``run``, so it is never counted as returned. Raises RuntimeError when the poster is shut down
        (nothing was handed over).

        Handed over once the callbacks the loop has ready have run (``_hand_over``), not at once: Pulls that
        came in together then all take their first step before the first post begins, where each one's
        Python waited for the GIL behind the post's (at staged 16k x 8 on an H100 the loop's pairing took
        0.39 ms wall at p90 for 0.13 ms of its CPU, ``loop-stalls-h100-2026-12-05.json``)."""
        if self._closed:
            raise RuntimeError("the poster thread is shut down")
        self._submitted += 1
        if not self._held_back:
            asyncio.get_running_loop().call_soon(self._hand_over)
        self._held_back.append((run, post))

    def _hand_over(self) -> None:
        """Give the poster thread what was submitted since the last hand-over, in order."""
        runs, self._held_back = self._held_back, []
        for run, post in runs:
            (self._posts if post else self._calls).append(run)
            self._poster.submit(self._next)

    def _next(self) -> None:
        """On the poster thread, one turn (one per hand-over): the oldest call waiting, else the oldest post.
        Only this thread takes from the queues."""
        (self._calls or self._posts).popleft()()

    def _back(self, loop: asyncio.AbstractEventLoop, then: Callable[..., None] | None, *args: Any) -> None:
        """On the poster thread, once a call is over: count it, and on the loop wake the poller, then
        ``then(*args)``."""
        self._returned += 1
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(self._returned_to_loop, then, args)

    def _returned_to_loop(self, then: Callable[..., None] | None, args: tuple) -> None:
        self._wake()
        if then is not None:
            then(*args)

    def _post_timed(self, ran: list[float], *args: Any) -> Any:
        ran.append(time.monotonic())
        try:
            return self._post_now(*args)
        finally:
            ran.append(time.monotonic())

    def _post_now(
        self,
        job: Job,
        mode: ReadMode,
        layer_groups: int,
        pool: StagingPool | None,
        slots: np.ndarray | None,
        gaps: Any,
    ) -> Any:
        """The post itself, on the poster thread; errors as the daemon's (Refused, PeerLost, Failed). None
        when the job was stopped while it waited behind other posts: then nothing is posted at all."""
        if job.stop is not None:
            return None
        msg = job.msg
        local_ids, remote_ids = job.id_arrays
        remaining = max(0.001, job.deadline - time.monotonic())
        try:
            return self._port.read(
                job.peer,
                job.caches.destination,
                mode,
                local_ids,
                remote_ids,
                msg.remote_request_id,
                layer_groups=layer_groups,
                timeout_s=remaining + 1.0,
                remote_num_tokens=msg.remote_num_tokens,
                pool=pool,
                slots=slots,
                gaps=gaps,
                pairs=job.pairs,
            )
        except GeometryError as exc:
            raise Refused(exc.field, exc.reason) from None
        except TransferError as exc:
            if isinstance(exc, RemoteRefused):
                err: Exception = Refused(exc.field or "remote", exc.reason)
            elif isinstance(exc, RemoteDisconnected):
                err = PeerLost(f"transfer: {exc}")
            else:
                err = Failed(f"transfer: {exc}")
            err.read = exc.read  # type: ignore[attr-defined]  # posted before it failed: post() keeps it
            raise err from None

    async def wait(self, job: Job) -> None:
        """Until every READ of the job is DONE (and the prefill notified)."""
        fut = asyncio.get_running_loop().create_future()
        self._waiting[job.read] = (fut, job)
        self._wake()
        try:
            await fut
        except RemoteDisconnected as exc:
            raise PeerLost(f"transfer: {exc}") from None
        except TransferError as exc:
            raise Failed(f"transfer: {exc}") from None

    async def stop(self, job: Job) -> bool:
        """Make sure the job's reads can no longer write; True when they cannot (else its blocks are unsafe).

        An unfinished read is cancelled (and the prefill notified); a finished one's handles are released
        after the answer, in ``release``."""
        fut, _ = self._waiting.pop(job.read, (None, None))
        if fut is not None and not fut.done():
            fut.cancel()
        if job.read.finished and (job.read.error is None or not job.read.handles):
            return True  # DONE (released after the answer), or failed with every handle released
        safe = await self.on_poster(self._port.abort, job.read)
        give_up = time.monotonic() + RELEASE_GIVE_UP_S
        while not safe and time.monotonic() < give_up:
            await asyncio.sleep(0.01)
            safe = await self.on_poster(self._port.abort, job.read)
        if not safe:
            log.error("pull %s: its transfers neither ended nor could be released within %g s; its blocks "
                      "are unsafe", job.req_id, RELEASE_GIVE_UP_S)
        return safe

    def release(self, job: Job, then: Callable[[], None]) -> None:
        """Release a finished read's handles on the poster thread (its notification went out with the last
        poll; releasing thousands of descriptors is work the answer need not wait for), then call ``then``
        on the loop: what the read used (caches, peers) may be deregistered or removed only after that."""
        read = job.read
        if read is None or not read.handles:
            then()
            return
        self.sent()
        try:
            self.in_background(self._release_now, job.req_id, read, then=then)
        except RuntimeError:  # the poster is closed (shutdown): release here, nothing else runs in NIXL now
            with contextlib.suppress(Exception):
                self._release_now(job.req_id, read)
            then()

    def _release_now(self, req_id: str, read: Any) -> None:
        if not self._port.release(read):
            log.warning("pull %s: some DONE transfers could not be released", req_id)

    def close(self) -> None:
        """Wait for the poster thread's last call (after every job was answered, before the port closes)."""
        self._closed = True
        self._hand_over()
        self._poster.shutdown(wait=True)

    def poll(self, now: float) -> tuple[bool, bool]:
        """One pass over the reads in flight: (did one land or end, is one still in flight). Skipped while
        the poster thread is inside the transport: the post's return wakes the poller. What landed is
        launched after the transport is let go, so a post waiting for it is not held up by launches."""
        if not self._waiting:
            return False, False
        with self._port.hold(blocking=False) as held:
            if not held:
                return False, False
            changed, seen = self._check(now)
        for read, fut, job, finished in seen:
            if read.landed and job.first_landed is None:
                job.first_landed = now
            try:
                while read.landed:
                    self._on_landed(job, *read.landed.pop(0))
            except Exception:  # noqa: BLE001 - an unlaunched group fails its job at the layer count
                log.exception("pull %s: launching a landed group", job.req_id)
            if finished:  # launched first, then the prefill is told it may free the blocks
                if job.first_landed is not None and len(read.layer_ranges) > 1:
                    # ~0 when the groups land together: then no conversion overlaps a later group's read
                    job.timings["landing_spread"] = now - job.first_landed
                self._notify(read)
                fut.set_result(None)
        return changed, bool(self._waiting)

    def _check(self, now: float) -> tuple[bool, list[tuple[Any, asyncio.Future, Job, bool]]]:
        """Ask the port about every read in flight (holding it): (changed, [(read, wait, job, finished)] of
        those with something landed or finished). Failed reads fail their wait here."""
        changed = False
        seen = []
        for read, (fut, job) in list(self._waiting.items()):
            if fut.done():
                self._waiting.pop(read, None)
                continue
            try:
                finished = self._port.poll(read, now, notify=False)
            except TransferError as exc:
                self._waiting.pop(read, None)
                fut.set_exception(exc)
                changed = True
                continue
            if read.landed or finished:
                changed = True
                seen.append((read, fut, job, finished))
            if finished:
                self._waiting.pop(read, None)
        return changed, seen

    def _notify(self, read: Any) -> None:
        """A finished read's notification: now, or after the post in progress (the loop does not wait)."""
        self.sent()
        with self._port.hold(blocking=False) as held:
            if held:
                self._port.notify_read(read)
                return
        try:
            self.in_background(self._port.notify_read, read)
        except RuntimeError:  # the poster is closed (shutdown): nothing else is in the transport now
            self._port.notify_read(read)

    async def progress_loop(self) -> None:
        """Without NIXL's progress thread, UCX moves only when we call in: for a while after the last
        notification or heartbeat, call in every few ms so nothing we sent waits in a queue; after that,
        sleep until something is sent (an idle daemon does not wake up here)."""
        self._sent_event = sent = asyncio.Event()
        while True:
            if time.monotonic() - self._last_sent > PROGRESS_AFTER_SEND_S:
                sent.clear()
                await sent.wait()
            await asyncio.sleep(0.005)
            try:
                with self._port.hold(blocking=False) as held:
                    if held:  # else a post is in progress, and moves UCX itself
                        self._port.progress()
            except Exception as exc:  # noqa: BLE001 - progress is best effort; errors surface on transfers
                log.debug("progress: %s", exc)


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """Give a poster call's outcome to its future, unless it was cancelled meanwhile."""
    if fut.done():
        return
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)


def _warn_if_posting(job: Job, fut: asyncio.Future, ran: list[float], submitted: float) -> None:
    """Say so when a stopped job's post is still out (``ran``: when the poster thread began it, if it has)."""
    if fut.done():
        return
    now = time.monotonic()
    if ran:
        where = f"in NIXL for {now - ran[0]:.1f} s"
    else:
        where = f"queued on the poster thread for {now - submitted:.1f} s"
    log.warning(
        "pull %s was stopped (%s) but its post is still %s: it is answered once the post returns",
        job.req_id,
        job.stop.reason if job.stop is not None else "cancelled",
        where,
    )
