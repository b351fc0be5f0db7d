"""The mapped read mode: a request's pages converted straight out of the prefill's memory, mapped here.

A third way beside direct and staged (``docs/converting-read.md``): no NIXL READ and no staging, each byte
moves once. A prefill rank's registered pages are mapped once per peer (``TransferPort.map_pages``, on the
poster thread, which holds the CUDA context), and a request's conversion kernel reads them through the
mapping, its source rows the request's remote block ids. A prefill whose pages do not map (host memory,
ROCm, VMM memory, a head slice at another TP) is read the way ``auto`` reads; why is logged once per peer
and counted (``kv_sidecar_peer_mappings``).

The prefill may reuse a request's blocks once told it may; here the kernel reads them until its event, so
the notification goes out only after the conversion has ended: ``Pipeline._quiesce`` settles a job's
conversions before it notifies, and a mapped job never has a read for the notification to ride on.

A mapping keeps the prefill's GPU memory allocated, even after that prefill exits (measured on the H200: a
SIGKILLed prefill's pages stayed readable, bit-exact, through the daemon's mapping). So a prefill rank
without a pull for ``mapping_idle_s`` is let go (``release_loop``); its next pull maps it again.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

from sidecar.daemon.conversion import Conversions
from sidecar.daemon.errors import Failed
from sidecar.daemon.jobs import Job
from sidecar.daemon.port import TransferPort
from sidecar.nixl.errors import MappingUnavailable
from sidecar.ops.metrics import Metrics

log = logging.getLogger("kv_sidecar.mapped")


class MappedReads:
    """Which prefill ranks map, and the conversion of a job out of a mapping."""

    def __init__(
        self,
        port: TransferPort,
        on_poster: Callable[..., Any],
        in_background: Callable[..., None],
        conversions: Conversions,
        metrics: Metrics,
        idle_s: Callable[[], float],
    ) -> None:
        """``idle_s``: config ``mapping_idle_s``, read at every pass of ``release_loop``."""
        self._port = port
        self._idle_s = idle_s
        self._on_poster = on_poster  # Reads.on_poster: the port's calls that need the CUDA context
        self._in_background = in_background  # Reads.in_background: the same, for a call nobody awaits
        self._conversions = conversions
        self._metrics = metrics
        # peer -> the mapping of its pages: a future of a [layers, blocks, page] tensor, or of None when they
        # do not map; a replaced peer (a restarted prefill) is a new object, so it is asked again
        self._sources: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._last_used: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
        # peer -> pulls waiting for its mapping: they launch a loop turn or two after it ends (not let go
        # meanwhile, however long the mapping took)
        self._waiting: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()

    async def source(self, job: Job) -> Any | None:
        """The job's prefill pages, mapped, in the caches' dtype; None when they do not map (then the job
        reads the usual way). Asks the port once per prefill rank; jobs arriving meanwhile wait for that."""
        peers = job.peer.peers
        if len(peers) != 1:
            return None  # a prefill at a larger TP: each rank gives a head slice, read the usual way
        peer = peers[0]
        self._last_used[peer] = time.monotonic()
        found = self._sources.get(peer)
        if found is None:
            found = self._sources[peer] = asyncio.ensure_future(self._map(peer, job.caches.k_planes[0].dtype))
        if found.done():
            return found.result()
        self._waiting[peer] = self._waiting.get(peer, 0) + 1
        try:
            return await asyncio.shield(found)
        finally:
            self._last_used[peer] = time.monotonic()
            left = self._waiting.pop(peer) - 1
            if left:
                self._waiting[peer] = left

    async def _map(self, peer: Any, dtype: Any) -> Any | None:
        try:
            source = await self._on_poster(self._port.map_pages, peer, dtype, self._conversions.fence)
        except Exception as exc:  # noqa: BLE001 - whatever stops the mapping, the usual read still works
            why = str(exc) if isinstance(exc, MappingUnavailable) else f"{type(exc).__name__}: {exc}"
            log.warning(
                "prefill %s at %s: pages not mapped (%s); its pulls read the usual way",
                getattr(peer, "engine_id", "?"),
                getattr(peer, "address", "?"),
                why,
            )
            self._metrics.peer_mappings.labels(outcome="unavailable").inc()
            return None
        self._metrics.peer_mappings.labels(outcome="mapped").inc()
        self._metrics.mapped_peers.set(self._held() + 1)  # this one's future is not done yet
        return source

    def _held(self) -> int:
        """Peers whose pages are mapped (a peer dropped meanwhile is counted until it is let go)."""
        return sum(1 for found in list(self._sources.values()) if _mapped(found))

    def release_idle(self, now: float) -> int:
        """Let go the mappings of prefill ranks without a pull for ``mapping_idle_s``; how many. Forgotten
        here first, on the loop, so no pull can take one after this; a pull that took one before has
        launched its kernel already (no await between the two), and the port unmaps only once this
        process's kernels have finished. A pull that waited for the mapping takes it only once it resumes,
        a loop turn or two after the mapping ended: kept until then."""
        idle, released = self._idle_s(), 0
        for peer, last in list(self._last_used.items()):
            found = self._sources.get(peer)
            if now - last <= idle or found is None or not _mapped(found) or peer in self._waiting:
                continue  # in use, being mapped, or not mappable (kept: the same peer never maps later)
            del self._sources[peer], self._last_used[peer]
            released += 1
            log.info(
                "prefill %s at %s: pages let go after %.0f s without a pull",
                getattr(peer, "engine_id", "?"),
                getattr(peer, "address", "?"),
                now - last,
            )
            self._in_background(self._port.unmap_pages, peer)
        self._metrics.mapped_peers.set(self._held())
        return released

    async def release_loop(self) -> None:
        """``release_idle`` every quarter of ``mapping_idle_s`` (at most every 5 s)."""
        while True:
            await asyncio.sleep(min(5.0, self._idle_s() / 4))
            self.release_idle(time.monotonic())

    async def convert(self, job: Job, source: Any, layers: int) -> None:
        """Convert the job's blocks (``job.pairs``) out of ``source`` in one launch on the daemon's stream and
        wait until it has ended; raises ``Failed`` unless every layer was converted, and before launching
        anything when NIXL let the prefill rank go (``unloaded``: a newer registration or a restarted
        prefill replaced it): its mapping stays open only for conversions launched before, and its old
        regions may now hold the newer registration's pages (a read through it is refused alike)."""
        peer = job.peer.peers[0]
        if getattr(peer, "unloaded", False):
            raise Failed(
                f"prefill {peer.engine_id} rank {peer.tp_rank} re-registered or restarted since this pull's "
                "handshake: its old pages are not converted"
            )
        pairs = job.pairs
        self._conversions.begin(job, source, job.peer.plan, pairs.remote)
        self._conversions.convert_group(job, 0, layers)
        job.mapped_bytes = layers * pairs.count * job.peer.plan.remote.page_bytes
        await self._conversions.finish(job, layers)


def _mapped(found: asyncio.Future) -> bool:
    """Whether a mapping's future ended with pages (not None, not failed, not cancelled)."""
    return found.done() and not found.cancelled() and found.exception() is None and found.result() is not None

