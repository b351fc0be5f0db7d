"""Decode one query token per sequence from paged KV caches: the reference (standard pages) and the readers of
shuffled pages (torch here; Triton in ``triton_reader``; AITER's own kernel on ROCm in ``decode_aiter``).

Every reader returns float32 ``[num_seqs, num_q_heads, head_size]``. Query head ``hq`` reads KV head
``hq // gqa`` (pa.cuh L149-150: a work group's query heads ``blockIdx.z * GQA_RATIO ...`` share KV head
``blockIdx.z``). Softmax over the first ``context_lens[s]`` tokens of sequence ``s``; tokens past it are never
weighed, whatever the cache holds there.
"""

from __future__ import annotations

import math

import torch

from sidecar.verify.aiter_layout import k_offset, v_offset, x_of

PARTITION_SIZE = 256  # vLLM rocm_aiter_fa.py _PARTITION_SIZE_ROCM, used to size the kernel's scratch


class ReaderUnavailable(RuntimeError):
    """The reader cannot run here (e.g. aiter missing on ROCm); the message says how to get it."""


def shuffled_views(k_side: torch.Tensor, v_side: torch.Tensor, num_heads: int, head_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The 5-D K ``[B, H, D/x, N, x]`` and V ``[B, H, N/x, D, x]`` views vLLM hands AITER (rocm_aiter_fa.py
    L1539-1546), from each side as ``_split_kv_cache`` gives it: ``[B, N, H, D]`` (L1657-1665)."""
    num_blocks, block_size = k_side.shape[0], k_side.shape[1]
    x = x_of(k_side.dtype)
    k = k_side.reshape(num_blocks, num_heads, head_size // x, block_size, x)
    v = v_side.reshape(num_blocks, num_heads, block_size // x, head_size, x)
    if k.stride(0) != num_heads * head_size * block_size:  # the assertion of rocm_aiter_fa.py L1551
        raise ValueError("K/V sides must be dense planes (K.stride(0) == H*D*N); the cache is not LHBNC")
    return k, v


def decode_reference(q: torch.Tensor, std_pages: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention from standard pages ``[B, H, N, 2D]`` (K = [..., :D], V = [..., D:], page-formats.md), one
    sequence at a time over exactly its tokens (no masking code: a slice)."""
    num_seqs, num_q_heads, d = q.shape
    _, h, n, _ = std_pages.shape
    gqa = num_q_heads // h
    out = torch.empty((num_seqs, num_q_heads, d), dtype=torch.float32, device=q.device)
    for s in range(num_seqs):
        ctx = int(context_lens[s])
        blocks = block_tables[s, : -(-ctx // n)].long()
        pages = std_pages[blocks].float()  # [nb, H, N, 2D]
        k = pages[..., :d].permute(1, 0, 2, 3).reshape(h, -1, d)[:, :ctx]  # [H, ctx, D]
        v = pages[..., d:].permute(1, 0, 2, 3).reshape(h, -1, d)[:, :ctx]
        k, v = k.repeat_interleave(gqa, 0), v.repeat_interleave(gqa, 0)  # [Hq, ctx, D]
        p = torch.softmax(torch.einsum("hd,htd->ht", q[s].float(), k) * scale, dim=-1)
        out[s] = torch.einsum("ht,htd->hd", p, v)
    return out


def gather_shuffled(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of tokens ``0..num_tokens-1`` of every sequence, ``[S, H, T, D]`` float32, read from the
    shuffled caches by AITER's address arithmetic (``aiter_layout``) on the raw memory, not through the
    views' shapes."""
    num_heads, block_size, head_size = k_cache.shape[1], k_cache.shape[3], v_cache.shape[3]
    x = x_of(k_cache.dtype)
    kv_block_stride, kv_head_stride = k_cache.stride(0), k_cache.stride(1)  # pa.py L101-102, both from K
    dev = k_cache.device
    t = torch.arange(num_tokens, device=dev)
    blk = block_tables[:, t // block_size].long()[:, None, :, None]  # [S, 1, T, 1]
    tok = (t % block_size)[None, None, :, None]
    head = torch.arange(num_heads, device=dev)[None, :, None, None]
    dim = torch.arange(head_size, device=dev)[None, None, None, :]
    geom = dict(kv_block_stride=kv_block_stride, kv_head_stride=kv_head_stride, x=x)
    k_off = k_offset(blk, head, tok, dim, block_size=block_size, **geom)
    v_off = v_offset(blk, head, tok, dim, head_size=head_size, **geom)
    k_flat, v_flat = _raw(k_cache, kv_block_stride), _raw(v_cache, kv_block_stride)
    return k_flat[k_off].float(), v_flat[v_off].float()


def _raw(cache: torch.Tensor, block_stride: int) -> torch.Tensor:
    """The cache's memory as a flat tensor from its first element (as the kernel's pointer sees it)."""
    return torch.as_strided(cache, (cache.shape[0] * block_stride,), (1,))


def decode_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The torch reader of shuffled caches (any device): gather by AITER's indexing, masked softmax."""
    num_seqs, num_q_heads, _ = q.shape
    gqa = num_q_heads // k_cache.shape[1]
    block_size = k_cache.shape[3]
    num_tokens = int(context_lens.max())
    num_tokens = -(-num_tokens // block_size) * block_size  # whole blocks, as the kernel fetches them
    k, v = gather_shuffled(k_cache, v_cache, block_tables, num_tokens)
    k, v = k.repeat_interleave(gqa, 1), v.repeat_interleave(gqa, 1)  # [S, Hq, T, D]
    logits = torch.einsum("shd,shtd->sht", q.float(), k) * scale
    live = torch.arange(num_tokens, device=q.device)[None, :] < context_lens.to(q.device)[:, None].long()
    logits = logits.masked_fill(~live[:, None, :], float("-inf"))
    return torch.einsum("sht,shtd->shd", torch.softmax(logits, dim=-1), v)


def decode_aiter(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """AITER's own decode (ROCm only; UNVERIFIED: no MI300X has run it).

    The call vLLM 0.33's ROCM_AITER_FA makes with VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT=1: rocm_aiter_fa.py
    L1537-1599 calls vllm/_aiter_ops.py ``paged_attention_common`` (L4656-4703), which imports
    ``aiter.paged_attention_common`` (L4683) and calls it by keyword (L4685-4703). In github.com/ROCm/aiter
    (commit 0056982d17eb, aiter/ops/attention.py, ``paged_attention_common``) that runs the asm
    ``pa_fwd_asm`` for D=128 when num_seqs*num_heads > 2*CUs, else ``paged_attention_rocm``: the pa.cuh
    kernel ``aiter_layout`` cites, with ``block_size=K.size(3)`` and ``num_kv_heads=K.size(1)``. bf16/fp16
    caches: ``kv_cache_dtype="auto"`` and unit scales, as vLLM passes ``layer._k_scale``/``_v_scale``
    (1.0 unless fp8) and no asm scale tables."""
    if torch.version.hip is None:
        raise ReaderUnavailable("the AITER reader runs only on ROCm")
    try:
        from aiter import paged_attention_common  # lazy: ROCm only, JIT-compiles with hipcc on first use
    except ImportError as exc:
        raise ReaderUnavailable(
            f"aiter is not importable ({exc}); install it: pip install 'kv-sidecar[rocm]' (PyPI amd-aiter, a "
            "pre-release) or, as vLLM's ROCm images do, from source: git clone --recursive "
            "https://github.com/ROCm/aiter && cd aiter && python setup.py develop"
        ) from None
    num_seqs, num_heads, head_size = q.shape
    max_seq_len = int(context_lens.max())
    parts = math.ceil(max_seq_len / PARTITION_SIZE)
    dev = q.device
    tmp_out = torch.empty((num_seqs, num_heads, parts, head_size), dtype=q.dtype, device=dev)
    exp_sums = torch.empty((num_seqs, num_heads, parts), dtype=torch.float32, device=dev)
    max_logits = torch.empty_like(exp_sums)
    one = torch.ones((), dtype=torch.float32, device=dev)
    out = torch.empty_like(q)
    tables = block_tables.to(device=dev, dtype=torch.int32).contiguous()
    paged_attention_common(  # the keyword call of vllm/_aiter_ops.py L4685-4703
        Q=q, K=k_cache, V=v_cache, tmp_out=tmp_out, max_logits=max_logits, exp_sums=exp_sums,
        max_seq_len=max_seq_len, block_tables=tables,
        context_lens=context_lens.to(device=dev, dtype=torch.int32), block_tables_stride0=tables.stride(0),
        scale=scale, K_QScale_hip=one, V_QScale_hip=one, K_QScale_asm=None, V_QScale_asm=None, out_=out,
        kv_cache_dtype="auto",
    )
    return out.float()
