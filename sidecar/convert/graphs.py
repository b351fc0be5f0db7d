"""Conversion launches replayed from CUDA graphs: one graph launch, not Python's tables and launch.

The daemon's launch is the same two steps for every request: copy the request's table (block ids, source
rows, meta) to the device, then run the kernel over its (layer, block) pairs: ``convert_kernel`` out of place
(staged, mapped), ``in_place_split_kernel`` in place (direct). Done in Python each time that is 150-420 µs
of host time on the H200 host (bench/results/launch-inline-h200-2026-12-02.json). Captured once per size
bucket, layer count and form, a launch checks the ids (unless handed ``CheckedIds``: the daemon checks a
request's once, not once a layer group), writes the table into the graph's pinned buffer, replays the graph
(the copy, then the kernel) and records an event. A source's checks and meta table are
made once (``_source``), and a table is given a meta only when it holds another one.

Padding: ``graph_tables`` (a request replays the graph of the smallest bucket holding it; out of place the
extra rows convert the request's first block again, with the same bytes; in place they name no block).
Buffers: a graph copies from its own pinned buffer, which may be rewritten only once that copy has run, so
each graph keeps the event recorded after its last replay; a launch takes a graph of its key whose event is
complete, captures another (up to ``per_key``) when all are busy, and otherwise returns None: the caller then
launches the ordinary way. So does a request this cannot take (a source 16-byte vectors do not fit) and, for
good, a ``GraphLaunches`` whose capture failed once. Neither form re-encodes fp8 (the ordinary launch does);
in place replays only where the shape converts with the on-chip "split" kernel (every in-scope shape).

Ahead of the data: ``prepare`` does a launch's host work (the checks, a graph taken and held, its table
written) while the request still reads, and ``fire`` queues it once the bytes have landed, so only the replay
is left on a lone request's critical path. A held graph is nobody else's until fired or ``drop``ped; at most
half a key's graphs are held at once, so launches at landing still find one.

Behind gates (``queue``, ``sidecar.convert.gates``): while the owner's ``held`` says GPU work waits behind a
closed gate, no graph is captured (its instantiation waits for the device: for the gated work, whose gate the
same thread would open) and none is made (new buffers); a launch that would need either goes the ordinary way.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sidecar.convert.api import PlaneSet
from sidecar.convert.checks import (
    CheckedIds,
    launch_ids,
    launch_source,
    launch_src_rows,
    layer_range,
    source_tensor,
    x_of,
)
from sidecar.convert.graph_tables import bucket, fill, table_layout
from sidecar.convert.tables import META_COLUMNS
from sidecar.convert.tuning import TUNING, Tuning

log = logging.getLogger("kv_sidecar.convert")


@dataclass(eq=False)
class _Graph:
    """One captured launch: its pinned table, the device copy the kernel reads, its last replay's event."""

    host: torch.Tensor  # pinned int64: written by the host before each replay
    table: np.ndarray  # ``host`` as numpy
    device: torch.Tensor  # int64 on the GPU: the graph copies ``host`` here, the kernel reads it
    graph: Any = None  # torch.cuda.CUDAGraph, once captured
    last: Any = None  # the event recorded after its latest launch (None: never launched)
    meta: np.ndarray | None = None  # the (read-only, cached) meta table ``host`` holds
    held: bool = False  # prepared for a launch not yet fired: its table is that launch's

    def free(self) -> bool:
        """Whether it is not held and the copy of its latest launch has run (the table may be rewritten)."""
        return not self.held and (self.last is None or self.last.query())


@dataclass(eq=False)
class Prepared:
    """A launch made ready ahead of its data (``GraphLaunches.prepare``): its graph held, its table written.
    ``fire`` it once the bytes have landed, or ``drop`` it; either lets the graph go."""

    owner: GraphLaunches
    entry: _Graph
    key: Key

    def fire(self, stream: Any) -> Any:
        """Queue the launch on ``stream``; the event after it."""
        return self.owner._fire(self.entry, self.key, stream)

    def drop(self) -> None:
        """Let the graph go unfired (the request ended before its bytes landed): nothing was queued, and the
        next launch that takes the graph rewrites its whole table."""
        self.entry.held = False

    def queue(self, stream: Any, gates: Any) -> tuple[Any, int] | None:
        """Queue the launch on ``stream`` behind a closed gate of ``gates`` (``sidecar.convert.gates``), ahead
        of its bytes: (the event after it, the gate's slot). The caller must ``gates.open`` the slot, once
        the bytes have landed or, if they never will, after ``disarm``. None (nothing queued, the launch
        still held: ``fire`` or ``drop`` it) when no gate is free or the graph is not captured yet."""
        return self.owner._queue(self.entry, self.key, stream, gates)

    def disarm(self) -> None:
        """Point a queued launch's writes at the owner's scratch block instead of the request's blocks (call
        before opening the gate of a request whose bytes will not land: the table is copied only then)."""
        self.owner._disarm(self.entry, self.key)


Key = tuple[int, int, bool]  # a graph's (layers, bucket, in place)


@dataclass(frozen=True, eq=False)
class _Source:
    """One source as launches of one layer range take it, checked once: its rows, whether 16-byte vectors fit
    it, and the kernel's meta table of those layers reading it."""

    rows: int  # 0 in place
    vectors_fit: bool
    meta: np.ndarray  # read-only (``MetaCache``): a graph whose table holds this object holds these values


class GraphLaunches:
    """Graph-replayed launches into one ``PlaneSet``'s planes (its caches own it)."""

    def __init__(self, planes: PlaneSet, tuning: Tuning = TUNING, per_key: int = 8, max_graphs: int = 256,
                 held: Callable[[], bool] = lambda: False):
        """``held``: whether GPU work is held behind a closed gate now (``Gates.closed``); see the module."""
        from sidecar.convert import triton_kernel as tk  # lazy: the CPU torch wheel has no Triton

        p = planes.planes
        if planes.lut is not None:
            raise ValueError("graph launches do not re-encode fp8 (the padding would count bytes twice)")
        self._tk = tk
        self.planes = planes
        self.tuning = tuning
        self.per_key = per_key
        self.max_graphs = max_graphs
        self._gates_held = held
        self.anchor = p.k_planes[0]
        self._anchor_ptr = self.anchor.data_ptr()
        self.device = p.device
        h, n, d = p.num_heads, p.block_size, p.head_size
        self._geom = dict(N=n, D=d, X=x_of(p.elem_bytes))
        self._chunks = tk.oop_chunks(h, n, d, x_of(p.elem_bytes), tuning)
        self._in_place = tk.in_place_form(h, n, d, p.elem_bytes, tuning) == "split"  # else never replayed
        self._unused = tk._unused_counts(self.device)
        self._graphs: OrderedDict[Key, list[_Graph]] = OrderedDict()
        self._sources: OrderedDict[tuple, _Source] = OrderedDict()  # by every property the checks read
        self.max_sources = 64
        self.count = 0  # graphs held
        self.broken: str | None = None  # why capture failed (then every launch goes the ordinary way)
        self.stats = {"replays": 0, "captures": 0, "declined": 0}
        self._scratch: torch.Tensor | None = None  # where a disarmed launch writes (``Prepared.disarm``)

    def launch(
        self, stream: Any, ids: np.ndarray | CheckedIds, src: torch.Tensor | None, layers: tuple[int, int],
        src_index: Any = None,
    ) -> Any:
        """Queue the conversion of layers ``[first, last)`` of blocks ``ids`` from ``src`` ([layers, rows,
        page], rows picked by ``src_index``, else row i; None: in place) on ``stream``; return the event after
        it, or None when this launch is not taken (nothing queued, nothing written). Bad input raises
        ValueError. ``ids`` as ``CheckedIds`` (``checks.checked_ids``) skip the id checks."""
        prepared = self.prepare(ids, src, layers, src_index, hold_limit=self.per_key)
        return None if prepared is None else prepared.fire(stream)

    def prepare(
        self, ids: np.ndarray | CheckedIds, src: torch.Tensor | None, layers: tuple[int, int],
        src_index: Any = None, hold_limit: int | None = None,
    ) -> Prepared | None:
        """``launch``'s host work, done before the bytes are there: the checks, a graph of the request's key
        taken and held, its table written. None when not taken (then nothing is held). ``hold_limit``: how
        many of the key's graphs may be held at once (default half of ``per_key``); a key at its limit is
        declined before the checks, which the launch at landing makes. Bad input raises ValueError."""
        p = self.planes.planes
        first, last = layer_range(p, layers)  # the ordinary launch's checks, in its order (check_launch)
        limit = max(1, self.per_key // 2) if hold_limit is None else hold_limit
        in_place = src is None
        # ids maybe unchecked yet: anything but an array (or ``CheckedIds``) counts as no blocks here and is
        # refused by the checks below
        if self._held(last - first, getattr(ids, "size", 0), in_place) >= limit:
            # At 16k x 8 four in five groups found their key's limit reached (one H100, 2026-12-05), and
            # each had spent ~40 µs of the loop on checks the launch at landing repeats.
            self.stats["declined"] += 1
            return None
        ids = launch_ids(p, ids)
        m = ids.size
        rows: np.ndarray | None = None
        if in_place:
            if src_index is not None:
                raise ValueError("src_index needs a source: an in-place launch reads its blocks' own pages")
            source = self._in_place_source(first, last)
        else:
            source = self._source(src, first, last, m, src_index)
            if src_index is None:
                rows = np.arange(m, dtype=np.int64)
            else:
                rows = launch_src_rows(src_index, ids, source.rows)
        fits = p.aligned16 and source.vectors_fit and (self._in_place or not in_place)
        if self.broken is not None or m == 0 or not fits:
            self.stats["declined"] += 1
            return None
        key = (last - first, bucket(m), in_place)
        entry = self._take(key)
        if entry is None:
            self.stats["declined"] += 1
            return None
        fill(entry.table, key[1], ids, rows, None if entry.meta is source.meta else source.meta)
        entry.meta = source.meta
        entry.held = True
        return Prepared(owner=self, entry=entry, key=key)

    def _fire(self, entry: _Graph, key: Key, stream: Any) -> Any:
        """``Prepared.fire``: the launch's replay and event; its graph is let go whatever happens."""
        previous = _use_stream(stream)
        try:
            if entry.graph is None:
                self._enqueue(entry, key)  # this request, the ordinary way (and Triton compiles if it must)
                if self._gates_held():  # instantiating would wait for the gated work: a later fire captures
                    self.stats["deferred"] = self.stats.get("deferred", 0) + 1
                else:
                    self._capture(entry, key)  # the next one of this key replays
            else:
                entry.graph.replay()
                self.stats["replays"] += 1
            entry.last = torch.cuda.Event()
            entry.last.record(stream)
        finally:
            entry.held = False
            _restore_stream(previous)
        return entry.last

    def _queue(self, entry: _Graph, key: Key, stream: Any, gates: Any) -> tuple[Any, int] | None:
        """``Prepared.queue``: the gate's wait on ``stream``, then ``_fire`` behind it."""
        if entry.graph is None or self.broken is not None:
            return None
        self._scratch_offsets()  # a disarm writes there: made now, not while the gate holds the GPU
        slot = gates.take()
        if slot is None:
            return None
        try:
            gates.close_on(stream, slot)
        except Exception:
            gates.open(slot)  # nothing was queued behind it
            gates.give_back(slot)
            raise
        try:
            # held no more once fired, but not rewritten before its copy has run: ``free`` waits for the
            # event, recorded behind the gate
            event = self._fire(entry, key, stream)
        except Exception:
            gates.open(slot)  # the wait passes with nothing behind it; the slot is not reused (rare)
            raise
        self.stats["gated"] = self.stats.get("gated", 0) + 1
        return event, slot

    def _disarm(self, entry: _Graph, key: Key) -> None:
        """``Prepared.disarm``: every layer's K and V destination in the entry's table made the scratch
        block's, with row stride 0 (every block id lands there; in place it is read there too); the next
        fill rewrites the meta."""
        layers, b, _ = key
        _, meta_at, _ = table_layout(b, layers)
        meta = entry.table[meta_at : meta_at + layers * META_COLUMNS].reshape(layers, META_COLUMNS)
        k_at, v_at = self._scratch_offsets()
        meta[:, 0], meta[:, 1], meta[:, 2], meta[:, 3] = k_at, 0, v_at, 0
        entry.meta = None
        self.stats["disarmed"] = self.stats.get("disarmed", 0) + 1

    def _scratch_offsets(self) -> tuple[int, int]:
        """The scratch block's K and V rows, in elements from the anchor (as the meta table holds them)."""
        p = self.planes.planes
        row = p.num_heads * p.block_size * p.head_size  # elements of one block's K (or V) row
        if self._scratch is None:
            self._scratch = torch.empty(2 * row * p.elem_bytes, dtype=torch.uint8, device=self.device)
        k_at = (self._scratch.data_ptr() - self._anchor_ptr) // p.elem_bytes
        return k_at, k_at + row

    def _source(self, src: Any, first: int, last: int, m: int, src_index: Any) -> _Source:
        """``src`` checked (``launch_source``) with its meta table for layers [first, last), both remembered
        by every property they are computed from (a daemon launches from the same few sources)."""
        src = source_tensor(src)  # its properties key the memo: checked first, as launch_source does
        indexed = src_index is not None
        rows_for = None if indexed else m  # an unindexed source is checked for its first m rows
        key = (src.data_ptr(), src.shape, src.stride(), src.dtype, src.device, first, last, rows_for)
        found = self._sources.get(key)
        if found is not None:
            return found
        ps, p = self.planes, self.planes.planes
        view, src_rows, fit = launch_source(ps.sources, p, src, last - first, m, src_index)
        meta = ps.tables.get(p.rows[first:last], src_rows, self._anchor_ptr, p.elem_bytes)
        return self._remember(key, _Source(rows=view.shape[1], vectors_fit=fit, meta=meta))

    def _in_place_source(self, first: int, last: int) -> _Source:
        """The in-place launches' "source" of layers [first, last): the blocks themselves, with the meta
        table of those layers (no source rows); remembered like ``_source``'s."""
        key = ("in place", first, last)
        found = self._sources.get(key)
        if found is not None:
            return found
        p = self.planes.planes
        meta = self.planes.tables.get(p.rows[first:last], None, self._anchor_ptr, p.elem_bytes)
        return self._remember(key, _Source(rows=0, vectors_fit=True, meta=meta))

    def _remember(self, key: tuple, found: _Source) -> _Source:
        """``found`` kept under ``key``, the oldest source let go past ``max_sources``."""
        if len(self._sources) >= self.max_sources:
            self._sources.popitem(last=False)
        self._sources[key] = found
        return found

    def _held(self, layers: int, m: int, in_place: bool) -> int:
        """How many graphs of the key of ``m`` blocks over ``layers`` layers are held (0 for no blocks)."""
        entries = self._graphs.get((layers, bucket(m), in_place)) if m > 0 else None
        return sum(e.held for e in entries) if entries else 0

    def _take(self, key: Key) -> _Graph | None:
        """A graph of ``key`` free to rewrite, a new one (not yet captured) if none is, or None. The key's
        hold limit is ``prepare``'s to check, before its checks (``_held``)."""
        entries = self._graphs.get(key)
        if entries is None:
            entries = self._graphs[key] = []
        self._graphs.move_to_end(key)
        for entry in entries:
            if entry.free():
                return entry
        if len(entries) >= self.per_key or self._gates_held() or not self._room():
            return None  # at the key's limit, gated work held (``held``), or no room
        _, _, total = table_layout(key[1], key[0])
        host = torch.empty(total, dtype=torch.int64, pin_memory=True)
        entry = _Graph(host=host, table=host.numpy(), device=torch.empty(total, dtype=torch.int64,
                                                                          device=self.device))
        entries.append(entry)
        self.count += 1
        return entry

    def _room(self) -> bool:
        """Room for one more graph: drop the least recently used keys whose graphs are all idle."""
        for key in list(self._graphs):
            if self.count < self.max_graphs:
                return True
            entries = self._graphs[key]
            if entries and all(e.free() for e in entries):
                del self._graphs[key]
                self.count -= len(entries)
        return self.count < self.max_graphs

    def _enqueue(self, entry: _Graph, key: Key) -> None:
        """The launch itself, on the current stream: the table's copy, then the kernel."""
        layers, b, in_place = key
        entry.device.copy_(entry.host, non_blocking=True)
        _, meta_at, _ = table_layout(b, layers)
        meta = entry.device[meta_at:]
        ids = entry.device[: 2 * b]
        p, t = self.planes.planes, self.tuning
        if in_place:  # the bucket's padding ids (PAD_ID) convert nothing
            self._tk.launch_split(self.device, True, self.anchor, meta, ids, b, layers * b, p.num_heads,
                                  self._geom, t)
            return
        hc, nc, dc, hchunks = self._chunks
        programs = layers * b * hchunks * (p.block_size // nc) * (p.head_size // dc)
        shape = dict(HC=hc, HCHUNKS=hchunks, NC=nc, DC=dc, KD=t.k_direct_oop, EVICT=t.evict,
                     num_warps=t.oop_warps, SRC_IDX=True, lut=self._unused, cnt=self._unused, REENC=False,
                     **self._geom)
        tk = self._tk
        if t.oop_max_programs and programs > t.oop_max_programs:  # a capped grid: programs loop
            tk._launch(tk.convert_persistent_kernel, (t.oop_max_programs,), self.device, True, self.anchor,
                       meta, ids, b, p.num_heads, 0, programs, STAGES=t.oop_stages, **shape)
        else:
            tk._launch(tk.convert_kernel, (programs,), self.device, True, self.anchor, meta, ids, b,
                       p.num_heads, 0, FROM_SRC=True, **shape)

    def _capture(self, entry: _Graph, key: Key) -> None:
        """Capture ``_enqueue`` into the entry's graph; a failure turns graph launches off, with a warning
        (the request itself was already queued the ordinary way)."""
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: CUDA calls of other threads (NIXL's UCX workers) may go on during the capture
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                self._enqueue(entry, key)
            finally:
                graph.capture_end()
        except Exception as exc:  # noqa: BLE001 - the ordinary launch still works
            self.broken = f"{type(exc).__name__}: {exc}"
            log.warning("conversion graphs off: capture failed (%s); launches go the ordinary way",
                        self.broken)
            return
        entry.graph = graph
        self.stats["captures"] += 1


def _use_stream(stream: Any) -> tuple[int, int, int] | None:
    """Make ``stream`` current (cheaper than ``torch.cuda.stream``'s 17-40 µs); returns what to restore."""
    previous = torch._C._cuda_getCurrentStream(stream.device_index)
    if previous[0] == stream.stream_id:
        return None
    torch._C._cuda_setStream(stream_id=stream.stream_id, device_index=stream.device_index,
                             device_type=stream.device_type)
    return previous


def _restore_stream(previous: tuple[int, int, int] | None) -> None:
    if previous is not None:
        torch._C._cuda_setStream(stream_id=previous[0], device_index=previous[1], device_type=previous[2])
