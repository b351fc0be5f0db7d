"""Prefill ranks: one handshake per (engine id, rank), shared by every request to it, and notifications.

A handshake is cached until the prefill restarts (a newer registration generation or a new engine at the
same address), the configuration changes what it was admitted under, or a read finds the peer gone. A
failed or refused handshake is never cached: the next request tries again. A refusal by the admission rules
is remembered, though, so the shim's heartbeats do not handshake again under the same rules (``refused``);
a prefill the transport cannot load for what it has loaded already (``PeerConflict``) is not: that passes
once the peer in its way is let go, and the pull is answered failed, not refused.
A request we will not read still gets its notification, so the prefill frees its blocks now instead of at
its lease's end.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from sidecar.daemon.errors import Failed, Inadmissible, Refused, reason_of
from sidecar.daemon.port import Admission, PeerTarget, Runner, TransferPort
from sidecar.nixl.admission import RemoteFormatRule
from sidecar.nixl.errors import PeerConflict, RemoteRefused
from sidecar.ops.config import Config
from sidecar.ops.metrics import Metrics
from sidecar.ops.ratelog import RateLimitedLog
from sidecar.wire import prefill as vllm_wire

log = logging.getLogger("kv_sidecar.peers")

Key = tuple[str, int]  # (engine id, prefill TP rank)
# Handshakes no pull waits for (a Heartbeat's early one, one made only to tell a prefill a request will not
# be read) running at once, at most. A Heartbeat may name any number of prefills, and each handshake holds
# two of the process's 1,023 ZMQ sockets for up to handshake_timeout_s: unbounded, one Heartbeat naming
# 2,000 left none for the handshakes pulls wait for ("Too many open files"). Past it, a pull handshakes
# when it comes, and an unread request's blocks are freed by the prefill's lease.
MAX_UNAWAITED_HANDSHAKES = 64
# A prefill rank no pull and no heartbeat used for this long is let go (``let_go_idle``): its NIXL agent
# unloaded, its next pull handshakes again. Prefills restart under new engine ids (vLLM's default), and each
# dead one's agent, a UCX endpoint to a gone process, stayed loaded until the daemon exited.
PEER_IDLE_S = 600.0


@dataclass(eq=False)
class PeerEntry:
    """A handshake (shared by every request to that prefill rank) and the peer it produced."""

    task: asyncio.Task
    config_gen: int
    key: Key = ("", 0)  # (engine id, prefill rank)
    users: int = 0
    target: PeerTarget | None = None  # what the handshake was for (the TP sizes and ranks among it)
    used_at: float = 0.0  # time.monotonic() when a pull or a heartbeat last used it (``let_go_idle``)

    @property
    def peer(self) -> Any:
        """The handshake's peer once it has succeeded, else None (running, failed or cancelled)."""
        t = self.task
        return t.result() if t.done() and not t.cancelled() and t.exception() is None else None

    @property
    def failed(self) -> bool:
        t = self.task
        return t.done() and (t.cancelled() or t.exception() is not None)


def newer_than_read(pull_generation: int, read_generation: int) -> bool:
    """Whether a pull naming the prefill's registration ``pull_generation`` is past the one a handshake read
    (``read_generation``), so must not read through its peer. An unknown one (0: a prefill older than vLLM's
    connector v15, or a heartbeat naming none) stands for the first publish, 1: a prefill at 1 has published
    no other metadata, but one past it may have answered that handshake before it registered again
    (sleep/wake)."""
    return pull_generation > max(read_generation, 1)


def same_prefill(target: PeerTarget, admitted: PeerTarget | None) -> bool:
    """Whether a pull's ``target`` names the prefill rank a handshake was made with (``admitted``): its engine
    id at the same address, TP and reading rank; the registration generation is ``newer_than_read``'s. A
    prefill restarted under a fixed engine id elsewhere, or at another TP (another head slice, another
    "id:n"), is another prefill."""
    return admitted is None or msgspec.structs.replace(target, generation=admitted.generation) == admitted


def admission_for(
    cfg: Config, address: str, local_format: Any, layers: int, compat_factors: Mapping[str, Any]
) -> Admission:
    """What the prefill at ``address`` is admitted against: the decoder's caches (their page format, layer
    count and hash factors) and the config's first [[remotes]] rule matching it. ``kv-sidecar doctor``
    builds its negotiation from the same call."""
    rule = next((r for r in cfg.remotes if fnmatch.fnmatchcase(address, r.match)), None)
    rules = (
        (RemoteFormatRule(address=rule.match, format=rule.page_format),)
        if rule is not None and rule.page_format is not None
        else ()
    )
    return Admission(
        local_format=local_format,
        layers=layers,
        compat_factors=dict(compat_factors),
        rules=rules,
        conversion_enabled=rule.convert if rule else True,
        allow_lossy_fp8=rule.fp8_lossy_reencode if rule else False,
        check_identity=cfg.verify_model_identity,
        timeout_s=cfg.handshake_timeout_s,
    )


class Peers:
    """The prefill ranks this daemon has handshaken with, keyed by (engine id, rank)."""

    def __init__(
        self,
        port: TransferPort,
        config: Callable[[], Config],
        metrics: Metrics,
        on_admitted: Callable[[Key, Any], None],
        spawn: Callable[[Any], asyncio.Task],
        sent: Callable[[], None],
        later: Callable[..., Any] | None = None,
        on_poster: Runner | None = None,
    ) -> None:
        self._port = port
        self._later = later  # runs a call on the poster thread (Reads.in_background), when one is given
        self._on_poster = on_poster  # the same, awaited for its result (Reads.on_poster)
        self._config = config
        self._metrics = metrics
        self._on_admitted = on_admitted
        self._spawn = spawn
        self._sent = sent  # something went out on NIXL: keep it moving (see Reads.progress_loop)
        self._entries: dict[Key, PeerEntry] = {}
        self._retiring: set[PeerEntry] = set()  # replaced entries whose peer goes once no pull holds it
        # per rank, what its last handshake was for when the rules refused it: the target alone, not the
        # entry (its task's exception holds the handshake's frame, and with it the caches it was admitted
        # against); forgotten at ``invalidate``, when they no longer say what the rules in force do
        self._refusals: dict[Key, PeerTarget] = {}
        self._generation = 0  # bumped when what peers were admitted under changes
        self._telling: set[asyncio.Task] = set()  # notifications waiting for their handshake (``told``)
        self._unawaited: set[asyncio.Task] = set()  # running handshakes of ``start_unawaited``
        self._ratelog = RateLimitedLog(log)  # conflicts repeat with each heartbeat while they last

    def invalidate(self) -> None:
        """Re-admit every cached prefill once idle (new caches, or a reload changed the rules)."""
        self._generation += 1
        self._refusals.clear()

    def admitted(self, key: Key) -> Any:
        """The admitted peer for ``key``, or None."""
        entry = self._entries.get(key)
        return entry.peer if entry is not None else None

    def heartbeat_through(self, key: Key) -> Any:
        """``admitted``, for a heartbeat to go through: the rank counts as used (``let_go_idle``)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        entry.used_at = time.monotonic()
        return entry.peer

    def let_go_idle(self, idle_s: float, now: float | None = None) -> int:
        """Forget the admitted ranks no pull holds and no pull or heartbeat used for ``idle_s``, their peers
        removed (NIXL's agent unloaded where nothing else uses it): a prefill gone for good, or restarted
        under a new engine id, no longer keeps its agent loaded. A live one is handshaken with again by its
        next heartbeat or pull. How many were let go."""
        now = time.monotonic() if now is None else now
        idle = [
            (key, entry)
            for key, entry in self._entries.items()
            if entry.users == 0 and entry.task.done() and now - entry.used_at > idle_s
        ]
        for key, entry in idle:
            del self._entries[key]
            peer = entry.peer
            if peer is not None:
                log.info("prefill %s rank %d let go after %.0f s unused", key[0], key[1], now - entry.used_at)
                self._remove(peer)
        return len(idle)

    def admitted_peers(self) -> list[tuple[PeerTarget, Any]]:
        """Every prefill rank admitted now, with the target it was admitted for, in no particular order: those
        a new pull would read through without handshaking again (``acquire``). A peer dropped, admitted
        against older caches or config, or let go by the transport is not: the next pull naming it
        handshakes anew."""
        return [
            (entry.target, peer)
            for entry in self._entries.values()
            if (peer := entry.peer) is not None
            and entry.target is not None
            and entry.config_gen == self._generation
            and not getattr(peer, "unloaded", False)
        ]

    def known(self, key: Key) -> bool:
        return key in self._entries

    def refused(self, target: PeerTarget) -> bool:
        """Whether the rules in force refused the last handshake with ``target`` (the same rank, address and
        TP): asked again, it would be refused again until a reload or new caches (``invalidate``). Not a
        handshake that failed, nor one the transport could not load for a peer in its way (``_handshake``)."""
        refused = self._refusals.get((target.engine_id, target.tp_rank))
        return refused is not None and refused == msgspec.structs.replace(
            target, generation=refused.generation
        )

    def acquire(self, target: PeerTarget, caches: Any) -> tuple[PeerEntry, asyncio.Task]:
        """The admitted peer for a request (handshaking if needed); the entry is held until ``release``."""
        key = (target.engine_id, target.tp_rank)
        entry = self._entries.get(key)
        if entry is not None and not entry.task.done() and (
            entry.config_gen != self._generation
            or newer_than_read(target.generation, entry.target.generation)
            or not same_prefill(target, entry.target)
        ):
            # still running, but admitting against what was replaced (other caches: another page format,
            # dtype or model identity of the same page size; other rules; an older registration of the
            # prefill; another prefill under its engine id): not joined, let go once through
            self._retire_running(entry)
            entry = None
        elif entry is not None and entry.task.done():
            peer = entry.peer
            stale = (
                peer is None
                or entry.config_gen != self._generation
                or newer_than_read(target.generation, peer.generation)
                or not same_prefill(target, entry.target)
            )
            if not stale and peer.generation == 0 and target.generation:
                peer.generation = target.generation  # a heartbeat's handshake that named none
            if stale:
                # replaced now, even while pulls still read through it (a restarted prefill's new pulls must
                # not read the old one, nor a reload wait for a quiet moment); removed once they let go
                self._retire(entry)
                entry = None
        if entry is None:
            entry = self.start(target, caches)
        entry.users += 1  # held, so not idle (``let_go_idle``) until ``release`` marks it used
        return entry, entry.task

    def release(self, entry: PeerEntry) -> None:
        entry.users -= 1
        entry.used_at = time.monotonic()
        if entry.users == 0 and entry in self._retiring and entry.task.done():
            self._retiring.discard(entry)
            self._remove(entry.peer)

    def _retire(self, entry: PeerEntry) -> None:
        """A replaced entry: its peer removed now if no pull holds it, else once the last lets go; a running
        handshake's once it is through (``_retire_running``)."""
        if not entry.task.done():
            self._retire_running(entry)
            return
        peer = entry.peer
        if peer is not None and entry.users == 0:
            self._remove(peer)
        elif peer is not None:
            self._retiring.add(entry)

    def _retire_running(self, entry: PeerEntry) -> None:
        """A running handshake replaced: its peer, if it comes, goes once no pull holds it (``release``)."""
        self._retiring.add(entry)

        def through(t: asyncio.Task) -> None:
            if entry not in self._retiring:
                return  # closed
            peer = entry.peer
            if peer is None or entry.users == 0:
                self._retiring.discard(entry)
                if peer is not None:
                    self._remove(peer)

        entry.task.add_done_callback(through)

    def _remove(self, peer: Any) -> None:
        """Let a peer no pull reads through go: on the poster thread, after the post in progress (NIXL's
        removal waits for it, and unmapping waits for the conversions queued so far)."""
        if self._later is not None:
            try:
                self._later(self._port.remove_peer, peer)
                return
            except RuntimeError:  # the poster thread is shut down: no post can be in progress
                pass
        self._port.remove_peer(peer)

    def let_go_notify_only(self, idle_s: float) -> None:
        """Have the transport let go the refused prefills' agents, loaded only to notify them, that were not
        used for ``idle_s`` (``TransferPort.let_go_notify_only``): on the poster thread, after the post in
        progress (NIXL's removal waits for it), or here without one; skipped once it is shut down."""
        if self._later is None:
            self._port.let_go_notify_only(idle_s)
            return
        with contextlib.suppress(RuntimeError):  # the poster thread is shut down: the daemon is stopping
            self._later(self._port.let_go_notify_only, idle_s)

    def start(self, target: PeerTarget, caches: Any) -> PeerEntry:
        """Start a handshake with ``target`` (replacing any entry for its key)."""
        key = (target.engine_id, target.tp_rank)
        task = asyncio.ensure_future(self._handshake(target, caches))
        entry = PeerEntry(task=task, config_gen=self._generation, key=key, target=target,
                          used_at=time.monotonic())
        self._entries[key] = entry
        self._refusals.pop(key, None)

        def forget_failure(t: asyncio.Task) -> None:
            # forgotten even while pulls hold it (they have the entry): kept, it would make the rank "known"
            # with no peer, and the shim's heartbeats for it would neither go out nor start a handshake
            if (t.cancelled() or t.exception() is not None) and self._entries.get(key) is entry:
                del self._entries[key]
                if not t.cancelled() and isinstance(t.exception(), Inadmissible) and (
                    entry.config_gen == self._generation
                ):
                    self._refusals[key] = target

        task.add_done_callback(forget_failure)
        return entry

    def start_unawaited(self, target: PeerTarget, caches: Any) -> PeerEntry | None:
        """``start`` a handshake no pull waits for; None (not started) while MAX_UNAWAITED_HANDSHAKES run."""
        if len(self._unawaited) >= MAX_UNAWAITED_HANDSHAKES:
            log.debug("handshake with %s rank %d not started early: %d such handshakes running",
                      target.engine_id, target.tp_rank, len(self._unawaited))
            return None
        entry = self.start(target, caches)
        self._unawaited.add(entry.task)
        entry.task.add_done_callback(self._unawaited.discard)
        return entry

    def drop(self, entry: PeerEntry | None) -> None:
        """The prefill is gone (restarted?): the next request handshakes again."""
        if entry is not None:
            entry.config_gen = -1

    def _admission(self, address: str, caches: Any) -> Admission:
        return admission_for(
            self._config(), address, caches.page_format, len(caches.layers), caches.compat_factors
        )

    async def _handshake(self, target: PeerTarget, caches: Any) -> Any:
        try:
            peer = await self._port.connect(target, self._admission(target.address, caches), self._on_poster)
        except RemoteRefused as exc:
            self._metrics.handshake("refused")
            raise Inadmissible(exc.field or "remote", exc.reason, getattr(exc, "peer", None)) from None
        except PeerConflict as exc:
            # admitted, but a peer loaded already stands in its way (an older generation than the loaded one,
            # an agent name another engine's peer reads through): no rule of ours, so not remembered
            # (``refused``) nor counted refused, and its pull fails rather than being refused (its field is
            # no page format or identity that does not fit: KvSidecarRefusing)
            self._metrics.handshake("failed")
            self._ratelog.log(
                f"conflict:{exc.field}", logging.INFO, "prefill %s rank %d at %s not loaded: %s",
                target.engine_id, target.tp_rank, target.address, exc,
            )
            raise Failed(f"handshake with {target.address}: {exc}") from None
        except vllm_wire.HandshakeRefused as exc:
            self._metrics.handshake("failed")
            raise Refused(exc.field, exc.reason) from None
        except vllm_wire.HandshakeTimeout as exc:
            self._metrics.handshake("failed")
            raise Failed(f"handshake: {exc}") from None
        except Exception as exc:
            self._metrics.handshake("failed")
            raise Failed(f"handshake with {target.address}: {reason_of(exc)}") from None
        self._metrics.handshake("ok")
        log.info(
            "prefill %s rank %d at %s admitted: %s",
            target.engine_id,
            target.tp_rank,
            target.address,
            "convert" if peer.plan.convert else "plain read",
        )
        self._forget_unloaded()
        self._on_admitted((target.engine_id, target.tp_rank), peer)
        return peer

    def _forget_unloaded(self) -> None:
        """Entries whose peer the transport let go when this admission replaced it (``unloaded``: a restarted
        prefill at the same address): forgotten, their peer removed once no pull holds it, so its mapping
        closes now rather than after ``mapping_idle_s``."""
        for key, entry in list(self._entries.items()):
            peer = entry.peer
            if peer is None or not getattr(peer, "unloaded", False):
                continue
            del self._entries[key]
            if entry.users == 0:
                self._remove(peer)
            else:
                self._retiring.add(entry)

    # -- notifications

    def notify(self, peer: Any, remote_request_id: str) -> None:
        """Tell the prefill to free a request's blocks (best effort: its lease frees them anyway). Sent now,
        or on the poster thread after the post in progress (the loop does not wait for a post)."""
        self._sent()
        with self._port.hold(blocking=self._later is None) as held:
            if held:
                self._notify_now(peer, remote_request_id)
                return
        assert self._later is not None
        self._later(self._notify_now, peer, remote_request_id)

    def _notify_now(self, peer: Any, remote_request_id: str) -> None:
        try:
            self._port.notify(peer, remote_request_id)
        except Exception as exc:  # noqa: BLE001
            log.info("notification for %s failed: %s", remote_request_id, exc)

    def notify_soon(self, peer: Any, remote_request_id: str, entries: list[PeerEntry]) -> None:
        """``notify`` on the loop's next turn (after the answer, which need not wait for NIXL's send), the
        ranks' ``entries`` held until it is sent or queued: a peer a reload retired meanwhile is removed only
        after that. Its removal, queued on the poster thread first, unloaded the prefill's agent (where no
        current peer shared it yet) before the notification went out, and the prefill held the blocks for
        the rest of its lease."""
        for entry in entries:
            entry.users += 1

        def send() -> None:
            try:
                self.notify(peer, remote_request_id)
            finally:
                for entry in entries:
                    self.release(entry)

        asyncio.get_running_loop().call_soon(send)

    def notify_when_admitted(self, entry: PeerEntry, remote_request_id: str) -> None:
        """Notify once the entry's running handshake is through, without holding anyone up; the entry is held
        until then, so a retired peer is removed only after its notification (``notify_soon``)."""
        handshake = entry.task
        entry.users += 1

        async def later() -> None:
            try:
                peer = await asyncio.shield(handshake)
            except Refused as exc:  # refused after its handshake decoded: it can still be told
                peer = exc.notify_peer
            except Exception:  # noqa: BLE001 - no prefill to tell; its lease frees the blocks
                return
            if peer is not None:
                self.notify(peer, remote_request_id)

        task = self._spawn(later())
        self._telling.add(task)
        task.add_done_callback(self._telling.discard)
        task.add_done_callback(lambda _t: self.release(entry))  # also if cancelled before it began

    async def told(self, timeout_s: float) -> None:
        """Wait, at most ``timeout_s``, for the notifications still waiting for their handshake: at shutdown,
        before those handshakes are cancelled (the prefill would otherwise hold the blocks for its lease)."""
        if self._telling:
            await asyncio.wait(list(self._telling), timeout=timeout_s)

    def notify_unread(self, target: PeerTarget, caches: Any, remote_request_id: str) -> None:
        """A request stopped before its handshake began: notify through the cached handshake, or (when there
        are caches to be admitted against) one made just to notify."""
        key = (target.engine_id, target.tp_rank)
        entry = self._entries.get(key)
        stale = None
        if entry is not None and not entry.failed and not same_prefill(target, entry.target):
            # made for another TP or reading rank (its peer owes another "id:n": a decoder restarted at
            # another TP), or another prefill under this engine id: not told through it
            stale, entry = entry, None
        if entry is None or entry.failed:
            if caches is None:
                return  # the prefill's lease frees the blocks
            entry = self.start_unawaited(target, caches)
            if entry is None:
                return  # as above
            if stale is not None:  # replaced by the handshake just started: let go as ``acquire`` does
                self._retire(stale)
        self.notify_when_admitted(entry, remote_request_id)

    def close(self) -> None:
        for entry in [*self._entries.values(), *self._retiring]:
            entry.task.cancel()
        self._entries.clear()
        self._retiring.clear()
        self._refusals.clear()
