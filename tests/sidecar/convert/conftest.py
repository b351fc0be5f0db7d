"""Test cases for the converters, built by an independent model of vLLM's two cache writers.

The standard page is written as reshape_and_cache_flash does under LBHNC (K(h,n,d) = h*N*2D + n*2D + d,
V at +D), the expected shuffled planes as vLLM 0.33's reshape_and_cache_shuffle_triton does
(aiter-shuffle-layout.md §3.2): token t with slot s goes to block s//N, row n = s%N, K at
h*D*N + (d//x)*N*x + n*x + d%x and V at h*D*N + (n//x)*D*x + d*x + n%x. Nothing here uses the permute
formula of the code under test.

Element values are tags: the unique index of (layer, token, K|V, head, dim) split into 16-bit words. A case
is built for one word (``word`` 0 or 1); since the converter is a value-independent permutation, passing for
both words means every element landed exactly where the writer puts it. Everything stays int16 (raw bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

X = 8  # elements per 16-byte vector for bf16/fp16
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def tags(index: np.ndarray, word: int) -> np.ndarray:
    """16-bit word ``word`` of each unique index, as int16 raw bits (any pattern, NaNs included)."""
    return ((index >> (16 * word)) & 0xFFFF).astype(np.uint16).view(np.int16)


def write_standard(pages: np.ndarray, key: np.ndarray, value: np.ndarray, slots: np.ndarray, n: int) -> None:
    """vLLM's standard writer into LBHNC pages [B, H*N*2D] (flattened per block), skipping slot -1."""
    _, h, d = key.shape
    ok = slots >= 0
    b, row = slots[ok] // n, slots[ok] % n
    hh, dd = np.arange(h)[None, :, None], np.arange(d)[None, None, :]
    off = hh * n * 2 * d + row[:, None, None] * 2 * d + dd
    flat = pages.reshape(pages.shape[0], -1)
    flat[b[:, None, None], off] = key[ok]
    flat[b[:, None, None], off + d] = value[ok]


def write_shuffled(k_plane: np.ndarray, v_plane: np.ndarray, key: np.ndarray, value: np.ndarray,
                   slots: np.ndarray, n: int) -> None:
    """vLLM's shuffle writer into dense K and V planes [B, H*N*D] (block stride H*D*N, LHBNC)."""
    _, h, d = key.shape
    ok = slots >= 0
    b, row = (slots[ok] // n)[:, None, None], (slots[ok] % n)[:, None, None]
    hh, dd = np.arange(h)[None, :, None], np.arange(d)[None, None, :]
    k_off = hh * d * n + (dd // X) * n * X + row * X + dd % X
    v_off = hh * d * n + (row // X) * d * X + dd * X + row % X
    k_plane[np.broadcast_to(b, k_off.shape), k_off] = key[ok]
    v_plane[np.broadcast_to(b, v_off.shape), v_off] = value[ok]


@dataclass
class ConversionCase:
    """One conversion: what the planes hold before (in place / out of place), the staged pages, the truth."""

    in_place_k: np.ndarray  # [L, B, HND]: chosen blocks hold the standard page's byte halves
    in_place_v: np.ndarray
    before_k: np.ndarray  # [L, B, HND]: what an out-of-place target holds before (stale data everywhere)
    before_v: np.ndarray
    src: np.ndarray  # [L, M, 2HND]: standard pages of the chosen blocks, in ids order
    want_k: np.ndarray  # [L, B, HND]
    want_v: np.ndarray
    ids: np.ndarray


def make_case(layers: int, blocks: int, ids: list[int], h: int, n: int, d: int, word: int,
              seed: int = 0) -> ConversionCase:
    rng = np.random.default_rng(seed)
    ids_a = np.asarray(ids, dtype=np.int64)
    _m, half = len(ids), h * n * d
    # Tokens fill every slot of the chosen blocks in a random order, with a few skipped (slot -1) tokens.
    slots = (ids_a[:, None] * n + np.arange(n)[None, :]).reshape(-1)
    slots = np.concatenate([rng.permutation(slots), np.full(3, -1)])
    rng.shuffle(slots)
    t = len(slots)
    stale = lambda: rng.integers(-32768, 32768, size=(layers, blocks, half), dtype=np.int64).astype(np.int16)
    before_k, before_v = stale(), stale()
    std = np.concatenate([stale(), stale()], axis=2)  # pages of unchosen blocks never matter
    want_k, want_v = before_k.copy(), before_v.copy()
    index = np.arange(layers * t * 2 * h * d, dtype=np.int64).reshape(layers, t, 2, h, d)
    for layer in range(layers):
        key, value = tags(index[layer, :, 0], word), tags(index[layer, :, 1], word)
        write_standard(std[layer], key, value, slots, n)
        write_shuffled(want_k[layer], want_v[layer], key, value, slots, n)
    in_place_k, in_place_v = before_k.copy(), before_v.copy()
    in_place_k[:, ids_a], in_place_v[:, ids_a] = std[:, ids_a, :half], std[:, ids_a, half:]
    src = np.ascontiguousarray(std[:, ids_a])
    return ConversionCase(in_place_k, in_place_v, before_k, before_v, src, want_k, want_v, ids_a)


def planes(arr: np.ndarray, dtype: torch.dtype, device: str = "cpu") -> list[torch.Tensor]:
    """Per-layer planes of ``dtype`` whose raw bits are ``arr`` [L, B, HND] (separate allocations)."""
    return [torch.from_numpy(a.copy()).to(device).view(dtype) for a in arr]


def bits(ts: list[torch.Tensor]) -> np.ndarray:
    return np.stack([t.view(torch.int16).cpu().numpy() for t in ts])


def distinct_ids(rng: np.random.Generator, blocks: int, m: int) -> list[int]:
    """Unsorted, non-contiguous block ids (when the cache has room for gaps)."""
    ids = rng.permutation(blocks)[:m].tolist()
    if m > 1 and ids == sorted(ids):
        ids.reverse()
    return ids


@pytest.fixture(scope="session")
def cases():
    """The case builders above, for test modules (importlib import mode has no sibling imports)."""
    import types

    return types.SimpleNamespace(make_case=make_case, planes=planes, bits=bits, distinct_ids=distinct_ids,
                                 tags=tags, write_standard=write_standard, write_shuffled=write_shuffled,
                                 DTYPES=DTYPES, X=X)


@pytest.fixture
def no_reference(monkeypatch):
    """Fail if a GPU conversion falls back to the torch reference: the GPU tests are about the kernels."""
    from sidecar.convert import api

    reference = api.run_reference

    def refuse_on_gpu(job):
        if job.device.type != "cpu":
            raise AssertionError("the torch reference ran on the GPU instead of the Triton kernel")
        reference(job)

    monkeypatch.setattr(api, "run_reference", refuse_on_gpu)
