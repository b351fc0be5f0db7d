"""fp8 on a GPU: the Triton converter (every strategy, re-encode included) bit-exact against the CPU torch
reference, and against vLLM's own shuffle cache writer (``reshape_and_cache_shuffle_kernel`` of
``vllm/v1/attention/backends/rocm_aiter_fa.py``, a Triton kernel) run with an fp8 KV cache dtype.

vLLM's kernel is compiled from the vLLM source tree named by ``VLLM_ORACLE_SRC`` (the directory holding
``vllm/``, e.g. an unzipped 0.33.0 wheel); it is never copied here. Without it that test skips.
"""

from __future__ import annotations

import ast
import os
import pathlib
import textwrap

import pytest
import torch

from sidecar.convert import PlaneSet
from sidecar.convert.tuning import Tuning
from sidecar.wire import fp8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]
DEV = "cuda:0"
WRITER = "vllm/v1/attention/backends/rocm_aiter_fa.py"


def _pages(layers, m, h, n, d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (layers, m, 2 * h * n * d), generator=g, dtype=torch.int32).to(torch.uint8)


def _convert(std, blocks, ids, h, n, d, dtype, device, in_place, lut=None, tuning=None):
    layers, half = std.shape[0], h * n * d
    ks = [torch.zeros((blocks, half), dtype=torch.uint8, device=device).view(dtype) for _ in range(layers)]
    vs = [torch.zeros((blocks, half), dtype=torch.uint8, device=device).view(dtype) for _ in range(layers)]
    src = None
    if in_place:
        for i in range(layers):
            ks[i].view(torch.uint8)[ids] = std[i, :, :half].to(device)
            vs[i].view(torch.uint8)[ids] = std[i, :, half:].to(device)
    else:
        src = std.to(device).view(torch.float8_e4m3fn if lut is not None else dtype)
    ps = PlaneSet(ks, vs, num_heads=h, block_size=n, head_size=d, lut=lut)
    if tuning is not None:  # force one in-place strategy of the Triton launcher
        from sidecar.convert import checks, triton_kernel

        job = checks.check_request(ps.planes, torch.tensor(ids), src, lut=ps.lut,
                                   counts=None if ps.lut is None else torch.zeros(2, dtype=torch.int64,
                                                                                  device=device))
        triton_kernel.Launcher(job, tuning)()
        counts = job.counts
    else:
        counts = ps.convert(torch.tensor(ids), src=src)
    torch.cuda.synchronize()
    out = [torch.stack([t.view(torch.uint8).cpu() for t in ts]) for ts in (ks, vs)]
    return out[0], out[1], None if counts is None else counts.cpu().tolist()


@pytest.mark.parametrize("h,n,d", [(1, 16, 64), (3, 32, 128), (8, 16, 128), (8, 32, 256)])
@pytest.mark.parametrize("in_place", [None, "pipe", "whole", "split", "scratch", False])
def test_triton_fp8_matches_reference(h, n, d, in_place):
    std, ids = _pages(2, 3, h, n, d, seed=h * n + d), [5, 0, 2]
    tuning = Tuning(in_place=in_place) if isinstance(in_place, str) else None
    got = _convert(std, 7, ids, h, n, d, torch.float8_e4m3fnuz, DEV, in_place is not False, tuning=tuning)
    want = _convert(std, 7, ids, h, n, d, torch.float8_e4m3fnuz, "cpu", in_place is not False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("scales", [(0.5, 1.0, 0.5, 1.0), (1.0, 1.0, 1.0, 1.0), (1.0, 4.0, 2.0, 0.5)])
@pytest.mark.parametrize("in_place", [True, False])
def test_triton_reencode_matches_reference(scales, in_place):
    h, n, d, ids = 8, 16, 128, [3, 1, 6]
    lut = fp8.pair_table(*scales)
    std = _pages(3, len(ids), h, n, d, seed=11)
    got = _convert(std, 8, ids, h, n, d, torch.float8_e4m3fnuz, DEV, in_place, lut=lut)
    want = _convert(std, 8, ids, h, n, d, torch.float8_e4m3fnuz, "cpu", in_place, lut=lut)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2] == want[2] and (scales[0] * 2 != scales[1] or got[2][0] == 0)


def _vllm_writer():
    root = os.environ.get("VLLM_ORACLE_SRC")
    if not root or not (pathlib.Path(root) / WRITER).exists():
        pytest.skip(f"set VLLM_ORACLE_SRC to a directory holding {WRITER} (an unzipped vLLM 0.33 wheel)")
    import triton
    import triton.language as tl

    tree = ast.parse((pathlib.Path(root) / WRITER).read_text())
    fn = next((n for n in ast.walk(tree)
               if isinstance(n, ast.FunctionDef) and n.name == "reshape_and_cache_shuffle_kernel"), None)
    if fn is None:
        pytest.skip(f"{WRITER} has no reshape_and_cache_shuffle_kernel")
    src = textwrap.dedent(ast.get_source_segment((pathlib.Path(root) / WRITER).read_text(), fn))
    path = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / "kv_sidecar_vllm_shuffle_writer.py"
    # Triton reads a kernel's source back from its file, so the function goes to a scratch file first.
    path.write_text("import triton\nimport triton.language as tl\n\n@triton.jit\n" + src + "\n")
    ns: dict = {"triton": triton, "tl": tl}
    exec(compile(path.read_text(), str(path), "exec"), ns)  # noqa: S102 -- a file Triton can read back
    return ns["reshape_and_cache_shuffle_kernel"]


@pytest.mark.parametrize("h,n,d", [(1, 16, 64), (8, 16, 128), (4, 32, 256)])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_triton_fp8_matches_vllm_shuffle_writer(h, n, d, dtype):
    """vLLM's writer quantises fp32 K/V by its per-tensor scale (QUANT) into an fp8 LHBNC cache; values are
    exact fp8 numbers times a power-of-two scale, so the writer's cast is exact and the standard page built
    from the same bytes must convert to the same planes, bit for bit."""
    if dtype == torch.float8_e4m3fnuz and torch.version.hip is None:
        pytest.skip("Triton on NVIDIA has no e4m3fnuz type (fp8e4b8), so vLLM's writer compiles for it on "
                    "ROCm only; the shuffle moves bytes alike for both flavours, and e4m3fn runs here")
    kernel = _vllm_writer()
    blocks, scale = 6, 0.5
    slots = torch.tensor([s for b in (4, 1, 3) for s in range(b * n, b * n + n)], dtype=torch.int64)
    t = slots.numel()
    g = torch.Generator().manual_seed(h * d)
    codes = torch.randint(0, 256, (2, t, h, d), generator=g, dtype=torch.int32).to(torch.uint8)
    vals = codes.view(dtype).to(torch.float32)
    codes[vals.isnan()] = 0  # NaN and -0 are not round-trip values of a quantiser
    codes[(codes == 0x80)] = 0
    vals = codes.view(dtype).to(torch.float32)
    k_cache = torch.zeros((blocks, h * n * d), dtype=torch.uint8, device=DEV).view(dtype)
    v_cache = torch.zeros((blocks, h * n * d), dtype=torch.uint8, device=DEV).view(dtype)
    key, value = (vals[i].mul(scale).contiguous().to(DEV) for i in range(2))
    sc = torch.tensor([scale], dtype=torch.float32, device=DEV)
    kernel[(t, h)](key, value, k_cache, v_cache, slots.to(DEV), sc, sc, 16, key.stride(0), value.stride(0),
                   k_cache.stride(0), v_cache.stride(0), n, d, h, BLOCK_SIZE=d, QUANT=True)
    torch.cuda.synchronize()
    # The same tokens as standard pages [H, N, 2D] per block.
    ids = [4, 1, 3]
    std = torch.zeros((1, len(ids), h, n, 2 * d), dtype=torch.uint8)
    for j in range(len(ids)):
        sel = slice(j * n, (j + 1) * n)
        std[0, j, :, :, :d] = codes[0, sel].permute(1, 0, 2)
        std[0, j, :, :, d:] = codes[1, sel].permute(1, 0, 2)
    got_k, got_v, _ = _convert(std.reshape(1, len(ids), -1), blocks, ids, h, n, d, dtype, DEV, False)
    assert torch.equal(got_k[0][ids], k_cache.view(torch.uint8).cpu()[ids])
    assert torch.equal(got_v[0][ids], v_cache.view(torch.uint8).cpu()[ids])
