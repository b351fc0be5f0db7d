"""``Staged.source_index``: the converter gets a source index only where block i is not staging row i; the
pool's line of waiting pulls (first come, first served; a stopped waiter takes nothing with it)."""

from __future__ import annotations

import asyncio
import itertools

import msgspec
import numpy as np
import pytest

from sidecar.daemon.errors import Refused
from sidecar.daemon.staging import Staged, Staging
from sidecar.nixl.spans import SpanSlots, plan_span
from sidecar.standins.fake_transfer import FakePort
from sidecar.wire.formats import PageFormat

FMT = PageFormat(kind="standard", layout="LHBNC", dtype="bfloat16", num_heads=1, block_size=16, head_size=64)


def _staged(width: int, pos: list[int]) -> Staged:
    p = np.asarray(pos, dtype=np.int64)
    return Staged(pool=None, slots=SpanSlots(0, 1, width, p), run=(0, width), gaps=None)


@pytest.mark.parametrize("n", [0, 1, 2, 5])
def test_identity_layout_needs_no_index(n):
    assert _staged(n, list(range(n))).source_index is None


@pytest.mark.parametrize("perm", [p for p in itertools.permutations(range(4)) if list(p) != [0, 1, 2, 3]])
def test_every_other_order_keeps_its_index(perm):
    got = _staged(4, list(perm)).source_index
    assert got is not None and got.tolist() == list(perm)


@pytest.mark.parametrize("n", [1, 3, 256])
def test_a_contiguous_span_needs_no_index_whether_its_rows_are_shared_or_not(n):
    shared = plan_span(np.arange(9, 9 + n), 4096, None, 0)  # back to back: identity_rows(n) itself
    assert _staged(n, shared.pos.tolist()).source_index is None  # a copy: compared
    assert Staged(pool=None, slots=SpanSlots(0, 1, n, shared.pos), run=(0, n), gaps=None).source_index is None


def test_a_span_with_gap_rows_keeps_its_index_even_when_ascending():
    # rows 0, 2, 3 of a 4-row span: ascending, yet row 1 is a gap block
    assert _staged(4, [0, 2, 3]).source_index.tolist() == [0, 2, 3]


@pytest.mark.parametrize("seed", range(20))
def test_planned_spans_convert_the_same_rows_with_or_without_the_shortcut(seed):
    """For spans as the daemon plans them (remote order, no gaps), the index it drops is the identity."""
    rng = np.random.default_rng(seed)
    ids = rng.choice(200, size=int(rng.integers(1, 30)), replace=False)
    span = plan_span(ids, 4096, None, 0)
    staged = _staged(span.width, span.pos.tolist())
    rows = staged.source_index if staged.source_index is not None else np.arange(ids.size)
    assert rows.tolist() == span.pos.tolist()
    assert (staged.source_index is None) == bool((np.diff(ids) > 0).all())


def _pool(slots: int) -> Staging:
    return Staging(FakePort(), slots * FMT.page_bytes, "cpu", 0)


def _free(staging: Staging) -> int:
    return staging._cut.allocator.free  # noqa: SLF001


def test_waiters_are_served_in_arrival_order_while_the_first_fits():
    async def main():
        staging = _pool(4)
        _, whole = await staging.take(FMT, 1, 4)
        served: list[str] = []

        async def take(name: str, blocks: int) -> tuple[int, int]:
            _, run = await staging.take(FMT, 1, blocks)
            served.append(name)
            return run

        tasks = [asyncio.ensure_future(take(name, n)) for name, n in (("three", 3), ("one", 1), ("two", 2))]
        await asyncio.sleep(0)
        assert staging.waiting == 3
        staging.give(whole)  # three and one fit; two waits for them
        await asyncio.sleep(0)
        assert served == ["three", "one"] and staging.waiting == 1
        staging.give(await tasks[0])
        assert (await tasks[2])[1] == 2 and served == ["three", "one", "two"]
        staging.give(await tasks[1])
        staging.give(await tasks[2])
        assert _free(staging) == 4 and staging.waiting == 0

    asyncio.run(main())


def test_a_waiter_served_but_cancelled_before_it_resumes_gives_its_slots_back():
    async def main():
        staging = _pool(4)
        _, whole = await staging.take(FMT, 1, 4)
        waiter = asyncio.ensure_future(staging.take(FMT, 1, 2))
        behind = asyncio.ensure_future(staging.take(FMT, 1, 3))
        await asyncio.sleep(0)
        staging.give(whole)  # serves the first waiter at once; it has not resumed yet
        assert _free(staging) == 2
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        _, run = await behind  # the slots came back and went to the next in line
        assert run[1] == 3 and _free(staging) == 1
        staging.give(run)
        assert _free(staging) == 4 and staging.waiting == 0

    asyncio.run(main())


def test_a_pull_arriving_while_others_wait_joins_the_line_even_if_it_fits():
    async def main():
        staging = _pool(4)
        _, half = await staging.take(FMT, 1, 2)
        big = asyncio.ensure_future(staging.take(FMT, 1, 4))
        await asyncio.sleep(0)
        small = asyncio.ensure_future(staging.take(FMT, 1, 1))
        await asyncio.sleep(0.01)
        assert not big.done() and not small.done() and _free(staging) == 2
        staging.give(half)
        _, run = await big
        assert not small.done()
        staging.give(run)
        staging.give((await small)[1])
        assert _free(staging) == 4

    asyncio.run(main())


@pytest.mark.parametrize("slots", range(0, 10))
def test_holds_says_what_take_would_refuse(slots):
    """``holds`` (auto's switch to direct) agrees with ``take`` on every size, for pages of two sizes."""
    staging = _pool(6)
    other = msgspec.structs.replace(FMT, head_size=40)  # 6 pages of FMT hold 9 of these, and a remainder
    for fmt, room in ((FMT, 6), (other, 9)):
        assert staging.holds(fmt.page_bytes, slots) == (slots <= room)

        async def take(fmt=fmt):
            pool, run = await staging.take(fmt, 1, slots)
            staging.give(run)

        if slots <= room:
            asyncio.run(take())
        else:
            with pytest.raises(Refused, match="staging_bytes"):
                asyncio.run(take())


def test_a_request_of_no_blocks_takes_no_slots_and_never_waits_for_them():
    """A Pull of no blocks (a full local prefix hit, or the shim's notify-only pull) stages nothing: it gets
    an empty run at once, even from a pool another pull holds whole, and its source is an empty view."""

    async def main():
        staging = _pool(4)
        _, whole = await staging.take(FMT, 1, 4)
        for get in (
            lambda: staging.take(FMT, 2, 0),
            lambda: staging.take_span(FMT, 2, np.empty(0, np.int64), None, 0.0),
        ):
            got = await asyncio.wait_for(get(), 0.5)
            run = got[1] if isinstance(got, tuple) else got.run
            assert run[1] == 0 and staging.waiting == 0
            assert tuple(staging.source(run, FMT, 2, 0).shape[:2]) == (2, 0)
            staging.give(run)
        assert _free(staging) == 0  # the whole pool is still the first pull's
        staging.give(whole)
        assert _free(staging) == 4

    asyncio.run(main())


def test_kept_out_runs_shrink_what_the_pool_holds_and_a_pull_that_cannot_fit_is_refused_at_once():
    """Slots a read could not be stopped in are never lent again: ``holds`` and ``take`` size a request
    against the largest run that can still come free, not the whole pool, so a pull that could only fit
    across the kept-out run is refused at once (naming staging_bytes) instead of waiting for it forever."""

    async def main():
        staging = _pool(8)
        _, a = await staging.take(FMT, 1, 3)
        _, b = await staging.take(FMT, 1, 2)
        _, c = await staging.take(FMT, 1, 3)
        assert (a, b, c) == ((0, 3), (3, 2), (5, 3))
        staging.keep_out(b)  # free around it: 0..3 and 5..8
        staging.give(a)
        staging.give(c)
        assert staging.kept_out == 2 and _free(staging) == 6
        assert staging.holds(FMT.page_bytes, 3) and not staging.holds(FMT.page_bytes, 4)
        for get in (
            lambda: staging.take(FMT, 1, 4),
            lambda: staging.take_span(FMT, 2, np.arange(2), None, 0.0),
        ):
            with pytest.raises(Refused, match="staging_bytes: .*could not be stopped"):
                await asyncio.wait_for(get(), 0.5)
        assert staging.waiting == 0
        _, run = await asyncio.wait_for(staging.take(FMT, 1, 3), 0.5)  # either side of it still lends
        staging.give(run)
        # the pool is never re-cut under a run a read may still write: another page size gets nothing
        other = msgspec.structs.replace(FMT, head_size=40)
        assert not staging.holds(other.page_bytes, 1)
        with pytest.raises(Refused, match="staging_bytes: .*could not be stopped"):
            await asyncio.wait_for(staging.take(other, 1, 1), 0.5)
        assert _free(staging) == 6

    asyncio.run(main())


def test_waiters_that_can_no_longer_ever_fit_are_refused_and_the_line_goes_on():
    """Pulls already in line when a run is kept out: those that need more than can still come free are
    answered at once (not at their deadline), and one behind them that fits is served in turn."""

    async def main():
        staging = _pool(8)
        _, a = await staging.take(FMT, 1, 4)
        _, b = await staging.take(FMT, 1, 4)
        big = asyncio.ensure_future(staging.take(FMT, 1, 6))
        fits = asyncio.ensure_future(staging.take(FMT, 1, 4))
        also_big = asyncio.ensure_future(staging.take(FMT, 1, 5))
        await asyncio.sleep(0)
        assert staging.waiting == 3
        staging.keep_out(a)  # at most 4 slots can ever be free now
        await asyncio.sleep(0)
        for task in (big, also_big):
            assert task.done()
            with pytest.raises(Refused, match="staging_bytes: .*could not be stopped"):
                task.result()
        assert not fits.done() and staging.waiting == 1
        staging.give(b)
        _, run = await asyncio.wait_for(fits, 0.5)
        assert run == (4, 4) and staging.waiting == 0

    asyncio.run(main())


def test_a_gap_span_waiter_that_can_no_longer_fit_its_span_takes_its_plain_slots_at_once():
    """A pull waiting for its gap span (worth waiting for: 10 s saved) whose span can no longer ever fit,
    but whose own blocks can, asks for its plain slots in its place at once, not after its give-up time."""
    from sidecar.nixl.spans import ReadCost

    async def main():
        staging = _pool(6)
        _, a = await staging.take(FMT, 1, 3)
        cost = ReadCost(descriptor_us=1e7, gbps=200.0)
        span = asyncio.ensure_future(staging.take_span(FMT, 1, np.array([7, 4]), cost, 1.0))
        await asyncio.sleep(0)
        assert staging.waiting == 1  # 4 slots for blocks 4..7, 3 free
        staging.keep_out(a)  # 3 slots at most can ever be free
        staged = await asyncio.wait_for(span, 0.5)
        assert staged.gaps is None and staged.run == (3, 2) and staged.waited == "gave_up"
        assert staged.pos.tolist() == [1, 0]  # still in remote order
        staging.give(staged.run)
        assert _free(staging) == 3

    asyncio.run(main())


def test_a_waiter_refused_by_a_kept_out_run_but_cancelled_before_it_resumes_ends_cancelled():
    """Stopped (Abort, deadline) in the same loop pass as its refusal, a waiter ends cancelled, as a stopped
    pull must, and takes nothing with it."""

    async def main():
        staging = _pool(8)
        _, a = await staging.take(FMT, 1, 4)
        _, b = await staging.take(FMT, 1, 4)
        big = asyncio.ensure_future(staging.take(FMT, 1, 6))
        await asyncio.sleep(0)
        staging.keep_out(a)
        big.cancel()
        with pytest.raises(asyncio.CancelledError):
            await big
        staging.give(b)
        assert _free(staging) == 4 and staging.waiting == 0

    asyncio.run(main())
