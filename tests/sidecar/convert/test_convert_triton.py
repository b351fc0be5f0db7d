"""The Triton kernels on a GPU: bit-exact against the torch reference and the vLLM writer model (conftest)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from sidecar.convert import api, convert_layers_standard_to_shuffled, convert_standard_to_shuffled
from sidecar.convert.checks import check_job

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]

GRID = list(itertools.product([1, 2, 3, 4, 5, 7, 8], [16, 32], [64, 128, 256], ["bfloat16", "float16"]))
DEV = "cuda"



def cpu_reference(case, dtype, h, n, d, in_place):
    """The public CPU path (torch reference) on the same input."""
    k0, v0 = (case.in_place_k, case.in_place_v) if in_place else (case.before_k, case.before_v)
    ks = [torch.from_numpy(a.copy()).view(dtype) for a in k0]
    vs = [torch.from_numpy(a.copy()).view(dtype) for a in v0]
    src = None if in_place else torch.from_numpy(case.src).view(dtype)
    convert_layers_standard_to_shuffled(ks, vs, torch.from_numpy(case.ids), num_heads=h, block_size=n,
                                        head_size=d, src=src)
    return (np.stack([t.view(torch.int16).numpy() for t in ks]),
            np.stack([t.view(torch.int16).numpy() for t in vs]))


def lhbnc(k: np.ndarray, v: np.ndarray, dtype) -> torch.Tensor:
    """One allocation [L, 2, B, HND] on the GPU: each layer's K plane then its V plane."""
    return torch.from_numpy(np.stack([k, v], axis=1).copy()).to(DEV).view(dtype)


def assert_bits(got_k, got_v, want_k, want_v, what):
    assert np.array_equal(got_k, want_k), f"{what}: K planes differ"
    assert np.array_equal(got_v, want_v), f"{what}: V planes differ"


@pytest.mark.parametrize(("h", "n", "d", "dtype"), GRID, ids=lambda v: str(v))
def test_kernel_bit_exact(cases, no_reference, h, n, d, dtype):
    from sidecar.convert import triton_kernel

    dt = cases.DTYPES[dtype]
    geom = dict(num_heads=h, block_size=n, head_size=d)
    ids = [5, 1, 3, 6]  # unsorted with gaps; blocks 0, 2, 4 stay untouched
    for word in (0, 1):
        case = cases.make_case(2, 7, ids, h, n, d, word, seed=word)
        ref_in = cpu_reference(case, dt, h, n, d, in_place=True)
        ref_out = cpu_reference(case, dt, h, n, d, in_place=False)
        assert_bits(*ref_in, case.want_k, case.want_v, "reference, in place")
        assert_bits(*ref_out, case.want_k, case.want_v, "reference, out of place")

        # Single layer, in place and out of place, through the public entry point (ids on CPU and on GPU).
        for in_place, ids_dev in ((True, "cpu"), (False, DEV)):
            k0, v0 = (case.in_place_k, case.in_place_v) if in_place else (case.before_k, case.before_v)
            ks, vs = cases.planes(k0[:1], dt, DEV), cases.planes(v0[:1], dt, DEV)
            src = None if in_place else torch.from_numpy(case.src[0]).to(DEV).view(dt)
            convert_standard_to_shuffled(ks[0], vs[0], torch.tensor(ids, device=ids_dev), **geom, src=src)
            assert_bits(cases.bits(ks), cases.bits(vs), ref_in[0][:1] if in_place else ref_out[0][:1],
                        ref_in[1][:1] if in_place else ref_out[1][:1], f"single layer, in_place={in_place}")

        # Batched over both layers of one LHBNC allocation, in place and out of place (src as one tensor).
        for in_place in (True, False):
            k0, v0 = (case.in_place_k, case.in_place_v) if in_place else (case.before_k, case.before_v)
            cache = lhbnc(k0, v0, dt)
            src = None if in_place else torch.from_numpy(case.src).to(DEV).view(dt)
            convert_layers_standard_to_shuffled([cache[0, 0], cache[1, 0]], [cache[0, 1], cache[1, 1]],
                                                torch.tensor(ids), **geom, src=src)
            got = cache.view(torch.int16).cpu().numpy()
            ref = ref_in if in_place else ref_out
            assert_bits(got[:, 0], got[:, 1], *ref, f"batched, in_place={in_place}")

        # Every in-place strategy, whatever the default picks for this shape: through a small scratch (several
        # chunks), half the pair resident with and without prefetch, and the whole pair where it fits.
        Tuning = triton_kernel.Tuning
        forced = [Tuning(in_place="scratch", scratch_bytes=3 * 4 * h * n * d),
                  Tuning(in_place="split", prefetch=False), Tuning(in_place="split", prefetch=True),
                  Tuning(in_place="split", split_group=2),
                  Tuning(in_place="split", split_group=2, prefetch=False),
                  Tuning(in_place="split", k_direct=False),
                  Tuning(in_place="split", k_direct=True, prefetch=False)]
        if 4 * h * n * d <= 128 * 1024:
            forced += [Tuning(in_place="whole", whole_max_pair_bytes=1 << 30),
                       Tuning(in_place="whole", whole_max_pair_bytes=1 << 30, k_direct=True)]
        if 4 * h * n * d <= 64 * 1024:  # persistent programs that each loop over several pairs
            forced += [Tuning(in_place="pipe", pipe_max_programs=3), Tuning(in_place="pipe"),
                       Tuning(in_place="pipe", pipe_max_programs=3, k_direct=True)]
        for tuning in forced:
            cache = lhbnc(case.in_place_k, case.in_place_v, dt)
            job = check_job([cache[0, 0], cache[1, 0]], [cache[0, 1], cache[1, 1]], torch.tensor(ids), **geom,
                            srcs=None)
            launcher = triton_kernel.Launcher(job, tuning)
            assert launcher.strategy == tuning.in_place
            launcher()
            got = cache.view(torch.int16).cpu().numpy()
            assert_bits(got[:, 0], got[:, 1], *ref_in, f"in place with {tuning}")
        # Out of place: blocks of tokens x dims of one head; several heads per program.
        for tuning in (Tuning(oop_elems=1024, oop_max_dims=64), Tuning(oop_elems=65536, oop_max_dims=256),
                       Tuning(k_direct_oop=True), Tuning(k_direct_oop=True, oop_elems=1024, oop_max_dims=64)):
            cache = lhbnc(case.before_k, case.before_v, dt)
            src = torch.from_numpy(case.src).to(DEV).view(dt)
            job = check_job([cache[0, 0], cache[1, 0]], [cache[0, 1], cache[1, 1]], torch.tensor(ids), **geom,
                            srcs=[src[0], src[1]])
            triton_kernel.Launcher(job, tuning)()
            got = cache.view(torch.int16).cpu().numpy()
            assert_bits(got[:, 0], got[:, 1], *ref_out, f"out of place with {tuning}")


def test_batched_separate_allocations_and_src_list(cases, no_reference):
    h, n, d, dt = 3, 32, 128, torch.float16
    ids = [2, 0]
    for word in (0, 1):
        case = cases.make_case(3, 4, ids, h, n, d, word)
        for in_place in (True, False):
            k0, v0 = (case.in_place_k, case.in_place_v) if in_place else (case.before_k, case.before_v)
            ks, vs = cases.planes(k0, dt, DEV), cases.planes(v0, dt, DEV)
            src = None if in_place else [torch.from_numpy(s).to(DEV).view(dt) for s in case.src]
            convert_layers_standard_to_shuffled(ks, vs, torch.tensor(ids), num_heads=h, block_size=n,
                                                head_size=d, src=src)
            assert_bits(cases.bits(ks), cases.bits(vs), case.want_k, case.want_v, f"in_place={in_place}")


def test_misaligned_planes_fall_back_to_reference(cases):
    """A plane not on a 16-byte boundary cannot take the kernel's vectors: the reference converts it."""
    h, n, d, dt = 2, 16, 64, torch.bfloat16
    case = cases.make_case(1, 3, [2, 0], h, n, d, 0)
    row = h * n * d
    buf = torch.zeros(2 * 3 * row + 1, dtype=torch.int16, device=DEV)
    k = buf[1: 1 + 3 * row].view(3, row)
    v = buf[1 + 3 * row:].view(3, row)
    k.copy_(torch.from_numpy(case.in_place_k[0]))
    v.copy_(torch.from_numpy(case.in_place_v[0]))
    convert_standard_to_shuffled(k.view(dt), v.view(dt), torch.tensor([2, 0]), num_heads=h, block_size=n,
                                 head_size=d)
    assert_bits(k.cpu().numpy()[None], v.cpu().numpy()[None], case.want_k, case.want_v, "misaligned")


@pytest.mark.parametrize("in_place", [True, False])
def test_plane_set_layer_groups_on_the_gpu(cases, no_reference, in_place):
    """The daemon's path: planes checked once, layer groups converted by the kernel one launch each."""
    h, n, d, dt = 8, 16, 128, torch.bfloat16
    layers, ids = 5, [6, 1, 3, 0]
    case = cases.make_case(layers, 8, ids, h, n, d, 0, seed=3)
    k0, v0 = (case.in_place_k, case.in_place_v) if in_place else (case.before_k, case.before_v)
    cache = lhbnc(k0, v0, dt)
    planes = api.PlaneSet([cache[i, 0] for i in range(layers)], [cache[i, 1] for i in range(layers)],
                          num_heads=h, block_size=n, head_size=d)
    src = None if in_place else torch.from_numpy(case.src).to(DEV).view(dt)
    for first, last in [(0, 2), (2, 3), (3, 5)]:
        planes.convert(torch.tensor(ids), src=None if src is None else src[first:last], layers=(first, last))
    got = cache.view(torch.int16).cpu().numpy()
    assert_bits(got[:, 0], got[:, 1], case.want_k, case.want_v, f"layer groups, in_place={in_place}")


@pytest.mark.parametrize(("h", "n", "d"), [(3, 16, 96), (8, 16, 192), (2, 48, 128)], ids=lambda v: str(v))
def test_pages_off_the_powers_of_two_convert_whole(cases, no_reference, h, n, d):
    """Head or block sizes that are not powers of two (192 dims, 48 tokens): the out-of-place chunks divide
    them (no remainder left unconverted, as a 128-dim chunk of 192 did) and in place goes through the scratch
    (the on-chip kernels hold a whole head per power-of-two range)."""
    from sidecar.convert import triton_kernel

    dt, ids = torch.bfloat16, [5, 1, 3, 6]
    geom = dict(num_heads=h, block_size=n, head_size=d)
    case = cases.make_case(2, 7, ids, h, n, d, 0, seed=4)
    for in_place in (True, False):
        k0, v0 = (case.in_place_k, case.in_place_v) if in_place else (case.before_k, case.before_v)
        for tuning in (triton_kernel.TUNING, triton_kernel.Tuning(oop_elems=1024, oop_max_dims=64)):
            cache = lhbnc(k0, v0, dt)
            src = None if in_place else torch.from_numpy(case.src).to(DEV).view(dt)
            job = check_job([cache[0, 0], cache[1, 0]], [cache[0, 1], cache[1, 1]], torch.tensor(ids), **geom,
                            srcs=None if src is None else [src[0], src[1]])
            launcher = triton_kernel.Launcher(job, tuning)
            assert launcher.strategy == ("scratch" if in_place else "out_of_place")
            launcher()
            got = cache.view(torch.int16).cpu().numpy()
            assert_bits(got[:, 0], got[:, 1], case.want_k, case.want_v, f"in_place={in_place}, {tuning}")


def _compiled_kernels() -> int:
    from sidecar.convert import triton_kernel as tk

    kernels = (tk.convert_kernel, tk.in_place_split_kernel, tk.in_place_pipe_kernel, tk.gather_pairs_kernel)
    return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())


@pytest.mark.parametrize(("h", "n", "d"), [(5, 32, 64), (8, 16, 128)])
def test_warm_up_compiles_what_a_request_then_uses(cases, no_reference, h, n, d):
    """The daemon warms the kernels up at registration on scratch blocks: a request on the real planes
    (another allocation, other block counts) must need no further compile."""
    case = cases.make_case(3, 9, [7, 2, 4], h, n, d, 0, seed=5)
    cache = lhbnc(case.in_place_k, case.in_place_v, torch.bfloat16)
    planes = api.PlaneSet([cache[i, 0] for i in range(3)], [cache[i, 1] for i in range(3)], num_heads=h,
                          block_size=n, head_size=d)
    planes.warm_up()
    compiled = _compiled_kernels()
    planes.convert(torch.tensor([7, 2, 4]))
    planes.convert(torch.tensor([7, 2, 4]), src=torch.from_numpy(case.src).to(DEV).view(torch.bfloat16))
    torch.cuda.synchronize()
    assert _compiled_kernels() == compiled
