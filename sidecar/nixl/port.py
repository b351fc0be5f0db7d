"""``NixlPort``: the daemon's ``TransferPort`` on a real NIXL agent and vLLM's side channel."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sidecar.daemon.port import Admission, PeerTarget, ReadMode
from sidecar.nixl.admission import admit_remote
from sidecar.nixl.agent import NixlTransfer, Peer, ReadOp, TransferSettings
from sidecar.nixl.errors import RemoteRefused, TransferError
from sidecar.nixl.geometry import LocalRegions, StagingPool
from sidecar.wire import prefill as vllm_wire


@dataclass(eq=False)
class NotifyOnlyPeer:
    """A prefill rank we refused after its handshake decoded: loaded in NIXL only to be notified, so it
    frees the blocks of requests we will not read at once instead of at its lease's end."""

    engine_id: str
    tp_rank: int
    address: str
    agent_name: str


class NixlPort:
    """A thin adapter: one ``NixlTransfer`` (the agent) plus the handshake over the prefill's side channel."""

    def __init__(self, settings: TransferSettings) -> None:
        self.agent = NixlTransfer(settings)
        self.local_mem_type = "DRAM" if settings.cuda_device is None else "VRAM"
        self._notify_only: dict[bytes, NotifyOnlyPeer] = {}  # agent metadata -> its loaded agent

    def register(self, ranges: Sequence[tuple[int, int, int]], mem_type: str) -> Any:
        return self.agent.register(ranges, mem_type)

    def deregister(self, registration: Any) -> None:
        self.agent.deregister(registration)

    def destination(self, registration: Any, regions: LocalRegions) -> Any:
        return self.agent.destination(registration, regions)

    def staging(self, registration: Any, pool: StagingPool) -> StagingPool:
        return self.agent.staging(registration, pool)

    async def connect(self, target: PeerTarget, admission: Admission) -> Peer:
        replies = await vllm_wire.fetch_handshake_async(
            target.host,
            target.port,
            [(0, target.tp_rank)],
            timeout_s=admission.timeout_s,
            expected_engine_id=target.engine_id,
        )
        reply = replies[(0, target.tp_rank)]
        try:
            plan, regions = self._admit(target, admission, reply)
        except RemoteRefused as exc:
            exc.peer = self._notify_only_peer(target, reply.metadata.agent_metadata)
            raise
        stale = self._notify_only.pop(reply.metadata.agent_metadata, None)
        if stale is not None:  # refused before, admitted now (a reload): load it as a full peer
            self.agent.agent.remove_remote_agent(stale.agent_name)
        return self.agent.add_peer(
            engine_id=target.engine_id,
            tp_rank=target.tp_rank,
            generation=target.generation,
            address=target.address,
            agent_metadata=reply.metadata.agent_metadata,
            plan=plan,
            regions=regions,
        )

    def _admit(self, target: PeerTarget, admission: Admission, reply: Any) -> Any:
        settings = TransferSettings(
            remote_formats=admission.rules,
            conversion_enabled=admission.conversion_enabled,
            allow_lossy_fp8=admission.allow_lossy_fp8,
            remote_mem_type=self.agent.settings.remote_mem_type,
        )
        return admit_remote(
            reply.metadata,
            address=target.address,
            local_format=admission.local_format,
            layers=admission.layers,
            settings=settings,
            remote_hash=reply.compatibility_hash,
            local_factors=admission.compat_factors or None,
            check_identity=admission.check_identity,
            expected_engine_id=target.engine_id,
        )

    def _notify_only_peer(self, target: PeerTarget, agent_metadata: bytes) -> NotifyOnlyPeer | None:
        peer = self._notify_only.get(agent_metadata)
        if peer is None:
            try:
                name = self.agent.load_agent(agent_metadata)
            except TransferError:
                return None  # e.g. already loaded as an admitted peer; the lease frees the blocks
            peer = NotifyOnlyPeer(target.engine_id, target.tp_rank, target.address, name)
            self._notify_only[agent_metadata] = peer
        return peer

    def remove_peer(self, peer: Peer) -> None:
        self.agent.remove_peer(peer)

    def blocks(
        self,
        peer: Peer,
        dest: Any,
        mode: ReadMode,
        local_ids: Sequence[int],
        remote_ids: Sequence[int],
        remote_num_tokens: int | None,
    ) -> np.ndarray:
        geo = self.agent.geometry(peer, dest, "plain" if mode == "plain" else "direct")
        return geo.blocks(local_ids, remote_ids, remote_num_tokens)[0]

    def read(
        self,
        peer: Peer,
        dest: Any,
        mode: ReadMode,
        local_ids: Sequence[int],
        remote_ids: Sequence[int],
        remote_request_id: str,
        *,
        layer_groups: int,
        timeout_s: float,
        remote_num_tokens: int | None,
        pool: StagingPool | None = None,
        slots: np.ndarray | None = None,
    ) -> ReadOp:
        return self.agent.pull(
            peer,
            dest,
            mode,
            local_ids,
            remote_ids,
            remote_request_id,
            readers=1,
            layer_groups=layer_groups,
            timeout_s=timeout_s,
            remote_num_tokens=remote_num_tokens,
            pool=pool,
            slots=slots,
        )

    def poll(self, read: ReadOp, now: float, *, notify: bool = True) -> bool:
        return self.agent.poll(read, now, notify=notify)

    def notify_read(self, read: ReadOp) -> None:
        self.agent.notify_read(read)

    def abort(self, read: ReadOp) -> bool:
        return self.agent.abort(read)

    def release(self, read: ReadOp) -> bool:
        return self.agent.release(read)

    def notify(self, peer: Peer | NotifyOnlyPeer, remote_request_id: str) -> None:
        self.agent.notify_agent(peer.agent_name, remote_request_id, 1)

    def heartbeat(self, peer: Peer, remote_request_ids: Sequence[str]) -> None:
        self.agent.heartbeat(peer, remote_request_ids)

    def progress(self) -> None:
        self.agent.agent.get_new_notifs()

    def close(self) -> None:
        self.agent.close()
