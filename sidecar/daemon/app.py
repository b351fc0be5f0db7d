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
import sys
import time
from collections.abc import Callable
from typing import Any

from sidecar import __version__
from sidecar.convert.gpu_share import mode_line
from sidecar.convert.launch import limits_for
from sidecar.daemon.caches import CacheRegistry
from sidecar.daemon.conversion import Conversions
from sidecar.daemon.heartbeats import Heartbeats
from sidecar.daemon.jobs import SHUTTING_DOWN, Ending, JobTable, Outcome, Session
from sidecar.daemon.leases import Leases, LeaseTracker
from sidecar.daemon.mapped import MappedReads
from sidecar.daemon.peers import Peers
from sidecar.daemon.pipeline import Pipeline
from sidecar.daemon.polling import Pacer, Poller
from sidecar.daemon.port import TransferPort
from sidecar.daemon.reads import Reads
from sidecar.daemon.registration import Registrations
from sidecar.daemon.router import Router
from sidecar.daemon.staging import Staging
from sidecar.ops import sdnotify
from sidecar.ops.config import Config, plan_reload, startup_warnings
from sidecar.ops.errors import StartupError
from sidecar.ops.metrics import Health, Metrics, MetricsServer, start_http_server
from sidecar.ops.socket_files import refuse_if_served, resolve_group, secure_socket_dir
from sidecar.wire import protocol as p

log = logging.getLogger("kv_sidecar.daemon")
# At shutdown, how long the notifications of pulls stopped in their handshake may wait for it to come through.
# A prefill left untold frees the blocks at its lease's end anyway: this must not stretch a short
# shutdown_grace_s by a long handshake_timeout_s.
TELL_AT_SHUTDOWN_S = 2.0


def nixl_port(config: Config) -> TransferPort:
    """The real port: a NIXL agent on this host (the CPU twin's when ``config.gpu`` is None)."""
    import torch

    from sidecar.nixl.agent import TransferSettings
    from sidecar.nixl.errors import TransferFailed
    from sidecar.nixl.port import NixlPort

    if config.gpu is None:
        # The CPU twin converts in one worker thread; torch's intra-op threads would take every core
        # from the loop, the zmq I/O threads and NIXL's progress thread.
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    try:
        return NixlPort(
            TransferSettings(
                backends=tuple(config.nixl_backends),
                progress_thread=config.nixl_progress_thread,
                num_threads=config.nixl_num_threads,
                cuda_device=config.gpu,
            )
        )
    except TransferFailed as exc:
        if exc.field != "nixl_backends":
            raise
        raise StartupError("nixl_backends", exc.reason) from None


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
        config_file: str = "",
    ) -> None:
        self.config = config
        self.config_file = config_file  # the file ``reload`` reads (absolute; "": none), for Status
        self._reload_fn = reload
        self.last_reload: p.ReloadStatus | None = None  # the latest SIGHUP's outcome (Status reports it)
        self._reloading: asyncio.Task | None = None  # on_sighup's read, in a thread
        self._reload_again = False  # a SIGHUP came while it read
        self.sighups = 0  # received so far; a reload's outcome says how many its read began after
        self._make_port = make_port
        self._bind_socket = bind
        self.metrics = Metrics()
        self.health = Health()
        self.metrics_server: MetricsServer | None = None
        self.port: TransferPort | None = None
        self.router = Router(self.metrics, keep=self._keeps_session)
        self.jobs = JobTable(config.max_inflight, config.max_queued)
        self.poller = Poller(
            Pacer(
                lambda: self.config.poll_busy_window_s,
                lambda: self.config.poll_interval_s,
                lambda: self.config.poll_linger_s,
            )
        )
        self.conversions = Conversions(
            config.gpu,
            limits_for(config.conversion_max_step_delay_us),
            self.metrics.fp8_reencode,
            wake=self.poller.wake,
            graphs=lambda: self.config.conversion_graphs,
            on_launch=self.metrics.launched,
            gates=lambda: self.config.conversion_gates,
            on_forced=self.metrics.gates_forced_open,
            loop_seen=lambda: self.health.last_tick,
        )
        self.poller.add(self.conversions.poll)
        self.caches: CacheRegistry | None = None
        self.peers: Peers | None = None
        self.leases: Leases | None = None
        self.reads: Reads | None = None
        self.staging: Staging | None = None
        self.pipeline: Pipeline | None = None
        self.registrations: Registrations | None = None
        self.heartbeats: Heartbeats | None = None
        self.mapped: MappedReads | None = None
        self._stop = asyncio.Event()
        self._stopping = False
        self._switch_interval: float | None = None
        self._watchdog: sdnotify.Watchdog | None = None  # under a unit with WatchdogSec=
        self._background: set[asyncio.Task] = set()

    # -- lifecycle

    async def start(self) -> None:
        cfg = self.config
        if cfg.http_port >= 0:
            self.metrics_server = start_http_server(
                self.metrics, self.health, cfg.metrics_host, cfg.http_port
            )
            log.info("metrics on %s", self.metrics_server.url)
        gid = resolve_group(cfg.socket_group) if cfg.socket_group else None
        if self._bind_socket:  # fail fast, before the slow start: a bad directory, or another daemon
            secure_socket_dir(cfg.socket_path, gid)
            refuse_if_served(cfg.socket_endpoint, cfg.socket_path)
        self.port = port = await asyncio.to_thread(self._make_port, cfg)
        if cfg.gpu is not None:
            # NIXL is driven from this (the loop's) thread: give it the device's context as well.
            from sidecar.nixl.calls import init_cuda_context

            init_cuda_context(cfg.gpu)
        self.health.agent_up = True
        await asyncio.to_thread(self.conversions.make_stream)
        log.info("%s", mode_line(self.conversions.limits, gpu=cfg.gpu, platform=_gpu_platform(cfg.gpu)))
        if cfg.staging_bytes:
            dev = 0 if cfg.gpu is None else cfg.gpu
            try:
                self.staging = await asyncio.to_thread(
                    Staging, port, cfg.staging_bytes, cfg.device, dev, self.metrics
                )
            except Exception as exc:  # torch's allocator (OutOfMemoryError too) or the NIXL registration
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise StartupError(
                    "staging_bytes", f"no pool of {cfg.staging_bytes} bytes on {cfg.device}: {first}"
                ) from None
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
            self._spawn(self.router.receive_loop(), essential="receive loop")
        assert self.reads is not None and self.heartbeats is not None and self.mapped is not None
        loops = {"poller": self.poller.loop(), "tick loop": self.health.beat(),
                 "lease renewals": self.heartbeats.renew_loop(),
                 "mapping release": self.mapped.release_loop()}
        if not cfg.nixl_progress_thread:
            loops["NIXL progress"] = self.reads.progress_loop()
        for name, coro in loops.items():
            self._spawn(coro, essential=name)
        self._switch_interval = sys.getswitchinterval()  # given back at shutdown (in-process daemons, tests)
        sys.setswitchinterval(cfg.gil_switch_interval_us / 1e6)
        gc.collect()
        gc.freeze()  # startup objects (torch, NIXL) never need scanning again: shorter GC pauses per Done
        self.health.mark_started()
        sdnotify.ready(f"serving {cfg.socket_endpoint} ({cfg.device})")
        period = sdnotify.watchdog_period_s()
        if period is not None:
            self._watchdog = sdnotify.Watchdog(period, self.health.healthy).start()
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
        self.reads = reads = Reads(port, self.poller.wake, self.conversions.convert_group)
        self.metrics.poster_busy.set_function(reads.poster_busy_s)
        self.health.add_check(self._poster_stalled)
        self.poller.add(reads.poll)
        self.leases = Leases(tracker, port, self.metrics, reads.sent, reads.on_poster)
        stopping = lambda: self._stopping  # noqa: E731
        self.peers = Peers(
            port,
            lambda: self.config,
            self.metrics,
            lambda k, peer: self._admitted(k, peer),
            self._spawn,
            reads.sent,
            reads.in_background,
            reads.on_poster,
        )
        self.heartbeats = Heartbeats(
            leases=self.leases,
            peers=self.peers,
            caches=self.caches,
            jobs=self.jobs,
            send=self.router.send,
            metrics=self.metrics,
            interval_s=lambda: self.config.heartbeat_interval_s,
            stopping=stopping,
        )
        self.registrations = regs = Registrations(
            caches=self.caches,
            jobs=self.jobs,
            peers=self.peers,
            send=self.router.send,
            metrics=self.metrics,
            health=self.health,
            config=lambda: self.config,
            spawn=self._spawn,
            stopping=stopping,
            bound=lambda identity: (
                self.router.completions is not None and self.router.completions.bound(identity)
            ),
        )
        self.mapped = MappedReads(
            port, reads.on_poster, reads.in_background, self.conversions, self.metrics,
            lambda: self.config.mapping_idle_s,
        )
        self.pipeline = Pipeline(
            config=lambda: self.config,
            jobs=self.jobs,
            caches=self.caches,
            peers=self.peers,
            leases=self.leases,
            reads=reads,
            staging=self.staging,
            conversions=self.conversions,
            mapped=self.mapped,
            send=self.router.send,
            metrics=self.metrics,
            spawn=self._spawn,
            stopping=stopping,
        )
        r = self.router
        r.on(p.Hello, self._on_hello)
        r.on(p.Ping, lambda env, _s, msg, _t: r.send(env, p.Pong(nonce=msg.nonce, sent_at_ns=_now_ns())))
        r.on(p.Status, lambda env, _s, msg, _t: r.send(env, self._status(msg.nonce)))
        r.on(p.RegisterCaches, lambda env, s, msg, _t: self._spawn(regs.on_register(env, s, msg)))
        r.on(p.Unregister, lambda env, s, _m, _t: self._spawn(regs.on_unregister(env, s)))
        r.on(p.Pull, self.pipeline.on_pull)
        r.on(p.Abort, self.pipeline.on_abort)
        r.on(p.Heartbeat, self.heartbeats.on_heartbeat)

    def _status(self, nonce: int) -> p.StatusReply:
        """``Status``'s answer: the current caches and the prefill ranks the daemon holds admitted against
        them (none without caches: no pull reads, and a new registration admits every prefill again)."""
        caches = self.caches.current if self.caches is not None else None
        if caches is None:
            return p.StatusReply(nonce=nonce, registered=False, pid=os.getpid(), reload=self.last_reload,
                                 sighups=self.sighups, device=self.config.device,
                                 config_file=self.config_file)
        peers = [p.PeerStatus(address=target.address, engine_id=peer.engine_id, tp_rank=peer.tp_rank,
                              tp_size=target.remote_tp)
                 for target, peer in (self.peers.admitted_peers() if self.peers is not None else [])]
        owner = caches.owner_session
        return p.StatusReply(nonce=nonce, registered=True, registered_bytes=caches.nbytes,
                             num_layers=len(caches.layers), page_format=caches.page_format,
                             compat_factors=caches.compat_factors, peers=peers,
                             tp_size=owner.tp_size if owner is not None else 1,
                             tp_rank=owner.rank if owner is not None else 0,
                             pid=os.getpid(), reload=self.last_reload, sighups=self.sighups,
                             device=self.config.device, config_file=self.config_file)

    def _admitted(self, key: tuple[str, int], peer: Any) -> None:
        if self.heartbeats is not None:
            self.heartbeats.admitted(key, peer)

    def _keeps_session(self, session: Session) -> bool:
        """The router must remember a session that owns the caches or has a pull in flight: forgotten, it
        would have to say Hello again before its next Pull."""
        caches = self.caches.current if self.caches is not None else None
        if caches is not None and caches.owned_by(session):
            return True
        return any(job.session is session for job in self.jobs.jobs())

    def _shim_gone(self, identity: bytes) -> None:
        if self.registrations is not None:
            self.registrations.shim_gone(identity)

    def request_stop(self) -> None:
        self._stop.set()

    async def serve(self) -> None:
        await self._stop.wait()

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Stop accepting, let in-flight pulls finish for ``grace_s``, fail the rest, release everything."""
        if self._stopping:
            return
        self._stopping = True
        if self.registrations is not None:
            self.registrations.cancel_owner_timer()
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
        if self.registrations is not None:
            await self.registrations.release()
        if self.peers is not None:  # a pull stopped in its handshake tells its prefill once it is through
            await self.peers.told(min(self.config.handshake_timeout_s, TELL_AT_SHUTDOWN_S))
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.peers is not None:
            self.peers.close()
        if self.reads is not None:
            self.reads.close()  # the poster thread's last call returns before the port closes
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
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None
        if self._watchdog is not None:  # fed through the drain above: systemd's stop has its own timeout
            self._watchdog.stop()
            self._watchdog = None
        if self.metrics_server is not None:
            self.metrics_server.close()
        log.info("kv-sidecar stopped")

    def reload(self) -> None:
        """Re-read the configuration and apply what can change live, here and now. Reading waits for the file
        to settle (at least ``settled_file.SETTLE_S``): the loop's SIGHUP handler reads in a thread
        (``on_sighup``)."""
        self.sighups += 1
        self._apply_config(self.sighups, *self._read_config())

    def on_sighup(self) -> None:
        """SIGHUP, on the loop: read the configuration in a thread, then apply it on the loop. The read waits
        ``settled_file.SETTLE_S`` for the file to stay unchanged, up to ``settled_file.SETTLE_BOUND_S`` while
        it keeps changing: on the loop, that would hold every pull's polls and replies. A SIGHUP while one
        reads makes one more read after it (the file may have changed since that read began)."""
        if self._stopping:  # one queued as the stop began: nothing left to reload
            return
        self.sighups += 1
        if self._reloading is not None and not self._reloading.done():
            self._reload_again = True
            return
        self._reloading = self._spawn(self._reload_in_thread())

    async def _reload_in_thread(self) -> None:
        again = True
        while again:
            self._reload_again = False
            covered = self.sighups
            new, error = await asyncio.to_thread(self._read_config)
            if not self._stopping:
                self._apply_config(covered, new, error)
            again = self._reload_again

    def _read_config(self) -> tuple[Config | None, str]:
        """The reload source's configuration, or None and why it could not be read (any thread)."""
        if self._reload_fn is None:
            return None, ""
        try:
            return self._reload_fn(), ""
        except Exception as exc:  # noqa: BLE001 - a bad reload keeps the running config
            return None, str(exc) or type(exc).__name__

    def _apply_config(self, covered: int, new: Config | None, error: str) -> None:
        """Apply the live keys of ``new`` (on the loop), read after the first ``covered`` SIGHUPs. The outcome
        is kept for ``Status`` (``kv-sidecar reload`` waits for it) and counted in ``config_*`` metrics."""
        if new is None and not error:
            log.warning("SIGHUP: no configuration source to reload")
            return
        if new is None:
            log.error("SIGHUP: configuration not reloaded: %s", error)
            # the file was not read: what the last readable one left pending still is
            pending = self.last_reload.restart_pending if self.last_reload is not None else []
            self._reloaded(covered, "refused", error, [], pending)
            return
        plan = plan_reload(self.config, new)
        if plan.restart:
            log.warning("SIGHUP: %s changed but need a restart; keeping the running values",
                        ", ".join(plan.restart))
        if plan.refused:
            log.error("SIGHUP: configuration not reloaded: %s", plan.refused)
            self._reloaded(covered, "refused", plan.refused, applied=[], restart=plan.restart)
            return
        if plan.config is None:
            log.info("SIGHUP: nothing to apply")
            self._reloaded(covered, "unchanged", "", [], plan.restart)
            return
        self.config = plan.config
        logging.getLogger("kv_sidecar").setLevel(self.config.log_level)
        if self.leases is not None:
            self.leases.tracker.heartbeat_interval_s = self.config.heartbeat_interval_s
        if {"remotes", "verify_model_identity", "pull_mode"} & set(plan.applied) and self.peers is not None:
            self.peers.invalidate()  # cached prefills are re-admitted once idle
        log.info("SIGHUP: applied %s", ", ".join(plan.applied))
        for warning in startup_warnings(plan.config):  # the running config, not the file's restart-only keys
            log.warning("SIGHUP: %s", warning)
        self._reloaded(covered, "applied", "", plan.applied, plan.restart)

    def _reloaded(self, covered: int, outcome: str, reason: str, applied: list[str],
                  restart: list[str]) -> None:
        """Keep a reload's outcome for ``Status`` and count it."""
        self.last_reload = p.ReloadStatus(count=covered, outcome=outcome, reason=reason, applied=applied,
                                          restart_pending=restart)
        self.metrics.reloaded(outcome, len(restart), time.time())

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        # SIGHUP through signal.signal, not the loop's add_signal_handler: a loop letting go of a signal (its
        # remove_signal_handler, its close) sets the default action back, SIGHUP's terminates, and a SIGHUP
        # in the moment before ``run`` ignores it killed the daemon on its way out. Set so, it goes from this
        # handler to ignored in one step (the loop's wake-up fd, set for SIGTERM, runs it promptly).
        signal.signal(signal.SIGHUP, lambda _sig, _frame: loop.call_soon_threadsafe(self.on_sighup))

    def _spawn(self, coro: Any, essential: str | None = None) -> asyncio.Task:
        """A background task, its crash logged. ``essential`` names a loop the daemon cannot serve without:
        should it ever end, /healthz says so (and a liveness probe or systemd's watchdog restarts us)."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_crash)
        if essential is not None:
            task.add_done_callback(lambda t: self._essential_ended(essential, t))
        return task

    def _essential_ended(self, name: str, task: asyncio.Task) -> None:
        if self.health.stopping or task.cancelled():
            return
        exc = task.exception()
        self.health.broken = f"{name} ended: {type(exc).__name__}: {exc}" if exc else f"{name} ended"
        log.error("%s; /healthz now fails", self.health.broken)

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

    def _poster_stalled(self) -> str | None:
        """/healthz's check of the poster thread (called from the HTTP thread)."""
        busy, limit = (self.reads.poster_busy_s() if self.reads else 0.0), self.config.poster_stall_s
        if busy <= limit:
            return None
        return (
            f"poster thread inside one NIXL call for {busy:.0f} s (poster_stall_s {limit:g}): pulls behind "
            "it cannot be posted; restart the daemon"
        )


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
    config_file: str = "",
) -> int:
    """Run a daemon until SIGTERM/SIGINT (SIGHUP reloads): the body of ``kv-sidecar serve``."""
    daemon = Daemon(config, reload=reload, config_file=config_file)
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
        # Stopping: nothing left to reload. Ignored, never its default action (terminate), which would kill
        # the process on its way out (exit by signal, not 0): see install_signal_handlers.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        await daemon.shutdown()
    return 0
