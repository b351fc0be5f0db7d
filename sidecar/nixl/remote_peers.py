"""The prefill ranks' NIXL side (``RemotePeers``): each rank a ``Peer``, its remote agent loaded and let go
by ``PeerBook``'s rules, its checked geometries and its prepared remote descriptor lists."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sidecar.nixl.calls import locked, nixl_call
from sidecar.nixl.errors import PeerConflict, RemoteRefused, TransferError
from sidecar.nixl.geometry import GeometryError, Mode, PairGeometry, RemoteRegions, StagingPool
from sidecar.nixl.peer_book import PeerBook
from sidecar.wire.formats import Plan

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


class RemotePeers:
    """The loaded prefill ranks and NIXL's side of them: ``PeerBook`` keeps which are loaded and current, this
    makes the NIXL calls around it."""

    def __init__(self, agent: Any, lock: threading.RLock) -> None:
        self.agent = agent  # the serialized NIXL agent
        self.lock = lock
        self._book = PeerBook()  # the loaded peers, and the current one of each (engine id, rank)
        # remote agents loaded only to notify (``load_agent``), until ``remove_agent``: NIXL does not count
        # loads, so a peer let go must not remove one of these under them
        self._notify_only: set[str] = set()

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
        ``remove_peer``. PeerConflict when a loaded peer stands in its way (a newer generation of the rank,
        another engine's peer on the same agent name)."""
        key = (engine_id, tp_rank)
        for old in self._book.replaced_by(key, generation, agent_metadata, address, tp_rank):
            if old.key != key:
                log.info("prefill at %s rank %d restarted: dropping engine %s", address, tp_rank,
                         old.engine_id)
            self._unload(old)
        name = self._book.agent_for(agent_metadata)
        if name is None:
            name = nixl_call("add_remote_agent", self.agent.add_remote_agent, agent_metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            if self._book.agent_in_use(name):
                raise PeerConflict(
                    f"agent name {name!r} is already loaded for another engine", "agent_metadata"
                )
            try:
                nixl_call("make_connection", self.agent.make_connection, name)
            except TransferError:
                if name not in self._notify_only:  # loaded just now, and no peer records it: let it go
                    self._remove_agent(name)
                raise
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
        return peer

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
        if self._book.agent_in_use(peer.agent_name) or peer.agent_name in self._notify_only:
            return  # a peer that replaced it reads through the same agent, or a notify-only load notifies it
        self._remove_agent(peer.agent_name)

    def _remove_agent(self, name: str) -> None:
        """NIXL's removal of the remote agent ``name``, best effort (a failure is logged)."""
        try:
            self.agent.remove_remote_agent(name)
        except Exception as exc:  # noqa: BLE001
            log.warning("removing agent %s: %s", name, exc)

    @locked
    def load_agent(self, agent_metadata: bytes) -> str:
        """Load a remote agent only to notify it (its prefill was refused, its metadata decoded fine), until
        ``remove_agent``. NIXL loads metadata it has loaded already again, under the same name: a peer may
        share the agent."""
        name = nixl_call("add_remote_agent", self.agent.add_remote_agent, agent_metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._notify_only.add(name)
        return name

    @locked
    def remove_agent(self, name: str) -> None:
        """Let a remote agent loaded only to notify (``load_agent``) go, unless a peer reads through it: NIXL
        does not count loads, and removing it would unload it under that peer. TransferError if NIXL fails."""
        self._notify_only.discard(name)
        if self._book.agent_in_use(name):
            return
        nixl_call("remove_remote_agent", self.agent.remove_remote_agent, name)

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

    def close(self) -> None:
        """Let every loaded peer go."""
        for peer in self._book.loaded():
            self.remove_peer(peer)
