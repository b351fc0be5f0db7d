"""The golden grid: standard pages with known K/V, converted by the daemon's own path, decoded from the
shuffled planes by independent readers, compared with attention over the standard pages.

The check is built so that a layout slip cannot pass it:
- sequences end at different offsets inside their last block, and the slots past the end hold poison
  (|V| = 512, where real values are within 4): a converter that moves tokens inside a block (even the same
  way for K and V, which plain attention could not see) brings poison into some sequence's softmax;
- every block the request does not own, and every plane block before conversion, holds poison too;
- K and V differ per head, token and dim, and query heads differ, so a head or dim swap moves the output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch

from sidecar.verify.aiter_layout import k_offset, v_offset, x_of
from sidecar.verify.readers import decode_reference, shuffled_views
from sidecar.wire.formats import PageFormat

POISON = 512.0  # exactly representable in bf16 and fp16; real K/V/Q are clamped to [-VMAX, VMAX]
VMAX = 4.0
LAYERS = 2
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}

# Tolerances on float32 outputs, as a fraction of VMAX (every output is a convex combination of V rows, so
# |out| <= VMAX). Exact readers (torch, Triton) see the very values the reference sees (bf16/fp16 upcast to
# float32 exactly) and differ only in float32 summation order: ~T * 2^-24 relative, far below 1e-4.
# AITER's kernel multiplies in the cache dtype with float32 accumulation and rounds the softmax weights
# (PV mfma inputs) and the output to the cache dtype: each rounding is at most eps/2 relative (eps = 2^-8 for
# bf16's 8-bit significand, 2^-11 for fp16's 11 bits), so the error is about eps * VMAX; 4 eps leaves a
# margin for the logits' own rounding. A layout slip moves whole tokens' weight: errors of order VMAX, or
# of order POISON when a poisoned slot is read, i.e. 15x (bf16) to 128x (fp16) above the loosest tolerance.
EXACT_TOL = 1e-4
EPS = {"bfloat16": 2.0**-8, "float16": 2.0**-11}


def tolerance(reader: str, dtype: str) -> float:
    """Absolute tolerance on the attention output of ``reader`` for a ``dtype`` cache."""
    return VMAX * (4 * EPS[dtype] if reader == "aiter" else EXACT_TOL)


class Shape(msgspec.Struct, frozen=True):
    """One golden shape: N tokens per block, D head size, H KV heads, cache dtype, query heads per KV head."""

    block_size: int
    head_size: int
    num_heads: int
    dtype: str
    gqa: int

    @property
    def label(self) -> str:
        return f"N={self.block_size} D={self.head_size} H={self.num_heads} {self.dtype} gqa={self.gqa}"

    def page_format(self, kind: str, layout: str) -> PageFormat:
        return PageFormat(kind=kind, layout=layout, dtype=self.dtype, num_heads=self.num_heads,
                          block_size=self.block_size, head_size=self.head_size)


GOLDEN_GRID: tuple[Shape, ...] = tuple(
    Shape(n, d, h, dt, 4 if h % 2 else 2)
    for dt in ("bfloat16", "float16") for n in (16, 32) for d in (64, 128, 256) for h in (3, 4)
)

# (k_planes, v_planes, block_ids, local format, staged source or None): convert those blocks in every layer
Converter = Callable[[list, list, np.ndarray, PageFormat, Any], None]


@dataclass
class _DaemonCaches:
    """The two attributes the daemon's conversion entry points read from its ``Caches`` (k/v planes and the
    ``PlaneSet`` they build lazily): sidecar.convert.launch.convert_blocks / launch_gpu."""

    k_planes: list
    v_planes: list
    plane_set: Any = None


def daemon_converter(k_planes: list, v_planes: list, ids: np.ndarray, fmt: PageFormat, src: Any) -> None:
    """Convert as the daemon does: ``convert_blocks`` on the CPU, ``launch_gpu`` on a side stream on a GPU
    (sidecar/daemon/service.py ``_convert_group``), then wait for its event."""
    from sidecar.convert.launch import convert_blocks, launch_gpu

    caches = _DaemonCaches(list(k_planes), list(v_planes))
    if k_planes[0].device.type == "cpu":
        convert_blocks(caches, ids, fmt, src)
        return
    stream = torch.cuda.Stream(device=k_planes[0].device)
    # The pages were written on the current stream; in the daemon NIXL's DONE plays this part.
    stream.wait_stream(torch.cuda.current_stream(k_planes[0].device))
    launch_gpu(stream, caches, ids, fmt, src).synchronize()


@dataclass
class Case:
    """Known inputs of one shape: standard pages, the decoder's cache, the request and its queries."""

    shape: Shape
    std: torch.Tensor  # [L, B, H, N, 2D] standard pages (LBHNC), cache dtype
    cache: torch.Tensor  # [L, 2, B, N, H*D]: the decoder's LHBNC allocation (K plane, V plane per layer)
    ids: np.ndarray  # blocks the request owns, in the order its pages arrive
    block_tables: torch.Tensor  # [S, max blocks] int32
    context_lens: torch.Tensor  # [S] int32
    queries: torch.Tensor  # [L, S, H*gqa, D]

    def k_planes(self) -> list[torch.Tensor]:
        """Per layer ``[B, H*N*D]``, as the daemon views each layer's K side (daemon/caches.py map_caches)."""
        return [self.cache[layer, 0].view(self.cache.shape[2], -1) for layer in range(self.cache.shape[0])]

    def v_planes(self) -> list[torch.Tensor]:
        return [self.cache[layer, 1].view(self.cache.shape[2], -1) for layer in range(self.cache.shape[0])]

    def sides(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's per-layer view ``[B, 2, N, H*D]`` split as rocm_aiter_fa.py ``_split_kv_cache``: two
        ``[B, N, H, D]`` sides."""
        view = self.cache[layer].transpose(0, 1)  # [B, 2, N, H*D] with LHBNC strides
        s = self.shape
        return view.unflatten(-1, (s.num_heads, s.head_size)).unbind(1)


def context_lengths(block_size: int) -> list[int]:
    """Sequences ending on a block edge, past the middle of a block, and early in their first block."""
    n = block_size
    return [2 * n, n + n // 2 + 3, 5]


def make_case(shape: Shape, device: torch.device, seed: int = 0) -> Case:
    g = torch.Generator().manual_seed(seed)
    dtype = DTYPES[shape.dtype]
    n, d, h = shape.block_size, shape.head_size, shape.num_heads
    lens = context_lengths(n)
    owned = [-(-c // n) for c in lens]
    num_blocks = sum(owned) + 2
    perm = torch.randperm(num_blocks, generator=g).numpy()
    ids = perm[: sum(owned)]
    rand = lambda *size: torch.randn(*size, generator=g).clamp_(-VMAX, VMAX)
    std = torch.full((LAYERS, num_blocks, h, n, 2 * d), POISON)
    std[:, ids] = rand(LAYERS, len(ids), h, n, 2 * d)
    tables = torch.zeros((len(lens), max(owned)), dtype=torch.int32)
    start = 0
    for s, (ctx, nb) in enumerate(zip(lens, owned, strict=True)):
        blocks = ids[start:start + nb]
        start += nb
        tables[s, :nb] = torch.from_numpy(blocks.astype(np.int32))
        tail = ctx - (nb - 1) * n  # tokens used in the last block
        std[:, int(blocks[-1]), :, tail:] = POISON  # slots no token was written to
    queries = rand(LAYERS, len(lens), h * shape.gqa, d)
    cache = torch.full((LAYERS, 2, num_blocks, n, h * d), POISON)
    return Case(shape=shape, std=std.to(dtype).to(device), cache=cache.to(dtype).to(device), ids=ids,
                block_tables=tables.to(device), context_lens=torch.tensor(lens, dtype=torch.int32).to(device),
                queries=queries.to(dtype).to(device))


def land_halves(case: Case) -> None:
    """What NIXL does before an in-place conversion: each standard page's first byte half into the K-plane
    block, the second into the V-plane block (page-formats.md, "Moving a standard block into the two
    planes")."""
    half = case.shape.num_heads * case.shape.block_size * case.shape.head_size
    ids = torch.from_numpy(case.ids).to(case.std.device)
    pages = case.std[:, ids].reshape(LAYERS, len(case.ids), 2 * half)
    for layer, (kp, vp) in enumerate(zip(case.k_planes(), case.v_planes(), strict=True)):
        kp[ids] = pages[layer, :, :half]
        vp[ids] = pages[layer, :, half:]


def staged_source(case: Case) -> torch.Tensor:
    """The request's standard pages as the daemon stages them: ``[layers, blocks, page elements]``."""
    ids = torch.from_numpy(case.ids).to(case.std.device)
    return case.std[:, ids].reshape(LAYERS, len(case.ids), -1).contiguous()


def expected_bits(case: Case) -> torch.Tensor:
    """The cache as AITER's kernel expects to find it: the owned blocks' K/V placed by ``aiter_layout``'s
    offsets, the rest untouched (poison). Raw int16 bits, ``[L, 2, B*N*H*D]``."""
    s = case.shape
    n, d, h, x = s.block_size, s.head_size, s.num_heads, x_of(DTYPES[s.dtype])
    out = case.cache.clone().view(torch.int16).reshape(LAYERS, 2, -1)
    dev = case.std.device
    blk = torch.from_numpy(case.ids).to(dev)[:, None, None, None]
    head = torch.arange(h, device=dev)[None, :, None, None]
    tok = torch.arange(n, device=dev)[None, None, :, None]
    dim = torch.arange(d, device=dev)[None, None, None, :]
    geom = dict(kv_block_stride=h * d * n, kv_head_stride=d * n, x=x)
    k_off = k_offset(blk, head, tok, dim, block_size=n, **geom).expand(-1, h, n, d)
    v_off = v_offset(blk, head, tok, dim, head_size=d, **geom).expand(-1, h, n, d)
    bits = case.std.view(torch.int16)[:, torch.from_numpy(case.ids).to(dev)]  # [L, M, H, N, 2D]
    for layer in range(LAYERS):
        out[layer, 0, k_off.reshape(-1)] = bits[layer, ..., :d].reshape(-1)
        out[layer, 1, v_off.reshape(-1)] = bits[layer, ..., d:].reshape(-1)
    return out


Reader = Callable[..., torch.Tensor]


class ReaderResult(msgspec.Struct, frozen=True):
    reader: str
    max_error: float
    tolerance: float
    ok: bool


class ShapeResult(msgspec.Struct, frozen=True):
    """One shape in one conversion mode: bytes as AITER's indexing expects, and each reader's attention."""

    shape: Shape
    mode: str  # "in_place" (NIXL landed the halves in the planes) or "staged" (converted from a staging copy)
    bytes_ok: bool | None  # None when not checked
    readers: list[ReaderResult]

    @property
    def attention_ok(self) -> bool:
        return bool(self.readers) and all(r.ok for r in self.readers)

    @property
    def ok(self) -> bool:
        return self.attention_ok and self.bytes_ok is not False


def run_shape(shape: Shape, device: torch.device, readers: dict[str, Reader], *, mode: str = "in_place",
              convert: Converter | None = None, check_bytes: bool = True, seed: int = 0) -> ShapeResult:
    """Build, convert (default: ``daemon_converter``), decode every layer with every reader, compare with the
    standard-page reference."""
    convert = convert or daemon_converter
    case = make_case(shape, device, seed)
    local = shape.page_format("aiter_shuffled", "LHBNC")
    if mode == "in_place":
        land_halves(case)
        convert(case.k_planes(), case.v_planes(), case.ids, local, None)
    elif mode == "staged":
        convert(case.k_planes(), case.v_planes(), case.ids, local, staged_source(case))
    else:
        raise ValueError(f"mode {mode!r} is not 'in_place' or 'staged'")
    bytes_ok = None
    if check_bytes:
        bytes_ok = bool(torch.equal(case.cache.view(torch.int16).reshape(LAYERS, 2, -1), expected_bits(case)))
    scale = shape.head_size ** -0.5
    results = []
    for name, reader in readers.items():
        worst = 0.0
        for layer in range(LAYERS):
            ref = decode_reference(case.queries[layer], case.std[layer], case.block_tables, case.context_lens,
                                   scale)
            k_cache, v_cache = shuffled_views(*case.sides(layer), shape.num_heads, shape.head_size)
            out = reader(case.queries[layer], k_cache, v_cache, case.block_tables, case.context_lens, scale)
            err = (out.float() - ref).abs().max().item()
            worst = max(worst, err if err == err else float("inf"))  # NaN counts as a failure
        tol = tolerance(name, shape.dtype)
        results.append(ReaderResult(name, worst, tol, worst <= tol))
    return ShapeResult(shape=shape, mode=mode, bytes_ok=bytes_ok, readers=results)


def run_grid(shapes: Sequence[Shape], device: torch.device, readers: dict[str, Reader], *,
             modes: Sequence[str] = ("in_place", "staged"), convert: Converter | None = None
             ) -> list[ShapeResult]:
    return [run_shape(s, device, readers, mode=m, convert=convert) for s in shapes for m in modes]
