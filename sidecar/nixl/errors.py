"""Typed failures of the NIXL side; ``field`` names the culprit, as every refusal in kv-sidecar does."""

from __future__ import annotations


class TransferError(RuntimeError):
    """Base of every failure of the transfer layer; ``field`` names the culprit when there is one."""

    def __init__(self, reason: str, field: str | None = None) -> None:
        super().__init__(f"{field}: {reason}" if field else reason)
        self.field = field
        self.reason = reason
        # A post that failed midway: what it had posted (stopped, notified), whose handles NIXL may not
        # have released yet. The caller must keep stopping it before the request's memory is reused.
        self.read: object = None


class RemoteRefused(TransferError):
    """The remote cannot be read: its metadata, format, identity or geometry disagree (at handshake)."""


class PeerConflict(TransferError):
    """An admitted remote the transport cannot load now: it conflicts with a prefill loaded already (a
    registration generation older than the loaded one's, an agent name another engine's peer reads
    through). What is loaded, not a rule: once that peer is let go, the same handshake may load."""


class RemoteDisconnected(TransferError):
    """The remote agent is gone (NIXL_ERR_REMOTE_DISCONNECT)."""


class TransferFailed(TransferError):
    """NIXL reported an error for a transfer or a call."""


class TransferTimeout(TransferError):
    """A pull did not finish before its deadline."""


class MappingUnavailable(TransferError):
    """A prefill's pages cannot be mapped here (no transport maps them, or their layout does not fit one
    source tensor): its requests read the usual way (``sidecar.nixl.mapping``)."""


class RequestRefused(TransferError):
    """A request's block ids do not fit the checked geometry (out of range, duplicates, too many)."""


def map_nixl_error(exc: BaseException, what: str) -> TransferError:
    """NIXL raises its own exception classes (from whichever of nixl_cu12/cu13/rocm); map them by name."""
    name = type(exc).__name__
    if name == "nixlRemoteDisconnectError":
        return RemoteDisconnected(f"{what}: remote agent disconnected ({exc})")
    if name == "nixlNotFoundError":
        return TransferFailed(f"{what}: not found — unknown remote or unregistered memory ({exc})")
    if name == "nixlInvalidParamError":
        return TransferFailed(f"{what}: invalid parameter ({exc})")
    return TransferFailed(f"{what}: {name}: {exc}")
