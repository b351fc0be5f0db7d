"""The worker half of the shim, without vLLM: export the caches, forward each step's orders, report the loads.

``vllm_glue.connector`` wraps it for vLLM; the decoder stand-in (``sidecar.standins.decoder``) drives it
directly, so both exercise the same code. torch is imported only when caches are exported.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from sidecar import __version__
from sidecar.wire import protocol as p
from sidecar.wire.formats import PageFormat
from vllm_glue.client import Gone, Lost, NotReady, Reply, SidecarClient
from vllm_glue.load_tracker import LoadTracker, TransferResults
from vllm_glue.orders import StepOrders

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from sidecar.wire.ipc import ExportedCaches

log = logging.getLogger(__name__)

# {rank} becomes the worker's TP rank: worker N talks to the daemon of GPU N (kv-sidecar@N). Where rank N is
# not on GPU N (data parallelism, CUDA_VISIBLE_DEVICES), gpu{gpu}.sock names its GPU (vllm_glue.gpu_index).
DEFAULT_SOCKET = "ipc:///run/kv-sidecar/gpu{rank}.sock"
# How long past a load's deadline to wait for the daemon's answer before failing the load ("no answer"). The
# daemon answers by the deadline, or up to its 4 s give-up later when a read will not stop (reads.py).
DEFAULT_GRACE_S = 5.0


class WorkerHalf:
    """One vLLM worker's link to its kv-sidecar. Methods are called from the engine thread and never block on
    I/O (except :meth:`register`, at startup, up to ``register_timeout_s``).
    """

    def __init__(
        self,
        socket: str = DEFAULT_SOCKET,
        *,
        pull_timeout_s: float = 60.0,
        grace_s: float = DEFAULT_GRACE_S,
        register_timeout_s: float = 30.0,
        worker_rank: int = 0,
        tp_size: int = 1,
        engine_id: str = "",
    ) -> None:
        self.socket = socket.replace("{rank}", str(worker_rank))
        if "{gpu}" in self.socket:  # only the worker's process knows its GPU: the connector fills it in
            raise ValueError(f"socket {socket!r}: {{gpu}} must be resolved first (vllm_glue.gpu_index)")
        self.pull_timeout_s = pull_timeout_s
        self.register_timeout_s = register_timeout_s
        self.tracker = LoadTracker(grace_s=grace_s)
        self._hello = p.Hello(
            protocol_version=p.PROTOCOL_VERSION,
            package_version=__version__,
            worker_rank=worker_rank,
            tp_size=tp_size,
            pid=os.getpid(),
            engine_id=engine_id,
        )
        self.client: SidecarClient | None = None
        self.exported: ExportedCaches | None = None

    # ------------------------------------------------------------------------------------------- startup

    def register(
        self,
        kv_caches: dict[str, torch.Tensor],
        page_format: PageFormat,
        compat_factors: dict[str, Any],
        *,
        reap_shm: bool = True,
    ) -> bool:
        """Export the caches (CPU: moved into /dev/shm in place) and register them with the daemon.

        Returns True when the daemon acknowledged in time. A daemon that is down is not fatal: the client
        keeps trying, loads fail cleanly until it is up, and it registers as soon as it appears. ``reap_shm``:
        unlink the /dev/shm files created here when this process exits, even by SIGKILL
        (vllm_glue.shm_reaper).
        """
        from sidecar.wire.ipc import TORCH_SHM_HEADER_BYTES, export_caches

        self.exported = export_caches(kv_caches)
        moved = [
            b.shm.path
            for b in self.exported.buffers
            if b.kind == "shm" and b.shm is not None and b.shm.data_offset == TORCH_SHM_HEADER_BYTES
        ]
        if reap_shm and moved:
            from vllm_glue.shm_reaper import unlink_when_gone

            unlink_when_gone(os.getpid(), moved)
        msg = p.RegisterCaches(
            buffers=self.exported.buffers,
            layers=self.exported.layers,
            page_format=page_format,
            compat_factors=compat_factors,
        )
        return self.connect(msg)

    def connect(self, register: p.RegisterCaches) -> bool:
        self.client = SidecarClient(
            self.socket, self._hello, register, register_timeout_s=self.register_timeout_s
        )
        ok = self.client.wait_ready(self.register_timeout_s)
        if ok:
            log.info(
                "kv-sidecar at %s registered %d bytes in %d layers",
                self.socket,
                self.client.registered.registered_bytes if self.client.registered else 0,
                len(register.layers),
            )
        else:
            log.warning(
                "kv-sidecar at %s not ready (%s); remote-prefill loads fail until it is",
                self.socket,
                self.client.status_reason,
            )
        return ok

    # ------------------------------------------------------------------------------------------- per step

    def start_step(self, orders: StepOrders) -> None:
        """Send this step's pulls, aborts and heartbeats; failures become failed loads, never exceptions."""
        now, now_ns = time.monotonic(), time.monotonic_ns()
        for order in orders.pulls:
            if self.tracker.is_outstanding(order.req_id):
                log.error("request %s: a load is already in flight; ignoring a second pull", order.req_id)
                continue
            self.tracker.started(
                order.req_id, order.local_block_ids, order.awaiting, now + self.pull_timeout_s
            )
            r = order.remote
            try:
                msg = p.Pull(
                    req_id=order.req_id,
                    remote_engine_id=r.engine_id,
                    remote_host=r.host,
                    remote_port=r.port,
                    remote_request_id=r.request_id,
                    remote_block_ids=p.pack_block_ids(r.block_ids),
                    local_block_ids=p.pack_block_ids(order.local_block_ids),
                    timeout_s=self.pull_timeout_s,
                    remote_tp_size=r.tp_size,
                    remote_registration_generation=r.registration_generation,
                    remote_num_tokens=r.num_tokens,
                    lease_started_at_ns=local_lease_start(
                        order.lease_started_at_ns, orders.scheduler_clock_ns, now_ns
                    ),
                    sent_at_ns=time.monotonic_ns(),
                )
                self.tracker.sent(order.req_id, self._send(msg))
                log.debug(
                    "pull %s sent: %d local block(s) from %s:%d (%s)",
                    order.req_id,
                    len(order.local_block_ids),
                    r.host,
                    r.port,
                    r.request_id,
                )
            except Exception as e:  # noqa: BLE001 - one request's bad values fail its load, never vLLM's step
                log.warning("request %s: load not started: %s", order.req_id, e)
                self.tracker.fail(order.req_id, str(e), now)
        for req_id in orders.aborts:
            if self.tracker.abort_requested(req_id):
                try:
                    self.tracker.abort_sent(req_id, self._send(p.Abort(req_id=req_id)))
                except NotReady as e:
                    # A Pull that never went out can be released now; for one that did the Abort is owed: it
                    # goes out at a later step, on this connection or, once that drops, on the next.
                    self.tracker.release_unsent(req_id, str(e), now)
        targets = []
        for h in orders.heartbeats:
            try:  # one by one: a target the daemon would refuse must not cost the others their renewal
                targets.append(p.HeartbeatTarget(
                    remote_engine_id=h.engine_id,
                    remote_host=h.host,
                    remote_port=h.port,
                    remote_request_ids=list(h.remote_request_ids),
                    remote_tp_size=h.tp_size,
                    remote_registration_generation=h.generation,
                ))
            except ValueError as e:
                log.warning("heartbeat for %s:%s left out: %s", h.host, h.port, e)
        if targets:
            try:
                for beat in p.heartbeats(targets):  # more than one past the daemon's MAX_HEARTBEAT_IDS
                    self._send(beat)
                log.debug(
                    "heartbeat: %d request(s) on %d prefill(s)",
                    sum(len(t.remote_request_ids) for t in targets),
                    len(targets),
                )
            except (NotReady, ValueError, OverflowError) as e:
                log.debug("heartbeat not sent: %s", e)

    def collect(self) -> None:
        """Apply every reply that arrived, and expire loads past their deadline."""
        if self.client is not None:
            for ev in self.client.poll_events():
                at = ev.received_at_ns / 1e9
                if isinstance(ev, Lost):
                    lost = self.tracker.lost(ev.epoch, ev.reason)
                    if lost:
                        log.warning(
                            "kv-sidecar lost (%s): %d load(s) of that connection held until the daemon is "
                            "gone or confirms an abort", ev.reason, len(lost)
                        )
                elif isinstance(ev, Gone):
                    failed = self.tracker.gone(ev.epochs, ev.reason, at)
                    if failed:
                        log.warning("%s: failing %d load(s)", ev.reason, len(failed))
                else:
                    self._apply(ev)
            self._send_owed_aborts()
        late = self.tracker.expire(time.monotonic())
        if late:
            log.warning("%d load(s) failed: no answer from kv-sidecar by the deadline", len(late))

    def _send_owed_aborts(self) -> None:
        """Ask the daemon on the current connection to stop the loads of a dropped one: Aborted(safe) (or a
        Done) releases them; a new daemon never saw them and answers at once. Also sends the Aborts that
        could not go out when vLLM asked."""
        client = self.client
        if client is None or not client.is_ready():
            return
        for req_id in self.tracker.aborts_owed(client.epoch):
            try:
                self.tracker.abort_sent(req_id, client.send(p.Abort(req_id=req_id)))
            except NotReady:
                return  # this one and the rest stay owed: the next step tries again

    def transfer_results(self) -> TransferResults:
        self.collect()
        return self.tracker.take_results()

    def load_errors(self) -> set[int]:
        return self.tracker.take_bad_blocks()

    def shutdown(self) -> None:
        if self.client is not None:
            if self.client.is_ready():
                with contextlib.suppress(NotReady):
                    self.client.send(p.Unregister())
            self.client.close()
            self.client = None
        if self.exported is not None:
            self.exported.close()
            self.exported = None

    # ------------------------------------------------------------------------------------------- internals

    def _send(self, msg: p.ToDaemon) -> int:
        if self.client is None:
            raise NotReady("caches not registered with kv-sidecar")
        return self.client.send(msg)

    def _apply(self, ev: Reply) -> None:
        msg, at = ev.message, ev.received_at_ns / 1e9
        if isinstance(msg, p.Done):
            timings = msg.timings
            if msg.sent_at_ns:  # the daemon's send time: one host, one monotonic clock
                timings = {**timings, "return": max(0, ev.received_at_ns - msg.sent_at_ns) / 1e9}
            if not self.tracker.done(msg.req_id, msg.ok, msg.reason, timings, at, ev.epoch, msg.safe):
                log.debug("Done for unknown request %s ignored", msg.req_id)
            elif not msg.safe:
                log.error("request %s: %s; its blocks are held until kv-sidecar exits or the deadline "
                          "passes", msg.req_id, msg.reason)
            elif not msg.ok:
                log.warning("request %s: load failed: %s", msg.req_id, msg.reason)
            elif log.isEnabledFor(logging.DEBUG):  # the join costs the engine thread ~4 µs a Done (2-core VM)
                stages = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in timings.items())
                log.debug("load %s done: %s", msg.req_id, stages)
        elif isinstance(msg, p.Aborted):
            self.tracker.aborted(msg.req_id, msg.safe, msg.reason, at, ev.epoch)
        elif isinstance(msg, p.Error):
            refused = msg.req_id is not None and msg.in_reply_to in ("Pull", None)
            if refused and self.tracker.epoch_of(msg.req_id) in (ev.epoch, None):
                self.tracker.fail(msg.req_id, f"kv-sidecar refused the pull: {msg.reason}", at)
            else:
                log.error("kv-sidecar error (in reply to %s): %s", msg.in_reply_to, msg.reason)


def local_lease_start(started_ns: int, scheduler_clock_ns: int, now_ns: int) -> int:
    """A lease start the scheduler stamped with its monotonic clock, in this process's: its age there,
    counted back from ``now_ns``. The scheduler may run on another node, whose monotonic clock has another
    origin (stock NixlConnector rebases its deadlines the same way). The time the orders took to get here is
    added to the start (well inside the daemon's margin); 0 stays 0 (unknown), and a start from before this
    clock's origin is 1."""
    if not started_ns or not scheduler_clock_ns:
        return started_ns
    return max(1, now_ns - max(0, scheduler_clock_ns - started_ns))
