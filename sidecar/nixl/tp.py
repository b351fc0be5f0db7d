"""Heterogeneous TP between a prefill and a decoder: which prefill ranks a decoder rank reads, where its heads
sit in their pages, and what each prefill rank expects back. Pure; no I/O.

The rules are vLLM 0.33's NixlConnector (non-MLA, no DCP), read in
``distributed/kv_transfer/kv_connector/utils.py`` (``TransferTopology.tp_ratio``, ``dcp_consumer_count``)
and ``v1/nixl/tp_mapping.py`` (``compute_tp_mapping``, ``compute_head_offset``), ``base_worker.py``
(remote descriptors: ``base + rank_offset_factor * local_block_len``, length ``local_block_len / reads``),
``pull_worker.py`` (notification ``"<remote_request_id>:<local_consumers>"`` to each rank read) and
``base_worker._send_heartbeats`` (``"HB:id1,id2"`` to every remote rank handshaken).

Pages are LBHNC ``[H, N, 2D]``, so a run of heads is one contiguous byte range of a page:
- decoder TP = r x prefill TP: decoder rank t reads prefill rank t // r, bytes [o*L, (o+1)*L) of each remote
  page (L = the decoder's page bytes, o = t % r), and every prefill rank expects r notifications "id:r".
- prefill TP = r x decoder TP: decoder rank t reads prefill ranks t*r .. t*r+r-1 (the GQA de-duplication of
  vLLM only drops ranks when total KV heads < prefill TP, which we refuse), each whole remote page into bytes
  [i*L/r, (i+1)*L/r) of its own page; every prefill rank expects 1 notification "id:1".
"""

from __future__ import annotations

import msgspec

from sidecar.wire.formats import HEAD_MAJOR_KINDS, PageFormat, Refusal


class SourceSlice(msgspec.Struct, frozen=True):
    """One read per block: bytes [remote_offset, +length) of the prefill rank's page go to
    [local_offset, +length) of the decoder's page."""

    remote_rank: int
    remote_offset: int
    local_offset: int
    length: int


class TPPlan(msgspec.Struct, frozen=True):
    """What one decoder rank does against one prefill engine."""

    sources: tuple[SourceSlice, ...]
    notif_count: int  # the n of "id:n": decoder ranks reading each prefill rank (the prefill frees at n)
    heartbeat_ranks: tuple[int, ...]  # vLLM heartbeats every remote rank it has handshaken: these


def tp_plan(*, local_tp: int, local_rank: int, remote_tp: int, total_kv_heads: int, local_page_bytes: int,
            remote_page_bytes: int) -> TPPlan | Refusal:
    """Decide how decoder rank ``local_rank`` of ``local_tp`` reads a prefill at ``remote_tp``; refuse naming
    the field when the heads or page sizes do not divide."""
    for name, v in (("local_tp", local_tp), ("remote_tp", remote_tp), ("total_kv_heads", total_kv_heads)):
        if v <= 0:
            return Refusal(name, f"{name} must be positive, got {v}")
    if not 0 <= local_rank < local_tp:
        return Refusal("local_rank", f"rank {local_rank} is outside TP {local_tp}")
    for name, tp in (("local_tp", local_tp), ("remote_tp", remote_tp)):
        if total_kv_heads % tp:
            return Refusal(name, f"{total_kv_heads} KV heads do not split evenly over TP {tp} (replicated KV "
                                 "heads are not supported)")
    h_local, h_remote = total_kv_heads // local_tp, total_kv_heads // remote_tp
    if local_page_bytes % h_local or remote_page_bytes % h_remote:
        return Refusal("page_bytes", "a page must hold whole heads")
    if local_page_bytes // h_local != remote_page_bytes // h_remote:
        return Refusal("page_bytes", f"bytes per head differ: local {local_page_bytes // h_local}, remote "
                                     f"{remote_page_bytes // h_remote} (block size, head size or dtype; or "
                                     "KV heads replicated over the prefill's ranks, not supported)")
    if local_tp >= remote_tp:
        if local_tp % remote_tp:
            return Refusal("local_tp", f"decoder TP {local_tp} is not a multiple of prefill TP {remote_tp}")
        r = local_tp // remote_tp
        src = SourceSlice(local_rank // r, (local_rank % r) * local_page_bytes, 0, local_page_bytes)
        return TPPlan(sources=(src,), notif_count=r, heartbeat_ranks=(local_rank // r,))
    if remote_tp % local_tp:
        return Refusal("remote_tp", f"prefill TP {remote_tp} is not a multiple of decoder TP {local_tp}")
    r = remote_tp // local_tp
    sources = tuple(SourceSlice(local_rank * r + i, 0, i * remote_page_bytes, remote_page_bytes)
                    for i in range(r))
    return TPPlan(sources=sources, notif_count=1, heartbeat_ranks=tuple(s.remote_rank for s in sources))


def read_ranks(*, local_tp: int, local_rank: int, remote_tp: int) -> tuple[int, ...] | Refusal:
    """The prefill ranks decoder rank ``local_rank`` reads (and heartbeats), from the TP sizes alone: what the
    daemon must handshake before it knows the page formats. ``tp_plan`` agrees once it does."""
    if local_tp <= 0 or remote_tp <= 0 or not 0 <= local_rank < local_tp:
        return Refusal("remote_tp_size", f"rank {local_rank} of TP {local_tp} against prefill TP {remote_tp}")
    if local_tp >= remote_tp:
        if local_tp % remote_tp:
            return Refusal("remote_tp_size",
                           f"decoder TP {local_tp} is not a multiple of prefill TP {remote_tp}")
        return (local_rank // (local_tp // remote_tp),)
    if remote_tp % local_tp:
        return Refusal("remote_tp_size", f"prefill TP {remote_tp} is not a multiple of decoder TP {local_tp}")
    r = remote_tp // local_tp
    return tuple(range(local_rank * r, local_rank * r + r))


def notif_count(*, local_tp: int, remote_tp: int) -> int:
    """The n of ``"id:n"`` vLLM sends each prefill rank: decoder ranks reading it (1 when the prefill's TP is
    at least the decoder's). Also what a refused pairing's notification carries."""
    if remote_tp > 0 and local_tp > remote_tp and local_tp % remote_tp == 0:
        return local_tp // remote_tp
    return 1


class RankRead(msgspec.Struct, frozen=True):
    """One prefill rank as one decoder rank reads it: the heads it takes, seen as a page of the decoder's
    head count (``view``: what negotiation and conversion see), and the notification count it owes."""

    view: PageFormat
    source: SourceSlice
    notif_count: int


def rank_read(remote: PageFormat, local: PageFormat, *, local_tp: int, local_rank: int, remote_tp: int,
              remote_rank: int) -> RankRead | Refusal:
    """How decoder rank ``local_rank`` reads prefill rank ``remote_rank`` whose pages are ``remote``; refuse
    naming the field when heads do not divide or the pages cannot be sliced by heads."""
    if remote.kind not in HEAD_MAJOR_KINDS:  # where the heads lie in other kinds' pages is not guessed
        return Refusal("remote.kind", f"only {sorted(HEAD_MAJOR_KINDS)} pages can be sliced by heads, not "
                                      f"{remote.kind!r}")
    if remote.layout != "LBHNC":
        return Refusal("remote.layout", f"only LBHNC pages hold a run of heads as one byte range, not "
                                        f"{remote.layout}")
    plan = tp_plan(local_tp=local_tp, local_rank=local_rank, remote_tp=remote_tp,
                   total_kv_heads=remote.num_heads * remote_tp, local_page_bytes=local.page_bytes,
                   remote_page_bytes=remote.page_bytes)
    if isinstance(plan, Refusal):
        return plan
    src = next((s for s in plan.sources if s.remote_rank == remote_rank), None)
    if src is None:
        return Refusal("remote_rank", f"decoder rank {local_rank} of TP {local_tp} reads prefill ranks "
                                      f"{[s.remote_rank for s in plan.sources]}, not {remote_rank}")
    view = msgspec.structs.replace(remote, num_heads=remote.num_heads * remote_tp // local_tp)
    return RankRead(view=view, source=src, notif_count=plan.notif_count)
