"""Polling: one loop that checks what is in flight (NIXL reads, the conversions' GPU events) without timers.

While work is in flight the loop polls pass after pass, yielding to the event loop in between
(``asyncio.sleep(0)``: a Pull or a socket reply still gets in), so a READ or an event is seen DONE within one
pass instead of up to a timer tick later (uvloop's timers have millisecond resolution). That busy phase costs
a core while it lasts, so it lasts only ``poll_busy_s`` after the last pass that saw something change; after
that the loop falls back to a ``poll_interval_s`` timer (a stuck read does not burn a core). With nothing in
flight it keeps passing for ``poll_linger_s`` after the last change (meant for the next Pull to find the
core awake; on the H200 host it helped in one run and not in another, README), then sleeps on an
``asyncio.Event`` that ``wake()`` sets: an idle daemon uses no CPU here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

log = logging.getLogger("kv_sidecar.polling")

# A source's pass: (did anything change, is anything still in flight).
Pass = Callable[[float], tuple[bool, bool]]


class Pacer:
    """When to poll next. Pure: fed each pass's outcome and the clock, answers how long to wait.

    ``None``: nothing in flight, sleep until woken; ``0.0``: poll again after one yield; ``> 0``: a timer.
    """

    def __init__(
        self,
        busy_s: Callable[[], float],
        interval_s: Callable[[], float],
        linger_s: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self._busy_s = busy_s
        self._interval_s = interval_s
        self._linger_s = linger_s
        self._last_change = float("-inf")

    def woken(self, now: float) -> None:
        """New work was put in flight: it counts as a change (poll hot from here)."""
        self._last_change = now

    def after_pass(self, now: float, changed: bool, in_flight: bool) -> float | None:
        if changed:
            self._last_change = now
        if not in_flight:
            return 0.0 if now - self._last_change < self._linger_s() else None
        if now - self._last_change < self._busy_s():
            return 0.0
        return self._interval_s()


class Poller:
    """Runs each registered pass until nothing is in flight; ``wake()`` when something new is. ``pacer``
    says how long to wait between passes."""

    def __init__(self, pacer: Pacer) -> None:
        self._pacer = pacer
        self._passes: list[Pass] = []
        self._wakeup: asyncio.Event | None = None
        self.passes = 0  # passes run so far (tests and the busy-poll cost)

    def add(self, poll_pass: Pass) -> None:
        self._passes.append(poll_pass)

    def wake(self) -> None:
        """Something was put in flight: poll now, and hot."""
        self._pacer.woken(time.monotonic())
        if self._wakeup is not None:
            self._wakeup.set()

    def run_pass(self, now: float) -> tuple[bool, bool]:
        """One pass over every source: (changed, in flight)."""
        changed = in_flight = False
        for poll_pass in self._passes:
            try:
                c, f = poll_pass(now)
            except Exception:  # noqa: BLE001 - a source's bug must not stop the others' completions
                log.exception("poll pass failed")
                c, f = False, True
            changed |= c
            in_flight |= f
        self.passes += 1
        return changed, in_flight

    async def loop(self) -> None:
        self._wakeup = wakeup = asyncio.Event()
        loop = asyncio.get_running_loop()
        while True:
            wakeup.clear()  # cleared before the pass: a wake() during it makes the next wait return at once
            now = time.monotonic()
            changed, in_flight = self.run_pass(now)
            wait = self._pacer.after_pass(now, changed, in_flight)
            if wait is None:
                await wakeup.wait()
            elif wait == 0.0:
                await asyncio.sleep(0)
            else:
                timer = loop.call_later(wait, wakeup.set)  # a timer, cut short by new work
                try:
                    await wakeup.wait()
                finally:
                    timer.cancel()
