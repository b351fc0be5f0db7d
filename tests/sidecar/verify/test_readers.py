"""The shuffled-page reader against a brute-force definition of the layout, taken from docs/page-formats.md
("Shuffled pages"): inside a plane-block, k_off(h, n, d) = h*D*N + (d//x)*N*x + n*x + d%x and
v_off(h, n, d) = h*D*N + (n//x)*D*x + d*x + n%x; block b of a dense plane starts at b*H*N*D."""

from __future__ import annotations

import itertools

import pytest
import torch

from sidecar.verify import readers
from sidecar.verify.aiter_layout import k_offset, v_offset

X = 8


def brute_planes(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V ``[B, H, N, D]`` written element by element into dense planes ``[B, H*N*D]`` (page-formats.md)."""
    b_, h_, n_, d_ = k.shape
    kp = [[float("nan")] * (h_ * n_ * d_) for _ in range(b_)]
    vp = [[float("nan")] * (h_ * n_ * d_) for _ in range(b_)]
    kl, vl = k.tolist(), v.tolist()
    for b, h, n, d in itertools.product(range(b_), range(h_), range(n_), range(d_)):
        kp[b][h * d_ * n_ + (d // X) * n_ * X + n * X + d % X] = kl[b][h][n][d]
        vp[b][h * d_ * n_ + (n // X) * d_ * X + d * X + n % X] = vl[b][h][n][d]
    return torch.tensor(kp, dtype=k.dtype), torch.tensor(vp, dtype=k.dtype)


@pytest.mark.parametrize("h,n,d", [(1, 16, 16), (3, 16, 8), (2, 32, 16)])
def test_aiter_offsets_equal_page_formats_definition(h, n, d):
    """Every (block, head, token, dim): the offsets read from AITER's kernel equal page-formats.md's."""
    blocks = 3
    geom = dict(kv_block_stride=h * n * d, kv_head_stride=n * d, x=X)
    seen_k, seen_v = set(), set()
    for b, hh, nn, dd in itertools.product(range(blocks), range(h), range(n), range(d)):
        ko = k_offset(b, hh, nn, dd, block_size=n, **geom)  # plain ints: the same arithmetic
        vo = v_offset(b, hh, nn, dd, head_size=d, **geom)
        assert ko == b * h * n * d + hh * d * n + (dd // X) * n * X + nn * X + dd % X
        assert vo == b * h * n * d + hh * d * n + (nn // X) * d * X + dd * X + nn % X
        seen_k.add(ko)
        seen_v.add(vo)
    assert seen_k == seen_v == set(range(blocks * h * n * d))  # a bijection onto the planes


def _views(kp, vp, h, n, d):
    b = kp.shape[0]
    return readers.shuffled_views(kp.view(b, n, h, d), vp.view(b, n, h, d), h, d)


def test_gather_reads_every_element_where_the_layout_puts_it():
    g = torch.Generator().manual_seed(1)
    b, h, n, d = 5, 3, 16, 16
    k = torch.randn(b, h, n, d, generator=g).to(torch.bfloat16)
    v = torch.randn(b, h, n, d, generator=g).to(torch.bfloat16)
    kc, vc = _views(*brute_planes(k, v), h, n, d)
    tables = torch.tensor([[4, 0, 2], [1, 3, 0]], dtype=torch.int32)
    gk, gv = readers.gather_shuffled(kc, vc, tables, 3 * n)
    for s in range(2):
        for j, blk in enumerate(tables[s].tolist()):
            assert torch.equal(gk[s, :, j * n:(j + 1) * n], k[blk].float())
            assert torch.equal(gv[s, :, j * n:(j + 1) * n], v[blk].float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_reader_equals_attention_over_the_brute_force_pages(dtype):
    g = torch.Generator().manual_seed(2)
    b, h, n, d, gqa = 6, 2, 16, 32, 3
    k = torch.randn(b, h, n, d, generator=g).to(dtype)
    v = torch.randn(b, h, n, d, generator=g).to(dtype)
    kc, vc = _views(*brute_planes(k, v), h, n, d)
    tables = torch.tensor([[5, 1, 3], [0, 2, 4]], dtype=torch.int32)
    lens = torch.tensor([2 * n + 7, 3], dtype=torch.int32)
    q = torch.randn(2, h * gqa, d, generator=g).to(dtype)
    out = readers.decode_torch(q, kc, vc, tables, lens, 0.3)
    for s in range(2):
        ctx = int(lens[s])
        ks = torch.cat([k[i] for i in tables[s].tolist()], dim=1)[:, :ctx].float()  # [H, ctx, D]
        vs = torch.cat([v[i] for i in tables[s].tolist()], dim=1)[:, :ctx].float()
        for hq in range(h * gqa):
            p = torch.softmax(ks[hq // gqa] @ q[s, hq].float() * 0.3, dim=0)
            torch.testing.assert_close(out[s, hq], p @ vs[hq // gqa], rtol=0, atol=1e-5)


def test_views_refuse_sides_that_are_not_dense_planes():
    """Under LBHNC the K and V tiles of a block alternate (stride 2*H*N*D): vLLM asserts, so do we."""
    h, n, d, b = 2, 16, 16, 4
    cache = torch.zeros(b, 2, n, h * d, dtype=torch.bfloat16)  # LBHNC: [B, 2, N, H*D] contiguous
    k_side, v_side = cache.unflatten(-1, (h, d)).unbind(1)
    with pytest.raises(ValueError, match="dense planes"):
        readers.shuffled_views(k_side, v_side, h, d)


def test_aiter_reader_says_it_needs_rocm_elsewhere():
    if torch.version.hip:
        pytest.skip("this host is ROCm")
    t = torch.zeros(1, 1, 8)
    with pytest.raises(readers.ReaderUnavailable, match="only on ROCm"):
        readers.decode_aiter(t, t, t, t, torch.tensor([1]), 1.0)


def test_triton_reader_in_triton_interpreter_where_triton_is_installed():
    """The Triton kernel's logic on the CPU (TRITON_INTERPRET=1, set before triton is imported, hence a
    subprocess). Skipped where Triton is not installed (the CPU venv); the GPU tests compile it."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    code = (
        "import torch\n"
        "from sidecar.verify import golden\n"
        "from sidecar.verify.triton_reader import decode_triton\n"
        "r = golden.run_shape(golden.Shape(16, 64, 3, 'bfloat16', 4), torch.device('cpu'), "
        "{'triton': decode_triton})\n"
        "assert r.ok, r\n"
    )
    path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
