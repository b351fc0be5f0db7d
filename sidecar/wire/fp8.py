"""FP8 re-encoding between flavours: e4m3fn (OCP; NVIDIA, MI355) pages into an e4m3fnuz (MI300) cache.

A 1-byte element has 256 possible bit patterns, so a re-encode is a 256-entry byte table per tensor (K uses
the K-scale ratio, V the V-scale ratio). Everything here is pure and exhaustively tested.

The two encodings (value = decoded element x the tensor's per-tensor scale):
- e4m3fn: bias 7, max 448, NaN = 0x7F/0xFF, 0x80 is -0.
- e4m3fnuz: bias 8, max 240, NaN = 0x80 only, no -0. Every e4m3fnuz value is half the e4m3fn value with
  the same bits (except 0x80), so with the decoder's scale twice the prefill's the bits carry over.

Rules (``reencode_rule``):
- ``"bits"``: decoder scale == 2 x prefill scale (vLLM's ``normalize_e4m3fn_to_e4m3fnuz`` and its fnuz
  k/v-scale doubling). Output = input bits, 0x80 (-0) -> 0x00, and the fn NaNs 0x7F/0xFF -> 0x80 (fnuz
  NaN). Every value is preserved exactly. vLLM's weight normalisation leaves 0x7F/0xFF alone, which turns
  a NaN into +-240 x scale; we keep NaN a NaN (the only two bytes where we differ from it, on purpose).
- ``"rescale"``: any other ratio. Output = fnuz(round_nearest_even(v_fn x prefill_scale / decoder_scale)),
  computed in float64, saturated to +-240 (fnuz has no infinity), NaN -> 0x80, -0 -> 0x00. Lossy where a
  value saturates or rounds; ``table_loses_values`` says whether a given ratio can lose anything.

Whether a byte keeps its value is decided in exact rational arithmetic (the scales are arbitrary floats:
0.1 x 3 / 0.2 is 1.5000000000000002 in float64, yet a 0.2 decoder scale is exactly twice 0.1).

Scales (``scale_problem``): the bits rule takes any positive finite pair. The rescale rule's float64 target
is the exact value rounded only while v_fn x prefill_scale is a normal float64 for every finite fn value
(2^-9 to 448 in magnitude): a prefill scale from 2^-1013 (1.1e-305) to about 4.0e305. Past that it would
overflow to infinity or lose digits, and bytes would be wrong rather than rounded, so it is refused.
"""

from __future__ import annotations

import bisect
import math
import sys
from fractions import Fraction
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # numpy only where a kernel table is built: the shim imports formats, which imports us
    import numpy as np

FN = "float8_e4m3fn"
FNUZ = "float8_e4m3fnuz"
FN_MAX = 448.0
FN_MIN = 2.0**-9  # the smallest positive e4m3fn value (a subnormal)
FNUZ_MAX = 240.0
FNUZ_NAN = 0x80
FLAG_SATURATED = 1 << 8  # bits above the output byte in a kernel table entry
FLAG_NAN = 1 << 9

Rule = Literal["bits", "rescale"]
Side = Literal["prefill", "decoder"]


def decode_e4m3fn(byte: int) -> float:
    """The value of one e4m3fn byte (NaN for 0x7F/0xFF)."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * man * 2.0**-9  # subnormal: man/8 * 2^(1-7)
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def decode_e4m3fnuz(byte: int) -> float:
    """The value of one e4m3fnuz byte (NaN for 0x80)."""
    if byte == FNUZ_NAN:
        return math.nan
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0:
        return sign * man * 2.0**-10  # subnormal: man/8 * 2^(1-8)
    return sign * (1 + man / 8) * 2.0 ** (exp - 8)


_FNUZ_VALUES = [decode_e4m3fnuz(b) for b in range(256)]
# Non-negative fnuz codes 0x00..0x7F in increasing value order (the encoding is monotone per sign).
_POS = list(_FNUZ_VALUES[:128])
# Exact values of the finite bytes as (numerator, denominator), for the loss notes (NaN has none: (0, 1)).
_FN_EXACT = [(0, 1) if math.isnan(v) else v.as_integer_ratio() for v in map(decode_e4m3fn, range(256))]
_FNUZ_EXACT = [(0, 1) if math.isnan(v) else v.as_integer_ratio() for v in _FNUZ_VALUES]
_FNUZ_MAX_INT = int(FNUZ_MAX)


def encode_e4m3fnuz(value: float) -> tuple[int, bool]:
    """Nearest e4m3fnuz byte to ``value`` (ties to even mantissa), saturating; returns (byte, saturated).
    NaN gives 0x80; -0 and values rounding to zero give 0x00 (fnuz has no -0)."""
    if math.isnan(value):
        return FNUZ_NAN, False
    mag = abs(value)
    if mag > FNUZ_MAX:
        code, saturated = 0x7F, True
    else:
        i = bisect.bisect_left(_POS, mag)  # first code with value >= mag
        if i < 128 and _POS[i] == mag:
            code = i
        else:
            lo, hi = i - 1, i
            dlo, dhi = mag - _POS[lo], _POS[hi] - mag
            code = lo if dlo < dhi or (dlo == dhi and lo % 2 == 0) else hi
        saturated = False
    if code == 0:
        return 0x00, saturated
    return (code | 0x80 if value < 0 else code), saturated


def reencode_rule(prefill_scale: float, decoder_scale: float) -> Rule:
    """Which table a (prefill, decoder) per-tensor scale pair gets."""
    return "bits" if decoder_scale == 2.0 * prefill_scale else "rescale"


RESCALE_PREFILL_MIN = sys.float_info.min / FN_MIN  # 2^-1013 exactly: FN_MIN x it is the least normal float64


def _rescale_computes(prefill_scale: float) -> bool:
    """Whether v x prefill_scale is a normal float64 for every finite e4m3fn value v."""
    return prefill_scale >= RESCALE_PREFILL_MIN and math.isfinite(FN_MAX * prefill_scale)


RESCALE_PREFILL_MAX = sys.float_info.max / FN_MAX
while not _rescale_computes(RESCALE_PREFILL_MAX):  # the quotient rounded up; one ulp down is the largest
    RESCALE_PREFILL_MAX = math.nextafter(RESCALE_PREFILL_MAX, 0.0)


def scale_problem(prefill_scale: float, decoder_scale: float) -> tuple[Side, str] | None:
    """None when ``byte_table`` takes this tensor's scales; else which scale it cannot take, and why."""
    for side, scale in (("prefill", prefill_scale), ("decoder", decoder_scale)):
        try:
            ok = 0.0 < float(scale) < math.inf
        except (TypeError, ValueError, OverflowError):  # an int past float64 is not a scale we can use
            ok = False
        if not ok:
            return side, f"the {side} scale {scale!r} must be a positive finite float64"
    if reencode_rule(float(prefill_scale), float(decoder_scale)) == "rescale" and not _rescale_computes(
        float(prefill_scale)
    ):
        return "prefill", (
            f"a rescaled byte is v x prefill scale / decoder scale in float64, which is the exact value "
            f"rounded only for a prefill scale from {RESCALE_PREFILL_MIN:.3g} to {RESCALE_PREFILL_MAX:.3g} "
            "(past that it overflows or loses digits); any scale is re-encoded exactly when the decoder "
            "scale is exactly twice it"
        )
    return None


def byte_table(prefill_scale: float, decoder_scale: float) -> list[tuple[int, int, str]]:
    """Every e4m3fn input byte's (input, output, note) for one tensor's scales; note is "", "saturated",
    "nan", "rounded" (value changed by rounding) or "-0". ValueError for scales ``scale_problem`` refuses."""
    problem = scale_problem(prefill_scale, decoder_scale)
    if problem is not None:
        raise ValueError(problem[1])
    prefill_scale, decoder_scale = float(prefill_scale), float(decoder_scale)
    rule = reencode_rule(prefill_scale, decoder_scale)
    # prefill / decoder scale as an exact ratio rn / rd: the notes compare rationals, with no rounding
    rn, rd = (Fraction(prefill_scale) / Fraction(decoder_scale)).as_integer_ratio()
    rows = []
    for b in range(256):
        v = decode_e4m3fn(b)
        if math.isnan(v):
            rows.append((b, FNUZ_NAN, "nan"))
            continue
        if rule == "bits":
            out = 0x00 if b == 0x80 else b
        else:
            out, _ = encode_e4m3fnuz(v * prefill_scale / decoder_scale)
        # the decoder must read v x prefill / decoder scale = (vn x rn) / (vd x rd); fnuz(out) is un / ud
        (vn, vd), (un, ud) = _FN_EXACT[b], _FNUZ_EXACT[out]
        if abs(vn) * rn > _FNUZ_MAX_INT * vd * rd:
            note = "saturated"
        elif b == 0x80:
            note = "-0"
        elif un * vd * rd != vn * rn * ud:
            note = "rounded"
        else:
            note = ""
        rows.append((b, out, note))
    return rows


def kernel_table(prefill_scale: float, decoder_scale: float) -> np.ndarray:
    """int32[256]: output byte | FLAG_SATURATED | FLAG_NAN, the form the converters load."""
    import numpy as np

    out = np.zeros(256, dtype=np.int32)
    for b, o, note in byte_table(prefill_scale, decoder_scale):
        out[b] = o | (FLAG_SATURATED if note == "saturated" else 0) | (FLAG_NAN if note == "nan" else 0)
    return out


def table_loses_values(prefill_scale: float, decoder_scale: float) -> bool:
    """True when some finite input saturates or rounds (NaN stays NaN and -0 is 0: neither counts)."""
    return any(note in ("saturated", "rounded") for _, _, note in byte_table(prefill_scale, decoder_scale))


def format_table(prefill_scale: float, decoder_scale: float) -> str:
    """A human-readable table of all 256 bytes (for docs and review)."""
    lines = [
        f"# e4m3fn -> e4m3fnuz, prefill scale {prefill_scale!r}, decoder scale {decoder_scale!r}, "
        f"rule {reencode_rule(prefill_scale, decoder_scale)}",
        "# in   fn value         out  fnuz value x (decoder/prefill scale)  note",
        "# regenerate: python -c 'from sidecar.wire import fp8; print(fp8.format_table(1.0, 2.0))'",
    ]
    ratio = decoder_scale / prefill_scale
    for b, o, note in byte_table(prefill_scale, decoder_scale):
        row = f"0x{b:02X}  {decode_e4m3fn(b):>12g}    0x{o:02X}  {_FNUZ_VALUES[o] * ratio:>12g}  {note}"
        lines.append(row.rstrip())
    return "\n".join(lines) + "\n"


def pair_table(prefill_k: float, decoder_k: float, prefill_v: float, decoder_v: float) -> np.ndarray:
    """int32 [2, 256]: the K table then the V table, as ``PlaneSet(lut=...)`` takes them."""
    import numpy as np

    return np.stack([kernel_table(prefill_k, decoder_k), kernel_table(prefill_v, decoder_v)])
