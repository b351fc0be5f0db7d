"""Page formats and the negotiation rule: which remote→local pairings are read, converted, or refused.

The byte contract is docs/page-formats.md. Nothing here does I/O.
"""

from __future__ import annotations

from typing import Literal

import msgspec

STANDARD = "standard"
AITER_SHUFFLED = "aiter_shuffled"

Layout = Literal["LBHNC", "LBNHC", "LHBNC"]

# Bytes per element of every cache dtype we can describe. Only bf16/fp16 are converted (a pure permutation).
DTYPE_BYTES: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
CONVERTIBLE_DTYPES = frozenset({"bfloat16", "float16"})
SHUFFLE_BLOCK_SIZES = frozenset({16, 32})
SHUFFLE_HEAD_SIZES = frozenset({64, 128, 256})


class PageFormat(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one KV page holds, on one side of a transfer.

    ``kind`` is ``"standard"`` (K then V per head and token), ``"aiter_shuffled"`` (AITER K/V tiles), or an
    opaque name for a backend-specific page (for example ``"cpu_attn"``) that can only be read as it is.
    """

    kind: str
    layout: Layout
    dtype: str
    num_heads: int
    block_size: int
    head_size: int

    def __post_init__(self) -> None:
        if not self.kind or not self.kind.replace("_", "").isalnum():
            raise ValueError(f"kind {self.kind!r} must be a non-empty identifier")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        for name in ("num_heads", "block_size", "head_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def elem_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def x(self) -> int:
        """Elements in one 16-byte vector: the AITER tile width."""
        return 16 // self.elem_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer: K and V of every head and token."""
        return 2 * self.num_heads * self.block_size * self.head_size * self.elem_bytes

    @property
    def plane_block_bytes(self) -> int:
        """Bytes of one K-plane (or V-plane) block: half a page."""
        return self.page_bytes // 2


class Plan(msgspec.Struct, frozen=True):
    """An accepted pairing. ``convert`` False means a plain read of whole blocks."""

    remote: PageFormat
    local: PageFormat
    convert: bool


class Refusal(msgspec.Struct, frozen=True):
    """A refused pairing; ``field`` names what disqualified it, e.g. ``"remote.layout"``."""

    field: str
    reason: str

    def __str__(self) -> str:
        return f"{self.field}: {self.reason}"


def negotiate(remote: PageFormat, local: PageFormat, *, conversion_enabled: bool = True) -> Plan | Refusal:
    """Decide how pages in ``remote`` format reach a decoder that wants ``local`` pages. Never guesses."""
    if remote == local:
        return Plan(remote=remote, local=local, convert=False)
    for name in ("dtype", "num_heads", "block_size", "head_size"):
        r, l_ = getattr(remote, name), getattr(local, name)
        if r != l_:
            return Refusal(name, f"remote {name} {r!r} differs from local {l_!r}; {_WHY_EQUAL[name]}")
    if remote.kind == local.kind:
        return Refusal(
            "layout",
            f"same page kind {remote.kind!r} but layouts differ "
            f"(remote {remote.layout}, local {local.layout}); relayout is not supported",
        )
    if remote.kind != STANDARD:
        return Refusal("remote.kind", f"only {STANDARD!r} remote pages can be converted, not {remote.kind!r}")
    if local.kind != AITER_SHUFFLED:
        return Refusal(
            "local.kind", f"standard pages convert only into {AITER_SHUFFLED!r}, not {local.kind!r}"
        )
    if not conversion_enabled:
        return Refusal("remote.kind", "the pairing needs conversion, which is disabled for this remote")
    if remote.layout != "LBHNC":
        return Refusal(
            "remote.layout", f"standard pages must be LBHNC to be split into planes, not {remote.layout}"
        )
    if local.layout != "LHBNC":
        return Refusal("local.layout", f"shuffled pages need dense K/V planes (LHBNC), not {local.layout}")
    if remote.dtype not in CONVERTIBLE_DTYPES:
        return Refusal(
            "dtype",
            f"{remote.dtype} is out of scope; conversion is bit-exact only for {sorted(CONVERTIBLE_DTYPES)}",
        )
    if remote.block_size not in SHUFFLE_BLOCK_SIZES:
        return Refusal(
            "block_size",
            f"shuffled pages need block_size in {sorted(SHUFFLE_BLOCK_SIZES)}, not {remote.block_size}",
        )
    if remote.head_size not in SHUFFLE_HEAD_SIZES:
        return Refusal(
            "head_size", f"head_size must be one of {sorted(SHUFFLE_HEAD_SIZES)}, not {remote.head_size}"
        )
    return Plan(remote=remote, local=local, convert=True)


_WHY_EQUAL = {
    "dtype": "pages are moved bit for bit, so the element type (and fp8 flavour) must match",
    "num_heads": "heterogeneous TP (different heads per rank) is not supported",
    "block_size": "unequal block sizes are not supported",
    "head_size": "K/V head sizes must match",
}
