"""The daemon's launch on a GPU (``launch_gpu`` -> ``PlaneSet.convert_arrays`` -> one pinned table copy):
bit-exact against the vLLM-writer truth of conftest (in place, out of place, through a source index, in
layer groups, in slices, with a capped grid, through the in-place scratch, fp8 re-encode against the CPU),
never waiting for work already queued on its stream, and never reusing a pinned table before its copy ran."""

from __future__ import annotations

import gc
import time
import types

import numpy as np
import pytest
import torch

from sidecar.convert import PlaneSet
from sidecar.convert.launch import ConversionLimits, convert_blocks, launch_gpu, make_stream
from sidecar.convert.tuning import Tuning
from sidecar.wire import fp8
from sidecar.wire.formats import AITER_SHUFFLED

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]
DEV = "cuda:0"
MODES = ["in_place", "staged", "indexed"]
LIMITS = [None, ConversionLimits(max_slice_pairs=3), ConversionLimits(max_ctas=2),
          ConversionLimits(max_slice_pairs=5, max_ctas=3)]
GROUPS = [[(0, 3)], [(0, 1), (1, 3)]]



def _spanned(case, width, rng):
    """The case's pages planted at random distinct rows of a junk-filled [L, width, page] span."""
    layers, m, page = case.src.shape
    span = rng.integers(-32768, 32768, size=(layers, width, page), dtype=np.int64).astype(np.int16)
    rows = rng.permutation(width)[:m]
    span[:, rows] = case.src
    return span, rows.astype(np.int64)


def _rig(cases, case, mode, dtype, rng):
    """GPU planes holding the case's before-state, the daemon's caches stand-in, the source and its rows."""
    k0, v0 = (case.in_place_k, case.in_place_v) if mode == "in_place" else (case.before_k, case.before_v)
    ks, vs = cases.planes(k0, dtype, DEV), cases.planes(v0, dtype, DEV)
    h, n, d = case.geom
    ps = PlaneSet(ks, vs, num_heads=h, block_size=n, head_size=d)
    src = rows = None
    if mode == "staged":
        src = torch.from_numpy(case.src).to(DEV).view(dtype)
    elif mode == "indexed":
        span, rows = _spanned(case, 2 * case.src.shape[1] + 3, rng)
        src = torch.from_numpy(span).to(DEV).view(dtype)
    return types.SimpleNamespace(ks=ks, vs=vs, ps=ps, caches=types.SimpleNamespace(plane_set=ps), src=src,
                                 rows=rows)


def _case(cases, layers, blocks, m, h, n, d, word, rng):
    case = cases.make_case(layers, blocks, cases.distinct_ids(rng, blocks, m), h, n, d, word, seed=h + n + d)
    case.geom = (h, n, d)
    return case


def _launch(stream, rig, ids, layers, limits=None, rows=None):
    src = None if rig.src is None else rig.src[layers[0] : layers[1]]
    return launch_gpu(stream, rig.caches, ids, AITER_SHUFFLED, src, layers, limits, None, None,
                      rig.rows if rows is None else rows)


def _side_stream():
    stream = make_stream(torch.device(DEV))
    stream.wait_stream(torch.cuda.current_stream(DEV))  # the planes and sources were written there
    return stream


def _assert_writer_truth(cases, rig, case, what):
    assert np.array_equal(cases.bits(rig.ks), case.want_k), f"{what}: K planes differ"
    assert np.array_equal(cases.bits(rig.vs), case.want_v), f"{what}: V planes differ"


@pytest.mark.parametrize(("h", "n", "d"), [(8, 16, 128), (3, 32, 64), (1, 16, 256)], ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("limits", range(len(LIMITS)))
@pytest.mark.parametrize("groups", range(len(GROUPS)))
def test_daemon_launch_matches_the_writer(cases, no_reference, h, n, d, mode, limits, groups):
    rng = np.random.default_rng(h * 100 + d + limits)
    for word in (0, 1):
        case = _case(cases, 3, 11, 6, h, n, d, word, rng)
        rig = _rig(cases, case, mode, torch.bfloat16, rng)
        stream = _side_stream()
        for layers in GROUPS[groups]:
            event = _launch(stream, rig, case.ids, layers, LIMITS[limits])
        event.synchronize()
        _assert_writer_truth(cases, rig, case, f"{mode}, limits {LIMITS[limits]}, groups {GROUPS[groups]}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_daemon_launch_of_one_block_and_of_every_block(cases, no_reference, mode, dtype):
    rng = np.random.default_rng(3)
    for m in (1, 9):
        case = _case(cases, 2, 9, m, 8, 16, 128, 1, rng)
        rig = _rig(cases, case, mode, cases.DTYPES[dtype], rng)
        stream = _side_stream()
        _launch(stream, rig, case.ids, (0, 2)).synchronize()
        _assert_writer_truth(cases, rig, case, f"{mode}, {m} blocks")


def test_scratch_chunks_ride_the_same_copy(cases, no_reference):
    """In place through a scratch of 3 pairs: several chunk tables in the one pinned upload."""
    h, n, d = 3, 16, 128
    rng = np.random.default_rng(8)
    case = _case(cases, 3, 12, 7, h, n, d, 0, rng)
    rig = _rig(cases, case, "in_place", torch.bfloat16, rng)
    stream = _side_stream()
    with torch.cuda.stream(stream):
        rig.ps.convert_arrays(case.ids, layers=(0, 3), tuning=Tuning(in_place="scratch",
                                                                     scratch_bytes=3 * 4 * h * n * d))
    stream.synchronize()
    _assert_writer_truth(cases, rig, case, "in place through the scratch")


def _fp8_rig(std, blocks, ids, h, n, d, device, mode, lut, rows=None):
    layers, half = std.shape[0], h * n * d
    ks = [torch.zeros((blocks, half), dtype=torch.uint8, device=device) for _ in range(layers)]
    vs = [torch.zeros((blocks, half), dtype=torch.uint8, device=device) for _ in range(layers)]
    src = None
    if mode == "in_place":
        for i in range(layers):
            ks[i][torch.from_numpy(ids)] = std[i, :, :half].to(device)
            vs[i][torch.from_numpy(ids)] = std[i, :, half:].to(device)
    else:
        src = std.to(device)
        if mode == "indexed":
            span = torch.randint(0, 256, (layers, 2 * len(ids) + 1, 2 * half), dtype=torch.int32)
            span = span.to(torch.uint8)
            span[:, torch.from_numpy(rows)] = std
            src = span.to(device)
        src = src.view(torch.float8_e4m3fn)
    fnuz = torch.float8_e4m3fnuz
    plain = PlaneSet([k.view(fnuz) for k in ks], [v.view(fnuz) for v in vs], num_heads=h, block_size=n,
                     head_size=d)
    reenc = PlaneSet([k.view(fnuz) for k in ks], [v.view(fnuz) for v in vs], num_heads=h, block_size=n,
                     head_size=d, lut=lut)
    return ks, vs, types.SimpleNamespace(plane_set=plain), reenc, src


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scales", [(1.0, 1.0, 1.0, 1.0), (1.0, 4.0, 2.0, 0.5)])
def test_fp8_reencode_launch_matches_the_cpu(no_reference, mode, scales):
    """The daemon's fp8 e4m3fn -> e4m3fnuz launch (its own PlaneSet with a table, counts collected) gives
    the CPU twin's bytes and counts, in two layer groups."""
    h, n, d, blocks = 8, 16, 128, 9
    ids = np.array([3, 8, 0, 5])
    g = torch.Generator().manual_seed(len(mode))
    std = torch.randint(0, 256, (3, len(ids), 2 * h * n * d), generator=g, dtype=torch.int32).to(torch.uint8)
    rows = np.array([6, 0, 8, 3]) if mode == "indexed" else None
    lut = fp8.pair_table(*scales)
    got = []
    for device in (DEV, "cpu"):
        ks, vs, caches, reenc, src = _fp8_rig(std, blocks, ids, h, n, d, device, mode, lut, rows)
        counts = []
        stream = _side_stream() if device != "cpu" else None
        for layers in [(0, 1), (1, 3)]:
            part = None if src is None else src[layers[0] : layers[1]]
            if device == "cpu":
                counts.append(convert_blocks(caches, ids, AITER_SHUFFLED, part, layers, None, reenc, rows))
            else:
                event = launch_gpu(stream, caches, ids, AITER_SHUFFLED, part, layers, None, reenc, counts,
                                   rows)
        if device != "cpu":
            event.synchronize()
        total = sum(c.cpu() for c in counts).tolist()
        got.append((torch.stack([k.cpu() for k in ks]), torch.stack([v.cpu() for v in vs]), total))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    assert got[0][2] == got[1][2]
    assert not torch.equal(got[1][0], torch.zeros_like(got[1][0]))


def _sleep_cycles(ms: float) -> int:
    """``torch.cuda._sleep`` cycles that keep this GPU busy about ``ms`` milliseconds."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    a.record()
    torch.cuda._sleep(1_000_000)
    b.record()
    b.synchronize()
    return int(1_000_000 * ms / max(1e-3, a.elapsed_time(b)))


def _queue_sleep(stream, cycles):
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)
        ahead = torch.cuda.Event()
        ahead.record(stream)
    return ahead


@pytest.mark.parametrize("mode", MODES)
def test_launch_returns_while_queued_work_still_runs(cases, no_reference, mode):
    """A ~300 ms kernel is queued on the conversion stream first; every launch of the request (three layer
    groups) returns while that kernel is still running, each in a small fraction of it (a launch that
    waited for the stream would take the whole 300 ms), and the bytes are right afterwards. How fast a
    launch is, is `bench launch`'s to say (H200: 0.5-1 ms for a first launch on new planes)."""
    h, n, d, layers, groups = 8, 16, 128, 4, [(0, 1), (1, 3), (3, 4)]
    rng = np.random.default_rng(21)
    stream = _side_stream()
    cycles = _sleep_cycles(300.0)
    # Warm, on other planes of the same shape: the kernels compiled, the pinned and device allocators
    # holding as many blocks as a request's launches use while the stream is busy.
    warm_case = _case(cases, layers, 40, 16, h, n, d, 0, rng)
    warm = _rig(cases, warm_case, mode, torch.bfloat16, rng)
    warm.ps.warm_up()
    for _ in range(2):
        _queue_sleep(stream, cycles // 30)
        for group in groups:
            _launch(stream, warm, warm_case.ids, group)
        stream.synchronize()

    case = _case(cases, layers, 40, 16, h, n, d, 1, rng)
    rig = _rig(cases, case, mode, torch.bfloat16, rng)
    stream.wait_stream(torch.cuda.current_stream(DEV))
    gc.collect()
    ahead = _queue_sleep(stream, cycles)
    took = []
    for group in groups:
        t0 = time.perf_counter()
        event = _launch(stream, rig, case.ids, group)
        took.append(time.perf_counter() - t0)
    still_running = not ahead.query()
    event.synchronize()
    assert still_running, "the queued kernel ended before the launches returned: they waited for it"
    assert max(took) < 0.03, f"launch host times {[round(t * 1e6) for t in took]} µs"
    _assert_writer_truth(cases, rig, case, f"{mode} behind a queued kernel")


def test_pinned_tables_are_not_reused_before_their_copy_ran(cases, no_reference):
    """16 launches of 2 blocks each, all queued behind a long kernel: each one's pinned ids buffer is handed
    back at once, so a buffer reused before its copy ran would convert another launch's blocks."""
    h, n, d, layers = 2, 16, 64, 2
    rng = np.random.default_rng(5)
    stream = _side_stream()
    cycles = _sleep_cycles(200.0)
    warm_case = _case(cases, layers, 40, 32, h, n, d, 1, rng)  # the same launches on other planes first
    warm = _rig(cases, warm_case, "indexed", torch.bfloat16, rng)
    warm.ps.warm_up()
    _queue_sleep(stream, cycles // 20)
    for i in range(0, 32, 2):
        _launch(stream, warm, warm_case.ids[i : i + 2], (0, layers), rows=warm.rows[i : i + 2])
    stream.synchronize()
    case = _case(cases, layers, 40, 32, h, n, d, 0, rng)
    rig = _rig(cases, case, "indexed", torch.bfloat16, rng)
    stream.wait_stream(torch.cuda.current_stream(DEV))
    ahead = _queue_sleep(stream, cycles)
    for i in range(0, 32, 2):
        _launch(stream, rig, case.ids[i : i + 2], (0, layers), rows=rig.rows[i : i + 2])
    still_running = not ahead.query()
    stream.synchronize()
    assert still_running
    _assert_writer_truth(cases, rig, case, "16 launches behind a queued kernel")


def test_meta_tables_are_built_once_per_layer_range_and_source(cases, no_reference):
    h, n, d = 8, 16, 128
    rng = np.random.default_rng(9)
    case = _case(cases, 3, 30, 4, h, n, d, 0, rng)
    rig = _rig(cases, case, "staged", torch.bfloat16, rng)
    stream = _side_stream()
    for _ in range(5):  # the same request's groups again and again, fresh ids each time
        ids = rng.permutation(30)[:4]
        for layers in [(0, 1), (1, 3)]:
            _launch(stream, rig, ids, layers)
    stream.synchronize()
    assert rig.ps.tables.misses == 2 and rig.ps.tables.hits == 8
    assert len(rig.ps.sources) == 2


@pytest.mark.parametrize("mode", MODES)
def test_warm_launches_go_past_tritons_binder(cases, no_reference, mode, monkeypatch):
    """Once a variant has run, later launches of it (new ids, other layer groups of the same size) reach the
    compiled kernel directly: with Triton's ``JITFunction.run`` made to fail they still convert
    bit-exactly."""
    import triton

    from sidecar.convert import triton_kernel as tk

    if not tk.DIRECT_LAUNCH:
        pytest.skip(f"Triton {triton.__version__} launches through its binder")
    h, n, d = 8, 16, 128
    rng = np.random.default_rng(31)
    warm_case = _case(cases, 4, 20, 6, h, n, d, 0, rng)
    warm = _rig(cases, warm_case, mode, torch.bfloat16, rng)
    stream = _side_stream()
    for layers in [(0, 2), (2, 4)]:
        _launch(stream, warm, warm_case.ids, layers)
    stream.synchronize()
    _assert_writer_truth(cases, warm, warm_case, f"{mode} warm-up")

    def refuse(*args, **kwargs):
        raise AssertionError("a warm launch went through Triton's binder")

    monkeypatch.setattr(triton.runtime.jit.JITFunction, "run", refuse)
    case = _case(cases, 4, 20, 6, h, n, d, 1, rng)
    rig = _rig(cases, case, mode, torch.bfloat16, rng)
    stream = _side_stream()
    for layers in [(0, 2), (2, 4)]:
        event = _launch(stream, rig, case.ids, layers)
    event.synchronize()
    _assert_writer_truth(cases, rig, case, f"{mode} through the compiled kernels")

