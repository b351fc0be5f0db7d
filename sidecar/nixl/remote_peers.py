"""The prefill ranks' NIXL side (``RemotePeers``): each rank a ``Peer``, its remote agent loaded and let go
by ``PeerBook``'s rules, its checked geometries and its prepared remote descriptor lists; each refused rank
whose agent is loaded only to be notified a ``NotifyOnlyPeer``."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sidecar.nixl.calls import locked, nixl_call
from sidecar.nixl.errors import PeerConflict, RemoteRefused, TransferError
from sidecar.nixl.geometry import GeometryError, Mode, PairGeometry, RemoteRegions, StagingPool
from sidecar.nixl.peer_book import PeerBook
from sidecar.wire.formats import Plan
from sidecar.wire.nixl_metadata import NixlMetadataError, read_agent_name

if TYPE_CHECKING:
    from sidecar.nixl.local_memory import Destination

log = logging.getLogger("kv_sidecar.nixl")


@dataclass(eq=False)
class Peer:
    """One prefill rank: its NIXL agent, its checked geometry and our prepared lists for it."""

    engine_id: str
    tp_rank: int
    generation: int
    address: str
    agent_name: str
    plan: Plan
    regions: RemoteRegions
    remote_handles: dict[str, Any] = field(default_factory=dict)  # mode -> prepped remote dlist
    geometries: dict[tuple[int, str], PairGeometry] = field(default_factory=dict)
    prep_seconds: dict[str, float] = field(default_factory=dict)  # mode -> one-time prep_xfer_dlist cost
    source: Any = None  # tp.SourceSlice when the prefill runs at another TP (we read a head slice), else None
    notif_count: int = 1  # the n of "id:n" this rank expects (decoder ranks reading it)
    agent_metadata: bytes = b""  # its NIXL agent metadata (UCX worker address, region keys): for mapping
    mapping: Any = None  # mapping.MappedPages once mapped, or the MappingUnavailable that said why not
    # NIXL let it go when a newer registration or a restarted engine replaced it: no read goes through it
    # any more (its old regions may now be another registration's), while its mapping stays until
    # ``remove_peer``, as a pull may still convert through it
    unloaded: bool = False

    @property
    def key(self) -> tuple[str, int]:
        return (self.engine_id, self.tp_rank)


@dataclass(eq=False)
class NotifyOnlyPeer:
    """A prefill rank we refused after its handshake decoded: loaded in NIXL only to be notified, so it
    frees the blocks of requests we will not read at once instead of at its lease's end."""

    engine_id: str
    tp_rank: int
    address: str
    agent_name: str
    notif_count: int = 1
    used_at: float = 0.0  # when last loaded, found again or notified through (``RemotePeers``' clock)


def _agent_name(metadata: bytes) -> str | None:
    """The name NIXL will load ``metadata`` under, or None where this NIXL 1.5 reader cannot read it (another
    NIXL's format, which NIXL may still load)."""
    try:
        return read_agent_name(metadata)
    except NixlMetadataError:
        return None


class RemotePeers:
    """The loaded prefill ranks and NIXL's side of them: ``PeerBook`` keeps which are loaded and current, this
    makes the NIXL calls around it."""

    def __init__(
        self, agent: Any, lock: threading.RLock, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.agent = agent  # the serialized NIXL agent
        self.lock = lock
        self._book = PeerBook()  # the loaded peers, and the current one of each (engine id, rank)
        # the refused ranks loaded only to be notified, by agent metadata: NIXL does not count loads, so an
        # agent is removed only once neither a peer nor one of these needs it (``_needed``)
        self._notify_only: dict[bytes, NotifyOnlyPeer] = {}
        self._clock = clock  # when a notify-only load was last used (``let_go_notify_only``)

    def peer(self, engine_id: str, tp_rank: int) -> Peer | None:
        return self._book.current((engine_id, tp_rank))

    @property
    def peers(self) -> list[Peer]:
        return self._book.all_current()

    @locked
    def add_peer(
        self,
        *,
        engine_id: str,
        tp_rank: int,
        generation: int,
        address: str,
        agent_metadata: bytes,
        plan: Plan,
        regions: RemoteRegions,
        source: Any = None,
        notif_count: int = 1,
    ) -> Peer:
        """Load a checked remote (see ``admit_remote``) as the current peer of (engine id, rank); what it
        replaces, and which remote agent it shares, by ``PeerBook``'s rules: a replaced peer is let go by NIXL
        at once (``_unload``) or, re-admitted alike, reads on; either way its mapping stays until
        ``remove_peer``. A notify-only load of these metadata becomes the peer's; the rank's loads of others
        go once it is in (``_forget_replaced``). PeerConflict when a loaded peer stands in its way (a newer
        generation of the rank, another engine's peer on the same agent name)."""
        key = (engine_id, tp_rank)
        replaced = self._book.replaced_by(key, generation, agent_metadata, address, tp_rank)
        # the same metadata as a loaded peer's (a newer generation of an unchanged registration) or as a
        # notify-only load's (refused before, admitted now) is the same remote agent: shared, not loaded
        # again, and what it replaces let go once this peer is in, so a failure leaves the rank as it was
        name = self._book.agent_for(agent_metadata)
        told = self._notify_only.get(agent_metadata)
        if name is None and told is not None and all(old.agent_name != told.agent_name for old in replaced):
            name = self._connected(self._unshared(told.agent_name))
        if name is None:
            # other metadata: what it replaces goes first, though the load may still fail (they are stale
            # either way: re-registered or restarted). A re-registered prefill's agent keeps its name, and
            # NIXL loads other metadata over a loaded name: it keeps the regions it holds, with their old
            # keys, and refuses other connection info (nixlAgent::loadRemoteMD); a notify-only load merged
            # over a replaced peer's agent so goes with it
            self._replace(replaced, key, address)
            replaced = []
            # a name another engine's peer reads through is refused before NIXL loads these over its agent:
            # NIXL refuses other connection info itself (no conflict named), but merges metadata without any
            named = _agent_name(agent_metadata)
            if named is not None:
                self._unshared(named)
            if told is not None:
                del self._notify_only[agent_metadata]
                self._release_agent(told.agent_name)
            name = nixl_call("add_remote_agent", self.agent.add_remote_agent, agent_metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            name = self._connected(self._unshared(name))  # the name we could not read, checked once loaded
        peer = Peer(
            engine_id=engine_id,
            tp_rank=tp_rank,
            generation=generation,
            address=address,
            agent_name=name,
            plan=plan,
            regions=regions,
            source=source,
            notif_count=notif_count,
            agent_metadata=agent_metadata,
        )
        self._book.add(peer)
        self._replace(replaced, key, address)
        self._notify_only.pop(agent_metadata, None)  # the peer's agent: notified through the peer from now on
        self._forget_replaced(engine_id, tp_rank, address, agent_metadata)
        return peer

    def _unshared(self, name: str) -> str:
        """``name``, unless a current peer of other metadata reads through that agent (PeerConflict)."""
        if self._book.agent_in_use(name):
            raise PeerConflict(f"agent name {name!r} is already loaded for another engine", "agent_metadata")
        return name

    def _connected(self, name: str) -> str:
        """``name``, connected (``make_connection``); a load nothing else needs is let go if that fails."""
        try:
            nixl_call("make_connection", self.agent.make_connection, name)
        except TransferError:
            self._release_agent(name)  # loaded just now: let go unless something records it
            raise
        return name

    def _replace(self, replaced: list[Peer], key: tuple[str, int], address: str) -> None:
        """Unload the peers an admission of ``key`` at ``address`` replaces (``PeerBook.replaced_by``)."""
        for old in replaced:
            if old.key != key:
                log.info("prefill at %s rank %d restarted: dropping engine %s", address, key[1],
                         old.engine_id)
            self._unload(old)

    @locked
    def remove_peer(self, peer: Peer) -> None:
        """Let ``peer`` go (the daemon calls it once no pull reads through it): NIXL's side (``_unload``),
        then its mapping. A second call is a no-op; neither touches a peer that replaced it."""
        if not self._book.forget(peer):
            return
        self._unload(peer)
        mapping, peer.mapping = peer.mapping, None
        if hasattr(mapping, "close"):
            try:
                mapping.close()  # waits for this process's kernels first: one may still read through it
            except Exception as exc:  # noqa: BLE001 - best effort on teardown
                log.warning("unmapping %s: %s", peer.agent_name, exc)

    def _unload(self, peer: Peer) -> None:
        """NIXL's side of letting ``peer`` go: its prepared lists, and its remote agent unless a current peer
        reads through the same one. Reads through it are refused from now on (``NixlReads.pull``)."""
        if not self._book.unload(peer):
            return
        for handle in peer.remote_handles.values():
            try:
                self.agent.release_dlist_handle(handle)
            except Exception as exc:  # noqa: BLE001 - best effort on teardown
                log.warning("releasing a dlist of %s: %s", peer.agent_name, exc)
        peer.remote_handles.clear()
        peer.geometries.clear()
        self._release_agent(peer.agent_name)  # kept if a replacing peer or notify-only load shares it

    def _needed(self, name: str) -> bool:
        """Whether a current peer reads through the remote agent ``name`` or a notify-only load notifies it:
        NIXL does not count loads, so removing it would unload it under them."""
        return self._book.agent_in_use(name) or any(t.agent_name == name for t in self._notify_only.values())

    def _release_agent(self, name: str) -> bool:
        """NIXL's removal of the remote agent ``name`` unless something still needs it (``_needed``), best
        effort (a failure is logged); whether it was removed."""
        if self._needed(name):
            return False
        try:
            self.agent.remove_remote_agent(name)
        except Exception as exc:  # noqa: BLE001
            log.warning("removing agent %s: %s", name, exc)
        return True

    @locked
    def load_notify_only(
        self, *, engine_id: str, tp_rank: int, address: str, agent_metadata: bytes, notif_count: int = 1
    ) -> NotifyOnlyPeer:
        """A refused prefill rank (its metadata decoded fine) loaded only to be notified, or its load found
        again; marked used. NIXL loads metadata it has loaded already again, under the same name: a peer may
        share the agent. The rank's loads from other metadata go (``_forget_replaced``). TransferError if
        NIXL cannot load it."""
        told = self._notify_only.get(agent_metadata)
        if told is None:
            name = nixl_call("add_remote_agent", self.agent.add_remote_agent, agent_metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            told = NotifyOnlyPeer(engine_id, tp_rank, address, name, notif_count)
            self._notify_only[agent_metadata] = told
            self._forget_replaced(engine_id, tp_rank, address, agent_metadata)
        elif told.notif_count != notif_count:
            # refused again for a decoder at another TP (restarted, the prefill still up): its notifications
            # owe that TP's n; the refusals still holding the old load are told with theirs
            told = self._notify_only[agent_metadata] = dataclasses.replace(told, notif_count=notif_count)
        told.used_at = self._clock()  # a new refusal to tell it of: kept for another lease
        return told

    @locked
    def mark_used(self, told: NotifyOnlyPeer) -> None:
        """``told`` notified through now: kept for another lease (``let_go_notify_only``)."""
        told.used_at = self._clock()

    @locked
    def let_go_notify_only(self, idle_s: float) -> int:
        """Let go the notify-only loads not used (loaded, found again or notified through) for ``idle_s``,
        the prefills' lease and a margin: by then their prefill has freed the refused requests' blocks on its
        own, and nothing tells it of a new one without using the load again. Else a refused prefill gone for
        good (scaled down) kept its agent loaded, a UCX endpoint to a dead process, until the daemon exited.
        An agent a peer reads through or a kept load shares stays loaded (``_needed``). How many loads were
        let go."""
        now = self._clock()
        idle = [md for md, told in self._notify_only.items() if now - told.used_at > idle_s]
        for md in idle:
            told = self._notify_only.pop(md)
            if self._release_agent(told.agent_name):
                log.info("prefill %s rank %d at %s: its notify-only agent let go after %.0f s unused",
                         told.engine_id, told.tp_rank, told.address, now - told.used_at)
        return len(idle)

    def _forget_replaced(self, engine_id: str, tp_rank: int, address: str, metadata: bytes) -> None:
        """Let go the notify-only loads of the prefill rank (at ``address`` or of ``engine_id``, as
        ``PeerBook`` matches a restart) from other metadata than ``metadata``: it restarted or re-registered
        since, so nothing notifies their agent any more (kept where NIXL loaded the same one again)."""
        for md, old in list(self._notify_only.items()):
            if md == metadata or old.tp_rank != tp_rank:
                continue
            if old.address != address and old.engine_id != engine_id:
                continue
            del self._notify_only[md]
            self._release_agent(old.agent_name)

    def geometry(
        self, peer: Peer, dest: Destination, mode: Mode, pool: StagingPool | None = None
    ) -> PairGeometry:
        """The checked pairing of ``peer``'s regions with ``dest`` (cached); refusals name the field."""
        key = (id(dest), mode)
        geo = peer.geometries.get(key)
        if geo is None or (mode == "staged" and geo.pool is not pool):
            try:
                geo = PairGeometry(peer.plan, peer.regions, dest.regions, mode, pool=pool, source=peer.source)
            except GeometryError as exc:
                raise RemoteRefused(exc.reason, exc.field) from exc
            peer.geometries[key] = geo
        return geo

    def remote_handle(self, peer: Peer, mode: Mode, geo: PairGeometry) -> Any:
        """``peer``'s prepared remote dlist for ``mode`` (of ``geo``'s remote table): NIXL's one-time work."""
        remote = peer.remote_handles.get(mode)
        if remote is None:
            t0 = time.perf_counter()
            remote = nixl_call(
                "prep remote dlist",
                self.agent.prep_xfer_dlist,
                peer.agent_name,
                geo.remote_table(),
                peer.regions.mem_type,
            )
            peer.prep_seconds[mode] = time.perf_counter() - t0
            peer.remote_handles[mode] = remote
        return remote

    def forget_destination(self, dest: Destination) -> None:
        """Drop every loaded peer's geometries paired with ``dest`` (it is being let go)."""
        key = id(dest)
        for peer in self._book.loaded():
            for gk in [gk for gk in peer.geometries if gk[0] == key]:
                del peer.geometries[gk]

    @locked
    def close(self) -> None:
        """Let every notify-only load and every loaded peer go."""
        while self._notify_only:
            _, told = self._notify_only.popitem()
            self._release_agent(told.agent_name)  # one a peer shares goes with that peer
        for peer in self._book.loaded():
            self.remove_peer(peer)
