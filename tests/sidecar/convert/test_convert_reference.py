"""The CPU path of the public converters against an independent model of vLLM's writers (see conftest)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.convert import PlaneSet, convert_layers_standard_to_shuffled, convert_standard_to_shuffled

HEADS = [1, 2, 3, 4, 5, 7, 8]
GRID = list(itertools.product(HEADS, [16, 32], [64, 128, 256], ["bfloat16", "float16"]))


def run_single(c, case, dtype, in_place: bool, h: int, n: int, d: int) -> None:
    k_src, v_src = (case.in_place_k, case.in_place_v) if in_place else (case.before_k, case.before_v)
    ks, vs = c.planes(k_src, dtype), c.planes(v_src, dtype)
    ids = torch.tensor(case.ids)
    src = None if in_place else torch.from_numpy(case.src[0]).view(dtype)
    convert_standard_to_shuffled(ks[0], vs[0], ids, num_heads=h, block_size=n, head_size=d, src=src)
    np.testing.assert_array_equal(c.bits(ks), case.want_k)
    np.testing.assert_array_equal(c.bits(vs), case.want_v)


@pytest.mark.parametrize(("h", "n", "d", "dtype"), GRID, ids=lambda v: str(v))
def test_single_layer_matches_vllm_writer(cases, h, n, d, dtype):
    rng = np.random.default_rng(h * 1000 + n * 10 + d)
    ids = cases.distinct_ids(rng, 7, 4)  # unsorted, with gaps; three blocks stay untouched
    for word in (0, 1):
        case = cases.make_case(1, 7, ids, h, n, d, word, seed=word)
        for in_place in (True, False):
            run_single(cases, case, cases.DTYPES[dtype], in_place, h, n, d)


@pytest.mark.parametrize(("h", "n", "d"), [(8, 16, 128), (3, 32, 64), (5, 16, 256)])
@pytest.mark.parametrize("in_place", [True, False])
def test_batched_layers_in_one_allocation(cases, h, n, d, in_place):
    """LHBNC: layer l is [K plane (B blocks) | V plane (B blocks)], all layers back to back."""
    layers, blocks = 3, 6
    ids = [4, 0, 2]
    for word in (0, 1):
        case = cases.make_case(layers, blocks, ids, h, n, d, word, seed=7)
        k0, v0 = (case.in_place_k, case.in_place_v) if in_place else (case.before_k, case.before_v)
        cache = torch.from_numpy(np.stack([k0, v0], axis=1).copy()).view(torch.bfloat16)  # [L, 2, B, HND]
        src = None if in_place else torch.from_numpy(case.src).view(torch.bfloat16)
        convert_layers_standard_to_shuffled([cache[i, 0] for i in range(layers)],
                                            [cache[i, 1] for i in range(layers)],
                                            torch.tensor(ids, dtype=torch.int32),
                                            num_heads=h, block_size=n, head_size=d, src=src)
        got = cache.view(torch.int16).numpy()
        np.testing.assert_array_equal(got[:, 0], case.want_k)
        np.testing.assert_array_equal(got[:, 1], case.want_v)


def test_batched_layers_in_separate_padded_allocations(cases):
    """Planes with row padding and sources given as a list; the padding is never written."""
    h, n, d, layers, blocks, pad = 3, 16, 64, 2, 5, 24
    ids = [3, 1]
    for word in (0, 1):
        case = cases.make_case(layers, blocks, ids, h, n, d, word, seed=3)
        for in_place in (True, False):
            k0, v0 = (case.in_place_k, case.in_place_v) if in_place else (case.before_k, case.before_v)
            bufs = []
            for arr in (*k0, *v0):
                buf = torch.full((blocks, arr.shape[1] + pad), -1, dtype=torch.int16)
                buf[:, : arr.shape[1]] = torch.from_numpy(arr)
                bufs.append(buf)
            views = [b.view(torch.float16)[:, : h * n * d] for b in bufs]
            src = None
            if not in_place:  # staged rows with a stride too
                padded = [torch.nn.functional.pad(torch.from_numpy(s), (0, 8)) for s in case.src]
                src = [p.view(torch.float16)[:, : 2 * h * n * d] for p in padded]
            convert_layers_standard_to_shuffled(views[:layers], views[layers:], torch.tensor(ids),
                                                num_heads=h, block_size=n, head_size=d, src=src)
            got = np.stack([b.numpy() for b in bufs])
            np.testing.assert_array_equal(got[:layers, :, : h * n * d], case.want_k)
            np.testing.assert_array_equal(got[layers:, :, : h * n * d], case.want_v)
            assert (got[:, :, h * n * d:] == -1).all()


def test_ids_on_any_int_dtype_and_empty_ids(cases):
    h, n, d = 2, 16, 64
    case = cases.make_case(1, 4, [2, 0], h, n, d, 0)
    for idt in (torch.int16, torch.int32, torch.int64, torch.uint8):
        ks, vs = cases.planes(case.in_place_k, torch.bfloat16), cases.planes(case.in_place_v, torch.bfloat16)
        convert_standard_to_shuffled(ks[0], vs[0], torch.tensor([2, 0], dtype=idt), num_heads=h, block_size=n,
                                     head_size=d)
        np.testing.assert_array_equal(cases.bits(ks), case.want_k)
    ks, vs = cases.planes(case.in_place_k, torch.bfloat16), cases.planes(case.in_place_v, torch.bfloat16)
    convert_standard_to_shuffled(ks[0], vs[0], torch.tensor([], dtype=torch.int64), num_heads=h, block_size=n,
                                 head_size=d)
    np.testing.assert_array_equal(cases.bits(ks), case.in_place_k)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    h=st.integers(1, 8),
    n=st.sampled_from([16, 32]),
    d=st.sampled_from([64, 128, 256]),
    dtype=st.sampled_from(["bfloat16", "float16"]),
    layers=st.integers(1, 3),
    blocks=st.integers(1, 9),
    data=st.data(),
)
def test_hypothesis_in_scope_space(cases, h, n, d, dtype, layers, blocks, data):
    order = data.draw(st.permutations(range(blocks)))
    ids = order[: data.draw(st.integers(0, blocks))]  # unsorted, any subset size, gaps likely
    in_place = data.draw(st.booleans())
    word = data.draw(st.sampled_from([0, 1]))
    case = cases.make_case(layers, blocks, list(ids), h, n, d, word, seed=len(ids))
    k0, v0 = (case.in_place_k, case.in_place_v) if in_place else (case.before_k, case.before_v)
    ks, vs = cases.planes(k0, cases.DTYPES[dtype]), cases.planes(v0, cases.DTYPES[dtype])
    src = None if in_place else torch.from_numpy(case.src).view(cases.DTYPES[dtype])
    convert_layers_standard_to_shuffled(ks, vs, torch.tensor(list(ids), dtype=torch.int64), num_heads=h,
                                        block_size=n, head_size=d, src=src)
    np.testing.assert_array_equal(cases.bits(ks), case.want_k)
    np.testing.assert_array_equal(cases.bits(vs), case.want_v)


@pytest.mark.parametrize("in_place", [True, False])
def test_plane_set_converts_layer_ranges_independently(cases, in_place):
    """A PlaneSet (planes checked once) converting layer groups one at a time, as the daemon does when each
    group's read lands: every group exact, layers outside the group never written."""
    layers, blocks, (h, n, d) = 4, 6, (3, 16, 64)
    ids = [5, 1, 3]
    case = cases.make_case(layers, blocks, ids, h, n, d, 1, seed=11)
    k0, v0 = (case.in_place_k, case.in_place_v) if in_place else (case.before_k, case.before_v)
    cache = torch.from_numpy(np.stack([k0, v0], axis=1).copy()).view(torch.float16)  # [L, 2, B, HND]
    planes = PlaneSet([cache[i, 0] for i in range(layers)], [cache[i, 1] for i in range(layers)],
                      num_heads=h, block_size=n, head_size=d)
    src = None if in_place else torch.from_numpy(case.src).view(torch.float16)
    converted: set[int] = set()
    for first, last in [(1, 3), (0, 1), (3, 4)]:
        planes.convert(torch.tensor(ids), src=None if src is None else src[first:last], layers=(first, last))
        converted |= set(range(first, last))
        got = cache.view(torch.int16).numpy()
        for layer in range(layers):
            done = layer in converted
            np.testing.assert_array_equal(got[layer, 0], case.want_k[layer] if done else k0[layer],
                                          err_msg=f"K, after group {first}:{last}, layer {layer}")
            np.testing.assert_array_equal(got[layer, 1], case.want_v[layer] if done else v0[layer],
                                          err_msg=f"V, after group {first}:{last}, layer {layer}")
