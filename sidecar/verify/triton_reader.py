"""The Triton reader of shuffled caches (GPU): one program per (sequence, query head), a block per step,
online softmax in float32. Imported only on a GPU (the CPU torch wheel has no Triton).

Addresses as AITER's HIP decode computes them (aiter_layout.py cites pa.cuh line by line): K at
``block*kv_block_stride + head*kv_head_stride + (d//x)*N*x + n*x + d%x`` (pa.cuh L256, L263-265, L272-276),
V at ``block*kv_block_stride + head*kv_head_stride + (n//x)*D*x + d*x + n%x`` (pa.cuh L324, L329-343), both
strides taken from K (pa.py L101-102). Dot products are elementwise sums, never ``tl.dot``: tf32 would blur
the comparison.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sidecar.verify.aiter_layout import x_of


@triton.jit
def _decode_shuffled(q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, out_ptr, scale, bt_stride, kv_block_stride,
                     kv_head_stride, num_q_heads, MAX_BLOCKS: tl.constexpr, GQA: tl.constexpr,
                     N: tl.constexpr, D: tl.constexpr, X: tl.constexpr):
    s = tl.program_id(0)
    hq = tl.program_id(1)
    h = hq // GQA  # pa.cuh L149-150: GQA_RATIO query heads per KV head
    ctx = tl.load(ctx_ptr + s)
    d = tl.arange(0, D)
    n = tl.arange(0, N)
    q = tl.load(q_ptr + (s * num_q_heads + hq) * D + d).to(tl.float32)
    m_i = tl.max(tl.full([N], float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros([N], tl.float32), 0)
    acc = tl.zeros([D], tl.float32)
    for j in range(0, MAX_BLOCKS):  # blocks past this sequence's end are read but weigh nothing
        b = tl.load(bt_ptr + s * bt_stride + j).to(tl.int64)
        base = b * kv_block_stride + h * kv_head_stride
        k_off = base + (d[None, :] // X) * (N * X) + n[:, None] * X + d[None, :] % X
        v_off = base + (n[:, None] // X) * (D * X) + d[None, :] * X + n[:, None] % X
        k = tl.load(k_ptr + k_off).to(tl.float32)  # [N, D]
        v = tl.load(v_ptr + v_off).to(tl.float32)
        logits = tl.sum(k * q[None, :], 1) * scale
        logits = tl.where(j * N + n < ctx, logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, 0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(logits - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m_i = m_new
    tl.store(out_ptr + (s * num_q_heads + hq) * D + d, acc / l_i)


def decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """As ``readers.decode_torch``, on the GPU with Triton; ``k_cache``/``v_cache`` are vLLM's 5-D views."""
    num_seqs, num_q_heads, head_size = q.shape
    num_heads, block_size = k_cache.shape[1], k_cache.shape[3]
    dev = q.device
    tables = block_tables.to(device=dev, dtype=torch.int32).contiguous()
    out = torch.empty((num_seqs, num_q_heads, head_size), dtype=torch.float32, device=dev)
    _decode_shuffled[(num_seqs, num_q_heads)](
        q.contiguous(), k_cache, v_cache, tables, context_lens.to(device=dev, dtype=torch.int32), out,
        float(scale), tables.stride(0), k_cache.stride(0), k_cache.stride(1), num_q_heads,
        MAX_BLOCKS=-(-int(context_lens.max()) // block_size),
        GQA=num_q_heads // num_heads, N=block_size, D=head_size, X=x_of(k_cache.dtype),
    )
    return out
