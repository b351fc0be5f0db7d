"""``PeerBook``: which prefill peers the agent has loaded, and which is current for each (engine id, rank).

Pure bookkeeping, no NIXL: ``RemotePeers`` makes the NIXL calls around it. The rules:

- A peer admitted again with the same generation and agent metadata (a reload's new rules) becomes current,
  and the one it replaces stays loaded and readable until the daemon removes it (once no pull reads through
  it).
- A higher generation, other metadata, or another engine at the same address and rank (a restarted prefill)
  replaces the current one, and any a re-admission left readable, at once: they are *unloaded* (no read goes
  through them) but stay loaded, their mappings open, until removed. A lower generation is refused
  (``PeerConflict``: what is loaded, not the admission rules).
- Generation 0 is unknown (a prefill older than vLLM's connector v15, which starts at 1, names none;
  nor does a heartbeat of requests that name none): neither higher nor lower than another, so only the
  metadata tells whether it replaces a peer, and it is never refused.
- Loaded peers may share one NIXL remote agent (the same metadata bytes); the agent is let go once no current
  peer uses it.
"""

from __future__ import annotations

from typing import Any

from sidecar.nixl.errors import PeerConflict

Key = tuple[str, int]  # (engine id, prefill rank)


class PeerBook:
    """The loaded peers (anything with ``key``, ``generation``, ``address``, ``tp_rank``, ``agent_name``,
    ``agent_metadata`` and a settable ``unloaded``)."""

    def __init__(self) -> None:
        self._current: dict[Key, Any] = {}
        self._loaded: dict[int, Any] = {}  # every peer added and not yet forgotten

    def current(self, key: Key) -> Any | None:
        return self._current.get(key)

    def all_current(self) -> list[Any]:
        return list(self._current.values())

    def loaded(self) -> list[Any]:
        return list(self._loaded.values())

    def replaced_by(
        self, key: Key, generation: int, metadata: bytes, address: str, tp_rank: int
    ) -> list[Any]:
        """The readable peers a new admission of ``key`` replaces at once (to unload), by the rules above: the
        current one and any a re-admission left readable, since a pull may still read through those too;
        PeerConflict for a generation older than a readable one's of ``key``."""
        newest = max((p.generation for p in self._readable() if p.key == key), default=0)
        if 0 < generation < newest:
            raise PeerConflict(
                f"generation {generation} is older than the loaded {newest}", "remote_registration_generation"
            )
        out = []
        for p in self._readable():
            if p.key == key:
                if generation > p.generation > 0 or metadata != p.agent_metadata:
                    out.append(p)
            elif p.address == address and p.tp_rank == tp_rank:
                out.append(p)
        return out

    def agent_for(self, metadata: bytes) -> str | None:
        """The remote agent a current peer loaded from these metadata bytes, if any (shared, not reloaded)."""
        return next((p.agent_name for p in self._readable() if p.agent_metadata == metadata), None)

    def agent_in_use(self, name: str) -> bool:
        """Whether a current peer reads through the remote agent ``name``."""
        return any(p.agent_name == name for p in self._readable())

    def add(self, peer: Any) -> None:
        """``peer`` loaded and current for its key."""
        self._current[peer.key] = peer
        self._loaded[id(peer)] = peer

    def unload(self, peer: Any) -> bool:
        """Mark ``peer`` unloaded (no longer current); False if it was already."""
        if peer.unloaded:
            return False
        peer.unloaded = True
        if self._current.get(peer.key) is peer:
            del self._current[peer.key]
        return True

    def forget(self, peer: Any) -> bool:
        """Drop ``peer`` from the loaded ones; False if it was not loaded (removed already)."""
        return self._loaded.pop(id(peer), None) is not None

    def _readable(self) -> list[Any]:
        """The loaded peers NIXL still reads through (a replaced one, not yet removed, may still be read)."""
        return [p for p in self._loaded.values() if not p.unloaded]
