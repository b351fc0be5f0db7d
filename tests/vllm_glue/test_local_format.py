"""The decoder's page format as the shim declares it (pure)."""

from __future__ import annotations

import pytest

from sidecar.wire.formats import AITER_SHUFFLED, STANDARD
from vllm_glue.local_format import UnknownFormat, local_page_format, one_scale, required_layout


def test_shuffled_aiter_under_lhbnc() -> None:
    fmt = local_page_format(
        backend_name="ROCM_AITER_FA",
        layout="LHBNC",
        dtype="bfloat16",
        num_kv_heads=8,
        head_size=128,
        layer_shape=[1000, 2, 16, 1024],
        env={"VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT": "1"},
    )
    assert (fmt.kind, fmt.layout, fmt.num_heads, fmt.block_size, fmt.head_size) == (
        AITER_SHUFFLED,
        "LHBNC",
        8,
        16,
        128,
    )


def test_shuffle_flag_off_means_standard() -> None:
    fmt = local_page_format(
        backend_name="ROCM_AITER_FA",
        layout="LBHNC",
        dtype="float16",
        num_kv_heads=8,
        head_size=128,
        layer_shape=[1000, 8, 16, 256],
        env={"VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT": "0"},
    )
    assert fmt.kind == STANDARD and fmt.dtype == "float16"


def test_cpu_attn_is_opaque() -> None:
    fmt = local_page_format(
        backend_name="CPU_ATTN",
        layout="LBHNC",
        dtype="bfloat16",
        num_kv_heads=2,
        head_size=128,
        layer_shape=[256, 2, 128, 256],
        env={},
    )
    assert fmt.kind == "cpu_attn" and fmt.block_size == 128


def test_refusals_name_the_field() -> None:
    with pytest.raises(UnknownFormat, match="layout"):
        local_page_format(
            backend_name="ROCM_AITER_FA",
            layout="LBHNC",
            dtype="bfloat16",
            num_kv_heads=8,
            head_size=128,
            layer_shape=[10, 8, 16, 256],
            env={"VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT": "1"},
        )
    with pytest.raises(UnknownFormat, match="backend"):
        local_page_format(
            backend_name="MYSTERY",
            layout="LBHNC",
            dtype="bfloat16",
            num_kv_heads=8,
            head_size=128,
            layer_shape=[10, 8, 16, 256],
            env={},
        )
    with pytest.raises(UnknownFormat, match="layer_shape"):
        local_page_format(
            backend_name="FLASH_ATTN",
            layout="LBHNC",
            dtype="bfloat16",
            num_kv_heads=4,
            head_size=128,
            layer_shape=[10, 8, 16, 256],
            env={},
        )


def test_required_layout() -> None:
    assert required_layout(backend_name=None, env={"VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT": "1"}) == "LHBNC"
    assert (
        required_layout(backend_name="ROCM_AITER_FA", env={"VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT": "true"})
        == "LHBNC"
    )
    assert required_layout(backend_name=None, env={}) is None
    assert required_layout(backend_name="CPU_ATTN", env={"VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT": "1"}) is None


def cpu_fp8(**kw):
    args = dict(
        backend_name="CPU_ATTN",
        layout="LBHNC",
        dtype="uint8",
        num_kv_heads=2,
        head_size=128,
        layer_shape=[512, 2, 128, 256],
        env={},
        cache_dtype="fp8",
    )
    return local_page_format(**{**args, **kw})


@pytest.mark.parametrize(
    ("cache_dtype", "platform", "storage"),
    [
        ("fp8", "float8_e4m3fn", "float8_e4m3fn"),
        ("fp8_e4m3", "float8_e4m3fn", "float8_e4m3fn"),
        ("fp8", "float8_e4m3fnuz", "float8_e4m3fnuz"),  # MI300
        ("fp8_e5m2", "float8_e4m3fnuz", "float8_e5m2"),
    ],
)
def test_fp8_cache_is_described_by_its_storage_flavour(cache_dtype: str, platform: str, storage: str) -> None:
    fmt = cpu_fp8(cache_dtype=cache_dtype, fp8_e4m3_dtype=platform, k_scale=0.5, v_scale=2.0)
    assert (fmt.dtype, fmt.k_scale, fmt.v_scale, fmt.page_bytes) == (storage, 0.5, 2.0, 2 * 2 * 128 * 128)


def test_scales_are_dropped_for_a_16_bit_cache() -> None:
    fmt = cpu_fp8(dtype="bfloat16", layer_shape=[256, 2, 128, 256], cache_dtype="auto", k_scale=0.5)
    assert (fmt.dtype, fmt.k_scale, fmt.v_scale) == ("bfloat16", 1.0, 1.0)


def test_fp8_refusals_name_the_field() -> None:
    with pytest.raises(UnknownFormat, match="^cache_dtype: .*'fp8_inc'"):
        cpu_fp8(cache_dtype="fp8_inc")
    with pytest.raises(UnknownFormat, match="^dtype: an fp8 KV cache in a bfloat16 tensor"):
        cpu_fp8(dtype="bfloat16")
    with pytest.raises(UnknownFormat, match="^fp8_e4m3_dtype"):
        cpu_fp8(fp8_e4m3_dtype="bfloat16")


def test_one_scale_per_cache() -> None:
    assert one_scale("k_scale", {"l0": 0.25, "l1": 0.25}) == 0.25
    assert one_scale("k_scale", {}) == 1.0
    with pytest.raises(UnknownFormat, match=r"^v_scale: the layers' fp8 scales differ \(\[0.25, 0.5\]\)"):
        one_scale("v_scale", {"l0": 0.25, "l1": 0.5})
