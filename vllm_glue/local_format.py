"""The decoder's own page format, from what vLLM resolved (pure: backend name, layout, env, one layer's
tensor).

The sidecar never guesses a format; the shim states it, because vLLM publishes none (page-formats.md, "Why the
format must be declared").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sidecar.wire.formats import AITER_SHUFFLED, FP8_DTYPES, STANDARD, PageFormat

SHUFFLE_ENV = "VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT"
CPU_ATTN_KIND = "cpu_attn"
AITER_FA = "ROCM_AITER_FA"
# Backends whose default spec stores K then V per (head, token): the standard page.
STANDARD_BACKENDS = frozenset(
    {"FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "ROCM_AITER_UNIFIED_ATTN", "ROCM_ATTN", "ROCM_AITER_FA"}
)


# vLLM's fp8 --kv-cache-dtype names; "fp8"/"fp8_e4m3" store the platform's e4m3 flavour (current_platform.
# fp8_dtype(): e4m3fnuz on MI300, else e4m3fn), in uint8 tensors.
VLLM_FP8_CACHE_DTYPES = frozenset({"fp8", "fp8_e4m3", "fp8_e5m2"})


class UnknownFormat(ValueError):
    """The local page cannot be described; the text names the field."""


def env_flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def local_page_format(
    *,
    backend_name: str,
    layout: str,
    dtype: str,
    num_kv_heads: int,
    head_size: int,
    layer_shape: Sequence[int],
    env: Mapping[str, str],
    cache_dtype: str = "auto",
    fp8_e4m3_dtype: str = "float8_e4m3fn",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> PageFormat:
    """Describe one decoder page. ``layer_shape`` is one layer's view ``[B, H_slots, N, C]`` as vLLM allocated
    it.

    ``num_kv_heads`` is per rank. The block size is the kernel block size: the view's token axis.
    ``dtype`` is the tensor's; with an fp8 ``cache_dtype`` (vLLM's --kv-cache-dtype) the page is described by
    its storage flavour (``fp8_e4m3_dtype``: the platform's e4m3) and the layers' ``k_scale``/``v_scale``.
    """
    dtype, k_scale, v_scale = _storage(dtype, cache_dtype, fp8_e4m3_dtype, k_scale, v_scale)
    if len(layer_shape) != 4:
        raise UnknownFormat(f"layer_shape: expected a 4-D [B, H, N, C] view, got {list(layer_shape)}")
    block_size = int(layer_shape[2])
    shuffled = backend_name == AITER_FA and env_flag(env, SHUFFLE_ENV)
    if backend_name == "CPU_ATTN":
        kind = CPU_ATTN_KIND
    elif shuffled:
        kind = AITER_SHUFFLED
        if layout != "LHBNC":
            raise UnknownFormat(f"layout: shuffled AITER pages need LHBNC, vLLM resolved {layout}")
        if layer_shape[1] != 2 or layer_shape[3] != num_kv_heads * head_size:
            raise UnknownFormat(
                f"layer_shape: a shuffled view is [B, 2, N, H*D] = [B, 2, N, "
                f"{num_kv_heads * head_size}], got {list(layer_shape)}"
            )
    elif backend_name in STANDARD_BACKENDS:
        kind = STANDARD
    else:
        raise UnknownFormat(f"backend: no page format is known for attention backend {backend_name!r}")
    if kind != AITER_SHUFFLED and (layer_shape[1] != num_kv_heads or layer_shape[3] != 2 * head_size):
        raise UnknownFormat(
            f"layer_shape: expected [B, {num_kv_heads}, N, {2 * head_size}] for {kind} pages, "
            f"got {list(layer_shape)}"
        )
    return PageFormat(
        kind=kind,
        layout=layout,
        dtype=dtype,
        num_heads=num_kv_heads,
        block_size=block_size,
        head_size=head_size,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def one_scale(name: str, per_layer: Mapping[str, float]) -> float:
    """The layers' common fp8 scale; a page format carries one per tensor, so differing scales are refused."""
    values = sorted(set(per_layer.values()))
    if len(values) > 1:
        raise UnknownFormat(
            f"{name}: the layers' fp8 scales differ ({values[:4]}); one scale per cache is needed"
        )
    return values[0] if values else 1.0


def _storage(
    dtype: str, cache_dtype: str, fp8_e4m3_dtype: str, k_scale: float, v_scale: float
) -> tuple[str, float, float]:
    """The page's element dtype and scales: the tensor's dtype unless the cache stores fp8 (in uint8)."""
    if not cache_dtype.startswith("fp8"):
        return dtype, 1.0, 1.0  # scales exist only for fp8 pages
    if cache_dtype not in VLLM_FP8_CACHE_DTYPES:
        raise UnknownFormat(f"cache_dtype: no page format is known for vLLM's {cache_dtype!r} KV cache")
    if dtype not in ("uint8", *FP8_DTYPES):
        raise UnknownFormat(f"dtype: an {cache_dtype} KV cache in a {dtype} tensor")
    storage = "float8_e5m2" if cache_dtype == "fp8_e5m2" else fp8_e4m3_dtype
    if storage not in FP8_DTYPES:
        raise UnknownFormat(f"fp8_e4m3_dtype: {storage!r} is not an fp8 dtype")
    return storage, k_scale, v_scale


def required_layout(*, backend_name: str | None, env: Mapping[str, str]) -> str | None:
    """What get_required_kvcache_layout returns: LHBNC for shuffled AITER pages, else no preference."""
    if env_flag(env, SHUFFLE_ENV) and (backend_name in (None, AITER_FA)):
        return "LHBNC"
    return None
