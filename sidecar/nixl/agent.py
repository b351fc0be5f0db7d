"""The daemon's NIXL agent (``NixlTransfer``): made here, its work done by its parts.

Synchronous: the daemon polls from its asyncio loop and posts READs from one worker thread (``transfer()``
runs for ~5-8 µs per descriptor with the GIL released). Every call into NIXL goes through one lock of ours
(``NixlTransfer.lock``, why: ``sidecar.nixl.calls``); the loop only *tries* it where it can skip
(``NixlTransfer.hold``). The wire formats (notification, heartbeat, metadata) come from
``sidecar.wire.prefill``; the byte geometry from ``sidecar.nixl.geometry``. ``nixl`` is imported lazily (it
costs ~2 s with CPU torch installed).

Made here: on a GPU the CUDA context first, then NIXL's agent with the configured backends; NIXL skips a
backend whose plugin it lacks with only a warning, so a missing one is refused at creation
(``nixl_backends``). The parts share the agent and its lock, each owning its state:

- ``local_memory.LocalMemory``: registrations, the destinations read into, staging pools;
- ``remote_peers.RemotePeers``: the prefill ranks loaded (their remote agents), geometries, prepared lists,
  and the refused ones loaded only to be notified;
- ``reads.NixlReads``: a request's READs posted, polled, released and aborted (``ReadOp``);
- ``notifications.Notifier``: completion notifications, heartbeats and progress (without its thread).

``NixlTransfer``'s other methods hand each call to the part that owns it, so its callers (``NixlPort``, the
benches, ``doctor``) hold one agent.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec
import numpy as np

from sidecar.nixl.calls import Serialized, init_cuda_context, nixl_call
from sidecar.nixl.errors import TransferFailed
from sidecar.nixl.geometry import DescIndices, LocalRegions, Mode, PairGeometry, StagingPool
from sidecar.nixl.local_memory import Destination, LocalMemory, Registration
from sidecar.nixl.notifications import Notifier
from sidecar.nixl.reads import NixlReads, ReadOp
from sidecar.nixl.remote_peers import NotifyOnlyPeer, Peer, RemotePeers
from sidecar.nixl.runs import Descs


class TransferSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The NIXL agent's settings (the daemon's from its config's ``nixl_*`` keys and ``gpu``)."""

    name_prefix: str = "kv-sidecar"
    backends: tuple[str, ...] = ("UCX",)
    num_threads: int = 0
    progress_thread: bool = True
    # GPU whose memory this agent registers; None on the CPU twin.
    cuda_device: int | None = None


def _create_agent(name: str, settings: TransferSettings) -> Any:
    """NIXL's agent named ``name`` with ``settings``' backends, each of which must have its plugin here."""
    from nixl._api import nixl_agent, nixl_agent_config

    conf = nixl_agent_config(
        enable_prog_thread=settings.progress_thread,
        enable_listen_thread=False,
        backends=list(settings.backends),
        num_threads=settings.num_threads,
    )
    agent = nixl_call("create agent", nixl_agent, name, conf)
    # NIXL skips a backend whose plugin it lacks with a warning; every registration naming it then fails
    created = getattr(agent, "backends", settings.backends)
    missing = [b for b in settings.backends if b not in created]
    if missing:
        raise TransferFailed(f"no NIXL plugin for {', '.join(missing)} here (plugins: "
                             f"{', '.join(agent.get_plugin_list()) or 'none'})", "nixl_backends")
    return agent


class NixlTransfer:
    """A NIXL agent used to pull KV pages from prefills. Any thread may call it: calls into NIXL are
    serialised by ``lock`` (the daemon posts from its poster thread and polls from its loop). ``clock``: when
    a notify-only load was last used (``let_go_notify_only``)."""

    def __init__(
        self, settings: TransferSettings | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings or TransferSettings()
        if self.settings.cuda_device is not None:
            init_cuda_context(self.settings.cuda_device)
        self.name = f"{self.settings.name_prefix}-{uuid.uuid4().hex}"
        self.lock = threading.RLock()
        self.agent = Serialized(_create_agent(self.name, self.settings), self.lock)
        self.remote_peers = RemotePeers(self.agent, self.lock, clock)
        self.memory = LocalMemory(
            self.agent,
            self.lock,
            self.remote_peers,
            backends=self.settings.backends,
            cuda_device=self.settings.cuda_device,
        )
        self.notifier = Notifier(self.agent)
        self.reads = NixlReads(self.agent, self.lock, self.memory, self.remote_peers, self.notifier)

    @contextlib.contextmanager
    def hold(self, blocking: bool = True) -> Iterator[bool]:
        """Hold the agent (True), or with ``blocking=False`` yield False at once if another thread is in
        NIXL (a post): for work that can be skipped this time round (a poll pass, UCX progress)."""
        got = self.lock.acquire(blocking)
        try:
            yield got
        finally:
            if got:
                self.lock.release()

    def thread_init(self) -> None:
        """Prepare the calling thread for NIXL calls: on a GPU its CUDA context (current per thread)."""
        if self.settings.cuda_device is not None:
            init_cuda_context(self.settings.cuda_device)

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def close(self) -> None:
        """Release everything this agent holds (peers, lists, registrations)."""
        self.remote_peers.close()
        self.memory.close()

    # -- local memory: ``LocalMemory`` --

    def register(self, ranges: Sequence[tuple[int, int, int]], mem_type: str) -> Registration:
        return self.memory.register(ranges, mem_type)

    def deregister(self, reg: Registration) -> None:
        self.memory.deregister(reg)

    def destination(self, reg: Registration, regions: LocalRegions) -> Destination:
        return self.memory.destination(reg, regions)

    def staging(self, reg: Registration, pool: StagingPool) -> StagingPool:
        return self.memory.staging(reg, pool)

    # -- prefill ranks: ``RemotePeers`` --

    def peer(self, engine_id: str, tp_rank: int) -> Peer | None:
        return self.remote_peers.peer(engine_id, tp_rank)

    @property
    def peers(self) -> list[Peer]:
        return self.remote_peers.peers

    def add_peer(self, **peer: Any) -> Peer:
        return self.remote_peers.add_peer(**peer)

    def remove_peer(self, peer: Peer) -> None:
        self.remote_peers.remove_peer(peer)

    def load_notify_only(self, **rank: Any) -> NotifyOnlyPeer:
        return self.remote_peers.load_notify_only(**rank)

    def mark_used(self, told: NotifyOnlyPeer) -> None:
        self.remote_peers.mark_used(told)

    def let_go_notify_only(self, idle_s: float) -> int:
        return self.remote_peers.let_go_notify_only(idle_s)

    def geometry(
        self, peer: Peer, dest: Destination, mode: Mode, pool: StagingPool | None = None
    ) -> PairGeometry:
        return self.remote_peers.geometry(peer, dest, mode, pool)

    # -- reads: ``NixlReads`` --

    @staticmethod
    def table(*args: Any, **kwargs: Any) -> DescIndices | Descs:
        return NixlReads.table(*args, **kwargs)  # looked up per call: ``loop_pieces`` may have wrapped it

    def prepare(self, peer: Peer, dest: Destination, mode: Mode) -> tuple[Any, Any]:
        return self.reads.prepare(peer, dest, mode)

    def start(
        self, peer: Peer, remote_request_id: str, *, readers: int = 1, timeout_s: float = 30.0
    ) -> ReadOp:
        return self.reads.start(peer, remote_request_id, readers=readers, timeout_s=timeout_s)

    def pull(self, *args: Any, **kwargs: Any) -> ReadOp:  # its many options: see ``NixlReads.pull``
        return self.reads.pull(*args, **kwargs)

    def read_indices(
        self,
        pull: ReadOp,
        dest: Destination,
        mode: Mode,
        local_idx: np.ndarray,
        remote_idx: np.ndarray,
        nbytes: int = 0,
    ) -> None:
        self.reads.read_indices(pull, dest, mode, local_idx, remote_idx, nbytes)

    def read_descs(self, pull: ReadOp, local: np.ndarray, remote: np.ndarray, local_mem_type: str) -> None:
        self.reads.read_descs(pull, local, remote, local_mem_type)

    def seal(self, pull: ReadOp) -> None:
        self.reads.seal(pull)

    def poll(self, pull: ReadOp, now: float | None = None, *, notify: bool = True) -> bool:
        return self.reads.poll(pull, now, notify=notify)

    def notify_read(self, pull: ReadOp) -> None:
        self.reads.notify_read(pull)

    def wait(self, pull: ReadOp, *, sleep_s: float = 0.0005, release: bool = True) -> ReadOp:
        return self.reads.wait(pull, sleep_s=sleep_s, release=release)

    def release(self, pull: ReadOp) -> bool:
        return self.reads.release(pull)

    def abort(self, pull: ReadOp) -> bool:
        return self.reads.abort(pull)

    # -- notifications: ``Notifier`` --

    def notify(self, peer: Peer, remote_request_id: str, readers: int = 1) -> None:
        self.notifier.notify(peer, remote_request_id, readers)

    def notify_agent(self, agent_name: str, remote_request_id: str, readers: int = 1) -> None:
        self.notifier.notify_agent(agent_name, remote_request_id, readers)

    def heartbeat(self, peer: Peer, remote_request_ids: Sequence[str]) -> None:
        self.notifier.heartbeat(peer, remote_request_ids)

    def progress(self) -> None:
        self.notifier.progress()
