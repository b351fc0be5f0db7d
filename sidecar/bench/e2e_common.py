"""What ``kv-sidecar bench e2e``'s parts share, and ``bench loop`` and ``bench interference`` with them: the
bench's error, the devices it accepts (cpu, cuda:N) and ``--daemon-set``'s settings."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Sequence
from typing import Any

_DEVICE = re.compile(r"cpu|cuda:(\d+)")


class BenchError(RuntimeError):
    """A part of the bench could not run as asked (a failed pull, a process that did not start, ...)."""


def parse_device(text: str) -> int | None:
    """``"cpu"`` -> None, ``"cuda:N"`` -> N; anything else is refused."""
    m = _DEVICE.fullmatch(text)
    if m is None:
        raise BenchError(f"device {text!r}: use cpu or cuda:N")
    return None if m.group(1) is None else int(m.group(1))


def daemon_settings(items: Sequence[str]) -> dict[str, str]:
    """``KEY=VALUE`` pairs (TOML values) for the daemons' config files, each checked here: a value the
    daemons could not read would only show as their exit before ready."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise BenchError(f"--daemon-set {item!r}: use KEY=VALUE with a TOML value")
        _toml_value(key, value)
        out[key] = value
    return out


def toml_values(settings: dict[str, str]) -> dict[str, Any]:
    """``daemon_settings``' TOML texts as values (``--daemon-set`` read in-process, as a daemon reads it)."""
    return {k: _toml_value(k, v) for k, v in settings.items()}


def _toml_value(key: str, text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        raise BenchError(
            f"--daemon-set {key}: {text!r} is not a TOML value (a string is quoted: {key}='\"{text}\"')"
        ) from None
