"""Descriptor geometry, checked by replaying every descriptor as a byte copy between two simulated memories.

The address spaces are numpy byte arrays (address = offset + a base), the remote holds random bytes, and a
request's descriptors are applied as copies; then each local block must hold exactly the remote bytes
page-formats.md says, and every byte outside the request's blocks must be untouched.
"""

from __future__ import annotations

import dataclasses
import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.nixl.geometry import (
    DescIndices,
    GeometryError,
    LocalRegions,
    PairGeometry,
    RemoteRegions,
    StagingPool,
    check_remote,
    contiguous_slots,
    regions_per_layer,
)
from sidecar.nixl.pairing import kernel_block_ids
from sidecar.wire.formats import AITER_SHUFFLED, STANDARD, PageFormat, Plan, negotiate

H, N, D = 2, 16, 64
RBASE, LBASE = 1 << 20, 1 << 30
SENTINEL = 0xAA


def std(**kw) -> PageFormat:
    return PageFormat(
        **{
            **dict(kind=STANDARD, layout="LBHNC", dtype="bfloat16", num_heads=H, block_size=N, head_size=D),
            **kw,
        }
    )


def shuf(**kw) -> PageFormat:
    return PageFormat(
        **{
            **dict(
                kind=AITER_SHUFFLED, layout="LHBNC", dtype="bfloat16", num_heads=H, block_size=N, head_size=D
            ),
            **kw,
        }
    )


def plan_of(remote: PageFormat, local: PageFormat) -> Plan:
    plan = negotiate(remote, local)
    assert isinstance(plan, Plan), plan
    return plan


PAGE = std().page_bytes
HALF = PAGE // 2


class RemoteMem:
    """A prefill's allocation: ``layers`` regions (one or k per layer) with optional block padding."""

    def __init__(
        self,
        layers: int,
        num_blocks: int,
        *,
        block_len: int = PAGE,
        pad: int = 0,
        regions_per_layer: int = 1,
        ratio: int = 1,
        counts: list[int] | None = None,
        seed: int = 0,
        layout: str = "LBHNC",
        block_size: int = N,
        mem_types: list[str] | None = None,
    ):
        self.stride = block_len + pad
        r = layers * regions_per_layer
        self.counts = counts or [num_blocks] * r
        self.region_bytes = [c * self.stride for c in self.counts]
        self.bases = list(RBASE + np.cumsum([0, *self.region_bytes[:-1]]))
        self.mem = np.random.default_rng(seed).integers(0, 256, sum(self.region_bytes), dtype=np.uint8)
        self.block_len = block_len
        self.meta = SimpleNamespace(
            engine_id="prefill",
            agent_metadata=b"x",
            kv_caches_base_addr=[int(b) for b in self.bases],
            device_id=0,
            num_blocks=num_blocks,
            block_lens=[block_len] * r,
            block_strides=[self.stride] * r,
            kv_cache_layout=layout,
            block_size=block_size,
            ssm_sizes=(0, 0),
            attn_backend_name="FLASH_ATTN",
            physical_blocks_per_logical_kv_block=ratio,
            region_num_blocks=list(self.counts),
            region_mem_types=mem_types if mem_types is not None else ["DRAM"] * r,
        )

    def regions(self) -> RemoteRegions:
        return RemoteRegions.from_metadata(self.meta)

    def block(self, region: int, k: int) -> np.ndarray:
        off = int(self.bases[region]) - RBASE + k * self.stride
        return self.mem[off : off + self.block_len]


class LocalMem:
    """The decoder's destination: K/V planes per layer, or whole-block regions; all sentinel at start."""

    def __init__(self, regions: int, num_blocks: int, block_len: int, pad: int = 0):
        self.stride = block_len + pad
        self.nb, self.block_len = num_blocks, block_len
        self.mem = np.full(regions * num_blocks * self.stride, SENTINEL, np.uint8)
        self.bases = [LBASE + r * num_blocks * self.stride for r in range(regions)]

    def block(self, region: int, k: int) -> np.ndarray:
        off = self.bases[region] - LBASE + k * self.stride
        return self.mem[off : off + self.block_len]

    def planes(self) -> LocalRegions:
        return LocalRegions.planes(self.bases[0::2], self.bases[1::2], self.block_len, self.nb)

    def blocks(self, ratio: int = 1) -> LocalRegions:
        return LocalRegions.blocks(
            self.bases, self.block_len, self.nb, block_stride=self.stride, blocks_per_logical=ratio
        )


def expand(table: np.ndarray) -> np.ndarray:
    """NIXL's expansion of strided Nx5 rows into Nx3 (addr, len, dev) descriptors."""
    rows = []
    for addr, length, dev, stride, count in table.astype(np.int64):
        k = np.arange(count)
        rows.append(np.stack([addr + k * stride, np.full(count, length), np.full(count, dev)], axis=1))
    return np.concatenate(rows)


def apply(local: np.ndarray, remote: np.ndarray, lmem: LocalMem, rmem: RemoteMem) -> None:
    """Replay descriptors as copies, refusing any that leaves either address space or overlaps another."""
    assert local.shape == remote.shape and local.shape[1] == 3
    written = np.zeros(lmem.mem.size, np.int32)
    for (la, ll, _), (ra, rl, _) in zip(local.astype(np.int64), remote.astype(np.int64), strict=True):
        assert ll == rl > 0
        lo, ro = la - LBASE, ra - RBASE
        assert lo >= 0 and lo + ll <= lmem.mem.size and ro >= 0 and ro + rl <= rmem.mem.size
        lmem.mem[lo : lo + ll] = rmem.mem[ro : ro + rl]
        written[lo : lo + ll] += 1
    assert written.max(initial=0) <= 1, "two descriptors wrote the same local byte"


def apply_indices(geo: PairGeometry, idx: DescIndices, lmem: LocalMem, rmem: RemoteMem) -> None:
    apply(expand(geo.local_table())[idx.local], expand(geo.remote_table())[idx.remote], lmem, rmem)


def check_direct(lmem: LocalMem, rmem: RemoteMem, layers: int, pairs: list[tuple[int, int]]) -> None:
    """(K-plane block ‖ V-plane block) is the standard block; nothing else was touched."""
    touched = {lb for lb, _ in pairs}
    for layer in range(layers):
        for lb, rb in pairs:
            page = rmem.block(layer, rb)
            assert (lmem.block(2 * layer, lb) == page[:HALF]).all()
            assert (lmem.block(2 * layer + 1, lb) == page[HALF:]).all()
        for lb in set(range(lmem.nb)) - touched:
            assert (lmem.block(2 * layer, lb) == SENTINEL).all() and (
                lmem.block(2 * layer + 1, lb) == SENTINEL
            ).all()


def direct_setup(layers=3, nb_remote=12, nb_local=10, **kw):
    rmem = RemoteMem(layers, nb_remote, **kw)
    lmem = LocalMem(2 * layers, nb_local, HALF)
    geo = PairGeometry(plan_of(std(), shuf()), rmem.regions(), lmem.planes(), "direct")
    return geo, lmem, rmem


# -- regions from metadata -------------------------------------------------------------------------


def test_remote_regions_from_metadata():
    rmem = RemoteMem(3, 8, pad=64, ratio=2, counts=[8, 10, 12])
    r = rmem.regions()
    assert r.num_regions == 3 and r.mem_type == "DRAM" and r.blocks_per_logical == 2
    assert r.base.tolist() == [int(b) for b in rmem.bases]
    assert r.block_len.tolist() == [PAGE] * 3 and r.block_stride.tolist() == [PAGE + 64] * 3
    assert r.num_blocks.tolist() == [8, 10, 12]


def test_remote_regions_default_counts_and_mem_type():
    rmem = RemoteMem(2, 8)
    rmem.meta.region_num_blocks = None
    rmem.meta.region_mem_types = None
    r = RemoteRegions.from_metadata(rmem.meta, default_mem_type="VRAM")
    assert r.num_blocks.tolist() == [8, 8] and r.mem_type == "VRAM"


BAD_META = [
    (
        "no-regions",
        dict(kv_caches_base_addr=[], block_lens=[], block_strides=[], region_num_blocks=[]),
        "kv_caches_base_addr",
    ),
    ("zero-base", dict(kv_caches_base_addr=[0, RBASE]), "kv_caches_base_addr"),
    ("lens-count", dict(block_lens=[PAGE]), "block_lens"),
    ("strides-count", dict(block_strides=[PAGE] * 3), "block_strides"),
    ("stride-below-len", dict(block_strides=[PAGE, PAGE - 2]), "block_strides"),
    ("zero-len", dict(block_lens=[0, PAGE]), "block_lens"),
    ("ratio-zero", dict(physical_blocks_per_logical_kv_block=0), "physical_blocks_per_logical_kv_block"),
    ("num-blocks-not-multiple", dict(physical_blocks_per_logical_kv_block=3), "num_blocks"),
    ("num-blocks-zero", dict(num_blocks=0), "num_blocks"),
    # a logical block larger than a region: requests would expand their ids by it before any range check
    ("ratio-past-region", dict(physical_blocks_per_logical_kv_block=16, num_blocks=16),
     "physical_blocks_per_logical_kv_block"),
    ("region-counts-len", dict(region_num_blocks=[8]), "region_num_blocks"),
    ("region-count-zero", dict(region_num_blocks=[8, 0]), "region_num_blocks"),
    ("device-negative", dict(device_id=-1), "device_id"),
    ("block-size-zero", dict(block_size=0), "block_size"),
    ("mem-types-mixed", dict(region_mem_types=["DRAM", "VRAM"]), "region_mem_types"),
    ("mem-types-unknown", dict(region_mem_types=["HBM", "HBM"]), "region_mem_types"),
    ("mem-types-count", dict(region_mem_types=["DRAM"]), "region_mem_types"),
    ("lens-not-ints", dict(block_lens=[1.5, 2.5]), "block_lens"),
]


@pytest.mark.parametrize("change,field", [c[1:] for c in BAD_META], ids=[c[0] for c in BAD_META])
def test_remote_regions_refusals_name_the_field(change, field):
    rmem = RemoteMem(2, 8)
    for k, v in change.items():
        setattr(rmem.meta, k, v)
    with pytest.raises(GeometryError) as e:
        RemoteRegions.from_metadata(rmem.meta)
    assert e.value.field == field, e.value


# -- the declared format against the published geometry --------------------------------------------


@pytest.mark.parametrize(
    "fmt,k",
    [
        (std(), 1),
        (std(layout="LBNHC"), 1),
        (shuf(), 2),
        (std(layout="LHBNC"), H),
        (std(kind="cpu_attn", block_size=32), 1),
    ],
)
def test_regions_per_layer(fmt, k):
    assert regions_per_layer(fmt) == k


def test_regions_per_layer_unknown_refused():
    with pytest.raises(GeometryError) as e:
        regions_per_layer(std(kind="cpu_attn", layout="LHBNC"))
    assert e.value.field == "layout"


CHECKS = [
    # (id, metadata change, declared format, layers, field) — vLLM's "identical P/D block geometry" refusals
    ("layout", dict(kv_cache_layout="LBNHC"), std(), 3, "kv_cache_layout"),
    ("legacy-layout-name", dict(kv_cache_layout="HND"), std(), 3, "kv_cache_layout"),
    ("block-size", dict(block_size=32), std(), 3, "block_size"),
    ("region-count-vs-layers", {}, std(), 4, "kv_caches_base_addr"),
    ("block-len-heads", dict(block_lens=[PAGE // 2] * 3), std(), 3, "block_lens"),
    (
        "block-len-odd",
        dict(block_lens=[PAGE + 16] * 3, block_strides=[PAGE + 16] * 3),
        std(),
        3,
        "block_lens",
    ),
    ("dtype-fp32", dict(block_lens=[PAGE * 2] * 3, block_strides=[PAGE * 2] * 3), std(), 3, "block_lens"),
    ("declared-fp8", {}, std(dtype="float8_e4m3fn"), 3, "block_lens"),
    ("shuffled-lhbnc-regions", {}, shuf(), 3, "kv_cache_layout"),
]


@pytest.mark.parametrize("change,fmt,layers,field", [c[1:] for c in CHECKS], ids=[c[0] for c in CHECKS])
def test_check_remote_refusals(change, fmt, layers, field):
    rmem = RemoteMem(3, 8)
    for k, v in change.items():
        setattr(rmem.meta, k, v)
    with pytest.raises(GeometryError) as e:
        check_remote(RemoteRegions.from_metadata(rmem.meta), fmt, layers)
    assert e.value.field == field, e.value


def test_block_len_refusal_names_the_element_size():
    """The dtype is not in the metadata; a block_len off by an element-size factor says so."""
    rmem = RemoteMem(3, 8)
    with pytest.raises(GeometryError) as e:
        check_remote(rmem.regions(), std(dtype="float32"), 3)
    assert e.value.field == "block_lens" and "2-byte elements" in e.value.reason


def test_check_remote_accepts_matching_geometry():
    check_remote(RemoteMem(3, 8).regions(), std(), 3)
    check_remote(RemoteMem(3, 8, regions_per_layer=2, block_len=HALF, layout="LHBNC").regions(), shuf(), 3)
    check_remote(
        RemoteMem(3, 8, regions_per_layer=H, block_len=PAGE // H, layout="LHBNC").regions(),
        std(layout="LHBNC"),
        3,
    )


def test_mismatched_kernel_page_rejected():
    """vLLM's test_mismatched_mla_kernel_page_rejected: equal block sizes, half-sized page → refused."""
    rmem = RemoteMem(2, 8)
    rmem.meta.block_lens = [PAGE // 2] * 2
    lmem = LocalMem(4, 8, HALF)
    with pytest.raises(GeometryError) as e:
        PairGeometry(plan_of(std(), shuf()), rmem.regions(), lmem.planes(), "direct")
    assert e.value.field == "block_lens"


def test_descriptor_rows_past_int32_refused():
    """Requests index descriptor rows as int32: a region count that takes the rows past that would wrap one
    layer's rows into another's, so the pairing is refused, naming the field."""
    rmem = RemoteMem(2, 8)
    rmem.meta.region_num_blocks = [2**31 + 32, 8]
    with pytest.raises(GeometryError) as e:
        PairGeometry(plan_of(std(), shuf()), rmem.regions(), LocalMem(4, 8, HALF).planes(), "direct")
    assert e.value.field == "region_num_blocks"


@pytest.mark.parametrize(
    ("mode", "counts"), [("direct", [2**62, 8]), ("plain", [2**62] * 4), ("plain", [2**63 - 1, 2, 8, 8])]
)
def test_descriptor_rows_wrapping_int64_refused(mode, counts):
    """Region counts whose rows overflow int64 (2 * 2**62 in direct, a sum of 2**64 in plain) must not wrap
    back under the int32 bound: else every layer's rows alias layer 0's (a V half read from the K half) and
    NIXL is handed a table of 2**62-block regions."""
    layers = len(counts)
    rmem = RemoteMem(layers, 8)
    rmem.meta.region_num_blocks = counts
    if mode == "direct":
        plan, local = plan_of(std(), shuf()), LocalMem(2 * layers, 8, HALF).planes()
    else:
        plan, local = plan_of(std(), std()), LocalMem(layers, 8, PAGE).blocks()
    with pytest.raises(GeometryError) as e:
        PairGeometry(plan, rmem.regions(), local, mode)
    assert e.value.field == "region_num_blocks"


# -- pairing rules ---------------------------------------------------------------------------------


def test_direct_bytes_land_in_k_and_v_planes():
    geo, lmem, rmem = direct_setup()
    local, remote = [7, 2, 9, 0], [5, 11, 3, 4]
    idx = geo.indices(local, remote)
    assert idx.count == 3 * 2 * 4 and idx.per_layer == 8 and idx.local.dtype == np.int32
    apply_indices(geo, idx, lmem, rmem)
    check_direct(lmem, rmem, 3, list(zip(local, remote, strict=True)))


def test_direct_tables_are_half_blocks():
    geo, _, rmem = direct_setup(layers=2, pad=32)
    rt = geo.remote_table()
    b0, b1 = rmem.bases[0], rmem.bases[1]
    assert rt.tolist() == [
        [b0, HALF, 0, PAGE + 32, 12],
        [b0 + HALF, HALF, 0, PAGE + 32, 12],
        [b1, HALF, 0, PAGE + 32, 12],
        [b1 + HALF, HALF, 0, PAGE + 32, 12],
    ]
    lt = geo.local_table()
    assert lt.shape == (4, 5) and (lt[:, 1] == HALF).all() and (lt[:, 4] == 10).all()


def test_direct_pairs_local_blocks_with_remote_tail():
    """vLLM's _apply_prefix_caching: the decoder's uncached blocks take the TAIL of the prefill's list."""
    geo, lmem, rmem = direct_setup()
    remote = [4, 8, 1, 10, 6]
    idx = geo.indices([3, 5], remote)
    apply_indices(geo, idx, lmem, rmem)
    check_direct(lmem, rmem, 3, [(3, 10), (5, 6)])


def test_direct_refuses_more_local_than_remote_blocks():
    geo, _, _ = direct_setup()
    with pytest.raises(GeometryError) as e:
        geo.indices([1, 2, 3], [4, 5])
    assert e.value.field == "local_block_ids"


@pytest.mark.parametrize(
    "local,remote,field",
    [
        ([10], [1], "local_block_ids"),  # local has 10 blocks: 0..9
        ([-1], [1], "local_block_ids"),
        ([1], [12], "remote_block_ids"),
        ([1], [-3], "remote_block_ids"),
        ([1, 1], [2, 3], "local_block_ids"),  # duplicate destination
        ([7, 8, 9, 10], [1, 2, 3, 4], "local_block_ids"),  # increasing: bounded by its ends
        ([-1, 0, 1], [1, 2, 3], "local_block_ids"),
        ([9, 3, 10, 4], [1, 2, 3, 4], "local_block_ids"),  # neither increasing nor in range
        ([3, 1, 3], [1, 2, 4], "local_block_ids"),
        ([1, 2], [10, 12], "remote_block_ids"),
    ],
)
def test_ids_out_of_range_or_duplicate(local, remote, field):
    geo, _, _ = direct_setup()
    with pytest.raises(GeometryError) as e:
        geo.indices(local, remote)
    assert e.value.field == field


def test_remote_ids_checked_against_smallest_region():
    rmem = RemoteMem(2, 8, counts=[8, 6])
    lmem = LocalMem(4, 8, HALF)
    geo = PairGeometry(plan_of(std(), shuf()), rmem.regions(), lmem.planes(), "direct")
    with pytest.raises(GeometryError) as e:
        geo.indices([0], [7])
    assert e.value.field == "remote_block_ids"
    geo.indices([0], [5])


def test_per_region_block_counts_offset_the_indices():
    """vLLM's test_local_descriptors_follow_each_region_pool_capacity: regions of 2 and 3 blocks of 16 bytes
    at bases 100 and 1000 expand to [100, 116, 1000, 1016, 1032]; ids of region 1 start after region 0's."""
    fmt = PageFormat(kind="opaque", layout="LBHNC", dtype="uint8", num_heads=1, block_size=8, head_size=1)
    meta = SimpleNamespace(
        kv_caches_base_addr=[100, 1000],
        block_lens=[16, 16],
        block_strides=[16, 16],
        num_blocks=3,
        region_num_blocks=[2, 3],
        device_id=0,
        kv_cache_layout="LBHNC",
        block_size=8,
        physical_blocks_per_logical_kv_block=1,
        region_mem_types=["DRAM"] * 2,
    )
    remote = RemoteRegions.from_metadata(meta)
    local = LocalRegions.blocks([5000, 6000], 16, 4)
    geo = PairGeometry(plan_of(fmt, fmt), remote, local, "plain")
    assert expand(geo.remote_table())[:, 0].tolist() == [100, 116, 1000, 1016, 1032]
    idx = geo.indices([3], [1])
    assert idx.remote.tolist() == [1, 2 + 1] and idx.local.tolist() == [3, 4 + 3]


def test_logical_to_kernel_expansion_on_the_remote():
    geo, lmem, rmem = direct_setup(nb_remote=16, ratio=2)
    idx = geo.indices([0, 1, 2, 3], [5, 2])  # remote logical 5, 2 → kernel 10, 11, 4, 5
    apply_indices(geo, idx, lmem, rmem)
    check_direct(lmem, rmem, 3, [(0, 10), (1, 11), (2, 4), (3, 5)])


def test_empty_request_has_no_descriptors():
    geo, _, _ = direct_setup()
    idx = geo.indices([], [1, 2])
    assert idx.count == 0 and idx.layer_slice(0, 3)[0].size == 0
    assert geo.descs([], [1, 2]).count == 0


def test_layer_slices_partition_the_request():
    geo, lmem, rmem = direct_setup(layers=4)
    idx = geo.indices([1, 2, 3], [4, 5, 6])
    parts = [idx.layer_slice(a, b) for a, b in ((0, 1), (1, 3), (3, 4))]
    assert np.array_equal(np.concatenate([p[0] for p in parts]), idx.local)
    assert np.array_equal(np.concatenate([p[1] for p in parts]), idx.remote)
    # the first group touches layer 0 only
    lt, rt = expand(geo.local_table()), expand(geo.remote_table())
    apply(lt[parts[0][0]], rt[parts[0][1]], lmem, rmem)
    assert (lmem.block(2, 1) == SENTINEL).all() and not (lmem.block(0, 1) == SENTINEL).all()


def test_explicit_direct_equals_index_form():
    geo, lmem, rmem = direct_setup()
    local, remote = [1, 2, 3, 8], [0, 1, 2, 9]
    d = geo.descs(local, remote)
    idx = geo.indices(local, remote)
    lt, rt = expand(geo.local_table()), expand(geo.remote_table())
    assert d.count == idx.count == 24
    assert np.array_equal(np.sort(d.local, axis=0), np.sort(lt[idx.local], axis=0))
    assert np.array_equal(np.sort(d.remote, axis=0), np.sort(rt[idx.remote], axis=0))
    assert d.layer_rows.tolist() == [0, 8, 16, 24]
    apply(d.local, d.remote, lmem, rmem)
    check_direct(lmem, rmem, 3, list(zip(local, remote, strict=True)))


# -- vLLM's hetero-ppl sweeps, re-expressed: token-aligned, neighbour-safe, full coverage ----------


def _hetero_case(local_ratio: int, remote_ratio: int, num_tokens: int, cached_local: int) -> None:
    """Local logical blocks of ``local_ratio`` kernels, remote of ``remote_ratio``; ``cached_local`` logical
    blocks of the decoder are prefix hits. Every local kernel block must receive exactly the remote kernel
    block holding the same tokens, and no byte outside the request's blocks may change."""
    layers, n_remote_logical = 2, -(-num_tokens // (remote_ratio * N))
    n_local_logical = -(-num_tokens // (local_ratio * N))
    if cached_local >= n_local_logical:
        return
    rmem = RemoteMem(layers, 4 * n_remote_logical * remote_ratio + 4 * remote_ratio, ratio=remote_ratio)
    nb_local = 2 * n_local_logical * local_ratio + 2 * local_ratio
    lmem = LocalMem(2 * layers, nb_local, HALF)
    local_regions = LocalRegions.planes(
        lmem.bases[0::2], lmem.bases[1::2], HALF, nb_local, blocks_per_logical=local_ratio
    )
    geo = PairGeometry(plan_of(std(), shuf()), rmem.regions(), local_regions, "direct")
    remote_logical = [2 * i + 1 for i in range(n_remote_logical)]  # sparse: neighbours on both sides
    local_logical = [2 * i + 1 for i in range(n_local_logical)][cached_local:]
    idx = geo.indices(local_logical, remote_logical, remote_num_tokens=num_tokens)
    apply_indices(geo, idx, lmem, rmem)
    used = -(-num_tokens // N)
    remote_k = kernel_block_ids(remote_logical, remote_ratio, "r")[:used]
    local_k = kernel_block_ids([2 * i + 1 for i in range(n_local_logical)], local_ratio, "l")[:used]
    first = cached_local * local_ratio  # token position (in kernel blocks) of the first uncached local block
    pairs = [(int(local_k[t]), int(remote_k[t])) for t in range(first, used)]
    check_direct(lmem, rmem, layers, pairs)
    assert idx.count == layers * 2 * len(pairs)


@pytest.mark.parametrize("local_ratio,remote_ratio", [(1, 1), (1, 2), (1, 4), (3, 2), (2, 3), (2, 1), (6, 1)])
@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 31, 33, 47, 48, 49, 63, 64, 65, 95, 97, 130])
def test_hetero_ratio_token_alignment_sweep(local_ratio, remote_ratio, num_tokens):
    for cached in (0, 1):
        _hetero_case(local_ratio, remote_ratio, num_tokens, cached)


def test_without_token_count_a_padded_remote_tail_would_misalign():
    """Why remote_num_tokens matters: 17 tokens in remote logical blocks of 2 kernels leave an empty last
    kernel block; plain tail pairing then shifts every local block by one."""
    geo, _, _ = direct_setup(nb_remote=16, ratio=2)
    rk = geo.blocks([0, 1], [3, 5]).remote  # remote kernels 6, 7, 10, 11
    assert rk.tolist() == [10, 11]  # tokens 32..63: wrong for a 17-token request
    rk = geo.blocks([0, 1], [3, 5], remote_num_tokens=17).remote
    assert rk.tolist() == [6, 7]
    with pytest.raises(GeometryError) as e:
        geo.blocks([0, 1], [3], remote_num_tokens=40)
    assert e.value.field == "remote_block_ids"


# -- staged ----------------------------------------------------------------------------------------


def staged_setup(layers=3, nb_remote=24, slots=None, pad=0):
    rmem = RemoteMem(layers, nb_remote, pad=pad)
    lmem = LocalMem(2 * layers, 8, HALF)
    pool_slots = slots or layers * 16
    pool_mem = LocalMem(1, pool_slots, PAGE)
    pool = StagingPool(pool_mem.bases[0], PAGE, pool_slots)
    geo = PairGeometry(plan_of(std(), shuf()), rmem.regions(), lmem.planes(), "staged", pool=pool)
    return geo, pool_mem, rmem


def check_staged(pool_mem: LocalMem, rmem: RemoteMem, remote: list[int], slots: np.ndarray) -> None:
    for layer in range(slots.shape[0]):
        for i, rb in enumerate(remote):
            assert (pool_mem.block(0, int(slots[layer, i])) == rmem.block(layer, rb)).all()
    untouched = set(range(pool_mem.nb)) - {int(s) for s in slots.ravel()}
    assert all((pool_mem.block(0, s) == SENTINEL).all() for s in untouched)


def test_staged_merges_adjacent_runs():
    geo, pool_mem, rmem = staged_setup()
    remote = [4, 5, 6, 7, 12, 13, 2]  # runs: 4-7, 12-13, 2
    slots = contiguous_slots(3, 3, len(remote))
    d = geo.staged_descs(remote, slots)
    assert d.count == 3 * 3 and d.layer_rows.tolist() == [0, 3, 6, 9]
    assert d.local[:3, 1].tolist() == [PAGE, 4 * PAGE, 2 * PAGE]  # in remote-id order: 2, 4-7, 12-13
    apply(d.local, d.remote, pool_mem, rmem)
    check_staged(pool_mem, rmem, remote, slots)


@pytest.mark.parametrize("seed", range(12))
def test_staged_span_in_remote_order_with_gaps_merges_and_lands_exactly(seed):
    """Slots laid out in remote order (spans.plan_span) merge scattered blocks; gap pages land in their own
    slots; nothing else in the pool is written."""
    from sidecar.nixl.spans import GapRead, ReadCost, count_runs, plan_span, span_slots

    rng = np.random.default_rng(seed)
    layers = 3
    geo, pool_mem, rmem = staged_setup(layers=layers, nb_remote=24, slots=layers * 24)
    remote = rng.choice(24, size=int(rng.integers(1, 12)), replace=False).tolist()
    cost = ReadCost(descriptor_us=8.0, gbps=PAGE * 3 / 8.0 / 1e3)  # gaps of up to 2 pages are worth it
    span = plan_span(np.array(remote), PAGE, cost, budget_blocks=int(rng.integers(0, 6)))
    first = int(rng.integers(0, 5))
    slots = span_slots(first, layers, span.width, span.pos)
    gap_slots = span_slots(first, layers, span.width, span.gap_pos)
    d = geo.staged_descs(remote, slots, gaps=GapRead(span.gap_ids, gap_slots))
    every = np.union1d(remote, span.gap_ids)
    assert d.count == layers * count_runs(every)
    assert d.count <= layers * count_runs(np.sort(remote))
    apply(d.local, d.remote, pool_mem, rmem)
    check_staged(pool_mem, rmem, remote + span.gap_ids.tolist(), np.concatenate([slots, gap_slots], axis=1))


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("pad", [0, 256])
def test_a_compact_span_gives_the_matrix_s_descriptors_and_lands_exactly(seed, pad):
    """``SpanSlots`` (the daemon's form: no [layers, n] matrix) builds the same descriptors as its matrix,
    gaps included, and with padded regions (stride > page: the per-layer fallback) too."""
    from sidecar.nixl.spans import GapRead, ReadCost, SpanSlots, plan_span

    rng = np.random.default_rng(seed)
    layers = 3
    geo, pool_mem, rmem = staged_setup(layers=layers, nb_remote=24, slots=layers * 30, pad=pad)
    remote = rng.choice(24, size=int(rng.integers(1, 12)), replace=False).tolist()
    cost = ReadCost(descriptor_us=8.0, gbps=PAGE * 3 / 8.0 / 1e3)
    span = plan_span(np.array(remote), PAGE, cost, budget_blocks=int(rng.integers(0, 6)))
    first = int(rng.integers(0, 30 * layers - layers * span.width + 1))
    slots, gap_slots = SpanSlots(first, layers, span.width, span.pos), SpanSlots(first, layers, span.width,
                                                                                 span.gap_pos)
    d = geo.staged_descs(remote, slots, gaps=GapRead(span.gap_ids, gap_slots))
    m = geo.staged_descs(remote, np.asarray(slots), gaps=GapRead(span.gap_ids, np.asarray(gap_slots)))
    assert np.array_equal(d.local, m.local) and np.array_equal(d.remote, m.remote)
    assert np.array_equal(d.layer_rows, m.layer_rows)
    apply(d.local, d.remote, pool_mem, rmem)
    check_staged(pool_mem, rmem, remote + span.gap_ids.tolist(),
                 np.concatenate([np.asarray(slots), np.asarray(gap_slots)], axis=1))


def test_a_compact_span_is_checked():
    from sidecar.nixl.spans import GapRead, SpanSlots

    geo, _, _ = staged_setup(slots=3 * 10)  # 30 slots
    ok = SpanSlots(0, 3, 4, np.array([0, 2]))
    geo.staged_descs([1, 3], ok)
    bad = {
        "outside the span": SpanSlots(0, 3, 4, np.array([0, 4])),
        "negative row": SpanSlots(4, 3, 4, np.array([-1, 2])),
        "one row twice": SpanSlots(0, 3, 4, np.array([2, 2])),
        "past the pool": SpanSlots(20, 3, 4, np.array([0, 2])),
        "before the pool": SpanSlots(-4, 3, 4, np.array([0, 2])),
    }
    for why, slots in bad.items():
        with pytest.raises(GeometryError, match="slots"):
            geo.staged_descs([1, 3], slots)
            pytest.fail(why)
    with pytest.raises(GeometryError, match="slots"):  # other layer count
        geo.staged_descs([1, 3], SpanSlots(0, 2, 4, np.array([0, 2])))
    with pytest.raises(GeometryError, match="gaps.slots"):  # gap rows of another span
        geo.staged_descs([1, 3], ok, gaps=GapRead(np.array([2]), SpanSlots(4, 3, 4, np.array([1]))))
    with pytest.raises(GeometryError, match="slots"):  # a gap row that is also a block's row
        geo.staged_descs([1, 3], ok, gaps=GapRead(np.array([2]), SpanSlots(0, 3, 4, np.array([2]))))
    with pytest.raises(GeometryError, match="gaps.remote_ids"):
        geo.staged_descs([1, 3], ok, gaps=GapRead(np.array([99]), SpanSlots(0, 3, 4, np.array([1]))))


def test_staged_gaps_are_checked():
    from sidecar.nixl.spans import GapRead

    geo, _, _ = staged_setup()
    slots = contiguous_slots(0, 3, 2)
    with pytest.raises(GeometryError, match="gaps.slots"):
        geo.staged_descs([1, 3], slots, gaps=GapRead(np.array([2]), np.array([[9], [10]])))
    with pytest.raises(GeometryError, match="gaps.remote_ids"):
        geo.staged_descs([1, 3], slots, gaps=GapRead(np.array([99]), np.array([[9], [10], [11]])))
    with pytest.raises(GeometryError, match="slots"):  # a gap slot that is also a block's slot
        geo.staged_descs([1, 3], slots, gaps=GapRead(np.array([2]), np.array([[1], [10], [11]])))


def test_staged_whole_request_one_descriptor_per_layer():
    geo, pool_mem, rmem = staged_setup()
    remote = list(range(8, 24))
    d = geo.staged_descs(remote, contiguous_slots(0, 3, 16))
    assert d.count == 3 and (d.local[:, 1] == 16 * PAGE).all() and d.nbytes == 3 * 16 * PAGE
    apply(d.local, d.remote, pool_mem, rmem)
    check_staged(pool_mem, rmem, remote, contiguous_slots(0, 3, 16))


def test_staged_padded_remote_blocks_never_merge():
    """Consecutive ids are not enough: with stride > len the bytes between blocks are not ours to read."""
    geo, pool_mem, rmem = staged_setup(pad=256)
    remote = [1, 2, 3, 4]
    d = geo.staged_descs(remote, contiguous_slots(0, 3, 4))
    assert d.count == 12 and (d.local[:, 1] == PAGE).all()
    apply(d.local, d.remote, pool_mem, rmem)
    check_staged(pool_mem, rmem, remote, contiguous_slots(0, 3, 4))


def test_staged_slot_gaps_break_runs():
    geo, pool_mem, rmem = staged_setup()
    remote = [1, 2, 3, 4]
    slots = np.array([[0, 1, 5, 6], [10, 11, 12, 13], [20, 30, 21, 22]])
    d = geo.staged_descs(remote, slots)
    assert d.layer_rows.tolist() == [0, 2, 3, 6]
    apply(d.local, d.remote, pool_mem, rmem)
    check_staged(pool_mem, rmem, remote, slots)


def test_staged_pairs_with_local_blocks_and_tail():
    geo, pool_mem, rmem = staged_setup()
    remote = [9, 10, 11, 3, 4]
    slots = contiguous_slots(0, 3, 2)
    d = geo.staged_descs(remote, slots, local_block_ids=[6, 7])
    apply(d.local, d.remote, pool_mem, rmem)
    check_staged(pool_mem, rmem, [3, 4], slots)
    d2 = geo.staged_descs(remote, slots)  # without local ids: the tail of as many blocks as slots
    assert np.array_equal(d.remote, d2.remote)


@pytest.mark.parametrize(
    "slots,field",
    [
        (np.zeros((2, 2), np.int64), "slots"),  # 2 layers, geometry has 3
        (np.array([[0, 1], [2, 3], [4, 48]]), "slots"),  # 48 >= 48 slots
        (np.array([[-1, 0], [1, 2], [3, 4]]), "slots"),  # increasing, first out of range
        (np.array([[0, 1], [2, 3], [3, 4]]), "slots"),  # slot 3 twice
        (np.array([[0.0, 1.0]] * 3), "slots"),
        (np.arange(9).reshape(3, 3), "slots"),  # 3 slots per layer for 2 blocks
    ],
)
def test_staged_slot_refusals(slots, field):
    geo, _, _ = staged_setup()
    with pytest.raises(GeometryError) as e:
        geo.staged_descs([1, 2], slots, local_block_ids=[0, 1])
    assert e.value.field == field


def test_staged_pool_must_hold_pages():
    rmem = RemoteMem(2, 8)
    lmem = LocalMem(4, 8, HALF)
    with pytest.raises(GeometryError) as e:
        PairGeometry(
            plan_of(std(), shuf()), rmem.regions(), lmem.planes(), "staged", pool=StagingPool(LBASE, HALF, 8)
        )
    assert e.value.field == "pool.slot_bytes"
    with pytest.raises(GeometryError) as e:
        PairGeometry(plan_of(std(), shuf()), rmem.regions(), lmem.planes(), "staged")
    assert e.value.field == "pool"
    with pytest.raises(GeometryError):
        StagingPool(LBASE, PAGE, 0)


def test_a_ratio_past_the_cap_is_refused_at_admission_naming_it():
    rmem = RemoteMem(2, 8)
    rmem.meta.physical_blocks_per_logical_kv_block = 512
    rmem.meta.num_blocks, rmem.meta.region_num_blocks = 512, [512, 512]  # regions as large: not refused so
    with pytest.raises(GeometryError) as e:
        RemoteRegions.from_metadata(rmem.meta)
    assert e.value.field == "physical_blocks_per_logical_kv_block"
    assert "512 kernel blocks per logical block, past the 256 accepted" in e.value.reason
    rmem.meta.physical_blocks_per_logical_kv_block = 256  # the cap itself is accepted
    assert RemoteRegions.from_metadata(rmem.meta).blocks_per_logical == 256


@pytest.mark.parametrize("staged", [False, True])
def test_logical_ids_past_the_cache_are_refused_before_they_are_expanded(staged):
    """A prefill with 2**16 kernel blocks per logical block and regions that large (admitted before the cap):
    a 16-id Pull expanded to 1M kernel ids before any range check (2**22: 583 MB and 2.5 s on the loop)."""
    ratio = 2**16
    rmem = RemoteMem(1, 8)
    regions = rmem.regions()
    remote = dataclasses.replace(regions, blocks_per_logical=ratio, num_blocks=np.full(1, ratio, np.int64))
    geo = PairGeometry(plan_of(std(), std()), remote, LocalMem(1, 8, PAGE).blocks(), "plain")
    ids = np.arange(16, dtype=np.int64)  # one logical block fits the region: ids 1.. are past it
    tracemalloc.start()
    try:
        with pytest.raises(GeometryError) as e:
            if staged:
                pool = StagingPool(base=1 << 44, slot_bytes=PAGE, num_slots=4)
                staged_geo = PairGeometry(plan_of(std(), shuf()), remote, LocalMem(2, 8, HALF).planes(),
                                          "staged", pool=pool)
                staged_geo.staged_descs(ids, np.zeros((1, 1), np.int64))
            else:
                geo.blocks(ids[:1], ids)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert e.value.field == "remote_block_ids"
    assert "logical block id 1 outside [0, 1)" in e.value.reason, e.value
    assert peak < 1 << 20, peak  # 16 x 2**16 kernel ids are 8 MiB


# -- plain -----------------------------------------------------------------------------------------


def test_plain_cpu_one_region_per_layer():
    """A CPU prefill to a CPU decoder: CPU_ATTN pages (opaque, LBHNC, blocks of 32), whole blocks."""
    cpu = std(kind="cpu_attn", block_size=32)
    page = cpu.page_bytes
    rmem = RemoteMem(3, 10, block_len=page, block_size=32)
    lmem = LocalMem(3, 10, page)
    geo = PairGeometry(plan_of(cpu, cpu), rmem.regions(), lmem.blocks(), "plain")
    local, remote = [2, 3, 4, 9], [5, 6, 7, 1]
    idx = geo.indices(local, remote)
    assert idx.count == 12 and idx.per_layer == 4
    assert (expand(geo.remote_table())[idx.remote][:, 1] == page).all()
    apply_indices(geo, idx, lmem, rmem)
    for layer in range(3):
        for lb, rb in zip(local, remote, strict=True):
            assert (lmem.block(layer, lb) == rmem.block(layer, rb)).all()
    # explicit form merges 2,3,4 <- 5,6,7 into one run per layer
    lmem2 = LocalMem(3, 10, page)
    d = geo.descs(local, remote)
    assert d.count == 6 and d.layer_rows.tolist() == [0, 2, 4, 6]
    apply(d.local, d.remote, lmem2, rmem)
    assert np.array_equal(lmem.mem, lmem2.mem)
    d3 = geo.descs(local, remote, merge=False)
    assert d3.count == 12 and d3.layer_rows.tolist() == [0, 4, 8, 12]


def test_plain_shuffled_planes_region_to_region():
    """Shuffled on both sides (LHBNC): 2 regions per layer, plane-block to plane-block."""
    rmem = RemoteMem(2, 8, block_len=HALF, regions_per_layer=2, layout="LHBNC")
    lmem = LocalMem(4, 8, HALF)
    geo = PairGeometry(plan_of(shuf(), shuf()), rmem.regions(), lmem.planes(), "plain")
    idx = geo.indices([1, 2], [6, 3])
    assert idx.per_layer == 4
    apply_indices(geo, idx, lmem, rmem)
    for region in range(4):
        assert (lmem.block(region, 1) == rmem.block(region, 6)).all()
        assert (lmem.block(region, 2) == rmem.block(region, 3)).all()


# -- mode and local-side refusals ------------------------------------------------------------------


def test_mode_refusals():
    rmem = RemoteMem(2, 8)
    planes = LocalMem(4, 8, HALF).planes()
    with pytest.raises(GeometryError) as e:
        PairGeometry(plan_of(std(), shuf()), rmem.regions(), planes, "plain")
    assert e.value.field == "mode"
    with pytest.raises(GeometryError) as e:
        PairGeometry(plan_of(std(), std()), rmem.regions(), LocalMem(2, 8, PAGE).blocks(), "direct")
    assert e.value.field == "mode"
    with pytest.raises(GeometryError) as e:
        PairGeometry(plan_of(std(), shuf()), rmem.regions(), planes, "push")  # type: ignore[arg-type]
    assert e.value.field == "mode"
    shuffled_remote = RemoteMem(2, 8, block_len=HALF, regions_per_layer=2, layout="LHBNC")
    with pytest.raises(GeometryError) as e:
        PairGeometry(
            plan_of(shuf(), shuf()),
            shuffled_remote.regions(),
            planes,
            "staged",
            pool=StagingPool(LBASE, HALF, 4),
        )
    assert e.value.field == "mode"
    geo = PairGeometry(plan_of(std(), shuf()), rmem.regions(), planes, "direct")
    with pytest.raises(GeometryError):
        geo.staged_descs([1], np.zeros((2, 1), np.int64))


def test_local_side_refusals():
    rmem = RemoteMem(2, 8)
    with pytest.raises(GeometryError) as e:
        PairGeometry(plan_of(std(), shuf()), rmem.regions(), LocalMem(4, 8, HALF // 2).planes(), "direct")
    assert e.value.field == "local.block_len"
    odd = LocalRegions.blocks([LBASE, LBASE + 10 * HALF, LBASE + 20 * HALF], HALF, 8)
    with pytest.raises(GeometryError) as e:
        PairGeometry(plan_of(std(), shuf()), rmem.regions(), odd, "direct")
    assert e.value.field == "local.regions"
    with pytest.raises(GeometryError) as e:  # 3 layers locally, 2 remote regions
        PairGeometry(plan_of(std(), shuf()), rmem.regions(), LocalMem(6, 8, HALF).planes(), "direct")
    assert e.value.field == "kv_caches_base_addr"
    for bad in (dict(block_len=0), dict(num_blocks=0), dict(mem_type="HBM"), dict(bases=[])):
        kw = dict(bases=[LBASE], block_len=HALF, num_blocks=8) | bad
        with pytest.raises(GeometryError):
            LocalRegions.blocks(**kw)
    with pytest.raises(GeometryError):
        LocalRegions.planes([LBASE], [], HALF, 8)


# -- property: any geometry, any ids, every mode ---------------------------------------------------


@st.composite
def requests(draw):
    layers = draw(st.integers(1, 3))
    nb_remote = draw(st.integers(2, 12))
    ratio = draw(st.sampled_from([1, 2]))
    pad = draw(st.sampled_from([0, 64]))
    nb_local = draw(st.integers(1, 10))
    n_logical = draw(st.integers(0, nb_remote))
    remote = draw(
        st.lists(st.integers(0, nb_remote - 1), min_size=n_logical, max_size=n_logical, unique=True)
    )
    n_kernel = len(remote) * ratio
    n_local = draw(st.integers(0, min(n_kernel, nb_local)))
    local = draw(st.lists(st.integers(0, nb_local - 1), min_size=n_local, max_size=n_local, unique=True))
    mode = draw(st.sampled_from(["direct", "staged", "plain"]))
    return layers, nb_remote, ratio, pad, nb_local, remote, local, mode


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_property_every_mode_moves_exactly_the_paired_bytes(case):
    layers, nb_remote, ratio, pad, nb_local, remote, local, mode = case
    rmem = RemoteMem(layers, nb_remote * ratio, pad=pad, ratio=ratio)
    rk = kernel_block_ids(remote, ratio, "r")[len(remote) * ratio - len(local) :]
    pairs = list(zip(local, rk.tolist(), strict=True))
    if mode == "direct":
        lmem = LocalMem(2 * layers, nb_local, HALF)
        geo = PairGeometry(plan_of(std(), shuf()), rmem.regions(), lmem.planes(), "direct")
        apply_indices(geo, geo.indices(local, remote), lmem, rmem)
        check_direct(lmem, rmem, layers, pairs)
        lmem2 = LocalMem(2 * layers, nb_local, HALF)
        d = geo.descs(local, remote)
        apply(d.local, d.remote, lmem2, rmem)
        assert np.array_equal(lmem.mem, lmem2.mem)
    elif mode == "plain":
        lmem = LocalMem(layers, nb_local, PAGE)
        geo = PairGeometry(plan_of(std(), std()), rmem.regions(), lmem.blocks(), "plain")
        apply_indices(geo, geo.indices(local, remote), lmem, rmem)
        lmem2 = LocalMem(layers, nb_local, PAGE)
        d = geo.descs(local, remote)
        apply(d.local, d.remote, lmem2, rmem)
        assert np.array_equal(lmem.mem, lmem2.mem)
        for layer in range(layers):
            for lb, rb in pairs:
                assert (lmem.block(layer, lb) == rmem.block(layer, rb)).all()
    else:
        pool_mem = LocalMem(1, max(1, layers * len(local)) + 3, PAGE)
        geo = PairGeometry(
            plan_of(std(), shuf()),
            rmem.regions(),
            LocalMem(2 * layers, nb_local, HALF).planes(),
            "staged",
            pool=StagingPool(pool_mem.bases[0], PAGE, pool_mem.nb),
        )
        slots = contiguous_slots(1, layers, len(local))
        d = geo.staged_descs(remote, slots, local_block_ids=local)
        assert d.count <= layers * len(local)
        apply(d.local, d.remote, pool_mem, rmem)
        check_staged(pool_mem, rmem, rk.tolist(), slots)
