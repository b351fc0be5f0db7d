"""``RemotePeers`` on a stand-in NIXL agent: what a load turns down for what is loaded already."""

from __future__ import annotations

import struct
import threading

import pytest

from sidecar.nixl.errors import PeerConflict, RemoteRefused
from sidecar.nixl.remote_peers import RemotePeers
from sidecar.wire.nixl_metadata import INTRO


class Agent:
    """NIXL's remote-agent calls, by name: each metadata names the agent it was made from."""

    def __init__(self, names: dict[bytes, str]) -> None:
        self.names = names
        self.loaded: list[str] = []
        self.removed: list[str] = []

    def add_remote_agent(self, metadata: bytes) -> bytes:
        name = self.names[metadata]
        self.loaded.append(name)
        return name.encode()

    def make_connection(self, name: str) -> None:
        pass

    def remove_remote_agent(self, name: str) -> None:
        self.removed.append(name)


def _add(peers: RemotePeers, engine_id: str, metadata: bytes, address: str, generation: int = 1):
    return peers.add_peer(engine_id=engine_id, tp_rank=0, generation=generation, address=address,
                          agent_metadata=metadata, plan=None, regions=None)


def _metadata(name: str, rest: bytes) -> bytes:
    """NIXL 1.5 agent metadata as far as its first entry, the agent's name; ``rest`` tells them apart."""
    return INTRO + b"Agent" + struct.pack("<Q", len(name)) + name.encode() + b"|" + rest


@pytest.mark.parametrize("readable", [True, False])
def test_an_agent_name_another_engines_peer_reads_through_is_a_conflict_not_a_rule(readable):
    """Other metadata under an agent name a current peer of another engine reads through: what is loaded
    turns it down, not the admission rules (``RemoteRefused``), so the daemon does not remember it as their
    refusal; the other engine's peer reads on through its agent. The name read from the metadata, it is
    turned down before NIXL loads them over that agent; else (a format this reader does not know) once
    NIXL has loaded them."""
    a, b = (_metadata("agent-x", b"a"), _metadata("agent-x", b"b")) if readable else (b"meta-a", b"meta-b")
    agent = Agent({a: "agent-x", b: "agent-x"})
    peers = RemotePeers(agent, threading.RLock())
    first = _add(peers, "engine-a", a, "10.0.0.1:5600")
    with pytest.raises(PeerConflict) as e:
        _add(peers, "engine-b", b, "10.0.0.2:5600")
    assert e.value.field == "agent_metadata" and not isinstance(e.value, RemoteRefused)
    assert agent.loaded == (["agent-x"] if readable else ["agent-x", "agent-x"])
    assert peers.peer("engine-a", 0) is first and not first.unloaded and agent.removed == []
    assert peers.peer("engine-b", 0) is None
    peers.remove_peer(first)  # the peer in the way let go: the same load goes through
    assert _add(peers, "engine-b", b, "10.0.0.2:5600").agent_name == "agent-x"


def test_an_older_generation_than_the_loaded_one_is_a_conflict_and_leaves_the_loaded_peer():
    agent = Agent({b"meta-a": "agent-a"})
    peers = RemotePeers(agent, threading.RLock())
    newer = _add(peers, "e", b"meta-a", "10.0.0.1:5600", generation=2)
    with pytest.raises(PeerConflict) as e:
        _add(peers, "e", b"meta-a", "10.0.0.1:5600", generation=1)
    assert e.value.field == "remote_registration_generation"
    assert peers.peer("e", 0) is newer and not newer.unloaded and agent.loaded == ["agent-a"]


def test_a_notify_only_load_found_again_owes_the_n_of_its_new_refusal():
    """A prefill rank refused for a decoder at TP 1 ("id:1"), then, with the daemon and the prefill still
    up, for the decoder restarted at TP 2: the load is found again, and its notifications must say "id:2"
    (the prefill rank now waits for both decoder ranks), not the n of the first refusal. A refusal still
    being told under the old n keeps it."""
    agent = Agent({b"meta-a": "agent-a"})
    peers = RemotePeers(agent, threading.RLock())
    rank = dict(engine_id="e", tp_rank=0, address="10.0.0.1:5600", agent_metadata=b"meta-a")
    old = peers.load_notify_only(**rank, notif_count=1)
    new = peers.load_notify_only(**rank, notif_count=2)
    assert new.notif_count == 2 and new.agent_name == "agent-a" and agent.loaded == ["agent-a"]
    assert old.notif_count == 1
    assert peers.load_notify_only(**rank, notif_count=2) is new
