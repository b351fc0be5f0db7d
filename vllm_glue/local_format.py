"""The decoder's own page format, from what vLLM resolved (pure: backend name, layout, env, one layer's
tensor).

The sidecar never guesses a format; the shim states it, because vLLM publishes none (page-formats.md, "Why the
format must be declared").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sidecar.wire.formats import AITER_SHUFFLED, STANDARD, PageFormat

SHUFFLE_ENV = "VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT"
CPU_ATTN_KIND = "cpu_attn"
AITER_FA = "ROCM_AITER_FA"
# Backends whose default spec stores K then V per (head, token): the standard page.
STANDARD_BACKENDS = frozenset(
    {"FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "ROCM_AITER_UNIFIED_ATTN", "ROCM_ATTN", "ROCM_AITER_FA"}
)


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
) -> PageFormat:
    """Describe one decoder page. ``layer_shape`` is one layer's view ``[B, H_slots, N, C]`` as vLLM allocated
    it.

    ``num_kv_heads`` is per rank. The block size is the kernel block size: the view's token axis.
    """
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
    )


def required_layout(*, backend_name: str | None, env: Mapping[str, str]) -> str | None:
    """What get_required_kvcache_layout returns: LHBNC for shuffled AITER pages, else no preference."""
    if env_flag(env, SHUFFLE_ENV) and (backend_name in (None, AITER_FA)):
        return "LHBNC"
    return None
