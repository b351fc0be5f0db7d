"""Launch shapes of the Triton kernels (plain data, importable without Triton)."""

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
