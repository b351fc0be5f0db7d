"""Registration: the decoder's caches arriving (RegisterCaches), leaving (Unregister) and being orphaned.

Only the shim connection that registered the caches may pull into them or unregister them. When that shim's
completion socket closes, its caches stay for ``owner_grace_s`` (it may reconnect) and are then released:
pulls into them fail first, so nothing is written after the memory goes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from sidecar.daemon.caches import CacheRegistry
from sidecar.daemon.errors import Refused
from sidecar.daemon.jobs import SHUTTING_DOWN, Ending, JobTable, Outcome, Session
from sidecar.daemon.peers import Peers
from sidecar.ops.config import Config
from sidecar.ops.metrics import Health, Metrics
from sidecar.wire import ipc as ipc_mod
from sidecar.wire import protocol as p

log = logging.getLogger("kv_sidecar.registration")


class Registrations:
    """Handles RegisterCaches and Unregister, and releases the caches of a shim that went away."""

    def __init__(
        self,
        *,
        caches: CacheRegistry,
        jobs: JobTable,
        peers: Peers,
        send: Callable[[list[bytes], p.ToShim], None],
        metrics: Metrics,
        health: Health,
        config: Callable[[], Config],
        spawn: Callable[[Any], asyncio.Task],
        stopping: Callable[[], bool],
        bound: Callable[[bytes], bool],
    ) -> None:
        self._caches = caches
        self._jobs = jobs
        self._peers = peers
        self._send = send
        self._metrics = metrics
        self._health = health
        self._config = config
        self._spawn = spawn
        self._stopping = stopping
        self._bound = bound  # whether a shim has a completion connection now
        self._owner_timer: asyncio.TimerHandle | None = None
        # one registration change at a time, in arrival order: two that both waited for the old caches'
        # release would install in either order, the loser never released
        self._turn = asyncio.Lock()

    async def on_register(self, envelope: list[bytes], session: Session, msg: p.RegisterCaches) -> None:
        async with self._turn:
            await self._register(envelope, session, msg)

    async def _register(self, envelope: list[bytes], session: Session, msg: p.RegisterCaches) -> None:
        if session.hello is None:
            self._send(
                envelope, p.Error(reason="say Hello before RegisterCaches", in_reply_to="RegisterCaches")
            )
            return
        if self._stopping():
            self._send(envelope, p.Error(reason=SHUTTING_DOWN, in_reply_to="RegisterCaches"))
            return
        try:
            caches = await self._caches.map(session, msg)
        except (Refused, ipc_mod.IpcError, ValueError) as exc:
            self._refuse(envelope, exc)
            return
        except Exception as exc:  # noqa: BLE001 - a spawned task: the router's catch-all never sees this
            log.exception("RegisterCaches: mapping failed")
            self._refuse(envelope, RuntimeError(f"internal error: {type(exc).__name__}: {exc}"))
            return
        if self._caches.current is not None:
            log.warning("new registration replaces generation %d", self._caches.current.generation)
            self._caches.retire()
            await self._jobs.cancel_all(Ending(Outcome.FAILED, "caches re-registered by the shim"))
            await self.release()
        try:
            self._caches.install(caches)  # NIXL stays on the loop thread
        except Exception as exc:  # noqa: BLE001 - NIXL refused the memory: report, keep serving
            self._refuse(envelope, exc)
            return
        # Only now: a registration refused above replaced nothing, so a vanished owner's caches must still go
        # at the end of its grace (a timer that fired meanwhile waited for this turn and finds them replaced).
        self.cancel_owner_timer()
        self._peers.invalidate()  # prefills admitted against the old caches' format are admitted again
        self._health.caches_registered = True
        self._metrics.registered_bytes.set(caches.nbytes)
        self._metrics.ready.set(1)
        log.info(
            "registered %d layers, %d bytes, %s (generation %d)",
            len(caches.layers),
            caches.nbytes,
            caches.page_format,
            caches.generation,
        )
        self._send(
            envelope,
            p.Registered(
                generation=caches.generation, registered_bytes=caches.nbytes, num_layers=len(caches.layers)
            ),
        )

    def _refuse(self, envelope: list[bytes], exc: Exception) -> None:
        field_name = exc.field if isinstance(exc, Refused) else getattr(exc, "field", None) or "buffers"
        self._metrics.refused(field_name)
        log.warning("RegisterCaches refused: %s", exc)
        self._send(envelope, p.Error(reason=str(exc), in_reply_to="RegisterCaches"))

    async def on_unregister(self, envelope: list[bytes], session: Session) -> None:
        async with self._turn:
            await self._unregister(envelope, session)

    async def _unregister(self, envelope: list[bytes], session: Session) -> None:
        current = self._caches.current
        if current is not None and not current.owned_by(session):
            self._metrics.foreign_messages.inc()
            reason = "session: the caches were registered by another shim connection"
            self._send(envelope, p.Error(reason=reason, in_reply_to="Unregister"))
            return
        self._caches.retire()
        await self._jobs.cancel_all(Ending(Outcome.FAILED, "caches unregistered by the shim"))
        await self.release()
        self._send(envelope, p.Unregistered())

    async def release(self) -> None:
        """Release the current caches (their jobs must be answered first)."""
        self._health.caches_registered = False
        self._metrics.ready.set(0)
        self._metrics.registered_bytes.set(0)
        await self._caches.release()

    def shim_gone(self, identity: bytes) -> None:
        """A shim's completion socket closed: if it owns the caches, release them after a grace period
        (a decoder that died leaves nothing mapped; one that reconnects in time keeps them)."""
        current = self._caches.current
        if self._stopping() or current is None or current.owner != identity:
            return
        grace = self._config().owner_grace_s
        log.warning(
            "the shim that registered cache generation %d disconnected; releasing them in %g s unless it "
            "comes back",
            current.generation,
            grace,
        )
        self.cancel_owner_timer()
        self._owner_timer = asyncio.get_running_loop().call_later(
            grace, lambda: self._spawn(self._release_if_still_gone(identity))
        )

    def cancel_owner_timer(self) -> None:
        if self._owner_timer is not None:
            self._owner_timer.cancel()
            self._owner_timer = None

    async def _release_if_still_gone(self, identity: bytes) -> None:
        self._owner_timer = None
        async with self._turn:
            await self._release_gone(identity)

    async def _release_gone(self, identity: bytes) -> None:
        current = self._caches.current
        if current is None or current.owner != identity or self._stopping() or self._bound(identity):
            return  # replaced, stopping, or it came back
        self._caches.retire()
        await self._jobs.cancel_all(
            Ending(Outcome.FAILED, "the shim that registered the caches disconnected")
        )
        await self.release()
        log.warning("released the caches of a disconnected shim (generation %d)", current.generation)
