"""Converter input checks: each problem is a ValueError naming it, raised before anything is written."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sidecar.wire.block_ids import increasing, read_only, repeat_in_sorted, within

CONVERTIBLE = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2,
               torch.uint8, torch.int8)
BASE = {2: torch.int16, 1: torch.uint8}  # what a permutation moves: the bits of one element


def x_of(elem_bytes: int) -> int:
    """Elements in one 16-byte vector: the AITER tile width (8 for 2-byte, 16 for 1-byte elements)."""
    return 16 // elem_bytes


@dataclass(frozen=True, eq=False)
class ConversionJob:
    """A checked conversion: planes as int16 (or, for 1-byte dtypes, uint8) views, ids on CPU.

    A pure permutation never looks at values; with ``lut`` (fp8 e4m3fn -> e4m3fnuz) every moved byte ``b`` of
    K becomes ``lut[0, b] & 0xFF`` and of V ``lut[1, b] & 0xFF``, and the flag bits above it are counted into
    ``counts`` (saturated, NaN).
    """

    k_planes: tuple[torch.Tensor, ...]
    v_planes: tuple[torch.Tensor, ...]
    srcs: torch.Tensor | tuple[torch.Tensor, ...] | None  # srcs[layer]: one [layers, M, page] or one a layer
    ids: torch.Tensor  # int64, CPU, checked: in range, no duplicates
    num_heads: int
    block_size: int
    head_size: int
    planes_aligned16: bool  # see ``aligned16``
    # Per layer: K plane address (bytes), its row stride (elements), the same for V; and for the sources
    # (address, row stride). Kernels build their tables from these without touching the tensors again.
    plane_rows: np.ndarray  # int64 [layers, 4]
    src_rows: np.ndarray | None  # int64 [layers, 2]
    elem_bytes: int = 2
    lut: torch.Tensor | None = None  # int32 [2, 256] on the planes' device
    counts: torch.Tensor | None = None  # int64 [2] on the planes' device, added into
    # Out of place only: block ids[i] reads source row src_index[i] (int64, CPU) instead of row i.
    src_index: torch.Tensor | None = None
    # Whether 16-byte vectors fit the sources, when the check already knows (``aligned16`` then skips it).
    src_aligned16: bool | None = None

    @property
    def x(self) -> int:
        return x_of(self.elem_bytes)

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
        raise ValueError(f"{name} dtype {t.dtype} is not convertible; only bfloat16, float16 and 1-byte "
                         "(fp8, int8, uint8) caches are (a bit-exact permutation)")
    if t.dim() != 2 or t.shape[1] != row_elems:
        raise ValueError(f"{name} shape {tuple(t.shape)} must be [num_blocks, num_heads*block_size*head_size]"
                         f" = [num_blocks, {row_elems}]")
    if t.numel() and t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must be dense along its element axis (stride(1) == 1), got {t.stride()}")
    if t.shape[0] > 1 and t.stride(0) < row_elems:  # converting one block would rewrite its neighbour's bytes
        raise ValueError(f"{name} rows overlap: stride(0) {t.stride(0)} < {row_elems} elements a block")
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
    _check_id_values(ids.numpy(), num_blocks)
    return ids


def _check_id_values(ids: np.ndarray, num_blocks: int) -> None:
    """Every id in [0, num_blocks), none twice."""
    if not ids.size:
        return
    # Strictly increasing ids (a decoder's fresh blocks usually are) are unique and bounded by their ends:
    # one compare instead of a sort. Otherwise one sort finds the range and any duplicate.
    inc = increasing(ids)
    ordered = ids if inc else np.sort(ids)
    lo, hi = int(ordered[0]), int(ordered[-1])
    if lo < 0 or hi >= num_blocks:
        bad = lo if lo < 0 else hi
        raise ValueError(f"block_ids holds {bad}, out of range [0, {num_blocks})")
    dup = None if inc else repeat_in_sorted(ordered)
    if dup is not None:
        raise ValueError(f"block_ids holds duplicates, e.g. {dup}")


def _id_array(name: str, values: object) -> np.ndarray:
    """A 1-D integer numpy array as int64 (a view when it already is one)."""
    if not isinstance(values, np.ndarray):
        raise ValueError(f"{name} must be a numpy array, got {type(values).__name__}")
    if values.dtype.kind not in "iu":
        raise ValueError(f"{name} dtype {values.dtype} must be an integer type")
    if values.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {values.shape}")
    if values.dtype.kind == "u" and values.size and int(values.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{name} holds {int(values.max())}, beyond int64")
    return np.ascontiguousarray(values, dtype=np.int64)


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


@dataclass(frozen=True, eq=False)
class Planes:
    """Every layer's K and V planes, checked once (``check_planes``); requests then check only ids and src."""

    k_planes: tuple[torch.Tensor, ...]  # int16 views
    v_planes: tuple[torch.Tensor, ...]
    dtype: torch.dtype
    num_blocks: int  # the fewest blocks of any plane: every id must be below it
    num_heads: int
    block_size: int
    head_size: int
    aligned16: bool  # every plane's base and row stride allow 16-byte vectors
    spans: tuple[tuple[int, int, str], ...]  # byte ranges of the planes and their names, sorted, disjoint
    starts: tuple[int, ...]  # each span's start, for bisecting
    rows: np.ndarray  # int64 [layers, 4], as ConversionJob.plane_rows
    elem_bytes: int = 2

    @property
    def single(self) -> bool:
        return len(self.k_planes) == 1

    @property
    def device(self) -> torch.device:
        return self.k_planes[0].device


def _aligned16(tensors: Sequence[torch.Tensor]) -> bool:
    """The kernels use 16-byte vectors: every base and row stride must be a multiple of 16 bytes."""
    return all(
        t.data_ptr() % 16 == 0 and (t.shape[0] <= 1 or (t.stride(0) * t.element_size()) % 16 == 0)
        for t in tensors
    )


def aligned16(job: ConversionJob) -> bool:
    """16-byte vectors fit every tensor of the job (the planes were checked once, the sources now)."""
    rows = job.src_rows
    if rows is None or not len(rows) or not job.planes_aligned16:
        return job.planes_aligned16
    if job.src_aligned16 is not None:
        return job.src_aligned16
    return _sources_aligned16(rows, job.x, job.ids.numel() <= 1 and job.src_index is None)


def _sources_aligned16(rows: np.ndarray, x: int, one_row: bool) -> bool:
    """Every source base on 16 bytes and, unless one row is read (its stride never used), every row stride
    a whole 16-byte vector of ``x`` elements."""
    if one_row:
        return not (rows[:, 0] % 16).any()
    return not (rows % (16, x)).any()


def check_planes(
    k_planes: Sequence[object],
    v_planes: Sequence[object],
    *,
    num_heads: object,
    block_size: object,
    head_size: object,
) -> Planes:
    """Check the planes and the geometry once; raise ValueError naming the first problem found."""
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
    _check_disjoint(named)
    spans = tuple(sorted((*_span(t), name) for name, t in named if t.numel()))
    base = BASE[ks[0].element_size()]
    return Planes(
        k_planes=tuple(t.view(base) for t in ks),
        v_planes=tuple(t.view(base) for t in vs),
        dtype=dtype,
        num_blocks=min(k.shape[0] for k in ks),
        num_heads=h,
        block_size=n,
        head_size=d,
        aligned16=_aligned16(ks + vs),
        spans=spans,
        starts=tuple(span[0] for span in spans),
        rows=np.array(
            [(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0)) for k, v in zip(ks, vs, strict=True)],
            dtype=np.int64,
        ).reshape(-1, 4),
        elem_bytes=ks[0].element_size(),
    )


def _check_src_disjoint(planes: Planes, named: list[tuple[str, int, int]]) -> None:
    """No source span (name, start, end) overlaps a plane (the planes' own spans are sorted and disjoint)."""
    for name, start, end in named:
        if start == end:
            continue
        i = bisect.bisect_right(planes.starts, start)
        for p_start, p_end, plane in (planes.spans[j] for j in (i - 1, i) if 0 <= j < len(planes.spans)):
            if p_start < end and start < p_end:
                raise ValueError(
                    f"{plane} and {name} overlap in memory; every plane and source must be disjoint"
                )


def _check_src_tensor(planes: Planes, name: str, s: object) -> torch.Tensor:
    if not isinstance(s, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(s).__name__}")
    if s.dtype != planes.dtype and not (s.element_size() == 1 == planes.elem_bytes):
        raise ValueError(f"{name} dtype {s.dtype} differs from the planes' {planes.dtype}")
    if s.device != planes.device:
        raise ValueError(f"mismatched devices: {name} is on {s.device}, the planes on {planes.device}")
    if s.numel() and s.shape[-1] > 1 and s.stride(-1) != 1:
        raise ValueError(f"{name} must be dense along its element axis (stride(-1) == 1)")
    return s


def _batched_src(
    planes: Planes, src: torch.Tensor, layers: int, m: int | None
) -> tuple[torch.Tensor, np.ndarray]:
    """A [layers, M, page] source (the staging slots), checked as one tensor: its int16 view and rows.
    ``m`` None (a source index is given): any number of rows."""
    row = planes.num_heads * planes.block_size * planes.head_size
    if src.dim() != 3 or src.shape[0] != layers:
        raise ValueError(f"src shape {tuple(src.shape)} must be [num_layers={layers}, len(block_ids), page]")
    m = src.shape[1] if m is None else m
    if src.shape[1] != m or src.shape[2] != 2 * row:
        raise ValueError(f"src shape {tuple(src.shape)} must be [num_layers, len(block_ids), "
                         f"2*num_heads*block_size*head_size] = [{layers}, {m}, {2 * row}]")
    _check_src_tensor(planes, "src", src)
    if src.numel():
        # the bounding range: a source interleaved with a plane is refused too (never guessed safe)
        last = sum((n - 1) * st for n, st in zip(src.shape, src.stride(), strict=True)) + 1
        _check_src_disjoint(planes, [("src", src.data_ptr(), src.data_ptr() + last * src.element_size())])
    rows = np.empty((layers, 2), dtype=np.int64)
    rows[:, 0] = src.data_ptr() + np.arange(layers, dtype=np.int64) * src.stride(0) * src.element_size()
    rows[:, 1] = src.stride(1)
    return src.view(BASE[planes.elem_bytes]), rows  # not unbound: 36 layer views cost ~25 µs a request


def _listed_srcs(planes: Planes, srcs: Sequence[object], m: int | None) -> tuple[tuple, np.ndarray]:
    """``m`` None (a source index is given): every source needs the same number of rows, any number."""
    row = planes.num_heads * planes.block_size * planes.head_size
    src_list = []
    for i, s in enumerate(srcs):
        name = "src" if planes.single else f"src[{i}]"
        _check_src_tensor(planes, name, s)
        if m is None and s.dim() == 2:
            m = s.shape[0]
        if s.dim() != 2 or s.shape[0] != m or s.shape[1] != 2 * row:
            raise ValueError(f"{name} shape {tuple(s.shape)} must be [len(block_ids), "
                             f"2*num_heads*block_size*head_size] = [{m}, {2 * row}]")
        src_list.append(s)
    named = [("src" if planes.single else f"src[{i}]", t) for i, t in enumerate(src_list)]
    _check_src_disjoint(planes, [(name, *_span(t)) for name, t in named])
    _check_disjoint(named)
    rows = np.array([(t.data_ptr(), t.stride(0)) for t in src_list], dtype=np.int64).reshape(-1, 2)
    return tuple(t.view(BASE[planes.elem_bytes]) for t in src_list), rows


class SourceMemo:
    """Checked [layers, rows, page] sources of one ``Planes``, by every property the check reads (address,
    shape, strides, dtype, device), so a daemon's staging view is checked once, not on every launch.

    A source whose properties match a remembered one passes exactly the same checks, so this never lets
    through what ``check_request`` would refuse; the last ``capacity`` sources are kept. Safe to share
    between threads."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._rows: dict[tuple, tuple[np.ndarray, bool, bool]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._rows)

    def batched(
        self, planes: Planes, src: torch.Tensor, layers: int, m: int | None
    ) -> tuple[torch.Tensor, np.ndarray, bool, bool]:
        """``_batched_src(planes, src, layers, m)``, its checks and rows remembered; with whether 16-byte
        vectors fit the source when it has one row (its base) and when it has more (base and row stride)."""
        key = (planes, src.data_ptr(), src.shape, src.stride(), src.dtype, src.device, layers, m)
        found = self._rows.get(key)
        if found is None:
            view, rows = _batched_src(planes, src, layers, m)
            rows.flags.writeable = False
            x = x_of(planes.elem_bytes)
            found = (rows, _sources_aligned16(rows, x, True), _sources_aligned16(rows, x, False))
            with self._lock:
                if len(self._rows) >= self.capacity:
                    self._rows.pop(next(iter(self._rows)))
                self._rows[key] = found
            return (view, *found)
        return (src.view(BASE[planes.elem_bytes]), *found)


def check_request(
    planes: Planes,
    block_ids: object,
    src: object,
    layers: tuple[int, int] | None = None,
    lut: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    src_index: object = None,
    memo: SourceMemo | None = None,
) -> ConversionJob:
    """Check one request against checked planes: its ids and its source for layers ``[first, last)``
    (default all): None (in place), a [layers, M, page] tensor, or a sequence of [M, page] tensors.
    ``src_index`` (out of place only): block ``ids[i]`` reads source row ``src_index[i]``; the source
    may then hold any number of rows (e.g. a staged span with other blocks in between). ``memo``: sources
    of these planes already checked (a [layers, M, page] source is then checked once)."""
    first, last = layer_range(planes, layers)
    ids = _check_ids(block_ids, planes.device, planes.num_blocks)
    if src_index is not None and src is None:
        raise ValueError("src_index needs a src (it picks source rows; in place has none)")
    m = ids.numel() if src_index is None else None
    srcs = src_rows = src_aligned = None
    if isinstance(src, torch.Tensor):
        if memo is not None:
            srcs, src_rows, src_aligned = _remembered(memo, planes, src, last - first, ids.numel(), src_index)
        else:
            srcs, src_rows = _batched_src(planes, src, last - first, m)
    elif src is not None:
        srcs, src_rows = _listed_srcs(planes, _as_src_list(src, last - first), m)
    index = None
    if src_index is not None:
        rows = srcs.shape[1] if isinstance(srcs, torch.Tensor) else srcs[0].shape[0]
        index = _check_src_index(src_index, ids.numel(), rows)
    return _job(planes, first, last, ids, srcs, src_rows, lut, counts, index, src_aligned)


def check_launch(
    planes: Planes,
    block_ids: np.ndarray,
    src: torch.Tensor | None,
    layers: tuple[int, int] | None,
    memo: SourceMemo,
    lut: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    src_index: np.ndarray | None = None,
) -> ConversionJob:
    """``check_request`` for the daemon's own launches: ids and source rows as numpy int arrays, the source
    one [layers, rows, page] tensor (its staging) or None. The same checks of ids, source and source rows;
    the source's checked once per ``memo`` (the planes were checked once, at registration)."""
    first, last = layer_range(planes, layers)
    ids = launch_ids(planes, block_ids)
    srcs = src_rows = index = src_aligned = None
    if src is not None:
        srcs, src_rows, src_aligned = launch_source(memo, planes, src, last - first, len(ids), src_index)
    if src_index is not None:
        if src is None:
            raise ValueError("src_index needs a src (it picks source rows; in place has none)")
        index = _tensor(launch_src_rows(src_index, ids, srcs.shape[1]))
    return _job(planes, first, last, _tensor(ids), srcs, src_rows, lut, counts, index, src_aligned)


@dataclass(frozen=True, eq=False)
class CheckedIds:
    """Block ids that passed ``launch_ids``' checks for planes of ``num_blocks`` blocks (``checked_ids``).

    A daemon's request converts the same ids in every layer group: checked once, before its bytes land, each
    group's launch takes them as they are. ``ids`` is read-only (``read_only``: a copy unless nobody could
    write them already), so nobody changes them after the check."""

    ids: np.ndarray  # int64, flat, read-only, each in [0, num_blocks), none twice
    num_blocks: int

    @property
    def size(self) -> int:
        return int(self.ids.size)


def checked_ids(planes: Planes, block_ids: object) -> CheckedIds:
    """``block_ids`` checked as ``launch_ids`` checks them, kept read-only for later launches."""
    return CheckedIds(ids=read_only(launch_ids(planes, block_ids)), num_blocks=planes.num_blocks)


def launch_ids(planes: Planes, block_ids: object) -> np.ndarray:
    """A launch's block ids as a flat int64 array, each in [0, num_blocks), none twice. ``CheckedIds``
    checked for at most these planes' blocks are taken as they are (no second pass over them)."""
    if isinstance(block_ids, CheckedIds):
        if block_ids.num_blocks > planes.num_blocks:
            raise ValueError(f"block_ids were checked for {block_ids.num_blocks} blocks; these planes hold "
                             f"{planes.num_blocks}")
        return block_ids.ids
    ids = _id_array("block_ids", block_ids)
    _check_id_values(ids, planes.num_blocks)
    return ids


def launch_source(memo: SourceMemo, planes: Planes, src: object, layers: int, m: int,
                  src_index: object) -> tuple[torch.Tensor, np.ndarray, bool]:
    """A launch's [layers, rows, page] source, checked once per ``memo``: its element view, rows and whether
    16-byte vectors fit it (``_remembered``)."""
    return _remembered(memo, planes, source_tensor(src), layers, m, src_index)


def source_tensor(src: object) -> torch.Tensor:
    """A launch's ``src``, refused unless it is a tensor (its shape and strides are checked after)."""
    if not isinstance(src, torch.Tensor):
        raise ValueError(f"src must be a torch.Tensor, got {type(src).__name__}")
    return src


def launch_src_rows(src_index: object, ids: np.ndarray, available: int) -> np.ndarray:
    """A launch's source rows as a flat int64 array: one per block id, each in [0, available)."""
    rows = _id_array("src_index", src_index)
    if rows.shape != ids.shape:
        raise ValueError(f"src_index shape {rows.shape} must be [len(block_ids)] = [{len(ids)}]")
    _check_source_rows(rows, available)
    return rows


def _tensor(values: np.ndarray) -> torch.Tensor:
    """A CPU tensor of int64 ``values``; read-only ones (a daemon's shared id arrays) are copied, since torch
    warns about sharing memory it could write."""
    return torch.from_numpy(values if values.flags.writeable else values.copy())


def _remembered(memo: SourceMemo, planes: Planes, src: torch.Tensor, layers: int, m: int,
                src_index: object) -> tuple[torch.Tensor, np.ndarray, bool]:
    """A [layers, rows, page] source through ``memo``: its int16 view, rows and whether 16-byte vectors fit
    it for ``m`` blocks (read through a source index when one is given: then any number of rows)."""
    view, rows, one_ok, many_ok = memo.batched(planes, src, layers, None if src_index is not None else m)
    return view, rows, one_ok if m <= 1 and src_index is None else many_ok


def _check_source_rows(rows: np.ndarray, available: int) -> None:
    """Every source row in [0, available) (repeats allowed: reads never conflict)."""
    if not within(rows, available):
        lo, hi = int(rows.min()), int(rows.max())
        raise ValueError(f"src_index holds {lo if lo < 0 else hi}, out of range [0, {available}) source rows")


def layer_range(planes: Planes, layers: tuple[int, int] | None) -> tuple[int, int]:
    first, last = layers if layers is not None else (0, len(planes.k_planes))
    if not 0 <= first < last <= len(planes.k_planes):
        raise ValueError(
            f"layers [{first}, {last}) is not a non-empty range of the {len(planes.k_planes)} layers"
        )
    return first, last


def _job(planes: Planes, first: int, last: int, ids: torch.Tensor, srcs: object, src_rows: np.ndarray | None,
         lut: torch.Tensor | None, counts: torch.Tensor | None, index: torch.Tensor | None,
         src_aligned16: bool | None = None) -> ConversionJob:
    return ConversionJob(
        k_planes=planes.k_planes[first:last],
        v_planes=planes.v_planes[first:last],
        srcs=srcs,
        ids=ids,
        num_heads=planes.num_heads,
        block_size=planes.block_size,
        head_size=planes.head_size,
        planes_aligned16=planes.aligned16,
        plane_rows=planes.rows[first:last],
        src_rows=src_rows,
        elem_bytes=planes.elem_bytes,
        lut=lut,
        counts=counts,
        src_index=index,
        src_aligned16=src_aligned16,
    )


def _check_src_index(src_index: object, m: int, rows: int) -> torch.Tensor:
    """A CPU int64 [M] of source rows, each in [0, rows) (repeats allowed: reads never conflict)."""
    if not isinstance(src_index, torch.Tensor):
        raise ValueError(f"src_index must be a torch.Tensor, got {type(src_index).__name__}")
    if src_index.dtype.is_floating_point or src_index.dtype.is_complex or src_index.dtype == torch.bool:
        raise ValueError(f"src_index dtype {src_index.dtype} must be an integer type")
    if src_index.dim() != 1 or src_index.numel() != m:
        raise ValueError(f"src_index shape {tuple(src_index.shape)} must be [len(block_ids)] = [{m}]")
    if src_index.device.type != "cpu":
        raise ValueError(f"src_index is on {src_index.device}; it must be on the CPU")
    index = src_index.to(torch.int64)
    _check_source_rows(index.numpy(), rows)
    return index


def check_job(
    k_planes: Sequence[object],
    v_planes: Sequence[object],
    block_ids: object,
    *,
    num_heads: object,
    block_size: object,
    head_size: object,
    srcs: Sequence[object] | None,
) -> ConversionJob:
    """Check everything a conversion reads or writes; raise ValueError naming the first problem found."""
    planes = check_planes(k_planes, v_planes, num_heads=num_heads, block_size=block_size, head_size=head_size)
    return check_request(planes, block_ids, None if srcs is None else list(srcs))
