"""Rate-limited logging: one line per key per interval, then how many were left out.

A peer that sends 100,000 bad messages must not write 100,000 log lines; the counters in metrics keep
the exact numbers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class RateLimitedLog:
    """``log(key, level, msg, *args)`` writes at most once per ``interval_s`` for each key."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 10.0,
        on_suppressed: Callable[[], None] | None = None,
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._on_suppressed = on_suppressed
        self._next: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def log(self, key: str, level: int, msg: str, *args: object) -> bool:
        """Log unless ``key`` logged within the interval; True when written."""
        now = time.monotonic()
        if now < self._next.get(key, 0.0):
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            if self._on_suppressed is not None:
                self._on_suppressed()
            return False
        left_out = self._suppressed.pop(key, 0)
        if left_out:
            msg = f"{msg} (and {left_out} more like it in the last {self._interval_s:g} s)"
        self._logger.log(level, msg, *args)
        self._next[key] = now + self._interval_s
        return True
