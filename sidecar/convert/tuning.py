"""Launch shapes of the Triton kernels and how they tile a page (pure: importable without Triton)."""

from __future__ import annotations

from dataclasses import dataclass

IN_PLACE_STRATEGIES = ("split", "whole", "pipe", "scratch")


@dataclass(frozen=True)
class Tuning:
    """Launch shapes; the defaults come from H200 measurements (bench/results/convert-h200-*.json)."""

    oop_elems: int = 2048  # page elements (K+V) per out-of-place program
    oop_warps: int = 4
    oop_max_programs: int = 0  # cap on the out-of-place grid (0: none; programs then loop): a GPU share cap
    oop_stages: int = 0  # capped grid: chunks a program keeps loading ahead (Triton's num_stages; 0: default)
    oop_max_dims: int = 128  # split larger heads by dims (keeps the V transpose tile at D <= 128)
    in_place: str = "split"  # "split" (half the pair resident), "pipe", "whole" (all of it) or "scratch"
    pipe_max_pair_bytes: int = 64 * 1024  # "pipe" falls back to "split" above this
    pipe_ctas_per_sm: int = 1
    pipe_max_programs: int = 0  # cap on the persistent grid (0: none; tests use it to make programs loop)
    whole_max_pair_bytes: int = 64 * 1024  # "whole" falls back to "split" above this
    split_max_resident_bytes: int = 128 * 1024  # on chip up to this, else through a scratch
    in_place_elems_per_thread: int = 128  # resident elements per thread: sets num_warps
    prefetch: bool = True  # "split": load the next streamed group before writing the current one
    split_group: int = 1  # "split": heads streamed per step
    maxnreg: int = 0  # register cap for the in-place kernels (0: the compiler's choice)
    k_direct: bool = True  # in place: load K straight in tile order (no shared-memory transpose for K)
    k_direct_oop: bool = True  # the same for the out-of-place kernel
    scratch_bytes: int = 32 * 1024 * 1024
    streaming: bool = False  # evict_first on the plane/staging traffic (it is touched once)

    def __post_init__(self) -> None:
        if self.in_place not in IN_PLACE_STRATEGIES:
            raise ValueError(f"in_place {self.in_place!r} is not one of {IN_PLACE_STRATEGIES}")
        if self.split_group < 1 or self.split_group & (self.split_group - 1):
            raise ValueError(f"split_group {self.split_group} must be a power of two")

    @property
    def evict(self) -> str:
        return "evict_first" if self.streaming else ""


TUNING = Tuning()


# The kernels tile a page with Triton ranges, whose lengths must be powers of two, and cut it into whole
# chunks by integer division: a chunk that does not divide its dimension leaves a remainder unconverted.


def next_pow2(v: int) -> int:
    return 1 << (v - 1).bit_length()


def floor_pow2(v: int) -> int:
    return 1 << (max(1, v).bit_length() - 1)


def pow2_divisor(v: int, cap: int) -> int:
    """The largest power of two that divides ``v`` (> 0) and is at most ``cap``."""
    return min(v & -v, floor_pow2(cap))


def oop_chunks(h: int, n: int, d: int, x: int, tuning: Tuning) -> tuple[int, int, int, int]:
    """The out-of-place program's chunk of a page, about ``oop_elems`` elements: (heads, tokens, dims,
    head chunks); several heads of a small page, or tokens x dims of one head. Tokens and dims are cut
    into powers of two dividing ``n`` and ``d`` (multiples of ``x``, as the planes' checks require), so a
    head size like 192 is converted in three chunks of 64 dims, not one of 128 and a remainder."""
    if n % x or d % x:
        raise ValueError(f"block_size {n} and head_size {d} must be multiples of x={x}")
    dc = max(x, pow2_divisor(d, tuning.oop_max_dims))  # still a power of two dividing d
    whole_page = n & (n - 1) == 0 and dc == d
    if whole_page and 2 * n * d <= tuning.oop_elems:
        hc, nc = min(next_pow2(h), floor_pow2(tuning.oop_elems // (2 * n * d))), n
    else:
        hc, nc = 1, max(x, min(pow2_divisor(n, n), floor_pow2(tuning.oop_elems // (2 * dc))))
    return hc, nc, dc, -(-h // hc)


def in_place_form(h: int, n: int, d: int, e: int, tuning: Tuning = TUNING) -> str:
    """How a pair of ``h`` heads x ``n`` tokens x ``d`` dims of ``e`` bytes converts in place without a
    re-encode: "pipe", "whole" or "split" (on chip, a whole head per range: ``n`` and ``d`` powers of two)
    or "scratch" (copied aside, then converted by the out-of-place chunks)."""
    nd = n * d
    if nd & (nd - 1):
        return "scratch"
    pair_bytes = 2 * e * next_pow2(h) * nd  # K and V, heads padded to a power of two
    resident_bytes = 2 * e * next_pow2(h - h // 2) * nd
    if tuning.in_place == "pipe" and pair_bytes <= tuning.pipe_max_pair_bytes:
        return "pipe"
    if tuning.in_place == "whole" and pair_bytes <= tuning.whole_max_pair_bytes:
        return "whole"
    if tuning.in_place != "scratch" and resident_bytes <= tuning.split_max_resident_bytes:
        return "split"
    return "scratch"


def gather_piece(n: int, d: int) -> int:
    """Elements each program of the in-place scratch's gather copies: a power of two dividing a half page."""
    return pow2_divisor(n * d, 4096)
