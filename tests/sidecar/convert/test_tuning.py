"""Launch shapes (pure): the kernels' chunks tile every page the planes' checks accept, with no remainder."""

import itertools

import pytest

from sidecar.convert.tuning import (
    TUNING,
    Tuning,
    floor_pow2,
    gather_piece,
    in_place_form,
    next_pow2,
    oop_chunks,
    pow2_divisor,
)

TUNINGS = [TUNING, Tuning(oop_elems=1024, oop_max_dims=64), Tuning(oop_elems=65536, oop_max_dims=256),
           Tuning(oop_max_dims=4)]


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def _before(h, n, d, x, t):
    """The chunks as they were before non-power-of-two sizes were tiled: the oracle where those were exact."""
    dc = min(d, t.oop_max_dims)
    if 2 * n * dc <= t.oop_elems and dc == d:
        hc, nc = min(next_pow2(h), floor_pow2(t.oop_elems // (2 * n * d))), n
    else:
        hc, nc = 1, max(x, min(n, floor_pow2(t.oop_elems // (2 * dc))))
    return hc, nc, dc, -(-h // hc)


@pytest.mark.parametrize("x", [4, 8, 16])
def test_out_of_place_chunks_tile_every_checked_page_exactly(x):
    heads = [*range(1, 17), 31, 32, 64]
    for t, h, n, d in itertools.product(TUNINGS, heads, range(x, 257, x), range(x, 513, x)):
        hc, nc, dc, hchunks = oop_chunks(h, n, d, x, t)
        assert _pow2(hc) and _pow2(nc) and _pow2(dc), (h, n, d, x, t)
        assert n % nc == 0 and d % dc == 0 and nc % x == 0 and dc % x == 0, (h, n, d, x, t, nc, dc)
        assert hc * hchunks >= h > hc * (hchunks - 1), (h, hc, hchunks)
        if _pow2(n) and _pow2(d) and t.oop_max_dims >= x:
            assert (hc, nc, dc, hchunks) == _before(h, n, d, x, t), (h, n, d, x, t)


def test_a_head_size_of_192_is_cut_in_three():
    assert oop_chunks(8, 16, 192, 8, TUNING)[2] == 64
    assert oop_chunks(8, 16, 96, 8, TUNING)[2] == 32
    assert 48 % oop_chunks(8, 48, 128, 8, TUNING)[1] == 0


def test_pages_off_the_powers_of_two_are_refused_or_tiled():
    with pytest.raises(ValueError, match="multiples of x=8"):
        oop_chunks(8, 16, 100, 8, TUNING)
    with pytest.raises(ValueError, match="multiples of x=8"):
        oop_chunks(8, 12, 128, 8, TUNING)


def test_in_place_on_chip_only_for_power_of_two_pages():
    for h, n, d, e in itertools.product([1, 3, 8, 16], [8, 16, 24, 48, 64], [64, 96, 128, 192, 256], [1, 2]):
        for t in (TUNING, Tuning(in_place="pipe"), Tuning(in_place="whole"), Tuning(in_place="scratch")):
            form = in_place_form(h, n, d, e, t)
            if not (_pow2(n) and _pow2(d)):
                assert form == "scratch", (h, n, d, e, t)
            else:
                assert form in ("split", "pipe", "whole", "scratch")
                if t.in_place == "scratch":
                    assert form == "scratch"


def test_gather_piece_divides_the_half_page():
    for n, d in itertools.product(range(4, 257, 4), range(4, 513, 4)):
        piece = gather_piece(n, d)
        assert _pow2(piece) and (n * d) % piece == 0 and piece <= 4096
    assert gather_piece(16, 128) == 2048 and gather_piece(64, 256) == 4096


def test_pow2_divisor():
    assert [pow2_divisor(v, 128) for v in (1, 6, 96, 192, 256, 384)] == [1, 2, 32, 64, 128, 128]
