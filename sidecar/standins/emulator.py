"""``kv-sidecar emulate-prefill``: one process that speaks exactly a stock vLLM 0.33 (or 0.32) prefill's side.

It serves vLLM's ROUTER side channel, a real NIXL agent (UCX, progress thread on) over one registered
allocation of standard LBHNC pages (one region per layer; DRAM, or VRAM with ``--device cuda:N`` like a GPU
prefill), counts ``"{id}:{N}"`` notifications to free blocks, and runs vLLM's lease: extended by ``HB:``
heartbeats; on expiry the blocks are freed **and reused** (rewritten with a new generation) so a late reader
gets different bytes. Where a stock prefill would crash (malformed notification or handshake frame) the
emulator logs and counts instead. Its metadata goes through sidecar.wire.prefill, the same code that decodes a
real prefill's.

Size: a whole stand-in prefill (side channel, NIXL agent, lease, control); its page bytes and its
control client live in emulator_pages.py and emulator_control.py.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import logging
import math
import os
import random
import re
import signal
import sys
import tempfile
import time
import uuid
from typing import Any

import msgspec
import numpy as np
import zmq

from sidecar.bench import block_orders
from sidecar.standins.emulator_control import (
    ENCODER,
    REQUEST_DECODER,
    Ack,
    ControlReply,
    ErrorReply,
    NewRequest,
    NewRequestReply,
    ReadyInfo,
    RequestStatus,
    RequestStatusReply,
    Shutdown,
    Stats,
    StatsReply,
)
from sidecar.standins.emulator_pages import expected_pages, kernel_blocks
from sidecar.wire import prefill as wire
from sidecar.wire.formats import DTYPE_BYTES, PageFormat

log = logging.getLogger("kv_sidecar.emulator")

VLLM_VERSION_OF = {14: "0.32.0", 15: "0.33.0"}
POLL_MS = 5
MAX_MALFORMED_SAMPLES = 20
MAX_FINISHED_KEPT = 10_000
_DEVICE = re.compile(r"cpu|cuda:\d+")
_TAG_BYTES = msgspec.msgpack.Decoder(bytes)
_TAG_STR = msgspec.msgpack.Decoder(str)
_LENIENT_REQUEST = msgspec.msgpack.Decoder(tuple[msgspec.Raw, int, int])


class EmulatorConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the emulated prefill is; ``num_blocks`` counts logical (manager) blocks."""

    host: str = "127.0.0.1"
    port: int = 0
    control: str = ""
    ready_file: str = ""
    connector_version: int = 15
    layers: int = 2
    heads: int = 2
    head_size: int = 128
    block_size: int = 16
    num_blocks: int = 64
    blocks_per_logical: int = 1
    dtype: str = "bfloat16"
    tp: int = 1
    lease_s: float = 30.0
    seed: int = 0
    engine_id: str = ""
    model: str = "kv-sidecar/emulated-prefill"
    attn_backend: str = "FLASH_ATTN"
    hma: bool = False
    # vLLM keeps NIXL's progress thread on (it spins: about half a core here); off, the loop drives progress.
    progress_thread: bool = True
    # Where the KV pages live: "cpu" (DRAM) or "cuda:N" (VRAM, registered as such; needs torch with CUDA).
    device: str = "cpu"
    # Keep the pages' bytes when blocks are handed to a new request (no rewrite, same generation): a long
    # benchmark pulls the same few blocks many times without the emulator writing to the GPU between pulls.
    # Expired leases still rewrite (a late reader must see different bytes).
    keep_bytes: bool = False

    def __post_init__(self) -> None:
        if self.connector_version not in wire.CONNECTOR_VERSIONS:
            raise ValueError(f"connector_version must be one of {wire.CONNECTOR_VERSIONS}")
        for name in ("layers", "heads", "head_size", "block_size", "blocks_per_logical", "tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.num_blocks < 2:
            raise ValueError("num_blocks must be >= 2 (block 0 is vLLM's null block)")
        if not self.lease_s > 0:
            raise ValueError("lease_s must be positive")
        if not 0 <= self.port < 65536:
            raise ValueError("port must be in 0..65535")
        if not _DEVICE.fullmatch(self.device):
            raise ValueError(f"device must be 'cpu' or 'cuda:N', got {self.device!r}")
        self.fmt  # noqa: B018 -- validates dtype and sizes through PageFormat

    @property
    def fmt(self) -> PageFormat:
        """Format of one kernel page of one TP rank."""
        return PageFormat(
            kind="standard",
            layout="LBHNC",
            dtype=self.dtype,
            num_heads=self.heads,
            block_size=self.block_size,
            head_size=self.head_size,
        )

    @property
    def gpu(self) -> int | None:
        """The CUDA device index of the pages, or None on the CPU."""
        return None if self.device == "cpu" else int(self.device.split(":")[1])

    @property
    def num_kernel_blocks(self) -> int:
        return self.num_blocks * self.blocks_per_logical

    def compat_factors(self) -> dict[str, Any]:
        """vLLM's compatibility-hash factors for this emulated prefill."""
        return {
            "vllm_version": VLLM_VERSION_OF[self.connector_version],
            "nixl_connector_version": self.connector_version,
            "model": self.model,
            "dtype": f"torch.{self.dtype}",
            "num_kv_heads": self.heads * self.tp,
            "head_size": self.head_size,
            "num_hidden_layers": self.layers,
            "attn_backend_name": self.attn_backend,
            "cache_dtype": "auto",
            "is_hma_enabled": self.hma,
            "speculative_config": None,
            "transfer_mode": "pull",
        }


def lease_extension(lease_s: float) -> float:
    """vLLM's ``kv_lease_duration * 2 // 3`` for integral leases; two thirds for a fractional test lease."""
    return float(int(lease_s) * 2 // 3) if float(lease_s).is_integer() else lease_s * 2 / 3


# --- state ---


class _Rank:
    """One prefill TP rank: its NIXL agent, its KV allocation, its cached handshake payload."""

    def __init__(self, cfg: EmulatorConfig, tp_rank: int, engine_id: str, compat_hash: str) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.tp_rank = tp_rank
        page = cfg.fmt.page_bytes
        self.region_bytes = cfg.num_kernel_blocks * page
        size = cfg.layers * self.region_bytes
        nkb = cfg.num_kernel_blocks
        if cfg.gpu is None:
            raw = np.zeros(size + 4096, dtype=np.uint8)
            start = (-raw.ctypes.data) % 4096
            self._raw = raw
            self.buf = raw[start : start + size]
            base, mem, device_id = self.buf.ctypes.data, "DRAM", 0
            self.tensor = None
        else:
            import torch

            self.tensor = torch.zeros(size, dtype=torch.uint8, device=cfg.device)
            self.buf = None
            base, mem, device_id = self.tensor.data_ptr(), "VRAM", cfg.gpu
        self.pages = [self._layer_pages(layer, nkb, page) for layer in range(cfg.layers)]
        conf = nixl_agent_config(enable_prog_thread=cfg.progress_thread, backends=["UCX"])
        self.agent = nixl_agent(str(uuid.uuid4()), conf)
        self.reg = self.agent.register_memory([(base, size, device_id, "")], mem)
        meta = wire.NixlAgentMetadata(
            engine_id=engine_id,
            agent_metadata=self.agent.get_agent_metadata(),
            kv_caches_base_addr=[base + layer * self.region_bytes for layer in range(cfg.layers)],
            device_id=device_id,
            num_blocks=nkb,
            block_lens=[page] * cfg.layers,
            block_strides=[page] * cfg.layers,
            kv_cache_layout="LBHNC",
            block_size=cfg.block_size,
            ssm_sizes=(0, 0),
            attn_backend_name=cfg.attn_backend,
            physical_blocks_per_logical_kv_block=cfg.blocks_per_logical,
            region_num_blocks=[nkb] * cfg.layers,
            region_group_ids=[0] * cfg.layers,
            region_names=[f"model.layers.{layer}.self_attn.attn" for layer in range(cfg.layers)],
            region_mem_types=[mem] * cfg.layers,
        )
        self.payload = wire.encode_handshake_payload(compat_hash, wire.encode_agent_metadata(meta))
        # Faithfulness: what we serve must decode with the very code that decodes a real prefill.
        wire.decode_handshake_reply([self.payload, wire.encode_clock_frame()], 0, tp_rank, 0.0, engine_id)

    def _layer_pages(self, layer: int, nkb: int, page: int):  # noqa: ANN202 - ndarray or torch.Tensor
        """Layer's pages as [kernel blocks, page bytes] uint8 (numpy on the CPU, torch on a GPU)."""
        lo, hi = layer * self.region_bytes, (layer + 1) * self.region_bytes
        region = self.buf[lo:hi] if self.tensor is None else self.tensor[lo:hi]
        return region.reshape(nkb, page)

    def close(self) -> None:
        try:
            self.agent.deregister_memory(self.reg)
        except Exception as exc:  # shutting down: report, do not mask the exit
            log.warning("rank %d: deregister failed: %s", self.tp_rank, exc)


class _Request:
    def __init__(
        self, request_id: str, logical: list[int], kblocks: list[int], tp: int, deadline: float, lease: float
    ):
        self.request_id = request_id
        self.logical = logical
        self.kblocks = kblocks
        self.lease_s = lease
        self.deadlines = [deadline] * tp
        self.counts = [0] * tp
        self.expected = [0] * tp
        self.done: list[str | None] = [None] * tp  # "notif" or "expired" per rank
        self.heartbeats = 0
        self.late_notifications = 0
        self.state = "pending"


class PrefillEmulator:
    """The emulated prefill; ``serve()`` runs its single-threaded loop until shutdown."""

    def __init__(self, cfg: EmulatorConfig) -> None:
        self.cfg = cfg
        self.engine_id = cfg.engine_id or str(uuid.uuid4())
        self.compat_factors = cfg.compat_factors()
        self.compat_hash = wire.compatibility_hash(self.compat_factors)
        self.fmt = cfg.fmt
        self.stats = StatsReply()
        self.rng = random.Random(cfg.seed)
        self._churn: block_orders.FreeQueue | None = None  # made by the first "churn" request
        self.generation = np.zeros(cfg.num_kernel_blocks, dtype=np.int64)
        self.free: set[int] = set(range(1, cfg.num_blocks))
        self.active: dict[str, _Request] = {}
        self.finished: collections.OrderedDict[str, _Request] = collections.OrderedDict()
        self.stopping = False
        self.ranks = [_Rank(cfg, r, self.engine_id, self.compat_hash) for r in range(cfg.tp)]
        self._rewrite(list(range(cfg.num_kernel_blocks)))
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.RCVHWM, 0)
        self.router.setsockopt(zmq.SNDHWM, 0)
        self.router.setsockopt(zmq.LINGER, 0)
        if ":" in cfg.host:
            self.router.setsockopt(zmq.IPV6, 1)
        host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
        if cfg.port:
            self.router.bind(f"tcp://{host}:{cfg.port}")
            self.port = cfg.port
        else:
            self.port = self.router.bind_to_random_port(f"tcp://{host}")
        self.control = self.ctx.socket(zmq.REP)
        self.control.setsockopt(zmq.LINGER, 0)
        self._ipc_path = ""
        address = (
            cfg.control
            or f"ipc://{tempfile.gettempdir()}/kv-sidecar-emu-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        )
        if address.startswith("tcp://") and address.endswith(":0"):
            self.control.bind_to_random_port(address[: -len(":0")])
        else:
            self.control.bind(address)
        self.control_address = self.control.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.control_address.startswith("ipc://"):
            self._ipc_path = self.control_address[len("ipc://") :]

    # --- pages ---

    def _rewrite(self, kblocks: list[int]) -> None:
        """Write every layer's pages of ``kblocks`` at their current generation, on every rank."""
        if not kblocks:
            return
        ids = np.asarray(kblocks, dtype=np.int64)
        gens = self.generation[ids]
        if self.cfg.gpu is not None:
            self._rewrite_gpu(ids, gens)
            return
        for rank in self.ranks:
            for layer in range(self.cfg.layers):
                pages = rank.pages[layer]
                for lo in range(0, len(ids), 256):
                    chunk = ids[lo : lo + 256]
                    pages[chunk] = expected_pages(
                        self.cfg.seed, layer, chunk, gens[lo : lo + 256], self.fmt, rank.tp_rank
                    )

    def _rewrite_gpu(self, ids: np.ndarray, gens: np.ndarray) -> None:
        """The same bytes as the CPU path, generated on the pages' GPU (gigabytes in milliseconds)."""
        import torch

        from sidecar.standins.emulator_pages import expected_pages_torch

        dev = self.cfg.device
        step = max(1, (256 << 20) // self.fmt.page_bytes)  # ~256 MiB of pages per generation call
        for rank in self.ranks:
            for layer in range(self.cfg.layers):
                pages = rank.pages[layer]
                for lo in range(0, len(ids), step):
                    chunk = ids[lo : lo + step]
                    index = torch.from_numpy(chunk).to(dev)
                    pages[index] = expected_pages_torch(
                        self.cfg.seed, layer, chunk, gens[lo : lo + step], self.fmt, rank.tp_rank, device=dev
                    )
        torch.cuda.synchronize(dev)  # readers must never see the old bytes

    def _reuse(self, kblocks: list[int]) -> None:
        self.generation[np.asarray(kblocks, dtype=np.int64)] += 1
        self._rewrite(kblocks)

    # --- side channel ---

    def _malformed_handshake(self, why: str) -> None:
        self.stats.malformed_handshakes += 1
        self._sample(f"handshake: {why}")
        log.error("malformed side-channel request (a stock prefill's listener would die): %s", why)

    def _serve_handshakes(self) -> None:
        while True:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"":
                self._malformed_handshake(f"{len(frames)} frames (need identity, empty, request)")
                continue
            identity, _, msg = frames
            try:
                pp, tp = wire.decode_handshake_request(msg)
            except wire.WireError as exc:
                pp, tp = self._lenient_request(msg, exc)
                if pp is None:
                    continue
            if pp != 0 or not 0 <= tp < self.cfg.tp:
                self._malformed_handshake(f"(pp={pp}, tp={tp}) not served (KeyError in a stock prefill)")
                continue
            self.router.send_multipart((identity, b"", self.ranks[tp].payload, wire.encode_clock_frame()))
            self.stats.handshakes_served += 1

    def _lenient_request(self, msg: bytes, exc: wire.WireError) -> tuple[int | None, int | None]:
        """Stock P replies despite a wrong tag (it only warns); anything else kills its listener."""
        try:
            raw_tag, pp, tp = _LENIENT_REQUEST.decode(msg)
        except msgspec.MsgspecError:
            self._malformed_handshake(exc.reason)
            return None, None
        for dec in (_TAG_BYTES, _TAG_STR):
            try:
                tag = dec.decode(raw_tag)
                break
            except msgspec.MsgspecError:
                continue
        else:
            self._malformed_handshake(exc.reason)
            return None, None
        self.stats.handshake_wrong_tag += 1
        log.warning("side-channel request with unexpected tag %r (a stock prefill warns and replies)", tag)
        return pp, tp

    # --- notifications ---

    def _sample(self, text: str) -> None:
        samples = self.stats.malformed_samples
        if len(samples) < MAX_MALFORMED_SAMPLES:
            samples.append(text[:200])

    def _poll_notifs(self) -> None:
        for rank in self.ranks:
            for msgs in rank.agent.get_new_notifs().values():
                for msg in msgs:
                    self._on_notif(rank.tp_rank, msg)

    def _on_notif(self, tp_rank: int, msg: bytes) -> None:
        try:
            parsed = wire.parse_notification(msg)
        except wire.WireError as exc:
            self.stats.malformed_notifications += 1
            self._sample(f"notification {msg[:100]!r}: {exc.reason}")
            log.error(
                "malformed notification %r on rank %d (a stock prefill would crash): %s", msg, tp_rank, exc
            )
            return
        now = time.perf_counter()
        if isinstance(parsed, wire.HeartbeatNotif):
            self.stats.heartbeats += 1
            for rid in parsed.request_ids:
                req = self.active.get(rid)
                if req is None or req.done[tp_rank] is not None:
                    self.stats.heartbeat_unknown_ids += 1
                    continue
                req.heartbeats += 1
                req.deadlines[tp_rank] = max(req.deadlines[tp_rank], now + lease_extension(req.lease_s))
            return
        rid = parsed.request_id
        req = self.active.get(rid)
        if req is None or req.done[tp_rank] is not None:
            self.stats.late_notifications += 1
            old = req or self.finished.get(rid)
            if old is not None:
                old.late_notifications += 1
            log.error(
                "Potentially invalid KV blocks for unrecognized request %s were retrieved (rank %d)",
                rid,
                tp_rank,
            )
            return
        self.stats.notifications += 1
        if req.expected[tp_rank] and req.expected[tp_rank] != parsed.n:
            self.stats.inconsistent_n += 1
        req.expected[tp_rank] = parsed.n
        req.counts[tp_rank] += 1
        if req.counts[tp_rank] == parsed.n:
            req.done[tp_rank] = "notif"
            self._maybe_finish(req)

    def _reap_leases(self) -> None:
        now = time.perf_counter()
        for req in list(self.active.values()):
            for r, deadline in enumerate(req.deadlines):
                if req.done[r] is None and now >= deadline:
                    log.warning("Releasing expired KV blocks for request %s (rank %d)", req.request_id, r)
                    req.done[r] = "expired"
            self._maybe_finish(req)

    def _maybe_finish(self, req: _Request) -> None:
        if any(d is None for d in req.done) or req.request_id not in self.active:
            return
        del self.active[req.request_id]
        if "expired" in req.done:
            self._reuse(req.kblocks)
            self.stats.blocks_reused += len(req.kblocks)
            self.stats.requests_expired += 1
            req.state = "expired_and_reused"
        else:
            self.stats.requests_freed_by_notif += 1
            req.state = "freed_by_notif"
        self.free.update(req.logical)
        if self._churn is not None:
            self._churn.give(req.logical)
        self.finished[req.request_id] = req
        while len(self.finished) > MAX_FINISHED_KEPT:
            self.finished.popitem(last=False)

    # --- control ---

    def _serve_control(self) -> None:
        while True:
            try:
                raw = self.control.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = self._handle(REQUEST_DECODER.decode(raw))
            except msgspec.MsgspecError as exc:
                reply = ErrorReply("control", str(exc))
            self.control.send(ENCODER.encode(reply))

    def _handle(self, req: Any) -> ControlReply:
        if isinstance(req, NewRequest):
            return self._new_request(req)
        if isinstance(req, RequestStatus):
            return self._status(req.request_id)
        if isinstance(req, Stats):
            self.stats.free_blocks = len(self.free)
            return self.stats
        if isinstance(req, Shutdown):
            self.stopping = True
            return Ack()
        return ErrorReply("control", f"unhandled {type(req).__name__}")

    def _churn_queue(self) -> block_orders.FreeQueue:
        """vLLM's free queue after churn, over the blocks free now (all, when the first churn request comes
        before any other: the emulator is used for one order at a time)."""
        if self._churn is None:
            queue = block_orders.churned(self.cfg.num_blocks, random.Random(self.cfg.seed))
            self._churn = block_orders.FreeQueue(0)
            self._churn.give(reversed([b for b in queue.peek(len(queue)) if b in self.free]))
        return self._churn

    def _new_request(self, req: NewRequest) -> ControlReply:
        logical_bs = self.cfg.block_size * self.cfg.blocks_per_logical
        if (req.num_tokens is None) == (req.num_blocks is None):
            return ErrorReply("num_tokens", "give exactly one of num_tokens, num_blocks")
        num_tokens = req.num_tokens if req.num_tokens is not None else req.num_blocks * logical_bs
        if num_tokens < 1:
            return ErrorReply("num_tokens", f"must be >= 1, got {num_tokens}")
        if req.lease_s is not None and not req.lease_s > 0:
            return ErrorReply("lease_s", f"must be positive, got {req.lease_s}")
        if req.external_id is not None and not req.external_id:
            return ErrorReply("external_id", "must be non-empty")
        nblocks = math.ceil(num_tokens / logical_bs)
        if nblocks > len(self.free):
            return ErrorReply("num_blocks", f"{nblocks} blocks needed, {len(self.free)} free")
        if not 0 < req.density <= 1:
            return ErrorReply("density", f"must be in (0, 1], got {req.density}")
        pool = sorted(self.free)
        if req.order == "churn":
            logical = self._churn_queue().take(nblocks)
        elif req.density < 1:
            logical = block_orders.spread(pool, nblocks, req.density, self.rng)
        elif req.order == "contiguous":
            logical = pool[:nblocks]  # lowest free ids in order, as a fresh vLLM free queue hands them out
        else:
            logical = self.rng.sample(pool, nblocks)
            if req.order == "ascending":
                logical.sort()
        self.free.difference_update(logical)
        if self._churn is not None and req.order != "churn":
            self._churn.remove(logical)
        kblocks = kernel_blocks(logical, self.cfg.blocks_per_logical)
        if not self.cfg.keep_bytes:
            self._reuse(kblocks)  # a new prefill overwrites whatever the blocks held
        external = req.external_id or f"cmpl-{uuid.uuid4().hex[:16]}-0"
        request_id = f"{external}-{uuid.uuid4().hex[:8]}"
        lease = req.lease_s if req.lease_s is not None else self.cfg.lease_s
        self.active[request_id] = _Request(
            request_id, logical, kblocks, self.cfg.tp, time.perf_counter() + lease, lease
        )
        self.stats.requests_created += 1
        params = wire.KVTransferParams(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_block_ids=[logical],
            remote_engine_id=self.engine_id,
            remote_request_id=request_id,
            remote_host=self.cfg.host,
            remote_port=self.port,
            tp_size=self.cfg.tp,
            dcp_size=1,
            pp_size=1,
            remote_num_tokens=num_tokens,
            remote_blocks_expiry_time=None,
            remote_registration_generation=1,
            transfer_mode="pull",
            remote_prefill_cached_tokens=0,
        )
        return NewRequestReply(
            kv_transfer_params=wire.kv_transfer_params_to_dict(params, self.cfg.connector_version),
            kernel_block_ids=kblocks,
            block_generations=[int(g) for g in self.generation[np.asarray(kblocks, dtype=np.int64)]],
            num_tokens=num_tokens,
        )

    def _status(self, request_id: str) -> ControlReply:
        req = self.active.get(request_id) or self.finished.get(request_id)
        if req is None:
            return ErrorReply("request_id", f"unknown request {request_id!r}")
        now = time.perf_counter()
        return RequestStatusReply(
            request_id=request_id,
            state=req.state,
            notif_counts=list(req.counts),
            expected_n=list(req.expected),
            ranks_done=[d is not None for d in req.done],
            heartbeats=req.heartbeats,
            late_notifications=req.late_notifications,
            lease_deadlines_s=[d - now for d in req.deadlines],
        )

    # --- loop ---

    def ready_info(self) -> ReadyInfo:
        return ReadyInfo(
            event="ready",
            pid=os.getpid(),
            side_channel_host=self.cfg.host,
            side_channel_port=self.port,
            control=self.control_address,
            engine_id=self.engine_id,
            connector_version=self.cfg.connector_version,
            tp_size=self.cfg.tp,
            compatibility_hash=self.compat_hash,
            compat_factors=self.compat_factors,
        )

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.control, zmq.POLLIN)
        while not self.stopping:
            events = dict(poller.poll(POLL_MS))
            if self.router in events:
                self._serve_handshakes()
            if self.control in events:
                self._serve_control()
            self._poll_notifs()
            self._reap_leases()

    def close(self) -> None:
        self.router.close(linger=0)
        self.control.close(linger=0)
        self.ctx.term()
        for rank in self.ranks:
            rank.close()
        if self._ipc_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._ipc_path)


# --- CLI ---


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kv-sidecar emulate-prefill``."""
    d = EmulatorConfig()
    a = parser.add_argument
    a("--host", default=d.host, help="side-channel bind host, also sent as remote_host (default %(default)s)")
    a("--port", type=int, default=d.port, help="side-channel port; 0 picks a free one (announced on stdout)")
    a(
        "--control",
        default="",
        help="control endpoint (ipc://PATH or tcp://127.0.0.1:PORT, :0 = free); default ipc in tmp",
    )
    a("--ready-file", default="", help="also write the ready JSON line to this file (atomically)")
    a("--connector-version", type=int, choices=wire.CONNECTOR_VERSIONS, default=d.connector_version)
    a("--layers", type=int, default=d.layers)
    a("--heads", type=int, default=d.heads, help="KV heads per TP rank")
    a("--head-size", type=int, default=d.head_size)
    a("--block-size", type=int, default=d.block_size, help="kernel block size in tokens")
    a(
        "--num-blocks",
        type=int,
        default=d.num_blocks,
        help="logical (manager) blocks, block 0 never handed out",
    )
    a("--blocks-per-logical", type=int, default=d.blocks_per_logical, help="kernel blocks per logical block")
    a("--dtype", choices=sorted(DTYPE_BYTES), default=d.dtype)
    a("--tp", type=int, default=d.tp, help="prefill TP ranks (one NIXL agent each)")
    a("--lease", type=float, default=d.lease_s, help="kv_lease_duration in seconds (vLLM default 30)")
    a("--seed", type=int, default=d.seed, help="seed of the page contents and block choice")
    a("--engine-id", default="", help="default: a fresh uuid4, like vLLM")
    a("--model", default=d.model, help="model string hashed into the compatibility hash")
    a(
        "--attn-backend",
        default=d.attn_backend,
        help="attn_backend_name advertised (FLASH_ATTN, CPU_ATTN, ...)",
    )
    a("--hma", action="store_true", help="is_hma_enabled in the compatibility hash")
    a(
        "--no-progress-thread",
        dest="progress_thread",
        action="store_false",
        help="drive NIXL progress from the 5 ms loop, not vLLM's spinning progress thread (saves ~0.5 core)",
    )
    a(
        "--device",
        default=d.device,
        help="where the KV pages live: cpu (DRAM) or cuda:N (VRAM, registered as VRAM, like a GPU prefill)",
    )
    a(
        "--keep-bytes",
        action="store_true",
        help="new requests keep the blocks' bytes and generation (no rewrite): many pulls of the same pages",
    )
    a("--log-level", default="WARNING")


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    return EmulatorConfig(
        host=args.host,
        port=args.port,
        control=args.control,
        ready_file=args.ready_file,
        connector_version=args.connector_version,
        layers=args.layers,
        heads=args.heads,
        head_size=args.head_size,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        blocks_per_logical=args.blocks_per_logical,
        dtype=args.dtype,
        tp=args.tp,
        lease_s=args.lease,
        seed=args.seed,
        engine_id=args.engine_id,
        model=args.model,
        attn_backend=args.attn_backend,
        hma=args.hma,
        progress_thread=args.progress_thread,
        device=args.device,
        keep_bytes=args.keep_bytes,
    )


def _private_stdout() -> int:
    """Keep the real stdout for the ready line only; all else (NIXL/UCX logs, prints) goes to stderr."""
    sys.stdout.flush()
    fd = os.dup(1)
    os.dup2(2, 1)
    return fd


def _announce(info: ReadyInfo, ready_file: str, stdout_fd: int) -> None:
    line = msgspec.json.encode(info) + b"\n"
    if ready_file:
        tmp = f"{ready_file}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(line)
        os.replace(tmp, ready_file)
    os.write(stdout_fd, line)


def run(args: argparse.Namespace) -> int:
    """Run the emulator until shutdown (control message, SIGTERM or SIGINT); returns the exit code."""
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(json.dumps({"event": "error", "reason": str(exc)}), file=sys.stderr)
        return 2
    stdout_fd = _private_stdout()
    emu = PrefillEmulator(cfg)

    def _stop(signum: int, _frame: object) -> None:
        emu.stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    # As vLLM and the daemon do after start-up: the import-time objects (torch comes with NIXL) are never
    # scanned again, which also cuts the exit's final collection from ~0.6 s to ~0.15 s of CPU.
    gc.collect()
    gc.freeze()
    try:
        _announce(emu.ready_info(), cfg.ready_file, stdout_fd)
        emu.serve()
    finally:
        emu.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kv-sidecar emulate-prefill", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
