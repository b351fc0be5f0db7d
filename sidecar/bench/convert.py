"""``kv-sidecar bench convert``: the converter against a plain device copy of the same bytes, in one run.

Per shape (a model's layers × one request's blocks) it times, on one device: a device-to-device copy of the
request's pages (``copy_GBps``), the torch reference converting them in place (``torch_ref_GBps``) and, on a
GPU, the Triton kernel in place and out of place from a staging buffer (``kernel_GBps`` = the faster form).
Bandwidths count bytes read + bytes written (2 × the request's pages). Kernel and copy times are the device's
work (CUDA events, the launch hidden behind a spin: ``timing.LEAD_S``); per-call times are wall times of
launch + sync, the daemon's way, set against the copy timed the same way. It also checks that the kernel's
bytes equal the reference's. Writes a table, a JSON list of rows and a PNG plot. A shape the device's memory
cannot hold is skipped, with a row that says so, and the others are still measured and written.

Size: shapes, timing, plotting and the JSON report of one benchmark.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import platform
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sidecar.bench.timing import device_timer
from sidecar.convert.checks import ConversionJob, check_job
from sidecar.convert.reference import run_reference


@dataclass(frozen=True)
class ConvertShape:
    """A request's pages: ``layers`` × ceil(tokens / block_size) blocks of H heads, N tokens, D dims."""

    name: str
    layers: int
    num_heads: int
    block_size: int
    head_size: int
    tokens: int
    elem_bytes: int = 2  # 1 for fp8 pages

    @property
    def blocks(self) -> int:
        return -(-self.tokens // self.block_size)

    @property
    def pair_bytes(self) -> int:
        return 2 * self.num_heads * self.block_size * self.head_size * self.elem_bytes

    @property
    def request_bytes(self) -> int:
        return self.layers * self.blocks * self.pair_bytes


GPU_SHAPES = [
    ConvertShape("qwen3-8b-4k", 36, 8, 16, 128, 4096),
    ConvertShape("qwen3-8b-16k", 36, 8, 16, 128, 16384),
    ConvertShape("qwen3-8b-tp8-4k", 36, 1, 16, 128, 4096),
    ConvertShape("l64-h8-n32-d128-4k", 64, 8, 32, 128, 4096),
    ConvertShape("llama3.2-1b-d64-16k", 16, 8, 16, 64, 16384),
    ConvertShape("l42-h8-n16-d256-4k", 42, 8, 16, 256, 4096),
    ConvertShape("l42-h8-n32-d256-4k", 42, 8, 32, 256, 4096),
]
# A 2-core laptop runs these in well under a minute: the same page geometries, requests of 64 MiB, larger
# than the caches, so the copy runs at memory speed as it would on a real request.
CPU_SHAPES = [
    ConvertShape("qwen3-8b-4L-4k", 4, 8, 16, 128, 4096),
    ConvertShape("l4-h8-n32-d128-4k", 4, 8, 32, 128, 4096),
    ConvertShape("l4-h8-n16-d64-8k", 4, 8, 16, 64, 8192),
    ConvertShape("l2-h8-n32-d256-4k", 2, 8, 32, 256, 4096),
]
PRESETS = {s.name: s for s in GPU_SHAPES + CPU_SHAPES}
PER_CALL_REPS = 20  # timed calls per per-call measurement (each ends in a device sync)
_CUSTOM = re.compile(r"^L(\d+)-H(\d+)-N(\d+)-D(\d+)-T(\d+)$")

# Must show (issue 2): thresholds checked by --check.
IN_PLACE_SHAPE, IN_PLACE_MIN, OUT_OF_PLACE_MIN, FASTER_MIN, OVER_REF_MIN, CPU_REF_MIN = (
    "qwen3-8b-4k", 0.90, 0.90, 0.85, 6.0, 0.10)


def parse_shape(spec: str) -> ConvertShape:
    if spec in PRESETS:
        return PRESETS[spec]
    m = _CUSTOM.match(spec)
    if not m:
        raise argparse.ArgumentTypeError(f"unknown shape {spec!r}: a preset ({', '.join(PRESETS)}) or "
                                         "L<layers>-H<heads>-N<block>-D<head size>-T<tokens>")
    layers, h, n, d, t = map(int, m.groups())
    return ConvertShape(spec, layers, h, n, d, t)


def parse_variant(spec: str):
    """``name:field=value,...`` → (name, Tuning); fields are those of sidecar.convert.triton_kernel.Tuning."""
    from sidecar.convert.tuning import Tuning

    name, _, body = spec.partition(":")
    fields = {f.name: f.type for f in dataclasses.fields(Tuning)}
    kw = {}
    for item in filter(None, body.split(",")):
        key, _, value = item.partition("=")
        if key not in fields:
            raise argparse.ArgumentTypeError(f"unknown tuning field {key!r}; one of {sorted(fields)}")
        kind = fields[key]
        if kind in (bool, "bool"):
            kw[key] = value.lower() in ("1", "true", "yes")
        elif kind in (str, "str"):
            kw[key] = value
        else:
            kw[key] = int(value)
    return name or "default", Tuning(**kw)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", help="auto (a GPU if there is one), cpu, cuda or cuda:N")
    parser.add_argument("--shapes", type=lambda s: [parse_shape(x) for x in s.split(",") if x],
                        help="comma-separated presets or L<l>-H<h>-N<n>-D<d>-T<tokens> (default: per device)")
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float8_e4m3fn", "float8_e4m3fnuz"],
        default="bfloat16",
        help="page element type (fp8 pages move 1-byte elements, x = 16)",
    )
    parser.add_argument("--reps", type=int, default=0, help="timed runs per measurement (0: per device)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where the JSON and PNG go (default: bench/results if it exists, else .)")
    parser.add_argument("--tag", default=None, help="file name tag (default: from the device name)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--no-verify", action="store_true", help="skip the kernel-vs-reference byte check")
    parser.add_argument("--variant", action="append", type=parse_variant, default=None,
                        help="GPU kernel tuning, name:field=value,... (repeatable; default: the shipped one)")
    parser.add_argument("--cache-blocks", type=int, default=8192,
                        help="blocks per layer in the cache the request's random ids are drawn from (GPU; "
                             "the CPU uses the request's blocks + 25 %%)")
    parser.add_argument("--check", action="store_true", help="exit 1 unless the must-show ratios hold")


# ---- one shape -------------------------------------------------------------------------------------------

def _random_bits(shape: tuple[int, ...], device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """Random raw bits (never zeros: they hide unwritten outputs and can time faster)."""
    return torch.randint(-32768, 32768, shape, dtype=torch.int16, generator=gen, device=device)


def _job(shape: ConvertShape, cache: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype,
         src: torch.Tensor | None) -> ConversionJob:
    return check_job([cache[i, 0].view(dtype) for i in range(shape.layers)],
                     [cache[i, 1].view(dtype) for i in range(shape.layers)], ids,
                     num_heads=shape.num_heads, block_size=shape.block_size, head_size=shape.head_size,
                     srcs=None if src is None else [s.view(dtype) for s in src])


def _copy_call(nbytes: int, device: torch.device, gen: torch.Generator) -> Callable[[], Any]:
    """A plain device-to-device copy of ``nbytes`` (the same bytes the conversion reads and writes)."""
    a = _random_bits((nbytes // 2,), device, gen)
    b = torch.empty_like(a)
    return lambda: b.copy_(a)


def _wall_timer(reps: int) -> Callable[[Callable[[], None]], float]:
    """Median wall seconds of ``fn`` and a device sync: what one request's conversion costs the caller,
    the Python launch included."""

    def wall_time(fn):
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return wall_time


def _fired_timer(reps: int, stream: Any) -> Callable[[Callable[[], Any]], float]:
    """Median wall seconds from ``Prepared.fire`` to a device sync, each launch made ready (``prepare``,
    untimed) after the previous one's sync: the part of a graph launch left once a request's bytes land."""

    def fired_time(prepare):
        times = []
        for _ in range(reps + 1):  # the first fire may capture
            prepared = prepare()
            if prepared is None:
                raise RuntimeError("the graph launch was declined (no graph free)")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            prepared.fire(stream)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    return fired_time


def measure(shape: ConvertShape, device: torch.device, dtype: torch.dtype, timer, variants, verify: bool,
            step: Callable[[str], None], kernel: bool, cache_blocks: int = 0) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(0)
    shape = dataclasses.replace(shape, elem_bytes=torch.empty(0, dtype=dtype).element_size())
    # The request's ids are random in a cache larger than the request (issue 12: at least 8,192 blocks).
    spare = max(max(1, shape.blocks // 4), cache_blocks - shape.blocks)
    hnd = shape.num_heads * shape.block_size * shape.head_size
    words = hnd * shape.elem_bytes // 2  # random bits are drawn as int16 and viewed as the page dtype
    cache = _random_bits((shape.layers, 2, shape.blocks + spare, words), device, gen)  # LHBNC: [L, 2, B, HND]
    ids = torch.randperm(shape.blocks + spare, generator=torch.Generator().manual_seed(0))[: shape.blocks]
    moved = 2 * shape.request_bytes  # read + written
    gbps = lambda seconds: moved / seconds / 1e9

    step("copy")
    copy = _copy_call(shape.request_bytes, device, gen)
    copy_s = timer(copy)

    step("torch reference")
    ref_job = _job(shape, cache, ids, dtype, None)
    ref_s = timer(lambda: run_reference(ref_job))
    base = {
        "shape": shape.name, "layers": shape.layers, "num_heads": shape.num_heads,
        "block_size": shape.block_size, "head_size": shape.head_size, "tokens": shape.tokens,
        "blocks": shape.blocks, "dtype": str(dtype)[6:],
        "pair_KiB": shape.pair_bytes / 1024, "request_GB": shape.request_bytes / 1e9,
        "copy_ms": copy_s * 1e3, "copy_GBps": gbps(copy_s), "torch_ref_ms": ref_s * 1e3,
        "torch_ref_GBps": gbps(ref_s), "torch_ref_vs_copy": copy_s / ref_s,
        "cache_blocks": shape.blocks + spare,
    }
    if not kernel:
        step("done")
        return [{**base, "variant": None, "kernel_GBps": None, "kernel_form": None,
                 "in_place_mode": "torch gather",
                 "kernel_in_place_GBps": None, "kernel_out_of_place_GBps": None, "kernel_vs_copy": None,
                 "in_place_vs_copy": None, "out_of_place_vs_copy": None, "in_place_vs_torch_ref": None,
                 "out_of_place_vs_torch_ref": None, "verified": None}]

    from sidecar.convert import PlaneSet, triton_kernel
    from sidecar.convert.graphs import GraphLaunches
    from sidecar.convert.launch import make_stream

    src = _random_bits((shape.layers, shape.blocks, 2 * words), device, gen)  # a staging buffer of pages
    planes = PlaneSet([cache[i, 0].view(dtype) for i in range(shape.layers)],
                      [cache[i, 1].view(dtype) for i in range(shape.layers)], num_heads=shape.num_heads,
                      block_size=shape.block_size, head_size=shape.head_size)
    src_typed = src.view(dtype)
    wall = _wall_timer(PER_CALL_REPS)
    copy_call_s = wall(copy)  # the copy timed as the conversion is per call: its launch and a sync included
    graph_stream = make_stream(device)  # a graph is captured on, and replays from, a side stream
    rows = []
    for name, tuning in variants:
        step(f"kernel {name}")
        in_place = triton_kernel.Launcher(ref_job, tuning)
        out_of_place = triton_kernel.Launcher(_job(shape, cache, ids, dtype, src), tuning)
        ip_s, oop_s = timer(in_place), timer(out_of_place)
        # Per call: what the daemon does per request (ids checked, tables built, launched), synced.
        call_ip_s = wall(lambda t=tuning: planes.convert(ids, tuning=t))
        call_oop_s = wall(lambda t=tuning: planes.convert(ids, src=src_typed, tuning=t))
        # Per call, the daemon's launches with conversion_graphs on: a replay (captured in the warm-up),
        # staged (out of place) and direct (in place)
        graphs = GraphLaunches(planes, tuning)
        call_graph_s = wall(_graph_call(graphs, graph_stream, ids.numpy(), src_typed, shape.layers))
        # graphs replay only the "split" in-place kernel (a variant choosing another has no graph form)
        call_ip_graph_s = (wall(_graph_call(graphs, graph_stream, ids.numpy(), None, shape.layers))
                           if in_place.strategy == "split" else None)
        # Per call as the daemon launches at landing: made ready while the read runs (ids checked, graph
        # held, table written: ``prepare``), timed from its fire to the sync
        fired = _fired_timer(PER_CALL_REPS, graph_stream)
        fired_oop_s = fired(lambda g=graphs: g.prepare(ids.numpy(), src_typed, (0, shape.layers)))
        fired_ip_s = (fired(lambda g=graphs: g.prepare(ids.numpy(), None, (0, shape.layers)))
                      if in_place.strategy == "split" else None)
        verified = None
        if verify:
            verified = _verify(shape, cache, ids, dtype, src, tuning)
        best = min(ip_s, oop_s)
        rows.append({
            **base, "variant": name, "tuning": dataclasses.asdict(tuning),
            "in_place_mode": {"scratch": "scratch"}.get(in_place.strategy, "on_chip"),
            "in_place_strategy": in_place.strategy,
            "kernel_GBps": gbps(best), "kernel_form": "in_place" if ip_s <= oop_s else "out_of_place",
            "kernel_in_place_ms": ip_s * 1e3, "kernel_in_place_GBps": gbps(ip_s),
            "kernel_out_of_place_ms": oop_s * 1e3, "kernel_out_of_place_GBps": gbps(oop_s),
            "kernel_vs_copy": copy_s / best, "in_place_vs_copy": copy_s / ip_s,
            "out_of_place_vs_copy": copy_s / oop_s,
            "per_call_in_place_ms": call_ip_s * 1e3, "per_call_out_of_place_ms": call_oop_s * 1e3,
            "per_call_in_place_vs_copy": copy_s / call_ip_s,
            "per_call_out_of_place_vs_copy": copy_s / call_oop_s,
            "per_call_out_of_place_graph_ms": call_graph_s * 1e3,
            "per_call_out_of_place_graph_vs_copy": copy_s / call_graph_s,
            "per_call_in_place_graph_ms": call_ip_graph_s and call_ip_graph_s * 1e3,
            "per_call_in_place_graph_vs_copy": call_ip_graph_s and copy_s / call_ip_graph_s,
            # like for like: each per-call time against the copy's own per-call time
            "per_call_copy_ms": copy_call_s * 1e3,
            "per_call_in_place_vs_copy_per_call": copy_call_s / call_ip_s,
            "per_call_out_of_place_vs_copy_per_call": copy_call_s / call_oop_s,
            "per_call_out_of_place_graph_vs_copy_per_call": copy_call_s / call_graph_s,
            "per_call_in_place_graph_vs_copy_per_call": call_ip_graph_s and copy_call_s / call_ip_graph_s,
            # the launch made ready ahead, only its fire timed (what is left once the bytes land)
            "per_call_out_of_place_fired_ms": fired_oop_s * 1e3,
            "per_call_out_of_place_fired_vs_copy_per_call": copy_call_s / fired_oop_s,
            "per_call_in_place_fired_ms": fired_ip_s and fired_ip_s * 1e3,
            "per_call_in_place_fired_vs_copy_per_call": fired_ip_s and copy_call_s / fired_ip_s,
            "in_place_vs_torch_ref": ref_s / ip_s, "out_of_place_vs_torch_ref": ref_s / oop_s,
            "verified": verified,
        })
    step("done")
    return rows


def _graph_call(
    graphs: Any, stream: Any, ids: np.ndarray, src: torch.Tensor | None, layers: int
) -> Callable[[], None]:
    """One request's launch through ``GraphLaunches``, every layer: staged (block i from source row i), or
    direct (``src`` None: in place)."""

    def call() -> None:
        if graphs.launch(stream, ids, src, (0, layers), None) is None:
            raise RuntimeError(f"the graph launch was declined ({graphs.broken or 'no graph free'})")

    return call


def _verify(shape, cache, ids, dtype, src, tuning) -> bool:
    """Kernel and reference bytes agree on the whole allocation, in place and out of place."""
    from sidecar.convert import triton_kernel

    ok = True
    for s in (None, src):
        mine, ref = cache.clone(), cache.clone()
        triton_kernel.Launcher(_job(shape, mine, ids, dtype, s), tuning)()
        run_reference(_job(shape, ref, ids, dtype, s))
        ok = ok and torch.equal(mine, ref)
        del mine, ref
    return ok


# ---- report ----------------------------------------------------------------------------------------------

def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU {line.split(':', 1)[1].strip()} ({torch.get_num_threads()} threads)"
    except OSError:
        pass
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def must_show(rows: list[dict], device: torch.device) -> list[str]:
    """The issue's must-show ratios that do not hold (empty: all hold)."""
    fails = []
    for r in rows:
        if "skipped" in r:
            fails.append(f"{r['shape']}: not measured ({r['skipped']})")
            continue
        tag = f"{r['shape']}" + (f" [{r['variant']}]" if r.get("variant") not in (None, "default") else "")
        if device.type != "cuda":
            if r["torch_ref_vs_copy"] < CPU_REF_MIN:
                fails.append(f"{tag}: CPU reference {r['torch_ref_vs_copy']:.3f} of copy < {CPU_REF_MIN}")
            continue
        if r["shape"] == IN_PLACE_SHAPE and r["in_place_vs_copy"] < IN_PLACE_MIN:
            fails.append(f"{tag}: in place {r['in_place_vs_copy']:.3f} of copy < {IN_PLACE_MIN}")
        if r["out_of_place_vs_copy"] < OUT_OF_PLACE_MIN:
            fails.append(f"{tag}: out of place {r['out_of_place_vs_copy']:.3f} of copy < {OUT_OF_PLACE_MIN}")
        # per call (issue 12): each form through the daemon's graph
        ip_call = r["per_call_in_place_graph_vs_copy_per_call"]
        oop_call = r["per_call_out_of_place_graph_vs_copy_per_call"]
        if r["shape"] == IN_PLACE_SHAPE and (ip_call or 0.0) < IN_PLACE_MIN:
            got = "not measured (no graph form)" if ip_call is None else f"{ip_call:.3f} of a copy per call"
            fails.append(f"{tag}: in place per call {got} < {IN_PLACE_MIN}")
        if oop_call < OUT_OF_PLACE_MIN:
            fails.append(f"{tag}: out of place per call {oop_call:.3f} of a copy per call < "
                         f"{OUT_OF_PLACE_MIN}")
        if r["kernel_vs_copy"] < FASTER_MIN:
            fails.append(f"{tag}: faster form {r['kernel_vs_copy']:.3f} of copy < {FASTER_MIN}")
        for form in ("in_place", "out_of_place"):
            if r[f"{form}_vs_torch_ref"] < OVER_REF_MIN:
                fails.append(f"{tag}: {form} only {r[f'{form}_vs_torch_ref']:.1f}x the torch reference")
        if r["verified"] is False:
            fails.append(f"{tag}: kernel bytes differ from the reference")
    return fails


def _table(rows: list[dict], title: str):
    from rich.table import Table

    t = Table(title=title)
    cuda = rows and rows[0]["kernel_GBps"] is not None
    cols = ["shape", "GB", "copy GB/s", "torch ref GB/s"]
    if cuda:
        cols += ["variant", "in place GB/s", "mode", "out of place GB/s", "kernel/copy",
                 "per call ÷ copy per call: ip/oop, graphs ip/oop, fired ip/oop", "x ref",
                 "bit-exact"]
    for c in cols:
        t.add_column(c, justify="left" if c in ("shape", "variant", "mode") else "right")
    for r in rows:
        cells = [r["shape"], f"{2 * r['request_GB']:.3f}", f"{r['copy_GBps']:.0f}",
                 f"{r['torch_ref_GBps']:.0f} ({r['torch_ref_vs_copy']:.0%})"]
        if cuda:
            cells += [str(r["variant"]), f"{r['kernel_in_place_GBps']:.0f} ({r['in_place_vs_copy']:.0%})",
                      r["in_place_mode"],
                      f"{r['kernel_out_of_place_GBps']:.0f} ({r['out_of_place_vs_copy']:.0%})",
                      f"{r['kernel_vs_copy']:.0%}",
                      f"{r['per_call_in_place_vs_copy_per_call']:.0%} / "
                      f"{r['per_call_out_of_place_vs_copy_per_call']:.0%}, "
                      f"{_share(r['per_call_in_place_graph_vs_copy_per_call'])} / "
                      f"{r['per_call_out_of_place_graph_vs_copy_per_call']:.0%}, "
                      f"{_share(r.get('per_call_in_place_fired_vs_copy_per_call'))} / "
                      f"{_share(r.get('per_call_out_of_place_fired_vs_copy_per_call'))}",
                      f"{min(r['in_place_vs_torch_ref'], r['out_of_place_vs_torch_ref']):.1f}",
                      {True: "yes", False: "NO", None: "-"}[r["verified"]]]
        t.add_row(*cells)
    return t


def _share(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.0%}"


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["shape"] + ("" if r["variant"] in (None, "default") else f"\n[{r['variant']}]") for r in rows]
    series = [("copy", "copy_GBps"), ("torch reference", "torch_ref_GBps")]
    if rows[0]["kernel_GBps"] is not None:
        series += [("kernel in place", "kernel_in_place_GBps"),
                   ("kernel out of place", "kernel_out_of_place_GBps")]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.3 * len(rows) + 2), 4.8))
    for i, (label, key) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(rows))]
        ax.bar(xs, [r[key] for r in rows], width, label=label)
    ax.set_xticks(range(len(rows)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("GB/s (bytes read + written)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, ncols=len(series), loc="upper center", bbox_to_anchor=(0.5, -0.22), frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- entry -----------------------------------------------------------------------------------------------

def _pick_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU")
    return device


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    device = _pick_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    shapes = args.shapes or (GPU_SHAPES if device.type == "cuda" else CPU_SHAPES)
    reps = args.reps or (20 if device.type == "cuda" else 5)
    variants = args.variant
    if device.type == "cuda" and not variants:
        from sidecar.convert.tuning import TUNING

        variants = [("default", TUNING)]
    dtype = getattr(torch, args.dtype)
    name = device_name(device)
    now = dt.datetime.now(dt.UTC)
    timer = device_timer(device, args.warmup, reps)
    rows: list[dict] = []
    steps_per_shape = 2 + (len(variants) if variants else 0)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=False) as progress:
        task = progress.add_task("bench convert", total=len(shapes) * steps_per_shape)
        for shape in shapes:
            def step(what, shape=shape):
                progress.update(task, description=f"{shape.name}: {what}")
                if what != "copy":
                    progress.advance(task)

            try:
                rows += measure(shape, device, dtype, timer, variants or [], not args.no_verify, step,
                                kernel=device.type == "cuda",
                                cache_blocks=args.cache_blocks if device.type == "cuda" else 0)
            except torch.OutOfMemoryError as exc:
                why = f"out of device memory: {str(exc).splitlines()[0]}"
                console.print(f"[yellow]{shape.name}: skipped, {why}[/yellow]")
                rows.append({"shape": shape.name, "skipped": why})
            if device.type == "cuda":
                torch.cuda.empty_cache()
    meta = {"device": name, "date": now.isoformat(timespec="seconds"), "command": _command_line(),
            "torch": torch.__version__, "triton": _triton_version(device), "reps": reps,
            "warmup": args.warmup}
    rows = [{**r, **meta} for r in rows]
    measured = [r for r in rows if "skipped" not in r]
    title = f"kv-sidecar bench convert — {name}, {args.dtype}, {now.date()}"
    if measured:
        console.print(_table(measured, title))
    out_dir = args.out_dir or (Path("bench/results") if Path("bench/results").is_dir() else Path("."))
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = args.tag or (name.split()[-1].lower() if device.type == "cuda" else "cpu")
    stem = out_dir / f"convert-{re.sub(r'[^a-z0-9]+', '-', tag.lower())}-{now.date()}"
    stem.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    console.print(f"wrote {stem.with_suffix('.json')}")
    if not args.no_plot and measured:
        plot(measured, stem.with_suffix(".png"), title)
        console.print(f"wrote {stem.with_suffix('.png')}")
    fails = must_show(rows, device)
    for f in fails:
        console.print(f"[red]must-show not met:[/red] {f}")
    if not fails:
        console.print("must-show ratios: all met")
    return 1 if (args.check and fails) else 0


def _command_line() -> str:
    prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    if prog == "kv-sidecar":
        return shlex.join(["kv-sidecar", *sys.argv[1:]])
    if prog == "convert.py":
        return shlex.join(["python", "-m", "sidecar.bench.convert", *sys.argv[1:]])
    return shlex.join(sys.argv)


def _triton_version(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    import triton

    return triton.__version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kv-sidecar bench convert", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
