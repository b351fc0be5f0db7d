"""Heartbeats: the shim's Heartbeat messages forwarded to prefills, and the renewal of leases we hold.

Like stock vLLM, the first heartbeat for a prefill rank we do not know yet starts its handshake early (a
bounded number at once: ``peers.MAX_UNAWAITED_HANDSHAKES``); the requests heartbeated meanwhile are
heartbeated as soon as it is through (``admitted``). A rank the rules in force refused is not asked again
(``Peers.refused``): its pulls still handshake, to be refused and told.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from sidecar.daemon.caches import CacheRegistry
from sidecar.daemon.jobs import JobTable, Session
from sidecar.daemon.leases import Leases
from sidecar.daemon.peers import PEER_IDLE_S, Key, Peers
from sidecar.daemon.port import PeerTarget
from sidecar.nixl.tp import read_ranks
from sidecar.ops.metrics import Metrics
from sidecar.wire import protocol as p


class Heartbeats:
    """Forwards the shim's heartbeats and renews the leases of the requests in flight."""

    def __init__(
        self,
        *,
        leases: Leases,
        peers: Peers,
        caches: CacheRegistry,
        jobs: JobTable,
        send: Callable[[list[bytes], p.ToShim], None],
        metrics: Metrics,
        interval_s: Callable[[], float],
        stopping: Callable[[], bool],
    ) -> None:
        self._leases = leases
        self._peers = peers
        self._caches = caches
        self._jobs = jobs
        self._send = send
        self._metrics = metrics
        self._interval_s = interval_s
        self._stopping = stopping
        self._next_let_go = 0.0  # when ``renew_loop`` next lets idle prefills and notify-only loads go

    def on_heartbeat(
        self, envelope: list[bytes], session: Session, msg: p.Heartbeat, received: float
    ) -> None:
        if session.hello is None:
            self._metrics.foreign_messages.inc()
            self._send(envelope, p.Error(reason="say Hello before Heartbeat", in_reply_to="Heartbeat"))
            return
        for t in msg.targets:
            # vLLM heartbeats every prefill rank it reads: one, or several when the prefill's TP is larger
            ranks = read_ranks(local_tp=session.tp_size, local_rank=session.rank, remote_tp=t.remote_tp_size)
            if not isinstance(ranks, tuple) or not t.remote_request_ids:
                continue
            for rank in ranks:
                key = (t.remote_engine_id, rank)
                self._leases.shim_heartbeat(key, t.remote_request_ids, received)
                peer = self._peers.heartbeat_through(key)
                if peer is not None:
                    self._leases.send(key, peer, t.remote_request_ids)
                elif not self._peers.known(key) and self._caches.current is not None and not self._stopping():
                    target = PeerTarget(t.remote_engine_id, rank, t.remote_host, t.remote_port,
                                        generation=t.remote_registration_generation,
                                        remote_tp=t.remote_tp_size, local_tp=session.tp_size,
                                        local_rank=session.rank)
                    if not self._peers.refused(target):
                        self._peers.start_unawaited(target, self._caches.current)

    def admitted(self, key: Key, peer: Any) -> None:
        """A handshake went through: heartbeat what the shim heartbeated before we knew this prefill."""
        pending = self._leases.heartbeated_for(key)
        if pending:
            self._leases.send(key, peer, pending)

    async def renew_loop(self) -> None:
        """Renew the leases that are due of requests we hold past their handshake (a queued one has no prefill
        rank yet: the shim's own heartbeats renew it, as they do while the request waits for blocks); every
        quarter lease, let go the notify-only loads unused for a lease and its margin
        (``Peers.let_go_notify_only``) and the admitted ranks unused for PEER_IDLE_S
        (``Peers.let_go_idle``)."""
        while True:
            await asyncio.sleep(min(1.0, self._interval_s() / 2))
            now = time.monotonic()
            held = {j.msg.remote_request_id: j for j in self._jobs.jobs()}
            # through the handshake each pull reads through: one a reload replaced (and the new rules may
            # refuse) is still the pull's until it lets go, and so is the prefill's lease
            by_peer: dict[tuple[Key, int], tuple[Any, list[str]]] = {}
            for rid, job in held.items():
                for entry in job.peer_entries:  # none yet while it queues
                    peer = entry.peer
                    if peer is not None and self._leases.due(rid, entry.key, now):
                        by_peer.setdefault((entry.key, id(peer)), (peer, []))[1].append(rid)
            for (key, _), (peer, ids) in by_peer.items():
                self._leases.send(key, peer, ids)
            self._leases.forget_lapsed(set(held), now)
            if now >= self._next_let_go:
                # a refused prefill's agent, loaded only to tell it to free blocks: past the lease and its
                # margin the blocks are freed anyway, and a prefill gone for good would keep it loaded
                tracker = self._leases.tracker
                idle_s = tracker.lease_s + tracker.margin_s
                self._next_let_go = now + idle_s / 4
                self._peers.let_go_notify_only(idle_s)
                self._peers.let_go_idle(max(idle_s, PEER_IDLE_S), now)
