"""The two ways a Pull or a registration ends badly: ``Refused`` (cannot be served as asked) or ``Failed``."""

from __future__ import annotations


class Refused(Exception):
    """A Pull or registration that cannot be served as asked; ``field`` names why (counted per field)."""

    def __init__(self, field: str, reason: str, notify_peer: object = None) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason
        # A refused prefill that can still be told to free the request's blocks (see TransferPort.connect).
        self.notify_peer = notify_peer


class Inadmissible(Refused):
    """A prefill rank that answered its handshake but that this daemon's admission rules refuse."""


class Failed(Exception):
    """A Pull that went wrong on the way (transfer, lease, conversion)."""


def reason_of(exc: BaseException) -> str:
    """An exception as a one-line reason (its type when it has no message)."""
    return str(exc) or type(exc).__name__


class PeerLost(Failed):
    """A read found the prefill gone (restarted?): the next request to it handshakes again."""
