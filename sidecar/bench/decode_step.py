"""A decoder stand-in's decode step for the interference bench: a Qwen3-8B-like layer stack.

Per layer: the weight GEMMs (QKV, O, gate+up, down; bf16) on ``batch`` rows and paged attention over the
running requests' pages in the AITER shuffled layout the decoder reads (K tile [H, D/x, N, x], V tile
[H, N/x, D, x] in per-layer K/V planes [blocks, H*N*D]). Norms, RoPE and the KV write of the new token are
left out (a few percent of the step). On a GPU the step is one CUDA graph (its CPU cost is one replay);
attention is a split-K Triton kernel checked against the torch version at start. On the CPU (tests) both
are the torch version at tiny sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

X = 8  # 16 bytes of bf16


@dataclass(frozen=True)
class ModelShape:
    layers: int = 36
    hidden: int = 4096
    q_heads: int = 32
    kv_heads: int = 8
    head_size: int = 128
    mlp: int = 12288
    block_size: int = 16

    @property
    def row(self) -> int:
        """Elements of one plane block (half a page)."""
        return self.kv_heads * self.block_size * self.head_size


TINY = ModelShape(layers=2, hidden=64, q_heads=4, kv_heads=2, head_size=16, mlp=96, block_size=16)


def _shuffled_kv(k_plane: torch.Tensor, v_plane: torch.Tensor, ids: torch.Tensor, s: ModelShape) -> tuple:
    """K and V of blocks ``ids`` as [len, H, N, D] from the shuffled tiles."""
    h, n, d = s.kv_heads, s.block_size, s.head_size
    k = k_plane[ids].view(-1, h, d // X, n, X).permute(0, 1, 3, 2, 4).reshape(-1, h, n, d)
    v = v_plane[ids].view(-1, h, n // X, d, X).permute(0, 1, 2, 4, 3).reshape(-1, h, n, d)
    return k, v


def attention_torch(q: torch.Tensor, k_plane: torch.Tensor, v_plane: torch.Tensor, tables: torch.Tensor,
                    lens: torch.Tensor, s: ModelShape) -> torch.Tensor:
    """Reference paged decode attention: q [B, Hq, D] -> [B, Hq, D] (fp32 math)."""
    out = torch.empty_like(q)
    g = s.q_heads // s.kv_heads
    for b in range(q.shape[0]):
        nb = -(-int(lens[b]) // s.block_size)
        k, v = _shuffled_kv(k_plane, v_plane, tables[b, :nb].long(), s)
        k = k.permute(1, 0, 2, 3).reshape(s.kv_heads, -1, s.head_size)[:, : int(lens[b])].float()
        v = v.permute(1, 0, 2, 3).reshape(s.kv_heads, -1, s.head_size)[:, : int(lens[b])].float()
        qb = q[b].float().view(s.kv_heads, g, s.head_size)
        p = torch.softmax(qb @ k.transpose(1, 2) / s.head_size**0.5, dim=-1)
        out[b] = (p @ v).reshape(s.q_heads, s.head_size).to(q.dtype)
    return out


class DecodeStep:
    """Weights, a paged KV cache view and one decode step; ``__call__`` runs it on the current stream."""

    def __init__(self, shape: ModelShape, k_planes: list[torch.Tensor], v_planes: list[torch.Tensor],
                 tables: torch.Tensor, lens: torch.Tensor, *, seed: int = 0) -> None:
        self.s = shape
        self.k_planes, self.v_planes = k_planes, v_planes
        dev = k_planes[0].device
        self.device = dev
        self.tables, self.lens = tables.to(dev), lens.to(dev)
        self.batch = int(tables.shape[0])
        gen = torch.Generator(device=dev).manual_seed(seed)
        dt = torch.bfloat16 if dev.type == "cuda" else torch.float32

        def w(i: int, o: int) -> torch.Tensor:
            return (torch.randn((i, o), generator=gen, device=dev, dtype=torch.float32) * i**-0.5).to(dt)

        qkv = (shape.q_heads + 2 * shape.kv_heads) * shape.head_size
        self.w = [(w(shape.hidden, qkv), w(shape.q_heads * shape.head_size, shape.hidden),
                   w(shape.hidden, 2 * shape.mlp), w(shape.mlp, shape.hidden)) for _ in range(shape.layers)]
        self.x = torch.randn((self.batch, shape.hidden), generator=gen, device=dev,
                             dtype=torch.float32).to(dt)
        self.dtype = dt
        self.triton = dev.type == "cuda"
        if self.triton:
            from sidecar.bench import paged_attention_triton as pat

            self.attn = pat.PagedAttention(shape, tables, lens, self.batch)
        self.graph: Any = None

    def attention(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        if self.triton:
            return self.attn(q, self.k_planes[layer], self.v_planes[layer])
        return attention_torch(q, self.k_planes[layer], self.v_planes[layer], self.tables, self.lens, self.s)

    def eager(self) -> None:
        s = self.s
        x = self.x
        for layer, (wqkv, wo, wgu, wd) in enumerate(self.w):
            h = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)
            qkv = h @ wqkv
            q = qkv[:, : s.q_heads * s.head_size].reshape(self.batch, s.q_heads, s.head_size)
            o = self.attention(layer, q.contiguous())
            x = x + o.reshape(self.batch, -1) @ wo
            gu = (x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)) @ wgu
            x = x + (torch.nn.functional.silu(gu[:, : s.mlp]) * gu[:, s.mlp :]) @ wd
        self.out = x

    def check_attention(self, requests: int = 2) -> float:
        """Relative error of the step's attention against the torch version on a few requests (GPU)."""
        q = torch.randn((self.batch, self.s.q_heads, self.s.head_size), device=self.device).to(self.dtype)
        got = self.attention(0, q)[:requests].float()
        ref = attention_torch(q[:requests], self.k_planes[0], self.v_planes[0], self.tables[:requests],
                              self.lens[:requests], self.s).float()
        return float((got - ref).norm() / ref.norm())

    def capture(self) -> None:
        """Warm up, then capture the step as one CUDA graph (GPU only)."""
        if self.device.type != "cuda":
            return
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.eager()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.eager()
        torch.cuda.synchronize()

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.eager()


def kv_bytes_per_step(shape: ModelShape, lens: torch.Tensor) -> int:
    """Bytes of K/V the step reads (whole pages)."""
    blocks = int(sum(-(-int(n) // shape.block_size) for n in lens))
    return blocks * shape.layers * 2 * shape.row * 2


def weight_bytes(shape: ModelShape) -> int:
    qkv = (shape.q_heads + 2 * shape.kv_heads) * shape.head_size
    per = shape.hidden * qkv + shape.q_heads * shape.head_size * shape.hidden + 3 * shape.hidden * shape.mlp
    return per * shape.layers * 2
