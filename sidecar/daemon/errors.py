"""The two ways a Pull or a registration ends badly: ``Refused`` (cannot be served as asked) or ``Failed``."""

from __future__ import annotations


class Refused(Exception):
    """A Pull or registration that cannot be served as asked; ``field`` names why (counted per field)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class Failed(Exception):
    """A Pull that went wrong on the way (transfer, lease, conversion)."""
