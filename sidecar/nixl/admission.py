"""Admitting a prefill rank at handshake (pure): its declared page format, model identity and geometry.

Every check runs in order and the first failure is refused by field name; nothing here does I/O.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from sidecar.nixl.errors import RemoteRefused
from sidecar.nixl.geometry import GeometryError, RemoteRegions, check_remote
from sidecar.wire import prefill as vllm_wire
from sidecar.wire.formats import PageFormat, Plan, Refusal, negotiate

# -- configuration ---------------------------------------------------------------------------------


class RemoteFormatRule(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The operator's declaration: prefills whose side channel matches ``address`` (``host:port``, fnmatch
    wildcards, e.g. ``"10.0.0.*:5600"`` or ``"*:*"``) publish pages in ``format``."""

    address: str
    format: PageFormat

    def __post_init__(self) -> None:
        if self.address.count(":") < 1:
            raise ValueError(f"address pattern {self.address!r} must be host:port (wildcards allowed)")


class AdmissionRules(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The operator's rules a prefill rank is admitted by: declared formats, conversion, lossy fp8."""

    remote_formats: tuple[RemoteFormatRule, ...] = ()
    conversion_enabled: bool = True
    # The matching [[remotes]] rule's fp8_lossy_reencode: accept e4m3fn -> e4m3fnuz re-encodes that can lose
    # values.
    allow_lossy_fp8: bool = False


# -- admission (pure) ------------------------------------------------------------------------------


def resolve_remote_format(address: str, rules: Sequence[RemoteFormatRule], tag: Any = None) -> PageFormat:
    """The remote page format: its own tag when a (future) vLLM publishes one, else the first declaration
    whose pattern matches ``host:port``; with neither, refuse — the format is never guessed."""
    if tag is not None:
        try:
            return msgspec.convert(tag, PageFormat)
        except (msgspec.ValidationError, ValueError) as exc:
            raise RemoteRefused(
                f"the published page-format tag is invalid: {exc}", "remote page format"
            ) from exc
    for rule in rules:
        if fnmatch.fnmatchcase(address, rule.address):
            return rule.format
    raise RemoteRefused(
        f"prefill {address} publishes no page-format tag and no declaration in the config "
        f"matches it (remote_formats: {[r.address for r in rules]})",
        "remote page format",
    )


def check_model_identity(
    remote_hash: str, remote_backend: str, local_factors: Mapping[str, Any] | None
) -> None:
    """Refuse a remote serving another model: its compatibility hash must equal the decoder's own, recomputed
    with the remote's attention backend name (the only factor allowed to differ)."""
    if local_factors is None:
        raise RemoteRefused(
            "no local model identity (hash factors) to check the remote against", "compatibility_hash"
        )
    try:
        vllm_wire.check_model_identity(remote_hash, local_factors, remote_backend)
    except vllm_wire.WireError as exc:
        raise RemoteRefused(exc.reason, exc.field) from exc


# Metadata fields whose non-default values mean a feature out of scope (MLA packing, PP/HMA members, DCP).
_OUT_OF_SCOPE = {
    "dcp_size": 1,
    "pcp_size": 1,
}


def admit_remote(
    meta: Any,
    *,
    address: str,
    local_format: PageFormat,
    layers: int,
    rules: AdmissionRules,
    remote_mem_type: str = "VRAM",
    remote_hash: str | None = None,
    local_factors: Mapping[str, Any] | None = None,
    check_identity: bool = True,
    expected_engine_id: str | None = None,
    view: PageFormat | None = None,
) -> tuple[Plan, RemoteRegions]:
    """Every handshake-time check of one prefill rank, in order; the first failure refused by field name.

    ``view`` (heterogeneous TP): the format this decoder rank negotiates against instead of the declared one
    (its head slice of the prefill rank's pages, see ``tp.rank_read``); the published geometry is still
    checked against the declared format. ``remote_mem_type`` (a fact of this host, not a rule): the memory
    type of remote regions when the metadata lists no ``region_mem_types``."""
    if expected_engine_id is not None and meta.engine_id != expected_engine_id:
        raise RemoteRefused(
            f"metadata is for engine {meta.engine_id!r}, the request names {expected_engine_id!r}",
            "engine_id",
        )
    for name, want in _OUT_OF_SCOPE.items():
        got = getattr(meta, name, want)
        if got != want:
            raise RemoteRefused(f"{got} != {want}: out of scope", name)
    if tuple(getattr(meta, "ssm_sizes", (0, 0)) or (0, 0)) != (0, 0):
        raise RemoteRefused("Mamba/SSM state is out of scope", "ssm_sizes")
    if getattr(meta, "region_members", None):
        raise RemoteRefused("per-region layer members (push/PP/HMA) are out of scope", "region_members")
    if getattr(meta, "packed_member_layouts", None):
        raise RemoteRefused("packed MLA layouts are out of scope", "packed_member_layouts")
    remote_format = resolve_remote_format(
        address, rules.remote_formats, getattr(meta, "page_format", None)
    )
    if check_identity:
        if remote_hash is None:
            raise RemoteRefused("the handshake carried no compatibility hash", "compatibility_hash")
        check_model_identity(remote_hash, meta.attn_backend_name, local_factors)
    plan = negotiate(
        remote_format if view is None else view,
        local_format,
        conversion_enabled=rules.conversion_enabled,
        allow_lossy_fp8=rules.allow_lossy_fp8,
    )
    if isinstance(plan, Refusal):
        rule = None if getattr(meta, "page_format", None) is not None else _declaration(address, rules)
        if rule is not None and plan.field in _DECLARED_SHAPE:
            raise RemoteRefused(
                _blame_declaration(rule, plan, meta, remote_format, local_format, layers, remote_mem_type),
                plan.field,
            )
        raise RemoteRefused(plan.reason, plan.field)
    try:
        regions = RemoteRegions.from_metadata(meta, default_mem_type=remote_mem_type)
        check_remote(regions, remote_format, layers)
    except GeometryError as exc:
        raise RemoteRefused(exc.reason, exc.field) from exc
    return plan, regions


_DECLARED_SHAPE = ("dtype", "num_heads", "block_size", "head_size")


def _declaration(address: str, rules: AdmissionRules) -> RemoteFormatRule | None:
    return next((r for r in rules.remote_formats if fnmatch.fnmatchcase(address, r.address)), None)


def _blame_declaration(
    rule: RemoteFormatRule,
    refusal: Refusal,
    meta: Any,
    declared: PageFormat,
    local: PageFormat,
    layers: int,
    remote_mem_type: str,
) -> str:
    """A refusal on a shape field of a *declared* format: vLLM publishes no tag, so the operator's
    [[remotes]] entry is the first suspect. Say so, and whether the prefill's registered pages even fit it."""
    name = refusal.field
    said = (
        f"the [[remotes]] declaration matching {rule.address!r} gives {name} {getattr(declared, name)!r}, "
        f"the decoder's is {getattr(local, name)!r}"
    )
    try:
        regions = RemoteRegions.from_metadata(meta, default_mem_type=remote_mem_type)
        check_remote(regions, declared, layers)
    except (GeometryError, ValueError, TypeError, AttributeError) as exc:
        return (
            f"{said}, and the prefill's registered pages do not fit the declaration either "
            f"({getattr(exc, 'reason', exc)}): fix the declaration's page_format"
        )
    return (
        f"{said}; the prefill's registered pages fit the declaration, so if it is right: "
        f"{refusal.reason.split('; ', 1)[-1]}"
    )
