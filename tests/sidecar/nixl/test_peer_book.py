"""``PeerBook``'s rules, pure: which peers a new admission replaces, which remote agent it shares."""

from __future__ import annotations

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


@pytest.mark.parametrize(
    ("generation", "metadata", "replaced"),
    [(1, b"meta-a", False), (2, b"meta-a", True), (1, b"meta-b", True)],
    ids=["re-admitted alike", "newer generation", "other metadata"],
)
def test_the_same_engine_is_replaced_by_a_newer_generation_or_other_metadata(generation, metadata, replaced):
    old = P("e")
    book = book_with(old)
    assert book.replaced_by(("e", 0), generation, metadata, old.address, 0) == ([old] if replaced else [])


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
