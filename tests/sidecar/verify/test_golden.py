"""The golden grid on the CPU through the daemon's conversion path, and converters with layout slips that
the attention check (alone, bytes not compared) must catch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sidecar.verify import golden, readers

CPU = torch.device("cpu")
READERS = {"torch": readers.decode_torch}


def test_whole_golden_grid_passes_on_cpu():
    assert len(golden.GOLDEN_GRID) == 24
    assert {s.block_size for s in golden.GOLDEN_GRID} == {16, 32}
    assert {s.head_size for s in golden.GOLDEN_GRID} == {64, 128, 256}
    assert {s.num_heads % 2 for s in golden.GOLDEN_GRID} == {0, 1}
    assert {s.dtype for s in golden.GOLDEN_GRID} == {"bfloat16", "float16"}
    assert all(s.gqa > 1 for s in golden.GOLDEN_GRID)
    results = golden.run_grid(golden.GOLDEN_GRID, CPU, READERS, modes=("in_place",))
    bad = [(r.shape.label, r.readers, r.bytes_ok) for r in results if not r.ok]
    assert not bad
    assert all(r.bytes_ok for r in results)


@pytest.mark.parametrize("shape", [golden.GOLDEN_GRID[0], golden.GOLDEN_GRID[-1]], ids=lambda s: s.label)
def test_staged_conversion_passes(shape):
    r = golden.run_shape(shape, CPU, READERS, mode="staged")
    assert r.ok and r.bytes_ok


# --- deliberately wrong converters ---------------------------------------------------------------------


def _pages(k_planes, v_planes, ids, src, fmt):
    """The request's standard pages [L, M, H, N, 2D] as the converter received them."""
    h, n, d = fmt.num_heads, fmt.block_size, fmt.head_size
    if src is not None:
        return src.reshape(len(k_planes), len(ids), h, n, 2 * d).clone()
    t = torch.from_numpy(ids)
    return torch.stack([torch.cat([kp[t], vp[t]], dim=1) for kp, vp in zip(k_planes, v_planes, strict=True)]
                       ).reshape(len(k_planes), len(ids), h, n, 2 * d)


def _write(k_planes, v_planes, ids, k_tiles, v_tiles):
    t = torch.from_numpy(ids)
    for layer, (kp, vp) in enumerate(zip(k_planes, v_planes, strict=True)):
        kp[t] = k_tiles[layer].reshape(len(ids), -1)
        vp[t] = v_tiles[layer].reshape(len(ids), -1)


def swap_k_axes(k_planes, v_planes, ids, fmt, src):
    """K tile [H, N, D/x, x] (the N and D/x axes swapped), V right."""
    p = _pages(k_planes, v_planes, ids, src, fmt)
    lm, h, n, d, x = p.shape[:2], fmt.num_heads, fmt.block_size, fmt.head_size, 8
    k = p[..., :d].reshape(*lm, h, n, d // x, x)  # no permute
    v = p[..., d:].reshape(*lm, h, n // x, x, d).permute(0, 1, 2, 3, 5, 4)
    _write(k_planes, v_planes, ids, k, v)


def swap_v_axes(k_planes, v_planes, ids, fmt, src):
    """V tile [H, N/x, x, D] (D and the token-in-group axis swapped), K right."""
    p = _pages(k_planes, v_planes, ids, src, fmt)
    lm, h, n, d, x = p.shape[:2], fmt.num_heads, fmt.block_size, fmt.head_size, 8
    k = p[..., :d].reshape(*lm, h, n, d // x, x).permute(0, 1, 2, 4, 3, 5)
    v = p[..., d:].reshape(*lm, h, n // x, x, d)
    _write(k_planes, v_planes, ids, k, v)


def _daemon_on(pages, k_planes, v_planes, ids, fmt):
    golden.daemon_converter(k_planes, v_planes, ids, fmt, pages.reshape(pages.shape[0], pages.shape[1], -1))


def reverse_tokens(k_planes, v_planes, ids, fmt, src):
    """Right tiles of pages whose tokens were reversed inside each block, for K and V alike: invisible to
    attention over full blocks (a token permutation), visible only through the sequences' ends."""
    p = _pages(k_planes, v_planes, ids, src, fmt)
    _daemon_on(p.flip(3).contiguous(), k_planes, v_planes, ids, fmt)


def swap_heads(k_planes, v_planes, ids, fmt, src):
    """Right tiles, KV heads 0 and 1 exchanged."""
    p = _pages(k_planes, v_planes, ids, src, fmt)
    _daemon_on(p[:, :, [1, 0, *range(2, fmt.num_heads)]].contiguous(), k_planes, v_planes, ids, fmt)


def swap_dims(k_planes, v_planes, ids, fmt, src):
    """Right tiles, K dims in 16-byte groups exchanged pairwise (x-groups 0<->1, 2<->3, ...)."""
    p = _pages(k_planes, v_planes, ids, src, fmt)
    d = fmt.head_size
    groups = torch.arange(d // 8).reshape(-1, 2).flip(1).reshape(-1)
    order = (groups[:, None] * 8 + torch.arange(8)[None, :]).reshape(-1)
    p = torch.cat([p[..., :d][..., order], p[..., d:]], dim=-1)
    _daemon_on(p.contiguous(), k_planes, v_planes, ids, fmt)


def halves_as_k_and_v(k_planes, v_planes, ids, fmt, src):
    """The classic slip: treat the landed byte halves as K and V (page-formats.md: they never are)."""
    if src is not None:
        pytest.skip("in place only")
    h, n, d, x = fmt.num_heads, fmt.block_size, fmt.head_size, 8
    t = torch.from_numpy(ids)
    for kp, vp in zip(k_planes, v_planes, strict=True):
        k = kp[t].reshape(-1, h, n, d // x, x).permute(0, 1, 3, 2, 4).contiguous()
        v = vp[t].reshape(-1, h, n // x, x, d).permute(0, 1, 2, 4, 3).contiguous()
        kp[t], vp[t] = k.reshape(len(ids), -1), v.reshape(len(ids), -1)


WRONG = [swap_k_axes, swap_v_axes, reverse_tokens, swap_heads, swap_dims, halves_as_k_and_v]


SLIP_SHAPES = [golden.Shape(16, 64, 3, "bfloat16", 4), golden.Shape(32, 128, 4, "float16", 2)]


@pytest.mark.parametrize("wrong", WRONG, ids=lambda f: f.__name__)
@pytest.mark.parametrize("shape", SLIP_SHAPES, ids=lambda s: s.label)
def test_attention_check_alone_catches_a_wrong_layout(wrong, shape):
    r = golden.run_shape(shape, CPU, READERS, mode="in_place", convert=wrong, check_bytes=False)
    assert r.bytes_ok is None  # the bytes were not compared: attention alone decides
    assert not r.attention_ok and not r.ok
    (res,) = r.readers
    # not a near miss: far above the loosest tolerance of any reader (AITER's, bf16)
    assert res.max_error > 10 * golden.tolerance("aiter", "bfloat16"), res


def test_token_reversal_is_invisible_without_the_sequence_ends():
    """Why the check poisons the slots past each sequence's end: over whole blocks only, attention is blind
    to a token permutation applied to K and V alike, so a reader comparison there could not catch it."""
    shape = golden.Shape(16, 64, 3, "bfloat16", 4)
    case = golden.make_case(shape, CPU)
    full = torch.full_like(case.context_lens, 2 * shape.block_size)
    tables = case.block_tables[:1].expand(3, -1).contiguous()  # the one sequence that owns 2 whole blocks
    golden.land_halves(case)
    reverse_tokens(case.k_planes(), case.v_planes(), case.ids, shape.page_format("aiter_shuffled", "LHBNC"),
                   None)
    k_cache, v_cache = readers.shuffled_views(*case.sides(0), shape.num_heads, shape.head_size)
    scale = shape.head_size ** -0.5
    ref = readers.decode_reference(case.queries[0], case.std[0], tables, full, scale)
    out = readers.decode_torch(case.queries[0], k_cache, v_cache, tables, full, scale)
    assert (out - ref).abs().max().item() < golden.tolerance("torch", "bfloat16")
    r = golden.run_shape(shape, CPU, READERS, convert=reverse_tokens, check_bytes=False)
    assert not r.attention_ok  # the golden case's partial blocks and poison catch it


def test_byte_check_also_catches_it():
    r = golden.run_shape(golden.GOLDEN_GRID[0], CPU, READERS, convert=swap_k_axes)
    assert r.bytes_ok is False


def test_tolerances():
    assert golden.tolerance("torch", "bfloat16") == golden.tolerance("triton", "float16") == 4e-4
    assert golden.tolerance("aiter", "bfloat16") == 4 * 2**-8 * golden.VMAX
    assert golden.tolerance("aiter", "float16") == 4 * 2**-11 * golden.VMAX
    assert 50 * golden.tolerance("aiter", "bfloat16") < golden.POISON


def test_case_poisons_every_slot_past_each_sequence_and_every_unowned_block():
    shape = golden.GOLDEN_GRID[0]
    case = golden.make_case(shape, CPU)
    n = shape.block_size
    owned = set(case.ids.tolist())
    for b in range(case.std.shape[1]):
        if b not in owned:
            assert (case.std[:, b] == golden.POISON).all()
    for s, ctx in enumerate(case.context_lens.tolist()):
        last = int(case.block_tables[s, (ctx - 1) // n])
        used = ctx - (ctx - 1) // n * n
        assert (case.std[:, last, :, used:] == golden.POISON).all()
        assert (case.std[:, last, :, :used].abs() <= golden.VMAX).all()
    assert isinstance(case.ids, np.ndarray) and len(set(case.ids.tolist())) == len(case.ids)
