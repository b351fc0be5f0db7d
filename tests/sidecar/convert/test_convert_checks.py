"""Invalid input raises ValueError naming the problem, and nothing is written."""

from __future__ import annotations

import pytest
import torch

from sidecar.convert import PlaneSet, convert_layers_standard_to_shuffled, convert_standard_to_shuffled

H, N, D, B = 2, 16, 64, 4
ROW = H * N * D
GEOM = dict(num_heads=H, block_size=N, head_size=D)


def fresh(dtype=torch.bfloat16, blocks=B):
    torch.manual_seed(0)
    k = torch.randint(-32768, 32767, (blocks, ROW), dtype=torch.int16).view(dtype)
    v = torch.randint(-32768, 32767, (blocks, ROW), dtype=torch.int16).view(dtype)
    return k, v


def raw(*ts):
    """Raw bits (NaN patterns compare equal)."""
    return [t.contiguous().view(torch.int16).clone() for t in ts]


def expect_refusal(match, k, v, ids, others=(), **kw):
    before = raw(k, v, *others)
    with pytest.raises(ValueError, match=match):
        convert_standard_to_shuffled(k, v, ids, **{**GEOM, **kw})
    for a, b in zip(before, raw(k, v, *others), strict=False):
        assert torch.equal(a, b), "a refused call wrote something"


IDS = torch.tensor([1, 3])


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: fresh(torch.float32), "dtype torch.float32 is not convertible"),
        (lambda: (fresh()[0].view(torch.int16), fresh()[1]), "dtype torch.int16 is not convertible"),
        (lambda: (fresh()[0], fresh(torch.float16)[1]), r"v_plane dtype torch.float16 differs"),
        (lambda: (fresh()[0].reshape(-1), fresh()[1]), r"k_plane shape \(8192,\) must be"),
        (lambda: (fresh()[0][:, :ROW - 8], fresh()[1][:, :ROW - 8]),
         r"k_plane shape .* = \[num_blocks, 2048\]"),
        (lambda: (fresh()[0], fresh(blocks=B + 1)[1]), "K plane has 4 blocks, V plane 5"),
        (lambda: (fresh()[0].t().contiguous().t(), fresh()[1]), r"dense along its element axis"),
        (lambda: (lambda k: (k, k))(fresh()[0]), "overlap in memory"),
        (lambda: (fresh()[0], fresh()[1].to("meta")), "mismatched devices"),
        # rows closer than a block (or aliased): converting one block rewrote its neighbour
        (lambda: (fresh()[0].as_strided((B, ROW), (ROW // 2, 1)), fresh()[1]), "k_plane rows overlap"),
        (lambda: (fresh()[0], fresh()[1].as_strided((B, ROW), (0, 1))), "v_plane rows overlap"),
    ],
    ids=["float32", "int16", "k-v-dtype", "1-D", "row-length", "block-counts", "strided", "same-tensor",
         "devices", "overlapping-rows", "aliased-rows"],
)
def test_bad_planes(make, match):
    k, v = make()
    if v.device.type == "meta":
        with pytest.raises(ValueError, match=match):
            convert_standard_to_shuffled(k, v, IDS, **GEOM)
        return
    expect_refusal(match, k, v, IDS)


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        (torch.tensor([1, 4]), r"block_ids holds 4, out of range \[0, 4\)"),
        (torch.tensor([-1, 2]), r"block_ids holds -1, out of range"),
        (torch.tensor([2, 0, 2]), "block_ids holds duplicates, e.g. 2"),
        (torch.tensor([1.0, 2.0]), "block_ids dtype torch.float32 must be an integer type"),
        (torch.tensor([True, False]), "must be an integer type"),
        (torch.tensor([[1, 2]]), "block_ids must be 1-D"),
        ([1, 2], "block_ids must be a torch.Tensor"),
        (torch.tensor([1, 2], device="meta"), "block_ids is on meta"),
    ],
    ids=["too-big", "negative", "duplicate", "float", "bool", "2-D", "list", "device"],
)
def test_bad_block_ids(ids, match):
    k, v = fresh()
    expect_refusal(match, k, v, ids)


@pytest.mark.parametrize(
    ("geom", "match"),
    [
        (dict(num_heads=0), "num_heads must be a positive int, got 0"),
        (dict(num_heads=2.0), "num_heads must be a positive int, got 2.0"),
        (dict(block_size=True), "block_size must be a positive int"),
        (dict(num_heads=4, head_size=32, block_size=16), None),  # same row length, still valid
        (dict(num_heads=1, head_size=4, block_size=512), "head_size 4 is not a multiple of x=8"),
        (dict(num_heads=2, head_size=64, block_size=12), "shape"),
    ],
    ids=["zero-heads", "float-heads", "bool-block", "other-split", "head-size", "row-mismatch"],
)
def test_bad_geometry(geom, match):
    k, v = fresh()
    if match is None:
        convert_standard_to_shuffled(k, v, IDS, **{**GEOM, **geom})
        return
    expect_refusal(match, k, v, IDS, **geom)


def test_block_size_not_multiple_of_x():
    k = torch.zeros((3, 1 * 12 * 64), dtype=torch.float16)
    v = torch.zeros((3, 1 * 12 * 64), dtype=torch.float16)
    with pytest.raises(ValueError, match="block_size 12 is not a multiple of x=8"):
        convert_standard_to_shuffled(k, v, IDS[:1], num_heads=1, block_size=12, head_size=64)


@pytest.mark.parametrize(
    ("make_src", "match"),
    [
        (lambda k: torch.zeros((2, 2 * ROW), dtype=torch.float16), "src dtype torch.float16 differs"),
        (lambda k: torch.zeros((3, 2 * ROW), dtype=torch.bfloat16), r"src shape \(3, 4096\) must be"),
        (lambda k: torch.zeros((2, ROW), dtype=torch.bfloat16), r"src shape \(2, 2048\) must be"),
        (lambda k: torch.zeros((2, 2 * ROW), dtype=torch.bfloat16, device="meta"), "mismatched devices: src"),
        (lambda k: k.view(-1)[: 2 * 2 * ROW].view(2, 2 * ROW), "overlap in memory"),
        (lambda k: [torch.zeros((2, 2 * ROW), dtype=torch.bfloat16)], "src must be a torch.Tensor"),
    ],
    ids=["dtype", "rows", "row-length", "device", "overlap", "list"],
)
def test_bad_src(make_src, match):
    k, v = fresh()
    src = make_src(k)
    if isinstance(src, torch.Tensor) and src.device.type == "meta":
        with pytest.raises(ValueError, match=match):
            convert_standard_to_shuffled(k, v, IDS, **GEOM, src=src)
        return
    expect_refusal(match, k, v, IDS, src=src)


def test_batched_checks_every_layer_before_writing():
    k0, v0 = fresh()
    k1, v1 = fresh()
    bad = torch.zeros((2, ROW), dtype=torch.bfloat16)  # layer 2 has too few blocks for id 3
    before = raw(k0, v0, k1, v1)
    with pytest.raises(ValueError, match=r"block_ids holds 3, out of range \[0, 2\)"):
        convert_layers_standard_to_shuffled([k0, k1, bad], [v0, v1, bad.clone()], IDS, **GEOM)
    assert all(torch.equal(a, b) for a, b in zip(before, raw(k0, v0, k1, v1), strict=False))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda k, v: convert_layers_standard_to_shuffled([], [], IDS, **GEOM), "no layers"),
        (lambda k, v: convert_layers_standard_to_shuffled([k], [v, v], IDS, **GEOM),
         "1 K planes but 2 V planes"),
        (lambda k, v: convert_layers_standard_to_shuffled(k, v, IDS, **GEOM), "must be sequences"),
        (lambda k, v: convert_layers_standard_to_shuffled(
            [k], [v], IDS, **GEOM, src=torch.zeros((2, 2, 2 * ROW), dtype=torch.bfloat16)),
         r"src shape \(2, 2, 4096\) must be \[num_layers=1"),
        (lambda k, v: convert_layers_standard_to_shuffled([k], [v], IDS, **GEOM, src=[]), "src has 0 layers"),
        (lambda k, v: convert_layers_standard_to_shuffled([k], [v], IDS, **GEOM, src="x"),
         "src must be a tensor"),
        (lambda k, v: convert_layers_standard_to_shuffled([k, k], [v, fresh()[1]], IDS, **GEOM), "overlap"),
    ],
    ids=["empty", "count", "tensor-not-list", "src-layers", "src-list-len", "src-type", "shared-plane"],
)
def test_batched_refusals(call, match):
    k, v = fresh()
    before = raw(k, v)
    with pytest.raises(ValueError, match=match):
        call(k, v)
    assert all(torch.equal(a, b) for a, b in zip(before, raw(k, v), strict=False))


BF16 = torch.bfloat16


def plane_set(layers=2):
    ks, vs = zip(*(fresh() for _ in range(layers)), strict=True)
    return list(ks), list(vs), PlaneSet(list(ks), list(vs), **GEOM)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda ps, ks: ps.convert(IDS, layers=(1, 1)), r"layers \[1, 1\) is not a non-empty range of the 2"),
        (lambda ps, ks: ps.convert(IDS, layers=(0, 3)), r"layers \[0, 3\) is not"),
        (lambda ps, ks: ps.convert(torch.tensor([3, 3])), "block_ids holds duplicates, e.g. 3"),
        (lambda ps, ks: ps.convert(torch.tensor([0, 4])), r"block_ids holds 4, out of range \[0, 4\)"),
        (lambda ps, ks: ps.convert(IDS, src=torch.zeros((2, 2, 2 * ROW), dtype=BF16), layers=(1, 2)),
         r"src shape \(2, 2, 4096\) must be \[num_layers=1"),
        (lambda ps, ks: ps.convert(IDS, src=[ks[1].view(-1)[: 2 * 2 * ROW].view(2, 2 * ROW)], layers=(0, 1)),
         r"k_planes\[1\] and src\[0\] overlap in memory"),
        (lambda ps, ks: ps.convert(IDS, src=[torch.zeros((2, 2 * ROW), dtype=torch.float16)], layers=(1, 2)),
         "src.0. dtype torch.float16 differs"),
        (lambda ps, ks: ps.convert(IDS, src=torch.zeros((1, 3, 2 * ROW), dtype=BF16), layers=(1, 2)),
         r"src shape \(1, 3, 4096\) must be \[num_layers, len\(block_ids\), .* = \[1, 2, 4096\]"),
        (lambda ps, ks: ps.convert(IDS, src=ks[0].view(-1)[: 2 * 2 * ROW].view(1, 2, 2 * ROW), layers=(1, 2)),
         r"k_planes\[0\] and src overlap in memory"),
        (lambda ps, ks: ps.convert(IDS, src=torch.zeros((2, 2, 2 * ROW), dtype=torch.float16)),
         "src dtype torch.float16 differs"),
        (lambda ps, ks: ps.convert(IDS, src=torch.zeros((2, 2, 4 * ROW), dtype=torch.bfloat16)[:, :, ::2]),
         "src must be dense along its element axis"),
    ],
    ids=["empty-range", "past-the-end", "duplicates", "out-of-range", "src-layers", "src-overlaps-a-plane",
         "src-dtype", "batched-src-rows", "batched-src-overlaps-a-plane", "batched-src-dtype",
         "batched-src-strided"],
)
def test_plane_set_refuses_a_bad_request_and_writes_nothing(call, match):
    ks, vs, ps = plane_set()
    before = raw(*ks, *vs)
    with pytest.raises(ValueError, match=match):
        call(ps, ks)
    assert all(torch.equal(a, b) for a, b in zip(before, raw(*ks, *vs), strict=True))


def test_plane_set_checks_its_planes_once_up_front():
    k, v = fresh()
    with pytest.raises(ValueError, match="overlap in memory"):
        PlaneSet([k, k], [v, fresh()[1]], **GEOM)
    with pytest.raises(ValueError, match="must be sequences"):
        PlaneSet(k, v, **GEOM)
