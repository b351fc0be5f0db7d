"""Opt-in timing of the daemon loop's pieces: thread CPU per call of chosen functions, for benchmarks.

With config ``loop_pieces = "<path>"`` (``--set loop_pieces=...``, ``KV_SIDECAR_LOOP_PIECES``; in ``bench
e2e`` ``--daemon-set loop_pieces=...``), ``kv-sidecar serve`` wraps each function of ``PIECES`` before it
starts: every call adds its thread's CPU time (``time.thread_time``) and its wall time to that piece, and
``{piece: {"p50_us", "p90_us", "max_us", "wall_p50_us", ..., "n", "calls"}}`` goes to ``<path>`` every
``DUMP_EVERY_S`` and at exit (the latest ``KEEP`` samples of each). A thread of its own writes it: sorting 25
pieces' samples took 130 ms on the 2-core VM, and until 2026-12-05 that ran every 2 s inside whichever timed
call came next, most often on the loop (the thread still holds the GIL for one piece's sort at a time). Wall
well above CPU means the call waited (for the GIL, a lock, the device). A coroutine's piece has wall time
only: its CPU is spread over the loop's other work. A piece includes what it calls, so ``launch`` holds the
``launch.*`` pieces (``launch.prep`` holds the checks, take and fill of a launch made ready while its bytes
were on their way). Each wrapped call costs four clock reads and two appends (about 1 µs on the 2-core CI VM,
more on a slower host), so compare only runs that both had pieces on. ``bench e2e`` starts one daemon per read
mode, each writing the same file: time one mode per run.

The garbage collector's pauses are pieces too (``gc.gen0`` .. ``gc.gen2``, from ``gc.callbacks``: whichever
thread allocated waits that long). Each call of a function (not of a coroutine: it waits, it does not hold the
loop) or collection that took ``slow_s`` (config ``loop_pieces_slow_us``, default ``SLOW_S``) or more is also
kept one by one (the latest ``KEEP_SLOW``), with when it began
(``time.perf_counter``, CLOCK_MONOTONIC on Linux like ``bench e2e``'s timelines) and its thread, in ``<path>``
with ``.slow.json`` for ``.json`` (written at exit only): what held the loop while a Pull waited. Unset,
nothing is wrapped.
"""

from __future__ import annotations

import atexit
import functools
import gc
import importlib
import inspect
import json
import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from sidecar.ops.config import Config

log = logging.getLogger("kv_sidecar.pieces")

DUMP_EVERY_S = 10.0  # the file is rewritten this often (and at exit)
KEEP = 20_000  # latest samples kept per piece (the busy poll passes many times a second)
SLOW_S = Config().loop_pieces_slow_us / 1e6  # calls this long or more are kept one by one too (the default)
KEEP_SLOW = 50_000

# piece -> "module:attribute path"; names a module imported from another are patched where they are used
PIECES = {
    "receipt": "sidecar.daemon.router:Router._on_completion_request",
    "pairing": "sidecar.daemon.reads:Reads.blocks",
    "launch.prep": "sidecar.daemon.conversion:Conversions.prepare",
    "launch": "sidecar.daemon.conversion:Conversions._launch",
    "launch.ids": "sidecar.convert.graphs:launch_ids",
    "launch.source": "sidecar.convert.graphs:GraphLaunches._source",
    "launch.rows": "sidecar.convert.graphs:launch_src_rows",
    "launch.take": "sidecar.convert.graphs:GraphLaunches._take",
    "launch.fill": "sidecar.convert.graphs:fill",
    # a graph launch's queueing: the replay and the event after it, once its bytes landed (or, with
    # conversion_gates, ahead of them behind a gate); torch's methods: every replay and record, any caller
    "launch.fire": "sidecar.convert.graphs:GraphLaunches._fire",
    "launch.replay": "torch.cuda.graphs:CUDAGraph.replay",
    "cuda.record": "torch.cuda.streams:Event.record",
    "answer": "sidecar.daemon.pipeline:Pipeline._answer",
    "notify": "sidecar.daemon.peers:Peers.notify",
    "poll": "sidecar.daemon.polling:Poller.run_pass",
    "poll.check": "sidecar.daemon.reads:Reads._check",  # NIXL's state of every read in flight (UCX progress)
    "poll.notify": "sidecar.daemon.reads:Reads._notify",  # a finished read's notification to its prefill
    # the transfer stage on the loop (coroutines: wall time only): the whole post, its staging span, the
    # conversion's set-up, the wait for the poster thread (queue, its work, the way back), the read's wait
    "transfer.post": "sidecar.daemon.pipeline:Pipeline._post",
    "transfer.span": "sidecar.daemon.pipeline:Pipeline._take_span",
    "transfer.begin": "sidecar.daemon.conversion:Conversions.begin",
    "transfer.poster": "sidecar.daemon.reads:Reads.post",
    "transfer.wait": "sidecar.daemon.reads:Reads.wait",
    # on the poster thread: the post, its descriptors, NIXL's make and transfer()
    "post": "sidecar.daemon.reads:Reads._post_now",
    "post.table": "sidecar.nixl.reads:NixlReads.table",
    "post.nixl": "sidecar.nixl.reads:NixlReads._post",
}


def resolve(target: str) -> tuple[Any, str, Callable[..., Any]]:
    """``"module:A.b"`` as (the object holding ``b``, ``"b"``, the function); ImportError or AttributeError
    when it does not exist (a renamed function must fail loudly, not time nothing)."""
    module, _, path = target.partition(":")
    owner: Any = importlib.import_module(module)
    *parents, name = path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    return owner, name, getattr(owner, name)


class Pieces:
    """The samples of each piece, and the file they are written to."""

    def __init__(self, path: str, slow_s: float = SLOW_S) -> None:
        self.path = path
        self.slow_s = slow_s
        self.samples: dict[str, deque[float]] = {}
        self.walls: dict[str, deque[float]] = {}
        self.calls: dict[str, int] = {}
        self.slow: deque[dict[str, Any]] = deque(maxlen=KEEP_SLOW)
        self._lock = threading.Lock()
        self._failed = False
        self._stop = threading.Event()
        self._writer: threading.Thread | None = None

    def add(
        self, piece: str, seconds: float | None, wall: float | None = None, began: float | None = None
    ) -> None:
        """One call's thread CPU (None for a coroutine) and wall time, in seconds; ``began``: its start
        (``time.perf_counter``), to keep it one by one when it took ``slow_s`` or more."""
        if began is not None and wall is not None and wall >= self.slow_s:
            self.slow.append({
                "piece": piece,
                "began_s": round(began, 6),
                "wall_us": round(wall * 1e6, 1),
                "cpu_us": None if seconds is None else round(seconds * 1e6, 1),
                "thread": threading.current_thread().name,
            })
        for kept, value in ((self.samples, seconds), (self.walls, wall)):
            if value is not None:
                found = kept.get(piece)
                if found is None:
                    found = kept[piece] = deque(maxlen=KEEP)
                found.append(value)
        self.calls[piece] = self.calls.get(piece, 0) + 1

    def start(self) -> None:
        """Write the file every ``DUMP_EVERY_S`` from a daemon thread until ``stop``."""
        self._writer = threading.Thread(target=self._dump_every, name="kv-sidecar-pieces", daemon=True)
        self._writer.start()

    def stop(self) -> None:
        """End the writing thread, after the write in progress if any."""
        self._stop.set()
        if self._writer is not None:
            self._writer.join(timeout=5.0)

    def _dump_every(self) -> None:
        while not self._stop.wait(DUMP_EVERY_S):
            # the summary only: encoding up to KEEP_SLOW slow calls holds the GIL for tens of ms, a stall of
            # the loop no piece would show; they are written at exit
            self.dump(slow=False)

    def summary(self) -> dict[str, dict[str, float]]:
        """p50 / p90 / max of each piece's kept samples (CPU, and wall where timed; the max names a piece that
        stalls the loop now and then), their count ``n`` and all its ``calls``."""
        out: dict[str, dict[str, float]] = {}
        for prefix, kept in (("", self.samples), ("wall_", self.walls)):
            for piece, values in sorted(list(kept.items())):  # list(): a snapshot (other threads add)
                ordered = sorted(list(values))
                row = out.setdefault(piece, {})
                row[prefix + "p50_us"] = round(statistics.median(ordered) * 1e6, 2)
                row[prefix + "p90_us"] = round(ordered[int(0.9 * (len(ordered) - 1))] * 1e6, 2)
                row[prefix + "max_us"] = round(ordered[-1] * 1e6, 2)
                row["n"] = len(ordered)
                row["calls"] = self.calls.get(piece, len(ordered))
        return out

    @property
    def slow_path(self) -> str:
        """Where the slow calls go: ``path`` with ``.slow.json`` for its ``.json`` (or added)."""
        stem = self.path[: -len(".json")] if self.path.endswith(".json") else self.path
        return stem + ".slow.json"

    def dump(self, slow: bool = True) -> None:
        """Write the summary and (``slow``) the slow calls; a file that cannot be written is logged once and
        never fails a timed call."""
        try:
            with self._lock:
                with open(self.path, "w") as f:
                    json.dump(self.summary(), f, indent=1)
                if slow:
                    with open(self.slow_path, "w") as f:
                        json.dump(list(self.slow), f)
        except OSError as exc:
            if not self._failed:
                log.warning("loop_pieces: cannot write %s: %s", self.path, exc)
            self._failed = True

    def wrap(self, piece: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                w0 = time.perf_counter()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    self.add(piece, None, time.perf_counter() - w0)

            return timed_async

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0, w0 = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(piece, time.thread_time() - t0, time.perf_counter() - w0, w0)

        return timed


def time_collections(timing: Pieces, serving_only: bool = True) -> Callable[[str, dict[str, Any]], None]:
    """A ``gc.callbacks`` entry that adds each collection's pause as piece ``gc.gen<generation>`` (returned
    so a test can remove it). A pause stops the thread that triggered it, and with the GIL every other.
    ``serving_only``: only once the daemon has frozen its start-up objects (``gc.freeze``), so its one full
    collect at start-up (tens of ms) is not taken for a pause while serving."""
    started: dict[int, tuple[float, float]] = {}  # thread id -> (thread CPU, wall) at the collection's start
    frozen = [not serving_only]

    def on_collection(phase: str, info: dict[str, Any]) -> None:
        me = threading.get_ident()
        if not frozen[0]:
            # asked only until the freeze: it walks the frozen objects' list, 4-8 ms on a daemon's heap
            frozen[0] = gc.get_freeze_count() > 0
            if not frozen[0]:
                return
        if phase == "start":
            started[me] = (time.thread_time(), time.perf_counter())
        elif me in started:
            t0, w0 = started.pop(me)
            timing.add(f"gc.gen{info['generation']}", time.thread_time() - t0, time.perf_counter() - w0, w0)

    gc.callbacks.append(on_collection)
    return on_collection


def install(path: str, pieces: dict[str, str] = PIECES, slow_s: float = SLOW_S) -> Pieces:
    """Wrap every function of ``pieces``; the samples go to ``path``, calls of ``slow_s`` or more one by one
    to its ``.slow.json`` too (see the module's docstring)."""
    timing = Pieces(path, slow_s)
    for piece, target in pieces.items():
        owner, name, fn = resolve(target)
        wrapped = timing.wrap(piece, fn)
        if isinstance(inspect.getattr_static(owner, name), staticmethod):
            wrapped = staticmethod(wrapped)  # else the class would pass itself as the first argument
        setattr(owner, name, wrapped)
    time_collections(timing)
    timing.start()
    atexit.register(timing.dump)
    return timing
