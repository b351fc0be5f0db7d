"""``NixlPort``'s calls into NIXL that are not reads, on a real ``NixlTransfer`` over a stub NIXL agent that
fails where told: each failure a typed ``TransferError``, or (where the port can go on) a logged warning. What
NIXL itself does with remote agents is tested on real NIXL in test_remote_agents.py."""

from __future__ import annotations

import pytest

from sidecar.daemon.port import PeerTarget
from sidecar.nixl import agent as agent_mod
from sidecar.nixl.agent import TransferSettings
from sidecar.nixl.errors import TransferFailed
from sidecar.nixl.port import NixlPort


class nixlBackendError(Exception):  # noqa: N801 - named as NIXL's own are (``map_nixl_error`` maps by name)
    pass


class StubNixl:
    """NIXL's agent as far as loading remote agents and progress go; the calls in ``fail`` raise."""

    def __init__(self, fail: set[str] | None = None) -> None:
        self.fail = fail or set()
        self.loaded: set[str] = set()

    def _enter(self, call: str) -> None:
        if call in self.fail:
            raise nixlBackendError(f"{call} failed")

    def add_remote_agent(self, metadata: bytes) -> bytes:
        self._enter("add_remote_agent")
        self.loaded.add(metadata.decode())
        return metadata  # the agent's name: its metadata bytes here

    def make_connection(self, name: str) -> None:
        self._enter("make_connection")

    def remove_remote_agent(self, name: str) -> None:
        self._enter("remove_remote_agent")
        self.loaded.discard(name)

    def get_new_notifs(self) -> dict:
        self._enter("get_new_notifs")
        return {}


def port_on(monkeypatch: pytest.MonkeyPatch, nixl: StubNixl) -> NixlPort:
    monkeypatch.setattr(agent_mod, "_create_agent", lambda name, settings: nixl)
    return NixlPort(TransferSettings())


TARGET = PeerTarget("engine-a", 0, "127.0.0.1", 5600, generation=1)


def test_progress_failing_in_nixl_is_a_typed_error(monkeypatch):
    """The daemon's progress loop logs what ``progress`` raises and goes on: a TransferError, like every other
    failure of the port, not NIXL's own exception class."""
    port = port_on(monkeypatch, StubNixl(fail={"get_new_notifs"}))
    with pytest.raises(TransferFailed) as e:
        port.progress()
    assert "get_new_notifs" in str(e.value)


def test_an_admitted_prefill_takes_over_its_notify_only_agent(monkeypatch):
    """A prefill refused (loaded only to be notified) is admitted after a reload: the peer reads through the
    agent its notify-only load holds. Admission let that load go and loaded the agent again: a failed
    ``make_connection`` then left the rank with neither a peer nor a load to tell it through (its refused
    requests' blocks left to their lease), and a working one cost a remove and a load for nothing."""
    nixl = StubNixl()
    port = port_on(monkeypatch, nixl)
    told = port._notify_only_peer(TARGET, b"prefill-agent")
    assert told is not None and nixl.loaded == {"prefill-agent"}
    nixl.fail.update({"make_connection", "add_remote_agent", "remove_remote_agent"})
    with pytest.raises(TransferFailed, match="make_connection"):
        port._load(TARGET, b"prefill-agent", None, None, None, 1)
    assert port._notify_only_peer(TARGET, b"prefill-agent") is told  # still loaded, still told through
    nixl.fail.discard("make_connection")
    peer = port._load(TARGET, b"prefill-agent", None, None, None, 1)
    assert peer.agent_name == "prefill-agent" and port.agent.peer("engine-a", 0) is peer
    assert nixl.loaded == {"prefill-agent"}
    assert port.let_go_notify_only(-1.0) == 0  # the record went to the peer: nothing left to let go
