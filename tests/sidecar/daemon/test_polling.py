"""The poll logic: the pacer's decisions (pure), the Poller's loop on a real event loop, the reads' pass
(launch first, then notify) on ``FakePort``, and the conversions' event pass with scripted events."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from sidecar.daemon.conversion import Conversions
from sidecar.daemon.polling import Pacer, Poller
from sidecar.daemon.reads import Reads
from sidecar.standins.fake_transfer import FakePort, FakeRead

# ---------------------------------------------------------------------------------------------- the pacer


def pacer(busy: float = 0.05, interval: float = 0.001) -> Pacer:
    return Pacer(lambda: busy, lambda: interval)


def test_idle_sleeps_until_woken():
    assert pacer().after_pass(0.0, changed=False, in_flight=False) is None
    assert pacer().after_pass(0.0, changed=True, in_flight=False) is None


def test_in_flight_polls_hot_within_busy_window_of_last_change():
    pc = pacer(busy=0.05)
    assert pc.after_pass(10.0, changed=True, in_flight=True) == 0.0
    assert pc.after_pass(10.049, changed=False, in_flight=True) == 0.0
    assert pc.after_pass(10.05, changed=False, in_flight=True) == 0.001  # busy window spent: the timer
    assert pc.after_pass(11.0, changed=False, in_flight=True) == 0.001
    assert pc.after_pass(11.001, changed=True, in_flight=True) == 0.0  # progress: hot again


def test_wake_starts_a_busy_window():
    pc = pacer(busy=0.05)
    assert pc.after_pass(5.0, changed=False, in_flight=True) == 0.001  # never changed: the timer
    pc.woken(5.0)
    assert pc.after_pass(5.01, changed=False, in_flight=True) == 0.0
    assert pc.after_pass(5.06, changed=False, in_flight=True) == 0.001


def test_linger_keeps_passing_after_the_last_change_then_sleeps():
    pc = Pacer(lambda: 0.05, lambda: 0.001, lambda: 0.2)
    assert pc.after_pass(3.0, changed=False, in_flight=False) is None  # nothing ever happened: asleep
    assert pc.after_pass(3.0, changed=True, in_flight=False) == 0.0  # the last read landed: stay awake
    assert pc.after_pass(3.199, changed=False, in_flight=False) == 0.0
    assert pc.after_pass(3.2, changed=False, in_flight=False) is None  # lingered long enough
    pc.woken(4.0)  # a new Pull put work in flight, then it ended
    assert pc.after_pass(4.1, changed=False, in_flight=False) == 0.0
    assert pc.after_pass(4.3, changed=False, in_flight=False) is None


def test_zero_busy_window_is_timer_only():
    pc = pacer(busy=0.0, interval=0.002)
    pc.woken(1.0)
    assert pc.after_pass(1.0, changed=True, in_flight=True) == 0.002


def test_settings_are_read_live():
    settings = {"busy": 0.05, "interval": 0.001}
    pc = Pacer(lambda: settings["busy"], lambda: settings["interval"])
    pc.woken(0.0)
    assert pc.after_pass(0.01, changed=False, in_flight=True) == 0.0
    settings["busy"] = 0.0
    settings["interval"] = 0.004
    assert pc.after_pass(0.01, changed=False, in_flight=True) == 0.004


# ---------------------------------------------------------------------------------------------- the loop


class Countdown:
    """A source in flight for ``n`` passes, then done (changed on its last pass)."""

    def __init__(self, n: int) -> None:
        self.left = n
        self.passes = 0

    def __call__(self, now: float) -> tuple[bool, bool]:
        self.passes += 1
        if self.left <= 0:
            return False, False
        self.left -= 1
        return self.left == 0, self.left > 0


async def _run(poller: Poller, body):
    task = asyncio.create_task(poller.loop())
    try:
        await asyncio.sleep(0)
        return await body()
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_poller_busy_polls_without_timer_then_sleeps_when_idle():
    async def main():
        poller = Poller(Pacer(lambda: 10.0, lambda: 1.0))  # a timer would take a second per pass
        src = Countdown(200)
        poller.add(src)

        async def body():
            t0 = time.monotonic()
            poller.wake()
            while src.left:
                await asyncio.sleep(0)
            elapsed = time.monotonic() - t0
            passes = poller.passes
            await asyncio.sleep(0.05)  # idle: the loop must not pass again
            return elapsed, passes, poller.passes

        return await _run(poller, body)

    elapsed, passes, later = asyncio.run(main())
    assert elapsed < 0.5  # 200 passes, no 1 s timer between them
    assert later == passes


def test_poller_lingers_awake_after_the_last_landing_then_sleeps():
    async def main():
        poller = Poller(Pacer(lambda: 10.0, lambda: 1.0, lambda: 0.1))
        src = Countdown(5)
        poller.add(src)

        async def body():
            poller.wake()
            while src.left:
                await asyncio.sleep(0)
            ended = poller.passes
            await asyncio.sleep(0.03)  # within the linger: still passing with nothing in flight
            lingering = poller.passes
            await asyncio.sleep(0.15)  # past it: asleep
            settled = poller.passes
            await asyncio.sleep(0.05)
            return ended, lingering, settled, poller.passes

        return await _run(poller, body)

    ended, lingering, settled, later = asyncio.run(main())
    assert lingering > ended
    assert later == settled


def test_poller_falls_back_to_the_timer_without_progress():
    async def main():
        poller = Poller(Pacer(lambda: 0.02, lambda: 0.01))
        stuck = Countdown(10**9)
        poller.add(stuck)

        async def body():
            poller.wake()
            await asyncio.sleep(0.02)  # the busy window
            before = poller.passes
            await asyncio.sleep(0.2)  # timer phase: about 20 passes, not thousands
            return poller.passes - before

        return await _run(poller, body)

    passes = asyncio.run(main())
    assert 3 <= passes <= 40


def test_a_source_that_raises_does_not_stop_the_loop():
    async def main():
        poller = Poller(Pacer(lambda: 0.05, lambda: 0.001))

        def broken(now):
            raise RuntimeError("bug")

        src = Countdown(5)
        poller.add(broken)
        poller.add(src)

        async def body():
            poller.wake()
            for _ in range(200):
                await asyncio.sleep(0)
                if not src.left:
                    break
            return src.left

        return await _run(poller, body)

    assert asyncio.run(main()) == 0


# ---------------------------------------------------------------------------------------------- the reads


def _job(port: FakePort, req: str, groups: list[tuple[int, int]]):
    read = FakeRead(
        SimpleNamespace(name="peer", tp_rank=0, notif_count=1),
        f"r-{req}",
        time.monotonic() + 30,
        list(groups),
        "direct",
    )
    read.handles = [object() for _ in groups]
    return SimpleNamespace(read=read, req_id=req, first_landed=None, timings={})  # what Reads uses of a Job


def test_reads_launch_the_last_group_before_notifying_the_prefill():
    async def main():
        port = FakePort()
        launches: list[tuple[int, int, int]] = []  # (first, last, notifications sent at the launch)
        woken: list[int] = []
        reads = Reads(
            port, lambda: woken.append(1), lambda job, a, b: launches.append((a, b, len(port.notified)))
        )
        job = _job(port, "a", [(0, 2), (2, 4)])
        wait = asyncio.ensure_future(reads.wait(job))
        await asyncio.sleep(0)
        assert woken  # posting a wait wakes the poller
        assert reads.poll(time.monotonic()) == (True, False)
        await wait
        return launches, port.notified

    launches, notified = asyncio.run(main())
    assert launches == [(0, 2, 0), (2, 4, 0)]  # both launched while the prefill was not yet told
    assert notified == ["r-a"]


def test_reads_pass_reports_progress_and_in_flight():
    async def main():
        port = FakePort()
        port.auto_land = False
        reads = Reads(port, lambda: None, lambda job, a, b: None)
        job = _job(port, "b", [(0, 2), (2, 4)])
        wait = asyncio.ensure_future(reads.wait(job))
        await asyncio.sleep(0)
        now = time.monotonic()
        quiet = reads.poll(now)
        port.land(job.read)
        landed = reads.poll(now)
        port.land(job.read)
        last = reads.poll(now)
        await wait
        return quiet, landed, last, reads.poll(now)

    quiet, landed, last, idle = asyncio.run(main())
    assert quiet == (False, True)
    assert landed == (True, True)
    assert last == (True, False)
    assert idle == (False, False)


def test_background_calls_run_in_order_on_the_poster_then_come_back_to_the_loop(caplog):
    """``in_background``: after the poster's earlier calls, off the loop's thread; a failure is logged, not
    raised; ``then`` and the poller's wake run on the loop once the call is over; a closed poster refuses."""

    async def main():
        reads = Reads(FakePort(), lambda: woken.append(threading.get_ident()), lambda job, a, b: None)
        loop_thread = threading.get_ident()
        order: list[tuple[str, int]] = []
        first = reads.on_poster(lambda: (time.sleep(0.05), order.append(("awaited", threading.get_ident()))))
        came_back = asyncio.Event()

        def then(name: str) -> None:
            order.append((name, threading.get_ident()))
            if name == "then-2":
                came_back.set()

        bg = lambda: order.append(("bg-1", threading.get_ident()))  # noqa: E731
        reads.in_background(bg, then=lambda: then("then-1"))
        reads.in_background(lambda: 1 / 0, then=lambda: then("then-2"))
        await first
        await asyncio.wait_for(came_back.wait(), 5)
        reads.close()
        with pytest.raises(RuntimeError):
            reads.in_background(lambda: None)
        return loop_thread, order

    woken: list[int] = []
    with caplog.at_level(logging.WARNING, logger="kv_sidecar.reads"):
        loop_thread, order = asyncio.run(main())
    names = [name for name, _ in order]
    assert names.index("awaited") < names.index("bg-1") < names.index("then-1") < names.index("then-2")
    threads = dict(order)
    assert threads["bg-1"] != loop_thread and threads["then-1"] == threads["then-2"] == loop_thread
    assert len(woken) >= 3 and set(woken) == {loop_thread}  # each poster call woke the poller, on the loop
    assert "ZeroDivisionError" in caplog.text


def test_poster_calls_are_handed_over_once_the_loops_ready_callbacks_have_run():
    """Two Pulls' first steps in one loop pass: neither post begins while the other still has its step to
    run (a post's Python would hold the GIL against it), both run in order after; close() hands over what
    is still held back before it waits."""

    async def main():
        reads = Reads(FakePort(), lambda: None, lambda job, a, b: None)
        ran: list[str] = []
        seen: list[list[str]] = []

        async def first_step(name: str) -> None:
            fut = reads.on_poster(lambda: ran.append(name))
            time.sleep(0.02)  # the rest of the step's loop work: a post handed over at once would run now
            seen.append(list(ran))
            await fut

        await asyncio.gather(first_step("a"), first_step("b"))
        reads.in_background(lambda: ran.append("last"))
        reads.close()  # without a yield in between
        return ran, seen

    ran, seen = asyncio.run(main())
    assert seen == [[], []]
    assert ran == ["a", "b", "last"]


def test_poster_calls_settle_their_futures_and_a_call_cancelled_before_its_turn_never_runs():
    async def main():
        reads = Reads(FakePort(), lambda: None, lambda job, a, b: None)
        ran: list[str] = []
        slow = reads.on_poster(lambda: (time.sleep(0.05), ran.append("slow"))[1] or "slow done")
        skipped = reads.on_poster(lambda: ran.append("skipped"))
        failing = reads.on_poster(lambda: 1 / 0)
        skipped.cancel()  # before the poster reached it
        assert await slow == "slow done"
        with pytest.raises(ZeroDivisionError):
            await failing
        reads.close()
        return ran, reads._submitted, reads._returned

    ran, submitted, returned = asyncio.run(main())
    assert ran == ["slow"]
    assert submitted == returned == 3  # the skipped call still counts as returned (the inline post's check)


# ---------------------------------------------------------------------------------------------- the events


class FakeEvent:
    """A CUDA event stand-in: ``query()`` is False until ``ready``, or raises ``error``."""

    def __init__(self) -> None:
        self.ready = False
        self.error: Exception | None = None
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        if self.error is not None:
            raise self.error
        return self.ready


def test_conversion_events_end_when_queried_done():
    async def main():
        woken: list[int] = []
        conv = Conversions(None, wake=lambda: woken.append(1))
        try:
            a, b = FakeEvent(), FakeEvent()
            fa, fb = conv.watch(a), conv.watch(b)
            assert len(woken) == 2
            first = conv.poll(0.0)
            a.ready = True
            second = conv.poll(0.0)
            b.error = RuntimeError("CUDA error: an illegal memory access")
            third = conv.poll(0.0)
            return first, second, third, fa, fb, conv.poll(0.0)
        finally:
            conv.close()

    first, second, third, fa, fb, idle = asyncio.run(main())
    assert first == (False, True)
    assert second == (True, True)
    assert fa.done() and fa.result() is None
    assert third == (True, False)
    assert isinstance(fb.exception(), RuntimeError)
    assert idle == (False, False)


def test_gpu_job_waits_on_its_event_through_the_poller():
    """``done`` of a job with a GPU event: the wait ends when the poller sees the event, not before."""

    async def main():
        poller = Poller(Pacer(lambda: 0.05, lambda: 0.001))
        conv = Conversions(None, wake=poller.wake)
        poller.add(conv.poll)
        event = FakeEvent()
        from sidecar.daemon.conversion import JobConversion

        job = SimpleNamespace(conversion=JobConversion(src=None, last_event=event, layers=2))
        task = asyncio.create_task(poller.loop())
        try:
            done = conv.done(job)
            for _ in range(20):
                await asyncio.sleep(0)
            early = done.done()
            event.ready = True
            await asyncio.wait_for(asyncio.shield(done), 1.0)
            return early, event.queries
        finally:
            task.cancel()
            conv.close()

    early, queries = asyncio.run(main())
    assert not early
    assert queries >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_a_real_cuda_event_is_seen_by_the_poller_only_once_its_work_ended():
    """A torch.cuda.Event after ~20 ms of GPU sleep: the poller's query() wait ends after it, not before,
    and the loop stays free meanwhile (no thread blocked in synchronize)."""

    async def main():
        poller = Poller(Pacer(lambda: 0.05, lambda: 0.001))
        conv = Conversions(None, wake=poller.wake)
        poller.add(conv.poll)
        task = asyncio.create_task(poller.loop())
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                torch.cuda._sleep(int(2e7))  # ~20 ms of cycles on any current GPU
                event = torch.cuda.Event()
                event.record(stream)
            t0 = time.monotonic()
            fut = conv.watch(event)
            ticks = 0
            while not fut.done():
                ticks += 1
                await asyncio.sleep(0)
            return time.monotonic() - t0, ticks, event.query()
        finally:
            task.cancel()
            conv.close()

    waited, ticks, ended = asyncio.run(main())
    assert ended
    assert waited > 0.001 and ticks > 10  # it waited for the GPU, and the loop kept turning meanwhile
