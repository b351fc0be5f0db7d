"""The two baselines ``bench e2e`` compares kv-sidecar with: torch's peer copy of the same number of bytes
(the link's limit) and ``BareReader``, this process's own NIXL agent reading the daemon's very descriptors
with no daemon, no conversion and no notification."""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import TYPE_CHECKING, Any

from sidecar.bench.e2e_common import BenchError, parse_device
from sidecar.nixl.runs import layer_group_bounds
from sidecar.wire.formats import PageFormat

if TYPE_CHECKING:
    from sidecar.bench.e2e_roles import DeviceStandin


class BareReader:
    """This process's own NIXL agent reading the daemon's descriptors into the same planes: no daemon, no
    conversion, no notification. The prefill's blocks are only read, so the daemon reads them next."""

    def __init__(
        self,
        standin: DeviceStandin,
        ready: Any,
        remote_fmt: PageFormat,
        local_fmt: PageFormat,
        *,
        staging_bytes: int,
        layer_groups: int,
        sleep_s: float,
        gap_cost: Any = None,
        gap_share: float = 0.0,
    ) -> None:
        from sidecar.nixl.admission import AdmissionRules, RemoteFormatRule, admit_remote
        from sidecar.nixl.agent import NixlTransfer, TransferSettings
        from sidecar.nixl.geometry import LocalRegions, StagingPool
        from sidecar.wire import prefill as vllm_wire

        gpu = parse_device(standin.device)
        self.mem, dev = ("DRAM", 0) if gpu is None else ("VRAM", gpu)
        self.layers = standin.shape.layers
        self.layer_groups = layer_groups
        self.sleep_s = sleep_s
        self.descriptors = 0  # per request, of the last batch
        self.descriptors_request_order = 0  # per request: what request-order slots without gaps would post
        self.gap_bytes = 0  # of the last batch
        self.post_s = 0.0  # of the last batch: from the first post to the last transfer() returned
        self.gap_cost, self.gap_share = gap_cost, gap_share
        self.page_bytes = remote_fmt.page_bytes
        settings = TransferSettings(name_prefix="bench-bare", cuda_device=gpu)
        rules = AdmissionRules(remote_formats=(RemoteFormatRule(address="*:*", format=remote_fmt),))
        t0 = time.perf_counter()
        self.tx = NixlTransfer(settings)
        self.agent_s = time.perf_counter() - t0
        host, port = ready.side_channel_host, ready.side_channel_port
        reply = vllm_wire.fetch_handshake(
            host, port, [(0, 0)], timeout_s=30.0, expected_engine_id=ready.engine_id
        )
        meta = reply[(0, 0)].metadata
        plan, regions = admit_remote(
            meta,
            address=f"{host}:{port}",
            local_format=local_fmt,
            layers=self.layers,
            rules=rules,
            remote_mem_type=self.mem,
            check_identity=False,
        )
        self.peer = self.tx.add_peer(
            engine_id=meta.engine_id,
            tp_rank=0,
            generation=1,
            address=f"{host}:{port}",
            agent_metadata=meta.agent_metadata,
            plan=plan,
            regions=regions,
        )
        planes = standin.buffer.tensor
        ranges = [(planes.data_ptr(), planes.numel(), dev)]
        self.pool_tensor = None
        if staging_bytes:
            import torch

            self.pool_tensor = torch.empty(staging_bytes, dtype=torch.uint8, device=standin.device)
            ranges.append((self.pool_tensor.data_ptr(), staging_bytes, dev))
        reg = self.tx.register(ranges, self.mem)
        k, v = standin.plane_bases()
        shape = standin.shape
        regions_local = LocalRegions.planes(
            k, v, shape.fmt.plane_block_bytes, shape.num_blocks, device_id=dev, mem_type=self.mem
        )
        self.dest = self.tx.destination(reg, regions_local)
        self.pool = None
        if staging_bytes:
            slots = staging_bytes // remote_fmt.page_bytes
            self.pool = self.tx.staging(
                reg,
                StagingPool(
                    self.pool_tensor.data_ptr(),
                    remote_fmt.page_bytes,
                    slots,
                    device_id=dev,
                    mem_type=self.mem,
                ),
            )
        t0 = time.perf_counter()
        self.tx.prepare(self.peer, self.dest, "direct")
        self.prep_s = time.perf_counter() - t0

    def _bounds(self, request_bytes: int = 0) -> list[tuple[int, int]]:
        from sidecar.daemon.read_plan import layer_groups_for

        groups = layer_groups_for(self.layer_groups, request_bytes)
        return layer_group_bounds(self.layers, groups)

    def _wait(self, handles: list[Any], deadline: float) -> None:
        agent = self.tx.agent
        pending = list(handles)
        while pending:
            states = [agent.check_xfer_state(h) for h in pending]
            if "ERR" in states:
                raise BenchError("bare NIXL read: a transfer ended in ERR")
            pending = [h for h, s in zip(pending, states, strict=True) if s != "DONE"]
            if pending:
                if time.monotonic() > deadline:
                    raise BenchError(f"bare NIXL read: {len(pending)} transfer(s) not done in time")
                time.sleep(self.sleep_s)

    def _post(self, make: Any, handles: list[Any]) -> None:
        h = make()
        handles.append(h)
        if self.tx.agent.transfer(h) == "ERR":
            raise BenchError("bare NIXL read: transfer() returned ERR")

    def batch(self, mode: str, requests: list[tuple[list[int], list[int], int]], timeout_s: float) -> float:
        """Read every request at once (staged: in waves that fit the pool); seconds from the first post to the
        last completion. ``requests``: (local kernel ids, remote kernel ids, remote_num_tokens)."""
        from sidecar.nixl.geometry import contiguous_slots
        from sidecar.nixl.spans import GapRead, plan_span, span_slots

        agent, peer, deadline = self.tx.agent, self.peer, time.monotonic() + timeout_s
        handles: list[Any] = []
        self.gap_bytes = 0
        try:
            if mode == "direct":
                geo = self.tx.geometry(peer, self.dest, "direct")
                lh, rh = self.tx.prepare(peer, self.dest, "direct")
                parts = []
                for loc, rem, tokens in requests:
                    idx = geo.indices(loc, rem, tokens)
                    bounds = self._bounds(self.layers * len(loc) * self.page_bytes)
                    parts += [idx.layer_slice(a, b) for a, b in bounds]
                self.descriptors = sum(p[0].size for p in parts) // len(requests)
                self.descriptors_request_order = self.descriptors
                t0 = time.perf_counter()
                for li, ri in parts:
                    self._post(lambda li=li, ri=ri: agent.make_prepped_xfer("READ", lh, li, rh, ri), handles)
                self.post_s = time.perf_counter() - t0
                self._wait(handles, deadline)
                return time.perf_counter() - t0
            if self.pool is None:
                raise BenchError("staged bare reads need --staging-gb > 0")
            geo = self.tx.geometry(peer, self.dest, "staged", self.pool)
            waves: list[list[Any]] = [[]]
            used = before = 0
            slots_all = self.pool.num_slots
            for loc, rem, tokens in requests:
                need = self.layers * len(loc)
                if need > slots_all:
                    raise BenchError(f"one request needs {need} staging slots, the pool has {slots_all}")
                if used + need > slots_all:
                    waves.append([])
                    used = 0
                # the daemon's layout (Staging.take_span): remote order, gaps within the share of free slots
                rk = geo.blocks(loc, rem, tokens).remote
                budget = min(int(self.gap_share * slots_all), slots_all - used - need) // self.layers
                span = plan_span(rk, self.page_bytes, self.gap_cost, budget)
                gaps = None
                if span.gap_blocks:
                    gaps = GapRead(span.gap_ids, span_slots(used, self.layers, span.width, span.gap_pos))
                d = geo.staged_descs(
                    rem,
                    span_slots(used, self.layers, span.width, span.pos),
                    local_block_ids=loc,
                    remote_num_tokens=tokens,
                    gaps=gaps,
                )
                in_order = contiguous_slots(0, self.layers, len(loc))
                before += geo.staged_descs(rem, in_order, local_block_ids=loc, remote_num_tokens=tokens).count
                used += self.layers * span.width
                self.gap_bytes += self.layers * span.gap_blocks * self.page_bytes
                bounds = self._bounds(need * self.page_bytes)
                waves[-1] += [d.layer_slice(a, b) for a, b in bounds]
            self.descriptors = sum(p[0].shape[0] for w in waves for p in w) // len(requests)
            self.descriptors_request_order = before // len(requests)
            t0 = time.perf_counter()
            self.post_s = 0.0
            for wave in waves:
                w0 = time.perf_counter()
                wave_handles: list[Any] = []
                for loc_d, rem_d in wave:

                    def make(loc_d=loc_d, rem_d=rem_d) -> Any:
                        ld = agent.get_xfer_descs(loc_d, self.mem)
                        rd = agent.get_xfer_descs(rem_d, peer.regions.mem_type)
                        return agent.initialize_xfer("READ", ld, rd, peer.agent_name)

                    self._post(make, wave_handles)
                self.post_s += time.perf_counter() - w0  # waves: the posts only, not the waits between them
                handles += wave_handles
                self._wait(wave_handles, deadline)
            return time.perf_counter() - t0
        finally:
            for h in handles:
                with contextlib.suppress(Exception):
                    agent.release_xfer_handle(h)

    def close(self) -> None:
        self.tx.close()
        self.pool_tensor = None


def peer_copy(nbytes: int, src: str, dst: str, reps: int) -> dict[str, Any]:
    """Median time of torch copying ``nbytes`` from ``src`` to ``dst`` in one piece (bytes counted once)."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device=src).fill_(1)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst).fill_(0)

    def sync() -> None:
        for d in {src, dst}:
            if d != "cpu":
                torch.cuda.synchronize(d)

    sync()
    b.copy_(a)  # warm-up: peer mappings, pages touched
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        b.copy_(a)
        sync()
        times.append(time.perf_counter() - t0)
    if not bool((b[:: max(1, nbytes // 4096)] == 1).all()):
        raise BenchError("peer copy: the destination does not hold the source's bytes")
    del a, b
    if "cuda" in src or "cuda" in dst:
        torch.cuda.empty_cache()
    med = statistics.median(times)
    return {"bytes": nbytes, "median_s": med, "min_s": min(times), "GBps": nbytes / med / 1e9, "reps": reps}
