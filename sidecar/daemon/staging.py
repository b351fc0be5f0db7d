"""The staging pool: one registered buffer, cut into page-sized slots, lent to staged pulls in runs.

A staged pull reads whole remote pages into a run of adjacent slots (adjacent slots let NIXL merge
descriptors), then converts out of place into the decoder's planes. The pool is cut for one page size at a
time; when a request with another page size comes and the pool is idle, it is re-cut.

Pulls that find no room wait in one queue and are served first come, first served: a pull never takes
slots while an earlier one waits, so a large request is not starved by smaller ones that keep fitting.

Slots a READ could not be stopped in may still be written: they are kept out (``keep_out``), never lent
again (unless every transfer into them is later released: ``let_in``), and the pool is never re-cut under
them. Requests are sized against the largest run that can still come free (``room``): one that can never fit
is refused at once (``PoolTooSmall``), and so is one waiting in line when a kept-out run leaves it no room,
rather than at its deadline with every pull behind it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from sidecar.daemon.errors import Refused
from sidecar.daemon.port import TransferPort
from sidecar.daemon.slots import SlotAllocator
from sidecar.nixl.geometry import StagingPool
from sidecar.nixl.spans import (
    GapRead,
    ReadCost,
    SpanGaps,
    SpanSlots,
    identity_rows,
    plan_span,
    span_saving_us,
    worth_waiting,
)
from sidecar.ops.metrics import Metrics
from sidecar.wire import ipc as ipc_mod
from sidecar.wire.formats import PageFormat

VIEWS_KEPT = 256  # staging views remembered (``Staging.source``); all are dropped when that many are held


class PoolTooSmall(Refused):
    """A request the pool can never lend its slots to (``staging_bytes``): too long for the whole pool, or
    for what can still come free around slots kept out (``kept_out``: how many; 0 for the first)."""

    def __init__(self, reason: str, kept_out: int) -> None:
        super().__init__("staging_bytes", reason)
        self.kept_out = kept_out


@dataclass(eq=False)
class _Cut:
    """The pool as slots of one page size."""

    slot_bytes: int
    pool: StagingPool  # what the port reads into
    allocator: SlotAllocator


@dataclass(eq=False)
class _Waiter:
    """A pull waiting for ``need`` adjacent slots; ``fallback``: what it asks for once it gives up its gap
    span (in the same place in the queue). ``fut``: the first slot, or None if the pool was re-cut."""

    need: int
    fut: asyncio.Future
    fallback: int | None = None


@dataclass(frozen=True, eq=False)
class Staged:
    """A staged request's slots: ``width`` per layer in remote order; block ``i`` lands in slot ``pos[i]``."""

    pool: StagingPool
    slots: SpanSlots  # the slot of each (layer, block), compact (np.asarray gives the [layers, n] matrix)
    run: tuple[int, int]  # (first slot, count) to give back
    gaps: GapRead | SpanGaps | None  # blocks read only to merge runs
    waited: str | None = None  # waited for its gap span: "taken" or "gave_up" (kv_sidecar_gap_span_waits)

    @property
    def width(self) -> int:
        return self.slots.width

    @property
    def pos(self) -> np.ndarray:
        """int64 (n,): block i's row in the span (the converter's source index)."""
        return self.slots.rows

    @property
    def source_index(self) -> np.ndarray | None:
        """The converter's source rows (``pos``), or None where block ``i`` is row ``i`` (no gaps, blocks
        already in remote order): the plain out-of-place launch then does (fewer checks, no index table)."""
        pos = self.pos
        if self.width != pos.size:
            return pos
        rows = identity_rows(pos.size)
        return None if pos is rows or (pos == rows).all() else pos

    def gap_bytes(self, page_bytes: int) -> int:
        return 0 if self.gaps is None else self.gaps.size * page_bytes


class Staging:
    """The daemon's staging pool (``staging_bytes`` of device memory, registered with NIXL)."""

    def __init__(
        self, port: TransferPort, nbytes: int, device: str, device_id: int, metrics: Metrics | None = None
    ) -> None:
        import torch

        self._port = port
        self._metrics = metrics
        self.nbytes = nbytes
        self._tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._device_id = device_id
        self._mem_type = port.local_mem_type
        self._registration = port.register([(self._tensor.data_ptr(), nbytes, device_id)], self._mem_type)
        self._cut: _Cut | None = None
        self._views: dict[tuple, Any] = {}  # (first, count, slot bytes, dtype, layers, blocks) -> source view
        self._queue: deque[_Waiter] = deque()  # pulls waiting for slots, served in order
        # runs (first, count) of the current cut that a READ which could not be stopped may still write, and
        # the longest run between them (what can still come free)
        self._kept_out: list[tuple[int, int]] = []
        self._room = 0
        if metrics is not None:
            metrics.staging_bytes.set(nbytes)
            # computed when scraped: a pull's take and give cost nothing more
            metrics.staging_bytes_in_use.set_function(self.bytes_in_use)
            metrics.staging_slots_kept_out.set(0)

    @property
    def waiting(self) -> int:
        """Pulls waiting for staging slots now."""
        return sum(not w.fut.done() for w in self._queue)

    def bytes_in_use(self) -> int:
        """Bytes of the slots lent to pulls now."""
        cut = self._cut
        return 0 if cut is None else (cut.allocator.num_slots - cut.allocator.free) * cut.slot_bytes

    @property
    def kept_out(self) -> int:
        """Slots kept out of use: a READ that could not be stopped may still write them."""
        return sum(n for _, n in self._kept_out)

    def room(self, page_bytes: int) -> int:
        """The most adjacent slots of ``page_bytes`` the pool can ever lend: a cut of that page size has
        ``nbytes // page_bytes`` slots; with runs kept out, only the longest run between them can come free,
        and the pool is never re-cut for another page size."""
        if not self._kept_out:
            return self.nbytes // page_bytes
        assert self._cut is not None
        return self._room if self._cut.slot_bytes == page_bytes else 0

    def holds(self, page_bytes: int, slots: int) -> bool:
        """Whether the pool, idle, could lend ``slots`` slots of ``page_bytes`` (``room``; ``take`` refuses
        if not)."""
        return slots <= self.room(page_bytes)

    def _too_small(self, page_bytes: int, need: int) -> PoolTooSmall:
        """Why a request of ``need`` slots of ``page_bytes`` can never be lent them."""
        wants = f"the request needs {need} slots of {page_bytes} bytes"
        kept = self.kept_out
        if not kept:
            return PoolTooSmall(f"{wants}, the pool has {self.nbytes // page_bytes}", 0)
        assert self._cut is not None
        held = f"{kept} of the pool's {self._cut.allocator.num_slots} slots of {self._cut.slot_bytes} bytes"
        if self._cut.slot_bytes != page_bytes:
            return PoolTooSmall(
                f"{wants}; {held} are held by a read that could not be stopped, so the pool cannot be re-cut",
                kept,
            )
        return PoolTooSmall(
            f"{wants}; {held} are held by a read that could not be stopped, and at most {self._room} "
            "adjacent slots can come free",
            kept,
        )

    def keep_out(self, run: tuple[int, int]) -> None:
        """Never lend ``run`` again (a READ into it could not be stopped and may still write). Pulls waiting
        in line that can no longer ever fit are refused now (``PoolTooSmall``), or ask for their plain slots
        if only their gap span no longer fits; the ones behind them are served."""
        first, n = run
        if n <= 0:
            return
        cut = self._cut
        assert cut is not None
        self._kept_out = sorted([*self._kept_out, (first, n)])
        room = self._kept_changed(cut)
        for waiter in list(self._queue):
            if waiter.fut.done() or waiter.need <= room:
                continue
            if waiter.fallback is not None and waiter.fallback <= room:
                waiter.need, waiter.fallback = waiter.fallback, None
                continue
            self._queue.remove(waiter)
            waiter.fut.set_exception(self._too_small(cut.slot_bytes, waiter.need))
        self._serve()

    def let_in(self, run: tuple[int, int]) -> None:
        """Lend a kept-out run again: nothing can write it any more (every transfer into it has ended and
        been released). Given back, it serves the pulls waiting in line."""
        if run not in self._kept_out:
            return
        self._kept_out.remove(run)
        assert self._cut is not None
        self._kept_changed(self._cut)
        self.give(run)

    def _kept_changed(self, cut: _Cut) -> int:
        """Count the slots kept out, and the longest run between them (``room``), which it returns."""
        if self._metrics is not None:
            self._metrics.staging_slots_kept_out.set(self.kept_out)
        self._room, end = 0, 0
        for start, count in [*self._kept_out, (cut.allocator.num_slots, 0)]:
            self._room = max(self._room, start - end)
            end = start + count
        return self._room

    def _cut_for(self, page_bytes: int) -> _Cut:
        cut = self._cut
        if cut is not None and cut.slot_bytes == page_bytes:
            return cut
        num = self.nbytes // page_bytes
        if num == 0:
            raise Refused("staging_bytes", f"{self.nbytes} bytes hold no {page_bytes}-byte page")
        if cut is not None and cut.allocator.free != cut.allocator.num_slots:
            raise Refused("staging", "the pool is in use with another page size")
        pool = StagingPool(
            base=self._tensor.data_ptr(),
            slot_bytes=page_bytes,
            num_slots=num,
            device_id=self._device_id,
            mem_type=self._mem_type,
        )
        self._cut = _Cut(page_bytes, self._port.staging(self._registration, pool), SlotAllocator(num))
        while self._queue:  # waiters of the old cut start over on the new one
            waiter = self._queue.popleft()
            if not waiter.fut.done():
                waiter.fut.set_result(None)
        self._count()
        return self._cut

    async def take(self, fmt: PageFormat, layers: int, blocks: int) -> tuple[StagingPool, tuple[int, int]]:
        """Wait for ``layers * blocks`` adjacent slots of ``fmt``'s page size: the pool to read into and the
        run (first slot, count) to give back."""
        while True:
            need = layers * blocks
            if not self.holds(fmt.page_bytes, need):  # the rule auto's fallback to direct asks first
                raise self._too_small(fmt.page_bytes, need)
            cut = self._cut_for(fmt.page_bytes)
            if need == 0:  # no block to read (a full prefix hit, a notify-only pull): nothing to wait for
                return cut.pool, (0, 0)
            first, _ = await self._wait_run(cut, need)
            if first is not None:
                return cut.pool, (first, need)
            # re-cut for another page size while we waited: start over on the new cut

    def _take_now(self, cut: _Cut, need: int) -> int | None:
        """``need`` adjacent slots now, unless another pull waits for slots (it comes first), or None."""
        return None if self.waiting else cut.allocator.take(need)

    async def _wait_run(
        self, cut: _Cut, need: int, fallback: int | None = None, give_up_s: float | None = None
    ) -> tuple[int | None, int]:
        """(first slot, slots taken): ``need`` adjacent slots, now or in turn behind the pulls already
        waiting. With ``fallback``, after ``give_up_s`` the pull asks for ``fallback`` slots instead, keeping
        its place. First is None if the pool was re-cut meanwhile. Cancelled, it takes nothing with it.
        PoolTooSmall once a run kept out leaves it no room (``keep_out``)."""
        first = self._take_now(cut, need)
        if first is not None:
            return first, need
        waiter = _Waiter(need, asyncio.get_running_loop().create_future(), fallback)
        self._queue.append(waiter)
        self._count()
        timer = None
        if fallback is not None and give_up_s is not None:
            timer = asyncio.get_running_loop().call_later(max(0.0, give_up_s), self._fall_back, waiter)
        try:
            first = await waiter.fut
        except asyncio.CancelledError:
            fut = waiter.fut
            if fut.done() and not fut.cancelled() and fut.exception() is None and fut.result() is not None:
                self.give((fut.result(), waiter.need))  # served, but stopped before it could go on
            raise
        finally:
            if timer is not None:
                timer.cancel()
            if waiter in self._queue:
                self._queue.remove(waiter)
                self._serve()  # it may have been what held up the pulls behind it
        return first, waiter.need

    def _count(self) -> None:
        if self._metrics is not None:
            self._metrics.staging_waiting.set(self.waiting)

    def _fall_back(self, waiter: _Waiter) -> None:
        """A waiter's gap span is no longer worth its wait: it asks for its plain slots, in the same place."""
        if waiter.fallback is not None and not waiter.fut.done():
            waiter.need, waiter.fallback = waiter.fallback, None
            self._serve()

    def _serve(self) -> None:
        """Give slots to the waiting pulls in order, while the first in line fits. (A re-cut empties the line,
        ``_cut_for``: every waiter waits for the current cut.)"""
        while self._queue:
            waiter = self._queue[0]
            if not waiter.fut.done():  # done: cancelled, its task takes it out
                assert self._cut is not None
                first = self._cut.allocator.take(waiter.need)
                if first is None:
                    break
                waiter.fut.set_result(first)
            self._queue.popleft()
        self._count()

    def _queued_slots(self) -> int:
        """Slots the pulls waiting in line ask for."""
        return sum(w.need for w in self._queue if not w.fut.done())

    async def take_span(
        self, fmt: PageFormat, layers: int, remote_ids: np.ndarray, cost: ReadCost | None, share: float
    ) -> Staged:
        """Slots for a request's remote kernel blocks in remote-address order (neighbours merge into runs),
        plus the gaps worth reading (``cost``) within ``share`` of the pool. A busy pool: it waits in turn for
        the span's slots when the gaps save more than the reads in flight take to free them
        (``worth_waiting``), at most as long as the gaps save, then for its plain slots in the same place;
        else reads the gaps that fit the free slots now, or none (as ``take``)."""
        n = int(np.asarray(remote_ids).size)
        page = fmt.page_bytes
        span, waited = None, None
        if not self.holds(page, layers * n):
            raise self._too_small(page, layers * n)
        if cost is not None and share > 0 and layers > 0 and n > 1:
            cut = self._cut_for(page)
            total, own = self.room(page), layers * n
            span = plan_span(remote_ids, page, cost, min(int(share * total), total - own) // layers)
            if span.gap_blocks:
                need = layers * span.width
                first = self._take_now(cut, need)
                saving_us = 0.0 if first is not None else span_saving_us(span, layers, page, cost)
                missing = 0 if first is not None else need + self._queued_slots() - cut.allocator.free
                if first is None and worth_waiting(saving_us, page, cost, missing):
                    # Never longer than the gaps save: past that, reading without them is cheaper.
                    first, need = await self._wait_run(cut, need, own, saving_us / 1e6)
                    waited = "taken" if need != own else "gave_up"
                    if first is not None and need == own:  # in turn, without its gaps
                        plain = SpanSlots(first, layers, n, plan_span(remote_ids, page, None, 0).pos)
                        return Staged(cut.pool, plain, (first, own), None, waited)
                elif first is None and not self.waiting:  # the gaps that fit the free slots now
                    budget = min(int(share * total), cut.allocator.free - own) // layers
                    span = plan_span(remote_ids, page, cost, budget)
                    need = layers * span.width
                    first = cut.allocator.take(need) if span.gap_blocks else None
                if first is not None:
                    gaps = SpanGaps(span, first, layers)
                    slots = SpanSlots(first, layers, span.width, span.pos)
                    return Staged(cut.pool, slots, (first, need), gaps, waited)
        if span is None or span.gap_blocks:  # a span without gaps is the plain plan already
            span = plan_span(remote_ids, page, None, 0)
        pool, run = await self.take(fmt, layers, n)
        return Staged(pool, SpanSlots(run[0], layers, n, span.pos), run, None, waited)

    def give(self, run: tuple[int, int]) -> None:
        """Give a run back (the job's reads and conversion are over) and serve the waiting pulls in order."""
        assert self._cut is not None
        self._cut.allocator.give(*run)
        self._serve()

    def source(self, run: tuple[int, int], fmt: PageFormat, layers: int, blocks: int) -> Any:
        """A run's pages as one [layers, blocks, page elements] tensor of the page dtype. Views are kept:
        first-fit hands out the same runs again and again, and torch's slicing lets go of the GIL."""
        assert self._cut is not None
        first, n = run
        slot = self._cut.slot_bytes
        key = (first, n, slot, fmt.dtype, layers, blocks)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= VIEWS_KEPT:
                self._views.clear()
            dtype = ipc_mod.torch_dtype(fmt.dtype)
            # the page's length spelled out: a run of no blocks (0 elements) cannot infer it
            page = slot // dtype.itemsize
            view = self._views[key] = (
                self._tensor[first * slot : (first + n) * slot].view(dtype).view(layers, blocks, page)
            )
        return view

    def close(self) -> None:
        self._port.deregister(self._registration)
        if self._metrics is not None:
            self._metrics.staging_bytes.set(0)
            self._metrics.staging_bytes_in_use.set_function(lambda: 0)
            self._metrics.staging_slots_kept_out.set(0)
