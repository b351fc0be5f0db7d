"""What the decoder tells a prefill over NIXL's ``send_notif`` (``Notifier``): a request's completion
notification ``id:n`` (its blocks may be freed) and heartbeats ``HB:id1,id2`` (its lease renewed). The bytes
come from ``sidecar.wire.prefill``, each checked before it goes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sidecar.nixl.calls import nixl_call
from sidecar.nixl.errors import RequestRefused
from sidecar.wire import prefill as vllm_wire

if TYPE_CHECKING:
    from sidecar.nixl.remote_peers import Peer


def _encode(encoder, *args) -> bytes:
    """A message for a stock prefill, validated: a malformed one would crash its engine, so never send it."""
    try:
        return encoder(*args)
    except vllm_wire.WireError as exc:
        raise RequestRefused(exc.reason, exc.field) from exc


class Notifier:
    """The notifications and heartbeats of one agent to the remote agents it loaded."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent  # the serialized NIXL agent

    @staticmethod
    def check(remote_request_id: str, readers: int = 1) -> None:
        """Refuse (RequestRefused) a request whose notification could not be sent: at its start, not when the
        notification is owed."""
        _encode(vllm_wire.encode_notification, remote_request_id, readers)

    def notify(self, peer: Peer, remote_request_id: str, readers: int = 1) -> None:
        """A notification without reads (full prefix hit): the prefill frees the request's blocks."""
        self.notify_agent(peer.agent_name, remote_request_id, readers)

    def notify_agent(self, agent_name: str, remote_request_id: str, readers: int = 1) -> None:
        """A notification to any loaded agent (a refused prefill's too: ``RemotePeers.load_notify_only``)."""
        msg = _encode(vllm_wire.encode_notification, remote_request_id, readers)
        nixl_call("send_notif", self.agent.send_notif, agent_name, msg)

    def heartbeat(self, peer: Peer, remote_request_ids: Sequence[str]) -> None:
        """Renew the prefill's lease on these requests (``HB:id1,id2``)."""
        if not remote_request_ids:
            return
        msg = _encode(vllm_wire.encode_heartbeat, list(remote_request_ids))
        nixl_call("send_notif", self.agent.send_notif, peer.agent_name, msg)

    def progress(self) -> None:
        """Let NIXL move what is queued when no progress thread does: a call in that takes the notifications
        received (a decoder is sent none it needs). TransferError if NIXL fails."""
        nixl_call("get_new_notifs", self.agent.get_new_notifs)
