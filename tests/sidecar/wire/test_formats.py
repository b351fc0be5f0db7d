"""Every in-scope and out-of-scope pairing rule of page-formats.md, as a table."""

import math

import msgspec
import pytest

from sidecar.wire import fp8
from sidecar.wire.formats import AITER_SHUFFLED, STANDARD, PageFormat, Plan, Refusal, negotiate


def std(**kw) -> PageFormat:
    base = dict(kind=STANDARD, layout="LBHNC", dtype="bfloat16", num_heads=8, block_size=16, head_size=128)
    return PageFormat(**{**base, **kw})


def shuf(**kw) -> PageFormat:
    base = dict(
        kind=AITER_SHUFFLED, layout="LHBNC", dtype="bfloat16", num_heads=8, block_size=16, head_size=128
    )
    return PageFormat(**{**base, **kw})


ACCEPT = [
    # (id, remote, local, convert)
    ("std-to-shuffled-bf16", std(), shuf(), True),
    ("std-to-shuffled-fp16", std(dtype="float16"), shuf(dtype="float16"), True),
    *[
        (f"N{n}-D{d}", std(block_size=n, head_size=d), shuf(block_size=n, head_size=d), True)
        for n in (16, 32)
        for d in (64, 128, 256)
    ],
    *[(f"H{h}", std(num_heads=h), shuf(num_heads=h), True) for h in (1, 2, 3, 5, 7)],
    ("same-standard", std(), std(), False),
    ("same-shuffled", shuf(), shuf(), False),
    ("same-opaque-cpu", std(kind="cpu_attn", block_size=128), std(kind="cpu_attn", block_size=128), False),
    ("same-fp8", std(dtype="float8_e4m3fn"), std(dtype="float8_e4m3fn"), False),
    ("same-standard-LBNHC", std(layout="LBNHC"), std(layout="LBNHC"), False),
    *[(f"fp8-same-flavour-{t}", std(dtype=t), shuf(dtype=t), True)
      for t in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2")],
    ("fp8-same-scales", std(dtype="float8_e4m3fnuz", k_scale=0.25, v_scale=3.0),
     shuf(dtype="float8_e4m3fnuz", k_scale=0.25, v_scale=3.0), True),
    ("fp8-fn-to-fnuz-doubled-scales", std(dtype="float8_e4m3fn", k_scale=0.5, v_scale=1.5),
     shuf(dtype="float8_e4m3fnuz", k_scale=1.0, v_scale=3.0), True),
]


@pytest.mark.parametrize("remote,local,convert", [a[1:] for a in ACCEPT], ids=[a[0] for a in ACCEPT])
def test_accepted_pairings(remote, local, convert):
    plan = negotiate(remote, local)
    assert isinstance(plan, Plan), plan
    assert plan.convert is convert
    assert plan.remote == remote and plan.local == local


REFUSE = [
    # (id, remote, local, conversion_enabled, field)
    ("reverse-direction", shuf(), std(), True, "remote.kind"),
    ("fp8-fnuz-to-fn", std(dtype="float8_e4m3fnuz"), shuf(dtype="float8_e4m3fn"), True, "dtype"),
    ("fp8-e5m2-to-e4m3", std(dtype="float8_e5m2"), shuf(dtype="float8_e4m3fn"), True, "dtype"),
    ("fp8-fn-to-fnuz-equal-scales-lossy", std(dtype="float8_e4m3fn"), shuf(dtype="float8_e4m3fnuz"), True,
     "local.k_scale"),
    ("fp8-fn-to-fnuz-v-lossy", std(dtype="float8_e4m3fn", k_scale=0.5), shuf(dtype="float8_e4m3fnuz"), True,
     "local.v_scale"),
    ("fp8-fn-to-fnuz-plain", std(dtype="float8_e4m3fn", k_scale=0.5, v_scale=0.5),
     std(dtype="float8_e4m3fnuz"), True, "dtype"),
    ("fp8-k-scales-differ", std(dtype="float8_e4m3fn", k_scale=2.0), shuf(dtype="float8_e4m3fn"), True,
     "k_scale"),
    ("fp8-v-scales-differ", std(dtype="float8_e4m3fnuz", v_scale=0.5), shuf(dtype="float8_e4m3fnuz"), True,
     "v_scale"),
    ("fp8-plain-scales-differ", std(dtype="float8_e4m3fn", k_scale=2.0), std(dtype="float8_e4m3fn"), True,
     "k_scale"),
    ("fp8-int8-vs-uint8", std(dtype="int8"), shuf(dtype="uint8"), True, "dtype"),
    ("bf16-vs-fp16", std(), shuf(dtype="float16"), True, "dtype"),
    ("unequal-block-size", std(block_size=32), shuf(block_size=16), True, "block_size"),
    ("heterogeneous-tp", std(num_heads=4), shuf(num_heads=8), True, "num_heads"),
    ("unequal-head-size", std(head_size=64), shuf(head_size=128), True, "head_size"),
    ("block-size-64", std(block_size=64), shuf(block_size=64), True, "block_size"),
    ("head-size-96", std(head_size=96), shuf(head_size=96), True, "head_size"),
    ("remote-LBNHC", std(layout="LBNHC"), shuf(), True, "remote.layout"),
    ("remote-LHBNC", std(layout="LHBNC"), shuf(), True, "remote.layout"),
    ("local-LBHNC-shuffled", std(), shuf(layout="LBHNC"), True, "local.layout"),
    ("opaque-remote", std(kind="cpu_attn"), shuf(), True, "remote.kind"),
    ("opaque-local", std(), std(kind="cpu_attn"), True, "local.kind"),
    ("conversion-disabled", std(), shuf(), False, "remote.kind"),
    ("same-kind-other-layout", std(layout="LBNHC"), std(), True, "layout"),
]


@pytest.mark.parametrize("remote,local,enabled,field", [r[1:] for r in REFUSE], ids=[r[0] for r in REFUSE])
def test_refused_pairings_name_the_field(remote, local, enabled, field):
    out = negotiate(remote, local, conversion_enabled=enabled)
    assert isinstance(out, Refusal), out
    assert out.field == field
    assert out.reason and str(out).startswith(field + ":")


def test_fp8_reencode_plans_say_which_rule_and_whether_lossy():
    exact = negotiate(std(dtype="float8_e4m3fn", k_scale=0.5, v_scale=0.5), shuf(dtype="float8_e4m3fnuz"))
    assert isinstance(exact, Plan) and (exact.reencode, exact.lossy) == ("bits", False)
    same = negotiate(std(dtype="float8_e4m3fn"), shuf(dtype="float8_e4m3fn"))
    assert isinstance(same, Plan) and (same.reencode, same.lossy) == (None, False)
    remote, local = std(dtype="float8_e4m3fn"), shuf(dtype="float8_e4m3fnuz")
    assert isinstance(negotiate(remote, local), Refusal)
    opted = negotiate(remote, local, allow_lossy_fp8=True)
    assert isinstance(opted, Plan) and (opted.reencode, opted.lossy) == ("rescale", True)
    # k exact by bits, v rescaled: the plan is "rescale" (the tables differ per tensor)
    mixed = negotiate(std(dtype="float8_e4m3fn", k_scale=0.5), local, allow_lossy_fp8=True)
    assert isinstance(mixed, Plan) and mixed.reencode == "rescale"


def fn(k: float, v: float) -> PageFormat:
    return std(dtype="float8_e4m3fn", k_scale=k, v_scale=v)


def fnuz(k: float, v: float) -> PageFormat:
    return shuf(dtype="float8_e4m3fnuz", k_scale=k, v_scale=v)


@pytest.mark.parametrize("k,v", [(0.1, 0.1), (0.3, 0.3), (1 / 3, 1 / 3), (0.0123, 0.0123), (0.1, 0.0123),
                                 (0.017, 3.7), (1e-320, 0.1)])
def test_fp8_doubled_scales_reencode_exactly_whatever_the_scale(k, v):
    """Checkpoint kv scales are arbitrary floats: a local scale exactly twice the remote's is the exact bit
    re-encode, not a lossy one (0.1 x 3 / 0.2 is 1.5000000000000002 in float64, yet nothing rounds)."""
    for allow in (False, True):
        plan = negotiate(fn(k, v), fnuz(2 * k, 2 * v), allow_lossy_fp8=allow)
        assert isinstance(plan, Plan) and (plan.reencode, plan.lossy) == ("bits", False), plan


LOCAL_SCALE = {  # a local scale off twice the remote's: each rounds or saturates some value
    "one-ulp-up": lambda s: math.nextafter(2 * s, math.inf),
    "one-ulp-down": lambda s: math.nextafter(2 * s, 0),
    "equal": lambda s: s,
    "x3": lambda s: 3 * s,
    "x4": lambda s: 4 * s,
}


@pytest.mark.parametrize("how", LOCAL_SCALE)
@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
@pytest.mark.parametrize("scale", [0.1, 1 / 3, 0.5])
def test_fp8_other_scale_ratios_stay_lossy(scale, name, how):
    remote = fn(scale, scale)
    local = msgspec.structs.replace(fnuz(2 * scale, 2 * scale), **{name: LOCAL_SCALE[how](scale)})
    refused = negotiate(remote, local)
    assert isinstance(refused, Refusal) and refused.field == f"local.{name}", refused
    opted = negotiate(remote, local, allow_lossy_fp8=True)
    assert isinstance(opted, Plan) and (opted.reencode, opted.lossy) == ("rescale", True), opted


def test_fp8_huge_scales_are_refused_by_field_never_raised():
    """Scales pass PageFormat validation at any positive finite size; negotiate answers a Refusal (or a
    Plan), never an exception: the admission turns only a Refusal into a refusal the prefill is told of."""
    # 1e200 x 1e200 overflows float64, yet the ratio is 1: the usual lossy refusal, a lossy plan opted in
    out = negotiate(fn(1e200, 1.0), fnuz(1e200, 2.0))
    assert isinstance(out, Refusal) and out.field == "local.k_scale", out
    out = negotiate(fn(1e200, 1e200), fnuz(1e200, 1e200), allow_lossy_fp8=True)
    assert isinstance(out, Plan) and (out.reencode, out.lossy) == ("rescale", True), out
    out = negotiate(fn(1.0, 1e300), fnuz(2.0, 2e300))
    assert isinstance(out, Plan) and (out.reencode, out.lossy) == ("bits", False), out
    # 448 x 1e306 is past float64: a rescaled byte cannot be computed, even opted in; names the remote scale
    for allow in (False, True):
        out = negotiate(fn(1e306, 1.0), fnuz(4e306, 2.0), allow_lossy_fp8=allow)
        assert isinstance(out, Refusal) and out.field == "remote.k_scale" and "1e+306" in out.reason, out
        out = negotiate(fn(1.0, 1e-310), fnuz(2.0, 1e-310), allow_lossy_fp8=allow)
        assert isinstance(out, Refusal) and out.field == "remote.v_scale", out
    out = negotiate(fn(1.0, 10**400), fnuz(2.0, 2.0), allow_lossy_fp8=True)  # an int PageFormat lets by
    assert isinstance(out, Refusal) and out.field == "remote.v_scale", out
    out = negotiate(fn(1.0, 1.0), fnuz(10**400, 2.0), allow_lossy_fp8=True)
    assert isinstance(out, Refusal) and out.field == "local.k_scale", out


EXTREME_SCALES = [5e-324, 1e-310, 2.0**-1013, 1e-300, 1e-30, 0.1, 1.0, 3.0, 1e30, 1e200, 4e305, 1e306,
                  1.7976931348623157e308]


@pytest.mark.parametrize("k", EXTREME_SCALES)
def test_fp8_any_valid_scales_negotiate_to_a_plan_whose_tables_build_or_a_scale_refusal(k):
    fields = {f"{side}.{name}" for side in ("remote", "local") for name in ("k_scale", "v_scale")}
    for lk in [*EXTREME_SCALES, *[2 * k] * math.isfinite(2 * k)]:
        for v, lv in ((1.0, 2.0), (k, lk), (lk, k)):
            for allow in (False, True):
                out = negotiate(fn(k, v), fnuz(lk, lv), allow_lossy_fp8=allow)
                if isinstance(out, Refusal):
                    assert out.field in fields, out
                    continue
                assert isinstance(out, Plan) and (allow or not out.lossy), out
                assert fp8.pair_table(k, lk, v, lv).shape == (2, 256)  # what the daemon builds next


@pytest.mark.parametrize("kw,word", [
    (dict(dtype="fp8"), "storage"), (dict(dtype="fp8_e4m3"), "storage"),
    (dict(dtype="float8_e4m3fn", k_scale=0.0), "k_scale"),
    (dict(dtype="float8_e4m3fn", v_scale=-1.0), "v_scale"),
    (dict(dtype="float8_e4m3fn", k_scale=float("inf")), "k_scale"),
    (dict(dtype="float8_e4m3fn", k_scale=float("nan")), "k_scale"),
    (dict(k_scale=2.0), "only for fp8"),
])
def test_fp8_dtype_and_scale_validation(kw, word):
    with pytest.raises(ValueError, match=word):
        std(**kw)


def test_scales_decode_from_a_declaration():
    doc = (b'{"kind":"standard","layout":"LBHNC","dtype":"float8_e4m3fn","num_heads":8,'
           b'"block_size":16,"head_size":128,"k_scale":0.5,"v_scale":0.25}')
    fmt = msgspec.json.decode(doc, type=PageFormat)
    assert (fmt.k_scale, fmt.v_scale) == (0.5, 0.25)
    assert std(dtype="float8_e4m3fn").k_scale == 1.0


def test_conversion_switch_does_not_block_plain_reads():
    assert negotiate(std(), std(), conversion_enabled=False) == Plan(std(), std(), convert=False)


@pytest.mark.parametrize("dtype,e,x", [("bfloat16", 2, 8), ("float16", 2, 8), ("float8_e4m3fnuz", 1, 16)])
def test_derived_sizes(dtype, e, x):
    f = std(dtype=dtype, num_heads=8, block_size=16, head_size=128)
    assert (f.elem_bytes, f.x) == (e, x)
    assert f.page_bytes == 2 * 8 * 16 * 128 * e
    assert f.plane_block_bytes * 2 == f.page_bytes


def test_qwen3_8b_page_is_64_kib():
    assert std().page_bytes == 64 * 1024


@pytest.mark.parametrize(
    "bad,word",
    [
        (dict(dtype="bf16"), "dtype"),
        (dict(num_heads=0), "num_heads"),
        (dict(block_size=-16), "block_size"),
        (dict(kind=""), "kind"),
        (dict(kind="a b"), "kind"),
    ],
)
def test_invalid_formats_rejected_on_decode(bad, word):
    raw = msgspec.json.encode({**msgspec.structs.asdict(std()), **bad})
    with pytest.raises(msgspec.ValidationError, match=word):
        msgspec.json.decode(raw, type=PageFormat)


def test_unknown_layout_and_fields_rejected():
    good = msgspec.structs.asdict(std())
    with pytest.raises(msgspec.ValidationError, match="layout"):
        msgspec.json.decode(msgspec.json.encode({**good, "layout": "HND"}), type=PageFormat)
    with pytest.raises(msgspec.ValidationError, match="extra"):
        msgspec.json.decode(msgspec.json.encode({**good, "extra": 1}), type=PageFormat)


def test_roundtrip_msgpack():
    f = shuf(num_heads=3, block_size=32, head_size=64)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(f), type=PageFormat) == f
