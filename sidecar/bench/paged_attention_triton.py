"""Split-K paged decode attention over AITER-shuffled pages, in Triton (GPU only; the bench's decoder load).

Program = (request, KV head, split of the request's pages): the GQA group's queries (padded to 16 rows for
the matrix units) against ``PAGES`` pages per iteration, online softmax; partial (max, sum, acc) per split
are merged by a few torch ops. Not a production kernel: it only has to read the pages the way a decoder does.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode(q, kp, vp, tables, lens, m_out, l_out, acc_out, stride_tb, scale, HQ: tl.constexpr,
                  G: tl.constexpr, GP: tl.constexpr, H: tl.constexpr, N: tl.constexpr, D: tl.constexpr,
                  X: tl.constexpr, PAGES: tl.constexpr, SPLITS: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    length = tl.load(lens + b)
    npages = (length + N - 1) // N
    per = (npages + SPLITS - 1) // SPLITS
    p0 = sp * per
    p1 = tl.minimum(p0 + per, npages)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    qv = tl.load(q + b * HQ * D + (h * G + g)[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0)
    m = tl.full([GP], float("-inf"), tl.float32)
    lsum = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    t = tl.arange(0, PAGES * N)
    tp = t // N
    tn = t % N
    for p in range(p0, p1, PAGES):
        page = p + tp
        valid = page < p1
        blk = tl.load(tables + b * stride_tb + page, mask=valid, other=0).to(tl.int64)
        base = blk * (H * N * D) + h * (D * N)
        k_off = base[None, :] + (d[:, None] // X) * (N * X) + tn[None, :] * X + (d[:, None] % X)
        kt = tl.load(kp + k_off, mask=valid[None, :], other=0.0)  # [D, T]
        s = tl.dot(qv, kt) * scale  # [GP, T]
        s = tl.where(((page * N + tn) < length)[None, :] & valid[None, :], s, float("-inf"))
        mn = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - mn)
        pr = tl.exp(s - mn[:, None])
        lsum = lsum * alpha + tl.sum(pr, 1)
        v_off = base[:, None] + (tn[:, None] // X) * (D * X) + d[None, :] * X + (tn[:, None] % X)
        v = tl.load(vp + v_off, mask=valid[:, None], other=0.0)  # [T, D]
        acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
        m = mn
    rows = (b * HQ + h * G + g) * SPLITS + sp
    ok = g < G
    tl.store(m_out + rows, m, mask=ok)
    tl.store(l_out + rows, lsum, mask=ok)
    tl.store(acc_out + rows[:, None] * D + d[None, :], acc, mask=ok[:, None])


class PagedAttention:
    """Buffers for one batch; ``__call__(q, k_plane, v_plane)`` -> [B, Hq, D] (graph-capturable)."""

    def __init__(self, shape: Any, tables: torch.Tensor, lens: torch.Tensor, batch: int, pages: int = 4,
                 min_programs: int = 1024) -> None:
        self.s = shape
        dev = torch.device("cuda", torch.cuda.current_device())
        self.tables = tables.to(dev, torch.int32).contiguous()
        self.lens = lens.to(dev, torch.int32).contiguous()
        self.batch = batch
        self.pages = pages
        self.splits = max(1, -(-min_programs // (batch * shape.kv_heads)))
        n = batch * shape.q_heads * self.splits
        self.m = torch.empty(n, device=dev, dtype=torch.float32)
        self.l = torch.empty(n, device=dev, dtype=torch.float32)
        self.acc = torch.empty((n, shape.head_size), device=dev, dtype=torch.float32)

    def __call__(self, q: torch.Tensor, k_plane: torch.Tensor, v_plane: torch.Tensor) -> torch.Tensor:
        s = self.s
        _paged_decode[(self.batch, s.kv_heads, self.splits)](
            q, k_plane, v_plane, self.tables, self.lens, self.m, self.l, self.acc, self.tables.stride(0),
            s.head_size**-0.5, HQ=s.q_heads, G=s.q_heads // s.kv_heads, GP=16, H=s.kv_heads, N=s.block_size,
            D=s.head_size, X=8, PAGES=self.pages, SPLITS=self.splits, num_warps=4)
        m = self.m.view(self.batch, s.q_heads, self.splits)
        w = torch.exp(m - m.amax(-1, keepdim=True))
        acc = self.acc.view(self.batch, s.q_heads, self.splits, s.head_size)
        den = (self.l.view_as(m) * w).sum(-1, keepdim=True)
        return ((acc * w[..., None]).sum(2) / den).to(q.dtype)
