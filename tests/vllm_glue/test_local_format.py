"""The decoder's page format as the shim declares it (pure)."""

from __future__ import annotations

import pytest

from sidecar.wire.formats import AITER_SHUFFLED, STANDARD
from vllm_glue.local_format import UnknownFormat, local_page_format, required_layout


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
