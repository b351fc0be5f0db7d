"""``kv-sidecar bench pull``: our NIXL pull against bare NIXL reads of the same bytes, same two processes.

Three parts, one run:

1. Descriptor build: the per-request numpy work (``PairGeometry.indices`` for direct reads, ``staged_descs``
   for staged ones) for a model's layers × one request's blocks (default 36 × 256, Qwen3-8B at 4k tokens).
2. NIXL's one-time preparation of the remote and local descriptor lists (per remote, not per request).
3. Throughput of each pull mode, measured interleaved between this process and one target process (a bare
   NIXL agent standing in for the prefill): ``ours`` (``NixlTransfer.pull``: descriptors built per request,
   posted, polled, notification sent), ``bare`` (NIXL called directly with the very same descriptors and
   the same polling), and ``single`` (one descriptor covering the same number of bytes). Reported as
   ``ours/bare`` (our overhead; must be ≥ 0.9) and ``ours/single`` (what splitting into pages costs).
   Releasing the transfer handles is timed apart for ours and bare (``release_median_s``): both do it after
   the data has landed, and the daemon does it after it has answered Done.

CPU (DRAM, default, modest sizes) or GPU (``--device cuda``: VRAM on both sides; sets
``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`` for both processes unless already set). Writes one JSON file.

Size: three measured parts in one run (ours, bare, index build) and their two processes.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import json
import os
import platform
import random
import selectors
import shlex
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from sidecar.bench import block_orders
from sidecar.nixl.geometry import LocalRegions, PairGeometry, RemoteRegions, StagingPool, contiguous_slots
from sidecar.nixl.runs import layer_group_bounds
from sidecar.wire.formats import AITER_SHUFFLED, STANDARD, PageFormat, Plan, negotiate

INDEX_BUDGET_S = 1e-3  # must show: 36 x 256 indices in <= 1 ms on the CPU machine
OVERHEAD_FLOOR = 0.9  # must show: ours >= 0.9 x a bare NIXL read of the same descriptors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--device", choices=["cpu", "cuda"], default="cpu", help="where both sides' KV memory lives")
    a("--gpu", type=int, default=0, help="GPU index for --device cuda (both processes)")
    a("--layers", type=int, default=36)
    a("--heads", type=int, default=8, help="KV heads per rank")
    a("--head-size", type=int, default=128)
    a("--block-size", type=int, default=16)
    a("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    a("--blocks", type=int, default=0, help="blocks per request read (default: 64 on cpu, 256 on cuda)")
    a("--remote-blocks", type=int, default=0, help="blocks per layer at the prefill (default: 2 x --blocks)")
    a(
        "--order",
        default="random",
        help="remote block ids: random (scattered), ascending (sorted, runs merge in staged mode), churn "
        "(vLLM's free queue after a busy engine's churn) or density-F (ascending, filling F of their span)",
    )
    a("--layer-groups", type=int, default=1, help="READs per request (one per layer group)")
    a("--modes", default="direct,staged", help="comma-separated pull modes to time")
    a("--reps", type=int, default=0, help="timed reads per variant (default: 7 on cpu, 20 on cuda)")
    a("--warmup", type=int, default=2)
    a(
        "--poll-sleep-us",
        type=float,
        default=50.0,
        help="sleep between completion polls (same for all variants)",
    )
    a("--index-layers", type=int, default=36)
    a("--index-blocks", type=int, default=256)
    a("--index-remote-blocks", type=int, default=4096, help="blocks per layer of the index-build geometry")
    a("--index-reps", type=int, default=2000)
    a("--skip-throughput", action="store_true", help="only the descriptor-build part (no NIXL)")
    a("--seed", type=int, default=0)
    a(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default: bench/results/pull-<device>-<date>.json if bench/results exists, else .)",
    )
    a("--check", action="store_true", help="exit 1 unless the must-show numbers hold")


# -- shapes ----------------------------------------------------------------------------------------


def _formats(args: argparse.Namespace) -> tuple[PageFormat, PageFormat, Plan]:
    kw = dict(dtype=args.dtype, num_heads=args.heads, block_size=args.block_size, head_size=args.head_size)
    std = PageFormat(kind=STANDARD, layout="LBHNC", **kw)
    shuf = PageFormat(kind=AITER_SHUFFLED, layout="LHBNC", **kw)
    plan = negotiate(std, shuf)
    if not isinstance(plan, Plan):
        raise SystemExit(f"the shape is out of scope: {plan}")
    return std, shuf, plan


def _meta(
    bases: list[int],
    page: int,
    num_blocks: int,
    block_size: int,
    device_id: int,
    mem: str,
    agent_metadata: bytes = b"x",
) -> Any:
    from sidecar.wire import prefill as wire

    n = len(bases)
    return wire.NixlAgentMetadata(
        engine_id="bench-target",
        agent_metadata=agent_metadata,
        kv_caches_base_addr=bases,
        device_id=device_id,
        num_blocks=num_blocks,
        block_lens=[page] * n,
        block_strides=[page] * n,
        kv_cache_layout="LBHNC",
        block_size=block_size,
        ssm_sizes=(0, 0),
        attn_backend_name="FLASH_ATTN",
        physical_blocks_per_logical_kv_block=1,
        region_num_blocks=[num_blocks] * n,
        region_group_ids=[0] * n,
        region_names=[f"model.layers.{i}.self_attn.attn" for i in range(n)],
        region_mem_types=[mem] * n,
    )


def _stats(seconds: list[float]) -> dict[str, float]:
    s = sorted(seconds)
    return {
        "median_us": statistics.median(s) * 1e6,
        "p99_us": s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6,
        "min_us": s[0] * 1e6,
        "mean_us": statistics.fmean(s) * 1e6,
    }


def _block_ids(rng: np.random.Generator, n: int, pool: int, order: str) -> list[int]:
    if order == "churn":
        seed = int(rng.integers(1 << 31))
        return block_orders.churned(pool, random.Random(seed)).take(n)
    if order.startswith("density-"):
        density = float(order.removeprefix("density-"))
        return block_orders.spread(range(pool), n, density, random.Random(int(rng.integers(1 << 31))))
    if order not in ("random", "ascending"):
        raise ValueError(f"--order {order!r}: random, ascending, churn or density-F")
    ids = rng.choice(pool, n, replace=False)
    return sorted(int(i) for i in ids) if order == "ascending" else [int(i) for i in ids]


# -- part 1: descriptor build (pure) ---------------------------------------------------------------


def bench_index(args: argparse.Namespace) -> dict[str, Any]:
    """Per-request descriptor work for index_layers x index_blocks, on fake addresses (no NIXL)."""
    std, _shuf, plan = _formats(args)
    layers, nb, n = args.index_layers, args.index_remote_blocks, args.index_blocks
    page, half = std.page_bytes, std.page_bytes // 2
    remote = RemoteRegions.from_metadata(
        _meta([(1 << 32) + i * nb * page for i in range(layers)], page, nb, args.block_size, 0, "VRAM")
    )
    lbase = 1 << 40
    local = LocalRegions.planes(
        [lbase + 2 * i * nb * half for i in range(layers)],
        [lbase + (2 * i + 1) * nb * half for i in range(layers)],
        half,
        nb,
        mem_type="VRAM",
    )
    rng = np.random.default_rng(args.seed)
    remote_ids = _block_ids(rng, n, nb, "random")
    local_ids = _block_ids(rng, n, nb, "random")
    direct = PairGeometry(plan, remote, local, "direct")
    pool = StagingPool(lbase * 2, page, layers * n)
    staged = PairGeometry(plan, remote, local, "staged", pool=pool)
    slots = contiguous_slots(0, layers, n)
    out: dict[str, Any] = {"layers": layers, "blocks": n, "remote_blocks": nb, "reps": args.index_reps}

    def timed(fn) -> dict[str, float]:
        for _ in range(20):
            fn()
        ts = []
        for _ in range(args.index_reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return _stats(ts)

    idx = direct.indices(local_ids, remote_ids)
    out["direct_indices"] = {**timed(lambda: direct.indices(local_ids, remote_ids)), "descriptors": idx.count}
    sd = staged.staged_descs(remote_ids, slots, local_block_ids=local_ids)
    out["staged_descs_scattered"] = {
        **timed(lambda: staged.staged_descs(remote_ids, slots, local_block_ids=local_ids)),
        "descriptors": sd.count,
    }
    asc = sorted(remote_ids)
    sa = staged.staged_descs(asc, slots, local_block_ids=local_ids)
    out["staged_descs_ascending"] = {
        **timed(lambda: staged.staged_descs(asc, slots, local_block_ids=local_ids)),
        "descriptors": sa.count,
    }
    t0 = time.perf_counter()
    table = direct.remote_table()
    out["remote_table_build_us"] = (time.perf_counter() - t0) * 1e6
    out["remote_table_descriptors"] = int(table[:, 4].sum())
    out["within_budget"] = out["direct_indices"]["median_us"] <= INDEX_BUDGET_S * 1e6
    return out


# -- the target process ----------------------------------------------------------------------------


def _alloc(nbytes: int, device: str, gpu: int) -> tuple[Any, int, str, int]:
    """(keep-alive object, address, NIXL memory type, device id) of a zeroed buffer of ``nbytes``."""
    if device == "cuda":
        import torch

        t = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{gpu}")
        return t, t.data_ptr(), "VRAM", gpu
    raw = np.zeros(nbytes + 4096, np.uint8)
    start = (-raw.ctypes.data) % 4096
    view = raw[start : start + nbytes]
    return (raw, view), view.ctypes.data, "DRAM", 0


def _pattern(offset: int, size: int) -> np.ndarray:
    """Byte ``i`` of the target is ``i * 7 % 251``: it differs per page offset, so a misplaced read shows."""
    return ((np.arange(offset, offset + size, dtype=np.int64) * 7) % 251).astype(np.uint8)


def _fill(obj: Any, device: str) -> None:
    size = obj.numel() if device == "cuda" else obj[1].size
    period = _pattern(0, 251)
    tiled = np.tile(period, -(-size // 251))[:size]  # one uint8 copy, no int64 temporaries
    if device == "cuda":
        import torch

        obj.copy_(torch.from_numpy(tiled))
    else:
        obj[1][:] = tiled


def _target_main(argv: list[str]) -> int:
    """The stand-in prefill: one registered allocation of standard pages, one NIXL agent (progress thread on).
    Prints one JSON line (its metadata), drains notifications, exits when stdin closes."""
    p = argparse.ArgumentParser()
    for name in ("layers", "blocks", "page", "block-size", "gpu"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--device", required=True)
    a = p.parse_args(argv)
    from nixl._api import nixl_agent, nixl_agent_config

    from sidecar.wire import prefill as wire

    size = a.layers * a.blocks * a.page
    keep, base, mem, dev = _alloc(size, a.device, a.gpu)
    _fill(keep, a.device)
    agent = nixl_agent(f"bench-target-{uuid.uuid4().hex}", nixl_agent_config(backends=["UCX"]))
    agent.register_memory([(base, size, dev, "")], mem)
    meta = _meta(
        [base + i * a.blocks * a.page for i in range(a.layers)],
        a.page,
        a.blocks,
        a.block_size,
        dev,
        mem,
        agent.get_agent_metadata(),
    )
    sys.stdout.write(
        json.dumps({"metadata": base64.b64encode(wire.encode_agent_metadata(meta)).decode()}) + "\n"
    )
    sys.stdout.flush()
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin, selectors.EVENT_READ)
    while True:
        if sel.select(0.05) and not os.read(sys.stdin.fileno(), 4096):
            return 0
        agent.get_new_notifs()


class _Target:
    """The target subprocess and its decoded metadata."""

    def __init__(self, args: argparse.Namespace, page: int, remote_blocks: int, env: dict[str, str]) -> None:
        from sidecar.wire import prefill as wire

        cmd = [
            sys.executable,
            "-m",
            "sidecar.bench.pull",
            "_target",
            "--layers",
            str(args.layers),
            "--blocks",
            str(remote_blocks),
            "--page",
            str(page),
            "--block-size",
            str(args.block_size),
            "--gpu",
            str(args.gpu),
            "--device",
            args.device,
        ]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        line = self._readline(timeout_s=120.0)
        self.meta = wire.decode_agent_metadata(base64.b64decode(json.loads(line)["metadata"]))

    def _readline(self, timeout_s: float) -> bytes:
        """The target's JSON line; UCX may log to the same stdout first, so other lines are skipped."""
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        buf, deadline = b"", time.monotonic() + timeout_s
        try:
            while True:
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if line.startswith(b"{"):
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise RuntimeError("bench target not ready in time")
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    raise RuntimeError(f"bench target exited (rc={self.proc.wait()})")
                buf += chunk
        finally:
            sel.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# -- part 2 + 3: NIXL ------------------------------------------------------------------------------


def _wait_handles(agent: Any, handles: list[Any], sleep_s: float) -> None:
    """The bare loop: poll every handle until all are DONE, with the same sleep as ``NixlTransfer.wait``."""
    pending = list(handles)
    while pending:
        pending = [h for h in pending if agent.check_xfer_state(h) != "DONE"]
        if pending:
            time.sleep(sleep_s)


def bench_throughput(args: argparse.Namespace) -> dict[str, Any]:
    from sidecar.nixl.admission import AdmissionRules, admit_remote
    from sidecar.nixl.agent import NixlTransfer, TransferSettings

    std, shuf, _ = _formats(args)
    page, half, layers = std.page_bytes, std.page_bytes // 2, args.layers
    n = args.blocks or (256 if args.device == "cuda" else 64)
    remote_blocks = args.remote_blocks or 2 * n
    reps = args.reps or (20 if args.device == "cuda" else 7)
    modes = [m for m in args.modes.split(",") if m]
    sleep_s = args.poll_sleep_us * 1e-6
    env = dict(os.environ)
    if args.device == "cuda":
        env.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
        os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
    # both processes on this host: loopback for UCX's tcp lanes unless the caller chose a device
    for key, value in (("NIXL_LOG_LEVEL", "WARN"), ("UCX_NET_DEVICES", "lo")):
        env.setdefault(key, value)
        os.environ.setdefault(key, value)

    target = _Target(args, page, remote_blocks, env)
    tx = None
    try:
        from sidecar.nixl.admission import RemoteFormatRule

        settings = TransferSettings(cuda_device=args.gpu if args.device == "cuda" else None)
        rules = AdmissionRules(remote_formats=(RemoteFormatRule(address="*:*", format=std),))
        t0 = time.perf_counter()
        tx = NixlTransfer(settings)
        agent_s = time.perf_counter() - t0
        plan, regions = admit_remote(
            target.meta,
            address="bench:0",
            local_format=shuf,
            layers=layers,
            rules=rules,
            remote_mem_type="VRAM" if args.device == "cuda" else "DRAM",
            check_identity=False,
        )
        peer = tx.add_peer(
            engine_id=target.meta.engine_id,
            tp_rank=0,
            generation=1,
            address="bench:0",
            agent_metadata=target.meta.agent_metadata,
            plan=plan,
            regions=regions,
        )
        # local planes: per layer a K plane then a V plane of n blocks each (exactly the request's size)
        planes_obj, pbase, mem, dev = _alloc(layers * n * page, args.device, args.gpu)
        pool_obj, qbase, _, _ = _alloc(layers * n * page, args.device, args.gpu)
        reg = tx.register([(pbase, layers * n * page, dev), (qbase, layers * n * page, dev)], mem)
        lregions = LocalRegions.planes(
            [pbase + 2 * i * n * half for i in range(layers)],
            [pbase + (2 * i + 1) * n * half for i in range(layers)],
            half,
            n,
            device_id=dev,
            mem_type=mem,
        )
        dest = tx.destination(reg, lregions)
        pool = tx.staging(reg, StagingPool(qbase, page, layers * n, device_id=dev, mem_type=mem))
        slots = contiguous_slots(0, layers, n)

        t0 = time.perf_counter()
        tx.prepare(peer, dest, "direct")
        prep = {
            "local_and_remote_direct_s": time.perf_counter() - t0,
            "remote_direct_s": peer.prep_seconds["direct"],
            "remote_direct_descriptors": 2 * layers * remote_blocks,
            "local_descriptors": 2 * layers * n,
        }
        prep["remote_us_per_descriptor"] = prep["remote_direct_s"] / prep["remote_direct_descriptors"] * 1e6

        rng = np.random.default_rng(args.seed)
        local_ids = list(range(n))
        total = layers * n * page
        single_l = np.array([[pbase, total, dev]], np.uint64)
        single_r = np.array([[int(regions.base[0]), total, regions.device_id]], np.uint64)
        agent = tx.agent
        results: dict[str, Any] = {}
        counter = [0]

        def rid() -> str:
            counter[0] += 1
            return f"bench-{counter[0]}"

        def verify(mode, remote_ids) -> None:
            """One byte check per mode on the CPU: the pages read are the target's (pattern i*7 % 251)."""
            tx.wait(
                tx.pull(
                    peer,
                    dest,
                    mode,
                    local_ids,
                    remote_ids,
                    "bench-verify",
                    pool=pool if mode == "staged" else None,
                    slots=slots if mode == "staged" else None,
                )
            )
            half = page // 2
            for layer in (0, layers - 1):
                for i in (0, n - 1):
                    off = (layer * remote_blocks + remote_ids[i]) * page
                    want = _pattern(off, page)
                    if mode == "staged":
                        got = pool_obj[1][slots[layer, i] * page : (slots[layer, i] + 1) * page]
                    else:
                        planes = planes_obj[1]
                        k = planes[(2 * layer * n + i) * half : (2 * layer * n + i + 1) * half]
                        v = planes[((2 * layer + 1) * n + i) * half : ((2 * layer + 1) * n + i + 1) * half]
                        got = np.concatenate([k, v])
                    if not np.array_equal(got, want):
                        raise RuntimeError(
                            f"{mode}: layer {layer} block {i} does not hold the target's bytes"
                        )

        # handle release, timed apart from the reads (both variants do it after the data has landed)
        release_s: dict[str, dict[str, list[float]]] = {m: {"ours": [], "bare": []} for m in modes}
        for mode in modes:
            geo = tx.geometry(peer, dest, mode, pool if mode == "staged" else None)

            def ours(remote_ids, mode=mode):
                t = time.perf_counter()
                pull = tx.pull(
                    peer,
                    dest,
                    mode,
                    local_ids,
                    remote_ids,
                    rid(),
                    layer_groups=args.layer_groups,
                    pool=pool if mode == "staged" else None,
                    slots=slots if mode == "staged" else None,
                )
                tx.wait(pull, sleep_s=sleep_s, release=False)  # the daemon releases after its Done
                dt_ = time.perf_counter() - t
                t = time.perf_counter()
                tx.release(pull)
                release_s[mode]["ours"].append(time.perf_counter() - t)
                return dt_, pull.descriptors

            def bare(remote_ids, mode=mode, geo=geo):
                # the very same descriptors (built outside the timing), NIXL called directly
                bounds = layer_group_bounds(layers, args.layer_groups)
                if mode == "staged":
                    d = geo.staged_descs(remote_ids, slots, local_block_ids=local_ids)
                    parts = [d.layer_slice(a, b) for a, b in bounds]
                    t = time.perf_counter()
                    handles = []
                    for loc, rem in parts:
                        ld, rd = agent.get_xfer_descs(loc, mem), agent.get_xfer_descs(rem, regions.mem_type)
                        h = agent.initialize_xfer("READ", ld, rd, peer.agent_name)
                        agent.transfer(h)
                        handles.append(h)
                else:
                    idx = geo.indices(local_ids, remote_ids)
                    lh, rh = tx.prepare(peer, dest, mode)
                    parts = [idx.layer_slice(a, b) for a, b in bounds]
                    t = time.perf_counter()
                    handles = []
                    for li, ri in parts:
                        h = agent.make_prepped_xfer("READ", lh, li, rh, ri)
                        agent.transfer(h)
                        handles.append(h)
                _wait_handles(agent, handles, sleep_s)
                dt_ = time.perf_counter() - t
                t = time.perf_counter()
                for h in handles:
                    agent.release_xfer_handle(h)
                release_s[mode]["bare"].append(time.perf_counter() - t)
                return dt_, sum(len(p[0]) for p in parts)

            def single(_remote_ids):
                ld, rd = agent.get_xfer_descs(single_l, mem), agent.get_xfer_descs(single_r, regions.mem_type)
                t = time.perf_counter()
                h = agent.initialize_xfer("READ", ld, rd, peer.agent_name)
                agent.transfer(h)
                _wait_handles(agent, [h], sleep_s)
                dt_ = time.perf_counter() - t
                agent.release_xfer_handle(h)
                return dt_, 1

            variants = {"ours": ours, "bare": bare, "single": single}
            times: dict[str, list[float]] = {k: [] for k in variants}
            descs: dict[str, int] = {}
            for rep in range(args.warmup + reps):
                remote_ids = _block_ids(rng, n, remote_blocks, args.order)
                order = list(variants)
                order = order[rep % 3 :] + order[: rep % 3]  # rotate, so no variant always runs first
                for name in order:
                    seconds, count = variants[name](remote_ids)
                    if rep >= args.warmup:
                        times[name].append(seconds)
                        descs[name] = count
                if rep == 0 and args.device == "cpu":
                    verify(mode, remote_ids)
            gbps = {k: total / statistics.median(v) / 1e9 for k, v in times.items()}
            results[mode] = {
                "bytes": total,
                "descriptors": descs,
                "median_s": {k: statistics.median(v) for k, v in times.items()},
                "GBps": gbps,
                "ours_over_bare": gbps["ours"] / gbps["bare"],
                "ours_over_single": gbps["ours"] / gbps["single"],
                "release_median_s": {
                    k: statistics.median(v[args.warmup :]) for k, v in release_s[mode].items() if v
                },
            }
        return {
            "agent_create_s": agent_s,
            "prep": prep,
            "throughput": results,
            "shape": {
                "layers": layers,
                "blocks": n,
                "remote_blocks": remote_blocks,
                "page_bytes": page,
                "order": args.order,
                "layer_groups": args.layer_groups,
                "reps": reps,
                "warmup": args.warmup,
                "poll_sleep_us": args.poll_sleep_us,
            },
        }
    finally:
        if tx is not None:
            tx.close()
        target.close()


# -- report ----------------------------------------------------------------------------------------


def _device_name(args: argparse.Namespace) -> str:
    if args.device == "cuda":
        import torch

        return torch.cuda.get_device_name(args.gpu)
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return f"CPU {model or platform.processor()} x{os.cpu_count()}"


def _command_line() -> str:
    prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    if prog == "kv-sidecar":
        return shlex.join(["kv-sidecar", *sys.argv[1:]])
    if prog == "pull.py":
        return shlex.join(["python", "-m", "sidecar.bench.pull", *sys.argv[1:]])
    return shlex.join(sys.argv)


def must_show(result: dict[str, Any]) -> list[str]:
    fails = []
    idx = result["index_build"]["direct_indices"]["median_us"]
    if result["device"].startswith("CPU") and idx > INDEX_BUDGET_S * 1e6:
        fails.append(f"direct indices built in {idx:.0f} us > {INDEX_BUDGET_S * 1e6:.0f} us")
    for mode, r in result.get("throughput", {}).items():
        if r["ours_over_bare"] < OVERHEAD_FLOOR:
            fails.append(f"{mode}: ours/bare {r['ours_over_bare']:.3f} < {OVERHEAD_FLOOR}")
    return fails


def run(args: argparse.Namespace) -> int:
    now = dt.datetime.now(dt.UTC)
    result: dict[str, Any] = {
        "bench": "pull",
        "date": now.isoformat(timespec="seconds"),
        "device": _device_name(args),
        "command": _command_line(),
        "host": platform.node(),
        "python": platform.python_version(),
        "env": {k: os.environ[k] for k in sorted(os.environ) if k.startswith(("UCX_", "NIXL_"))},
    }
    result["index_build"] = bench_index(args)
    ib = result["index_build"]
    print(
        f"descriptor build, {ib['layers']} layers x {ib['blocks']} blocks: direct indices "
        f"{ib['direct_indices']['median_us']:.0f} us median (p99 {ib['direct_indices']['p99_us']:.0f} us, "
        f"{ib['direct_indices']['descriptors']} descriptors); staged runs "
        f"{ib['staged_descs_scattered']['median_us']:.0f} us scattered "
        f"({ib['staged_descs_scattered']['descriptors']} descs), "
        f"{ib['staged_descs_ascending']['median_us']:.0f} us ascending "
        f"({ib['staged_descs_ascending']['descriptors']} descs)"
    )
    if not args.skip_throughput:
        result.update(bench_throughput(args))
        p = result["prep"]
        print(
            f"NIXL one-time prep: remote {p['remote_direct_descriptors']} descriptors in "
            f"{p['remote_direct_s'] * 1e3:.2f} ms ({p['remote_us_per_descriptor']:.2f} us each); "
            f"agent creation {result['agent_create_s']:.2f} s"
        )
        for mode, r in result["throughput"].items():
            g = r["GBps"]
            print(
                f"{mode:>7}: ours {g['ours']:.2f} GB/s ({r['descriptors']['ours']} descs), "
                f"bare {g['bare']:.2f}, "
                f"single {g['single']:.2f} -> ours/bare {r['ours_over_bare']:.3f}, "
                f"ours/single {r['ours_over_single']:.3f}; handle release "
                + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in r["release_median_s"].items())
            )
    fails = must_show(result)
    result["must_show_failures"] = fails
    out = args.out
    if out is None:
        out_dir = Path("bench/results") if Path("bench/results").is_dir() else Path(".")
        out = out_dir / f"pull-{args.device}-{now.date()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    for f in fails:
        print(f"must-show not met: {f}")
    return 1 if (args.check and fails) else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_target"]:
        return _target_main(argv[1:])
    parser = argparse.ArgumentParser(prog="kv-sidecar bench pull", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
