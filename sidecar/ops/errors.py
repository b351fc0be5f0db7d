"""The one error type of a start-up the operator must fix: ``kv-sidecar serve`` prints it as one line."""

from __future__ import annotations


class StartupError(RuntimeError):
    """The daemon cannot start as configured; ``key`` names the setting to fix."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason
