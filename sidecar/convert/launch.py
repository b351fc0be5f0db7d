"""Starting a request's page conversion: on the CPU (in the caller's thread) or on the daemon's own stream.

``ConversionLimits`` bounds what one conversion may take from the decoder sharing the GPU (issue 13):
slices (a request in launches of at most ``max_slice_pairs`` (layer, block) pairs, optionally paced by a
host wait between them), a capped grid (``max_ctas`` programs at most) and the stream's priority.
``limits_for`` turns the operator's one knob (``conversion_max_step_delay_us``) into those numbers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from sidecar.convert import checks
from sidecar.wire.formats import PageFormat

# Conversion rate used when none was measured: H200, Qwen3-8B 4k request, 9,216 pairs in 0.36 ms
# (measured on 2026-12-01: the daemon's convert stage, p50 0.36 ms).
DEFAULT_PAIRS_PER_US = 25.0


@dataclass(frozen=True)
class ConversionLimits:
    """How much of the GPU one conversion may hold at a time (all zero: one launch, the kernel's own grid)."""

    max_slice_pairs: int = 0  # (layer, block) pairs per launch; 0: a whole layer group in one launch
    slice_gap_us: float = 0.0  # host wait after each slice completes (paced; ``convert_paced`` only)
    max_ctas: int = 0  # programs per launch at most (persistent kernels loop); 0: the kernel's own grid
    low_priority: bool = False  # the conversion stream gets the lowest priority (matters in a shared context)

    def __post_init__(self) -> None:
        for name in ("max_slice_pairs", "max_ctas"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.slice_gap_us < 0:
            raise ValueError(f"slice_gap_us must be >= 0, got {self.slice_gap_us}")

    @property
    def unbounded(self) -> bool:
        return not (self.max_slice_pairs or self.max_ctas or self.slice_gap_us)

    def tuning(self) -> Any:
        """Launch shapes for this cap: in place through the persistent "pipe" kernel, out of place through the
        persistent out-of-place kernel, both with at most ``max_ctas`` programs (None: the defaults)."""
        if not self.max_ctas:
            return None
        from sidecar.convert.tuning import Tuning

        return Tuning(in_place="pipe", pipe_max_programs=self.max_ctas, oop_max_programs=self.max_ctas)


def limits_for(
    max_step_delay_us: float, pairs_per_us: float = DEFAULT_PAIRS_PER_US, low_priority: bool = True
) -> ConversionLimits:
    """The operator's knob as limits: slices short enough that one runs ``max_step_delay_us`` at most at
    ``pairs_per_us`` (a measured conversion rate); 0 means no bound."""
    if max_step_delay_us < 0 or pairs_per_us <= 0:
        raise ValueError(
            f"need max_step_delay_us >= 0 and pairs_per_us > 0, got {max_step_delay_us}, {pairs_per_us}"
        )
    if max_step_delay_us == 0:
        return ConversionLimits(low_priority=low_priority)
    return ConversionLimits(
        max_slice_pairs=max(1, int(max_step_delay_us * pairs_per_us)), low_priority=low_priority
    )


def plan_slices(layers: tuple[int, int], m: int, max_pairs: int) -> list[tuple[int, int, int, int]]:
    """Cut layers [first, last) x blocks [0, m) into launches of at most ``max_pairs`` pairs (0: one launch):
    whole layers together while a layer fits, else each layer in runs of blocks. Items: (l0, l1, b0, b1)."""
    first, last = layers
    if last <= first or m <= 0:
        return []
    if max_pairs <= 0 or max_pairs >= (last - first) * m:
        return [(first, last, 0, m)]
    if max_pairs >= m:
        per = max_pairs // m
        return [(lo, min(lo + per, last), 0, m) for lo in range(first, last, per)]
    return [
        (lay, lay + 1, b, min(b + max_pairs, m)) for lay in range(first, last) for b in range(0, m, max_pairs)
    ]


def conversion_planes(caches: Any, fmt: PageFormat) -> Any:
    """The caches' planes as a checked ``PlaneSet``: each conversion then checks only its ids and source."""
    from sidecar.convert import PlaneSet

    return PlaneSet(
        caches.k_planes,
        caches.v_planes,
        num_heads=fmt.num_heads,
        block_size=fmt.block_size,
        head_size=fmt.head_size,
    )


def convert_blocks(
    caches: Any,
    block_ids: np.ndarray,
    fmt: PageFormat,
    src: Any,
    layers: tuple[int, int] | None = None,
    limits: ConversionLimits | None = None,
    planes: Any = None,
    src_index: np.ndarray | None = None,
) -> Any:
    """Convert a request's blocks in layers ``[first, last)`` (default all) on the current stream or the CPU.
    ``src``: None to convert in place, else the staged pages of exactly those layers. ``limits``: slices and
    grid cap (the launches are queued back to back; pacing is ``convert_paced``'s). ``planes``: the
    ``PlaneSet`` to use instead of the caches' own (one with an fp8 re-encode table). Returns the re-encode's
    (saturated, NaN) counts as an int64 [2] tensor on the planes' device, or None without a table.
    ``src_index``: block ``i`` reads source row ``src_index[i]`` (a staged span with gap rows)."""
    ps = _plane_set(caches, fmt, planes)
    counts = None
    for piece in _pieces(ps, np.asarray(block_ids), src, layers, limits, src_index):
        got = piece()
        if got is not None:
            counts = got if counts is None else counts + got
    return counts


def _plane_set(caches: Any, fmt: PageFormat, planes: Any = None) -> Any:
    """The PlaneSet to convert with: ``planes``, else the caches' own (made here for a non-shuffled cache)."""
    if planes is None:
        if caches.plane_set is None:  # made at registration for a shuffled cache
            caches.plane_set = conversion_planes(caches, fmt)
        planes = caches.plane_set
    return planes


def _pieces(
    ps: Any,
    ids: np.ndarray,
    src: Any,
    layers: tuple[int, int] | None,
    limits: ConversionLimits | None,
    index: np.ndarray | None = None,
) -> list[Any]:
    """One callable per launch of the request (one unless ``limits`` slices it), on PlaneSet ``ps``.
    ``index``: source rows per block; a slice then keeps every source row."""
    if limits is None or limits.unbounded:
        return [lambda: ps.convert_arrays(ids, src=src, layers=layers, src_index=index)]
    # Each slice checks only its own ids: check the whole request first, so a duplicate split across slices
    # is refused and nothing is written unless every id (and source row) is valid.
    ids = checks.launch_ids(ps.planes, ids)
    span = layers if layers is not None else (0, ps.num_layers)
    if src is not None:
        _check_whole_source(src, span, len(ids), index is not None)
    if index is not None and src is not None:
        checks.launch_src_rows(index, ids, src.shape[1])
    tuning = limits.tuning()
    out = []
    for l0, l1, b0, b1 in plan_slices(span, len(ids), limits.max_slice_pairs):
        rows = slice(None) if index is not None else slice(b0, b1)
        part = None if src is None else src[l0 - span[0] : l1 - span[0], rows]
        sub = None if index is None else index[b0:b1]
        out.append(
            lambda i=ids[b0:b1], s=part, lr=(l0, l1), x=sub: ps.convert_arrays(
                i, src=s, layers=lr, tuning=tuning, src_index=x
            )
        )
    return out


def _check_whole_source(src: Any, span: tuple[int, int], m: int, indexed: bool) -> None:
    """The unsliced launch's rule for ``src``, [layers of ``span``, ``m`` rows (any number when ``indexed``),
    page], checked before any slice runs: a slice sees only its own cut and would convert its blocks before a
    later one found the source short."""
    layers = span[1] - span[0]
    shape = tuple(getattr(src, "shape", ()))
    if len(shape) != 3 or shape[0] != layers or (not indexed and shape[1] != m):
        rows = "rows" if indexed else f"{m} rows"
        raise ValueError(f"src shape {shape} must be [{layers} layers, {rows}, page] for this launch")


def make_stream(device: Any, limits: ConversionLimits | None = None) -> Any:
    """The conversion stream: lowest priority when ``limits.low_priority`` (a lower one than the decoder's
    only where the decoder's stream has a higher one; priorities order streams within one context)."""
    import torch

    if limits is not None and limits.low_priority:
        return torch.cuda.Stream(device=device, priority=0)  # CUDA/HIP: 0 is the lowest, negative is higher
    return torch.cuda.Stream(device=device)


def launch_gpu(
    stream: Any,
    caches: Any,
    block_ids: np.ndarray,
    fmt: PageFormat,
    src: Any,
    layers: tuple[int, int] | None = None,
    limits: ConversionLimits | None = None,
    planes: Any = None,
    counts: list[Any] | None = None,
    src_index: np.ndarray | None = None,
) -> Any:
    """Queue the conversion on the daemon's own stream (never the decoder's) and return its event.
    ``planes``, ``src_index`` as in ``convert_blocks``; the re-encode counts, if any, go to ``counts``."""
    import torch

    with torch.cuda.stream(stream):
        got = convert_blocks(caches, block_ids, fmt, src, layers, limits, planes, src_index)
        if got is not None and counts is not None:
            counts.append(got)
        event = torch.cuda.Event()
        event.record(stream)
    return event


def convert_paced(
    stream: Any,
    caches: Any,
    block_ids: np.ndarray,
    fmt: PageFormat,
    src: Any,
    layers: tuple[int, int] | None = None,
    limits: ConversionLimits | None = None,
    src_index: np.ndarray | None = None,
) -> Any:
    """As ``launch_gpu``, but each slice is waited for and followed by ``limits.slice_gap_us`` of host
    time before the next is queued, so the decoder's work finds the GPU free between slices. Blocks the
    calling thread (run it in a worker); returns the last slice's event (already complete)."""
    import torch

    ps = _plane_set(caches, fmt)
    gap = 0.0 if limits is None else limits.slice_gap_us * 1e-6
    event = torch.cuda.Event()
    with torch.cuda.stream(stream):
        for piece in _pieces(ps, np.asarray(block_ids), src, layers, limits, src_index):
            piece()
            event = torch.cuda.Event()
            event.record(stream)
            event.synchronize()
            if gap:
                time.sleep(gap)
    return event
