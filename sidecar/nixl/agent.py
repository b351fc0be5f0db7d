"""The NIXL agent: register local memory, load remote prefills, read, poll, notify, heartbeat.

Synchronous: the daemon polls from its asyncio loop and posts READs from one worker thread (``transfer()``
runs for ~5-8 µs per descriptor with the GIL released). NIXL's agent is not safe for two threads at once at
its default ``sync_mode`` (measured: a segfault in ``check_xfer_state``, ``sidecar.bench.nixl_threads``), and
at ``STRICT``/``RW`` a second thread's call waits for the first anyway, so every call goes through one lock
of ours (``NixlTransfer.lock``); the loop only *tries* it where it can skip (``NixlTransfer.hold``).
The wire formats (notification, heartbeat, metadata) come from ``sidecar.wire.prefill``; the byte geometry
from ``sidecar.nixl.geometry``. ``nixl`` is imported lazily (it costs ~2 s with CPU torch installed).

Completion notification: a request's reads from one prefill rank may be split into several transfers
(one per layer group, so conversion can start early). NIXL delivers a notification attached to a READ
when THAT transfer completes, and transfers may complete out of order, so attaching it to the last one
posted could free the prefill's blocks while an earlier transfer still reads them. We therefore never
attach it: after every transfer of the rank is DONE we send exactly one ``send_notif`` — the same call
that abort and full-prefix-hit requests use, so there is one path for all three.

Size: the NIXL agent's whole surface (registration, peers, reads, notifications); admission and errors
are split out.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from sidecar.nixl.admission import RemoteFormatRule
from sidecar.nixl.errors import (
    RemoteRefused,
    RequestRefused,
    TransferError,
    TransferFailed,
    TransferTimeout,
    map_nixl_error,
)
from sidecar.nixl.geometry import (
    BlockPairs,
    DescIndices,
    GeometryError,
    LocalRegions,
    Mode,
    PairGeometry,
    RemoteRegions,
    StagingPool,
)
from sidecar.nixl.peer_book import PeerBook
from sidecar.nixl.runs import Descs, layer_group_bounds
from sidecar.wire import prefill as vllm_wire
from sidecar.wire.formats import Plan

log = logging.getLogger("kv_sidecar.nixl")

LOCAL_AGENT = "NIXL_INIT_AGENT"


def _encode(encoder, *args) -> bytes:
    """A message for a stock prefill, validated: a malformed one would crash its engine, so never send it."""
    try:
        return encoder(*args)
    except vllm_wire.WireError as exc:
        raise RequestRefused(exc.reason, exc.field) from exc


def _nixl_call(what: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except TransferError:
        raise
    except Exception as exc:  # noqa: BLE001 - every NIXL failure becomes a typed error
        raise map_nixl_error(exc, what) from exc


class TransferSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The transfer section of the daemon's config."""

    name_prefix: str = "kv-sidecar"
    backends: tuple[str, ...] = ("UCX",)
    num_threads: int = 0
    progress_thread: bool = True
    remote_formats: tuple[RemoteFormatRule, ...] = ()
    # Memory type of remote regions when the metadata has no region_mem_types.
    remote_mem_type: str = "VRAM"
    conversion_enabled: bool = True
    # The matching [[remotes]] rule's fp8_lossy_reencode: accept e4m3fn -> e4m3fnuz re-encodes that can lose
    # values.
    allow_lossy_fp8: bool = False
    # GPU whose memory this agent registers; None on the CPU twin.
    cuda_device: int | None = None



# -- the agent -------------------------------------------------------------------------------------


@dataclass(eq=False)
class Registration:
    """Local memory registered with NIXL: (addr, len, dev) ranges of one memory type."""

    ranges: np.ndarray  # (N, 3) uint64
    mem_type: str
    handle: Any

    def covers(self, start: np.ndarray, end: np.ndarray, device_id: int) -> bool:
        """Whether every [start, end) lies inside one registered range of ``device_id``."""
        r = self.ranges[self.ranges[:, 2] == np.uint64(device_id)]
        lo, hi = r[:, 0][None, :], (r[:, 0] + r[:, 1])[None, :]
        inside = (start[:, None] >= lo) & (end[:, None] <= hi)
        return bool(inside.any(axis=1).all())


@dataclass(eq=False)
class Destination:
    """Local regions (K/V planes or whole blocks) inside a registration, with their prepared local table."""

    registration: Registration
    regions: LocalRegions
    local_handle: Any = None


@dataclass(eq=False)
class Peer:
    """One prefill rank: its NIXL agent, its checked geometry and our prepared lists for it."""

    engine_id: str
    tp_rank: int
    generation: int
    address: str
    agent_name: str
    plan: Plan
    regions: RemoteRegions
    remote_handles: dict[str, Any] = field(default_factory=dict)  # mode -> prepped remote dlist
    geometries: dict[tuple[int, str], PairGeometry] = field(default_factory=dict)
    prep_seconds: dict[str, float] = field(default_factory=dict)  # mode -> one-time prep_xfer_dlist cost
    source: Any = None  # tp.SourceSlice when the prefill runs at another TP (we read a head slice), else None
    notif_count: int = 1  # the n of "id:n" this rank expects (decoder ranks reading it)
    agent_metadata: bytes = b""  # its NIXL agent metadata (UCX worker address, region keys): for mapping
    mapping: Any = None  # mapping.MappedPages once mapped, or the MappingUnavailable that said why not
    # NIXL let it go when a newer registration or a restarted engine replaced it: no read goes through it
    # any more (its old regions may now be another registration's), while its mapping stays until
    # ``remove_peer``, as a pull may still convert through it
    unloaded: bool = False

    @property
    def key(self) -> tuple[str, int]:
        return (self.engine_id, self.tp_rank)


@dataclass(eq=False)
class ReadOp:
    """One request's reads from one prefill rank, and the single completion notification owed to it."""

    peer: Peer
    remote_request_id: str
    readers: int
    deadline: float  # monotonic
    handles: list[Any] = field(default_factory=list)
    done_flags: list[bool] = field(default_factory=list)
    sealed: bool = False  # no more transfers will be added
    notified: bool = False
    finished: bool = False
    error: TransferError | None = None
    notify_error: TransferError | None = None
    started_at: float = field(default_factory=time.monotonic)
    done_at: float | None = None
    descriptors: int = 0
    nbytes: int = 0
    layer_ranges: list[tuple[int, int]] = field(default_factory=list)  # [first, last) layers of each handle
    landed: list[tuple[int, int]] = field(default_factory=list)  # ranges seen DONE, for the caller to take


def init_cuda_context(device: int) -> None:
    """Create the CUDA/HIP context before the NIXL agent: UCX probes memory types through the current
    context, and an agent made without one takes VRAM for host memory and refuses to register it (seen on
    the H200: "VRAM memory is detected as host by UCX")."""
    import torch

    # UCX's memory-type cache learns ranges from the allocations it intercepts; memory mapped through
    # cudaIpcOpenMemHandle is not among them and was taken for host memory on the H200. Ask the driver.
    os.environ.setdefault("UCX_MEMTYPE_CACHE", "n")
    torch.cuda.set_device(device)
    torch.zeros(1, device=f"cuda:{device}")


def _locked(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run a ``NixlTransfer`` method under its lock as a whole: the Python state it reads and changes (peers,
    their prepared handles and geometries, destinations) stays consistent with another thread's post."""

    @functools.wraps(method)
    def call(self: NixlTransfer, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return method(self, *args, **kwargs)

    return call


class _Serialized:
    """The NIXL agent with every method call taken under ``lock`` (one thread inside NIXL at a time)."""

    def __init__(self, agent: Any, lock: threading.RLock) -> None:
        self._agent = agent
        self._lock = lock

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._agent, name)
        if not callable(attr):
            return attr
        lock = self._lock

        def call(*args: Any, **kwargs: Any) -> Any:
            with lock:
                return attr(*args, **kwargs)

        return call


class NixlTransfer:
    """A NIXL agent used to pull KV pages from prefills. Any thread may call it: calls into NIXL are
    serialised by ``lock`` (the daemon posts from its poster thread and polls from its loop)."""

    def __init__(self, settings: TransferSettings | None = None) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.settings = settings or TransferSettings()
        if self.settings.cuda_device is not None:
            init_cuda_context(self.settings.cuda_device)
        self.name = f"{self.settings.name_prefix}-{uuid.uuid4().hex}"
        conf = nixl_agent_config(
            enable_prog_thread=self.settings.progress_thread,
            enable_listen_thread=False,
            backends=list(self.settings.backends),
            num_threads=self.settings.num_threads,
        )
        self.lock = threading.RLock()
        agent = _nixl_call("create agent", nixl_agent, self.name, conf)
        # NIXL skips a backend whose plugin it lacks with a warning; every registration naming it then fails
        created = getattr(agent, "backends", self.settings.backends)
        missing = [b for b in self.settings.backends if b not in created]
        if missing:
            raise TransferFailed(f"no NIXL plugin for {', '.join(missing)} here (plugins: "
                                 f"{', '.join(agent.get_plugin_list()) or 'none'})", "nixl_backends")
        self.agent = _Serialized(agent, self.lock)
        self._book = PeerBook()  # the loaded peers, and the current one of each (engine id, rank)
        self._registrations: list[Registration] = []
        self._dests: dict[int, Destination] = {}

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

    # -- local memory --

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    @_locked
    def register(self, ranges: Sequence[tuple[int, int, int]], mem_type: str) -> Registration:
        """Register local (addr, len, dev) ranges: planes (DRAM on CPU, VRAM on GPU) or a staging pool."""
        if not ranges:
            raise TransferFailed("nothing to register", "ranges")
        if self.settings.cuda_device is not None:
            # The context is current per thread, and UCX checks the memory type in the calling thread.
            init_cuda_context(self.settings.cuda_device)
        arr = np.asarray(ranges, dtype=np.uint64).reshape(-1, 3)
        descs = self.agent.get_reg_descs([(int(a), int(n), int(d), "") for a, n, d in arr], mem_type)
        if descs is None:
            raise TransferFailed(f"NIXL rejected the ranges as {mem_type}", "mem_type")
        handle = _nixl_call(
            "register_memory", self.agent.register_memory, descs, backends=list(self.settings.backends)
        )
        reg = Registration(ranges=arr, mem_type=mem_type, handle=handle)
        self._registrations.append(reg)
        return reg

    @_locked
    def deregister(self, reg: Registration) -> None:
        for key in [k for k, d in self._dests.items() if d.registration is reg]:
            self._drop_destination(key)
        _nixl_call("deregister_memory", self.agent.deregister_memory, reg.handle)
        self._registrations.remove(reg)

    @_locked
    def destination(self, reg: Registration, regions: LocalRegions) -> Destination:
        """Local regions to read into; they must lie inside ``reg`` (fail closed, never read outside it)."""
        if regions.mem_type != reg.mem_type:
            raise TransferFailed(
                f"regions are {regions.mem_type}, the registration is {reg.mem_type}", "mem_type"
            )
        start = regions.base
        end = regions.base + ((regions.num_blocks - 1) * regions.block_stride + regions.block_len).astype(
            np.uint64
        )
        if not reg.covers(start, end, regions.device_id):
            raise TransferFailed("some local regions lie outside the registered memory", "local.regions")
        dest = Destination(registration=reg, regions=regions)
        self._dests[id(dest)] = dest
        return dest

    @_locked
    def staging(self, reg: Registration, pool: StagingPool) -> StagingPool:
        """A staging pool to read into; it must lie inside ``reg``."""
        if pool.mem_type != reg.mem_type:
            raise TransferFailed(f"pool is {pool.mem_type}, the registration is {reg.mem_type}", "mem_type")
        start = np.array([pool.base], np.uint64)
        if not reg.covers(start, start + np.uint64(pool.slot_bytes * pool.num_slots), pool.device_id):
            raise TransferFailed("the staging pool lies outside the registered memory", "pool")
        return pool

    def _local_handle(self, dest: Destination, table: np.ndarray) -> Any:
        if dest.local_handle is None:
            dest.local_handle = _nixl_call(
                "prep local dlist", self.agent.prep_xfer_dlist, LOCAL_AGENT, table, dest.registration.mem_type
            )
        return dest.local_handle

    def _drop_destination(self, key: int) -> None:
        dest = self._dests.pop(key)
        if dest.local_handle is not None:
            self.agent.release_dlist_handle(dest.local_handle)
        for peer in self._book.loaded():
            for gk in [gk for gk in peer.geometries if gk[0] == key]:
                del peer.geometries[gk]

    # -- remotes --

    def peer(self, engine_id: str, tp_rank: int) -> Peer | None:
        return self._book.current((engine_id, tp_rank))

    @property
    def peers(self) -> list[Peer]:
        return self._book.all_current()

    @_locked
    def add_peer(
        self,
        *,
        engine_id: str,
        tp_rank: int,
        generation: int,
        address: str,
        agent_metadata: bytes,
        plan: Plan,
        regions: RemoteRegions,
        source: Any = None,
        notif_count: int = 1,
    ) -> Peer:
        """Load a checked remote (see ``admit_remote``) as the current peer of (engine id, rank); what it
        replaces, and which remote agent it shares, by ``PeerBook``'s rules: a replaced peer is let go by NIXL
        at once (``_unload``) or, re-admitted alike, reads on; either way its mapping stays until
        ``remove_peer``."""
        key = (engine_id, tp_rank)
        for old in self._book.replaced_by(key, generation, agent_metadata, address, tp_rank):
            if old.key != key:
                log.info("prefill at %s rank %d restarted: dropping engine %s", address, tp_rank,
                         old.engine_id)
            self._unload(old)
        name = self._book.agent_for(agent_metadata)
        if name is None:
            name = _nixl_call("add_remote_agent", self.agent.add_remote_agent, agent_metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            if self._book.agent_in_use(name):
                raise RemoteRefused(
                    f"agent name {name!r} is already loaded for another engine", "agent_metadata"
                )
            _nixl_call("make_connection", self.agent.make_connection, name)
        peer = Peer(
            engine_id=engine_id,
            tp_rank=tp_rank,
            generation=generation,
            address=address,
            agent_name=name,
            plan=plan,
            regions=regions,
            source=source,
            notif_count=notif_count,
            agent_metadata=agent_metadata,
        )
        self._book.add(peer)
        return peer

    @_locked
    def remove_peer(self, peer: Peer) -> None:
        """Let ``peer`` go (the daemon calls it once no pull reads through it): NIXL's side (``_unload``),
        then its mapping. A second call is a no-op; neither touches a peer that replaced it."""
        if not self._book.forget(peer):
            return
        self._unload(peer)
        mapping, peer.mapping = peer.mapping, None
        if hasattr(mapping, "close"):
            try:
                mapping.close()  # waits for this process's kernels first: one may still read through it
            except Exception as exc:  # noqa: BLE001 - best effort on teardown
                log.warning("unmapping %s: %s", peer.agent_name, exc)

    def _unload(self, peer: Peer) -> None:
        """NIXL's side of letting ``peer`` go: its prepared lists, and its remote agent unless a current peer
        reads through the same one. Reads through it are refused from now on (``pull``)."""
        if not self._book.unload(peer):
            return
        for handle in peer.remote_handles.values():
            try:
                self.agent.release_dlist_handle(handle)
            except Exception as exc:  # noqa: BLE001 - best effort on teardown
                log.warning("releasing a dlist of %s: %s", peer.agent_name, exc)
        peer.remote_handles.clear()
        peer.geometries.clear()
        if self._book.agent_in_use(peer.agent_name):
            return  # a peer that replaced it reads through the same agent
        try:
            self.agent.remove_remote_agent(peer.agent_name)
        except Exception as exc:  # noqa: BLE001
            log.warning("removing agent %s: %s", peer.agent_name, exc)

    def geometry(
        self, peer: Peer, dest: Destination, mode: Mode, pool: StagingPool | None = None
    ) -> PairGeometry:
        """The checked pairing of ``peer``'s regions with ``dest`` (cached); refusals name the field."""
        key = (id(dest), mode)
        geo = peer.geometries.get(key)
        if geo is None or (mode == "staged" and geo.pool is not pool):
            try:
                geo = PairGeometry(peer.plan, peer.regions, dest.regions, mode, pool=pool, source=peer.source)
            except GeometryError as exc:
                raise RemoteRefused(exc.reason, exc.field) from exc
            peer.geometries[key] = geo
        return geo

    def prepare(self, peer: Peer, dest: Destination, mode: Mode) -> tuple[Any, Any]:
        """Prepared (local, remote) dlists for index-form reads: NIXL's one-time work per remote and mode."""
        geo = self.geometry(peer, dest, mode)
        local = self._local_handle(dest, geo.local_table())
        remote = peer.remote_handles.get(mode)
        if remote is None:
            t0 = time.perf_counter()
            remote = _nixl_call(
                "prep remote dlist",
                self.agent.prep_xfer_dlist,
                peer.agent_name,
                geo.remote_table(),
                peer.regions.mem_type,
            )
            peer.prep_seconds[mode] = time.perf_counter() - t0
            peer.remote_handles[mode] = remote
        return local, remote

    # -- reads --

    def start(
        self, peer: Peer, remote_request_id: str, *, readers: int = 1, timeout_s: float = 30.0
    ) -> ReadOp:
        """A pull of one request from one prefill rank; add transfers, then ``seal`` and ``poll``."""
        _encode(vllm_wire.encode_notification, remote_request_id, readers)  # refuse now, not when owed
        return ReadOp(
            peer=peer,
            remote_request_id=remote_request_id,
            readers=readers,
            deadline=time.monotonic() + timeout_s,
        )

    def _post(self, pull: ReadOp, make, what: str, count: int, nbytes: int) -> None:
        if pull.sealed or pull.finished:
            raise TransferFailed("the pull is sealed; no more transfers", "pull")
        try:
            handle = _nixl_call(what, make)
        except TransferError as exc:
            self._fail(pull, exc)
            raise
        pull.handles.append(handle)
        pull.done_flags.append(False)
        pull.done_flags[-1] = self._state(pull, "transfer", self.agent.transfer, handle)
        pull.descriptors += count
        pull.nbytes += nbytes

    def _refuse_unloaded(self, pull: ReadOp) -> None:
        """Fail the pull if NIXL let its peer go: its old regions may now lie in the prefill's newer
        registration (fail closed rather than read them)."""
        if pull.peer.unloaded:
            exc = TransferFailed(
                f"prefill {pull.peer.engine_id} rank {pull.peer.tp_rank} re-registered or restarted since "
                "this pull's handshake: its old regions are not read",
                "remote_registration_generation",
            )
            self._fail(pull, exc)
            raise exc

    def read_indices(
        self,
        pull: ReadOp,
        dest: Destination,
        mode: Mode,
        local_idx: np.ndarray,
        remote_idx: np.ndarray,
        nbytes: int = 0,
    ) -> None:
        """Post one READ of prepared-table rows (a layer group of ``DescIndices``)."""
        if local_idx.size == 0:
            return
        local_h, remote_h = self.prepare(pull.peer, dest, mode)
        li, ri = np.ascontiguousarray(local_idx, np.int32), np.ascontiguousarray(remote_idx, np.int32)
        self._post(
            pull,
            lambda: self.agent.make_prepped_xfer("READ", local_h, li, remote_h, ri),
            "make_prepped_xfer",
            li.size,
            nbytes,
        )

    def read_descs(self, pull: ReadOp, local: np.ndarray, remote: np.ndarray, local_mem_type: str) -> None:
        """Post one READ of explicit Nx3 descriptors (staged or merged runs)."""
        if local.shape[0] == 0:
            return
        agent, peer = self.agent, pull.peer

        def make():
            ld = agent.get_xfer_descs(np.ascontiguousarray(local, np.uint64), local_mem_type)
            rd = agent.get_xfer_descs(np.ascontiguousarray(remote, np.uint64), peer.regions.mem_type)
            if ld is None or rd is None:
                raise TransferFailed("NIXL rejected the descriptor arrays", "descs")
            return agent.initialize_xfer("READ", ld, rd, peer.agent_name)

        self._post(pull, make, "initialize_xfer", int(local.shape[0]), int(local[:, 1].sum()))

    @staticmethod
    def table(
        geo: PairGeometry,
        mode: Mode,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        remote_num_tokens: int | None,
        pool: StagingPool | None,
        slots: np.ndarray | None,
        gaps: Any = None,
        pairs: BlockPairs | None = None,
    ) -> DescIndices | Descs:
        """A request's descriptors against ``geo`` (from ``pairs`` when given: the ids are not paired again);
        raises GeometryError naming the field."""
        if geo.source is not None:  # a head slice (heterogeneous TP): explicit descriptors in every mode
            return geo.sliced_descs(local_block_ids, remote_block_ids, remote_num_tokens, slots, pairs=pairs)
        if mode == "staged":
            if pool is None or slots is None:
                raise GeometryError("pool", "a staged pull needs a pool and slots")
            return geo.staged_descs(
                remote_block_ids,
                slots,
                local_block_ids=local_block_ids,
                remote_num_tokens=remote_num_tokens,
                gaps=gaps,
                pairs=pairs,
            )
        return geo.indices(local_block_ids, remote_block_ids, remote_num_tokens, pairs=pairs)

    @_locked
    def pull(
        self,
        peer: Peer,
        dest: Destination,
        mode: Mode,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        remote_request_id: str,
        *,
        readers: int = 1,
        layer_groups: int = 1,
        timeout_s: float = 30.0,
        remote_num_tokens: int | None = None,
        pool: StagingPool | None = None,
        slots: np.ndarray | None = None,
        gaps: Any = None,
        table: DescIndices | Descs | None = None,
        pairs: BlockPairs | None = None,
    ) -> ReadOp:
        """Build the request's descriptors (unless ``table`` gives them, from :meth:`table`; from ``pairs``,
        the ids' checked pairing, when given) and post them in ``layer_groups`` READs; returns the sealed
        pull.
        ``gaps`` (staged): a ``spans.GapRead`` or ``SpanGaps`` of blocks read into staging only, to merge
        runs.

        Staged mode reads into ``pool`` (see ``staging``) at ``slots[layer, i]``. With no block to read (a
        full local prefix hit) nothing is posted and the pull completes with just the notification."""
        pull = self.start(peer, remote_request_id, readers=readers, timeout_s=timeout_s)
        self._refuse_unloaded(pull)  # once, under the lock no unload can take meanwhile
        try:
            geo = self.geometry(peer, dest, mode, pool)
        except RemoteRefused as exc:  # this pairing cannot be read: the prefill frees the blocks now
            self._fail(pull, exc)
            raise
        try:
            if table is None:
                table = self.table(
                    geo, mode, local_block_ids, remote_block_ids, remote_num_tokens, pool, slots, gaps, pairs
                )
        except GeometryError as exc:
            # Nothing will be read: tell the prefill now rather than let the blocks wait for the lease.
            self._fail(pull, RequestRefused(exc.reason, exc.field))
            raise pull.error from exc  # type: ignore[misc]
        try:
            self._post_groups(pull, geo, table, dest, mode, pool, layer_groups)
        except Exception as exc:  # whatever the error: what it posted may still hold handles, untold
            exc.read = pull  # type: ignore[attr-defined]  # failed midway: the caller stops it
            raise
        self.seal(pull)
        return pull

    def _post_groups(self, pull: ReadOp, geo: PairGeometry, table: Any, dest: Destination, mode: Mode,
                     pool: StagingPool | None, layer_groups: int) -> None:
        for a, b in layer_group_bounds(geo.layers, layer_groups):
            posted = len(pull.handles)
            if isinstance(table, Descs):
                loc, rem = table.layer_slice(a, b)
                mem = pool.mem_type if mode == "staged" else dest.registration.mem_type  # type: ignore[union-attr]
                self.read_descs(pull, loc, rem, mem)
            else:
                li, ri = table.layer_slice(a, b)
                self.read_indices(pull, dest, mode, li, ri, nbytes=self._index_bytes(geo, li.size))
            if len(pull.handles) > posted:
                pull.layer_ranges.append((a, b))
                if pull.done_flags[-1]:  # a transport that copies while posting (shm) is DONE at once
                    pull.landed.append((a, b))

    @staticmethod
    def _index_bytes(geo: PairGeometry, count: int) -> int:
        unit = int(geo.local.block_len[0])
        return unit * count

    def seal(self, pull: ReadOp) -> None:
        """No more transfers for this pull: once all are done, its notification may go."""
        pull.sealed = True

    def _state(self, pull: ReadOp, what: str, call: Any, handle: Any) -> bool:
        """Post or check one transfer; True when it is DONE. A NIXL error fails the whole pull."""
        try:
            state = _nixl_call(what, call, handle)
        except TransferError as exc:
            self._fail(pull, exc)
            raise
        if state == "ERR":
            exc = TransferFailed(f"{what} returned ERR")
            self._fail(pull, exc)
            raise exc
        return state == "DONE"

    def poll(self, pull: ReadOp, now: float | None = None, *, notify: bool = True) -> bool:
        """Non-blocking: True once every transfer is DONE and the one notification has been sent (with
        ``notify=False`` the caller sends it with :meth:`notify_read`, e.g. after launching work on the data).

        The DONE handles stay with the pull until :meth:`release`: releasing a handle of thousands of
        descriptors takes time the caller can spend after it has answered (the daemon releases after Done).

        Raises RemoteDisconnected / TransferFailed / TransferTimeout (the pull is then aborted: handles
        released and, where the peer is alive, the notification sent so the prefill frees its blocks)."""
        if pull.finished:
            if pull.error is not None:
                raise pull.error
            return True
        now = time.monotonic() if now is None else now
        for i, handle in enumerate(pull.handles):
            if pull.done_flags[i]:
                continue
            pull.done_flags[i] = self._state(pull, "check_xfer_state", self.agent.check_xfer_state, handle)
            if pull.done_flags[i] and i < len(pull.layer_ranges):
                pull.landed.append(pull.layer_ranges[i])  # its layers may be converted while others read
        if pull.sealed and all(pull.done_flags):
            pull.done_at = now
            if notify:
                self._notify_once(pull)  # every read is DONE: the prefill may free its blocks now
            pull.finished = True
            return True
        if now > pull.deadline:
            exc = TransferTimeout(
                f"pull of {pull.remote_request_id!r} from {pull.peer.address} rank "
                f"{pull.peer.tp_rank} missed its deadline"
            )
            self._fail(pull, exc)
            raise exc
        return False

    def notify_read(self, pull: ReadOp) -> None:
        """The finished pull's one notification, if :meth:`poll` was told not to send it."""
        self._notify_once(pull)

    def wait(self, pull: ReadOp, *, sleep_s: float = 0.0005, release: bool = True) -> ReadOp:
        """Blocking helper for benches and tests: poll with a short sleep (no hot spin on small hosts), then
        release the handles unless told not to."""
        while not self.poll(pull):
            time.sleep(sleep_s)
        if release:
            self.release(pull)
        return pull

    @_locked
    def release(self, pull: ReadOp) -> bool:
        """Release a pull's transfer handles that have ended (all of them after :meth:`poll` said done). True
        when none is left, i.e. nothing can still write into the destination; else call again later."""
        return self._release(pull)

    @_locked
    def abort(self, pull: ReadOp) -> bool:
        """Stop a pull: release its transfers that have ended, then send its notification so the prefill
        frees the blocks. Returns True when nothing can still write into local memory (every handle released);
        False while a transfer is still in progress (call again: it ends, or its peer is found gone)."""
        if not pull.finished:
            pull.error = pull.error or TransferFailed("aborted")
            pull.finished = True
        safe = self._release(pull)
        self._notify_once(pull)
        return safe

    def notify(self, peer: Peer, remote_request_id: str, readers: int = 1) -> None:
        """A notification without reads (full prefix hit): the prefill frees the request's blocks."""
        self.notify_agent(peer.agent_name, remote_request_id, readers)

    def notify_agent(self, agent_name: str, remote_request_id: str, readers: int = 1) -> None:
        """A notification to any loaded agent (also one whose prefill was refused, see ``load_agent``)."""
        msg = _encode(vllm_wire.encode_notification, remote_request_id, readers)
        _nixl_call("send_notif", self.agent.send_notif, agent_name, msg)

    def load_agent(self, agent_metadata: bytes) -> str:
        """Load a remote agent only to notify it (its prefill was refused, its metadata decoded fine)."""
        name = _nixl_call("add_remote_agent", self.agent.add_remote_agent, agent_metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def heartbeat(self, peer: Peer, remote_request_ids: Sequence[str]) -> None:
        """Renew the prefill's lease on these requests (``HB:id1,id2``)."""
        if not remote_request_ids:
            return
        msg = _encode(vllm_wire.encode_heartbeat, list(remote_request_ids))
        _nixl_call("send_notif", self.agent.send_notif, peer.agent_name, msg)

    def _release(self, pull: ReadOp) -> bool:
        """Release the pull's transfers that have ended (DONE or ERR); True when none is left. One still in
        progress is kept for a later call: NIXL cancels it on release, but over UCX's tcp transport a stalled
        prefill's reply still landed in local memory after that (test_agent's stalled-read tests), so only a
        transfer that has ended cannot write any more."""
        safe = True
        kept = []
        for i, handle in enumerate(pull.handles):
            ended = i < len(pull.done_flags) and pull.done_flags[i]
            if not ended:
                try:
                    ended = self.agent.check_xfer_state(handle) != "PROC"
                except Exception:  # noqa: BLE001 - failed, or never posted: nothing of it is in flight
                    ended = True
            if ended:
                try:
                    self.agent.release_xfer_handle(handle)
                    continue
                except Exception as exc:  # noqa: BLE001 - keep it for a retry
                    log.warning("could not release a transfer of %r: %s", pull.remote_request_id, exc)
            kept.append(handle)
            safe = False
        pull.handles = kept
        pull.done_flags = [False] * len(kept)
        return safe

    def _notify_once(self, pull: ReadOp) -> None:
        if pull.notified:
            return
        pull.notified = True  # exactly once, even if the send fails
        try:
            self.notify(pull.peer, pull.remote_request_id, pull.readers)
        except TransferError as exc:
            pull.notify_error = exc
            log.warning(
                "completion notification for %r to %s failed: %s",
                pull.remote_request_id,
                pull.peer.address,
                exc,
            )

    def _fail(self, pull: ReadOp, exc: TransferError) -> None:
        pull.error = exc
        pull.finished = True
        self._release(pull)
        self._notify_once(pull)

    def close(self) -> None:
        """Release everything this agent holds (peers, lists, registrations)."""
        for peer in self._book.loaded():
            self.remove_peer(peer)
        for key in list(self._dests):
            self._drop_destination(key)
        for reg in list(self._registrations):
            try:
                self.agent.deregister_memory(reg.handle)
            except Exception as exc:  # noqa: BLE001
                log.warning("deregister: %s", exc)
        self._registrations.clear()
