"""``PeerBook``'s rules, pure: which peers a new admission replaces, which remote agent it shares."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from sidecar.nixl.errors import PeerConflict, RemoteRefused
from sidecar.nixl.peer_book import PeerBook


@dataclass(eq=False)
class P:
    engine_id: str
    tp_rank: int = 0
    generation: int = 1
    address: str = "10.0.0.1:5600"
    agent_name: str = "agent-a"
    agent_metadata: bytes = b"meta-a"
    unloaded: bool = False

    @property
    def key(self) -> tuple[str, int]:
        return (self.engine_id, self.tp_rank)


def book_with(*peers: P) -> PeerBook:
    book = PeerBook()
    for peer in peers:
        book.add(peer)
    return book


def test_an_older_generation_is_refused_naming_the_field_as_a_conflict_not_a_rule():
    """What is loaded turns it down, not the admission rules (``RemoteRefused``): the daemon does not
    remember it as their refusal."""
    book = book_with(P("e", generation=2))
    with pytest.raises(PeerConflict) as e:
        book.replaced_by(("e", 0), 1, b"meta-a", "10.0.0.1:5600", 0)
    assert e.value.field == "remote_registration_generation"
    assert not isinstance(e.value, RemoteRefused)


# (loaded generation, admitted generation, metadata) -> what the admission does to the loaded peer. 0 is
# unknown (a heartbeat's handshake, a prefill before vLLM's connector v15): neither older nor newer than any.
OUTCOMES = {  # every pair of loaded (0, 2) and admitted (0 to 3) generations, with either metadata
    (2, 0, b"meta-a"): "alike",
    (2, 0, b"meta-b"): "replaced",
    (2, 1, b"meta-a"): "conflict",
    (2, 1, b"meta-b"): "conflict",
    (2, 2, b"meta-a"): "alike",
    (2, 2, b"meta-b"): "replaced",
    (2, 3, b"meta-a"): "replaced",
    (2, 3, b"meta-b"): "replaced",
    (0, 0, b"meta-a"): "alike",
    (0, 0, b"meta-b"): "replaced",
    (0, 1, b"meta-a"): "alike",
    (0, 1, b"meta-b"): "replaced",
    (0, 2, b"meta-a"): "alike",
    (0, 2, b"meta-b"): "replaced",
    (0, 3, b"meta-a"): "alike",
    (0, 3, b"meta-b"): "replaced",
}


@pytest.mark.parametrize(("loaded", "generation", "metadata"), list(OUTCOMES))
def test_the_same_engine_is_replaced_by_a_newer_known_generation_or_other_metadata(
    loaded, generation, metadata
):
    old = P("e", generation=loaded)
    book = book_with(old)
    outcome = OUTCOMES[(loaded, generation, metadata)]
    if outcome == "conflict":
        with pytest.raises(PeerConflict, match=f"generation {generation} is older than the loaded {loaded}"):
            book.replaced_by(("e", 0), generation, metadata, old.address, 0)
    else:
        replaced = book.replaced_by(("e", 0), generation, metadata, old.address, 0)
        assert replaced == ([old] if outcome == "replaced" else [])


def test_an_unknown_generation_re_admitted_alike_leaves_the_known_one_in_force():
    """A heartbeat's handshake (generation 0) re-admits a prefill whose generation 2 peer a pull still reads
    through: it is current, but says nothing of the generation, so an older one is still refused and a newer
    one still replaces the generation 2 peer (the unknown one, the same metadata, reads on)."""
    known = P("e", generation=2)
    book = book_with(known)
    assert book.replaced_by(("e", 0), 0, b"meta-a", known.address, 0) == []
    book.add(unknown := P("e", generation=0))
    assert book.current(("e", 0)) is unknown
    with pytest.raises(PeerConflict, match="generation 1 is older than the loaded 2"):
        book.replaced_by(("e", 0), 1, b"meta-a", known.address, 0)
    assert book.replaced_by(("e", 0), 0, b"meta-a", known.address, 0) == []
    assert book.replaced_by(("e", 0), 2, b"meta-a", known.address, 0) == []
    assert book.replaced_by(("e", 0), 3, b"meta-a", known.address, 0) == [known]
    assert book.replaced_by(("e", 0), 0, b"meta-b", known.address, 0) == [known, unknown]
    assert book.unload(known)  # its pull let go: nothing of a known generation is loaded
    assert book.replaced_by(("e", 0), 1, b"meta-a", known.address, 0) == []


def test_another_engine_at_the_same_address_and_rank_is_replaced_whatever_either_generation():
    """Another engine at the same address and rank is replaced whatever either generation is."""
    for loaded, generation in itertools.product([0, 2], [0, 1, 2, 3]):
        old = P("old", generation=loaded)
        book = book_with(old)
        assert book.replaced_by(("new", 0), generation, b"meta-n", old.address, 0) == [old]


def test_another_engine_at_the_same_address_and_rank_replaces_it_not_at_another_rank():
    old, other_rank = P("old"), P("old", tp_rank=1, agent_name="agent-b", agent_metadata=b"meta-b")
    book = book_with(old, other_rank)
    assert book.replaced_by(("new", 0), 1, b"meta-n", old.address, 0) == [old]
    assert book.replaced_by(("new", 0), 1, b"meta-n", "10.0.0.2:5600", 0) == []


def test_a_newer_generation_replaces_every_readable_peer_of_the_key_and_address():
    """A reload re-admitted the prefill alike (the old peer stays readable for a pull holding it); then it
    registered again: both peers are unloaded, else that pull would read the older registration's regions.
    A restarted engine at the same address replaces a retired peer of the old engine too."""
    old = P("e")
    book = book_with(old)
    assert book.replaced_by(("e", 0), 1, b"meta-a", old.address, 0) == []  # alike: reads on
    book.add(new := P("e"))
    assert book.replaced_by(("e", 0), 2, b"meta-b", old.address, 0) == [old, new]
    assert book.replaced_by(("restarted", 0), 1, b"meta-r", old.address, 0) == [old, new]


def test_a_re_admitted_peer_shares_the_agent_until_both_are_gone():
    old = P("e")
    book = book_with(old)
    assert book.agent_for(b"meta-a") == "agent-a" and book.agent_for(b"meta-b") is None
    new = P("e")  # re-admitted alike: current, the old one still loaded and readable
    book.add(new)
    assert book.current(("e", 0)) is new and book.loaded() == [old, new] and book.all_current() == [new]
    assert book.forget(old) and not book.forget(old)  # the daemon removes the old one, once
    assert book.unload(old) and book.agent_in_use("agent-a")  # the new one still reads through the agent
    assert book.current(("e", 0)) is new  # unloading a replaced peer leaves the current one
    assert book.forget(new) and book.unload(new) and not book.agent_in_use("agent-a")
    assert book.current(("e", 0)) is None and book.loaded() == []


def test_an_unloaded_peer_is_not_current_and_shares_nothing_but_stays_loaded():
    old = P("e")
    book = book_with(old)
    assert book.unload(old) and not book.unload(old)
    assert old.unloaded and book.current(("e", 0)) is None and book.loaded() == [old]
    assert book.agent_for(b"meta-a") is None and not book.agent_in_use("agent-a")
    assert book.replaced_by(("e", 0), 1, b"meta-a", old.address, 0) == []  # nothing current to replace
