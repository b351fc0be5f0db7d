"""Where AITER's paged-attention decode reads K and V of (block, kv head, token, dim) in shuffled caches.

Written from AITER's HIP decode kernel, not from our converter. Sources, as read:

- AITER: the PyPI wheel ``amd-aiter==0.1.7.post2.dev18``, file ``aiter_meta/csrc/cpp_itfs/pa/pa.cuh``
  (the ll4mi QKV mfma16 kernel, ``paged_attention_ll4mi_QKV_mfma16_kernel``; the same kernel is
  ``csrc/cpp_itfs/pa/pa.cuh`` in github.com/ROCm/aiter), and ``aiter_meta/csrc/cpp_itfs/pa/pa.py`` (its
  launcher).
- vLLM 0.33.0 wheel, ``vllm/v1/attention/backends/rocm_aiter_fa.py`` L1537-1599 (the shuffle decode branch):
  K is viewed as ``[B, H, D/x, N, x]`` and V as ``[B, H, N/x, D, x]`` (L1541-1546), and each side must be a
  dense plane: ``K.stride(0) == H*D*N`` (L1551).

The kernel is given only two strides, both taken from the *K* tensor and applied to V too
(pa.py L101-102: ``kv_block_stride = key_cache.stride(0)``, ``kv_head_stride = key_cache.stride(1)``), and it
picks the shuffled V path when V is 5-D (pa.py L106: ``v_shuffle = value_cache.dim() == 5``).
"""

from __future__ import annotations

import torch

VECTOR_BYTES = 16  # pa.cuh: CONTIGUOUS_KV_ELEMS_16B_LOAD = 16 / sizeof(cache_t), one 16-byte load


def x_of(dtype: torch.dtype) -> int:
    """Elements per 16-byte vector load (``x`` in vLLM, CONTIGUOUS_KV_ELEMS_16B_LOAD in pa.cuh)."""
    return VECTOR_BYTES // torch.empty((), dtype=dtype).element_size()


def k_offset(block: torch.Tensor, head: torch.Tensor, token: torch.Tensor, dim: torch.Tensor, *,
             kv_block_stride: int, kv_head_stride: int, block_size: int, x: int) -> torch.Tensor:
    """Element offset of K(block, head, token-in-block, dim) from the K cache's first element.

    pa.cuh L256 ``k_ptr = k_cache + wg_start_kv_head_idx * kv_head_stride``; L263 ``+ kblock_number *
    kv_block_stride``; L264-265 ``+ kphysical_block_offset * CONTIGUOUS_KV_ELEMS_16B_LOAD`` (the token in its
    block, L175 ``kglobal_token_idx % BLOCK_SIZE``); L272-276 ``+ (head_elem / X) * BLOCK_SIZE * X +
    head_elem % X``, where the 16-byte load at that address holds dims ``head_elem .. head_elem+X-1``.
    """
    return (block * kv_block_stride + head * kv_head_stride + token * x
            + (dim // x) * block_size * x + dim % x)


def v_offset(block: torch.Tensor, head: torch.Tensor, token: torch.Tensor, dim: torch.Tensor, *,
             kv_block_stride: int, kv_head_stride: int, head_size: int, x: int) -> torch.Tensor:
    """Element offset of V(block, head, token-in-block, dim) from the V cache's first element (V_SHUFFLE).

    pa.cuh L324 ``v_ptr = v_cache + wg_start_kv_head_idx * kv_head_stride`` (K's head stride); L329
    ``vhead_elem`` is the dim; L332 ``v_ptr2 = v_ptr + vhead_elem * X``; L339 ``+ vblock_number *
    kv_block_stride``; L336-343 ``+ (token_in_block / X + vfetch_depth) * HEAD_SIZE * X``, and the 16-byte
    load there holds X consecutive tokens of that dim, so the token's place in the vector is ``token % X``.
    """
    return (block * kv_block_stride + head * kv_head_stride + (token // x) * head_size * x
            + dim * x + token % x)
