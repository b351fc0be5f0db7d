"""The daemon as a whole: builds its parts, starts them, serves until told to stop, shuts down, reloads.

Start order matters: the HTTP endpoint and the NIXL agent come up before the socket is bound, so a shim
that connects is answered at once (it gives up on a Hello that waits out the agent's seconds-long start).
Shutdown lets in-flight pulls finish for ``shutdown_grace_s``, then fails the rest, then releases
everything. SIGHUP re-reads the configuration and applies what can change live.

Size: the composition root plus the four handlers that span parts (Hello, RegisterCaches, Unregister,
Heartbeat); each part it wires lives in its own module.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import msgspec

from sidecar import __version__
from sidecar.convert.gpu_share import mode_line
from sidecar.convert.launch import limits_for
from sidecar.daemon.caches import CacheRegistry
from sidecar.daemon.conversion import Conversions
from sidecar.daemon.errors import Refused
from sidecar.daemon.jobs import SHUTTING_DOWN, Ending, JobTable, Outcome, Session
from sidecar.daemon.leases import Leases, LeaseTracker
from sidecar.daemon.peers import Peers
from sidecar.daemon.pipeline import Pipeline
from sidecar.daemon.port import PeerTarget, TransferPort
from sidecar.daemon.reads import Reads
from sidecar.daemon.router import Router
from sidecar.daemon.staging import Staging
from sidecar.ops import sdnotify
from sidecar.ops.config import Config, reload_changes
from sidecar.ops.metrics import Health, Metrics, MetricsServer, start_http_server
from sidecar.ops.socket_files import refuse_if_served, resolve_group, secure_socket_dir
from sidecar.wire import ipc as ipc_mod
from sidecar.wire import protocol as p

log = logging.getLogger("kv_sidecar.daemon")


def nixl_port(config: Config) -> TransferPort:
    """The real port: a NIXL agent on this host (the CPU twin's when ``config.gpu`` is None)."""
    import torch

    from sidecar.nixl.agent import TransferSettings
    from sidecar.nixl.port import NixlPort

    if config.gpu is None:
        # The CPU twin converts in one worker thread; torch's intra-op threads would take every core
        # from the loop, the zmq I/O threads and NIXL's progress thread.
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    return NixlPort(
        TransferSettings(
            backends=tuple(config.nixl_backends),
            progress_thread=config.nixl_progress_thread,
            num_threads=config.nixl_num_threads,
            remote_mem_type="DRAM" if config.gpu is None else "VRAM",
            cuda_device=config.gpu,
        )
    )


class Daemon:
    """``await start()``, then ``await serve()`` until ``request_stop()``; ``await shutdown()`` cleans up.

    ``make_port`` builds the prefill side (default: NIXL); unit tests pass an in-process fake."""

    def __init__(
        self,
        config: Config,
        *,
        reload: Callable[[], Config] | None = None,
        make_port: Callable[[Config], TransferPort] = nixl_port,
        bind: bool = True,
    ) -> None:
        self.config = config
        self._reload_fn = reload
        self._make_port = make_port
        self._bind_socket = bind
        self.metrics = Metrics()
        self.health = Health()
        self.metrics_server: MetricsServer | None = None
        self.port: TransferPort | None = None
        self.router = Router(self.metrics)
        self.jobs = JobTable(config.max_inflight, config.max_queued, config.max_timeout_s)
        self.conversions = Conversions(
            config.gpu, limits_for(config.conversion_max_step_delay_us), self.metrics.fp8_reencode
        )
        self.caches: CacheRegistry | None = None
        self.peers: Peers | None = None
        self.leases: Leases | None = None
        self.reads: Reads | None = None
        self.staging: Staging | None = None
        self.pipeline: Pipeline | None = None
        self._stop = asyncio.Event()
        self._stopping = False
        self._background: set[asyncio.Task] = set()
        self._owner_timer: asyncio.TimerHandle | None = None

    # -- lifecycle

    async def start(self) -> None:
        cfg = self.config
        if cfg.metrics_port >= 0:
            self.metrics_server = start_http_server(
                self.metrics, self.health, cfg.metrics_host, cfg.metrics_port
            )
            log.info("metrics on %s", self.metrics_server.url)
        gid = resolve_group(cfg.socket_group) if cfg.socket_group else None
        if self._bind_socket:  # fail fast, before the slow start: a bad directory, or another daemon
            secure_socket_dir(cfg.socket_path, gid)
            refuse_if_served(cfg.socket_endpoint, cfg.socket_path)
        self.port = port = await asyncio.to_thread(self._make_port, cfg)
        if cfg.gpu is not None:
            # NIXL is driven from this (the loop's) thread: give it the device's context as well.
            from sidecar.nixl.agent import init_cuda_context

            init_cuda_context(cfg.gpu)
        self.health.agent_up = True
        await asyncio.to_thread(self.conversions.make_stream)
        log.info("%s", mode_line(self.conversions.limits, gpu=cfg.gpu, platform=_gpu_platform(cfg.gpu)))
        if cfg.staging_bytes:
            dev = 0 if cfg.gpu is None else cfg.gpu
            self.staging = await asyncio.to_thread(Staging, port, cfg.staging_bytes, cfg.device, dev)
        self._assemble(port)
        if self._bind_socket:
            _raise_fd_limit()
            self.router.bind(
                cfg.socket_endpoint,
                cfg.socket_path,
                gid,
                fast_completions=cfg.fast_completions,
                max_connections=cfg.max_connections,
                on_closed=self._shim_gone,
            )
            self.health.socket_bound = True
            self._spawn(self.router.receive_loop())
        assert self.reads is not None
        loops = [self.reads.poll_loop(), self._tick_loop(), self._heartbeat_loop()]
        if not cfg.nixl_progress_thread:
            loops.append(self.reads.progress_loop())
        for coro in loops:
            self._spawn(coro)
        gc.collect()
        gc.freeze()  # startup objects (torch, NIXL) never need scanning again: shorter GC pauses per Done
        sdnotify.ready(f"serving {cfg.socket_endpoint} ({cfg.device})")
        log.info(
            "kv-sidecar %s serving %s on %s (pid %d)",
            __version__,
            cfg.device,
            cfg.socket_endpoint,
            os.getpid(),
        )

    def _assemble(self, port: TransferPort) -> None:
        """Wire the parts together and register the router's handlers."""
        cfg = self.config
        tracker = LeaseTracker(
            cfg.lease_s, margin_s=cfg.lease_margin_s, heartbeat_interval_s=cfg.heartbeat_interval_s
        )
        self.caches = CacheRegistry(port, cfg.device, cfg.gpu)
        self.reads = reads = Reads(port, lambda: self.config.poll_interval_s, self.conversions.convert_group)
        self.leases = Leases(tracker, port, self.metrics, reads.sent)
        self.peers = Peers(port, lambda: self.config, self.metrics, self._admitted, self._spawn, reads.sent)
        self.pipeline = Pipeline(
            config=lambda: self.config,
            jobs=self.jobs,
            caches=self.caches,
            peers=self.peers,
            leases=self.leases,
            reads=reads,
            staging=self.staging,
            conversions=self.conversions,
            send=self.router.send,
            metrics=self.metrics,
            spawn=self._spawn,
            stopping=lambda: self._stopping,
        )
        r = self.router
        r.on(p.Hello, self._on_hello)
        r.on(p.Ping, lambda env, _s, msg, _t: r.send(env, p.Pong(nonce=msg.nonce, sent_at_ns=_now_ns())))
        r.on(p.RegisterCaches, lambda env, s, msg, _t: self._spawn(self._on_register(env, s, msg)))
        r.on(p.Unregister, lambda env, s, _m, _t: self._spawn(self._on_unregister(env, s)))
        r.on(p.Pull, self.pipeline.on_pull)
        r.on(p.Abort, self.pipeline.on_abort)
        r.on(p.Heartbeat, self._on_heartbeat)

    def request_stop(self) -> None:
        self._stop.set()

    async def serve(self) -> None:
        await self._stop.wait()

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Stop accepting, let in-flight pulls finish for ``grace_s``, fail the rest, release everything."""
        if self._stopping:
            return
        self._stopping = True
        self._cancel_owner_timer()
        self.health.stopping = True
        self.metrics.ready.set(0)
        sdnotify.stopping("draining")
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        tasks = [j.task for j in self.jobs.jobs() if j.task is not None]
        if tasks:
            log.info("shutdown: waiting up to %.1f s for %d pull(s)", grace, len(tasks))
            await asyncio.wait(tasks, timeout=grace)
        await self.jobs.cancel_all(
            Ending(Outcome.FAILED, f"{SHUTTING_DOWN}: daemon stopped before the pull finished")
        )
        await self._release_caches()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.peers is not None:
            self.peers.close()
        if self.port is not None:
            if self.staging is not None:
                try:
                    self.staging.close()
                except Exception as exc:  # noqa: BLE001 - best effort on the way out
                    log.warning("staging pool: %s", exc)
                self.staging = None
            self.port.close()
            self.health.agent_up = False
        self.router.close()
        self.conversions.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        log.info("kv-sidecar stopped")

    def reload(self) -> None:
        """SIGHUP: re-read the configuration and apply what can change live."""
        if self._reload_fn is None:
            log.warning("SIGHUP: no configuration source to reload")
            return
        try:
            new = self._reload_fn()
        except Exception as exc:  # noqa: BLE001 - a bad reload keeps the running config
            log.error("SIGHUP: configuration not reloaded: %s", exc)
            return
        applied, restart = reload_changes(self.config, new)
        if restart:
            log.warning(
                "SIGHUP: %s changed but need a restart; keeping the running values", ", ".join(restart)
            )
        if not applied:
            log.info("SIGHUP: nothing to apply")
            return
        values = msgspec.structs.asdict(self.config)
        values.update({k: getattr(new, k) for k in applied})
        self.config = Config(**values)
        logging.getLogger("kv_sidecar").setLevel(self.config.log_level)
        if self.leases is not None:
            self.leases.tracker.heartbeat_interval_s = self.config.heartbeat_interval_s
        if {"remotes", "verify_model_identity", "pull_mode"} & set(applied) and self.peers is not None:
            self.peers.invalidate()  # cached prefills are re-admitted once idle
        log.info("SIGHUP: applied %s", ", ".join(applied))

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self.reload)

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_crash)
        return task

    # -- sessions and caches

    def _on_hello(self, envelope: list[bytes], session: Session, msg: p.Hello, received: float) -> None:
        if msg.protocol_version != p.PROTOCOL_VERSION:
            self.metrics.refused("protocol_version")
            reason = (
                f"protocol_version: the shim speaks {msg.protocol_version}, this daemon {p.PROTOCOL_VERSION}"
            )
            self.router.send(envelope, p.Error(reason=reason, in_reply_to="Hello"))
            return
        session.hello = msg
        completions = self.router.completions
        self.router.send(
            envelope,
            p.Welcome(
                protocol_version=p.PROTOCOL_VERSION,
                package_version=__version__,
                device=self.config.device,
                gpu=self.config.gpu,
                pid=os.getpid(),
                completion_socket=completions.path if completions is not None else "",
            ),
        )

    async def _on_register(self, envelope: list[bytes], session: Session, msg: p.RegisterCaches) -> None:
        assert self.caches is not None and self.peers is not None
        if session.hello is None:
            self.router.send(
                envelope, p.Error(reason="say Hello before RegisterCaches", in_reply_to="RegisterCaches")
            )
            return
        if self._stopping:
            self.router.send(envelope, p.Error(reason=SHUTTING_DOWN, in_reply_to="RegisterCaches"))
            return
        self._cancel_owner_timer()
        try:
            caches = await self.caches.map(session.identity, msg)
        except (Refused, ipc_mod.IpcError, ValueError) as exc:
            self._refuse_registration(envelope, exc)
            return
        if self.caches.current is not None:
            log.warning("new registration replaces generation %d", self.caches.current.generation)
            await self.jobs.cancel_all(Ending(Outcome.FAILED, "caches re-registered by the shim"))
            await self._release_caches()
        try:
            self.caches.install(caches)  # NIXL stays on the loop thread
        except Exception as exc:  # noqa: BLE001 - NIXL refused the memory: report, keep serving
            self._refuse_registration(envelope, exc)
            return
        self.peers.invalidate()  # prefills admitted against the old caches' format are admitted again
        self.health.caches_registered = True
        self.metrics.registered_bytes.set(caches.nbytes)
        self.metrics.ready.set(1)
        log.info(
            "registered %d layers, %d bytes, %s (generation %d)",
            len(caches.layers),
            caches.nbytes,
            caches.page_format,
            caches.generation,
        )
        self.router.send(
            envelope,
            p.Registered(
                generation=caches.generation, registered_bytes=caches.nbytes, num_layers=len(caches.layers)
            ),
        )

    def _refuse_registration(self, envelope: list[bytes], exc: Exception) -> None:
        field_name = exc.field if isinstance(exc, Refused) else getattr(exc, "field", None) or "buffers"
        self.metrics.refused(field_name)
        log.warning("RegisterCaches refused: %s", exc)
        self.router.send(envelope, p.Error(reason=str(exc), in_reply_to="RegisterCaches"))

    async def _on_unregister(self, envelope: list[bytes], session: Session) -> None:
        assert self.caches is not None
        current = self.caches.current
        if current is not None and current.owner != session.identity:
            self.metrics.foreign_messages.inc()
            reason = "session: the caches were registered by another shim connection"
            self.router.send(envelope, p.Error(reason=reason, in_reply_to="Unregister"))
            return
        await self.jobs.cancel_all(Ending(Outcome.FAILED, "caches unregistered by the shim"))
        await self._release_caches()
        self.router.send(envelope, p.Unregistered())

    async def _release_caches(self) -> None:
        self.health.caches_registered = False
        self.metrics.ready.set(0)
        self.metrics.registered_bytes.set(0)
        if self.caches is not None:
            await self.caches.release()

    def _shim_gone(self, identity: bytes) -> None:
        """A shim's completion socket closed: if it owns the caches, release them after a grace period
        (a decoder that died leaves nothing mapped; one that reconnects in time keeps them)."""
        current = self.caches.current if self.caches is not None else None
        if self._stopping or current is None or current.owner != identity:
            return
        log.warning(
            "the shim that registered cache generation %d disconnected; releasing them in %g s unless it "
            "comes back",
            current.generation,
            self.config.owner_grace_s,
        )
        self._cancel_owner_timer()
        loop = asyncio.get_running_loop()
        self._owner_timer = loop.call_later(
            self.config.owner_grace_s, lambda: self._spawn(self._release_if_owner_still_gone(identity))
        )

    def _cancel_owner_timer(self) -> None:
        if self._owner_timer is not None:
            self._owner_timer.cancel()
            self._owner_timer = None

    async def _release_if_owner_still_gone(self, identity: bytes) -> None:
        assert self.caches is not None
        self._owner_timer = None
        current = self.caches.current
        completions = self.router.completions
        if current is None or current.owner != identity or self._stopping:
            return
        if completions is not None and completions.bound(identity):
            return  # it came back
        await self.jobs.cancel_all(Ending(Outcome.FAILED, "the shim that registered the caches disconnected"))
        await self._release_caches()
        log.warning("released the caches of a disconnected shim (generation %d)", current.generation)

    # -- heartbeats

    def _on_heartbeat(
        self, envelope: list[bytes], session: Session, msg: p.Heartbeat, received: float
    ) -> None:
        assert self.leases is not None and self.peers is not None and self.caches is not None
        now = received
        for t in msg.targets:
            if t.remote_tp_size != session.tp_size or not t.remote_request_ids:
                continue
            key = (t.remote_engine_id, session.rank)
            self.leases.shim_heartbeat(key, t.remote_request_ids, now)
            peer = self.peers.admitted(key)
            if peer is not None:
                self.leases.send(peer, t.remote_request_ids)
            elif not self.peers.known(key) and self.caches.current is not None and not self._stopping:
                # like stock vLLM, the first heartbeat starts the handshake early; it heartbeats when done
                target = PeerTarget(t.remote_engine_id, session.rank, t.remote_host, t.remote_port)
                self.peers.start(target, self.caches.current)

    def _admitted(self, key: tuple[str, int], peer: Any) -> None:
        """A handshake went through: heartbeat what the shim heartbeated before we knew this prefill."""
        assert self.leases is not None
        pending = self.leases.heartbeated_for(key)
        if pending:
            self.leases.send(peer, pending)

    async def _heartbeat_loop(self) -> None:
        """Renew the leases of requests we hold (queued or reading) that are due."""
        assert self.leases is not None and self.peers is not None
        while True:
            await asyncio.sleep(min(1.0, self.config.heartbeat_interval_s / 2))
            now = time.monotonic()
            held = {j.msg.remote_request_id: j for j in self.jobs.jobs()}
            by_peer: dict[tuple[str, int], list[str]] = {}
            for rid in self.leases.due(now):
                job = held.get(rid)
                if job is not None and job.peer_entry is not None:
                    by_peer.setdefault((job.msg.remote_engine_id, job.session.rank), []).append(rid)
            for key, ids in by_peer.items():
                peer = self.peers.admitted(key)
                if peer is not None:
                    self.leases.send(peer, ids)
            self.leases.forget_lapsed(set(held), now)

    async def _tick_loop(self) -> None:
        while True:
            self.health.tick()
            await asyncio.sleep(0.5)


def _gpu_platform(gpu: int | None) -> str | None:
    if gpu is None:
        return None
    import torch

    return "rocm" if torch.version.hip else "cuda"


def _raise_fd_limit() -> None:
    """Use the hard limit on open files: libzmq aborts the process when it runs out (issue: fd pressure)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            log.info("open-file limit stays %d: %s", soft, exc)


def _now_ns() -> int:
    return time.monotonic_ns()


def _log_crash(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background task crashed", exc_info=task.exception())


async def run(
    config: Config,
    *,
    reload: Callable[[], Config] | None = None,
    on_started: Callable[[Daemon], None] | None = None,
) -> int:
    """Run a daemon until SIGTERM/SIGINT (SIGHUP reloads): the body of ``kv-sidecar serve``."""
    daemon = Daemon(config, reload=reload)
    try:
        await daemon.start()
    except Exception:
        await daemon.shutdown(0)
        raise
    daemon.install_signal_handlers()
    if on_started is not None:
        on_started(daemon)
    try:
        await daemon.serve()
    finally:
        await daemon.shutdown()
    return 0
