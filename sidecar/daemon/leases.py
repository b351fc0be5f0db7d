"""Prefill leases: which requests' blocks a prefill still holds for us, and the heartbeats that renew them."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("kv_sidecar.leases")


@dataclass
class _Lease:
    """One request's lease as we can vouch for it."""

    started: float  # the earliest start anyone reported
    until: float  # vouched for until then
    last_beat: float  # the last heartbeat that counted (the start before any)
    beats: list[float] = field(default_factory=list)  # heartbeats that counted, in order


class LeaseTracker:
    """Which requests' prefill leases we can still vouch for.

    A prefill frees (and reuses) a request's blocks ``lease_s`` after it finished unless heartbeats arrive;
    a heartbeat that arrives at ``t`` extends the lease to at least ``t + extension_s`` (vLLM: lease*2//3).
    The prefill's clock started before we first saw the request, so we count from the earliest start the
    shim reported (or our first sighting) minus a ``margin_s`` for the proxy hop and clock skew. A heartbeat
    sent after the lease may have lapsed proves nothing (the blocks may already be reused), so such a request
    stays lost. Times are monotonic seconds.
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
        if lease is not None and lease.started <= started:
            return
        until = started + self.lease_s - self.margin_s
        for t in lease.beats if lease is not None else ():
            if t < until:
                until = self._renewed(until, t)
        if lease is None:
            self._leases[req_id] = _Lease(started, until, last_beat=started)
        else:
            lease.started, lease.until = started, until

    def heartbeat_sent(self, req_ids: Iterable[str], now: float) -> None:
        for req_id in req_ids:
            lease = self._leases.get(req_id)
            if lease is None or now >= lease.until:
                continue  # unknown, or too late to count
            lease.until = self._renewed(lease.until, now)
            lease.last_beat = now
            lease.beats.append(now)

    def _renewed(self, until: float, beat: float) -> float:
        """What a heartbeat sent at ``beat`` (in time) makes of a lease vouched for until ``until``."""
        return max(until, beat + self.extension_s - self.margin_s)

    def vouched_until(self, req_id: str) -> float:
        lease = self._leases.get(req_id)
        return float("-inf") if lease is None else lease.until

    def check(self, req_id: str, now: float) -> bool:
        """True while the prefill still holds ``req_id``'s blocks for sure."""
        return now < self.vouched_until(req_id)

    def due(self, now: float) -> list[str]:
        """Requests that need a heartbeat now (still vouched, last one older than the interval)."""
        return [
            r
            for r, lease in self._leases.items()
            if now - lease.last_beat >= self.heartbeat_interval_s and now < lease.until
        ]

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

    def check(self, remote_request_id: str, now: float) -> bool:
        return self.tracker.check(remote_request_id, now)

    def vouched_until(self, remote_request_id: str) -> float:
        return self.tracker.vouched_until(remote_request_id)

    def shim_heartbeat(self, key: tuple[str, int], remote_request_ids: list[str], now: float) -> None:
        """The shim heartbeated these requests for prefill rank ``key``."""
        for rid in remote_request_ids:
            self.tracker.seen(rid, now)
            self._heartbeated.setdefault(rid, set()).add(key)

    def heartbeated_for(self, key: tuple[str, int]) -> list[str]:
        """Requests the shim heartbeats for ``key`` (sent on once its handshake is through)."""
        return [rid for rid, keys in self._heartbeated.items() if key in keys]

    def send(self, peer: Any, remote_request_ids: list[str]) -> None:
        """Heartbeat those of ``remote_request_ids`` we can still vouch for (a late one proves nothing). Sent
        now, or on the poster thread after the post in progress (the loop does not wait for a post)."""
        now = time.monotonic()
        live = [rid for rid in remote_request_ids if self.tracker.check(rid, now)]
        if not live:
            return
        self._sent()
        with self._port.hold(blocking=self._later is None) as held:
            if held:
                self._counted(self._send_now(peer, live), live)
                return
        assert self._later is not None
        fut = self._later(self._send_now, peer, live)
        fut.add_done_callback(lambda f: self._counted(None if f.cancelled() else f.result(), live))

    def _send_now(self, peer: Any, live: list[str]) -> float | None:
        """Send the heartbeat; when it went out, the time just before (what it can vouch from)."""
        sent_at = time.monotonic()
        try:
            self._port.heartbeat(peer, live)
        except Exception as exc:  # noqa: BLE001 - a failed heartbeat only shortens what we can vouch for
            log.info("heartbeat to %s failed: %s", getattr(peer, "address", peer), exc)
            return None
        return sent_at

    def _counted(self, sent_at: float | None, live: list[str]) -> None:
        if sent_at is None:
            return
        self.tracker.heartbeat_sent(live, sent_at)  # a heartbeat sent after a lease lapsed counts for none
        self._metrics.heartbeats_sent.inc()

    def due(self, now: float) -> list[str]:
        return self.tracker.due(now)

    def forget(self, remote_request_id: str) -> None:
        self.tracker.forget(remote_request_id)
        self._heartbeated.pop(remote_request_id, None)

    def forget_lapsed(self, held: set[str], now: float) -> None:
        """Drop shim-heartbeated ids whose lease lapsed and that no job holds."""
        for rid in [r for r in self._heartbeated if r not in held and not self.tracker.check(r, now)]:
            self.forget(rid)
