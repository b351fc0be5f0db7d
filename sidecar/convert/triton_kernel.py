"""Triton kernels for the standard→shuffled conversion (GPU; plain Triton, so it builds for CUDA and ROCm).

Imported only when a GPU tensor is converted: the CPU torch wheel has no Triton.

Every kernel moves int16 elements, or uint8 ones for 1-byte dtypes such as fp8 (x = 16 then), a bit-exact
permutation; an fp8 re-encode (``ConversionJob.lut``) runs only in ``convert_kernel`` (out of place, or in
place through the scratch form), mapping each stored byte through its tensor's 256-entry table. Every kernel
finds a layer's planes through a small int64 table ``meta[L, 6]`` = (K offset, K row stride, V offset, V row
stride, src offset, src row stride), offsets in elements from one anchor tensor, so per-layer planes anywhere
in memory convert in one launch.

Forms (``Tuning`` picks among them; the defaults are what measured best on an H200, see
bench/results/convert-h200-*.json):
- out of place (``src`` rows → planes): one program per (layer, block, chunk of ~2048 page elements).
- in place, "split" (default): one program per (layer, block) keeps half the pair in registers and streams
  the other half head by head (``in_place_split_kernel`` says why that order is safe). On chip up to a
  128 KiB resident half, i.e. every in-scope shape (H <= 8, N <= 32, D <= 256).
- in place, "whole": one program per (layer, block) holds the whole (K-plane block ‖ V-plane block) pair,
  waits at a CTA barrier, then writes (every output position is some other output's source).
- in place, "pipe": persistent programs holding two whole pairs, the next one loading while the current one
  is written.
- in place, "scratch" (pairs too large for the chip): chunks of pairs are copied into a scratch buffer, then
  converted out of place from it.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from sidecar.convert.checks import ConversionJob
from sidecar.convert.tables import MetaCache, meta_table, upload
from sidecar.convert.tuning import TUNING, Tuning, gather_piece, in_place_form, next_pow2, oop_chunks


@triton.jit
def _page_offsets(k_base, v_base, s_base, row, o, H, N: tl.constexpr, D: tl.constexpr,
                  FROM_SRC: tl.constexpr):
    """Element offsets (from the anchor) of page element ``o`` in page row ``row`` (rows of 2D elements)."""
    if FROM_SRC:
        return s_base + o
    # The page is split by bytes: rows [0, H*N/2) in the K-plane block, the rest in the V-plane block.
    return tl.where(row < H * (N // 2), k_base + o, v_base + (o - H * (N * D)))


@triton.jit
def _load_sources(anchor, k_base, v_base, s_base, h0, n0, d0, HC: tl.constexpr, NC: tl.constexpr,
                  DC: tl.constexpr, hmax, valid, H, N: tl.constexpr, D: tl.constexpr, X: tl.constexpr,
                  FROM_SRC: tl.constexpr, KD: tl.constexpr, EVICT: tl.constexpr):
    """Load K and V of heads [h0, min(h0+HC, hmax)) x tokens [n0, n0+NC) x dims [d0, d0+DC) of a page.

    V comes as [HC, NC, DC]; K as [HC, NC, DC] too, or, with KD, directly in K-tile order [HC, DC/x, NC, x]
    (16-byte pieces gathered in place), which spares the K tile a trip through shared memory.
    """
    h = h0 + tl.arange(0, HC)[:, None, None]
    n = n0 + tl.arange(0, NC)[None, :, None]
    d = d0 + tl.arange(0, DC)[None, None, :]
    row = h * N + n  # row of the page viewed as [H*N, 2D]
    off = _page_offsets(k_base, v_base, s_base, row, row * (2 * D) + d, H, N, D, FROM_SRC)
    mask = (h < hmax) & valid
    vv = tl.load(anchor + off + D, mask=mask, eviction_policy=EVICT)
    if KD:
        h4 = h0 + tl.arange(0, HC)[:, None, None, None]
        db = d0 // X + tl.arange(0, DC // X)[None, :, None, None]
        n4 = n0 + tl.arange(0, NC)[None, None, :, None]
        xi = tl.arange(0, X)[None, None, None, :]
        row4 = h4 * N + n4
        off4 = _page_offsets(k_base, v_base, s_base, row4, row4 * (2 * D) + db * X + xi, H, N, D, FROM_SRC)
        kv = tl.load(anchor + off4, mask=(h4 < hmax) & valid, eviction_policy=EVICT)
    else:
        kv = tl.load(anchor + off, mask=mask, eviction_policy=EVICT)
    return kv, vv


@triton.jit
def _reencode(lut, cnt, vals, mask, TABLE: tl.constexpr):
    """Bytes through table TABLE (0: K, 1: V) of ``lut`` [2, 256]; flagged (saturated, NaN) lanes counted."""
    codes = tl.load(lut + TABLE * 256 + vals.to(tl.int32))
    sat = tl.where(mask, (codes >> 8) & 1, 0).to(tl.int64)
    nan = tl.where(mask, (codes >> 9) & 1, 0).to(tl.int64)
    tl.atomic_add(cnt, tl.sum(sat))
    tl.atomic_add(cnt + 1, tl.sum(nan))
    return (codes & 0xFF).to(tl.uint8)


@triton.jit
def _store_tiles(anchor, k_base, v_base, kv, vv, h0, n0, d0, HC: tl.constexpr, NC: tl.constexpr,
                 DC: tl.constexpr, hmax, N: tl.constexpr, D: tl.constexpr, X: tl.constexpr, KD: tl.constexpr,
                 EVICT: tl.constexpr, lut, cnt, REENC: tl.constexpr):
    """Store heads [h0, min(h0+HC, hmax)) x tokens [n0, n0+NC) x dims [d0, d0+DC) of the K tile [H, D/x, N, x]
    and the V tile [H, N/x, D, x] (through the re-encode tables with REENC)."""
    h4 = h0 + tl.arange(0, HC)[:, None, None, None]
    mask = h4 < hmax
    xi = tl.arange(0, X)[None, None, None, :]
    db = d0 // X + tl.arange(0, DC // X)[None, :, None, None]
    nn = n0 + tl.arange(0, NC)[None, None, :, None]
    if KD:  # noqa: SIM108 (a constexpr branch)
        kt = kv
    else:
        kt = tl.permute(tl.reshape(kv, (HC, NC, DC // X, X)), (0, 2, 1, 3))  # [HC, DC/x, NC, x]
    k_off = h4 * (D * N) + db * (N * X) + nn * X + xi
    if REENC:
        kt = _reencode(lut, cnt, kt, mask & (k_off >= 0), 0)
    tl.store(anchor + k_base + k_off, kt, mask=mask, eviction_policy=EVICT)
    nb = n0 // X + tl.arange(0, NC // X)[None, :, None, None]
    dd = d0 + tl.arange(0, DC)[None, None, :, None]
    vt = tl.permute(tl.reshape(vv, (HC, NC // X, X, DC)), (0, 1, 3, 2))  # [HC, NC/x, DC, x]
    v_off = h4 * (D * N) + nb * (D * X) + dd * X + xi
    if REENC:
        vt = _reencode(lut, cnt, vt, mask & (v_off >= 0), 1)
    tl.store(anchor + v_base + v_off, vt, mask=mask, eviction_policy=EVICT)


@triton.jit
def _row_bases(meta, ids, pair, M):
    """Element offsets (from the anchor) of pair ``pair`` = layer*M + i: its K block, V block and src row."""
    layer = pair // M
    i = pair - layer * M
    blk = tl.load(ids + i).to(tl.int64)
    row = meta + layer * 6
    k_base = tl.multiple_of(tl.load(row + 0) + blk * tl.load(row + 1), 8)
    v_base = tl.multiple_of(tl.load(row + 2) + blk * tl.load(row + 3), 8)
    s_base = tl.multiple_of(tl.load(row + 4) + i * tl.load(row + 5), 8)
    return k_base, v_base, s_base


@triton.jit
def _row_bases_src(meta, ids, pair, M, SRC_IDX: tl.constexpr):
    """As ``_row_bases``; with SRC_IDX the source row of block i is ``ids[M + i]`` instead of i."""
    k_base, v_base, s_base = _row_bases(meta, ids, pair, M)
    if SRC_IDX:
        layer = pair // M
        i = pair - layer * M
        src_row = tl.load(ids + M + i).to(tl.int64)
        row = meta + layer * 6
        s_base = tl.multiple_of(tl.load(row + 4) + src_row * tl.load(row + 5), 8)
    return k_base, v_base, s_base


@triton.jit(do_not_specialize=["M", "H", "pair0"])
def convert_kernel(anchor, meta, ids, M, H, pair0, HC: tl.constexpr, HCHUNKS: tl.constexpr, NC: tl.constexpr,
                   DC: tl.constexpr, N: tl.constexpr, D: tl.constexpr, X: tl.constexpr,
                   FROM_SRC: tl.constexpr, KD: tl.constexpr, EVICT: tl.constexpr, lut, cnt,
                   REENC: tl.constexpr, SRC_IDX: tl.constexpr):
    """Program = (pair, head chunk, token chunk, dim chunk); in place (not FROM_SRC) one covers a pair."""
    pid = tl.program_id(0)
    per_pair = HCHUNKS * (N // NC) * (D // DC)
    pair = pair0 + pid // per_pair
    c = pid % per_pair
    h0 = (c // ((N // NC) * (D // DC))) * HC
    n0 = ((c // (D // DC)) % (N // NC)) * NC
    d0 = (c % (D // DC)) * DC
    k_base, v_base, s_base = _row_bases_src(meta, ids, pair, M, SRC_IDX)
    kv, vv = _load_sources(anchor, k_base, v_base, s_base, h0, n0, d0, HC, NC, DC, H, True, H, N, D, X,
                           FROM_SRC, KD, EVICT)
    if not FROM_SRC:
        tl.debug_barrier()  # every load of the pair is performed before any thread of the CTA stores into it
    _store_tiles(anchor, k_base, v_base, kv, vv, h0, n0, d0, HC, NC, DC, H, N, D, X, KD, EVICT, lut, cnt,
                 REENC)


@triton.jit
def _convert_chunk(anchor, meta, ids, M, H, pair0, q, HC: tl.constexpr, HCHUNKS: tl.constexpr,
                   NC: tl.constexpr, DC: tl.constexpr, N: tl.constexpr, D: tl.constexpr, X: tl.constexpr,
                   KD: tl.constexpr, EVICT: tl.constexpr, lut, cnt, REENC: tl.constexpr,
                   SRC_IDX: tl.constexpr):
    """Out of place: ``convert_kernel``'s program ``q``."""
    per_pair = HCHUNKS * (N // NC) * (D // DC)
    pair = pair0 + q // per_pair
    c = q % per_pair
    h0 = (c // ((N // NC) * (D // DC))) * HC
    n0 = ((c // (D // DC)) % (N // NC)) * NC
    d0 = (c % (D // DC)) * DC
    k_base, v_base, s_base = _row_bases_src(meta, ids, pair, M, SRC_IDX)
    kv, vv = _load_sources(anchor, k_base, v_base, s_base, h0, n0, d0, HC, NC, DC, H, True, H, N, D, X,
                           True, KD, EVICT)
    _store_tiles(anchor, k_base, v_base, kv, vv, h0, n0, d0, HC, NC, DC, H, N, D, X, KD, EVICT, lut, cnt,
                 REENC)


@triton.jit(do_not_specialize=["M", "H", "pair0", "programs"])
def convert_persistent_kernel(anchor, meta, ids, M, H, pair0, programs, HC: tl.constexpr,
                              HCHUNKS: tl.constexpr, NC: tl.constexpr, DC: tl.constexpr, N: tl.constexpr,
                              D: tl.constexpr, X: tl.constexpr, KD: tl.constexpr, EVICT: tl.constexpr, lut,
                              cnt, REENC: tl.constexpr, SRC_IDX: tl.constexpr, STAGES: tl.constexpr):
    """Out of place with a capped grid: program ``pid`` does ``convert_kernel``'s programs pid, pid+grid, ...
    (caps the conversion's share of the SMs; every program's work is independent). STAGES > 0: Triton's
    software pipeliner keeps that many chunks' loads in flight; 0: the compiler's default for the loop."""
    if STAGES > 0:
        for q in tl.range(tl.program_id(0), programs, tl.num_programs(0), num_stages=STAGES):
            _convert_chunk(anchor, meta, ids, M, H, pair0, q, HC, HCHUNKS, NC, DC, N, D, X, KD, EVICT,
                           lut, cnt, REENC, SRC_IDX)
    else:
        for q in range(tl.program_id(0), programs, tl.num_programs(0)):
            _convert_chunk(anchor, meta, ids, M, H, pair0, q, HC, HCHUNKS, NC, DC, N, D, X, KD, EVICT,
                           lut, cnt, REENC, SRC_IDX)


@triton.jit(do_not_specialize=["M", "H"])
def in_place_split_kernel(anchor, meta, ids, M, H, HR: tl.constexpr, G: tl.constexpr, N: tl.constexpr,
                          D: tl.constexpr, X: tl.constexpr, PREFETCH: tl.constexpr, KD: tl.constexpr,
                          EVICT: tl.constexpr):
    """In place with only half the pair resident: one program per pair.

    View the pair as 2H slots of N*D elements (slot s = rows [s*N/2, (s+1)*N/2) of the page). Head h reads
    slots 2h, 2h+1 and writes slot h (K tile) and slot H+h (V tile). Heads [H//2, H) (all of the V-plane
    block, plus half a head for odd H) are loaded first and kept; heads h < H//2 then stream in ascending
    order (G at a time), each group written right after it is read: slot h's reader h//2 <= h has been read
    already and slot H+h's reader is resident. The resident heads are written last.

    A negative block id is a graph's padding row (``graph_tables.PAD_ID``): its program writes nothing.
    """
    pair = tl.program_id(0)
    if tl.load(ids + pair % M) < 0:
        return
    k_base, v_base, _ = _row_bases(meta, ids, pair, M)
    lo = H // 2
    kr, vr = _load_sources(anchor, k_base, v_base, 0, lo, 0, 0, HR, N, D, H, True, H, N, D, X, False, KD,
                           EVICT)
    if PREFETCH:
        kh, vh = _load_sources(anchor, k_base, v_base, 0, 0, 0, 0, G, N, D, lo, True, H, N, D, X, False, KD,
                               EVICT)
        for h in range(0, lo, G):
            kn, vn = _load_sources(anchor, k_base, v_base, 0, h + G, 0, 0, G, N, D, lo, True, H, N, D, X,
                                   False, KD, EVICT)
            tl.debug_barrier()  # the readers of the slots written next (h//2.., resident) are loaded CTA-wide
            _store_tiles(anchor, k_base, v_base, kh, vh, h, 0, 0, G, N, D, lo, N, D, X, KD, EVICT,
                         anchor, anchor, False)
            kh, vh = kn, vn
    else:
        for h in range(0, lo, G):
            kh, vh = _load_sources(anchor, k_base, v_base, 0, h, 0, 0, G, N, D, lo, True, H, N, D, X, False,
                                   KD, EVICT)
            tl.debug_barrier()  # the readers of the slots written next (h//2.., resident) are loaded CTA-wide
            _store_tiles(anchor, k_base, v_base, kh, vh, h, 0, 0, G, N, D, lo, N, D, X, KD, EVICT,
                         anchor, anchor, False)
    tl.debug_barrier()
    _store_tiles(anchor, k_base, v_base, kr, vr, lo, 0, 0, HR, N, D, H, N, D, X, KD, EVICT, anchor, anchor,
                 False)


@triton.jit(do_not_specialize=["M", "H", "total"])
def in_place_pipe_kernel(anchor, meta, ids, M, H, total, HP: tl.constexpr, N: tl.constexpr, D: tl.constexpr,
                         X: tl.constexpr, KD: tl.constexpr, EVICT: tl.constexpr):
    """In place, persistent: each program walks pairs pid, pid+grid, ... holding two whole pairs on chip.

    The next pair's loads are in flight while the current one is written; a CTA barrier between a pair's
    loads (issued one iteration earlier) and its stores keeps every read of the pair before any write to it.
    """
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    k_base, v_base, _ = _row_bases(meta, ids, pid, M)
    kc, vc = _load_sources(anchor, k_base, v_base, 0, 0, 0, 0, HP, N, D, H, True, H, N, D, X, False, KD,
                           EVICT)
    for p in range(pid, total, step):
        q = p + step
        more = q < total
        k_next, v_next, _ = _row_bases(meta, ids, tl.where(more, q, p), M)
        kn, vn = _load_sources(anchor, k_next, v_next, 0, 0, 0, 0, HP, N, D, H, more, H, N, D, X, False, KD,
                               EVICT)
        tl.debug_barrier()
        _store_tiles(anchor, k_base, v_base, kc, vc, 0, 0, 0, HP, N, D, H, N, D, X, KD, EVICT, anchor, anchor,
                     False)
        kc, vc, k_base, v_base = kn, vn, k_next, v_next


@triton.jit(do_not_specialize=["M", "pair0", "H"])
def gather_pairs_kernel(anchor, meta, ids, M, pair0, scratch, H, ND: tl.constexpr, PIECE: tl.constexpr,
                        EVICT: tl.constexpr):
    """Copy the (K-plane block ‖ V-plane block) pairs [pair0, pair0 + grid) into consecutive scratch rows."""
    pid = tl.program_id(0)
    piece = tl.program_id(1)
    k_base, v_base, _ = _row_bases(meta, ids, pair0 + pid, M)
    half = H * ND  # a multiple of ND keeps the 16-byte alignment visible to the compiler
    o = piece * PIECE + tl.arange(0, PIECE)
    dst = scratch + pid.to(tl.int64) * (2 * half)
    tl.store(dst + o, tl.load(anchor + k_base + o, eviction_policy=EVICT))
    tl.store(dst + half + o, tl.load(anchor + v_base + o, eviction_policy=EVICT))


def _meta_table(job: ConversionJob, anchor: torch.Tensor, src_rows: np.ndarray | None,
                cache: MetaCache | None = None) -> np.ndarray:
    """int64 [L, 6] of element offsets from ``anchor`` and row strides (``tables.meta_table``), host side.
    ``src_rows``: [L, 2] source addresses (bytes) and row strides, or None (in place)."""
    if cache is None:
        return meta_table(job.plane_rows, src_rows, anchor.data_ptr(), job.elem_bytes)
    return cache.get(job.plane_rows, src_rows, anchor.data_ptr(), job.elem_bytes)


def in_place_strategy(job: ConversionJob, tuning: Tuning = TUNING) -> str:
    """How a pair of this shape converts in place: "pipe", "whole" or "split" (on chip) or "scratch"."""
    if job.lut is not None:
        return "scratch"  # only convert_kernel re-encodes
    return in_place_form(job.num_heads, job.block_size, job.head_size, job.elem_bytes, tuning)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":  # Triton's CPU interpreter (development only)
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


_UNUSED_COUNTS: dict[torch.device, torch.Tensor] = {}


def _unused_counts(device: torch.device) -> torch.Tensor:
    """A kernel argument never read or written without a re-encode: one per device, not one per launch
    (a fresh ``torch.zeros`` costs an allocation and a fill kernel on every launch)."""
    found = _UNUSED_COUNTS.get(device)
    if found is None:
        found = _UNUSED_COUNTS[device] = torch.zeros(2, dtype=torch.int64, device=device)
    return found


def _warps(elems: int, per_thread: int) -> int:
    return max(1, min(16, elems // (32 * per_thread)))


def _triton_version() -> tuple[int, ...]:
    return tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())


# Triton from 3.4 on hands a compiled kernel's launcher every argument in signature order (constexprs
# included) and takes (launch metadata, enter hook, exit hook) before them; older ones differ.
DIRECT_LAUNCH = _triton_version() >= (3, 4)


def _hooks_set() -> bool:
    """Whether a launch hook (a profiler's) is installed: launches then go through Triton to call it."""
    hook = triton.knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


class DirectKernel:
    """One Triton kernel launched through its compiled form, without Triton's per-call binder.

    ``kernel[grid](...)`` binds every argument, recomputes the specialisation key, looks the kernel up and
    builds launch metadata on each call (about 5 of a launch's 40 µs on the H200 host, ``bench launch``).
    The conversion launches the same few variants again and again, so each compiled kernel is kept under a
    key made of what Triton specialises these kernels on: the device, the constexpr values, the launch
    options (num_warps, ...), each tensor's dtype and 16-byte alignment and, for ``do_not_specialize``
    integers, whether they fit 32 bits. A new key goes through Triton once (it compiles or loads the
    kernel), on the current stream; later calls go straight to the launcher with the stream given."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.names = tuple(fn.arg_names)
        self.kinds = tuple("c" if p.is_constexpr else "i" if p.do_not_specialize else "t" for p in fn.params)
        self._compiled: dict[tuple, Any] = {}

    def __call__(self, grid: tuple[int, ...], device: int, args: tuple, kwargs: dict[str, Any]) -> None:
        """``fn[grid](*args, **kwargs)`` on ``device``'s current stream; ``kwargs``: the remaining arguments
        by name, then launch options."""
        values = list(args)
        for name in self.names[len(args):]:
            values.append(kwargs[name])
        options = {k: v for k, v in kwargs.items() if k not in self.names[len(args):]}
        spec = [device, *sorted(options.items())]
        for value, kind in zip(values, self.kinds, strict=True):
            if kind == "c":
                spec.append(value)
            elif kind == "i":
                spec.append(-(2**31) <= value < 2**31)
            elif isinstance(value, torch.Tensor):
                spec.append((value.dtype, value.data_ptr() % 16 == 0))
            else:
                spec.append(value)
        key = tuple(spec)
        compiled = self._compiled.get(key)
        if compiled is None or _hooks_set():
            compiled = self.fn[grid](*values, **options)
            if hasattr(compiled, "result"):  # an asynchronous compile's future
                compiled = compiled.result()
            self._compiled[key] = compiled
            return
        g = (*grid, 1, 1)
        stream = torch._C._cuda_getCurrentRawStream(device)
        compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *values)


_DIRECT: dict[Any, DirectKernel] = {}


def _launch(fn: Any, grid: tuple[int, ...], device: torch.device, direct: bool, *args: Any,
            **kwargs: Any) -> None:
    """``fn[grid](*args, **kwargs)``, through ``DirectKernel`` when ``direct`` and this Triton allows it."""
    jitted = isinstance(fn, triton.runtime.jit.JITFunction)  # not the CPU interpreter's
    if not (direct and DIRECT_LAUNCH and jitted and device.type == "cuda"):
        fn[grid](*args, **kwargs)
        return
    kernel = _DIRECT.get(fn)
    if kernel is None:
        kernel = _DIRECT[fn] = DirectKernel(fn)
    index = device.index if device.index is not None else torch.cuda.current_device()
    kernel(grid, index, args, kwargs)


def launch_split(device: torch.device, direct: bool, anchor: torch.Tensor, meta: torch.Tensor,
                 ids: torch.Tensor, m: int, pairs: int, h: int, geom: dict[str, int], tuning: Tuning) -> None:
    """``in_place_split_kernel`` over ``pairs`` = layers x ``m`` (layer, block) pairs, block ids at ``ids``
    (the ordinary launch's, or a graph's padded to its bucket ``m``). ``geom``: N, D and X."""
    hr = next_pow2(h - h // 2)
    resident = 2 * hr * geom["N"] * geom["D"]
    _launch(in_place_split_kernel, (pairs,), device, direct, anchor, meta, ids, m, h, HR=hr,
            G=min(tuning.split_group, next_pow2(max(1, h // 2))), PREFETCH=tuning.prefetch,
            KD=tuning.k_direct, EVICT=tuning.evict,
            num_warps=_warps(resident, tuning.in_place_elems_per_thread), **geom, **register_cap(tuning))


def register_cap(tuning: Tuning) -> dict[str, int]:
    """A register cap lets more in-place programs share an SM (CUDA only: HIP's Triton has no such option)."""
    return {"maxnreg": tuning.maxnreg} if tuning.maxnreg and torch.version.hip is None else {}


class Launcher:
    """A checked job turned into device-side tables once; ``__call__`` only launches (for the benchmark).

    Every table (ids, source rows, meta, scratch chunks) reaches the device in one copy from pinned memory
    (``tables.upload``), so building a launcher never waits for work already queued on the stream.
    ``tables``: meta tables kept across launches (a ``PlaneSet``'s); None builds them here.
    ``direct``: launch through ``DirectKernel`` (False: through Triton's own binder every call)."""

    direct = True

    def __init__(self, job: ConversionJob, tuning: Tuning = TUNING, tables: MetaCache | None = None) -> None:
        self.job, self.t = job, tuning
        self.anchor = job.k_planes[0]
        self.device = job.device
        self.layers = len(job.k_planes)
        self.m = job.ids.numel()
        # With a source index the ids tensor carries the M source rows after the M block ids.
        self.src_idx = job.src_index is not None and job.srcs is not None
        self.geom = dict(N=job.block_size, D=job.head_size, X=job.x)
        counts = job.counts if job.counts is not None else _unused_counts(job.device)
        lut = job.lut if job.lut is not None else counts  # unused without REENC
        self.reenc = dict(lut=lut, cnt=counts, REENC=job.lut is not None)
        self.extra = register_cap(tuning)
        self.strategy = "out_of_place" if job.srcs is not None else in_place_strategy(job, tuning)
        ids = [job.ids.numpy(), job.src_index.numpy()] if self.src_idx else [job.ids.numpy()]
        segments = [ids, [_meta_table(job, self.anchor, job.src_rows, tables)]]
        if self.strategy == "scratch" and self.m:
            segments += [[rows] for rows in self._prepare_scratch()]
        got = self.upload(segments, job.device)
        self.ids, self.meta = got[0], got[1]
        if self.strategy == "scratch" and self.m:
            self.chunks = [(*chunk, table) for chunk, table in zip(self.chunks, got[2:], strict=True)]

    @staticmethod
    def upload(segments: list[list[np.ndarray]], device: torch.device) -> list[torch.Tensor]:
        """The host tables as device tensors, in one asynchronous copy (a seam for the launch probe)."""
        return upload(segments, device)

    def _go(self, fn: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        _launch(fn, grid, self.device, self.direct, *args, **kwargs)

    def __call__(self) -> None:
        if self.m == 0:
            return
        total = self.layers * self.m
        if self.strategy == "out_of_place":
            self._out_of_place(self.meta, 0, total, self.src_idx)
        elif self.strategy == "whole":
            hp = next_pow2(self.job.num_heads)
            self._go(convert_kernel, (total,), self.anchor, self.meta, self.ids, self.m, self.job.num_heads,
                     0, HC=hp, HCHUNKS=1, NC=self.job.block_size, DC=self.job.head_size, FROM_SRC=False,
                     KD=self.t.k_direct, EVICT=self.t.evict, SRC_IDX=False,
                     num_warps=_warps(2 * hp * self.job.block_size * self.job.head_size,
                                      self.t.in_place_elems_per_thread),
                     **self.reenc, **self.geom, **self.extra)
        elif self.strategy == "pipe":
            hp = next_pow2(self.job.num_heads)
            grid = min(total, _sm_count(self.job.device) * self.t.pipe_ctas_per_sm)
            if self.t.pipe_max_programs:
                grid = min(grid, self.t.pipe_max_programs)
            self._go(in_place_pipe_kernel, (grid,), self.anchor, self.meta, self.ids, self.m,
                     self.job.num_heads, total, HP=hp, KD=self.t.k_direct, EVICT=self.t.evict, num_stages=1,
                     num_warps=_warps(2 * hp * self.job.block_size * self.job.head_size,
                                      self.t.in_place_elems_per_thread),
                     **self.geom, **self.extra)
        elif self.strategy == "split":
            launch_split(self.device, self.direct, self.anchor, self.meta, self.ids, self.m, total,
                         self.job.num_heads, self.geom, self.t)
        else:
            self._in_place_scratch()

    def _out_of_place(self, meta: torch.Tensor, pair0: int, pairs: int, src_idx: bool = False) -> None:
        """Chunks of about ``oop_elems``: several heads of a small page, or tokens x dims of one head.
        ``src_idx``: source rows come from the ids tensor (the job's ``src_index``)."""
        job = self.job
        h, n, d = job.num_heads, job.block_size, job.head_size
        hc, nc, dc, hchunks = oop_chunks(h, n, d, job.x, self.t)
        grid = pairs * hchunks * (n // nc) * (d // dc)
        if self.t.oop_max_programs and grid > self.t.oop_max_programs:
            self._go(convert_persistent_kernel, (self.t.oop_max_programs,), self.anchor, meta, self.ids,
                     self.m, h, pair0, grid, HC=hc, HCHUNKS=hchunks, NC=nc, DC=dc, KD=self.t.k_direct_oop,
                     EVICT=self.t.evict, num_warps=self.t.oop_warps, SRC_IDX=src_idx,
                     STAGES=self.t.oop_stages, **self.reenc, **self.geom)
            return
        self._go(convert_kernel, (grid,), self.anchor, meta, self.ids, self.m, h, pair0, HC=hc,
                 HCHUNKS=hchunks, NC=nc, DC=dc, FROM_SRC=True, KD=self.t.k_direct_oop, EVICT=self.t.evict,
                 num_warps=self.t.oop_warps, SRC_IDX=src_idx, **self.reenc, **self.geom)

    def _prepare_scratch(self) -> list[np.ndarray]:
        """Allocate the scratch; ``self.chunks`` gets (pair0, pairs) per chunk, the result each chunk's meta
        table (uploaded with the other tables)."""
        job = self.job
        half = job.plane_block_elems
        total = self.layers * self.m
        self.per_chunk = min(total, max(1, self.t.scratch_bytes // (2 * job.elem_bytes * half)))
        self.scratch = torch.empty((self.per_chunk, 2 * half), dtype=self.anchor.dtype, device=job.device)
        s_addr = self.scratch.data_ptr()
        row_bytes = 2 * half * job.elem_bytes
        # One table per chunk: pair p = layer*M + i reads scratch row p - pair0.
        self.chunks, tables = [], []
        for pair0 in range(0, total, self.per_chunk):
            rows = np.array(
                [(s_addr + (layer * self.m - pair0) * row_bytes, 2 * half) for layer in range(self.layers)],
                dtype=np.int64,
            ).reshape(-1, 2)
            self.chunks.append((pair0, min(self.per_chunk, total - pair0)))
            tables.append(meta_table(job.plane_rows, rows, self.anchor.data_ptr(), job.elem_bytes))
        self.piece = gather_piece(job.block_size, job.head_size)
        return tables

    def _in_place_scratch(self) -> None:
        half = self.job.plane_block_elems
        for pair0, pairs, table in self.chunks:
            self._go(gather_pairs_kernel, (pairs, half // self.piece), self.anchor, self.meta, self.ids,
                     self.m, pair0, self.scratch, self.job.num_heads,
                     ND=self.job.block_size * self.job.head_size, PIECE=self.piece, EVICT=self.t.evict,
                     num_warps=4)
            self._out_of_place(table, pair0, pairs)


def run_triton(job: ConversionJob, tuning: Tuning | None = None, tables: MetaCache | None = None) -> None:
    """Convert a checked job on its GPU (current stream); ``tables`` as in ``Launcher``."""
    Launcher(job, TUNING if tuning is None else tuning, tables)()
