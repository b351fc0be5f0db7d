"""The shim's settings: ``kv_connector_extra_config``, checked once when vLLM builds the connector.

A bad value stops vLLM at start-up with one line naming the key, instead of failing every load later (a
non-positive pull timeout) or handing blocks back while the daemon may still write them (a grace shorter than
the daemon's give-up). Keys the shim does not know are left to vLLM and other connectors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from vllm_glue.scheduler_book import DEFAULT_LEASE_S
from vllm_glue.worker import DEFAULT_GRACE_S, DEFAULT_SOCKET

# The daemon keeps trying to stop a pull's transfers this long after its deadline before it answers unsafe
# (sidecar/daemon/reads.py RELEASE_GIVE_UP_S): the shim must hold the blocks at least as long.
MIN_GRACE_S = 4.0
MAX_SECONDS = 24 * 3600.0

Seconds = Annotated[float, msgspec.Meta(gt=0, le=MAX_SECONDS)]


class ShimSettings(msgspec.Struct, frozen=True):
    """The ``kv_connector_extra_config`` keys the shim reads (others are ignored)."""

    sidecar_socket: str = DEFAULT_SOCKET  # ``{rank}``: the worker's TP rank, ``{gpu}``: its physical GPU
    sidecar_pull_timeout_s: Seconds = 60.0
    sidecar_register_timeout_s: Seconds = 30.0
    sidecar_grace_s: Annotated[float, msgspec.Meta(ge=MIN_GRACE_S, le=MAX_SECONDS)] = DEFAULT_GRACE_S
    # vLLM's own key, which it reads raw (``lease // 6``): a fractional lease is one it runs with
    kv_lease_duration: Annotated[float, msgspec.Meta(ge=1, le=24 * 3600)] = DEFAULT_LEASE_S

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ShimSettings:
        """The settings in ``extra``; ValueError naming the key when one cannot be used."""
        try:
            return msgspec.convert(dict(extra or {}), cls, strict=False)
        except msgspec.ValidationError as exc:
            raise ValueError(f"kv_connector_extra_config: {exc}") from None
