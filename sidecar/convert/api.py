"""Public entry points: check the input, then convert with Triton on a GPU, the torch reference on the CPU."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from sidecar.convert.checks import (
    ConversionJob,
    SourceMemo,
    aligned16,
    check_job,
    check_launch,
    check_planes,
    check_request,
)
from sidecar.convert.reference import run_reference
from sidecar.convert.tables import MetaCache
from sidecar.convert.tuning import Tuning

IDENTITY_LUT = np.tile(np.arange(256, dtype=np.int32), (2, 1))  # a re-encode table that keeps every byte


def _run(job: ConversionJob, tuning: Tuning | None = None, tables: MetaCache | None = None) -> None:
    if job.device.type == "cuda":  # CUDA and ROCm (HIP) builds of torch both say "cuda"
        from sidecar.convert import triton_kernel  # lazy: the CPU torch wheel has no Triton

        if aligned16(job):  # the kernels move 16-byte vectors
            triton_kernel.run_triton(job, tuning, tables)
            return
    run_reference(job)


def convert_standard_to_shuffled(
    k_plane: torch.Tensor,
    v_plane: torch.Tensor,
    block_ids: torch.Tensor,
    *,
    num_heads: int,
    block_size: int,
    head_size: int,
    src: torch.Tensor | None = None,
) -> None:
    """Rewrite standard pages as AITER shuffled K/V tiles in one layer's planes (docs/page-formats.md).

    ``k_plane``/``v_plane``: ``[num_blocks, num_heads*block_size*head_size]``, bf16 or fp16, same device.
    In place (``src=None``): block ``b`` of ``block_ids`` holds a standard page split as (K-plane block ‖
    V-plane block); afterwards it holds the K tile ``[H, D/x, N, x]`` and the V tile ``[H, N/x, D, x]``.
    Out of place: ``src[i]`` is the standard page (``[len(block_ids), 2*H*N*D]``) for ``block_ids[i]``.
    Other blocks are left byte for byte. Invalid input raises ValueError and writes nothing. GPU work is
    queued on the current stream; ``block_ids`` on the CPU avoids a device sync for the checks.
    """
    if src is not None and not isinstance(src, torch.Tensor):
        raise ValueError(f"src must be a torch.Tensor, got {type(src).__name__}")
    job = check_job([k_plane], [v_plane], block_ids, num_heads=num_heads, block_size=block_size,
                    head_size=head_size, srcs=None if src is None else [src])
    _run(job)


def convert_layers_standard_to_shuffled(
    k_planes: Sequence[torch.Tensor],
    v_planes: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    *,
    num_heads: int,
    block_size: int,
    head_size: int,
    src: torch.Tensor | Sequence[torch.Tensor] | None = None,
) -> None:
    """Convert the same ``block_ids`` in every layer of a request, in one launch on a GPU.

    ``k_planes[l]``/``v_planes[l]``: layer ``l``'s planes, each as in ``convert_standard_to_shuffled``;
    they may live anywhere (one allocation or many, any row strides). ``src``: ``None`` (in place), a
    ``[L, len(block_ids), 2*H*N*D]`` tensor, or a sequence of ``L`` tensors ``[len(block_ids), 2*H*N*D]``.
    All checks of every layer pass before anything is written.
    """
    PlaneSet(k_planes, v_planes, num_heads=num_heads, block_size=block_size, head_size=head_size).convert(
        block_ids, src=src
    )


class PlaneSet:
    """One model's K/V planes, checked once; ``convert`` then checks only what a request brings (ids, src).

    For a daemon converting every request into the same caches: the per-layer checks of
    ``convert_layers_standard_to_shuffled`` cost about 10 µs a layer in Python on every call.
    """

    def __init__(
        self,
        k_planes: Sequence[torch.Tensor],
        v_planes: Sequence[torch.Tensor],
        *,
        num_heads: int,
        block_size: int,
        head_size: int,
        lut: np.ndarray | None = None,
    ) -> None:
        """``lut``: int32 [2, 256] (``sidecar.wire.fp8.pair_table``) to re-encode fp8 bytes while converting
        (e4m3fn pages into e4m3fnuz planes); the planes must then be a 1-byte dtype."""
        if not isinstance(k_planes, Sequence) or not isinstance(v_planes, Sequence):
            raise ValueError("k_planes and v_planes must be sequences of tensors (one per layer)")
        self.planes = check_planes(k_planes, v_planes, num_heads=num_heads, block_size=block_size,
                                   head_size=head_size)
        self.lut = None
        if lut is not None:
            table = np.asarray(lut)
            if table.shape != (2, 256) or table.dtype != np.int32:
                raise ValueError(f"lut must be int32 [2, 256], got {table.dtype} {table.shape}")
            if self.planes.elem_bytes != 1:
                raise ValueError(f"a byte re-encode needs 1-byte planes, not {self.planes.dtype}")
            self.lut = torch.from_numpy(table.copy()).to(self.planes.device)
        self.sources = SourceMemo()  # staged sources checked once
        self.tables = MetaCache()  # the kernels' meta tables built once per layer range and source

    @property
    def num_layers(self) -> int:
        return len(self.planes.k_planes)

    def warm_up(self) -> None:
        """Compile (or load from Triton's cache) the GPU kernels these planes need, on two scratch blocks of
        the same geometry, never on the planes: a first request then does not wait the ~1 s of a compile.
        1-byte planes also warm the fp8 re-encode's variants. No-op on the CPU."""
        p = self.planes
        if p.device.type != "cuda":
            return
        row = p.num_heads * p.block_size * p.head_size
        with torch.cuda.device(p.device):
            k, v = (torch.zeros((2, row), dtype=p.dtype, device=p.device) for _ in range(2))
            geom = dict(num_heads=p.num_heads, block_size=p.block_size, head_size=p.head_size)
            scratches = [PlaneSet([k], [v], **geom)]
            if p.elem_bytes == 1:
                # an fp8 pairing's re-encode (its own PlaneSet, made at its first pull) launches other
                # variants; their first launch would load a module on the loop, which waits for the device
                scratches.append(PlaneSet([k], [v], **geom, lut=IDENTITY_LUT))
            ids = torch.tensor([1, 0])
            for scratch in scratches:
                scratch.convert(ids)  # in place
                scratch.convert(ids, src=torch.zeros((1, 2, 2 * row), dtype=p.dtype, device=p.device))
                # staged spans read through gaps convert with a source index: another kernel variant
                scratch.convert(ids, src=torch.zeros((1, 3, 2 * row), dtype=p.dtype, device=p.device),
                                src_index=torch.tensor([2, 0]))
            torch.cuda.current_stream().synchronize()

    def convert(
        self,
        block_ids: torch.Tensor,
        *,
        src: torch.Tensor | Sequence[torch.Tensor] | None = None,
        layers: tuple[int, int] | None = None,
        tuning: Tuning | None = None,
        src_index: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """As ``convert_layers_standard_to_shuffled`` for layers ``[first, last)`` (default all); ``src``
        then holds exactly those layers. ``tuning``: launch shapes (default ``TUNING``; GPU only). With a
        re-encode table, returns int64 [2] on the planes' device: (saturated, NaN) elements of this call,
        ready once the conversion's stream gets there; else None. ``src_index`` (CPU ints, out of place):
        ``block_ids[i]`` reads source row ``src_index[i]``, so ``src`` may hold rows that are not converted
        (a staged span read through gaps)."""
        counts = self._counts()
        job = check_request(
            self.planes, block_ids, src, layers, lut=self.lut, counts=counts, src_index=src_index,
            memo=self.sources,
        )
        _run(job, tuning, self.tables)
        return counts

    def convert_arrays(
        self,
        block_ids: np.ndarray,
        *,
        src: torch.Tensor | None = None,
        layers: tuple[int, int] | None = None,
        tuning: Tuning | None = None,
        src_index: np.ndarray | None = None,
    ) -> torch.Tensor | None:
        """As ``convert`` for the daemon's launches: ``block_ids`` and ``src_index`` as numpy int arrays,
        ``src`` one ``[layers, rows, page]`` tensor (the staging view) or None. The same checks of ids,
        source and source rows, with less per call (``checks.check_launch``)."""
        counts = self._counts()
        job = check_launch(self.planes, block_ids, src, layers, self.sources, lut=self.lut, counts=counts,
                           src_index=src_index)
        _run(job, tuning, self.tables)
        return counts

    def _counts(self) -> torch.Tensor | None:
        """A fresh (saturated, NaN) counter for a call that re-encodes fp8; None without a table."""
        return None if self.lut is None else torch.zeros(2, dtype=torch.int64, device=self.planes.device)
