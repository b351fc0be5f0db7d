"""Opt-in timing of the daemon loop's pieces: thread CPU per call of chosen functions, for benchmarks.

With config ``loop_pieces = "<path>"`` (``--set loop_pieces=...``, ``KV_SIDECAR_LOOP_PIECES``; in ``bench
e2e`` ``--daemon-set loop_pieces=...``), ``kv-sidecar serve`` wraps each function of ``PIECES`` before it
starts: every call adds its thread's CPU time (``time.thread_time``) to that piece, and ``{piece: {"p50_us",
"p90_us", "n", "calls"}}`` goes to ``<path>`` every ``DUMP_EVERY_S`` and at exit (the latest ``KEEP`` samples
of each). A piece includes what it calls, so ``launch`` holds the ``launch.*`` pieces. Each wrapped call costs
two clock reads and an append (0.7-0.8 µs on the 2-core CI VM, more on a slower host), so compare only runs
that both had pieces on. ``bench e2e`` starts one daemon per read mode, each writing the same file: time one
mode per run. Unset, nothing is wrapped.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import json
import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kv_sidecar.pieces")

DUMP_EVERY_S = 2.0  # the file is rewritten at most this often (and at exit)
KEEP = 20_000  # latest samples kept per piece (the busy poll passes many times a second)

# piece -> "module:attribute path"; names a module imported from another are patched where they are used
PIECES = {
    "receipt": "sidecar.daemon.router:Router._on_completion_request",
    "pairing": "sidecar.daemon.reads:Reads.blocks",
    "launch": "sidecar.daemon.conversion:Conversions._launch",
    "launch.ids": "sidecar.convert.graphs:launch_ids",
    "launch.source": "sidecar.convert.graphs:GraphLaunches._source",
    "launch.rows": "sidecar.convert.graphs:launch_src_rows",
    "launch.take": "sidecar.convert.graphs:GraphLaunches._take",
    "launch.fill": "sidecar.convert.graphs:fill",
    "answer": "sidecar.daemon.pipeline:Pipeline._answer",
    "notify": "sidecar.daemon.peers:Peers.notify",
    "poll": "sidecar.daemon.polling:Poller.run_pass",
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

    def __init__(self, path: str) -> None:
        self.path = path
        self.samples: dict[str, deque[float]] = {}
        self.calls: dict[str, int] = {}
        self._dumped = time.monotonic()
        self._lock = threading.Lock()
        self._failed = False

    def add(self, piece: str, seconds: float) -> None:
        found = self.samples.get(piece)
        if found is None:
            found = self.samples[piece] = deque(maxlen=KEEP)
        found.append(seconds)
        self.calls[piece] = self.calls.get(piece, 0) + 1
        if time.monotonic() - self._dumped > DUMP_EVERY_S:
            self.dump()

    def summary(self) -> dict[str, dict[str, float]]:
        """p50 / p90 of each piece's kept samples, their count ``n`` and all its ``calls``."""
        out = {}
        for piece, values in sorted(list(self.samples.items())):  # list(): a snapshot (other threads add)
            ordered = sorted(list(values))
            out[piece] = {
                "p50_us": round(statistics.median(ordered) * 1e6, 2),
                "p90_us": round(ordered[int(0.9 * (len(ordered) - 1))] * 1e6, 2),
                "n": len(ordered),
                "calls": self.calls.get(piece, len(ordered)),
            }
        return out

    def dump(self) -> None:
        """Write the summary; a file that cannot be written is logged once and never fails a timed call."""
        self._dumped = time.monotonic()
        try:
            with self._lock, open(self.path, "w") as f:
                json.dump(self.summary(), f, indent=1)
        except OSError as exc:
            if not self._failed:
                log.warning("loop_pieces: cannot write %s: %s", self.path, exc)
            self._failed = True

    def wrap(self, piece: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(piece, time.thread_time() - t0)

        return timed


def install(path: str, pieces: dict[str, str] = PIECES) -> Pieces:
    """Wrap every function of ``pieces``; the samples go to ``path`` (see the module's docstring)."""
    timing = Pieces(path)
    for piece, target in pieces.items():
        owner, name, fn = resolve(target)
        setattr(owner, name, timing.wrap(piece, fn))
    atexit.register(timing.dump)
    return timing
