"""``kv-sidecar bench e2e``: torch's copy, a bare NIXL read and kv-sidecar's pull + convert of the same bytes.

Real processes: the prefill emulator (``--prefill-device``: its standard pages in DRAM or in VRAM), one
``kv-sidecar serve`` per pull mode (``--decoder-device``: the CPU twin or ``--gpu N``), and this process as
the decoder: it owns the K/V planes (/dev/shm or VRAM, exported by CUDA IPC) and drives the vLLM shim's
worker half.
For each cell (context tokens × requests at a time × pull mode × prefill block order) it measures, on the
same requests and block ids:

- ``peer copy``: torch copying the same number of bytes from the prefill device to the decoder device in one
  piece (the link's limit; on one GPU a device-to-device copy, on the CPU a memcpy);
- ``bare``: this process's own NIXL agent reading the very descriptors the daemon reads (direct: half pages
  into the K/V planes; staged: whole pages, adjacent runs merged, into a staging pool), all requests posted
  at once, no conversion;
- ``kv-sidecar``: the Pulls sent in one step through the shim, until the last Done arrived (read, convert on
  the daemon's stream, completion notification to the prefill, Done), with the daemon's per-stage timings,
  the two messages' trips (``delivery``, ``return``) and what the shim's round trip holds beyond them and
  the daemon's end to end (``round_trip_rest``: the shim's work before its send, the daemon's after the job).

Must show: bare NIXL ≥ 0.8 × the peer copy's bandwidth, and kv-sidecar ≤ 1.05 × bare + 0.2 ms per request.
UCX writes its own log per process (``UCX_LOG_LEVEL=info``, ``UCX_PROTO_INFO=y``): the report says which
transports carried each role's reads (cuda_ipc, cuda_copy, tcp, cma, ...). On CUDA both sides run with
``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`` unless it is set. One JSON file; the logs stay under ``--logs`` if given.

Size: a benchmark that starts and drives three processes on one or two devices and reports both
sides in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import glob
import itertools
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sidecar.bench.e2e_baselines import BareReader, peer_copy
from sidecar.bench.e2e_common import BenchError, daemon_settings, parse_device, toml_values
from sidecar.bench.e2e_report import (
    cell_json,
    command_line,
    device_names,
    failures,
    keep_timeline,
    print_cell,
    read_cost_fit,
    skipped_lines,
    timeline_row,
)
from sidecar.bench.e2e_roles import DeviceStandin, mismatched_planes, spread, start_daemon
from sidecar.bench.ucx_logs import summarize_ucx_logs, ucx_env
from sidecar.standins.decoder import DecoderStandin, StandinShape
from sidecar.wire.formats import AITER_SHUFFLED, STANDARD, PageFormat

# ------------------------------------------------------------------------------------------------ options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--prefill-device", default="auto", help="cpu or cuda:N: where the prefill's pages live (auto: cuda:0)")
    a(
        "--decoder-device",
        default="auto",
        help="cpu or cuda:N: the decoder's planes and the daemon (auto: cuda:1 with 2 GPUs, else cuda:0)",
    )
    a("--layers", type=int, default=36)
    a("--heads", type=int, default=8, help="KV heads per rank")
    a("--head-size", type=int, default=128)
    a("--block-size", type=int, default=16)
    a("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    a("--contexts", default="4096,16384", help="prompt tokens per request, comma-separated")
    a("--concurrency", default="1,8,32", help="requests pulled at a time, comma-separated")
    a(
        "--modes",
        default="direct,staged",
        help="daemon pull modes, comma-separated: direct, staged, mapped (the kernel reads the prefill's "
        "mapped pages; its bare read is the staged one)",
    )
    a(
        "--orders",
        default="random,contiguous",
        help="prefill block orders: random (uniformly scattered), contiguous (a fresh free queue), churn "
        "(vLLM's free queue after a busy engine's churn), density-F (ascending, filling F of their span)",
    )
    a(
        "--pairs",
        default="",
        help="mode/order pairs instead of --modes x --orders, e.g. direct/random,staged/contiguous",
    )
    a(
        "--max-batch-tokens",
        type=int,
        default=0,
        help="skip cells whose requests x context exceed this (0: no limit); sizes the KV pools",
    )
    a("--reps", type=int, default=3, help="timed batches per cell")
    a("--warmup", type=int, default=1, help="untimed batches per cell first (handshake, JIT, prep)")
    a(
        "--layer-groups",
        type=int,
        default=0,
        help="READs per request (daemon's layer_groups, same for bare); 0: the daemon's auto rule",
    )
    a(
        "--staging-gb",
        type=float,
        default=16.0,
        help="staging pool of the staged daemon and of the bare staged reads (GiB, capped at the largest "
        "batch); a batch that needs more is read in waves",
    )
    a(
        "--prefill-pool-factor",
        type=float,
        default=1.0,
        help="the prefill's KV pool as a multiple of the largest batch (scattered orders draw their blocks "
        "from it; at 1 a lone request holds every block, so any order sorts into one run)",
    )
    a(
        "--staging-factor",
        type=float,
        default=1.0,
        help="staging pools as a multiple of the largest batch (room beyond it is what gap blocks may use)",
    )
    a("--peer-copy-max-gb", type=float, default=8.0, help="largest single peer copy timed (GiB)")
    a("--peer-copy-reps", type=int, default=5)
    a("--poll-sleep-us", type=float, default=50.0, help="sleep between the bare read's completion polls")
    a("--verify-requests", type=int, default=1, help="requests per cell checked bit for bit")
    a("--verify-layers", type=int, default=3, help="layers checked per verified request (spread out)")
    a("--timeout", type=float, default=300.0, help="deadline of each Pull and of each bare batch (s)")
    a("--budget-s", type=float, default=0.0, help="start no new cell after this many seconds (0: none)")
    a("--seed", type=int, default=0, help="page contents seed of the prefill emulator")
    a(
        "--daemon-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra daemon config (TOML value), e.g. poll_interval_s=0.0002; repeatable",
    )
    a("--ucx-log-level", default="info", help="UCX_LOG_LEVEL for every process (info shows the lanes)")
    a("--logs", type=Path, default=None, help="keep the UCX and daemon logs here (default: discarded)")
    a("--out", type=Path, default=None, help="JSON path (default: bench/results/e2e-<devices>-<date>.json)")
    a("--check", action="store_true", help="exit 1 unless the must-show numbers hold in every cell")


def resolve_devices(prefill: str, decoder: str) -> tuple[str, str]:
    """Fill in ``auto``: two GPUs -> cuda:0 / cuda:1, one -> cuda:0 / cuda:0, none -> cpu / cpu."""
    if "auto" in (prefill, decoder):
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        auto = ("cuda:0", "cuda:1") if n >= 2 else ("cuda:0", "cuda:0") if n == 1 else ("cpu", "cpu")
        prefill = auto[0] if prefill == "auto" else prefill
        decoder = auto[1] if decoder == "auto" else decoder
    p, d = parse_device(prefill), parse_device(decoder)
    if (p is None) != (d is None):
        raise BenchError(f"{prefill} -> {decoder}: both sides on the CPU or both on GPUs")
    return prefill, decoder


def int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise BenchError(f"--{name}: {text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise BenchError(f"--{name}: need positive integers, got {text!r}")
    return values


def choice_list(text: str, name: str, allowed: Sequence[str]) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in allowed]
    if not values or bad:
        raise BenchError(f"--{name}: {bad or text!r} not among {list(allowed)}")
    return values


def gap_settings(settings: dict[str, str]) -> tuple[Any, float]:
    """The daemons' gap cost model and pool share (their config defaults unless ``--daemon-set``), so the
    bare staged reads read the very spans the daemon reads. (None, 0) when coalescing is off."""
    from sidecar.nixl.spans import ReadCost
    from sidecar.ops.config import Config

    base = Config()
    got = toml_values({k: v for k, v in settings.items() if k in _GAP_KEYS})
    value = {k: got.get(k, getattr(base, k)) for k in _GAP_KEYS}
    if not value["gap_coalescing"]:
        return None, 0.0
    cost = ReadCost(float(value["read_descriptor_us"]), float(value["read_gbps"]))
    return cost, float(value["gap_pool_share"])


_GAP_KEYS = ("gap_coalescing", "read_descriptor_us", "read_gbps", "gap_pool_share")


def mode_order_pairs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """``--pairs mode/order,...`` if given, else every --modes x --orders combination."""
    if args.pairs:
        out = []
        for item in args.pairs.split(","):
            mode, _, order = item.strip().partition("/")
            if mode not in MODES:
                raise BenchError(f"--pairs: {item!r} is not mode/order ({'|'.join(MODES)} / an order)")
            block_order(order)
            out.append((mode, order))
        return out
    modes = choice_list(args.modes, "modes", MODES)
    orders = [v.strip() for v in args.orders.split(",") if v.strip()]
    for order in orders:
        block_order(order)
    return [(m, o) for o in orders for m in modes]


ORDERS = ("random", "contiguous", "churn")
# the daemon's pull modes; a mapped cell's bare read is the staged one (whole pages, runs merged: NIXL's
# cheapest read of the same pages), since a mapped pull has no NIXL read of its own
MODES = ("direct", "staged", "mapped")
BARE_MODE = {"direct": "direct", "staged": "staged", "mapped": "staged"}


def block_order(name: str) -> dict[str, Any]:
    """The emulator's request arguments for an order name: random, contiguous, churn or density-F."""
    if name in ORDERS:
        return {"order": name}
    if name.startswith("density-"):
        try:
            density = float(name.removeprefix("density-"))
        except ValueError:
            density = -1.0
        if 0 < density <= 1:
            return {"order": "contiguous", "density": density}
    raise BenchError(f"block order {name!r} is not one of {list(ORDERS)} or density-F with 0 < F <= 1")


def formats(args: argparse.Namespace) -> tuple[PageFormat, PageFormat]:
    kw = dict(dtype=args.dtype, num_heads=args.heads, block_size=args.block_size, head_size=args.head_size)
    return PageFormat(kind=STANDARD, layout="LBHNC", **kw), PageFormat(
        kind=AITER_SHUFFLED, layout="LHBNC", **kw
    )


# ------------------------------------------------------------------------------------------------ cells


@dataclass
class Cell:
    """One measured combination; ``skipped`` says why it was not run."""

    context: int
    concurrency: int
    mode: str
    order: str
    blocks: int  # kernel blocks per request
    nbytes: int  # bytes of the whole batch
    skipped: str | None = None
    bare_s: list[float] = field(default_factory=list)
    bare_post_s: list[float] = field(default_factory=list)  # bare: posting alone (make and transfer())
    sidecar_s: list[float] = field(default_factory=list)
    bare_descriptors: int = 0  # per request
    bare_descriptors_request_order: int = 0  # per request, slots in request order without gaps (before)
    bare_gap_bytes: int = 0  # per batch: gap blocks read into staging to merge runs
    end_to_end_s: list[float] = field(default_factory=list)  # per request, from the daemon's Done
    stages_s: dict[str, list[float]] = field(default_factory=dict)
    round_trip_s: list[float] = field(default_factory=list)  # shim: Pull sent -> Done received
    daemon_cpu_s: list[float] = field(default_factory=list)  # the daemon's CPU seconds per timed batch
    verified: dict[str, Any] = field(default_factory=dict)
    notified: bool = True
    # the TIMELINES batches with the longest accept: each request's hops in ms from the batch's start
    timelines: list[dict[str, Any]] = field(default_factory=list)


def plan_cells(
    contexts: list[int],
    concurrency: list[int],
    pairs: list[tuple[str, str]],
    block_size: int,
    page_bytes: int,
    layers: int,
    max_batch_tokens: int,
) -> list[Cell]:
    """Every cell, smallest batches first (a time budget cuts the largest); over-size ones marked skipped."""
    cells = []
    for ctx in sorted(contexts):
        for c in sorted(concurrency):
            blocks = -(-ctx // block_size)
            for mode, order in pairs:
                cell = Cell(ctx, c, mode, order, blocks, c * blocks * layers * page_bytes)
                if max_batch_tokens and c * ctx > max_batch_tokens:
                    cell.skipped = f"{c} x {ctx} tokens > --max-batch-tokens {max_batch_tokens}"
                cells.append(cell)
    cells.sort(key=lambda x: (x.concurrency * x.blocks, x.context))
    return cells


# ------------------------------------------------------------------------------------------------ measures


def sidecar_batch(
    standin: DecoderStandin, orders: list[Any], timeout_s: float
) -> tuple[float, dict[str, Any]]:
    """Send the Pulls in one step; seconds from the send to the last Done's arrival, and the outcomes."""
    ids = {o.req_id for o in orders}
    t0 = time.monotonic()
    standin.pull(orders)
    got = standin.wait(ids, timeout_s)
    missing = sorted(ids - got.keys())
    failed = [f"{o.req_id}: {o.reason}" for o in got.values() if not o.ok]
    if missing or failed:
        raise BenchError(f"kv-sidecar pulls failed: {failed[:3]} missing {missing[:3]}")
    return max(o.received_at for o in got.values()) - t0, got


# ------------------------------------------------------------------------------------------------ the run


def sizing(
    cells: list[Cell], layers: int, page: int, staging_gb: float, staging_factor: float = 1.0
) -> tuple[int, int]:
    """(kernel blocks of the largest live batch, staging pool bytes) for the cells still to run."""
    live = [c for c in cells if c.skipped is None]
    max_blocks = max((c.concurrency * c.blocks for c in live), default=0)
    staged = [c for c in live if BARE_MODE[c.mode] == "staged"]
    if not staged:
        return max_blocks, 0
    largest_request = max(c.blocks for c in staged) * layers * page
    batch = int(max_blocks * layers * page * staging_factor)
    staging = max(min(int(staging_gb * 2**30), batch), largest_request)
    return max_blocks, staging - staging % page


def free_bytes(device: str) -> int:
    """Memory free for the bench's pools on ``device``: a GPU's free memory, or the host's MemAvailable."""
    if device == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    import torch

    return int(torch.cuda.mem_get_info(parse_device(device))[0])


def memory_check(
    cells: list[Cell],
    prefill: str,
    decoder: str,
    layers: int,
    page: int,
    staging_gb: float,
    prefill_factor: float = 1.0,
    staging_factor: float = 1.0,
    free: Callable[[str], int] = free_bytes,
) -> None:
    """Skip the largest batches until what they need fits the free memory (10 % slack): the emulator's pool
    on the prefill device; the planes and two staging pools (daemon, bare) on the decoder. On the CPU both
    sides are the host's memory (without this, the defaults' 16k x 32 cells ended in the emulator's
    MemoryError)."""
    while True:
        max_blocks, staging = sizing(cells, layers, page, staging_gb, staging_factor)
        if not max_blocks:
            return
        pool = (max_blocks + 1) * layers * page
        need = {prefill: 0, decoder: 0}
        need[prefill] += int(pool * prefill_factor)
        need[decoder] += pool + 2 * staging
        short = [d for d, n in need.items() if n * 1.1 > free(d)]
        if not short:
            return
        for c in cells:
            if c.skipped is None and c.concurrency * c.blocks == max_blocks:
                c.skipped = f"needs ~{need[short[0]] / 2**30:.0f} GiB on {short[0]}, more than is free"


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """The whole measurement; returns the result dict (written by ``run``)."""
    started = time.monotonic()
    prefill, decoder = resolve_devices(args.prefill_device, args.decoder_device)
    cuda = prefill != "cpu"
    remote_fmt, local_fmt = formats(args)
    page = remote_fmt.page_bytes
    contexts = int_list(args.contexts, "contexts")
    concurrency = int_list(args.concurrency, "concurrency")
    pairs = mode_order_pairs(args)
    extra_settings = daemon_settings(args.daemon_set)
    modes = sorted({m for m, _ in pairs}, key=MODES.index)
    cells = plan_cells(
        contexts, concurrency, pairs, args.block_size, page, args.layers, args.max_batch_tokens
    )
    if args.reps < 1 or args.warmup < 0:
        raise BenchError("--reps must be >= 1 and --warmup >= 0")
    if args.prefill_pool_factor < 1 or args.staging_factor < 1:
        raise BenchError("--prefill-pool-factor and --staging-factor must be >= 1")
    memory_check(
        cells, prefill, decoder, args.layers, page, args.staging_gb,
        args.prefill_pool_factor, args.staging_factor,
    )
    max_blocks, staging = sizing(cells, args.layers, page, args.staging_gb, args.staging_factor)
    if not max_blocks:
        raise BenchError(f"every cell is skipped: {sorted({str(c.skipped) for c in cells})}")
    live = [c for c in cells if c.skipped is None]
    modes = [m for m in modes if any(c.mode == m for c in live)]
    if staging:  # sized for the cells that fit: their gap budget depends on it
        print(f"staging pool {staging / 2**20:.1f} MiB (from --staging-factor {args.staging_factor:g}, "
              f"--staging-gb {args.staging_gb:g} and the largest batch that runs: {max_blocks} blocks)")
    # the emulator's and the decoder's pools: the largest batch, plus vLLM's null block 0
    pool_blocks = max_blocks + 1
    prefill_blocks = math.ceil(max_blocks * args.prefill_pool_factor) + 1

    work = Path(tempfile.mkdtemp(prefix="kv-sidecar-e2e-"))
    logs = args.logs or work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for key, value in ucx_env(logs, "bench", args.ucx_log_level, cuda).items():
        os.environ[key] = value  # before this process loads UCX (the bare reader's agent)

    result: dict[str, Any] = {
        "bench": "e2e",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": command_line(),
        "host": platform.node(),
        "python": platform.python_version(),
        "devices": {"prefill": prefill, "decoder": decoder, "names": device_names({prefill, decoder})},
        "shape": {
            "layers": args.layers,
            "heads": args.heads,
            "head_size": args.head_size,
            "block_size": args.block_size,
            "dtype": args.dtype,
            "page_bytes": page,
            "pool_blocks": pool_blocks,
            "prefill_pool_blocks": prefill_blocks,
        },
        "settings": {
            "reps": args.reps,
            "warmup": args.warmup,
            "layer_groups": args.layer_groups,
            "staging_bytes": staging,
            "poll_sleep_us": args.poll_sleep_us,
            "daemon_set": list(args.daemon_set),
            "budget_s": args.budget_s,
        },
    }
    import torch

    result["torch"] = torch.__version__

    # 1. the link's limit, before the pools take the memory
    peer: dict[int, dict[str, Any]] = {}
    cap = max(page, int(args.peer_copy_max_gb * 2**30))
    try:
        for nbytes in sorted({min(c.nbytes, cap) for c in live}):
            peer[nbytes] = peer_copy(nbytes, prefill, decoder, args.peer_copy_reps)
    except Exception as exc:  # noqa: BLE001 - the NIXL and kv-sidecar numbers are still worth having
        result["peer_copy_error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    result["peer_copy"] = list(peer.values())
    print(
        "peer copy "
        + ", ".join(f"{p['bytes'] / 2**20:.2f} MiB {p['GBps']:.2f} GB/s" for p in peer.values())
        + f" ({prefill} -> {decoder})",
        flush=True,
    )

    from sidecar.standins.emulator_control import spawn_emulator

    emu = standin = bare = None
    daemons: dict[str, Any] = {}
    workers: dict[str, Any] = {}
    failed = ""
    try:
        emu = spawn_emulator(
            [
                *("--device", prefill, "--layers", str(args.layers), "--heads", str(args.heads)),
                *("--head-size", str(args.head_size), "--block-size", str(args.block_size)),
                *("--dtype", args.dtype, "--num-blocks", str(prefill_blocks), "--lease", "600"),
                *("--seed", str(args.seed), "--control", f"ipc://{work}/emu.sock"),
            ],
            180.0,
            ucx_env(logs, "prefill", args.ucx_log_level, cuda),
        )
        shape = StandinShape(
            layers=args.layers,
            heads=args.heads,
            head_size=args.head_size,
            block_size=args.block_size,
            num_blocks=pool_blocks,
            dtype=args.dtype,
        )
        factors = dict(emu.ready.compat_factors)
        settings = {
            "max_inflight": str(max(64, max(concurrency))),
            "layer_groups": str(args.layer_groups),
            **extra_settings,
        }
        for mode in modes:
            daemons[mode] = start_daemon(
                work,
                f"daemon-{mode}",
                remote_fmt=remote_fmt,
                gpu=parse_device(decoder),
                mode=mode,
                staging_bytes=staging,
                env=ucx_env(logs, f"daemon-{mode}", args.ucx_log_level, cuda),
                log_path=logs / f"daemon-{mode}.log",
                settings=settings,
            )
        standin = DeviceStandin(
            daemons[modes[0]].socket,
            shape,
            device=decoder,
            compat_factors=factors,
            pull_timeout_s=args.timeout,
            register_timeout_s=120.0,
        )
        from vllm_glue.worker import WorkerHalf

        for mode in modes:
            w = (
                standin.worker
                if mode == modes[0]
                else WorkerHalf(daemons[mode].socket, pull_timeout_s=args.timeout, register_timeout_s=120.0)
            )
            if not w.register(standin.kv_caches, shape.fmt, factors):
                raise BenchError(f"the {mode} daemon did not register the planes: {w.client.status_reason}")
            workers[mode] = w
        gap_cost, gap_share = gap_settings(settings)
        result["settings"]["gaps"] = {
            "read_descriptor_us": None if gap_cost is None else gap_cost.descriptor_us,
            "read_gbps": None if gap_cost is None else gap_cost.gbps,
            "gap_pool_share": gap_share,
        }
        bare = BareReader(
            standin,
            emu.ready,
            remote_fmt,
            local_fmt,
            staging_bytes=staging,
            layer_groups=args.layer_groups,
            sleep_s=args.poll_sleep_us * 1e-6,
            gap_cost=gap_cost,
            gap_share=gap_share,
        )
        result["bare_setup"] = {"agent_create_s": bare.agent_s, "prep_direct_s": bare.prep_s}
        result["daemon_idle_cpu_pct"] = idle_cpu_pct({m: d.proc.pid for m, d in daemons.items()}, 1.0)
        for cell in cells:
            if cell.skipped is not None:
                continue
            if failed:
                cell.skipped = f"not run after an error in an earlier cell ({failed})"
                continue
            if args.budget_s and time.monotonic() - started > args.budget_s:
                cell.skipped = f"time budget of {args.budget_s:g} s spent"
                continue
            try:
                run_cell(
                    cell,
                    emu.client,
                    standin,
                    workers[cell.mode],
                    bare,
                    args,
                    remote_fmt,
                    daemon_pid=daemons[cell.mode].proc.pid,
                )
            except Exception as exc:  # noqa: BLE001 - recorded; the state is unknown, so no further cells
                cell.skipped = failed = f"error: {type(exc).__name__}: {exc}"
                print(f"{cell.mode}/{cell.order} {cell.context} x{cell.concurrency}: {failed}", flush=True)
                continue
            print_cell(cell, peer.get(min(cell.nbytes, cap), {}).get("GBps", 0.0))
        if failed:
            result["error"] = failed
    except Exception as exc:  # noqa: BLE001 - a setup failure still writes what was measured
        result["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        closers = [bare.close] if bare is not None else []
        closers += [w.shutdown for w in workers.values() if standin is None or w is not standin.worker]
        closers += [standin.close] if standin is not None else []
        closers += [d.stop for d in daemons.values()] + ([emu.stop] if emu is not None else [])
        for close in closers:
            try:
                close()
            except Exception:  # noqa: BLE001 - tear down the rest regardless
                traceback.print_exc()

    result["cells"] = [cell_json(c, peer.get(min(c.nbytes, cap))) for c in cells]
    result["read_cost_fit"] = read_cost_fit(cells)
    print(f"read_cost_fit (bare reads): {result['read_cost_fit']}", flush=True)
    result["transports"] = _transports(logs, modes)
    result["must_show_failures"] = [
        f"{c['mode']}/{c['order']} {c['context']} tokens x {c['concurrency']}: {why}"
        for c in result["cells"]
        if c.get("must_show")
        for why in failures(c)
    ]
    result["elapsed_s"] = time.monotonic() - started
    if args.logs is None:
        shutil.rmtree(work, ignore_errors=True)
    else:
        shutil.rmtree(work / "logs", ignore_errors=True)
        for p in work.glob("*.toml"):
            shutil.copy(p, logs / p.name)
        shutil.rmtree(work, ignore_errors=True)
    return result


_REQUEST_IDS = itertools.count(1)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu_pct(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """Each registered, idle daemon's CPU over ``seconds``, in % of a core."""
    before = {k: _cpu_s(pid) for k, pid in pids.items()}
    t0 = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    return {k: round(100 * (_cpu_s(pid) - before[k]) / wall, 2) for k, pid in pids.items()}


def run_cell(
    cell: Cell,
    emulator: Any,
    standin: DeviceStandin,
    worker: Any,
    bare: BareReader,
    args: argparse.Namespace,
    remote_fmt: PageFormat,
    daemon_pid: int | None = None,
) -> None:
    """Warm-up then timed batches of one cell: fresh prefill requests, the bare read of their blocks, then
    kv-sidecar's pulls of the same blocks; the first timed batch is checked bit for bit."""
    from vllm_glue.orders import PullOrder, parse_remote

    standin.worker = worker
    for rep in range(args.warmup + args.reps):
        replies = [
            emulator.new_request(num_tokens=cell.context, **block_order(cell.order))
            for _ in range(cell.concurrency)
        ]
        local = [standin.allocate(len(r.kernel_block_ids)) for r in replies]
        try:
            reqs = [(lo, r.kernel_block_ids, r.num_tokens) for lo, r in zip(local, replies, strict=True)]
            bare_s = bare.batch(BARE_MODE[cell.mode], reqs, args.timeout)
            pulls = [
                PullOrder(
                    f"e2e-{next(_REQUEST_IDS)}",
                    parse_remote(r.kv_transfer_params),
                    lo,
                    True,
                    time.monotonic_ns(),
                )
                for lo, r in zip(local, replies, strict=True)
            ]
            cpu0 = _cpu_s(daemon_pid) if daemon_pid else 0.0
            side_s, outcomes = sidecar_batch(standin, pulls, args.timeout)
            daemon_cpu = _cpu_s(daemon_pid) - cpu0 if daemon_pid else None
            if rep == args.warmup:
                _verify(cell, standin, replies, local, args, remote_fmt)
            for r in replies:
                try:
                    emulator.wait_state(r.kv_transfer_params["remote_request_id"], "freed_by_notif", 30.0)
                except Exception:  # noqa: BLE001 - recorded; its blocks stay taken
                    cell.notified = False
        finally:
            for lo in local:
                standin.release(lo)
        if rep < args.warmup:
            continue
        cell.bare_s.append(bare_s)
        cell.bare_post_s.append(bare.post_s)
        cell.bare_descriptors = bare.descriptors
        cell.bare_descriptors_request_order = bare.descriptors_request_order
        cell.bare_gap_bytes = bare.gap_bytes
        cell.sidecar_s.append(side_s)
        if daemon_cpu is not None:
            cell.daemon_cpu_s.append(daemon_cpu)
        batch_start = min(o.lease_started_at_ns for o in pulls) / 1e9
        rows = []
        for o in outcomes.values():
            if "end_to_end" in o.timings:
                cell.end_to_end_s.append(o.timings["end_to_end"])
            for k, v in o.timings.items():
                cell.stages_s.setdefault(k, []).append(v)
            rt = standin.round_trip_s(o)
            rows.append(timeline_row(o.timings, o.received_at - batch_start, rt))
            if rt is not None:
                cell.round_trip_s.append(rt)
                hops = [o.timings.get(k) for k in ("delivery", "end_to_end", "return")]
                if None not in hops:  # the shim's work before its send, the daemon's after the job ended
                    cell.stages_s.setdefault("round_trip_rest", []).append(rt - sum(hops))
        keep_timeline(cell.timelines, rows, batch_start)


def _verify(
    cell: Cell, standin: DecoderStandin, replies: list[Any], local: list[list[int]], args: Any, fmt: Any
) -> None:
    """Check the first requests of a batch bit for bit; a check that cannot run is recorded, not raised."""
    layers = spread(args.layers, args.verify_layers)
    bad: list[str] = []
    checked = min(args.verify_requests, len(replies))
    try:
        for r, lo in list(zip(replies, local, strict=True))[:checked]:
            bad += mismatched_planes(
                standin, r.kernel_block_ids, r.block_generations, lo, args.seed, fmt, layers
            )
    except Exception as exc:  # noqa: BLE001 - the timings are still valid; say the bytes were not checked
        cell.verified = {"requests": 0, "layers": layers, "error": f"{type(exc).__name__}: {exc}"}
        return
    cell.verified = {"requests": checked, "layers": layers, "mismatches": len(bad), "first": bad[:5]}


def _transports(logs: Path, modes: list[str]) -> dict[str, Any]:
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).fflush(None)  # UCX's log file in this process is a buffered C stream
    out = {}
    for mode in modes:
        out[f"daemon-{mode}"] = summarize_ucx_logs(sorted(glob.glob(str(logs / f"ucx-daemon-{mode}-*.log"))))
    out["bare"] = summarize_ucx_logs(sorted(glob.glob(str(logs / "ucx-bench-*.log"))), "bench-bare")
    out["prefill"] = summarize_ucx_logs(sorted(glob.glob(str(logs / "ucx-prefill-*.log"))))
    return out


def run(args: argparse.Namespace) -> int:
    try:
        result = run_bench(args)
    except BenchError as exc:
        print(f"kv-sidecar bench e2e: {exc}", file=sys.stderr)
        return 2
    out = args.out
    if out is None:
        out_dir = Path("bench/results") if Path("bench/results").is_dir() else Path(".")
        tag = "-".join(
            d.replace(":", "") for d in (result["devices"]["prefill"], result["devices"]["decoder"])
        )
        out = out_dir / f"e2e-{tag}-{result['date'][:10]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    for role, t in result["transports"].items():
        print(f"UCX reads of {role}: {', '.join(t['read_transports']) or 'none logged'}")
    print(f"wrote {out}")
    for line in skipped_lines(result["cells"]):
        print(line)
    for f in result["must_show_failures"]:
        print(f"must-show not met: {f}")
    if result.get("error"):
        print(f"kv-sidecar bench e2e: {result['error']}", file=sys.stderr)
        return 2
    return 1 if (args.check and result["must_show_failures"]) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kv-sidecar bench e2e", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
