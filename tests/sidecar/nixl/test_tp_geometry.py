"""Sliced geometry (heterogeneous TP): every byte each decoder rank reads lands where ``tp.py`` says.

A fake address space stands for NIXL: remote ranks' regions and the decoder's planes / pool are numpy
buffers at made-up addresses, and each descriptor is executed as a byte copy. The expected local page is
built independently from the rule "decoder rank t holds global heads [t*h, (t+1)*h)"."""

import itertools

import numpy as np
import pytest

from sidecar.nixl.geometry import GeometryError, LocalRegions, PairGeometry, RemoteRegions, StagingPool
from sidecar.nixl.tp import RankRead, rank_read
from sidecar.wire.formats import AITER_SHUFFLED, STANDARD, PageFormat, Plan, Refusal, negotiate

LAYERS, N, D, HEADS, BLOCKS = 2, 16, 64, 8, 12
HEAD = N * 2 * D * 2  # bf16 bytes of one head of a page


def fmt(kind, layout, heads):
    return PageFormat(kind=kind, layout=layout, dtype="bfloat16", num_heads=heads, block_size=N, head_size=D)


class Memory:
    """Buffers at addresses; ``copy`` runs one descriptor pair."""

    def __init__(self) -> None:
        self.bufs: dict[int, np.ndarray] = {}
        self.hits: dict[int, np.ndarray] = {}  # base -> writes per byte
        self.next = 1 << 20

    def alloc(self, nbytes: int, fill=None) -> int:
        base = self.next
        self.next += nbytes + (1 << 16)
        self.bufs[base] = np.zeros(nbytes, np.uint8) if fill is None else fill
        self.hits[base] = np.zeros(nbytes, np.int32)
        return base

    def view(self, addr: int, length: int, hits: bool = False) -> np.ndarray:
        for base, buf in self.bufs.items():
            if base <= addr and addr + length <= base + buf.size:
                return (self.hits if hits else self.bufs)[base][addr - base : addr - base + length]
        raise AssertionError(f"[{addr}, +{length}) is outside every buffer")

    def run(self, descs) -> None:
        for (la, ll, _), (ra, rl, _) in zip(descs.local.tolist(), descs.remote.tolist(), strict=True):
            assert ll == rl
            self.view(la, ll)[:] = self.view(ra, rl)
            self.view(la, ll, hits=True)[:] += 1


def remote_rank(mem, rng, remote_tp):
    """A prefill rank: one LBHNC region per layer of BLOCKS pages; returns (regions, its bytes by layer)."""
    page = HEADS // remote_tp * HEAD
    data = [rng.integers(0, 256, BLOCKS * page, dtype=np.uint8) for _ in range(LAYERS)]
    bases = [mem.alloc(d.size, d) for d in data]
    regions = RemoteRegions(
        base=np.array(bases, np.uint64), block_len=np.full(LAYERS, page, np.int64),
        block_stride=np.full(LAYERS, page, np.int64), num_blocks=np.full(LAYERS, BLOCKS, np.int64),
        device_id=0, layout="LBHNC", block_size=N, blocks_per_logical=1, mem_type="DRAM",
    )
    return regions, [d.reshape(BLOCKS, page) for d in data]


def global_page(pages_by_rank, remote_tp, layer, block):
    """The whole model's page [all heads, N, 2D] of ``block``: each prefill rank holds a run of heads."""
    return np.concatenate([pages_by_rank[r][layer][block] for r in range(remote_tp)])


CASES = [(lt, rt) for lt, rt in itertools.product([1, 2, 4, 8], repeat=2) if lt != rt]


@pytest.mark.parametrize("mode", ["direct", "staged", "plain"])
@pytest.mark.parametrize("local_tp,remote_tp", CASES, ids=str)
def test_every_byte_lands_where_tp_says(mode, local_tp, remote_tp):
    rng = np.random.default_rng(local_tp * 10 + remote_tp)
    mem = Memory()
    ranks = [remote_rank(mem, rng, remote_tp) for _ in range(remote_tp)]
    pages_by_rank = [p for _, p in ranks]
    h = HEADS // local_tp
    page = h * HEAD
    remote_fmt = fmt(STANDARD, "LBHNC", HEADS // remote_tp)
    local_fmt = fmt(STANDARD, "LBHNC", h) if mode == "plain" else fmt(AITER_SHUFFLED, "LHBNC", h)
    local_ids = np.array([5, 2, 7, 3])
    remote_ids = np.array([9, 1, 4, 10, 6])  # tail-paired: the last four
    for t in range(local_tp):
        if mode == "plain":
            lbases = [mem.alloc(BLOCKS * page) for _ in range(LAYERS)]
            local = LocalRegions.blocks(lbases, page, BLOCKS)
        else:
            lbases = [mem.alloc(BLOCKS * page // 2) for _ in range(2 * LAYERS)]
            local = LocalRegions.planes(lbases[0::2], lbases[1::2], page // 2, BLOCKS)
        pool = StagingPool(base=mem.alloc(LAYERS * 8 * page), slot_bytes=page, num_slots=LAYERS * 8)
        slots = np.arange(LAYERS * 4).reshape(LAYERS, 4)[:, ::-1] * 2  # scattered, never adjacent
        reads = [rank_read(remote_fmt, local_fmt, local_tp=local_tp, local_rank=t, remote_tp=remote_tp,
                           remote_rank=r) for r in range(remote_tp)]
        mine = [(r, rr) for r, rr in enumerate(reads) if isinstance(rr, RankRead)]
        pairs = None
        assert all(rr.field == "remote_rank" for rr in reads if isinstance(rr, Refusal))
        for r, rr in mine:
            plan = negotiate(rr.view, local_fmt)
            assert isinstance(plan, Plan) and plan.convert == (mode != "plain")
            geo = PairGeometry(plan, ranks[r][0], local, mode, pool=pool if mode == "staged" else None,
                               source=rr.source)
            s = slots if mode == "staged" else None
            d = geo.sliced_descs(local_ids, remote_ids, slots=s)
            if pairs is None:
                pairs = geo.blocks(local_ids, remote_ids)  # the first rank's pairing serves every rank
            p = geo.sliced_descs(local_ids, remote_ids, slots=s, pairs=pairs)
            assert np.array_equal(d.local, p.local) and np.array_equal(d.remote, p.remote)
            assert np.array_equal(d.layer_rows, p.layer_rows)
            mem.run(d)
        for layer in range(LAYERS):
            for i, (lb, rb) in enumerate(zip(local_ids, remote_ids[1:], strict=True)):
                want = global_page(pages_by_rank, remote_tp, layer, rb)[t * page : (t + 1) * page]
                if mode == "plain":
                    got = mem.view(lbases[layer] + lb * page, page)
                elif mode == "staged":
                    got = mem.view(pool.base + int(slots[layer, i]) * page, page)
                else:
                    half = page // 2
                    got = np.concatenate([mem.view(lbases[2 * layer] + lb * half, half),
                                          mem.view(lbases[2 * layer + 1] + lb * half, half)])
                assert np.array_equal(got, want), (t, layer, lb)
    # each paired local byte written exactly once, and nothing else written anywhere
    hits = np.concatenate(list(mem.hits.values()))
    assert hits.max() == 1 and int(hits.sum()) == local_tp * LAYERS * local_ids.size * page


def test_only_lbhnc_remote_pages_are_sliced():
    remote = fmt(STANDARD, "LBNHC", 4)
    local = fmt(AITER_SHUFFLED, "LHBNC", 2)
    got = rank_read(remote, local, local_tp=2, local_rank=0, remote_tp=1, remote_rank=0)
    assert isinstance(got, Refusal) and got.field == "remote.layout"


@pytest.mark.parametrize("kind", [AITER_SHUFFLED, "some_future_kind"])
def test_only_standard_pages_are_sliced_by_heads(kind):
    """Where the heads lie in another kind's LBHNC page is not ours to guess, even with that kind on both
    sides (a plain read would then accept whatever byte range the standard layout implies)."""
    remote, local = fmt(kind, "LBHNC", 4), fmt(kind, "LBHNC", 2)
    for local_tp, remote_tp in ((2, 1), (1, 2)):
        got = rank_read(remote, local, local_tp=local_tp, local_rank=0, remote_tp=remote_tp, remote_rank=0)
        assert isinstance(got, Refusal) and got.field == "remote.kind", got
    # vLLM's CPU attention page is head-major (sliced against real engines: tests/interop)
    cpu = fmt("cpu_attn", "LBHNC", 4)
    assert isinstance(rank_read(cpu, fmt("cpu_attn", "LBHNC", 2), local_tp=2, local_rank=1, remote_tp=1,
                                remote_rank=0), RankRead)


def test_heads_that_do_not_divide_are_refused_by_field():
    remote = fmt(STANDARD, "LBHNC", 3)
    local = fmt(AITER_SHUFFLED, "LHBNC", 1)
    got = rank_read(remote, local, local_tp=2, local_rank=0, remote_tp=1, remote_rank=0)
    assert isinstance(got, Refusal) and got.field == "local_tp"


def test_a_slice_outside_the_remote_pages_is_refused():
    mem = Memory()
    regions, _ = remote_rank(mem, np.random.default_rng(0), 2)
    local_fmt = fmt(AITER_SHUFFLED, "LHBNC", 8)
    rr = rank_read(fmt(STANDARD, "LBHNC", 4), local_fmt, local_tp=1, local_rank=0, remote_tp=2, remote_rank=1)
    plan = negotiate(rr.view, local_fmt)
    lb = [mem.alloc(BLOCKS * 4 * HEAD) for _ in range(2 * LAYERS)]
    local = LocalRegions.planes(lb[0::2], lb[1::2], 4 * HEAD, BLOCKS)
    bad = type(rr.source)(1, 1, rr.source.local_offset, rr.source.length)  # one byte past the page end
    with pytest.raises(GeometryError) as exc:
        PairGeometry(plan, regions, local, "direct", source=bad)
    assert exc.value.field == "block_lens"
