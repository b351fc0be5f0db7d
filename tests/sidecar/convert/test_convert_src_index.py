"""Out-of-place conversion with a per-block source index: block ``ids[i]`` reads source row ``src_index[i]``.

The daemon reads a span of remote blocks through small gaps into staging, so the staged rows of a request are
in remote-address order with rows of other requests' blocks in between. Every case here plants the request's
standard pages at random rows of a wider span filled with junk, and the result must be bit-exact the
vLLM-writer truth of conftest (the same truth as without an index), with every other block untouched.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from sidecar.convert import PlaneSet
from sidecar.convert.launch import ConversionLimits, convert_blocks

SHAPES = list(itertools.product([1, 2, 3, 5, 8], [16, 32], [64, 128, 256]))


def spanned(case, width: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The case's pages ([L, M, page]) planted at random distinct rows of a junk-filled [L, width, page]."""
    layers, m, page = case.src.shape
    span = rng.integers(-32768, 32768, size=(layers, width, page), dtype=np.int64).astype(np.int16)
    rows = rng.permutation(width)[:m]
    span[:, rows] = case.src
    return span, rows.astype(np.int64)


def run_cpu(cases, case, dtype, src, index, h, n, d, layers=None):
    ks, vs = cases.planes(case.before_k, dtype), cases.planes(case.before_v, dtype)
    ps = PlaneSet(ks, vs, num_heads=h, block_size=n, head_size=d)
    ps.convert(torch.from_numpy(case.ids), src=torch.from_numpy(src).view(dtype), layers=layers,
               src_index=None if index is None else torch.from_numpy(index))
    return cases.bits(ks), cases.bits(vs)


@pytest.mark.parametrize(("h", "n", "d"), SHAPES, ids=str)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_indexed_source_matches_the_writer(cases, h, n, d, dtype):
    rng = np.random.default_rng(h * 1000 + n * 10 + d)
    layers, blocks = 2, 9
    ids = cases.distinct_ids(rng, blocks, 4)
    for word in (0, 1):
        case = cases.make_case(layers, blocks, ids, h, n, d, word, seed=h + n + d)
        span, rows = spanned(case, 7, rng)
        got_k, got_v = run_cpu(cases, case, cases.DTYPES[dtype], span, rows, h, n, d)
        np.testing.assert_array_equal(got_k, case.want_k)
        np.testing.assert_array_equal(got_v, case.want_v)


@pytest.mark.parametrize(("m", "width"), [(0, 0), (0, 3), (1, 1), (1, 5), (3, 3), (5, 12)])
def test_every_width_and_count(cases, m, width):
    """No rows, one row, a span exactly as wide as the request (a permutation) and wider ones."""
    rng = np.random.default_rng(m * 31 + width)
    h, n, d, layers, blocks = 2, 16, 64, 3, 8
    ids = cases.distinct_ids(rng, blocks, m)
    case = cases.make_case(layers, blocks, ids, h, n, d, 1, seed=m)
    span, rows = spanned(case, width, rng)
    got_k, got_v = run_cpu(cases, case, torch.bfloat16, span, rows, h, n, d)
    np.testing.assert_array_equal(got_k, case.want_k)
    np.testing.assert_array_equal(got_v, case.want_v)


def test_identity_index_equals_no_index(cases):
    h, n, d = 3, 16, 128
    case = cases.make_case(2, 6, [4, 0, 5, 2], h, n, d, 0, seed=2)
    plain = run_cpu(cases, case, torch.float16, case.src, None, h, n, d)
    indexed = run_cpu(cases, case, torch.float16, case.src, np.arange(4), h, n, d)
    np.testing.assert_array_equal(plain[0], indexed[0])
    np.testing.assert_array_equal(plain[1], indexed[1])
    np.testing.assert_array_equal(plain[0], case.want_k)


def test_listed_sources_and_layer_ranges(cases):
    """Sources as a list of [W, page] tensors, and one layer group at a time (the daemon's path)."""
    rng = np.random.default_rng(5)
    h, n, d, layers = 4, 16, 64, 4
    case = cases.make_case(layers, 10, [7, 1, 8, 3, 0], h, n, d, 1, seed=4)
    span, rows = spanned(case, 9, rng)
    ks, vs = cases.planes(case.before_k, torch.bfloat16), cases.planes(case.before_v, torch.bfloat16)
    ps = PlaneSet(ks, vs, num_heads=h, block_size=n, head_size=d)
    src = torch.from_numpy(span).view(torch.bfloat16)
    for first, last in [(2, 4), (0, 1), (1, 2)]:
        ps.convert(torch.from_numpy(case.ids), src=list(src[first:last].unbind(0)), layers=(first, last),
                   src_index=torch.from_numpy(rows))
    np.testing.assert_array_equal(cases.bits(ks), case.want_k)
    np.testing.assert_array_equal(cases.bits(vs), case.want_v)


@pytest.mark.parametrize("max_pairs", [1, 2, 3, 5, 7, 100])
def test_sliced_launches_keep_the_index(cases, max_pairs):
    """``convert_blocks`` with a slice cap: each slice converts its blocks from their own source rows."""
    rng = np.random.default_rng(max_pairs)
    h, n, d, layers = 2, 16, 64, 3
    case = cases.make_case(layers, 8, [6, 2, 7, 0], h, n, d, 0, seed=9)
    span, rows = spanned(case, 11, rng)
    ks, vs = cases.planes(case.before_k, torch.bfloat16), cases.planes(case.before_v, torch.bfloat16)
    ps = PlaneSet(ks, vs, num_heads=h, block_size=n, head_size=d)
    convert_blocks(None, case.ids, None, torch.from_numpy(span).view(torch.bfloat16),
                   limits=ConversionLimits(max_slice_pairs=max_pairs), planes=ps, src_index=rows)
    np.testing.assert_array_equal(cases.bits(ks), case.want_k)
    np.testing.assert_array_equal(cases.bits(vs), case.want_v)


def _plane_set(h=2, n=16, d=64, blocks=4):
    k = torch.zeros((blocks, h * n * d), dtype=torch.bfloat16)
    v = torch.zeros_like(k)
    return PlaneSet([k], [v], num_heads=h, block_size=n, head_size=d), k, v


@pytest.mark.parametrize(
    ("index", "rows", "message"),
    [
        ([0, 1], 3, "src_index shape"),
        ([0, 3, 1], 3, "out of range"),
        ([0, -1, 1], 3, "out of range"),
        ("float", 3, "integer type"),
        ("list", 3, "must be a torch.Tensor"),
    ],
)
def test_bad_index_is_refused_before_any_write(index, rows, message):
    ps, k, v = _plane_set()
    before = (k.clone(), v.clone())
    src = torch.ones((1, rows, 2 * k.shape[1]), dtype=torch.bfloat16)
    if index == "float":
        idx = torch.tensor([0.0, 1.0, 2.0])
    elif index == "list":
        idx = [0, 1, 2]
    else:
        idx = torch.tensor(index)
    with pytest.raises(ValueError, match=message):
        ps.convert(torch.tensor([0, 1, 2]), src=src, src_index=idx)
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])


def test_index_without_source_is_refused():
    ps, _, _ = _plane_set()
    with pytest.raises(ValueError, match="src_index needs a src"):
        ps.convert(torch.tensor([0, 1]), src_index=torch.tensor([0, 1]))


def test_without_index_the_row_count_must_still_match():
    ps, k, _ = _plane_set()
    with pytest.raises(ValueError, match="src shape"):
        ps.convert(torch.tensor([0, 1]), src=torch.ones((1, 3, 2 * k.shape[1]), dtype=torch.bfloat16))


# -- the Triton kernel (GPU only): bit-exact against the CPU reference on the same input ------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")



@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("h", "n", "d"), [(1, 16, 64), (3, 32, 128), (8, 16, 128), (5, 16, 256), (8, 32, 64)]
)
@pytest.mark.parametrize("persistent", [0, 1, 2])
def test_kernel_with_index_matches_reference(cases, no_reference, h, n, d, persistent):
    from sidecar.convert.tuning import Tuning

    rng = np.random.default_rng(h * n + d)
    layers, blocks, dt = 3, 12, torch.bfloat16
    ids = cases.distinct_ids(rng, blocks, 5)
    # persistent: a capped grid whose programs loop (2: with loads pipelined two chunks ahead)
    tuning = Tuning(oop_max_programs=3, oop_stages=2 if persistent == 2 else 0) if persistent else None
    for word in (0, 1):
        case = cases.make_case(layers, blocks, ids, h, n, d, word, seed=h + d)
        span, rows = spanned(case, 9, rng)
        want = run_cpu(cases, case, dt, span, rows, h, n, d)
        ks, vs = cases.planes(case.before_k, dt, "cuda"), cases.planes(case.before_v, dt, "cuda")
        ps = PlaneSet(ks, vs, num_heads=h, block_size=n, head_size=d)
        ps.convert(torch.from_numpy(case.ids), src=torch.from_numpy(span).to("cuda").view(dt),
                   src_index=torch.from_numpy(rows), tuning=tuning)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(cases.bits(ks), want[0])
        np.testing.assert_array_equal(cases.bits(vs), want[1])
        np.testing.assert_array_equal(want[0], case.want_k)


@gpu
@pytest.mark.gpu
def test_kernel_index_with_layer_groups_and_no_index_unchanged(cases, no_reference):
    """Layer groups from one staged span (the daemon's path), then a plain out-of-place call still exact."""
    h, n, d, layers, dt = 8, 16, 128, 4, torch.float16
    rng = np.random.default_rng(1)
    case = cases.make_case(layers, 10, [9, 2, 5, 0], h, n, d, 1, seed=8)
    span, rows = spanned(case, 13, rng)
    ks, vs = cases.planes(case.before_k, dt, "cuda"), cases.planes(case.before_v, dt, "cuda")
    ps = PlaneSet(ks, vs, num_heads=h, block_size=n, head_size=d)
    src = torch.from_numpy(span).to("cuda").view(dt)
    for first, last in [(0, 1), (1, 3), (3, 4)]:
        ps.convert(torch.from_numpy(case.ids), src=src[first:last], layers=(first, last),
                   src_index=torch.from_numpy(rows))
    torch.cuda.synchronize()
    np.testing.assert_array_equal(cases.bits(ks), case.want_k)
    np.testing.assert_array_equal(cases.bits(vs), case.want_v)
    ks2, vs2 = cases.planes(case.before_k, dt, "cuda"), cases.planes(case.before_v, dt, "cuda")
    ps2 = PlaneSet(ks2, vs2, num_heads=h, block_size=n, head_size=d)
    ps2.convert(torch.from_numpy(case.ids), src=torch.from_numpy(case.src).to("cuda").view(dt))
    torch.cuda.synchronize()
    np.testing.assert_array_equal(cases.bits(ks2), case.want_k)
    np.testing.assert_array_equal(cases.bits(vs2), case.want_v)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("h", "n", "d"), [(5, 32, 64), (8, 16, 128)])
def test_warm_up_compiles_the_indexed_variant_too(cases, no_reference, h, n, d):
    """A first request read through gaps must not wait for a compile: warm_up covers the indexed kernel."""
    from sidecar.convert import triton_kernel as tk

    def compiled() -> int:
        return sum(len(cache[0]) for cache in tk.convert_kernel.device_caches.values())

    rng = np.random.default_rng(d)
    case = cases.make_case(3, 9, [7, 2, 4], h, n, d, 0, seed=5)
    span, rows = spanned(case, 6, rng)
    ks = cases.planes(case.before_k, torch.bfloat16, "cuda")
    vs = cases.planes(case.before_v, torch.bfloat16, "cuda")
    ps = PlaneSet(ks, vs, num_heads=h, block_size=n, head_size=d)
    ps.warm_up()
    before = compiled()
    ps.convert(torch.from_numpy(case.ids), src=torch.from_numpy(span).to("cuda").view(torch.bfloat16),
               src_index=torch.from_numpy(rows))
    torch.cuda.synchronize()
    assert compiled() == before
    np.testing.assert_array_equal(cases.bits(ks), case.want_k)
    np.testing.assert_array_equal(cases.bits(vs), case.want_v)
