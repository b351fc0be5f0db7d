"""Descriptor geometry: which remote bytes land in which local bytes, as NIXL descriptor tables and indices.

Pure and vectorised with numpy; no I/O, no NIXL import. The byte contract is docs/page-formats.md and the
remote side is what a stock vLLM 0.33 prefill publishes (reference/vllm-0.33-nixl-protocol.md §2, §4).

Three pull modes:

- ``direct``: each remote standard page is read as two virtual halves, half 0 into the local K-plane
  block and half 1 into the local V-plane block (then converted in place).
- ``staged``: whole pages into slots of a registered staging pool; runs that are contiguous on both
  sides are merged into one descriptor (then converted out of place).
- ``plain``: whole blocks into whole local blocks, same format on both sides (no conversion).

Two forms of the same tables:

- index form: a remote table prepared ONCE per remote (NIXL's strided Nx5 rows ``(addr, len, dev, stride,
  count)``), a local table once per registration, then per request only int32 index arrays;
- explicit form: Nx3 ``(addr, len, dev)`` arrays per request, with adjacent runs merged.

Size: three read modes (direct, staged, plain) over one pair of region tables; one file keeps
their shared index math in one place. Which block pairs with which is ``pairing.py``'s; how adjacent copies
merge into explicit descriptors is ``runs.py``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from sidecar.nixl.pairing import (
    MAX_BLOCKS_PER_LOGICAL,
    BlockPairs,
    GeometryError,
    PairRule,
    as_ids,
    check_range,
    check_unique,
    increasing,
    kernel_block_ids,
    pair_blocks,
    trim_padding,
)
from sidecar.nixl.runs import Descs, layer_uniform_runs, merge_runs, shifted_runs
from sidecar.nixl.spans import SpanSlots
from sidecar.wire.formats import AITER_SHUFFLED, STANDARD, PageFormat, Plan

Mode = Literal["direct", "staged", "plain"]
MODES: tuple[Mode, ...] = ("direct", "staged", "plain")
MEM_TYPES = frozenset({"DRAM", "VRAM"})
# Element sizes a block length may imply; only to hint at the dtype when a length is off by such a factor.
_ELEMENT_SIZES = (1, 2, 4)

_U64 = np.uint64
_I64 = np.int64
_MAX_ROWS = 2**31 - 1  # descriptor rows an int32 index reaches


def regions_per_layer(fmt: PageFormat) -> int:
    """How many registered regions (descriptor windows) one layer of ``fmt`` occupies."""
    if fmt.layout in ("LBHNC", "LBNHC"):
        return 1
    if fmt.kind == AITER_SHUFFLED:
        return 2  # LHBNC: the K plane, then the V plane
    if fmt.kind == STANDARD:
        return fmt.num_heads  # LHBNC standard: one head plane per head
    raise GeometryError("layout", f"no region model for {fmt.kind!r} pages under {fmt.layout}")


@dataclass(frozen=True, eq=False)
class RemoteRegions:
    """The prefill's registered regions as its NixlAgentMetadata describes them (kernel-block granular)."""

    base: np.ndarray  # (R,) uint64
    block_len: np.ndarray  # (R,) int64
    block_stride: np.ndarray  # (R,) int64
    num_blocks: np.ndarray  # (R,) int64, kernel blocks per region
    device_id: int
    layout: str
    block_size: int  # kernel block size in tokens
    blocks_per_logical: int  # physical_blocks_per_logical_kv_block
    mem_type: str

    @property
    def num_regions(self) -> int:
        return int(self.base.size)

    @classmethod
    def from_metadata(cls, meta: Any, *, default_mem_type: str = "VRAM") -> RemoteRegions:
        """Read and check the region fields of a NixlAgentMetadata (any object with vLLM's field names)."""
        bases = as_ids(meta.kv_caches_base_addr, "kv_caches_base_addr")
        r = bases.size
        if r == 0:
            raise GeometryError("kv_caches_base_addr", "the prefill published no regions")
        if (bases <= 0).any():
            raise GeometryError("kv_caches_base_addr", "region base addresses must be positive")
        lens = as_ids(meta.block_lens, "block_lens")
        strides = as_ids(meta.block_strides, "block_strides")
        for name, arr in (("block_lens", lens), ("block_strides", strides)):
            if arr.size != r:
                raise GeometryError(name, f"{arr.size} entries for {r} regions")
        if (lens <= 0).any():
            raise GeometryError("block_lens", "block lengths must be positive")
        if (strides < lens).any():
            i = int(np.flatnonzero(strides < lens)[0])
            raise GeometryError(
                "block_strides",
                f"region {i}: stride {strides[i]} < block_len {lens[i]} (blocks would overlap)",
            )
        ratio = int(meta.physical_blocks_per_logical_kv_block)
        if ratio < 1:
            raise GeometryError("physical_blocks_per_logical_kv_block", f"must be >= 1, got {ratio}")
        total = int(meta.num_blocks)
        if total <= 0 or total % ratio:
            raise GeometryError(
                "num_blocks",
                f"{total} kernel blocks is not a positive multiple of "
                f"physical_blocks_per_logical_kv_block={ratio}",
            )
        counts_in = getattr(meta, "region_num_blocks", None)
        counts = np.full(r, total, _I64) if counts_in is None else as_ids(counts_in, "region_num_blocks")
        if counts.size != r:
            raise GeometryError("region_num_blocks", f"{counts.size} entries for {r} regions")
        if (counts <= 0).any():
            raise GeometryError("region_num_blocks", "every region must hold at least one block")
        if ratio > MAX_BLOCKS_PER_LOGICAL:
            raise GeometryError(
                "physical_blocks_per_logical_kv_block",
                f"{ratio} kernel blocks per logical block, past the {MAX_BLOCKS_PER_LOGICAL} accepted "
                "(vLLM's is its manager block size over its kernel block size)",
            )
        if ratio > int(counts.min()):
            # a logical block must fit in every region: a larger ratio can only be a bad field, and one from
            # a peer would make each request expand its ids by that ratio before any range check
            raise GeometryError(
                "physical_blocks_per_logical_kv_block",
                f"{ratio} kernel blocks per logical block, but a region holds only {int(counts.min())}",
            )
        device_id = int(meta.device_id)
        if device_id < 0:
            raise GeometryError("device_id", f"must be >= 0, got {device_id}")
        block_size = int(meta.block_size)
        if block_size <= 0:
            raise GeometryError("block_size", f"must be positive, got {block_size}")
        mem_types = getattr(meta, "region_mem_types", None)
        if mem_types:
            kinds = set(mem_types)
            if len(mem_types) != r or len(kinds) != 1 or not kinds <= MEM_TYPES:
                raise GeometryError(
                    "region_mem_types",
                    f"expected one of {sorted(MEM_TYPES)} for all {r} "
                    f"regions, got {sorted(kinds)} over {len(mem_types)} entries",
                )
            mem_type = mem_types[0]
        else:
            mem_type = default_mem_type
        return cls(
            base=bases.astype(_U64),
            block_len=lens,
            block_stride=strides,
            num_blocks=counts,
            device_id=device_id,
            layout=str(meta.kv_cache_layout),
            block_size=block_size,
            blocks_per_logical=ratio,
            mem_type=mem_type,
        )


@dataclass(frozen=True, eq=False)
class LocalRegions:
    """The decoder's destination regions: K/V planes of each layer, or whole-block regions."""

    base: np.ndarray  # (R,) uint64
    block_len: np.ndarray  # (R,) int64
    block_stride: np.ndarray  # (R,) int64
    num_blocks: np.ndarray  # (R,) int64
    device_id: int = 0
    mem_type: str = "DRAM"
    blocks_per_logical: int = 1

    @property
    def num_regions(self) -> int:
        return int(self.base.size)

    @classmethod
    def planes(
        cls,
        k_bases: Sequence[int],
        v_bases: Sequence[int],
        plane_block_bytes: int,
        num_blocks: int,
        *,
        device_id: int = 0,
        mem_type: str = "DRAM",
        blocks_per_logical: int = 1,
    ) -> LocalRegions:
        """Dense LHBNC planes: regions ordered K0, V0, K1, V1, ... (one plane-block per block id)."""
        k, v = as_ids(k_bases, "local.k_bases"), as_ids(v_bases, "local.v_bases")
        if k.size != v.size or k.size == 0:
            raise GeometryError("local.planes", f"{k.size} K planes and {v.size} V planes")
        bases = np.empty(2 * k.size, _I64)
        bases[0::2], bases[1::2] = k, v
        return cls.blocks(
            bases,
            plane_block_bytes,
            num_blocks,
            device_id=device_id,
            mem_type=mem_type,
            blocks_per_logical=blocks_per_logical,
        )

    @classmethod
    def blocks(
        cls,
        bases: Sequence[int] | np.ndarray,
        block_len: int,
        num_blocks: int,
        *,
        block_stride: int | None = None,
        device_id: int = 0,
        mem_type: str = "DRAM",
        blocks_per_logical: int = 1,
    ) -> LocalRegions:
        """One region per entry of ``bases``, all with the same block length, stride and count."""
        b = as_ids(bases, "local.bases")
        stride = block_len if block_stride is None else block_stride
        if b.size == 0 or (b <= 0).any():
            raise GeometryError("local.bases", "need at least one positive base address")
        if block_len <= 0 or stride < block_len:
            raise GeometryError("local.block_len", f"block_len {block_len}, stride {stride}")
        if num_blocks <= 0:
            raise GeometryError("local.num_blocks", f"must be positive, got {num_blocks}")
        if mem_type not in MEM_TYPES:
            raise GeometryError("local.mem_type", f"{mem_type!r} is not one of {sorted(MEM_TYPES)}")
        r = b.size
        return cls(
            base=b.astype(_U64),
            block_len=np.full(r, block_len, _I64),
            block_stride=np.full(r, stride, _I64),
            num_blocks=np.full(r, num_blocks, _I64),
            device_id=device_id,
            mem_type=mem_type,
            blocks_per_logical=blocks_per_logical,
        )


@dataclass(frozen=True, eq=False)
class StagingPool:
    """A registered buffer of equal slots, each one remote page."""

    base: int
    slot_bytes: int
    num_slots: int
    device_id: int = 0
    mem_type: str = "DRAM"

    def __post_init__(self) -> None:
        if self.base <= 0 or self.slot_bytes <= 0 or self.num_slots <= 0:
            raise GeometryError(
                "pool",
                f"base {self.base}, slot_bytes {self.slot_bytes}, "
                f"num_slots {self.num_slots} must all be positive",
            )


@dataclass(frozen=True, eq=False)
class DescIndices:
    """Per-request indices into the prepared tables, layer-major (``per_layer`` rows per layer)."""

    local: np.ndarray  # int32, flat
    remote: np.ndarray  # int32, flat
    layers: int
    per_layer: int

    @property
    def count(self) -> int:
        return int(self.local.size)

    def layer_slice(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Indices of layers [start, stop): one layer group's transfer."""
        a, b = start * self.per_layer, stop * self.per_layer
        return self.local[a:b], self.remote[a:b]


def _table(
    base: np.ndarray, length: np.ndarray, dev: int, stride: np.ndarray, count: np.ndarray
) -> np.ndarray:
    t = np.empty((base.size, 5), _U64)
    t[:, 0], t[:, 1], t[:, 2], t[:, 3], t[:, 4] = base, length, dev, stride, count
    return t


def check_remote(remote: RemoteRegions, fmt: PageFormat, layers: int) -> None:
    """The remote's published geometry must be exactly what ``fmt`` implies for ``layers`` layers."""
    if remote.layout != fmt.layout:
        raise GeometryError(
            "kv_cache_layout",
            f"the prefill publishes {remote.layout!r}, the declared remote page format is {fmt.layout!r}",
        )
    if remote.block_size != fmt.block_size:
        raise GeometryError(
            "block_size",
            f"the prefill's kernel block is {remote.block_size} tokens, the "
            f"declared remote page format has {fmt.block_size}",
        )
    k = regions_per_layer(fmt)
    if remote.num_regions != layers * k:
        raise GeometryError(
            "kv_caches_base_addr",
            f"region count {remote.num_regions} != {layers} "
            f"layers x {k} region(s) per layer of the declared remote format",
        )
    want = fmt.page_bytes // k
    bad = np.flatnonzero(remote.block_len != want)
    if bad.size:
        got = int(remote.block_len[bad[0]])
        # A factor of an element size may be the dtype (or the head count): say so, never guess which.
        per_elem = want // fmt.elem_bytes
        hint = ""
        if got % per_elem == 0 and got // per_elem in _ELEMENT_SIZES:
            hint = (
                f"; it would fit {got // per_elem}-byte elements where the declared dtype {fmt.dtype} has "
                f"{fmt.elem_bytes} (or another head count)"
            )
        raise GeometryError(
            "block_lens",
            f"region {int(bad[0])}: block_len {got} != page bytes {want} of the "
            f"declared remote format (dtype size x heads x block size x head size){hint}",
        )


class PairGeometry:
    """One remote's regions paired with one local registration under a negotiated plan, in one mode.

    Built (and checked) once per (remote, registration, mode); then ``indices`` / ``descs`` /
    ``staged_descs`` per request.
    """

    def __init__(
        self,
        plan: Plan,
        remote: RemoteRegions,
        local: LocalRegions,
        mode: Mode,
        *,
        pool: StagingPool | None = None,
        source: Any = None,
    ) -> None:
        if mode not in MODES:
            raise GeometryError("mode", f"{mode!r} is not one of {MODES}")
        self.plan, self.remote, self.local, self.mode, self.pool = plan, remote, local, mode, pool
        self.source = source  # a tp.SourceSlice: heads of a prefill rank at another TP, or None (all of it)
        rf, lf = plan.remote, plan.local
        k_r, k_l = regions_per_layer(rf), regions_per_layer(lf)
        if local.num_regions % k_l:
            raise GeometryError(
                "local.regions", f"{local.num_regions} local regions is not a multiple of {k_l} per layer"
            )
        self.layers = local.num_regions // k_l
        if source is None:
            check_remote(remote, rf, self.layers)
        else:
            _check_sliced(remote, rf, lf, self.layers, source)
        want_local = lf.page_bytes // k_l
        if (local.block_len != want_local).any():
            raise GeometryError(
                "local.block_len",
                f"local blocks of {int(local.block_len[0])} bytes, the "
                f"local page format implies {want_local}",
            )
        self.remote_limit = int(remote.num_blocks.min())
        self.local_limit = int(local.num_blocks.min())
        self.rule = PairRule(
            local.blocks_per_logical, remote.blocks_per_logical, remote.block_size,
            self.local_limit, self.remote_limit,
        )
        if mode == "plain":
            if plan.convert:
                raise GeometryError("mode", "a plain read needs the same page format on both sides")
        elif k_r != 1:
            raise GeometryError(
                "mode", f"{mode} reads need whole remote pages (one region per layer), the remote has {k_r}"
            )
        if mode == "direct" and (not plan.convert or k_l != 2):
            raise GeometryError(
                "mode",
                "a direct read splits standard pages into K/V planes; the plan "
                f"(convert={plan.convert}, {k_l} local region(s) per layer) has none",
            )
        if mode == "staged":
            if pool is None:
                raise GeometryError("pool", "a staged read needs a staging pool")
            if pool.slot_bytes != rf.page_bytes:
                raise GeometryError(
                    "pool.slot_bytes", f"{pool.slot_bytes} != remote page bytes {rf.page_bytes}"
                )
        self._offsets()

    def _offsets(self) -> None:
        r, loc = self.remote, self.local
        rows_per_region = 2 if self.mode == "direct" else 1
        # requests index these rows as int32 (NIXL's descriptor indices): more rows would wrap into others.
        # Summed as Python ints: a claimed count near 2**62 wraps int64 (x2, or the sum) back under the bound
        totals = (
            ("region_num_blocks", rows_per_region * sum(r.num_blocks.tolist())),
            ("local.num_blocks", sum(loc.num_blocks.tolist())),
        )
        for name, rows in totals:
            if rows > _MAX_ROWS:
                raise GeometryError(name, f"{rows} descriptor rows in all, more than int32 indices reach")
        per = r.num_blocks * rows_per_region
        self._remote_off = (np.cumsum(per) - per).astype(_I64)
        self._local_off = (np.cumsum(loc.num_blocks) - loc.num_blocks).astype(_I64)
        if self.mode == "direct":
            # remote index of (layer, half, block) = off[layer] + half * nb[layer] + block
            self._r_base = self._remote_off[:, None] + np.arange(2)[None, :] * r.num_blocks[:, None]
            self._l_base = self._local_off.reshape(self.layers, 2)
        else:
            self._r_base = self._remote_off
            self._l_base = self._local_off

    def _pieces(self) -> list[tuple[int, int, int, int]]:
        """(remote offset, local region of the layer, local offset, length) per page for a sliced read: the
        source's bytes split where the local page splits into K/V planes (direct)."""
        src = self.source
        ro, lo, length = int(src.remote_offset), int(src.local_offset), int(src.length)
        if self.mode != "direct":
            return [(ro, 0, lo, length)]
        half = self.plan.local.page_bytes // 2
        pieces = []
        a = lo
        while a < lo + length:
            plane = a // half
            b = min(lo + length, (plane + 1) * half)
            pieces.append((ro + a - lo, plane, a - plane * half, b - a))
            a = b
        return pieces

    def sliced_descs(
        self,
        local_block_ids: Sequence[int] | np.ndarray,
        remote_block_ids: Sequence[int] | np.ndarray,
        remote_num_tokens: int | None = None,
        slots: np.ndarray | None = None,
        *,
        pairs: BlockPairs | None = None,
    ) -> Descs:
        """Explicit descriptors of a sliced read (heterogeneous TP), in any mode: the source's head slice of
        each remote page into its place in the local page (planes, slot or whole block)."""
        if self.source is None:
            raise GeometryError("source", "sliced_descs needs a geometry built with a source slice")
        lk, rk = self._paired(local_block_ids, remote_block_ids, remote_num_tokens, pairs)
        n, layers = lk.size, self.layers
        ra = self._remote_addr(rk)  # (layers, n): remote page starts
        if self.mode == "staged":
            if self.pool is None or slots is None:
                raise GeometryError("pool", "a staged read needs a pool and slots")
            s = np.asarray(slots)
            if s.shape != (layers, n) or not np.issubdtype(s.dtype, np.integer):
                raise GeometryError("slots", f"need integer slots of shape ({layers}, {n}), got {s.shape}")
            s = s.astype(_I64, copy=False)
            flat = s.ravel()
            inc = increasing(flat)
            check_range(flat, self.pool.num_slots, "slots", inc)
            check_unique(flat, "slots", inc)
            pages = (np.uint64(self.pool.base) + s.astype(_U64) * np.uint64(self.pool.slot_bytes))[:, None, :]
            local_dev = self.pool.device_id
        else:
            k_l = self.local.num_regions // layers
            pages = self._local_addr(lk).reshape(layers, k_l, n)
            local_dev = self.local.device_id
        pieces = self._pieces()
        rem = np.stack([ra + np.uint64(p[0]) for p in pieces], axis=1)  # (layers, pieces, n)
        loc = np.stack([pages[:, p[1], :] + np.uint64(p[2]) for p in pieces], axis=1)
        unit = np.tile(np.array([p[3] for p in pieces], _I64), layers)
        k = len(pieces)
        d = merge_runs(rem.reshape(layers * k, n), loc.reshape(layers * k, n), unit, self.remote.device_id,
                       local_dev)
        return Descs(local=d.local, remote=d.remote, layer_rows=d.layer_rows[::k])

    # -- prepared tables (once) --------------------------------------------------------------------------

    def remote_table(self) -> np.ndarray:
        """Strided Nx5 rows for ``prep_xfer_dlist(remote, ...)``: halves (direct) or whole blocks (plain)."""
        r = self.remote
        if self.mode == "direct":
            half = r.block_len // 2
            base = np.repeat(r.base, 2) + np.tile(np.array([0, 1], _U64), r.num_regions) * np.repeat(
                half, 2
            ).astype(_U64)
            return _table(
                base,
                np.repeat(half, 2),
                r.device_id,
                np.repeat(r.block_stride, 2),
                np.repeat(r.num_blocks, 2),
            )
        if self.mode == "plain":
            return _table(r.base, r.block_len, r.device_id, r.block_stride, r.num_blocks)
        raise GeometryError("mode", "staged reads use explicit descriptors, not a prepared remote table")

    def local_table(self) -> np.ndarray:
        """Strided Nx5 rows for ``prep_xfer_dlist("NIXL_INIT_AGENT", ...)``: one row per local region."""
        loc = self.local
        return _table(loc.base, loc.block_len, loc.device_id, loc.block_stride, loc.num_blocks)

    # -- per request -------------------------------------------------------------------------------------

    def blocks(
        self,
        local_block_ids: Sequence[int] | np.ndarray,
        remote_block_ids: Sequence[int] | np.ndarray,
        remote_num_tokens: int | None = None,
    ) -> BlockPairs:
        """Checked kernel block pairs: local ids and the tail of the remote ids, equal length.

        With ``remote_num_tokens`` (kv_transfer_params' ``remote_num_tokens``) the kernel blocks past the last
        token are dropped first on both sides (a logical block of several kernel blocks can end in empty
        ones), so tail pairing stays token-aligned when the two sides' logical block sizes differ."""
        lk = kernel_block_ids(
            local_block_ids, self.local.blocks_per_logical, "local_block_ids", self.local_limit
        )
        rk = kernel_block_ids(
            remote_block_ids, self.remote.blocks_per_logical, "remote_block_ids", self.remote_limit
        )
        if remote_num_tokens is not None:
            lk, rk = trim_padding(
                lk, rk, remote_num_tokens, self.remote.block_size, self.local.blocks_per_logical
            )
        lk, rk = pair_blocks(lk, rk)
        inc = increasing(lk)
        check_range(lk, self.local_limit, "local_block_ids", inc)
        check_range(rk, self.remote_limit, "remote_block_ids")
        check_unique(lk, "local_block_ids", inc)
        return BlockPairs(lk, rk, self.rule)

    def accept(self, pairs: BlockPairs) -> BlockPairs:
        """``pairs`` from ``blocks`` of this geometry or one pairing the same way (the same ratios and block
        size: another mode, or another prefill rank of the request): refused naming the field otherwise. Ids
        are checked again only against a block count smaller than the one they were checked against."""
        if not isinstance(pairs, BlockPairs):
            raise GeometryError("pairs", f"expected BlockPairs from PairGeometry.blocks, not {type(pairs)}")
        got, want = pairs.rule, self.rule
        for name in ("local_ratio", "remote_ratio", "remote_block_size"):
            if getattr(got, name) != getattr(want, name):
                raise GeometryError(
                    f"pairs.{name}",
                    f"the pairs were made with {getattr(got, name)}, this read has {getattr(want, name)}",
                )
        if got.local_limit > want.local_limit:
            check_range(pairs.local, want.local_limit, "local_block_ids")
        if got.remote_limit > want.remote_limit:
            check_range(pairs.remote, want.remote_limit, "remote_block_ids")
        return pairs

    def _paired(
        self,
        local_block_ids: Sequence[int] | np.ndarray,
        remote_block_ids: Sequence[int] | np.ndarray,
        remote_num_tokens: int | None,
        pairs: BlockPairs | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The request's (local, remote) kernel blocks: ``pairs`` when given (then the ids are not paired
        again), else paired from the ids."""
        if pairs is None:
            pairs = self.blocks(local_block_ids, remote_block_ids, remote_num_tokens)
        else:
            self.accept(pairs)
        return pairs.local, pairs.remote

    def indices(
        self,
        local_block_ids: Sequence[int] | np.ndarray,
        remote_block_ids: Sequence[int] | np.ndarray,
        remote_num_tokens: int | None = None,
        *,
        pairs: BlockPairs | None = None,
    ) -> DescIndices:
        """Index form (direct, plain): int32 indices into ``local_table`` / ``remote_table`` rows."""
        lk, rk = self._paired(local_block_ids, remote_block_ids, remote_num_tokens, pairs)
        n = lk.size
        if self.mode == "direct":
            # (layer, half, block): half 0 -> K plane of the layer, half 1 -> V plane.
            remote = (self._r_base[:, :, None] + rk[None, None, :]).astype(np.int32).ravel()
            local = (self._l_base[:, :, None] + lk[None, None, :]).astype(np.int32).ravel()
            return DescIndices(local=local, remote=remote, layers=self.layers, per_layer=2 * n)
        if self.mode == "plain":
            remote = (self._r_base[:, None] + rk[None, :]).astype(np.int32).ravel()
            local = (self._l_base[:, None] + lk[None, :]).astype(np.int32).ravel()
            per_layer = n * (self.remote.num_regions // self.layers)
            return DescIndices(local=local, remote=remote, layers=self.layers, per_layer=per_layer)
        raise GeometryError("mode", "staged reads have no index form; use staged_descs")

    def _remote_addr(self, rk: np.ndarray, half: int | None = None) -> np.ndarray:
        r = self.remote
        addr = r.base[:, None] + rk.astype(_U64)[None, :] * r.block_stride.astype(_U64)[:, None]
        if half:
            addr = addr + (r.block_len // 2).astype(_U64)[:, None]
        return addr

    def _local_addr(self, lk: np.ndarray) -> np.ndarray:
        loc = self.local
        return loc.base[:, None] + lk.astype(_U64)[None, :] * loc.block_stride.astype(_U64)[:, None]

    def descs(
        self,
        local_block_ids: Sequence[int] | np.ndarray,
        remote_block_ids: Sequence[int] | np.ndarray,
        remote_num_tokens: int | None = None,
        *,
        merge: bool = True,
        pairs: BlockPairs | None = None,
    ) -> Descs:
        """Explicit form (direct, plain). Direct halves never merge (the remote halves are not adjacent)."""
        lk, rk = self._paired(local_block_ids, remote_block_ids, remote_num_tokens, pairs)
        r, loc = self.remote, self.local
        if self.mode == "direct":
            half = r.block_len // 2  # (layers,)
            ra = np.stack([self._remote_addr(rk, 0), self._remote_addr(rk, 1)], axis=1)  # (L, 2, n)
            la = self._local_addr(lk).reshape(self.layers, 2, -1)
            unit = np.repeat(half, 2)
            d = merge_runs(
                ra.reshape(2 * self.layers, -1),
                la.reshape(2 * self.layers, -1),
                unit,
                r.device_id,
                loc.device_id,
            )
            return Descs(local=d.local, remote=d.remote, layer_rows=d.layer_rows[::2])
        if self.mode == "plain":
            ra, la = self._remote_addr(rk), self._local_addr(lk)
            if not merge:
                ra, la = ra.reshape(-1, 1), la.reshape(-1, 1)
                unit = np.repeat(r.block_len, lk.size)
            else:
                unit = r.block_len
            d = merge_runs(ra, la, unit, r.device_id, loc.device_id)
            k = r.num_regions // self.layers
            rows = d.layer_rows if merge else np.arange(r.num_regions + 1, dtype=_I64) * lk.size
            return Descs(local=d.local, remote=d.remote, layer_rows=rows[::k])
        raise GeometryError("mode", "use staged_descs for a staged read")

    def staged_descs(
        self,
        remote_block_ids: Sequence[int] | np.ndarray,
        slots: np.ndarray,
        *,
        local_block_ids: Sequence[int] | np.ndarray | None = None,
        remote_num_tokens: int | None = None,
        gaps: Any = None,
        pairs: BlockPairs | None = None,
    ) -> Descs:
        """Whole remote pages into pool slots: ``slots[layer, i]`` receives remote block ``i`` of the paired
        tail: the last ``slots.shape[1]`` kernel blocks, those paired with ``local_block_ids``, or ``pairs``.
        ``gaps`` (a ``spans.GapRead`` or ``SpanGaps``): more remote kernel blocks read into their own slots
        (staging only).
        Pages go in remote-id order, so blocks adjacent on both sides merge whatever the request order."""
        if self.mode != "staged" or self.pool is None:
            raise GeometryError("mode", "staged_descs needs a geometry built in staged mode with a pool")
        span = slots if isinstance(slots, SpanSlots) else None
        if span is None:
            slots = np.asarray(slots)
            if slots.ndim != 2 or not np.issubdtype(slots.dtype, np.integer):
                raise GeometryError("slots", f"need an integer array of shape ({self.layers}, n), "
                                             f"got {slots.dtype} {slots.shape}")
        if slots.shape[0] != self.layers:
            raise GeometryError("slots", f"need slots of shape ({self.layers}, n), got {slots.shape}")
        if pairs is not None:
            rk = self.accept(pairs).remote
        elif local_block_ids is None:
            rk = kernel_block_ids(
                remote_block_ids, self.remote.blocks_per_logical, "remote_block_ids", self.remote_limit
            )
            if remote_num_tokens is not None:
                _, rk = trim_padding(np.empty(0, _I64), rk, remote_num_tokens, self.remote.block_size, 1)
            if slots.shape[1] > rk.size:  # no local ids to blame: the slots ask for more than there is
                raise GeometryError("slots", f"{slots.shape[1]} slots per layer for the prefill's {rk.size} "
                                             "blocks")
            _, rk = pair_blocks(np.empty(slots.shape[1], _I64), rk)
            check_range(rk, self.remote_limit, "remote_block_ids")
        else:
            rk = self.blocks(local_block_ids, remote_block_ids, remote_num_tokens).remote
        if rk.size != slots.shape[1]:
            raise GeometryError("slots", f"{slots.shape[1]} slots per layer for {rk.size} blocks")
        if span is not None and (gaps is None or isinstance(gaps.slots, SpanSlots)):
            return self._span_descs(rk, span, gaps)
        s = np.asarray(slots).astype(_I64, copy=False)
        rk, s = _with_gaps(rk, s, gaps, self.remote_limit)
        flat = s.ravel()
        inc = increasing(flat)
        check_range(flat, self.pool.num_slots, "slots", inc)
        check_unique(flat, "slots", inc)
        r, pool = self.remote, self.pool
        same = layer_uniform_runs(r.base, r.block_stride, r.block_len, rk, s, pool.base, pool.slot_bytes,
                                  r.device_id, pool.device_id)
        if same is not None:
            return same
        ra = self._remote_addr(rk)
        la = np.uint64(pool.base) + s.astype(_U64) * np.uint64(pool.slot_bytes)
        return merge_runs(ra, la, r.block_len, r.device_id, pool.device_id)

    def _span_descs(self, rk: np.ndarray, span: SpanSlots, gaps: Any) -> Descs:
        """``staged_descs`` of a compact span: checked and built on one row of slots, not a matrix."""
        pool, r = self.pool, self.remote
        assert pool is not None
        rows = span.rows.astype(_I64, copy=False)
        if gaps is not None and np.asarray(gaps.remote_ids).size:
            g_ids, g = as_ids(gaps.remote_ids, "gaps.remote_ids"), gaps.slots
            same_span = (g.first, g.layers, g.width) == (span.first, span.layers, span.width)
            if not same_span or g.rows.size != g_ids.size:
                raise GeometryError("gaps.slots", f"need {g_ids.size} rows of the request's own span, got "
                                                  f"{g.rows.size} of a span at {g.first} x {g.width}")
            check_range(g_ids, self.remote_limit, "gaps.remote_ids")
            rk, rows = np.concatenate([rk, g_ids]), np.concatenate([rows, g.rows.astype(_I64, copy=False)])
        if rk.size > 1 and (rk[1:] < rk[:-1]).any():
            order = np.argsort(rk, kind="stable")
            rk, rows = rk[order], rows[order]
        inc = increasing(rows)
        check_range(rows, span.width, "slots", inc)  # rows inside the span: layers never collide
        check_unique(rows, "slots", inc)
        if span.first < 0 or span.first + span.layers * span.width > pool.num_slots:
            raise GeometryError("slots", f"a span of {span.layers} x {span.width} slots at {span.first} "
                                         f"outside the pool's {pool.num_slots}")
        row = span.first + rows
        shift = np.arange(span.layers, dtype=_I64) * span.width
        same = shifted_runs(r.base, r.block_stride, r.block_len, rk, row, shift, pool.base, pool.slot_bytes,
                            r.device_id, pool.device_id)
        if same is not None:
            return same
        la = np.uint64(pool.base) + (row[None, :] + shift[:, None]).astype(_U64) * np.uint64(pool.slot_bytes)
        return merge_runs(self._remote_addr(rk), la, r.block_len, r.device_id, pool.device_id)


def _with_gaps(rk: np.ndarray, s: np.ndarray, gaps: Any, remote_limit: int) -> tuple[np.ndarray, np.ndarray]:
    """Add a staged read's gap blocks, then order every page by remote id (runs merge in that order)."""
    if gaps is not None and np.asarray(gaps.remote_ids).size:
        g_ids = as_ids(gaps.remote_ids, "gaps.remote_ids")
        g_slots = np.asarray(gaps.slots)
        if g_slots.shape != (s.shape[0], g_ids.size) or not np.issubdtype(g_slots.dtype, np.integer):
            raise GeometryError(
                "gaps.slots", f"need shape ({s.shape[0]}, {g_ids.size}), got {g_slots.dtype} {g_slots.shape}"
            )
        check_range(g_ids, remote_limit, "gaps.remote_ids")
        rk = np.concatenate([rk, g_ids])
        s = np.concatenate([s, g_slots.astype(_I64, copy=False)], axis=1)
    if rk.size > 1 and (np.diff(rk) < 0).any():
        order = np.argsort(rk, kind="stable")
        rk, s = rk[order], s[:, order]
    return rk, s


def _check_sliced(
    remote: RemoteRegions, view: PageFormat, local: PageFormat, layers: int, source: Any
) -> None:
    """A sliced read's remote: one LBHNC region per layer, each page holding the source's byte range."""
    if remote.layout != "LBHNC" or view.layout != "LBHNC":
        raise GeometryError("remote.layout", f"only LBHNC pages can be sliced by heads, not {remote.layout}")
    if remote.block_size != view.block_size:
        raise GeometryError("block_size", f"the prefill's kernel block is {remote.block_size} tokens, "
                                          f"the remote page format has {view.block_size}")
    if remote.num_regions != layers:
        raise GeometryError("kv_caches_base_addr", f"region count {remote.num_regions} != {layers} layers")
    ro, lo, length = int(source.remote_offset), int(source.local_offset), int(source.length)
    if min(ro, lo) < 0 or length <= 0 or (remote.block_len < ro + length).any():
        raise GeometryError("block_lens", f"bytes [{ro}, {ro + length}) do not lie inside every remote page")
    if lo + length > local.page_bytes:
        raise GeometryError("local_offset", f"bytes [{lo}, {lo + length}) overflow a {local.page_bytes}-byte "
                                            "local page")


def contiguous_slots(first_slot: int, layers: int, n: int) -> np.ndarray:
    """Slots ``first_slot ..`` layer-major: each layer's blocks in adjacent slots, so runs can merge."""
    return (first_slot + np.arange(layers * n, dtype=_I64)).reshape(layers, n)
