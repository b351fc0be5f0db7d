"""``kv-sidecar bench launch``: host CPU time of one conversion launch, old, new and graph paths side by side.

The graph path (GPU) is the daemon's call with ``conversion_graphs`` on: a staged launch replayed from a CUDA
graph (``sidecar.convert.graphs``), in place the new path. The new path is the daemon's call with graphs off,
``launch_gpu`` (``Conversions.convert_group`` times the same call as each Done's ``launch``), on its own
stream, with random block ids in a cache of ``--blocks`` blocks. The old path is the launch as it was before
its tables went through pinned memory, replayed here: the full ``check_request`` on torch ids, the meta table
rebuilt, one pageable host-to-device copy per table (each may first wait for the work already queued on the
stream), a fresh zeroed counts tensor and the kernel launched through Triton's binder. Each is timed per call
(p50/p99 µs) for a staged request (``staged``), a staged span with gap rows read through a source index
(``staged_gaps``) and in place, as one launch for every layer or one launch per layer group, with the stream
idle (synchronised before each call, untimed), busy (a ~1 ms kernel queued on the stream just before each
call: a launch that waits for it shows ~1 ms; ``pending_after`` is the share of calls that returned while that
kernel still ran) and queued (8 requests' launches back to back, as the daemon's groups and requests queue).
Then each path's bytes are checked against the torch reference on the same device. ``--graph-programs N`` adds
the graphcap path: graphs of the persistent out-of-place kernel on N programs.

The new path's parts are also timed alone (``components_us``): the checks, the tables (built and sent), the
Triton launch (``DirectKernel``, and through Triton's binder), the stream switch and the event; and the graph
path's as the daemon splits it (``graph_fire_us``): the prepare done while a read runs, the fire left after it
lands, the fire's own parts, and the CUDA calls one fire makes (one ``torch.profiler`` pass). On the CPU
the same paths run through the torch reference on a small shape (the times then include the conversion
itself) and the bytes are checked the same way.

Usage on a GPU: ``python -m sidecar.bench.probe_launch --out $OUT/launch-probe.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import itertools
import json
import os
import platform
import shlex
import sys
import time
import types
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sidecar.convert import PlaneSet
from sidecar.convert.checks import aligned16, check_launch, check_request
from sidecar.convert.launch import convert_blocks, launch_gpu
from sidecar.convert.reference import run_reference
from sidecar.convert.tables import upload
from sidecar.convert.tuning import Tuning
from sidecar.wire.formats import AITER_SHUFFLED

MODES = ("staged", "staged_gaps", "in_place")
GAP_DENSITY = 4  # staged_gaps: the span holds 4x the request's rows (25 % density)


@dataclass(frozen=True)
class ProbeShape:
    layers: int
    heads: int
    head_size: int
    block_size: int
    num_blocks: int  # blocks per plane: ids are drawn from [0, num_blocks)
    request_blocks: int  # blocks per request (4096 tokens / 16 = 256)

    @property
    def row(self) -> int:
        return self.heads * self.block_size * self.head_size


GPU_SHAPE = ProbeShape(layers=36, heads=8, head_size=128, block_size=16, num_blocks=8192, request_blocks=256)
CPU_SHAPE = ProbeShape(layers=6, heads=2, head_size=64, block_size=16, num_blocks=64, request_blocks=16)


def quantiles(xs: list[float]) -> dict[str, float]:
    """p50/p99/mean/max of seconds, in µs."""
    a = np.asarray(xs) * 1e6
    return {"n": len(xs), "p50_us": round(float(np.percentile(a, 50)), 2),
            "p99_us": round(float(np.percentile(a, 99)), 2), "mean_us": round(float(a.mean()), 2),
            "max_us": round(float(a.max()), 2)}


def layer_groups(layers: int, per_launch: int) -> list[tuple[int, int]]:
    """Layers [0, layers) as consecutive ranges of ``per_launch`` layers (the last may be shorter)."""
    return [(lo, min(lo + per_launch, layers)) for lo in range(0, layers, per_launch)]


class LaunchRig:
    """Planes, staging and ids of one probe: what both paths convert."""

    def __init__(self, shape: ProbeShape, device: torch.device, seed: int) -> None:
        self.shape, self.device = shape, device
        s = shape
        gen = torch.Generator(device=device).manual_seed(seed)
        # one allocation per layer, as vLLM's per-layer caches; random bits (any pattern: a permutation)
        self.k = [self._random((s.num_blocks, s.row), gen) for _ in range(s.layers)]
        self.v = [self._random((s.num_blocks, s.row), gen) for _ in range(s.layers)]
        self.ps = PlaneSet(self.k, self.v, num_heads=s.heads, block_size=s.block_size, head_size=s.head_size)
        self.caches = types.SimpleNamespace(plane_set=self.ps)  # what launch_gpu reads of the daemon's caches
        m = s.request_blocks
        self.stage = self._random((s.layers, m, 2 * s.row), gen)  # the request's staging slots
        self.span = self._random((s.layers, GAP_DENSITY * m, 2 * s.row), gen)  # a span read through gaps
        self.rng = np.random.default_rng(seed)
        self.old_launcher: Any = None  # GPU: the launcher class of the old path (``_pageable_launcher``)
        self.graphs: Any = None  # GPU: the graph path's ``GraphLaunches``
        self.graphs_capped: Any = None  # GPU, --graph-programs: the graphcap path's

    def _random(self, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.int16, device=self.device)
        t.random_(-(2**15), 2**15, generator=gen)
        return t.view(torch.bfloat16)

    def request(self, mode: str) -> tuple[np.ndarray, Any, np.ndarray | None]:
        """Fresh random ids (int64, distinct) and the source (all layers) and source rows of ``mode``."""
        s = self.shape
        ids = self.rng.choice(s.num_blocks, s.request_blocks, replace=False).astype(np.int64)
        if mode == "staged":
            return ids, self.stage, None
        if mode == "staged_gaps":
            rows = self.rng.choice(self.span.shape[1], s.request_blocks, replace=False)
            return ids, self.span, np.sort(rows).astype(np.int64)
        return ids, None, None


def _pageable_launcher() -> type:
    from sidecar.convert import triton_kernel as tk

    class PageableLauncher(tk.Launcher):
        """The launcher as it was: one pageable copy per table, a fresh zeroed counts tensor per launch,
        kernels launched through Triton's binder."""

        direct = False

        def __init__(self, job: Any, tuning: Any = tk.TUNING, tables: Any = None) -> None:
            super().__init__(job, tuning, None)  # no meta cache: rebuilt every launch
            if job.lut is None:
                counts = torch.zeros(2, dtype=torch.int64, device=job.device)
                self.reenc = dict(lut=counts, cnt=counts, REENC=False)

        @staticmethod
        def upload(segments: list[list[np.ndarray]], device: torch.device) -> list[torch.Tensor]:
            return [torch.from_numpy(np.concatenate([p.ravel() for p in seg])).to(device, non_blocking=True)
                    for seg in segments]

    return PageableLauncher


def old_launch(rig: LaunchRig, stream: Any, ids: np.ndarray, src: Any, layers: tuple[int, int],
               index: np.ndarray | None) -> Any:
    """The launch path before pinned tables, replayed (see the module's docstring); returns its event."""
    ps = rig.ps
    with torch.cuda.stream(stream):
        tid = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
        tix = None if index is None else torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64))
        job = check_request(ps.planes, tid, src, layers, src_index=tix)  # no memo: every check every time
        if aligned16(job):
            rig.old_launcher(job)()
        else:
            run_reference(job)
        event = torch.cuda.Event()
        event.record(stream)
    return event


def new_launch(rig: LaunchRig, stream: Any, ids: np.ndarray, src: Any, layers: tuple[int, int],
               index: np.ndarray | None) -> Any:
    """The daemon's call (``Conversions.convert_group``): ``launch_gpu`` on its stream."""
    return launch_gpu(stream, rig.caches, ids, AITER_SHUFFLED, src, layers, None, None, None, index)


def graph_path(graphs: Any) -> Launch:
    """The daemon's call with ``conversion_graphs`` on, through ``graphs``: a staged launch replayed from a
    CUDA graph, the ordinary launch when that is not taken (in place, or every graph of the size queued)."""

    def graph_launch(rig: LaunchRig, stream: Any, ids: np.ndarray, src: Any, layers: tuple[int, int],
                     index: np.ndarray | None) -> Any:
        event = None if src is None else graphs.launch(stream, ids, src, layers, index)
        return event if event is not None else new_launch(rig, stream, ids, src, layers, index)

    return graph_launch


def cpu_old(rig: LaunchRig, _stream: Any, ids: np.ndarray, src: Any, layers: tuple[int, int],
            index: np.ndarray | None) -> None:
    """The public path on the CPU: ``PlaneSet.convert`` on torch ids."""
    rig.ps.convert(torch.from_numpy(ids), src=src, layers=layers,
                   src_index=None if index is None else torch.from_numpy(index))


def cpu_new(rig: LaunchRig, _stream: Any, ids: np.ndarray, src: Any, layers: tuple[int, int],
            index: np.ndarray | None) -> None:
    """The daemon's CPU twin call: ``convert_blocks`` in its worker."""
    convert_blocks(rig.caches, ids, AITER_SHUFFLED, src, layers, None, None, index)


Launch = Callable[[LaunchRig, Any, np.ndarray, Any, tuple[int, int], "np.ndarray | None"], Any]


def _sub(src: Any, layers: tuple[int, int]) -> Any:
    return None if src is None else src[layers[0] : layers[1]]


STREAM_STATES = ("idle", "busy", "queued")
QUEUED_REQUESTS = 8  # "queued": requests launched back to back between synchronisations
REST_HOW = ("sleep", "spin", "sweep")
SWEEP_BYTES = 64 << 20  # "sweep": more than the host's last-level cache
SWEEP_CHUNK = 1 << 20
PRIMERS = ("none", "kernel", "query")


@dataclass(frozen=True)
class Rest:
    """What the thread does between two timed launches: rest ``seconds`` (``how``: see ``rest``), then,
    unless ``primer`` is "none", touch the GPU (an empty kernel on the launch's stream, or an event query)
    and spin ``primer_gap_s`` more, as a daemon would that primed the GPU when a Pull came in and launched
    its conversion after the Pull's checks and pairing."""

    seconds: float = 0.0
    how: str = "sleep"
    primer: str = "none"
    primer_gap_s: float = 0.0


def prime(stream: Any, primer: str, event: Any) -> None:
    """Touch the GPU once before a launch (``Rest.primer``)."""
    if primer == "kernel":
        with torch.cuda.stream(stream):
            torch.cuda._sleep(1)
    elif primer == "query":
        event.query()
    elif primer != "none":
        raise ValueError(f"prime: unknown primer {primer!r}; one of {', '.join(PRIMERS)}")


def rest(seconds: float, how: str, scratch: np.ndarray | None = None) -> None:
    """Pass ``seconds`` before a launch: asleep (the core may go idle, as the daemon's loop does waiting for
    the next Pull), spinning in Python (the core kept busy on a few lines of code), or sweeping ``scratch``
    (the core kept busy on other data, which pushes the launch's code and data out of its caches)."""
    end = time.perf_counter() + seconds
    if how == "sleep":
        time.sleep(seconds)
    elif how == "spin":
        while time.perf_counter() < end:
            pass
    elif how == "sweep":
        assert scratch is not None
        while time.perf_counter() < end:
            for lo in range(0, scratch.size, SWEEP_CHUNK):  # read and write every byte, as far as time allows
                scratch[lo : lo + SWEEP_CHUNK] += 1
                if time.perf_counter() >= end:
                    break
    else:
        raise ValueError(f"rest: unknown way {how!r}; one of {', '.join(REST_HOW)}")


def time_cell(rig: LaunchRig, stream: Any, launch: Launch, mode: str, per_launch: int, state: str, iters: int,
              warmup: int, busy_cycles: int, pause: Rest = Rest()) -> dict[str, Any]:
    """Host time of ``iters`` launches of ``mode``, ``per_launch`` layers each, fresh ids per request.
    ``state``: the stream synchronised before each call ("idle"), a ~1 ms kernel queued just before each
    call ("busy"), or every launch of ``QUEUED_REQUESTS`` requests queued back to back ("queued": each
    call finds the earlier ones' conversions still queued, as the daemon's layer groups and requests do).
    ``pause``: what the thread does before each call (``Rest``), as the daemon's loop comes to a launch from
    waiting for a Pull or a read; with a primer, ``primer_p50_us`` is the primer's own time."""
    cuda = rig.device.type == "cuda"
    groups = layer_groups(rig.shape.layers, per_launch)
    xs, primed, pending = [], [], 0
    calls = requests = 0
    scratch = np.zeros(SWEEP_BYTES, np.uint8) if pause.seconds and pause.how == "sweep" else None
    priming = cuda and pause.primer != "none"
    marker = torch.cuda.Event() if priming else None
    if marker is not None:
        marker.record(stream)
    while calls < warmup + iters:
        ids, src, index = rig.request(mode)
        if cuda and state == "queued" and requests % QUEUED_REQUESTS == 0:
            stream.synchronize()
        requests += 1
        for layers in groups:
            if calls >= warmup + iters:
                break
            ahead = None
            if cuda and state != "queued":
                stream.synchronize()
                if state == "busy":
                    with torch.cuda.stream(stream):
                        torch.cuda._sleep(busy_cycles)
                        ahead = torch.cuda.Event()
                        ahead.record(stream)
            if pause.seconds:
                rest(pause.seconds, pause.how, scratch)
            if priming:
                p0 = time.perf_counter()
                prime(stream, pause.primer, marker)
                if calls >= warmup:
                    primed.append(time.perf_counter() - p0)
                if pause.primer_gap_s:
                    rest(pause.primer_gap_s, "spin")
            t0 = time.perf_counter()
            launch(rig, stream, ids, _sub(src, layers), layers, index)
            took = time.perf_counter() - t0
            if calls >= warmup:
                xs.append(took)
                if ahead is not None and not ahead.query():
                    pending += 1
            calls += 1
    if cuda:
        stream.synchronize()
    out = quantiles(xs)
    if primed:
        out["primer_p50_us"] = quantiles(primed)["p50_us"]
    if state == "busy":
        out["pending_after"] = round(pending / max(1, len(xs)), 3)
    return out


def _gather(planes: list[torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    return torch.stack([p.view(torch.int16).index_select(0, ids) for p in planes])


def verify(rig: LaunchRig, stream: Any, launch: Launch, mode: str, per_launch: int) -> bool:
    """The path's bytes for one fresh request equal the torch reference's on the same input (the blocks'
    content before is put back between the two, so in place compares like with like)."""
    ids, src, index = rig.request(mode)
    tid = torch.from_numpy(ids).to(rig.device)
    before_k, before_v = _gather(rig.k, tid), _gather(rig.v, tid)
    for layers in layer_groups(rig.shape.layers, per_launch):
        launch(rig, stream, ids, _sub(src, layers), layers, index)
    if rig.device.type == "cuda":
        stream.synchronize()
    got_k, got_v = _gather(rig.k, tid), _gather(rig.v, tid)
    for planes, before in ((rig.k, before_k), (rig.v, before_v)):
        for layer, p in enumerate(planes):
            p.view(torch.int16).index_copy_(0, tid, before[layer])
    job = check_request(rig.ps.planes, torch.from_numpy(ids), src, None,
                        src_index=None if index is None else torch.from_numpy(index))
    run_reference(job)
    if rig.device.type == "cuda":
        torch.cuda.synchronize(rig.device)
    changed = not torch.equal(got_k, before_k)  # it converted something
    return changed and torch.equal(got_k, _gather(rig.k, tid)) and torch.equal(got_v, _gather(rig.v, tid))


def components(rig: LaunchRig, stream: Any, iters: int) -> dict[str, dict[str, Any]]:
    """The new path's parts, each timed alone (staged, one launch for every layer, stream idle)."""
    from sidecar.convert import triton_kernel as tk

    ps, layers = rig.ps, (0, rig.shape.layers)
    ids, src, _ = rig.request("staged")
    tid = torch.from_numpy(ids)
    job = check_launch(ps.planes, ids, src, layers, ps.sources)
    launcher = tk.Launcher(job, tk.TUNING, ps.tables)
    bound = rig.old_launcher(job)  # the old launcher: kernels through Triton's binder

    def event() -> None:
        e = torch.cuda.Event()
        e.record(stream)

    def switch() -> None:
        with torch.cuda.stream(stream):
            pass

    meta = ps.tables.get(job.plane_rows, job.src_rows, job.k_planes[0].data_ptr(), job.elem_bytes)
    segments = [[ids], [meta]]
    parts: dict[str, Callable[[], Any]] = {
        "tables: one pinned buffer, one copy": lambda: upload(segments, rig.device),
        "tables: one pageable copy each (old)": lambda: rig.old_launcher.upload(segments, rig.device),
        "check_request (public, torch ids)": lambda: check_request(ps.planes, tid, src, layers),
        "check_launch (daemon, numpy ids)": lambda: check_launch(ps.planes, ids, src, layers, ps.sources),
        "aligned16": lambda: aligned16(job),
        "Launcher() (tables built + one pinned copy)": lambda: tk.Launcher(job, tk.TUNING, ps.tables),
        "Launcher() old (tables rebuilt + pageable copies)": lambda: rig.old_launcher(job),
        "Triton launch only (DirectKernel)": launcher,
        "Triton launch only (Triton's binder)": bound,
        "stream switch (torch.cuda.stream)": switch,
        "Event() + record": event,
    }
    out = {}
    for name, fn in parts.items():
        xs = []
        for i in range(iters + 20):
            if i % 32 == 0:
                torch.cuda.synchronize(rig.device)
            with torch.cuda.stream(stream):
                t0 = time.perf_counter()
                fn()
                took = time.perf_counter() - t0
            if i >= 20:
                xs.append(took)
        out[name] = quantiles(xs)
    torch.cuda.synchronize(rig.device)
    return out


def fire_parts(rig: LaunchRig, stream: Any, iters: int) -> dict[str, Any]:
    """The graph path's launch split in two, as the daemon splits it (staged, one launch for every layer,
    stream idle): ``prepare`` (checks, a graph held, its table written; done while the bytes read) and
    ``fire`` (stream made current, the replay, the event; what is left once they have landed). The fire's
    own parts are timed alone too, and one profiled pass of fires lists the CUDA calls each fire makes."""
    from sidecar.convert.graphs import _restore_stream, _use_stream

    graphs, layers = rig.graphs, (0, rig.shape.layers)
    ids, src, _ = rig.request("staged")
    kept = torch.cuda.Event()

    def prepared() -> Any:
        torch.cuda.synchronize(rig.device)  # the graph's last copy has run: prepare takes it again
        got = graphs.prepare(ids, src, layers)
        if got is None:
            raise RuntimeError(f"graph launch not taken: {graphs.stats}, broken: {graphs.broken}")
        return got

    def entry() -> Any:
        ready = prepared()
        ready.fire(stream)
        return ready.entry

    def timed(setup: Callable[[], Any], fn: Callable[[Any], Any]) -> dict[str, Any]:
        xs = []
        for i in range(iters + 20):
            arg = setup()
            t0 = time.perf_counter()
            fn(arg)
            took = time.perf_counter() - t0
            if i >= 20:
                xs.append(took)
        torch.cuda.synchronize(rig.device)
        return quantiles(xs)

    def replay(graph_entry: Any) -> None:
        previous = _use_stream(stream)
        t0 = time.perf_counter()
        graph_entry.graph.replay()
        replays.append(time.perf_counter() - t0)
        _restore_stream(previous)

    def prepared_exec() -> int:
        ready = prepared()
        ready.fire(stream)  # captured once; then its executable graph is launched directly
        torch.cuda.synchronize(rig.device)
        return ready.entry.graph.raw_cuda_graph_exec()

    def sync() -> None:
        torch.cuda.synchronize(rig.device)

    def prepare_and_drop() -> None:
        got = graphs.prepare(ids, src, layers)
        if got is not None:
            got.drop()

    replays: list[float] = []
    out: dict[str, Any] = {
        "prepare (checks, graph held, table written)": timed(sync, lambda _: prepare_and_drop()),
        "fire (stream, replay, event)": timed(prepared, lambda ready: ready.fire(stream)),
        "stream made current and restored": timed(sync, lambda _: _restore_stream(_use_stream(stream))),
        "Event() + record": timed(lambda: None, lambda _: torch.cuda.Event().record(stream)),
        "record on a kept Event": timed(lambda: None, lambda _: kept.record(stream)),
    }
    timed(entry, replay)
    out["replay only"] = quantiles(replays[20:])
    launch = _graph_launch_fn()
    if launch is not None:  # the same graph launched without torch's replay (its prologue, its guard)
        out["cudaGraphLaunch through ctypes"] = timed(
            lambda: prepared_exec(), lambda handle: launch(handle, stream.cuda_stream))
    else:
        out["cudaGraphLaunch through ctypes"] = "not available (no raw_cuda_graph_exec or no libcudart)"
    out["fire_profile"] = _profile_fires(prepared, stream, 20)
    return out


def _graph_launch_fn() -> Callable[[int, int], None] | None:
    """``cudaGraphLaunch(exec, stream)`` through ctypes on the CUDA runtime torch loaded, or None."""
    import ctypes

    if not hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec"):
        return None
    rt = None
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        with contextlib.suppress(OSError):
            rt = ctypes.CDLL(name)
            break
    if rt is None:
        return None
    rt.cudaGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    rt.cudaGraphLaunch.restype = ctypes.c_int

    def launch(handle: int, stream_ptr: int) -> None:
        err = rt.cudaGraphLaunch(handle, stream_ptr)
        if err:
            raise RuntimeError(f"cudaGraphLaunch: error {err}")

    return launch


def _profile_fires(prepared: Callable[[], Any], stream: Any, fires: int) -> dict[str, float]:
    """The calls each fire makes, by name, per fire: CUDA runtime and driver calls and aten ops that began
    inside a fire (one ``torch.profiler`` pass; the prepares between the fires are left out). A fire's window
    is its annotation on the CPU (the profiler shows it on the GPU's timeline too, longer)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(fires):
            ready = prepared()
            with record_function("probe.fire"):
                ready.fire(stream)
    events = list(prof.events())
    windows = [(e.time_range.start, e.time_range.end) for e in events
               if e.name == "probe.fire" and e.device_type == DeviceType.CPU]
    counts: dict[str, float] = {}
    for e in events:
        if e.name != "probe.fire" and any(lo <= e.time_range.start < hi for lo, hi in windows):
            counts[e.name] = counts.get(e.name, 0) + 1
    return {name: round(n / max(1, len(windows)), 2) for name, n in sorted(counts.items())}


def sleep_cycles(device: torch.device, us: float) -> int:
    """``torch.cuda._sleep`` cycles that keep the GPU busy about ``us`` µs (measured here)."""
    probe = 1_000_000
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(probe)  # warm
    a.record()
    torch.cuda._sleep(probe)
    b.record()
    b.synchronize()
    per_us = probe / max(1e-3, a.elapsed_time(b) * 1e3)
    return max(1, int(per_us * us))


def _load_nixl(device: torch.device) -> Any:
    """A NIXL agent on ``device`` with one registered region (VRAM, or DRAM on the CPU), kept alive for the
    whole probe."""
    from sidecar.nixl.agent import NixlTransfer, TransferSettings

    cuda = device.type == "cuda"
    agent = NixlTransfer(TransferSettings(cuda_device=(device.index or 0) if cuda else None))
    region = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    agent.register([(region.data_ptr(), region.numel(), (device.index or 0) if cuda else 0)],
                   "VRAM" if cuda else "DRAM")
    agent.keep = region  # type: ignore[attr-defined]  # the registered memory lives as long as the agent
    return agent


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kv-sidecar bench launch", description=__doc__.split("\n")[0])
    p.add_argument("--device", default=None, help="cuda:N or cpu (default: cuda:0 when a GPU is present)")
    p.add_argument("--blocks", type=int, default=None, help="blocks per plane (GPU default 8192)")
    p.add_argument("--request-blocks", type=int, default=None, help="blocks per request (GPU default 256)")
    p.add_argument("--layers", type=int, default=None, help="layers (GPU default 36)")
    p.add_argument("--per-launch", default=None,
                   help="layers per launch, comma-separated (default: all layers, and 3)")
    p.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    p.add_argument("--iters", type=int, default=None, help="timed launches per cell (GPU 300, CPU 10)")
    p.add_argument("--busy-us", type=float, default=1000.0, help="the kernel queued before each busy call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rest-us", type=float, default=0.0,
                   help="host rest before each timed call (the daemon's loop comes to a launch from "
                   "waiting)")
    p.add_argument("--rest-how", choices=REST_HOW, default="sleep",
                   help="how the rest passes: asleep, spinning on a few lines of Python, or sweeping "
                   f"{SWEEP_BYTES >> 20} MiB (other data through the core's caches)")
    p.add_argument("--primer", choices=PRIMERS, default="none",
                   help="after the rest, touch the GPU first (an empty kernel on the stream, or an event "
                   "query), untimed; its own time is reported as primer_p50_us")
    p.add_argument("--primer-gap-us", type=float, default=0.0,
                   help="spin this long between the primer and the timed launch (the Pull's checks)")
    p.add_argument("--nixl", action="store_true",
                   help="load a NIXL agent (UCX, this GPU) with one registered VRAM region first, as the "
                   "daemon has: shows what UCX's CUDA hooks cost a launch")
    p.add_argument("--graph-programs", type=int, default=0,
                   help="also time graphs of the persistent out-of-place kernel on this many programs "
                   "(path 'graphcap'; 0: not)")
    p.add_argument("--paths", default=None,
                   help="only these paths, comma-separated (old, new, graph, graphcap)")
    p.add_argument("--out", default=None, help="JSON results file (default: print only)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    base = GPU_SHAPE if cuda else CPU_SHAPE
    shape = ProbeShape(layers=args.layers or base.layers, heads=base.heads, head_size=base.head_size,
                       block_size=base.block_size, num_blocks=args.blocks or base.num_blocks,
                       request_blocks=args.request_blocks or base.request_blocks)
    if shape.request_blocks > shape.num_blocks:
        raise SystemExit(f"--request-blocks {shape.request_blocks} > --blocks {shape.num_blocks}")
    per_launch = ([int(v) for v in args.per_launch.split(",")] if args.per_launch
                  else sorted({shape.layers, min(3, shape.layers)}, reverse=True))
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m!r}; modes: {', '.join(MODES)}")
    iters = args.iters or (300 if cuda else 10)
    if cuda:
        torch.cuda.set_device(device)
    agent = _load_nixl(device) if args.nixl else None
    rig = LaunchRig(shape, device, args.seed)
    stream = None
    paths: dict[str, Launch] = {"old": cpu_old, "new": cpu_new}
    busy_cycles = 0
    if cuda:
        from sidecar.convert.launch import make_stream

        rig.old_launcher = _pageable_launcher()
        rig.ps.warm_up()
        stream = make_stream(device)
        from sidecar.convert.graphs import GraphLaunches

        rig.graphs = GraphLaunches(rig.ps)
        paths = {"old": old_launch, "new": new_launch, "graph": graph_path(rig.graphs)}
        if args.graph_programs:  # the graph of a persistent kernel on a capped grid
            rig.graphs_capped = GraphLaunches(rig.ps, Tuning(oop_max_programs=args.graph_programs))
            paths["graphcap"] = graph_path(rig.graphs_capped)
        busy_cycles = sleep_cycles(device, args.busy_us)
    if args.paths:
        paths = {k: v for k, v in paths.items() if k in args.paths.split(",")}
    states = STREAM_STATES if cuda else ("idle",)
    cells = []
    print(f"{'mode':12s} {'layers/launch':>13s} {'stream':6s} {'path':8s} {'p50 µs':>9s} {'p99 µs':>9s} "
          f"{'pending':>7s} {'primer':>7s}", flush=True)
    warmup = 20 if cuda else 2
    for mode, per, where, (name, launch) in itertools.product(modes, per_launch, states, paths.items()):
        pause = Rest(args.rest_us * 1e-6, args.rest_how, args.primer, args.primer_gap_us * 1e-6)
        got = time_cell(rig, stream, launch, mode, per, where, iters, warmup, busy_cycles, pause)
        cells.append({"path": name, "mode": mode, "layers_per_launch": per, "stream": where, **got})
        print(f"{mode:12s} {per:13d} {where:6s} {name:8s} {got['p50_us']:9.1f} {got['p99_us']:9.1f} "
              f"{got.get('pending_after', ''):>7} {got.get('primer_p50_us', ''):>7}", flush=True)
    verified = {name: {f"{mode}/{per}": verify(rig, stream, launch, mode, per) for mode in modes
                       for per in per_launch} for name, launch in paths.items()}
    print("bit-exact against the torch reference:", json.dumps(verified), flush=True)
    report: dict[str, Any] = {
        "bench": "launch",
        "what": __doc__.split("\n\n")[1].replace("\n", " "),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": "kv-sidecar bench launch " + shlex.join(sys.argv[1:] if argv is None else argv),
        "host": platform.node(),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "shape": asdict(shape),
        "settings": {"iters": iters, "graph_programs": args.graph_programs, "per_launch": per_launch,
                     "modes": modes, "busy_us": args.busy_us,
                     "rest_us": args.rest_us, "rest_how": args.rest_how, "primer": args.primer,
                     "primer_gap_us": args.primer_gap_us, "nixl_agent": agent is not None,
                     "ucx_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")},
                     "queued_requests": QUEUED_REQUESTS,
                     "gap_density": 1 / GAP_DENSITY, "seed": args.seed},
        "note": None if cuda else "CPU: both paths convert through the torch reference inside the call, so "
        "these times include the conversion (not launch times); only the bytes check means the same",
        "cells": cells,
        "verified": verified,
        "all_verified": all(all(v.values()) for v in verified.values()),
    }
    if cuda:
        import triton

        report["versions"]["triton"] = triton.__version__
        report["components_us"] = components(rig, stream, iters)
        if rig.graphs is not None:
            report["graph_fire_us"] = fire_parts(rig, stream, iters)
        for name, q in {**report["components_us"], **report.get("graph_fire_us", {})}.items():
            if "p50_us" in q:
                print(f"{name:52s} p50 {q['p50_us']:8.1f} µs  p99 {q['p99_us']:8.1f} µs", flush=True)
        print("per fire:", json.dumps(report.get("graph_fire_us", {}).get("fire_profile")), flush=True)
        report["tables"] = {"meta_cache_hits": rig.ps.tables.hits, "meta_cache_misses": rig.ps.tables.misses}
        report["graphs"] = {name: {**g.stats, "held": g.count, "broken": g.broken}
                            for name, g in (("graph", rig.graphs), ("graphcap", rig.graphs_capped)) if g}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print("wrote", args.out)
    return 0 if report["all_verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
