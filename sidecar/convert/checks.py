"""Converter input checks: each problem is a ValueError naming it, raised before anything is written."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

CONVERTIBLE = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Job:
    """A checked conversion: planes as int16 views (a pure permutation never looks at values), ids on CPU."""

    k_planes: tuple[torch.Tensor, ...]
    v_planes: tuple[torch.Tensor, ...]
    srcs: tuple[torch.Tensor, ...] | None
    ids: torch.Tensor  # int64, CPU, checked: in range, no duplicates
    num_heads: int
    block_size: int
    head_size: int

    @property
    def x(self) -> int:
        return 8  # 16 bytes of 2-byte elements

    @property
    def plane_block_elems(self) -> int:
        return self.num_heads * self.block_size * self.head_size

    @property
    def device(self) -> torch.device:
        return self.k_planes[0].device


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Byte range [start, end) that a 2-D tensor with unit inner stride can touch."""
    if t.numel() == 0:
        return (t.data_ptr(), t.data_ptr())
    last = (t.shape[0] - 1) * t.stride(0) + t.shape[1]
    return (t.data_ptr(), t.data_ptr() + last * t.element_size())


def _check_disjoint(named: list[tuple[str, torch.Tensor]]) -> None:
    spans = sorted((*_span(t), name) for name, t in named if t.numel())
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise ValueError(f"{a} and {b} overlap in memory; every plane and source must be disjoint")


def _check_plane(name: str, t: object, row_elems: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in CONVERTIBLE:
        raise ValueError(f"{name} dtype {t.dtype} is not convertible; only bfloat16 and float16 are "
                         "(a bit-exact permutation)")
    if t.dim() != 2 or t.shape[1] != row_elems:
        raise ValueError(f"{name} shape {tuple(t.shape)} must be [num_blocks, num_heads*block_size*head_size]"
                         f" = [num_blocks, {row_elems}]")
    if t.numel() and t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must be dense along its element axis (stride(1) == 1), got {t.stride()}")
    return t


def _check_ids(block_ids: object, device: torch.device, num_blocks: int) -> torch.Tensor:
    if not isinstance(block_ids, torch.Tensor):
        raise ValueError(f"block_ids must be a torch.Tensor, got {type(block_ids).__name__}")
    if block_ids.dtype.is_floating_point or block_ids.dtype.is_complex or block_ids.dtype == torch.bool:
        raise ValueError(f"block_ids dtype {block_ids.dtype} must be an integer type")
    if block_ids.dim() != 1:
        raise ValueError(f"block_ids must be 1-D, got shape {tuple(block_ids.shape)}")
    if block_ids.device.type != "cpu" and block_ids.device != device:
        raise ValueError(f"block_ids is on {block_ids.device}; it must be on the CPU or on the planes' "
                         f"{device}")
    ids = block_ids.to("cpu", torch.int64)  # a GPU tensor costs one sync here: pass CPU ids on hot paths
    if ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_blocks:
            bad = lo if lo < 0 else hi
            raise ValueError(f"block_ids holds {bad}, out of range [0, {num_blocks})")
        if torch.unique(ids).numel() != ids.numel():
            uniq, counts = torch.unique(ids, return_counts=True)
            raise ValueError(f"block_ids holds duplicates, e.g. {int(uniq[counts > 1][0])}")
    return ids


def _as_src_list(src: object, num_layers: int) -> list[object]:
    if isinstance(src, torch.Tensor):
        if src.dim() != 3 or src.shape[0] != num_layers:
            raise ValueError(f"src shape {tuple(src.shape)} must be "
                             f"[num_layers={num_layers}, len(block_ids), page]")
        return list(src.unbind(0))
    if isinstance(src, Sequence) and not isinstance(src, (str, bytes)):
        if len(src) != num_layers:
            raise ValueError(f"src has {len(src)} layers, the planes {num_layers}")
        return list(src)
    raise ValueError(f"src must be a tensor or a sequence of tensors, got {type(src).__name__}")


def check_job(
    k_planes: Sequence[object],
    v_planes: Sequence[object],
    block_ids: object,
    *,
    num_heads: object,
    block_size: object,
    head_size: object,
    srcs: Sequence[object] | None,
) -> Job:
    """Check everything a conversion reads or writes; raise ValueError naming the first problem found."""
    h = _positive_int("num_heads", num_heads)
    n = _positive_int("block_size", block_size)
    d = _positive_int("head_size", head_size)
    if len(k_planes) == 0:
        raise ValueError("no layers: k_planes is empty")
    if len(k_planes) != len(v_planes):
        raise ValueError(f"{len(k_planes)} K planes but {len(v_planes)} V planes")
    single = len(k_planes) == 1
    row = h * n * d
    k_names = ["k_plane"] if single else [f"k_planes[{i}]" for i in range(len(k_planes))]
    v_names = ["v_plane"] if single else [f"v_planes[{i}]" for i in range(len(v_planes))]
    ks = [_check_plane(name, t, row) for name, t in zip(k_names, k_planes, strict=False)]
    vs = [_check_plane(name, t, row) for name, t in zip(v_names, v_planes, strict=False)]
    named = list(zip(k_names, ks, strict=False)) + list(zip(v_names, vs, strict=False))
    dtype, device = ks[0].dtype, ks[0].device
    for name, t in named[1:]:
        if t.dtype != dtype:
            raise ValueError(f"{name} dtype {t.dtype} differs from {k_names[0]}'s {dtype}")
        if t.device != device:
            raise ValueError(f"mismatched devices: {name} is on {t.device}, {k_names[0]} on {device}")
    for i, (k, v) in enumerate(zip(ks, vs, strict=False)):
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"layer {i}: K plane has {k.shape[0]} blocks, V plane {v.shape[0]}")
    x = 16 // ks[0].element_size()
    if d % x:
        raise ValueError(f"head_size {d} is not a multiple of x={x} (16 bytes of {dtype})")
    if n % x:
        raise ValueError(f"block_size {n} is not a multiple of x={x} (16 bytes of {dtype})")
    ids = _check_ids(block_ids, device, min(k.shape[0] for k in ks))
    src_list = None
    if srcs is not None:
        src_list = []
        for i, s in enumerate(srcs):
            name = "src" if single else f"src[{i}]"
            if not isinstance(s, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(s).__name__}")
            if s.dtype != dtype:
                raise ValueError(f"{name} dtype {s.dtype} differs from the planes' {dtype}")
            if s.device != device:
                raise ValueError(f"mismatched devices: {name} is on {s.device}, the planes on {device}")
            if s.dim() != 2 or s.shape[0] != ids.numel() or s.shape[1] != 2 * row:
                raise ValueError(f"{name} shape {tuple(s.shape)} must be [len(block_ids), "
                                 f"2*num_heads*block_size*head_size] = [{ids.numel()}, {2 * row}]")
            if s.numel() and s.shape[1] > 1 and s.stride(1) != 1:
                raise ValueError(f"{name} must be dense along its element axis (stride(1) == 1)")
            src_list.append(s)
    if src_list is not None:
        named += [("src" if single else f"src[{i}]", t) for i, t in enumerate(src_list)]
    _check_disjoint(named)
    return Job(
        k_planes=tuple(t.view(torch.int16) for t in ks),
        v_planes=tuple(t.view(torch.int16) for t in vs),
        srcs=None if src_list is None else tuple(t.view(torch.int16) for t in src_list),
        ids=ids,
        num_heads=h,
        block_size=n,
        head_size=d,
    )


def src_layers(src: object, num_layers: int) -> list[object] | None:
    """Normalise a batched ``src`` (a [L, M, page] tensor or a list of L [M, page] tensors) to a list."""
    return None if src is None else _as_src_list(src, num_layers)
