"""What the parts of ``kv-sidecar bench e2e`` share: its error and the devices it accepts (cpu, cuda:N)."""

from __future__ import annotations

import re

_DEVICE = re.compile(r"cpu|cuda:(\d+)")


class BenchError(RuntimeError):
    """A part of the bench could not run as asked (a failed pull, a process that did not start, ...)."""


def parse_device(text: str) -> int | None:
    """``"cpu"`` -> None, ``"cuda:N"`` -> N; anything else is refused."""
    m = _DEVICE.fullmatch(text)
    if m is None:
        raise BenchError(f"device {text!r}: use cpu or cuda:N")
    return None if m.group(1) is None else int(m.group(1))
