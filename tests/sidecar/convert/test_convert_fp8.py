"""fp8 (1-byte, x = 16) conversion: bit-exact against an independent model of vLLM's shuffle writer, and the
e4m3fn -> e4m3fnuz re-encode against the byte tables (sidecar.wire.fp8), counts included.

Elements are byte tags of the unique (layer, token, K|V, head, dim) index, one byte word per case, so passing
for every word means every byte landed where vLLM's writer puts it (aiter-shuffle-layout.md §3.2).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sidecar.convert import PlaneSet
from sidecar.wire import fp8

X = 16
FP8 = [torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.uint8]
GEOMS = [(1, 16, 64), (2, 16, 128), (3, 32, 64), (8, 16, 128), (5, 32, 256)]


def make(layers: int, blocks: int, ids: list[int], h: int, n: int, d: int, word: int, seed: int):
    """Standard pages for ``ids`` and the planes vLLM's shuffle writer would hold, as uint8."""
    rng = np.random.default_rng(seed)
    m = len(ids)
    std = np.zeros((layers, m, h * n * 2 * d), dtype=np.uint8)
    want_k = rng.integers(0, 256, (layers, blocks, h * n * d), dtype=np.uint8)  # untouched blocks: noise
    want_v = rng.integers(0, 256, (layers, blocks, h * n * d), dtype=np.uint8)
    before_k, before_v = want_k.copy(), want_v.copy()
    hh, nn, dd = np.meshgrid(np.arange(h), np.arange(n), np.arange(d), indexing="ij")
    for layer in range(layers):
        for i, b in enumerate(ids):
            idx = ((((layer * m + i) * n + nn) * 2) * h + hh) * d + dd  # unique per element (K: +0, V: +h*d)
            kt = ((idx >> (8 * word)) & 0xFF).astype(np.uint8)
            vt = (((idx + h * d) >> (8 * word)) & 0xFF).astype(np.uint8)
            std[layer, i, (hh * n * 2 * d + nn * 2 * d + dd).ravel()] = kt.ravel()
            std[layer, i, (hh * n * 2 * d + nn * 2 * d + d + dd).ravel()] = vt.ravel()
            k_off = hh * d * n + (dd // X) * n * X + nn * X + dd % X
            v_off = hh * d * n + (nn // X) * d * X + dd * X + nn % X
            want_k[layer, b, k_off.ravel()] = kt.ravel()
            want_v[layer, b, v_off.ravel()] = vt.ravel()
    return std, before_k, before_v, want_k, want_v


def run(std, before_k, before_v, ids, h, n, d, dtype, in_place, lut=None, device="cpu"):
    layers = std.shape[0]
    half = h * n * d
    ks = [torch.from_numpy(before_k[i].copy()).to(device).view(dtype) for i in range(layers)]
    vs = [torch.from_numpy(before_v[i].copy()).to(device).view(dtype) for i in range(layers)]
    src = None
    if in_place:
        for i in range(layers):
            for j, b in enumerate(ids):
                ks[i].view(torch.uint8)[b] = torch.from_numpy(std[i, j, :half]).to(device)
                vs[i].view(torch.uint8)[b] = torch.from_numpy(std[i, j, half:]).to(device)
    else:
        src = torch.from_numpy(std).to(device).view(torch.float8_e4m3fn if lut is not None else dtype)
    counts = PlaneSet(ks, vs, num_heads=h, block_size=n, head_size=d, lut=lut).convert(
        torch.tensor(ids), src=src)
    bits = lambda ts: np.stack([t.view(torch.uint8).cpu().numpy() for t in ts])  # noqa: E731
    return bits(ks), bits(vs), counts


@pytest.mark.parametrize("h,n,d", GEOMS)
@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("in_place", [True, False])
def test_fp8_same_flavour_bit_exact(h, n, d, dtype, in_place):
    ids = [4, 0, 2]
    for word in range(3):
        std, bk, bv, wk, wv = make(2, 6, ids, h, n, d, word, seed=word)
        k, v, counts = run(std, bk, bv, ids, h, n, d, dtype, in_place)
        assert counts is None
        assert np.array_equal(k, wk) and np.array_equal(v, wv), (word, "planes differ")


@pytest.mark.parametrize("scales", [(0.5, 1.0, 0.25, 0.5), (1.0, 1.0, 1.0, 1.0), (1.0, 4.0, 2.0, 0.5)])
@pytest.mark.parametrize("in_place", [True, False])
def test_fn_to_fnuz_reencode_applies_each_tensors_table_and_counts(scales, in_place):
    pk, dk, pv, dv = scales
    lut = fp8.pair_table(pk, dk, pv, dv)
    h, n, d, ids = 2, 16, 64, [3, 1]
    for word in range(2):
        std, bk, bv, wk, wv = make(2, 5, ids, h, n, d, word, seed=7 + word)
        k, v, counts = run(std, bk, bv, ids, h, n, d, torch.float8_e4m3fnuz, in_place, lut=lut)
        sel = np.array(ids)
        want_k, want_v = wk.copy(), wv.copy()
        want_k[:, sel] = (lut[0][wk[:, sel]] & 0xFF).astype(np.uint8)
        want_v[:, sel] = (lut[1][wv[:, sel]] & 0xFF).astype(np.uint8)
        assert np.array_equal(k, want_k) and np.array_equal(v, want_v)
        codes = np.concatenate([lut[0][wk[:, sel]].ravel(), lut[1][wv[:, sel]].ravel()])
        assert counts.tolist() == [int(((codes >> 8) & 1).sum()), int(((codes >> 9) & 1).sum())]


def test_reencode_counts_are_nonzero_when_they_should_be():
    """Every byte value occurs in word 0 of a 2x16x64 page: equal scales must saturate some and see NaNs."""
    h, n, d, ids = 2, 16, 64, [0]
    std, bk, bv, *_ = make(1, 1, ids, h, n, d, 0, seed=0)
    lut = fp8.pair_table(1, 1, 1, 1)
    _, _, counts = run(std, bk, bv, ids, h, n, d, torch.float8_e4m3fnuz, False, lut=lut)
    sat, nan = counts.tolist()
    assert sat > 0 and nan > 0


def test_lut_needs_one_byte_planes_and_the_right_shape():
    k = [torch.zeros((2, 2 * 16 * 64), dtype=torch.bfloat16)]
    v = [torch.zeros((2, 2 * 16 * 64), dtype=torch.bfloat16)]
    with pytest.raises(ValueError, match="1-byte"):
        PlaneSet(k, v, num_heads=2, block_size=16, head_size=64, lut=fp8.pair_table(1, 1, 1, 1))
    k8, v8 = ([torch.zeros((2, 2 * 16 * 64), dtype=torch.float8_e4m3fnuz)] for _ in range(2))
    with pytest.raises(ValueError, match="int32"):
        PlaneSet(k8, v8, num_heads=2, block_size=16, head_size=64, lut=np.zeros((2, 256)))


def test_fp8_head_size_must_hold_whole_16_element_vectors():
    k = [torch.zeros((2, 1 * 16 * 8), dtype=torch.float8_e4m3fn)]
    v = [torch.zeros((2, 1 * 16 * 8), dtype=torch.float8_e4m3fn)]
    with pytest.raises(ValueError, match="x=16"):
        PlaneSet(k, v, num_heads=1, block_size=16, head_size=8)
