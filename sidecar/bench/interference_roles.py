"""The interference bench's processes (see ``interference``): what conversions cost a decoder's running
requests on the same GPU.

Three processes: this one (orchestrator), a decoder stand-in (``decode_step.DecodeStep`` in a loop, one CUDA
graph per step, every step's start/end from GPU events) owning the paged KV cache, and a converter that
imports the cache by CUDA IPC and converts requests arriving as a Poisson process through the daemon's own
launch code (``sidecar.convert.launch.launch_gpu`` / ``convert_paced``) on its own stream. NOT the full
daemon (no NIXL read, no socket round trips): that keeps one sweep inside one short GPU call; the GPU work
that competes with decode -- the conversion kernels -- is exactly the daemon's.

For each group of settings that needs its own processes (MPS on/off, MPS percentage) the decoder first runs
alone (baseline), then each (setting, context, rate) phase; the decoder's steps and the converter's
conversions are mapped to one host clock, so collisions are counted exactly. One JSON and one PNG under
``--out``. Break-even: ``kv-sidecar bench break-even`` on that JSON.
Messages between the processes are msgspec JSON lines (``@@`` prefix on the children's stdout).
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any

import msgspec
import numpy as np

from sidecar.bench import interference_stats as st

PREFIX = "@@"


class Setting(msgspec.Struct, frozen=True):
    """One way of sharing the GPU, as the bench runs it."""

    name: str
    mps: bool = False
    mps_percent: int = 0  # converter's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (0: none)
    max_slice_pairs: int = 0
    slice_gap_us: float = 0.0
    max_ctas: int = 0
    decoder_high_priority: bool = False  # the decoder's stream at the highest priority (shared context only)


class Phase(msgspec.Struct, frozen=True):
    setting: str
    context: int
    rate: float
    seconds: float
    seed: int


class StepsReply(msgspec.Struct):
    steps: list[tuple[float, float]]


class Conversion(msgspec.Struct):
    arrival: float
    launched: float
    gpu_start: float
    gpu_end: float


class ConvertReply(msgspec.Struct):
    conversions: list[Conversion]


# ----------------------------------------------------------------------------------------- child roles


def _say(obj: Any) -> None:
    sys.stdout.write(PREFIX + msgspec.json.encode(obj).decode() + "\n")
    sys.stdout.flush()


def _read() -> dict[str, Any]:
    line = sys.stdin.readline()
    if not line:
        raise SystemExit(0)
    return msgspec.json.decode(line)


class Clock:
    """Maps this process's CUDA events to host monotonic seconds (an anchor per phase); CPU: identity."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def anchor(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            self.ev = torch.cuda.Event(enable_timing=True)
            t0 = time.monotonic()
            self.ev.record()
            self.ev.synchronize()
            self.t = t0

    def mark(self, stream: Any = None) -> Any:
        if not self.cuda:
            return time.monotonic()
        import torch

        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)
        return e

    def seconds(self, mark: Any) -> float:
        return mark if not self.cuda else self.t + self.ev.elapsed_time(mark) * 1e-3


def _device(name: str) -> Any:
    import torch

    return torch.device(name)


def _shape(tiny: bool) -> Any:
    from sidecar.bench.decode_step import TINY, ModelShape

    return TINY if tiny else ModelShape()


def role_decoder(cfg: dict[str, Any]) -> None:
    import torch

    from sidecar.bench.decode_step import DecodeStep, kv_bytes_per_step
    from sidecar.wire import ipc

    dev = _device(cfg["device"])
    cuda = dev.type == "cuda"
    s = _shape(cfg["tiny"])
    rng = np.random.default_rng(cfg["seed"])
    lens = rng.integers(cfg["context_min"], cfg["context_max"] + 1, size=cfg["batch"])
    pages = [-(-int(n) // s.block_size) for n in lens]
    running = sum(pages)
    nb = running + cfg["spare_blocks"]
    perm = rng.permutation(running)  # running requests' pages scattered over the cache, as after churn
    tables = torch.zeros((cfg["batch"], max(pages)), dtype=torch.int32)
    o = 0
    for b, n in enumerate(pages):
        tables[b, :n] = torch.from_numpy(perm[o : o + n].astype(np.int32))
        o += n
    nbytes = s.layers * 2 * nb * s.row * 2
    if cuda:
        torch.cuda.set_device(dev)
        raw = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        desc = ipc.export_cuda_storage(raw.untyped_storage())
    else:
        shm = ipc.create_shm_buffer(nbytes)
        raw, desc = shm.tensor, shm.description
    cache = raw.view(torch.bfloat16).view(s.layers, 2, nb, s.row)
    gen = torch.Generator(device=dev).manual_seed(cfg["seed"])
    for layer in range(s.layers):  # random finite values (random bf16 bits would hold NaNs)
        cache[layer].normal_(generator=gen)
    step = DecodeStep(s, [cache[lay, 0] for lay in range(s.layers)],
                      [cache[lay, 1] for lay in range(s.layers)],
                      tables, torch.from_numpy(lens.astype(np.int32)), seed=cfg["seed"])
    err = step.check_attention() if cuda else 0.0
    step.capture()
    streams = {False: torch.cuda.Stream(dev) if cuda else None}
    if cuda:
        lo, hi = torch.cuda.Stream.priority_range()
        streams[True] = torch.cuda.Stream(dev, priority=hi)
    clock = Clock(cuda)
    _say({"ready": True, "cache": msgspec.to_builtins(desc), "num_blocks": nb, "first_free": running,
          "attention_rel_err": err, "kv_bytes_per_step": kv_bytes_per_step(s, lens), "lens": lens.tolist()})
    while True:
        cmd = _read()
        if cmd.get("cmd") == "quit":
            return
        stream = streams[bool(cmd.get("high_priority"))]
        clock.anchor()
        marks = []
        end = time.monotonic() + cmd["seconds"]
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            while time.monotonic() < end:
                a = clock.mark(stream)
                step()
                b = clock.mark(stream)
                if cuda:
                    b.synchronize()  # a decoder samples each step's token on the host before the next
                marks.append((a, b))
        _say(StepsReply(steps=[(clock.seconds(a), clock.seconds(b)) for a, b in marks]))


def role_converter(cfg: dict[str, Any]) -> None:
    import types

    import torch

    from sidecar.bench.decode_step import ModelShape
    from sidecar.convert import PlaneSet
    from sidecar.convert.launch import (
        ConversionLimits,
        convert_blocks,
        convert_paced,
        launch_gpu,
        make_stream,
    )
    from sidecar.wire import ipc
    from sidecar.wire.formats import AITER_SHUFFLED

    dev = _device(cfg["device"])
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(dev)
    s: ModelShape = _shape(cfg["tiny"])
    buf = ipc.import_buffer(msgspec.convert(cfg["cache"], ipc.IpcBuffer))
    nb, first_free = cfg["num_blocks"], cfg["first_free"]
    cache = buf.tensor.view(torch.bfloat16).view(s.layers, 2, nb, s.row)
    ps = PlaneSet([cache[lay, 0] for lay in range(s.layers)], [cache[lay, 1] for lay in range(s.layers)],
                  num_heads=s.kv_heads, block_size=s.block_size, head_size=s.head_size)
    ps.warm_up()
    caches = types.SimpleNamespace(plane_set=ps)  # launch_gpu reads only the caches' checked planes
    fmt = AITER_SHUFFLED
    settings = {k: msgspec.convert(v, Setting) for k, v in cfg["settings"].items()}
    srcs = {}
    for c in cfg["contexts"]:
        m = c // s.block_size
        src = torch.empty((s.layers, m, 2 * s.row), dtype=torch.bfloat16, device=dev)
        src.view(torch.int16).random_(-(2**12), 2**12)
        srcs[c] = src
    stream = make_stream(dev, ConversionLimits(low_priority=True)) if cuda else None
    clock = Clock(cuda)
    rng = np.random.default_rng(cfg["seed"])

    def limits_of(name: str) -> ConversionLimits:
        x = settings[name]
        return ConversionLimits(max_slice_pairs=x.max_slice_pairs, slice_gap_us=x.slice_gap_us,
                                max_ctas=x.max_ctas, low_priority=True)

    def one(context: int, lim: ConversionLimits) -> tuple[Any, Any]:
        m = context // s.block_size
        ids = first_free + rng.permutation(nb - first_free)[:m]
        src = srcs[context] if cfg["staged"] else None
        a = clock.mark(stream)
        if not cuda:
            convert_blocks(caches, ids, fmt, src, None, lim)
        elif lim.slice_gap_us:
            convert_paced(stream, caches, ids, fmt, src, None, lim)
        else:
            launch_gpu(stream, caches, ids, fmt, src, None, lim)
        return a, clock.mark(stream)

    # the kernel's GPU time alone (the decoder is idle now), per (context, setting): break-even's input
    alone: dict[str, dict[str, float]] = {}
    for name in settings:
        lim = limits_of(name)
        for c in cfg["contexts"]:
            clock.anchor()
            one(c, lim)  # compiles any new variant
            marks = [one(c, lim) for _ in range(cfg["alone_reps"])]
            if cuda:
                torch.cuda.synchronize()
            d = [clock.seconds(b) - clock.seconds(a) for a, b in marks]
            alone.setdefault(name, {})[str(c)] = float(np.median(d)) * 1e3
    _say({"ready": True, "alone_ms": alone, "verified": _verify(ps, dev, s, settings, limits_of)})
    while True:
        cmd = _read()
        if cmd.get("cmd") == "quit":
            return
        ph = msgspec.convert(cmd["phase"], Phase)
        lim = limits_of(ph.setting)
        arrivals = st.poisson_arrivals(ph.rate, ph.seconds, np.random.default_rng(ph.seed))
        clock.anchor()
        t0 = time.monotonic()
        recs = []
        for off in arrivals:
            delay = t0 + off - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            launched = time.monotonic()
            a, b = one(ph.context, lim)
            recs.append((t0 + off, launched, a, b))
        rest = t0 + ph.seconds - time.monotonic()
        if rest > 0:
            time.sleep(rest)
        if cuda:
            torch.cuda.synchronize()
        _say(ConvertReply(conversions=[Conversion(arrival=r[0], launched=r[1], gpu_start=clock.seconds(r[2]),
                                                  gpu_end=clock.seconds(r[3])) for r in recs]))


def _verify(ps: Any, dev: Any, s: Any, settings: dict[str, Setting], limits_of: Any) -> dict[str, bool]:
    """Each setting's launches give the same bytes as the default launch, in place and out of place, on
    scratch planes (never the decoder's): slicing and grid caps must not change the result."""
    import types

    import torch

    from sidecar.convert import PlaneSet
    from sidecar.convert.launch import ConversionLimits, convert_blocks
    from sidecar.wire.formats import AITER_SHUFFLED

    out = {}
    nb, m = 64, 40
    base = torch.empty((s.layers, 2, nb, s.row), dtype=torch.bfloat16, device=dev)
    base.view(torch.int16).random_(-(2**15), 2**15 - 1)
    src = torch.empty((s.layers, m, 2 * s.row), dtype=torch.bfloat16, device=dev)
    src.view(torch.int16).random_(-(2**15), 2**15 - 1)
    ids = np.random.default_rng(1).permutation(nb)[:m]
    results = {}
    for name in ["__default__", *settings]:
        lim = ConversionLimits() if name == "__default__" else limits_of(name)
        for staged in (False, True):
            c = base.clone()
            planes = PlaneSet([c[i, 0] for i in range(s.layers)], [c[i, 1] for i in range(s.layers)],
                              num_heads=s.kv_heads, block_size=s.block_size, head_size=s.head_size)
            convert_blocks(types.SimpleNamespace(plane_set=planes), ids, AITER_SHUFFLED,
                           src if staged else None, None, lim)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            results[(name, staged)] = c.view(torch.int16)
    for name in settings:
        out[name] = all(torch.equal(results[(name, st_)], results[("__default__", st_)])
                        for st_ in (False, True))
    return out


def main() -> None:
    """``python -m sidecar.bench.interference_roles decoder|converter``: config as the first stdin line."""
    role = sys.argv[1]
    cfg = _read()
    if cfg["device"] == "cpu":
        import torch

        torch.set_num_threads(1)  # two processes share the CI's few cores
    (role_decoder if role == "decoder" else role_converter)(cfg)


if __name__ == "__main__":
    main()
