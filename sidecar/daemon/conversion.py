"""Conversion: a job's landed layer groups rewritten into the decoder's format, off the event loop.

On a GPU each group is queued on the daemon's own stream (never the decoder's) and the job waits for the
event after its last group: ``poll``, run by the daemon's ``Poller``, queries the events in flight (no
thread blocked in ``synchronize``, no executor hop back to the loop). On the CPU twin each group runs in
one worker thread, the twin's "stream". Either way a job is answered only once every conversion it started
is over, failed ones included: a group that failed must not end the wait while another still writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sidecar.convert.checks import checked_ids
from sidecar.convert.launch import ConversionLimits, convert_blocks, launch_gpu, make_stream
from sidecar.daemon.errors import Failed, reason_of
from sidecar.daemon.jobs import Job
from sidecar.wire.formats import Plan

log = logging.getLogger("kv_sidecar.conversion")

GATES = 256  # gates of the daemon (a job's layer groups take one each until their work has run)
GATE_STREAMS = 8
# A loop silent this long while launches wait behind its gates is taken to be stuck in a host call that waits
# for the device, and so for them (``Gates``); far above any pass of a working loop.
GATE_STALL_S = 5.0
GUARD_TICK_S = 0.25  # how often the gate guard looks at the loop's last tick while gates are closed


def reencode_planes(caches: Any, plan: Plan) -> Any:
    """The caches' planes with the fp8 e4m3fn -> e4m3fnuz table of this pairing's scales (one per pairing,
    kept with the caches: checking planes and building a table is registration-time work)."""
    from sidecar.convert import PlaneSet
    from sidecar.wire.fp8 import pair_table

    r, lo = plan.remote, plan.local
    key = (r.k_scale, lo.k_scale, r.v_scale, lo.v_scale)
    found = caches.reencode_sets.get(key)
    if found is None:
        found = caches.reencode_sets[key] = PlaneSet(
            caches.k_planes,
            caches.v_planes,
            num_heads=lo.num_heads,
            block_size=lo.block_size,
            head_size=lo.head_size,
            lut=pair_table(*key),
        )
    return found


@dataclass(eq=False)
class Gated:
    """A group's launch queued on a gate stream behind a closed gate (``sidecar.convert.gates``)."""

    prepared: Any  # the graph launch (``Prepared``): disarmed if its bytes never land
    slot: int  # its gate
    event: Any  # recorded after it, behind the gate
    taking: int = 0  # which taking of the slot (``Gates.taking``)


@dataclass(eq=False)
class JobConversion:
    """What one job's conversion has started."""

    src: Any  # staged: the job's slots as [layers, width, page]; None: convert in place
    src_index: Any = None  # staged: block i's row in ``src`` (slots in remote order, gap rows between)
    planes: Any = None  # a PlaneSet with an fp8 re-encode table; None: the caches' own
    counts: list[Any] = field(default_factory=list)  # re-encode (saturated, NaN) counts per launch
    groups: list[asyncio.Future] = field(default_factory=list)  # CPU twin: one per layer group
    last_event: Any = None  # GPU: the event after the latest group (one stream, in order)
    prepared: dict[tuple[int, int], Any] = field(default_factory=dict)  # GPU: launches made ready, by group
    gated: dict[tuple[int, int], Gated] = field(default_factory=dict)  # GPU: queued behind closed gates
    opened: list[Gated] = field(default_factory=list)  # GPU: gated launches let go (landed or disarmed)
    launched: set[tuple[int, int]] = field(default_factory=set)  # groups launched at landing
    layers: int = 0  # layers started
    ids: Any = None  # GPU graph launches: the job's local ids as ``CheckedIds``, checked once for all groups
    all_done: asyncio.Future | None = None
    forced: bool = False  # a gated launch was let run disarmed by the gate guard: the job must fail


class Conversions:
    """The daemon's conversion stream (GPU) or worker thread (CPU)."""

    def __init__(
        self,
        gpu: int | None,
        limits: ConversionLimits | None = None,
        on_reencode: Callable[[int, int], None] | None = None,
        wake: Callable[[], None] = lambda: None,
        graphs: Callable[[], bool] = lambda: False,
        on_launch: Callable[[str], None] = lambda path: None,
        gates: Callable[[], bool] = lambda: False,
        on_forced: Callable[[int], None] = lambda launches: None,
        loop_seen: Callable[[], float] = time.monotonic,
    ) -> None:
        """``graphs``: whether launches may replay CUDA graphs (config ``conversion_graphs``);
        ``on_launch``: told each GPU launch's path ("gated", "graph" or "ordinary"); ``gates``: whether
        graph launches made ready ahead of their bytes are queued behind gates (config
        ``conversion_gates``), so that landing only opens them; ``on_forced``: told how many gated launches
        the gate guard let go (from its thread); ``loop_seen``: when the event loop last ran (the daemon's
        ``Health`` tick; the default, now, never looks stuck)."""
        self._gpu = gpu
        self._graphs = graphs
        self._gated = gates
        self._gates: Any = None  # ``Gates`` (GPU, where the driver has stream memory waits)
        self._gate_streams: list[Any] = []
        self._next_gate_stream = 0
        self._gates_tried = False
        self._holding: dict[int, Gated] = {}  # slot -> the launch behind that closed gate (guard reads it)
        self._loop_seen = loop_seen
        self._guard: threading.Thread | None = None
        self._guard_stop = threading.Event()
        self._on_launch = on_launch
        self._on_forced = on_forced
        self._on_reencode = on_reencode
        self._wake = wake
        self.limits = limits or ConversionLimits()
        self._stream: Any = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kv-sidecar-convert")
        self._events: list[tuple[Any, asyncio.Future]] = []  # GPU events in flight, with their waits

    def watch(self, event: Any) -> asyncio.Future:
        """A future that ends when ``event.query()`` says the work before it is done (seen by ``poll``)."""
        fut = asyncio.get_running_loop().create_future()
        self._events.append((event, fut))
        self._wake()
        return fut

    def poll(self, now: float) -> tuple[bool, bool]:
        """One pass over the events in flight: (did one end, is one still in flight)."""
        if not self._events:
            return False, False
        left: list[tuple[Any, asyncio.Future]] = []
        for event, fut in self._events:
            if fut.done():
                continue
            try:
                finished = event.query()
            except Exception as exc:  # noqa: BLE001 - a CUDA error fails the job that waits, not the loop
                fut.set_exception(exc)
                continue
            if finished:
                fut.set_result(None)
            else:
                left.append((event, fut))
        changed = len(left) != len(self._events)
        self._events = left
        return changed, bool(left)

    def fence(self) -> Any:
        """An event recorded now on the conversion stream, after every conversion launched on it so far (a
        mapped prefill's pages are read only there: never behind a gate); None on the CPU twin. Callable
        from any thread."""
        if self._stream is None:
            return None
        import torch

        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    @property
    def on_gpu(self) -> bool:
        """Whether conversions run on a GPU stream (else the CPU twin's worker thread)."""
        return self._stream is not None

    def make_stream(self) -> None:
        """Create the GPU stream (call in a worker thread at start; nothing to do on the CPU twin)."""
        if self._gpu is not None:
            self._stream = make_stream(self._gpu, self.limits)
            if self._gated():
                self._open_gates()

    def _open_gates(self) -> None:
        """The gates and their streams, once (at start, or when config ``conversion_gates`` is first on): one
        job's groups share a stream, in order; jobs take them in turn, so a job whose bytes are late holds
        back few others. Without stream memory waits (a ROCm host, an old driver): no gates, a warning."""
        from sidecar.convert.gates import Gates, GatesUnavailable

        self._gates_tried = True
        try:
            self._gates = Gates(GATES)
        except GatesUnavailable as exc:
            log.warning("conversion gates off: %s; launches are queued when their bytes land", exc)
            return
        self._gate_streams = [make_stream(self._gpu, self.limits) for _ in range(GATE_STREAMS)]
        if os.environ.get("CUDA_MODULE_LOADING", "").upper() != "EAGER":  # torch sets LAZY if unset
            log.warning(
                "conversion gates with lazy CUDA module loading: a kernel's first launch while a gate is "
                "closed makes later work on every stream of this process wait for that gate (a read's copies "
                "too: its pull would stall until it times out); set CUDA_MODULE_LOADING=EAGER in the "
                "daemon's environment"
            )

    def begin(self, job: Job, src: Any, plan: Plan, src_index: Any = None) -> None:
        """The job will convert what it reads (call before its first layer group can land)."""
        planes = None
        if plan.reencode is not None:
            planes = reencode_planes(job.caches, plan)
        job.conversion = JobConversion(src=src, planes=planes, src_index=src_index)

    def prepare(self, job: Job, groups: list[tuple[int, int]]) -> None:
        """While the job's layer groups still read: make each one's graph launch ready (``GraphLaunches.
        prepare``), so that when it lands only its replay is left to do. Where a group's launch cannot be
        made ready (not a graph launch, no graph to hold), it is built when the group lands. With config
        ``conversion_gates`` a launch made ready is also queued behind a gate: landing only opens it."""
        conv: JobConversion | None = job.conversion
        if conv is None or job.caches is None or not self._graph_launch(conv):
            return
        t0 = time.perf_counter()
        stream = self._gate_stream()
        try:
            graphs = self._graph_launches(job.caches)
            for first, last in groups:
                if (first, last) in conv.launched:  # landed before this ran: launched already
                    continue
                src = self._group_source(conv, first, last)
                prepared = graphs.prepare(self._checked_ids(job), src, (first, last), conv.src_index)
                if prepared is None:
                    continue
                queued = None if stream is None else self._queue(prepared, stream)
                if queued is not None:
                    gated = Gated(prepared, queued[1], queued[0], self._gates.taking(queued[1]))
                    conv.gated[(first, last)] = gated
                    self._hold(gated)
                else:
                    conv.prepared[(first, last)] = prepared
        except Exception:  # noqa: BLE001 - the launch at landing meets the same error and fails the group
            log.debug("pull %s: launch not prepared", job.req_id, exc_info=True)
        job.timings["launch_prep"] = time.perf_counter() - t0

    def _queue(self, prepared: Any, stream: Any) -> tuple[Any, int] | None:
        """``prepared`` queued behind a gate, or None (then it stays made ready). A driver that refuses the
        gate's wait turns gates off for good, with a warning."""
        from sidecar.convert.gates import GatesUnavailable

        if not self._gate_streams:  # turned off by an earlier group's refusal
            return None
        try:
            return prepared.queue(stream, self._gates)
        except GatesUnavailable as exc:
            log.warning("conversion gates off: %s; launches are queued when their bytes land", exc)
            self._gate_streams = []
            return None

    def _hold(self, gated: Gated) -> None:
        """``gated``'s gate is closed: the guard watches it until ``_let_run`` (on the loop thread)."""
        self._holding[gated.slot] = gated
        if self._guard is None:
            self._guard = threading.Thread(target=self._guard_gates, name="kv-sidecar-gate-guard",
                                           daemon=True)
            self._guard.start()

    def _guard_gates(self) -> None:
        """The gate guard's thread: while gates are closed, let the held launches go (``force_stalled``) once
        the loop has not ticked for ``GATE_STALL_S``."""
        while not self._guard_stop.wait(GUARD_TICK_S):
            self.force_stalled(time.monotonic())

    def force_stalled(self, now: float) -> int:
        """If the loop has not run for ``GATE_STALL_S`` while launches wait behind gates, it is stuck in a
        host call that waits for the device, so for them, and nothing else would open their gates: point
        each away from the decoder's blocks and open its gate (``Gates.force``); their jobs then fail.
        Returns how many were let go. Runs on the guard's thread (no CUDA call: tables and gate words)."""
        if not self._holding:
            return 0
        stalled = now - self._loop_seen()
        if stalled < GATE_STALL_S:
            return 0
        held = list(self._holding.items())
        forced = sum(self._gates.force(slot, g.taking, g.prepared.disarm) for slot, g in held)
        if forced:
            self._on_forced(forced)
            log.error("the loop has not run for %.1f s with conversion launches behind gates: %d let run "
                      "disarmed (their pulls fail); a host call waited for the device (conversion_gates)",
                      stalled, forced)
        return forced

    def _gate_stream(self) -> Any:
        """The gate stream for the next job's launches, or None: gates off or unavailable."""
        if not self._gated() or not self.on_gpu:
            return None
        if not self._gates_tried:  # turned on after start (SIGHUP)
            self._open_gates()
        if not self._gate_streams:
            return None
        self._next_gate_stream = (self._next_gate_stream + 1) % len(self._gate_streams)
        return self._gate_streams[self._next_gate_stream]

    def _graph_launches(self, caches: Any) -> Any:
        """The caches' ``GraphLaunches`` (made at first use: it holds pinned and device tables, and graphs),
        told when this daemon's gates hold GPU work (then it captures and makes no graph)."""
        if caches.graphs is None:
            from sidecar.convert.graphs import GraphLaunches  # lazy: GPU only

            caches.graphs = GraphLaunches(caches.plane_set, held=self._gates_held)
        return caches.graphs

    @staticmethod
    def _checked_ids(job: Job) -> Any:
        """The job's local ids checked for its caches' planes, once (the pairing checked them at admission
        too; this is the converter's own check, the last before a kernel writes the decoder's blocks): each
        layer group's graph launch takes them as they are. Raises ValueError as ``launch_ids`` does."""
        conv: JobConversion = job.conversion
        if conv.ids is None:
            conv.ids = checked_ids(job.caches.plane_set.planes, job.pairs.local)
        return conv.ids

    def _gates_held(self) -> bool:
        """Whether GPU work waits behind a closed gate of this daemon's now."""
        return self._gates is not None and self._gates.closed > 0

    def _graph_launch(self, conv: JobConversion) -> bool:
        """Whether this conversion's launches may replay graphs (out of place or in place): on a GPU,
        unsliced, no re-encode, config ``conversion_graphs``."""
        return self.on_gpu and conv.planes is None and self.limits.unbounded and self._graphs()

    @staticmethod
    def _group_source(conv: JobConversion, first: int, last: int) -> Any:
        src = conv.src
        if src is not None and (first, last) != (0, src.shape[0]):
            src = src[first:last]  # a layer group (a whole source, mapped pages above all, is used as it is)
        return src

    def convert_group(self, job: Job, first: int, last: int) -> None:
        """Start converting layers [first, last) of a job whose reads of them are DONE."""
        conv: JobConversion | None = job.conversion
        if conv is None or job.caches is None:
            return
        src = self._group_source(conv, first, last)
        loop = asyncio.get_running_loop()
        try:
            if self._stream is None:
                done = loop.run_in_executor(self._executor, self._convert_cpu, job, src, first, last)
                conv.groups.append(done)
            else:
                self._launch(job, src, first, last)
        except Exception as exc:  # noqa: BLE001 - a launch that fails fails the request, not the loop
            if self._stream is not None:
                # What it queued before failing (a slice, a table's copy) still reads the source and writes
                # the blocks: the job's wait, hence its answer and the staging slots' return, covers it.
                with contextlib.suppress(Exception):
                    conv.last_event = self.fence()
            failed = loop.create_future()
            failed.set_exception(exc)
            conv.groups.append(failed)
            return
        conv.layers += last - first

    def _launch(self, job: Job, src: Any, first: int, last: int) -> None:
        """Queue a group's conversion on the GPU stream: replayed from a CUDA graph when it can be (unsliced,
        no re-encode, config ``conversion_graphs``), else built here; timed into the job's Done."""
        conv: JobConversion = job.conversion
        caches, ids, layers = job.caches, job.pairs.local, (first, last)
        t0, c0 = time.perf_counter(), time.thread_time()
        conv.launched.add(layers)
        gated = conv.gated.pop(layers, None)
        if gated is not None:  # queued already: its bytes are here, let it run
            self._let_run(conv, gated)
            self._on_launch("gated")
            self._timed(job, t0, c0)
            return
        event = None
        prepared = conv.prepared.pop(layers, None)
        if prepared is not None:
            event = prepared.fire(self._stream)
        elif self._graph_launch(conv):
            event = self._graph_launches(caches).launch(self._stream, self._checked_ids(job), src, layers,
                                                        conv.src_index)
        self._on_launch("graph" if event is not None else "ordinary")
        if event is None:  # not taken: sliced, re-encoding, a shape graphs do not take, or no graph free
            event = launch_gpu(self._stream, caches, ids, caches.page_format, src, layers, self.limits,
                               conv.planes, conv.counts, conv.src_index)
        conv.last_event = event
        self._timed(job, t0, c0)

    @staticmethod
    def _timed(job: Job, t0: float, c0: float) -> None:
        job.timings["launch"] = job.timings.get("launch", 0.0) + time.perf_counter() - t0
        # this thread's CPU time in the launch: far below "launch" means it waited (GIL, driver locks)
        job.timings["launch_cpu"] = job.timings.get("launch_cpu", 0.0) + time.thread_time() - c0

    def _convert_cpu(self, job: Job, src: Any, first: int, last: int) -> None:
        """The CPU twin's conversion of one group, in the worker thread: through the pairing's re-encode
        planes when it has them, its flagged counts kept for ``finish``."""
        conv: JobConversion = job.conversion
        got = convert_blocks(job.caches, job.pairs.local, job.caches.page_format, src, (first, last),
                             self.limits, conv.planes, conv.src_index)
        if got is not None:
            conv.counts.append(got)

    def done(self, job: Job) -> asyncio.Future | None:
        """One future for every conversion the job started (None if none); it never fails early."""
        conv: JobConversion | None = job.conversion
        if conv is None:
            return None
        if conv.all_done is None and (conv.groups or conv.last_event is not None or conv.opened):
            waits = list(conv.groups)
            if conv.last_event is not None:
                waits.append(self.watch(conv.last_event))
            conv.all_done = self._wait_for(waits, list(conv.opened))
        return conv.all_done

    def _wait_for(self, waits: list[asyncio.Future], gated: list[Gated]) -> asyncio.Future:
        """One future for ``waits`` and ``gated``'s events, each result in one flat list (errors returned,
        not raised); ``gated``'s gates are given back once it ends."""
        done = asyncio.gather(*waits, *(self.watch(g.event) for g in gated), return_exceptions=True)
        if gated:
            done.add_done_callback(lambda d: self._give_back_gates(gated, d))
        return done

    def _give_back_gates(self, gated: list[Gated], done: asyncio.Future) -> None:
        """``gated``'s gates, once the work behind them has run (not after a failed query of their events:
        it may not have). Only their own events count: another group's failed launch says nothing of the
        work behind these gates, and a gate never given back is out of use for good."""
        if done.cancelled() or any(isinstance(r, BaseException) for r in done.result()[-len(gated):]):
            return
        for g in gated:
            self._gates.give_back(g.slot)

    async def finish(self, job: Job, layers: int) -> None:
        """Wait for the job's conversion; fail unless every one of ``layers`` was converted."""
        done = self.done(job)
        results = await asyncio.shield(done) if done is not None else []
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise Failed(f"convert: {reason_of(errors[0])}") from errors[0]
        conv: JobConversion | None = job.conversion
        if conv is not None and conv.forced:
            raise Failed(f"convert: the daemon's loop stalled {GATE_STALL_S:g} s with this pull's launches "
                         "behind gates; they were let run disarmed (config conversion_gates)")
        if conv is not None and conv.counts and self._on_reencode is not None:
            saturated, nan = (int(v) for v in sum(c.cpu() for c in conv.counts).tolist())
            self._on_reencode(saturated, nan)
        converted = conv.layers if conv is not None else 0
        if converted != layers:
            raise Failed(f"convert: {converted} of {layers} layers were converted")

    async def settle(self, job: Job) -> None:
        """Wait until nothing the job started converting can still write (errors ignored); graph launches
        made ready for groups that never landed are let go unfired, and those queued behind gates are
        disarmed and let run (into the scratch block)."""
        conv: JobConversion | None = job.conversion
        made = conv is not None and conv.all_done is not None
        disarmed = self._drop_prepared(job)
        done = self.done(job)
        waits = [done] if done is not None and not done.done() else []
        if disarmed and made:  # opened after the job's wait was made: that wait does not hold them
            waits.append(self._wait_for([], disarmed))
        for wait in waits:
            with contextlib.suppress(Exception):  # only the wait matters here
                await asyncio.shield(wait)

    def _drop_prepared(self, job: Job) -> list[Gated]:
        """Let go the job's prepared launches that were never fired, and open the gates of those queued
        whose bytes never landed, disarmed first (they then write only the scratch block); returns those."""
        conv: JobConversion | None = job.conversion
        if conv is None:
            return []
        for prepared in conv.prepared.values():
            prepared.drop()
        conv.prepared.clear()
        disarmed = list(conv.gated.values())
        for gated in disarmed:
            gated.prepared.disarm()
            self._let_run(conv, gated)
        conv.gated.clear()
        return disarmed

    def _let_run(self, conv: JobConversion, gated: Gated) -> None:
        """Open ``gated``'s gate; the job's wait then includes the work behind it. Where the guard forced it
        open first, that work ran disarmed: the job fails."""
        self._holding.pop(gated.slot, None)
        if not self._gates.open(gated.slot):
            conv.forced = True
        conv.opened.append(gated)

    def close(self) -> None:
        self._guard_stop.set()
        self._executor.shutdown(wait=True)
