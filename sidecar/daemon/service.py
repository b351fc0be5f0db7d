"""The daemon: a request's life from Pull to Done (queue → handshake → read → convert → Done).

One asyncio (uvloop) loop owns everything: the ZMQ ROUTER the shim talks to (and its completion socket,
``completions.py``), the NIXL agent (polled, never blocking), the lease bookkeeping and every request.
Conversion runs off the loop, one layer group at a time as its READ lands: on the daemon's own CUDA/HIP stream
(the loop waits for its event in a thread), or on the CPU in one worker thread (the CPU twin's "stream").
Every accepted Pull is answered exactly once (Done, or Aborted after an Abort) and at the latest at its
deadline; nothing is answered while a transfer or a conversion can still write into its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import functools
import gc
import logging
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from sidecar import __version__
from sidecar.convert.launch import convert_blocks, launch_gpu
from sidecar.daemon.caches import Caches, close_caches, map_caches, register_caches
from sidecar.daemon.completions import CompletionSocket, completion_path
from sidecar.daemon.errors import Failed, Refused
from sidecar.daemon.slots import SlotAllocator
from sidecar.nixl.geometry import GeometryError, StagingPool
from sidecar.ops import sdnotify
from sidecar.ops.config import Config, reload_changes
from sidecar.ops.metrics import Health, Metrics, MetricsServer, start_http_server
from sidecar.ops.socket_files import (
    MAX_UNIX_PATH,
    bind_socket_file,
    refuse_if_served,
    resolve_group,
    secure_socket_dir,
)
from sidecar.wire import ipc as ipc_mod
from sidecar.wire import prefill as vllm_wire
from sidecar.wire import protocol as p

log = logging.getLogger("kv_sidecar.service")

# Reasons that start a Done(ok=False); the shim may match on the leading word.
OVERLOADED = "overloaded"
SHUTTING_DOWN = "shutting down"


# ------------------------------------------------------------------------------------------- state


@dataclass(eq=False)
class Session:
    """One shim worker, known by its ROUTER identity."""

    identity: bytes
    hello: p.Hello | None = None

    @property
    def rank(self) -> int:
        return self.hello.worker_rank if self.hello else 0

    @property
    def tp_size(self) -> int:
        return self.hello.tp_size if self.hello else 1


@dataclass(eq=False)
class PeerEntry:
    """A handshake (shared by every request to that prefill rank) and the peer it produced."""

    task: asyncio.Task
    config_gen: int
    users: int = 0

    @property
    def peer(self) -> Any:
        """The handshake's peer once it has succeeded, else None (running, failed or cancelled)."""
        t = self.task
        return t.result() if t.done() and not t.cancelled() and t.exception() is None else None


@dataclass(eq=False)
class Job:
    """One accepted Pull."""

    msg: p.Pull
    envelope: list[bytes]
    session: Session
    received: float
    deadline: float
    timeout_s: float
    stage: str = "queue"
    task: asyncio.Task | None = None
    cancel: tuple[str, str] | None = None  # (outcome, reason) set by deadline / abort / shutdown
    abort_envelope: list[bytes] | None = None
    peer: Any = None
    peer_key: tuple[str, int] | None = None
    peer_entry: PeerEntry | None = None
    settled: bool = False  # the pipeline ended; only quiescing and the answer remain (no more cancels)
    tpull: Any = None
    converting: bool = False  # its pages are converted, layer group by layer group as they land
    convert_src: Any = None  # staged: the request's pool slots as [layers, blocks, page]; None: in place
    conversions: list[asyncio.Future] = field(default_factory=list)  # CPU twin: one per layer group
    last_event: Any = None  # GPU: the event after the latest group's conversion (one stream, in order)
    converted_layers: int = 0
    conversion: asyncio.Future | None = None  # all of the above, once awaited
    slots: tuple[int, int] | None = None
    blocks: Any = None  # local kernel block ids read (numpy int64)
    caches: Caches | None = None
    has_slot: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    stage_started: float = 0.0

    def enter(self, stage: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self.stage_started and self.stage not in self.timings:
            self.timings[self.stage] = now - self.stage_started
        self.stage, self.stage_started = stage, now


@dataclass
class Outcome:
    kind: str  # ok | failed | refused | aborted | expired
    reason: str | None = None
    field: str | None = None
    safe: bool = True


# ------------------------------------------------------------------------------------------- the daemon


class Daemon:
    """``await start()``, then ``await serve()`` until ``request_stop()``; ``await shutdown()`` cleans up."""

    def __init__(self, config: Config, *, reload: Callable[[], Config] | None = None) -> None:
        self.config = config
        self._reload_fn = reload
        self.metrics = Metrics()
        self.health = Health()
        self.metrics_server: MetricsServer | None = None
        self.transfer: Any = None
        self.ctx: zmq.asyncio.Context | None = None
        self.sock: zmq.asyncio.Socket | None = None
        self.completions: CompletionSocket | None = None
        self.caches: Caches | None = None
        self._cache_gen = 0
        self._config_gen = 0
        self._sessions: dict[bytes, Session] = {}
        self._jobs: dict[str, Job] = {}
        self._queued = 0
        self._slots: asyncio.Semaphore | None = None
        self._peers: dict[tuple[str, int], PeerEntry] = {}
        self._reads: dict[Any, tuple[asyncio.Future, Job]] = {}  # transfer.Pull -> (its wait, its job)
        self._reads_wakeup: asyncio.Event | None = None
        self._hb_peer: dict[
            str, tuple[str, int, str, int]
        ] = {}  # remote_request_id -> (engine, rank, host, port)
        self._lease: Any = None
        self._convert_pool = ThreadPoolExecutor(1, thread_name_prefix="kv-sidecar-convert")
        self._stream: Any = None
        # staging: tensor, registration, device_id, mem_type; per page size: slot_bytes, staging, allocator
        self._pool: dict[str, Any] | None = None
        self._pool_changed: asyncio.Condition | None = None
        self._stop = asyncio.Event()
        self._stopping = False
        self._background: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last_nixl_activity = 0.0
        self.socket_path = ""

    # ---------------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start the HTTP endpoint and the NIXL agent, then bind the socket: a shim that connects is
        answered at once (it gives up on a Hello that waits out the agent's seconds-long start)."""
        from sidecar.nixl.agent import LeaseTracker

        cfg = self.config
        self._loop = asyncio.get_running_loop()
        self._slots = asyncio.Semaphore(cfg.max_inflight)
        self._reads_wakeup = asyncio.Event()
        self._pool_changed = asyncio.Condition()
        self._lease = LeaseTracker(
            cfg.lease_s, margin_s=cfg.lease_margin_s, heartbeat_interval_s=cfg.heartbeat_interval_s
        )
        if cfg.metrics_port >= 0:
            self.metrics_server = start_http_server(
                self.metrics, self.health, cfg.metrics_host, cfg.metrics_port
            )
            log.info("metrics on %s", self.metrics_server.url)
        self._check_socket()
        self.transfer = await asyncio.to_thread(self._make_transfer)
        if cfg.gpu is not None:
            # NIXL is driven from this (the loop's) thread: give it the device's context as well.
            from sidecar.nixl.agent import init_cuda_context

            init_cuda_context(cfg.gpu)
        self.health.agent_up = True
        if cfg.gpu is not None:
            self._stream = await asyncio.to_thread(self._make_stream)
        if cfg.staging_bytes:
            await asyncio.to_thread(self._make_pool)
        self._bind()
        self.health.socket_bound = True
        loops = [self._receive_loop(), self._poll_loop(), self._tick_loop(), self._heartbeat_loop()]
        if not cfg.nixl_progress_thread:
            loops.append(self._progress_loop())
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

    def _make_transfer(self) -> Any:
        import torch

        from sidecar.nixl.agent import Transfer, TransferSettings

        if self.config.gpu is None:
            # The CPU twin converts in one worker thread; torch's intra-op threads would take every core
            # from the loop, the zmq I/O threads and NIXL's progress thread.
            torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
        return Transfer(
            TransferSettings(
                backends=tuple(self.config.nixl_backends),
                progress_thread=self.config.nixl_progress_thread,
                remote_mem_type="DRAM" if self.config.gpu is None else "VRAM",
                cuda_device=self.config.gpu,
            )
        )

    def _make_stream(self) -> Any:
        import torch

        return torch.cuda.Stream(device=self.config.gpu)

    def _make_pool(self) -> None:
        import torch

        cfg = self.config
        t = torch.empty(cfg.staging_bytes, dtype=torch.uint8, device=cfg.device)
        mem = "DRAM" if cfg.gpu is None else "VRAM"
        dev = 0 if cfg.gpu is None else cfg.gpu
        reg = self.transfer.register([(t.data_ptr(), t.numel(), dev)], mem)
        self._pool = {"tensor": t, "registration": reg, "device_id": dev, "mem_type": mem}

    def _check_socket(self) -> None:
        """Fail fast, before the slow start: a bad group, or another daemon on this socket."""
        cfg = self.config
        gid = resolve_group(cfg.socket_group) if cfg.socket_group else None
        secure_socket_dir(cfg.socket_path, gid)
        refuse_if_served(cfg.socket_endpoint, cfg.socket_path)

    def _bind(self) -> None:
        cfg = self.config
        path = cfg.socket_path
        gid = resolve_group(cfg.socket_group) if cfg.socket_group else None
        refuse_if_served(cfg.socket_endpoint, path)  # again: one may have started meanwhile
        self.ctx = zmq.asyncio.Context()
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        bind_socket_file(lambda: sock.bind(cfg.socket_endpoint), path, gid)
        self.sock = sock
        self.socket_path = path
        if cfg.fast_completions:
            self._bind_completions(completion_path(path), gid)

    def _bind_completions(self, path: str, gid: int | None) -> None:
        if len(path.encode()) > MAX_UNIX_PATH:
            log.warning("completion socket disabled: %s is longer than a unix socket path may be", path)
            return
        assert self._loop is not None
        self.completions = CompletionSocket(
            path, self._loop, self._may_bind_completions, self._send_over_zmq, group_gid=gid
        )

    def _may_bind_completions(self, routing_id: bytes) -> str | None:
        session = self._sessions.get(routing_id)
        if session is None or session.hello is None:
            return "routing_id: no shim with this routing id has said Hello on the main socket"
        return None

    def request_stop(self) -> None:
        self._stop.set()

    async def serve(self) -> None:
        await self._stop.wait()

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Stop accepting, let in-flight pulls finish for ``grace_s``, fail the rest, release everything."""
        if self._stopping:
            return
        self._stopping = True
        self.health.stopping = True
        self.metrics.ready.set(0)
        sdnotify.stopping("draining")
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        tasks = [j.task for j in self._jobs.values() if j.task is not None]
        if tasks:
            log.info("shutdown: waiting up to %.1f s for %d pull(s)", grace, len(tasks))
            await asyncio.wait(tasks, timeout=grace)
        await self._fail_all("failed", f"{SHUTTING_DOWN}: daemon stopped before the pull finished")
        await self._release_caches()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for entry in self._peers.values():
            entry.task.cancel()
        self._peers.clear()
        if self.transfer is not None:
            if self._pool is not None:
                with contextlib.suppress(Exception):
                    self.transfer.deregister(self._pool["registration"])
                self._pool = None
            self.transfer.close()
            self.health.agent_up = False
        if self.completions is not None:
            self.completions.close()
            self.completions = None
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
        if self.ctx is not None:
            self.ctx.term()
        self._convert_pool.shutdown(wait=True)
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
        if self._lease is not None:
            self._lease.heartbeat_interval_s = self.config.heartbeat_interval_s
        if {"remotes", "verify_model_identity", "pull_mode"} & set(applied):
            self._config_gen += 1  # cached prefills are re-admitted once idle
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

    # ---------------------------------------------------------------------------------------- the socket

    async def _receive_loop(self) -> None:
        assert self.sock is not None
        while True:
            frames = await self.sock.recv_multipart()
            received = time.monotonic()
            if len(frames) == 2:
                envelope, payload = frames[:1], frames[1]
            elif len(frames) == 3 and frames[1] == b"":
                envelope, payload = frames[:2], frames[2]
            else:
                self.metrics.invalid_messages.inc()
                self._send(
                    frames[:1],
                    p.Error(reason=f"expected one message frame after the identity, got {len(frames) - 1}"),
                )
                continue
            try:
                msg = p.decode_to_daemon(payload)
            except p.DecodeError as exc:
                self.metrics.invalid_messages.inc()
                kind, req_id = _peek(payload)
                log.warning("invalid message (%s): %s", kind or "?", exc)
                self._send(envelope, p.Error(reason=str(exc), in_reply_to=kind, req_id=req_id))
                continue
            try:
                self._dispatch(envelope, msg, received)
            except Exception as exc:  # noqa: BLE001 - one bad message never stops the daemon
                log.exception("handling %s", type(msg).__name__)
                self._send(
                    envelope,
                    p.Error(
                        reason=f"internal error: {exc}",
                        in_reply_to=type(msg).__name__,
                        req_id=getattr(msg, "req_id", None),
                    ),
                )

    def _send(self, envelope: list[bytes], msg: p.ToShim) -> None:
        if self.sock is None:
            return
        if isinstance(msg, p.Done):
            msg = msgspec.structs.replace(msg, sent_at_ns=time.monotonic_ns())
        data = p.encode(msg)
        if len(envelope) == 1 and self.completions is not None and self.completions.send(envelope[0], data):
            return
        self._send_frames([*envelope, data])

    def _send_over_zmq(self, routing_id: bytes, data: bytes) -> None:
        self._send_frames([routing_id, data])

    def _send_frames(self, frames: list[bytes]) -> None:
        if self.sock is None:
            return
        try:
            fut = self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("could not send a reply: %s", exc)
            return
        if isinstance(fut, asyncio.Future):
            fut.add_done_callback(_log_send_failure)

    def _session(self, envelope: list[bytes]) -> Session:
        ident = envelope[0]
        s = self._sessions.get(ident)
        if s is None:
            s = self._sessions[ident] = Session(ident)
        return s

    def _dispatch(self, envelope: list[bytes], msg: p.ToDaemon, received: float) -> None:
        session = self._session(envelope)
        if isinstance(msg, p.Pull):
            self._on_pull(envelope, session, msg, received)
        elif isinstance(msg, p.Heartbeat):
            self._on_heartbeat(session, msg)
        elif isinstance(msg, p.Abort):
            self._on_abort(envelope, msg)
        elif isinstance(msg, p.Ping):
            self._send(envelope, p.Pong(nonce=msg.nonce, sent_at_ns=time.monotonic_ns()))
        elif isinstance(msg, p.Hello):
            self._on_hello(envelope, session, msg)
        elif isinstance(msg, p.RegisterCaches):
            self._spawn(self._on_register(envelope, session, msg))
        elif isinstance(msg, p.Unregister):
            self._spawn(self._on_unregister(envelope))

    def _on_hello(self, envelope: list[bytes], session: Session, msg: p.Hello) -> None:
        if msg.protocol_version != p.PROTOCOL_VERSION:
            self.metrics.refused("protocol_version")
            self._send(
                envelope,
                p.Error(
                    reason=f"protocol_version: the shim speaks {msg.protocol_version}, "
                    f"this daemon {p.PROTOCOL_VERSION}",
                    in_reply_to="Hello",
                ),
            )
            return
        session.hello = msg
        self._send(
            envelope,
            p.Welcome(
                protocol_version=p.PROTOCOL_VERSION,
                package_version=__version__,
                device=self.config.device,
                gpu=self.config.gpu,
                pid=os.getpid(),
                completion_socket=self.completions.path if self.completions is not None else "",
            ),
        )

    # ---------------------------------------------------------------------------------------- caches

    async def _on_register(self, envelope: list[bytes], session: Session, msg: p.RegisterCaches) -> None:
        if session.hello is None:
            self._send(
                envelope, p.Error(reason="say Hello before RegisterCaches", in_reply_to="RegisterCaches")
            )
            return
        if self._stopping:
            self._send(envelope, p.Error(reason=SHUTTING_DOWN, in_reply_to="RegisterCaches"))
            return
        try:
            caches = await asyncio.to_thread(
                map_caches,
                session.identity,
                msg,
                device=self.config.device,
                gpu=self.config.gpu,
                next_generation=self._next_cache_gen,
            )
        except (Refused, ipc_mod.IpcError, ValueError) as exc:
            self._refuse_registration(envelope, exc)
            return
        if self.caches is not None:
            log.warning("new registration replaces generation %d", self.caches.generation)
            await self._fail_all("failed", "caches re-registered by the shim")
            await self._release_caches()
        try:
            register_caches(self.transfer, caches)  # NIXL stays on the loop thread
        except Exception as exc:  # noqa: BLE001 - NIXL refused the memory: report, keep serving
            close_caches(caches)
            self._refuse_registration(envelope, exc)
            return
        self.caches = caches
        self._config_gen += 1  # prefills admitted against the old caches' format are admitted again
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
        self._send(
            envelope,
            p.Registered(
                generation=caches.generation, registered_bytes=caches.nbytes, num_layers=len(caches.layers)
            ),
        )

    def _refuse_registration(self, envelope: list[bytes], exc: Exception) -> None:
        field_name = exc.field if isinstance(exc, Refused) else getattr(exc, "field", None) or "buffers"
        self.metrics.refused(field_name)
        log.warning("RegisterCaches refused: %s", exc)
        self._send(envelope, p.Error(reason=str(exc), in_reply_to="RegisterCaches"))

    def _next_cache_gen(self) -> int:
        self._cache_gen += 1
        return self._cache_gen

    async def _on_unregister(self, envelope: list[bytes]) -> None:
        await self._fail_all("failed", "caches unregistered by the shim")
        await self._release_caches()
        self._send(envelope, p.Unregistered())

    async def _release_caches(self) -> None:
        caches, self.caches = self.caches, None
        self.health.caches_registered = False
        self.metrics.ready.set(0)
        self.metrics.registered_bytes.set(0)
        if caches is None:
            return
        while caches.users:  # a job still finishing (it holds views into the buffers)
            await asyncio.sleep(0.001)
        with contextlib.suppress(Exception):
            self.transfer.deregister(caches.registration)
        close_caches(caches)
        log.info("released cache generation %d", caches.generation)

    # ---------------------------------------------------------------------------------------- pulls

    def _on_pull(self, envelope: list[bytes], session: Session, msg: p.Pull, received: float) -> None:
        if msg.req_id in self._jobs:
            self.metrics.invalid_messages.inc()
            self._send(
                envelope,
                p.Error(
                    reason=f"req_id {msg.req_id!r} is already in flight",
                    in_reply_to="Pull",
                    req_id=msg.req_id,
                ),
            )
            return
        if self._stopping:
            self._answer_now(envelope, msg, "failed", f"{SHUTTING_DOWN}: not accepting pulls")
            return
        if len(self._jobs) >= self.config.max_inflight + self.config.max_queued:
            self._answer_now(
                envelope,
                msg,
                "refused",
                f"{OVERLOADED}: {len(self._jobs)} pulls in flight or queued "
                f"(max_inflight {self.config.max_inflight} + max_queued {self.config.max_queued})",
            )
            return
        timeout = msg.timeout_s if msg.timeout_s is not None else self.config.default_timeout_s
        job = Job(
            msg=msg,
            envelope=envelope,
            session=session,
            received=received,
            deadline=received + timeout,
            timeout_s=timeout,
            stage_started=received,
        )
        self._jobs[msg.req_id] = job
        self.metrics.in_flight.set(len(self._jobs))
        started = msg.lease_started_at_ns / 1e9 if msg.lease_started_at_ns else received
        self._lease.seen(msg.remote_request_id, min(started, received))
        assert self._loop is not None
        # Fire a little early, so the Done leaves before the deadline even after stopping the transfer.
        margin = min(0.02, 0.1 * timeout)
        timer = self._loop.call_at(
            self._loop.time() + max(0.0, timeout - margin - (time.monotonic() - received)), self._expire, job
        )
        job.task = asyncio.ensure_future(self._run(job, timer))
        job.task.add_done_callback(functools.partial(self._task_done, job, timer))

    def _answer_now(self, envelope: list[bytes], msg: p.Pull, outcome: str, reason: str) -> None:
        self.metrics.answered(outcome)
        self._send(envelope, p.Done(req_id=msg.req_id, ok=False, reason=reason))

    def _expire(self, job: Job) -> None:
        if job.cancel is None and not job.settled and job.task is not None and not job.task.done():
            job.cancel = ("expired", f"deadline: {job.timeout_s:g} s passed during {job.stage}")
            job.task.cancel()

    def _on_abort(self, envelope: list[bytes], msg: p.Abort) -> None:
        job = self._jobs.get(msg.req_id)
        if job is None:
            self._send(
                envelope,
                p.Aborted(
                    req_id=msg.req_id, safe=True, reason="not in flight (already answered or never seen)"
                ),
            )
            return
        job.abort_envelope = envelope  # answered with Aborted (not Done) once the job is quiet
        if job.cancel is None and not job.settled and job.task is not None and not job.task.done():
            job.cancel = ("aborted", "aborted by the shim")
            job.task.cancel()

    def _task_done(self, job: Job, timer: asyncio.TimerHandle, task: asyncio.Task) -> None:
        """A task cancelled before its first step never ran ``_run``: answer its job here."""
        if task.cancelled() and self._jobs.get(job.msg.req_id) is job and not job.settled:
            timer.cancel()
            job.settled = True
            kind, reason = job.cancel or ("failed", "cancelled")
            self._spawn(self._settle(job, Outcome(kind, reason)))

    async def _settle(self, job: Job, outcome: Outcome) -> None:
        outcome.safe = await self._quiesce(job)
        self._finish(job, outcome)

    async def _run(self, job: Job, timer: asyncio.TimerHandle) -> None:
        try:
            outcome = await self._pipeline(job)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            kind, reason = job.cancel or ("failed", "cancelled")
            outcome = Outcome(kind, reason)
        except Refused as exc:
            outcome = Outcome("refused", str(exc), exc.field)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a Done(ok=False)
            if not isinstance(exc, Failed):
                log.warning("pull %s failed: %s: %s", job.msg.req_id, type(exc).__name__, exc)
            outcome = Outcome("failed", _reason(exc), getattr(exc, "field", None))
        finally:
            timer.cancel()
            job.settled = True
        outcome.safe = await self._quiesce(job)
        self._finish(job, outcome)

    async def _quiesce(self, job: Job) -> bool:
        """Make sure nothing can still write into the job's blocks: stop its reads, await its conversion."""
        safe = True
        if job.tpull is not None:
            fut, _ = self._reads.pop(job.tpull, (None, None))
            if fut is not None and not fut.done():
                fut.cancel()
            # A finished pull's handles are DONE (or already released on error): nothing left to stop. They
            # are released after the answer, in _finish.
            if not job.tpull.finished:
                safe = self.transfer.abort(job.tpull)
                give_up = time.monotonic() + 5.0
                while not safe and time.monotonic() < give_up:
                    await asyncio.sleep(0.01)
                    safe = self.transfer.abort(job.tpull)
                if not safe:
                    log.error(
                        "pull %s: NIXL would not release its transfers; its blocks are unsafe", job.msg.req_id
                    )
        elif job.peer is not None:
            self._notify(job)  # read never posted: still tell the prefill to free the blocks
        elif job.peer_entry is not None:
            # stopped during the handshake, or after it ended but before this job resumed from it (an Abort
            # handled in the same loop turn): notify once it is through, without holding up the answer
            self._spawn(self._notify_after_handshake(job.peer_entry.task, job.msg.remote_request_id))
        elif job.peer_entry is None and job.cancel is not None and job.cancel[0] in ("aborted", "expired"):
            # stopped before the handshake began (queued): the prefill still holds the blocks for its lease,
            # so handshake (or reuse one) in the background just to tell it to free them
            entry = self._peer_entry_for_notify(job)
            if entry is not None:
                self._spawn(self._notify_after_handshake(entry.task, job.msg.remote_request_id))
        done = self._conversions_done(job)
        if done is not None and not done.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(done)
        return safe

    def _peer_entry_for_notify(self, job: Job) -> PeerEntry | None:
        if self.caches is None or self._stopping:
            return None
        msg = job.msg
        key = (msg.remote_engine_id, job.session.rank)
        entry = self._peers.get(key)
        if entry is None or (entry.task.done() and (entry.task.cancelled() or entry.task.exception())):
            entry = self._start_handshake(
                key, msg.remote_host, msg.remote_port, msg.remote_registration_generation, self.caches
            )
        return entry

    async def _notify_after_handshake(self, handshake: asyncio.Task, remote_request_id: str) -> None:
        try:
            peer = await asyncio.shield(handshake)
        except Exception:  # noqa: BLE001 - no prefill to tell; its lease frees the blocks
            return
        self._nixl_active()
        try:
            self.transfer.notify(peer, remote_request_id, 1)
        except Exception as exc:  # noqa: BLE001
            log.info("notification for %s failed: %s", remote_request_id, exc)

    def _notify(self, job: Job) -> None:
        self._nixl_active()
        try:
            self.transfer.notify(job.peer, job.msg.remote_request_id, 1)
        except Exception as exc:  # noqa: BLE001 - the prefill's lease frees the blocks anyway
            log.info("notification for %s failed: %s", job.msg.remote_request_id, exc)

    def _finish(self, job: Job, outcome: Outcome) -> None:
        """Answer the job exactly once and release what it held."""
        if self._jobs.get(job.msg.req_id) is not job:
            return
        del self._jobs[job.msg.req_id]
        self.metrics.in_flight.set(len(self._jobs))
        now = time.monotonic()
        job.enter("done", now)
        if job.has_slot and self._slots is not None:
            self._slots.release()
            job.has_slot = False
        if job.slots is not None:
            self._give_slots(job)
        if job.caches is not None:
            job.caches.users -= 1
            job.caches = None
        if job.peer_entry is not None:
            job.peer_entry.users -= 1
            job.peer_entry = None
        self._lease.forget(job.msg.remote_request_id)
        self._hb_peer.pop(job.msg.remote_request_id, None)
        timings = {k: v for k, v in job.timings.items() if k != "done"}
        timings["end_to_end"] = now - job.received
        if job.abort_envelope is not None:
            outcome.kind = "aborted"
        # Counted before the answer goes out, so whoever holds the answer sees it counted.
        if outcome.field:
            self.metrics.refused(outcome.field)
        self.metrics.answered(outcome.kind)
        if outcome.kind == "ok":
            self.metrics.bytes_pulled.inc(getattr(job.tpull, "nbytes", 0) if job.tpull is not None else 0)
        if job.abort_envelope is not None:
            self._send(
                job.abort_envelope,
                p.Aborted(
                    req_id=job.msg.req_id,
                    safe=outcome.safe,
                    reason=None if outcome.safe else "transfers not released",
                ),
            )
        else:
            ok = outcome.kind == "ok"
            reason = outcome.reason
            if not outcome.safe:
                reason = f"{reason}; blocks unsafe: a transfer could not be stopped"
            t0 = time.monotonic()
            self._send(
                job.envelope,
                p.Done(req_id=job.msg.req_id, ok=ok, reason=None if ok else reason, timings=timings),
            )
            timings["signal"] = time.monotonic() - t0
        if job.tpull is not None:
            self._nixl_active()  # its completion notification went out with the last poll
            if job.tpull.handles and not self.transfer.release(job.tpull):
                log.warning("pull %s: some DONE transfers could not be released", job.msg.req_id)
        self.metrics.observe(timings)
        log.debug("pull %s: %s %s %s", job.msg.req_id, outcome.kind, outcome.reason or "", timings)

    async def _fail_all(self, kind: str, reason: str) -> None:
        jobs = list(self._jobs.values())
        for job in jobs:
            if job.cancel is None and not job.settled and job.task is not None and not job.task.done():
                job.cancel = (kind, reason)
                job.task.cancel()
        tasks = [j.task for j in jobs if j.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        while any(self._jobs.get(j.msg.req_id) is j for j in jobs):  # settled by _task_done's follow-up
            await asyncio.sleep(0.001)

    # ---------------------------------------------------------------------------------------- pipeline

    async def _pipeline(self, job: Job) -> Outcome:
        msg, cfg = job.msg, self.config
        assert self._slots is not None
        await self._slots.acquire()
        job.has_slot = True
        caches = self.caches
        if caches is None:
            raise Refused("caches", "no caches registered (RegisterCaches first)")
        caches.users += 1
        job.caches = caches
        if msg.remote_tp_size != job.session.tp_size:
            raise Refused(
                "remote_tp_size",
                f"prefill TP {msg.remote_tp_size} != decoder TP "
                f"{job.session.tp_size}: heterogeneous TP is not supported",
            )
        job.enter("handshake")
        job.peer = await self._peer(msg, job.session.rank, caches, job)
        if not self._lease.check(msg.remote_request_id, time.monotonic()):
            raise Failed(
                f"lease: cannot vouch for {msg.remote_request_id!r} any more (lease {cfg.lease_s:g} s, "
                "no heartbeat in time); not reading blocks the prefill may have reused"
            )
        plan = job.peer.plan
        mode = "plain" if not plan.convert else self._mode()
        job.enter("transfer")
        staged = await self._post_read(job, caches, mode)
        posted = time.monotonic()
        job.timings["post"] = posted - job.stage_started
        job.converting = bool(plan.convert and job.blocks is not None and job.blocks.size)
        if job.converting and staged is not None:
            job.convert_src = self._staged_source(job, caches)
        await self._wait_read(job)  # layer groups are converted as they land, while later ones still read
        done_at = job.tpull.done_at or time.monotonic()
        job.timings["read"] = done_at - posted
        if done_at >= self._lease.vouched_until(msg.remote_request_id):
            raise Failed(
                f"lease: the read of {msg.remote_request_id!r} ended after its lease could have "
                "lapsed; its bytes cannot be trusted"
            )
        if job.converting:
            job.enter("convert")  # what is left of the conversion once the last byte has landed
            await self._finish_conversion(job, len(caches.layers))
        return Outcome("ok")

    def _mode(self) -> str:
        mode = self.config.pull_mode
        if mode == "auto":
            return "staged" if self._pool is not None else "direct"
        return mode

    async def _peer(self, msg: p.Pull, rank: int, caches: Caches, job: Job) -> Any:
        key = (msg.remote_engine_id, rank)
        entry = self._peers.get(key)
        if entry is not None and entry.task.done():
            peer = entry.peer
            stale = (
                peer is None
                or entry.config_gen != self._config_gen
                or (msg.remote_registration_generation > peer.generation > 0)
            )
            if peer is not None and peer.generation == 0 and msg.remote_registration_generation:
                peer.generation = msg.remote_registration_generation  # the handshake came from a heartbeat
            if stale and (peer is None or entry.users == 0):
                if peer is not None:
                    self.transfer.remove_peer(peer)
                entry = None
        if entry is None:
            entry = self._start_handshake(
                key, msg.remote_host, msg.remote_port, msg.remote_registration_generation, caches
            )
        entry.users += 1
        job.peer_key, job.peer_entry = key, entry
        return await asyncio.shield(entry.task)

    def _start_handshake(
        self, key: tuple[str, int], host: str, port: int, generation: int, caches: Caches
    ) -> PeerEntry:
        task = asyncio.ensure_future(self._handshake(key, host, port, generation, caches))
        entry = PeerEntry(task=task, config_gen=self._config_gen)
        self._peers[key] = entry

        def forget_failure(t: asyncio.Task) -> None:
            if (t.cancelled() or t.exception() is not None) and self._peers.get(key) is entry:
                # a failed handshake is retried by the next request, not cached
                if entry.users == 0:
                    del self._peers[key]
                else:
                    entry.config_gen = -1

        task.add_done_callback(forget_failure)
        return entry

    async def _handshake(
        self, key: tuple[str, int], host: str, port: int, generation: int, caches: Caches
    ) -> Any:
        from sidecar.nixl import agent as tr

        engine_id, rank = key
        cfg = self.config
        address = f"{host}:{port}"
        t0 = time.monotonic()
        try:
            replies = await vllm_wire.fetch_handshake_async(
                host, port, [(0, rank)], timeout_s=cfg.handshake_timeout_s, expected_engine_id=engine_id
            )
            reply = replies[(0, rank)]
            rule = next((r for r in cfg.remotes if fnmatch.fnmatchcase(address, r.match)), None)
            rules = tuple(
                tr.RemoteFormatRule(address=r.match, format=r.page_format)
                for r in cfg.remotes
                if r.page_format is not None and r is rule
            )
            settings = tr.TransferSettings(
                remote_formats=rules,
                conversion_enabled=rule.convert if rule else True,
                remote_mem_type=self.transfer.settings.remote_mem_type,
            )
            plan, regions = tr.admit_remote(
                reply.metadata,
                address=address,
                local_format=caches.page_format,
                layers=len(caches.layers),
                settings=settings,
                remote_hash=reply.compatibility_hash,
                local_factors=caches.compat_factors or None,
                check_identity=cfg.verify_model_identity,
                expected_engine_id=engine_id,
            )
            peer = self.transfer.add_peer(
                engine_id=engine_id,
                tp_rank=rank,
                generation=generation,
                address=address,
                agent_metadata=reply.metadata.agent_metadata,
                plan=plan,
                regions=regions,
            )
        except tr.RemoteRefused as exc:
            self.metrics.handshake(False)
            raise Refused(exc.field or "remote", exc.reason) from None
        except vllm_wire.HandshakeRefused as exc:
            self.metrics.handshake(False)
            raise Refused(exc.field, exc.reason) from None
        except vllm_wire.HandshakeTimeout as exc:
            self.metrics.handshake(False)
            raise Failed(f"handshake: {exc}") from None
        except Exception as exc:
            self.metrics.handshake(False)
            raise Failed(f"handshake with {address}: {_reason(exc)}") from None
        self.metrics.handshake(True, time.monotonic() - t0)
        log.info(
            "prefill %s rank %d at %s admitted: %s",
            engine_id,
            rank,
            address,
            "convert" if plan.convert else "plain read",
        )
        # requests the shim heartbeated before we knew this prefill
        pending = [rid for rid, (e, r, _, _) in self._hb_peer.items() if (e, r) == key]
        if pending:
            self._send_heartbeat(peer, pending)
        return peer

    async def _post_read(self, job: Job, caches: Caches, mode: str) -> Any:
        from sidecar.nixl import agent as tr

        msg = job.msg
        pool = slots = None
        try:
            # the kernel blocks really read (tail pairing, padding trimmed): what gets converted
            geo = self.transfer.geometry(
                job.peer, caches.destination, "plain" if mode == "plain" else "direct"
            )
            job.blocks = geo.blocks(msg.local_block_ids, msg.remote_block_ids, msg.remote_num_tokens)[0]
            if mode == "staged":
                pool, slots = await self._take_slots(job, caches, int(job.blocks.size))
            remaining = max(0.001, job.deadline - time.monotonic())
            job.tpull = self.transfer.pull(
                job.peer,
                caches.destination,
                mode,
                msg.local_block_ids,
                msg.remote_block_ids,
                msg.remote_request_id,
                readers=1,
                layer_groups=self.config.layer_groups,
                timeout_s=remaining + 1.0,
                remote_num_tokens=msg.remote_num_tokens,
                pool=pool,
                slots=slots,
            )
        except GeometryError as exc:
            raise Refused(exc.field, exc.reason) from None
        except tr.RemoteRefused as exc:
            raise Refused(exc.field or "remote", exc.reason) from None
        except tr.RemoteDisconnected as exc:
            self._drop_peer(job)
            raise Failed(f"transfer: {exc}") from None
        except tr.TransferError as exc:
            raise Failed(f"transfer: {exc}") from None
        return slots

    async def _wait_read(self, job: Job) -> None:
        from sidecar.nixl import agent as tr

        assert self._loop is not None and self._reads_wakeup is not None
        fut = self._loop.create_future()
        self._reads[job.tpull] = (fut, job)
        self._reads_wakeup.set()
        try:
            await fut
        except tr.RemoteDisconnected as exc:
            self._drop_peer(job)
            raise Failed(f"transfer: {exc}") from None
        except tr.TransferError as exc:
            raise Failed(f"transfer: {exc}") from None

    def _drop_peer(self, job: Job) -> None:
        """The prefill is gone (restarted?): the next request handshakes again."""
        if job.peer_entry is not None:
            job.peer_entry.config_gen = -1

    async def _poll_loop(self) -> None:
        from sidecar.nixl import agent as tr

        assert self._reads_wakeup is not None
        while True:
            if not self._reads:
                self._reads_wakeup.clear()
                await self._reads_wakeup.wait()
            now = time.monotonic()
            for tpull, (fut, job) in list(self._reads.items()):
                if fut.done():
                    self._reads.pop(tpull, None)
                    continue
                try:
                    finished = self.transfer.poll(tpull, now)
                except tr.TransferError as exc:
                    self._reads.pop(tpull, None)
                    fut.set_exception(exc)
                    continue
                while tpull.landed:
                    self._convert_group(job, *tpull.landed.pop(0))
                if finished:
                    self._reads.pop(tpull, None)
                    fut.set_result(None)
            if self._reads:
                await asyncio.sleep(self.config.poll_interval_s)

    # ---------------------------------------------------------------------------------------- staging

    async def _take_slots(self, job: Job, caches: Caches, blocks: int) -> tuple[Any, np.ndarray]:
        from sidecar.nixl.geometry import contiguous_slots

        assert self._pool is not None and self._pool_changed is not None
        pool = self._pool
        fmt = job.peer.plan.remote
        if pool.get("slot_bytes") != fmt.page_bytes:
            num = pool["tensor"].numel() // fmt.page_bytes
            if num == 0:
                raise Refused(
                    "staging_bytes", f"{self.config.staging_bytes} bytes hold no {fmt.page_bytes}-byte page"
                )
            if pool.get("allocator") is not None and pool["allocator"].free != pool["allocator"].num_slots:
                raise Refused("staging", "the pool is in use with another page size")
            sp = StagingPool(
                base=pool["tensor"].data_ptr(),
                slot_bytes=fmt.page_bytes,
                num_slots=num,
                device_id=pool["device_id"],
                mem_type=pool["mem_type"],
            )
            pool.update(
                slot_bytes=fmt.page_bytes,
                staging=self.transfer.staging(pool["registration"], sp),
                allocator=SlotAllocator(num),
            )
        alloc: SlotAllocator = pool["allocator"]
        need = len(caches.layers) * blocks
        if need > alloc.num_slots:
            raise Refused(
                "staging_bytes",
                f"the request needs {need} slots of {fmt.page_bytes} bytes, the pool has {alloc.num_slots}",
            )
        async with self._pool_changed:
            while (first := alloc.take(need)) is None:
                await self._pool_changed.wait()
                if pool.get("allocator") is not alloc:
                    break  # re-cut for another page size while we waited: start over on the new one
        if first is None:
            return await self._take_slots(job, caches, blocks)
        job.slots = (first, need)
        return pool["staging"], contiguous_slots(first, len(caches.layers), blocks)

    def _give_slots(self, job: Job) -> None:
        assert self._pool is not None and job.slots is not None
        first, n = job.slots
        job.slots = None
        self._pool["allocator"].give(first, n)

        async def wake() -> None:
            assert self._pool_changed is not None
            async with self._pool_changed:
                self._pool_changed.notify_all()

        self._spawn(wake())

    # ---------------------------------------------------------------------------------------- conversion

    def _staged_source(self, job: Job, caches: Caches) -> Any:
        """The request's staging slots as [layers, blocks, page elements] of the page dtype."""
        assert self._pool is not None and job.slots is not None
        first, n = job.slots
        slot = self._pool["slot_bytes"]
        return (
            self._pool["tensor"][first * slot : (first + n) * slot]
            .view(ipc_mod.torch_dtype(caches.page_format.dtype))
            .view(len(caches.layers), int(job.blocks.size), -1)
        )

    def _convert_group(self, job: Job, first: int, last: int) -> None:
        """Start converting layers [first, last) of a job, their reads DONE (called by the poll loop)."""
        if not job.converting or job.caches is None:
            return
        caches, fmt = job.caches, job.caches.page_format
        src = None if job.convert_src is None else job.convert_src[first:last]
        assert self._loop is not None
        try:
            if self._stream is None:
                job.conversions.append(
                    self._loop.run_in_executor(
                        self._convert_pool, convert_blocks, caches, job.blocks, fmt, src, (first, last)
                    )
                )
            else:
                t0 = time.perf_counter()
                job.last_event = launch_gpu(self._stream, caches, job.blocks, fmt, src, (first, last))
                job.timings["launch"] = job.timings.get("launch", 0.0) + time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001 - a launch that fails fails the request, not the loop
            failed = self._loop.create_future()
            failed.set_exception(exc)
            job.conversions.append(failed)
            return
        job.converted_layers += last - first

    def _conversions_done(self, job: Job) -> asyncio.Future | None:
        """One future for every conversion the job started (None if it started none); never fails early."""
        if job.conversion is None and (job.conversions or job.last_event is not None):
            assert self._loop is not None
            waits = list(job.conversions)
            if job.last_event is not None:
                waits.append(self._loop.run_in_executor(self._convert_pool, job.last_event.synchronize))
            # return_exceptions: a failed group must not end the wait while others still write
            job.conversion = asyncio.gather(*waits, return_exceptions=True)
        return job.conversion

    async def _finish_conversion(self, job: Job, layers: int) -> None:
        done = self._conversions_done(job)
        results = await asyncio.shield(done) if done is not None else []
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise Failed(f"convert: {_reason(errors[0])}") from errors[0]
        if job.converted_layers != layers:
            raise Failed(f"convert: {job.converted_layers} of {layers} layers were converted")

    # ---------------------------------------------------------------------------------------- heartbeats

    def _on_heartbeat(self, session: Session, msg: p.Heartbeat) -> None:
        now = time.monotonic()
        for target in msg.targets:
            if target.remote_tp_size != session.tp_size or not target.remote_request_ids:
                continue
            key = (target.remote_engine_id, session.rank)
            for rid in target.remote_request_ids:
                self._lease.seen(rid, now)
                self._hb_peer[rid] = (key[0], key[1], target.remote_host, target.remote_port)
            entry = self._peers.get(key)
            peer = entry.peer if entry is not None else None
            if peer is not None:
                self._send_heartbeat(peer, target.remote_request_ids)
            elif entry is None and self.caches is not None and not self._stopping:
                # like stock vLLM, the first heartbeat starts the handshake early; it heartbeats when done
                self._start_handshake(key, target.remote_host, target.remote_port, 0, self.caches)

    def _send_heartbeat(self, peer: Any, ids: list[str]) -> None:
        now = time.monotonic()
        live = [rid for rid in ids if self._lease.check(rid, now)]
        if not live:
            return
        self._nixl_active()
        try:
            self.transfer.heartbeat(peer, live)
        except Exception as exc:  # noqa: BLE001 - a failed heartbeat only shortens what we can vouch for
            log.info("heartbeat to %s failed: %s", peer.address, exc)
            return
        self._lease.heartbeat_sent(live, now)
        self.metrics.heartbeats_sent.inc()

    async def _heartbeat_loop(self) -> None:
        """Renew the leases of requests we hold (queued or reading) that are due."""
        while True:
            await asyncio.sleep(min(1.0, self.config.heartbeat_interval_s / 2))
            now = time.monotonic()
            by_peer: dict[tuple[str, int], list[str]] = {}
            active = {job.msg.remote_request_id: job for job in self._jobs.values()}
            for rid in self._lease.due(now):
                job = active.get(rid)
                if job is not None and job.peer_key is not None:
                    by_peer.setdefault(job.peer_key, []).append(rid)
            for key, ids in by_peer.items():
                entry = self._peers.get(key)
                if entry is not None and entry.peer is not None:
                    self._send_heartbeat(entry.peer, ids)
            # forget shim-heartbeated ids whose lease lapsed and that no job holds
            for rid in [r for r in self._hb_peer if r not in active and not self._lease.check(r, now)]:
                self._hb_peer.pop(rid, None)
                self._lease.forget(rid)

    async def _tick_loop(self) -> None:
        while True:
            self.health.tick()
            await asyncio.sleep(0.5)

    def _nixl_active(self) -> None:
        self._last_nixl_activity = time.monotonic()

    async def _progress_loop(self) -> None:
        """Without NIXL's progress thread, UCX moves only when we call in: for a while after the last
        notification or heartbeat, call in every few ms so nothing we sent waits in a queue."""
        while True:
            await asyncio.sleep(0.005)
            if self.transfer is None or time.monotonic() - self._last_nixl_activity > 2.0:
                continue
            try:
                self.transfer.agent.get_new_notifs()
            except Exception as exc:  # noqa: BLE001 - progress is best effort; errors surface on transfers
                log.debug("progress: %s", exc)


# ------------------------------------------------------------------------------------------- small helpers


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _peek(payload: bytes) -> tuple[str | None, str | None]:
    """Best effort: the type and req_id of an invalid message, so the Error can name the request."""
    try:
        obj = msgspec.msgpack.decode(payload)
    except Exception:  # noqa: BLE001
        return None, None
    if not isinstance(obj, dict):
        return None, None
    kind, req_id = obj.get("type"), obj.get("req_id")
    return (kind if isinstance(kind, str) else None), (req_id if isinstance(req_id, str) else None)


def _log_send_failure(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("could not send a reply: %s", fut.exception())


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
