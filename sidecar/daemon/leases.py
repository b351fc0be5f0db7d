"""Prefill leases: which requests' blocks a prefill still holds for us, and the heartbeats that renew them."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("kv_sidecar.leases")


Rank = tuple[str, int]  # a prefill rank: (engine id, rank)


@dataclass
class _Lease:
    """One request's lease as we can vouch for it, rank by rank (each prefill rank frees its own blocks)."""

    started: float  # the earliest start anyone reported
    beats: dict[Rank, list[float]] = field(default_factory=dict)  # heartbeats that counted, by rank, in order


class LeaseTracker:
    """Which requests' prefill leases we can still vouch for.

    A prefill frees (and reuses) a request's blocks ``lease_s`` after it finished unless heartbeats arrive;
    a heartbeat that arrives at ``t`` extends the lease to at least ``t + extension_s`` (vLLM: lease*2//3).
    The prefill's clock started before we first saw the request, so we count from the earliest start the
    shim reported (or our first sighting) minus a ``margin_s`` for the proxy hop and clock skew. A heartbeat
    sent after the lease may have lapsed proves nothing (the blocks may already be reused), so such a request
    stays lost. Each prefill rank runs its own lease (a prefill of larger TP than the decoder's has several
    for one request): a heartbeat renews only the rank it reached, and a request is vouched for as long as
    every rank read is. Times are monotonic seconds.
    """

    def __init__(
        self,
        lease_s: float = 30.0,
        *,
        extension_s: float | None = None,
        margin_s: float = 2.0,
        heartbeat_interval_s: float = 5.0,
    ) -> None:
        if lease_s <= margin_s:
            raise ValueError(f"lease_s {lease_s} must exceed margin_s {margin_s}")
        self.lease_s = lease_s
        self.extension_s = float(int(lease_s) * 2 // 3) if extension_s is None else extension_s
        self.margin_s = margin_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self._leases: dict[str, _Lease] = {}

    def seen(self, req_id: str, started: float) -> None:
        """Track ``req_id`` from the earliest start reported. A shim Heartbeat can name a request before its
        Pull does, and the Pull's ``lease_started_at_ns`` may be seconds earlier: the lease is counted from
        that, and the heartbeats sent meanwhile are counted again against it (a late one proves nothing)."""
        lease = self._leases.get(req_id)
        if lease is None:
            self._leases[req_id] = _Lease(started)
        elif started < lease.started:
            lease.started = started

    def heartbeat_sent(self, req_ids: Iterable[str], now: float, rank: Rank) -> None:
        """A heartbeat for ``req_ids`` reached prefill ``rank`` (sent at ``now``)."""
        for req_id in req_ids:
            lease = self._leases.get(req_id)
            if lease is None or now >= self._until(lease, rank):
                continue  # unknown, or too late to count
            lease.beats.setdefault(rank, []).append(now)

    def _unrenewed(self, lease: _Lease) -> float:
        """Until when a rank no heartbeat reached holds the blocks for sure."""
        return lease.started + self.lease_s - self.margin_s

    def _until(self, lease: _Lease, rank: Rank) -> float:
        """Until when ``rank`` holds the blocks for sure: from the start, renewed by each beat in time."""
        until = self._unrenewed(lease)
        for beat in lease.beats.get(rank, ()):
            if beat < until:
                until = max(until, beat + self.extension_s - self.margin_s)
        return until

    def vouched_until(self, req_id: str, ranks: Iterable[Rank]) -> float:
        """Until when every one of ``ranks`` holds ``req_id``'s blocks for sure (-inf: unknown request)."""
        lease = self._leases.get(req_id)
        if lease is None:
            return float("-inf")
        return min((self._until(lease, rank) for rank in ranks), default=self._unrenewed(lease))

    def check(self, req_id: str, now: float, ranks: Iterable[Rank]) -> bool:
        """True while every one of ``ranks`` still holds ``req_id``'s blocks for sure."""
        return now < self.vouched_until(req_id, ranks)

    def due(self, req_id: str, rank: Rank, now: float) -> bool:
        """Whether ``rank`` needs a heartbeat for ``req_id`` now (still vouched, its last one older than the
        interval); a lost request is not heartbeated."""
        lease = self._leases.get(req_id)
        if lease is None:
            return False
        beats = lease.beats.get(rank)
        last = beats[-1] if beats else lease.started
        return now - last >= self.heartbeat_interval_s and now < self._until(lease, rank)

    def forget(self, req_id: str) -> None:
        self._leases.pop(req_id, None)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._leases

    def __len__(self) -> int:
        return len(self._leases)


class Leases:
    """The daemon's side of the prefill lease: what the shim heartbeats, and renewing what we hold.

    The shim heartbeats every request whose prefill lease is running (also while it waits for blocks);
    we forward those heartbeats to the prefill rank, and renew on our own the leases of requests we hold
    (once past their handshake) when they fall due.
    """

    def __init__(
        self,
        tracker: LeaseTracker,
        port: Any,
        metrics: Any,
        sent: Callable[[], None],
        later: Callable[..., Any] | None = None,
    ) -> None:
        self.tracker = tracker
        self._sent = sent
        self._later = later  # runs a call on the poster thread (Reads.on_poster), when one is given
        self._port = port
        self._metrics = metrics
        # remote_request_id -> the prefill ranks the shim heartbeats it for (engine id, rank): several when
        # the prefill's TP is larger than the decoder's
        self._heartbeated: dict[str, set[tuple[str, int]]] = {}

    def seen(self, remote_request_id: str, at: float) -> None:
        self.tracker.seen(remote_request_id, at)

    def check(self, remote_request_id: str, now: float, ranks: Iterable[Rank]) -> bool:
        return self.tracker.check(remote_request_id, now, ranks)

    def vouched_until(self, remote_request_id: str, ranks: Iterable[Rank]) -> float:
        return self.tracker.vouched_until(remote_request_id, ranks)

    def shim_heartbeat(self, key: Rank, remote_request_ids: list[str], now: float) -> None:
        """The shim heartbeated these requests for prefill rank ``key``."""
        for rid in remote_request_ids:
            self.tracker.seen(rid, now)
            self._heartbeated.setdefault(rid, set()).add(key)

    def heartbeated_for(self, key: Rank) -> list[str]:
        """Requests the shim heartbeats for ``key`` (sent on once its handshake is through)."""
        return [rid for rid, keys in self._heartbeated.items() if key in keys]

    def send(self, key: Rank, peer: Any, remote_request_ids: list[str]) -> None:
        """Heartbeat prefill rank ``key`` (``peer``) for those of ``remote_request_ids`` we can still vouch
        for there (a late one proves nothing). Sent now, or on the poster thread after the post in progress
        (the loop does not wait for a post)."""
        now = time.monotonic()
        live = [rid for rid in remote_request_ids if self.tracker.check(rid, now, [key])]
        if not live:
            return
        self._sent()
        with self._port.hold(blocking=self._later is None) as held:
            if held:
                self._counted(self._send_now(peer, live), live, key)
                return
        assert self._later is not None
        fut = self._later(self._send_now, peer, live)
        fut.add_done_callback(lambda f: self._counted(None if f.cancelled() else f.result(), live, key))

    def _send_now(self, peer: Any, live: list[str]) -> float | None:
        """Send the heartbeat; when it went out, the time just before (what it can vouch from)."""
        sent_at = time.monotonic()
        try:
            self._port.heartbeat(peer, live)
        except Exception as exc:  # noqa: BLE001 - a failed heartbeat only shortens what we can vouch for
            log.info("heartbeat to %s failed: %s", getattr(peer, "address", peer), exc)
            return None
        return sent_at

    def _counted(self, sent_at: float | None, live: list[str], key: Rank) -> None:
        if sent_at is None:
            return
        self.tracker.heartbeat_sent(live, sent_at, key)  # one sent after a lease lapsed counts for none
        self._metrics.heartbeats_sent.inc()

    def due(self, remote_request_id: str, key: Rank, now: float) -> bool:
        return self.tracker.due(remote_request_id, key, now)

    def forget(self, remote_request_id: str) -> None:
        self.tracker.forget(remote_request_id)
        self._heartbeated.pop(remote_request_id, None)

    def forget_lapsed(self, held: set[str], now: float) -> None:
        """Drop shim-heartbeated ids whose lease lapsed and that no job holds."""
        lapsed = [r for r, keys in self._heartbeated.items() if not self.tracker.check(r, now, keys)]
        for rid in [r for r in lapsed if r not in held]:
            self.forget(rid)
