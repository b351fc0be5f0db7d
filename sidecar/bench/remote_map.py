"""``kv-sidecar bench map``: can this process map a stock prefill's KV pages, and how fast would a kernel
read them through the mapping?

The question behind a converting read (``docs/converting-read.md``): instead of a NIXL READ into staging
and a conversion pass after it, map the prefill's registered memory with UCX and let the conversion kernel
read the pages itself, moving each byte once. One run against one prefill emulator:

1. handshake as the daemon does and read the prefill agent's metadata (``sidecar.wire.nixl_metadata``);
2. open a UCP endpoint of our own to its worker (``sidecar.nixl.ucx``), unpack the key of the region that
   holds its pages, read a request's first and last pages with ``ucp_get_nbx`` and check their bytes;
3. ask UCX to map the region (``ucp_rkey_ptr``). Where it does (VRAM through cuda_ipc), check every page
   of the request through the mapping, then time side by side: a gather of the request's pages through
   the mapping (one SM kernel), the same gather from local memory, a device copy of the same bytes, and a
   bare NIXL READ of them (adjacent pages merged). Where it does not, say UCX's reason.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

from sidecar.bench.e2e_common import BenchError, parse_device
from sidecar.bench.output import emit
from sidecar.bench.timing import device_timer
from sidecar.wire.formats import STANDARD, PageFormat

ORDERS = ("contiguous", "random")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kv-sidecar bench map", description=__doc__.split("\n")[0])
    a = p.add_argument
    a(
        "--device",
        default="cuda:0",
        help="where this process (the daemon's role) maps and reads: cpu or cuda:N",
    )
    a("--prefill-device", default="cuda:0", help="where the prefill emulator's pages live: cpu or cuda:N")
    a("--layers", type=int, default=36)
    a("--heads", type=int, default=8, help="KV heads per rank")
    a("--head-size", type=int, default=128)
    a("--block-size", type=int, default=16)
    a("--dtype", default="bfloat16")
    a("--context", type=int, default=4096, help="prompt tokens of the request read")
    a("--orders", default="contiguous,random", help=f"block orders, comma-separated: {', '.join(ORDERS)}")
    a("--pool-factor", type=int, default=4, help="the prefill's KV pool as a multiple of the request")
    a("--reps", type=int, default=10, help="timed repetitions of each read")
    a("--seed", type=int, default=0)
    a("--out", default=None, help="JSON path (default: print only)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    result["command"] = "kv-sidecar bench map " + shlex.join(sys.argv[1:] if argv is None else argv)
    emit(result, args.out)
    return 1 if "MISMATCH" in (result["get"]["checked"], result["mapping"].get("checked")) else 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    gpu, prefill_gpu = parse_device(args.device), parse_device(args.prefill_device)
    orders = [o for o in args.orders.split(",") if o]
    if not orders or set(orders) - set(ORDERS):
        raise BenchError(f"--orders {args.orders!r}: use {', '.join(ORDERS)}")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")  # NIXL's cuda_ipc READ on one GPU
    fmt = PageFormat(
        kind=STANDARD,
        layout="LBHNC",
        dtype=args.dtype,
        num_heads=args.heads,
        block_size=args.block_size,
        head_size=args.head_size,
    )
    blocks = -(-args.context // args.block_size)
    if gpu is not None:
        import torch

        torch.cuda.set_device(gpu)
        torch.zeros(1, device=f"cuda:{gpu}")  # the device's context current here: cuda_ipc maps into it
    from sidecar.nixl.ucx import Ucp
    from sidecar.standins.emulator_control import spawn_emulator
    from sidecar.wire import nixl_metadata, prefill

    ucp = Ucp()
    out: dict[str, Any] = {
        "bench": "map",
        "date": datetime.date.today().isoformat(),
        "host": platform.node(),
        "devices": f"{args.prefill_device} -> {args.device}",
        "ucx": {"version": ucp.version, "libdir": ucp.libdir},
        "shape": {
            "layers": args.layers,
            "page_bytes": fmt.page_bytes,
            "blocks": blocks,
            "request_bytes": args.layers * blocks * fmt.page_bytes,
        },
    }
    with tempfile.TemporaryDirectory(prefix="kvs-map-") as work:
        emu = spawn_emulator(_emulator_args(args, blocks * args.pool_factor + 1, work), 180.0)
        try:
            ready = emu.ready
            reply = prefill.fetch_handshake(ready.side_channel_host, ready.side_channel_port)[(0, 0)]
            meta = reply.metadata
            agent = nixl_metadata.read_agent_metadata(meta.agent_metadata)
            if meta.kv_caches_base_addr != [
                meta.kv_caches_base_addr[0] + layer * meta.num_blocks * fmt.page_bytes
                for layer in range(args.layers)
            ]:
                raise BenchError(
                    "the probe maps one allocation holding every layer, back to back (the emulator's)"
                )
            mem_type, region = agent.region_at(
                meta.kv_caches_base_addr[0], args.layers * meta.num_blocks * fmt.page_bytes
            )
            key = nixl_metadata.read_packed_key(region.key)
            out["prefill"] = {
                "mem_type": mem_type,
                "key_mem_type": key.mem_type,
                "key_domains": sorted(key.transport_keys),
                "region_bytes": region.length,
            }
            requests = {
                order: emu.client.new_request(num_tokens=args.context, order=order) for order in orders
            }
            with _endpoint(ucp, agent.connections["UCX"], region.key) as (ep, rkey):
                first = requests[orders[0]]
                out["get"] = _check_get(ep, rkey, meta, fmt, first, args)
                out["mapping"] = _map(rkey, region, meta, fmt, requests, gpu, prefill_gpu, args)
        finally:
            emu.stop()
    return out


def _emulator_args(args: argparse.Namespace, num_blocks: int, work: str) -> list[str]:
    opts = {
        "--device": args.prefill_device,
        "--layers": args.layers,
        "--heads": args.heads,
        "--head-size": args.head_size,
        "--block-size": args.block_size,
        "--dtype": args.dtype,
        "--num-blocks": num_blocks,
        "--lease": 600,
        "--seed": args.seed,
        "--control": f"ipc://{work}/emu.sock",
    }
    return [str(part) for option in opts.items() for part in option]


@contextlib.contextmanager
def _endpoint(ucp: Any, worker_address: bytes, packed_key: bytes):
    from sidecar.nixl.ucx import UcpWorker

    with UcpWorker(ucp) as worker:
        ep = worker.connect(worker_address)
        yield ep, ep.unpack(packed_key)


def _page_addr(meta: Any, fmt: PageFormat, layer: int, block: int) -> int:
    return meta.kv_caches_base_addr[layer] + block * fmt.page_bytes


def _check_get(
    ep: Any, rkey: Any, meta: Any, fmt: PageFormat, request: Any, args: argparse.Namespace
) -> dict:
    """The request's first and last page, read with ``ucp_get_nbx`` into host memory, checked."""
    from sidecar.nixl.ucx import UcxError
    from sidecar.standins.emulator_pages import expected_page

    blocks, gens = request.kernel_block_ids, request.block_generations
    picks = [(0, 0), (args.layers - 1, len(blocks) - 1)]
    page = np.empty(fmt.page_bytes, dtype=np.uint8)
    wrong = []
    try:
        for layer, i in picks:
            ep.get(rkey, _page_addr(meta, fmt, layer, blocks[i]), page.ctypes.data, fmt.page_bytes)
            if not np.array_equal(page, expected_page(args.seed, layer, blocks[i], gens[i], fmt)):
                wrong.append([layer, blocks[i]])
    except UcxError as exc:  # e.g. remote VRAM into host memory with no transport for it
        return {"pages": len(picks), "checked": "not read", "error": str(exc)}
    return {"pages": len(picks), "checked": "bit-exact" if not wrong else "MISMATCH", "wrong": wrong}


def _map(
    rkey: Any,
    region: Any,
    meta: Any,
    fmt: PageFormat,
    requests: dict,
    gpu: int | None,
    prefill_gpu: int | None,
    args: argparse.Namespace,
) -> dict:
    from sidecar.nixl.mapping import memory_view
    from sidecar.nixl.ucx import UcxError

    try:
        ptr = rkey.ptr(region.addr)
    except UcxError as exc:
        return {"mapped": False, "status": exc.status, "reason": str(exc)}
    mapped = memory_view(ptr, region.length, gpu)
    offset = meta.kv_caches_base_addr[0] - region.addr  # of layer 0's first page in the mapped region
    timing = "median of CUDA events" if gpu is not None else "best wall time"
    out: dict[str, Any] = {"mapped": True, "timing": f"{timing}; nixl_read: median wall time", "orders": {}}
    wrong = []
    for order, request in requests.items():
        rows = _rows(meta, request.kernel_block_ids, args.layers)
        wrong += _check_mapped(mapped, offset, rows, request, fmt, args, gpu)
        out["orders"][order] = _time_reads(mapped, offset, rows, meta, fmt, order, gpu, prefill_gpu, args)
    out["checked"] = "bit-exact" if not wrong else "MISMATCH"
    out["wrong"] = wrong[:8]
    return out


def _rows(meta: Any, blocks: list[int], layers: int) -> np.ndarray:
    """[layers, n] page rows of the request in the prefill's one allocation (layer-major, then block)."""
    return (
        np.arange(layers, dtype=np.int64)[:, None] * meta.num_blocks
        + np.asarray(blocks, dtype=np.int64)[None, :]
    )


def _dev(gpu: int | None) -> str:
    return "cpu" if gpu is None else f"cuda:{gpu}"


def _pages(memory: Any, offset: int, fmt: PageFormat) -> Any:
    """``memory`` from ``offset`` as [pages, page words] (8-byte words where pages allow: wider loads)."""
    import torch

    word = 8 if fmt.page_bytes % 8 == 0 else 1
    usable = (memory.numel() - offset) // fmt.page_bytes * fmt.page_bytes
    view = memory[offset : offset + usable]
    return (view.view(torch.int64) if word == 8 else view).view(-1, fmt.page_bytes // word)


def _check_mapped(
    mapped: Any,
    offset: int,
    rows: np.ndarray,
    request: Any,
    fmt: PageFormat,
    args: argparse.Namespace,
    gpu: int | None,
) -> list[list[int]]:
    """Every page of the request read through the mapping, against the emulator's bytes; the wrong ones."""
    import torch

    from sidecar.standins.emulator_pages import expected_pages_torch

    pages = _pages(mapped, offset, fmt)
    wrong = []
    for layer in range(args.layers):
        got = pages.index_select(0, torch.from_numpy(rows[layer]).to(_dev(gpu))).view(torch.uint8)
        want = expected_pages_torch(
            args.seed, layer, request.kernel_block_ids, request.block_generations, fmt, device=_dev(gpu)
        ).view(got.shape)
        bad = (got != want).any(dim=1).nonzero().flatten().tolist()
        wrong += [[layer, request.kernel_block_ids[i]] for i in bad]
    return wrong


def _time_reads(
    mapped: Any,
    offset: int,
    rows: np.ndarray,
    meta: Any,
    fmt: PageFormat,
    order: str,
    gpu: int | None,
    prefill_gpu: int | None,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Median seconds of each way to bring the request's pages here, side by side, and over a copy."""
    import torch

    dev = _dev(gpu)
    index = torch.from_numpy(rows.reshape(-1)).to(dev)
    src = _pages(mapped, offset, fmt)
    local = torch.empty_like(src)  # the prefill's pages as if they were this device's own
    local.copy_(src)
    dst = torch.empty((index.numel(), src.shape[1]), dtype=src.dtype, device=dev)
    contiguous = torch.empty_like(dst)
    ways = {
        "gather_mapped": lambda: torch.index_select(src, 0, index, out=dst),
        "gather_local": lambda: torch.index_select(local, 0, index, out=dst),
        "copy_local": lambda: dst.copy_(contiguous),
    }
    timer = device_timer(torch.device(dev), 1, args.reps)
    times = {name: timer(fn) for name, fn in ways.items()}
    first_page = np.uint64(meta.kv_caches_base_addr[0])
    remote_addr = first_page + rows.astype(np.uint64) * np.uint64(fmt.page_bytes)
    times["nixl_read"] = _nixl_read_median(meta, remote_addr, dst, fmt, order, gpu, prefill_gpu, args.reps)
    nbytes = dst.numel() * dst.element_size()
    return {
        name: {"ms": s * 1e3, "request_GBps": nbytes / s / 1e9, "over_copy": times["copy_local"] / s}
        for name, s in times.items()
    }


def _nixl_read_median(
    meta: Any,
    remote_addr: np.ndarray,
    dst: Any,
    fmt: PageFormat,
    name: str,
    gpu: int | None,
    prefill_gpu: int | None,
    reps: int,
) -> float:
    """A bare NIXL READ of the same pages into ``dst`` (adjacent pages merged into one descriptor), from
    ``transfer()`` to DONE, as ``bench e2e``'s bare read."""
    from nixl._api import nixl_agent, nixl_agent_config

    from sidecar.nixl.runs import merge_runs

    layers, n = remote_addr.shape
    agent = nixl_agent(
        f"bench-map-{os.getpid()}-{name}", nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    )
    local_mem, local_dev = ("DRAM", 0) if gpu is None else ("VRAM", gpu)
    reg = agent.register_memory(
        [(dst.data_ptr(), dst.numel() * dst.element_size(), local_dev, "")], local_mem
    )
    peer = agent.add_remote_agent(meta.agent_metadata)
    pages = np.arange(layers * n, dtype=np.uint64).reshape(layers, n)
    local_addr = np.uint64(dst.data_ptr()) + pages * np.uint64(fmt.page_bytes)
    unit = np.full(layers, fmt.page_bytes)
    descs = merge_runs(remote_addr, local_addr, unit, meta.device_id, local_dev)
    local_d = agent.get_xfer_descs(descs.local, local_mem)
    remote_d = agent.get_xfer_descs(descs.remote, "DRAM" if prefill_gpu is None else "VRAM")
    times = []
    try:
        for _ in range(reps + 1):
            handle = agent.initialize_xfer("READ", local_d, remote_d, peer)
            t0 = time.perf_counter()
            state = agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                state = agent.check_xfer_state(handle)
            times.append(time.perf_counter() - t0)
            agent.release_xfer_handle(handle)
            if state == "ERR":
                raise BenchError("the bare NIXL READ failed")
    finally:
        agent.remove_remote_agent(peer)
        agent.deregister_memory(reg)
    return statistics.median(times[1:])


if __name__ == "__main__":
    raise SystemExit(main())
