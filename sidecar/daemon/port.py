"""``TransferPort``: every call the daemon makes on the prefill side (side channel and NIXL), in one place.

The daemon's parts talk to prefills only through this contract. ``sidecar.nixl.port.NixlPort`` is the real
one (vLLM's side channel + a NIXL agent); ``sidecar.standins.fake_transfer.FakePort`` is an in-process fake
that can be told to be slow, fail a READ, lose a peer or complete out of order, so the daemon's logic can be
unit-tested without processes. All methods except ``connect`` are synchronous. ``read`` (posting: long on
a NIXL agent, ~5-8 µs per descriptor), ``release``/``abort`` of reads, ``remove_peer`` and the transport half
of ``connect`` (its ``run``) run on the daemon's poster thread (``reads.py``), so the loop never waits for a
post to end; the rest on its event loop. The port serialises the two threads itself; the loop asks
``hold(blocking=False)`` before work it may skip while the poster is inside the transport.

What the daemon reads off the objects the port returns:

- a peer (``connect``, one prefill rank; ``blocks``/``read``/``notify`` take a ``PeerSet`` of them): ``plan``
  (``sidecar.wire.formats.Plan``: ``.convert``, ``.remote``), ``generation``
  (settable: a handshake started by a heartbeat learns it from the first Pull), ``address``, and ``unloaded``
  when it has one (True once a later ``connect`` replaced it: a restarted prefill at the same address);
- a read (``read``): ``finished``, ``done_at``, ``nbytes``, ``handles`` (truthy while some are held),
  ``layer_ranges``, the ``(first, last)`` layer ranges it posted, and ``landed``, a list of those seen DONE
  that the daemon pops to convert them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import msgspec
import numpy as np

from sidecar.nixl.admission import RemoteFormatRule
from sidecar.nixl.geometry import BlockPairs, LocalRegions, StagingPool
from sidecar.wire.formats import PageFormat

ReadMode = Literal["direct", "staged", "plain", "mapped"]
# ``run(fn, *args)``: ``fn(*args)`` run elsewhere (the daemon's poster thread), awaited for its result
Runner = Callable[..., Awaitable[Any]]


class PeerTarget(msgspec.Struct, frozen=True):
    """One prefill rank to handshake with, as a Pull or a Heartbeat names it."""

    engine_id: str
    tp_rank: int  # the prefill rank
    host: str
    port: int
    generation: int = 0
    remote_tp: int = 1  # the prefill's TP size
    local_tp: int = 1  # the decoder's TP size and the rank this daemon serves
    local_rank: int = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, eq=False)
class PeerSet:
    """The admitted prefill ranks one request reads: one, or several when the prefill's TP is larger. They
    share one plan (the decoder's head count); each owes its own notification."""

    peers: tuple[Any, ...]

    @property
    def plan(self) -> Any:
        return self.peers[0].plan


class Admission(msgspec.Struct, frozen=True):
    """What a prefill rank is checked against at handshake (the decoder's caches and the operator's rules)."""

    local_format: PageFormat
    layers: int
    compat_factors: dict[str, Any]
    rules: tuple[RemoteFormatRule, ...]
    conversion_enabled: bool = True
    allow_lossy_fp8: bool = False  # the rule's fp8_lossy_reencode
    check_identity: bool = True
    timeout_s: float = 5.0


class TransferPort(Protocol):
    """The prefill side, as the daemon uses it. Errors are ``sidecar.nixl.errors.TransferError`` subclasses
    (``connect`` may also raise ``sidecar.wire.prefill.HandshakeRefused`` / ``HandshakeTimeout``)."""

    local_mem_type: str  # "DRAM" (the CPU twin) or "VRAM"

    # -- local memory (at registration and start-up)
    def register(self, ranges: Sequence[tuple[int, int, int]], mem_type: str) -> Any: ...
    def deregister(self, registration: Any) -> None: ...
    def destination(self, registration: Any, regions: LocalRegions) -> Any: ...
    def staging(self, registration: Any, pool: StagingPool) -> StagingPool: ...

    # -- prefills
    async def connect(self, target: PeerTarget, admission: Admission, run: Runner | None = None) -> Any:
        """Handshake with one prefill rank, admit it (format, identity, geometry) and load it. ``run(fn,
        *args)`` runs the transport calls (loading the prefill's agent) and is awaited for their result: the
        daemon's poster thread (``Reads.on_poster``); None: here."""
        ...

    def remove_peer(self, peer: Any) -> None:
        """Let a peer go (its mapping, prepared lists, and its agent once no other peer uses it); the
        daemon calls it once no pull reads through the peer. A second call is a no-op."""
        ...

    def let_go_notify_only(self, idle_s: float) -> int:
        """Let go what was loaded only to notify refused prefills (``connect``'s refusals) and not used for
        ``idle_s`` (the lease and a margin: their blocks are freed by then), unless a peer uses it; how many.
        Runs on the poster thread."""
        ...

    def map_pages(self, peer: Any, dtype: Any, fence: Callable[[], Any] | None = None) -> Any:
        """One prefill rank's pages mapped into this process (the mapped read mode): ``[layers,
        blocks, page]`` of ``dtype``, row ``b`` its kernel block ``b``. Mapped once per peer and
        unmapped when the peer is removed; ``MappingUnavailable`` says why not (remembered: asked
        again, raised again at once). Runs on the poster thread (its CUDA context). ``fence``:
        records and returns an event after every kernel queued so far that may read the pages (the
        conversion stream's), which unmapping waits for (None: the whole device)."""
        ...

    def unmap_pages(self, peer: Any) -> None:
        """Let ``map_pages``' mapping of ``peer`` go (after this process's kernels have finished); the next
        ``map_pages`` maps again. Runs on the poster thread."""
        ...

    # -- one request's reads
    def blocks(
        self,
        peer: Any,
        dest: Any,
        mode: ReadMode,
        local_ids: Sequence[int],
        remote_ids: Sequence[int],
        remote_num_tokens: int | None,
    ) -> BlockPairs:
        """The checked kernel block pairs a read of these ids moves (padding trimmed): the local ids it writes
        (what gets converted) and the remote ids each reads, in request order. Made once per request on the
        loop and handed to ``read`` (``pairs``), which does not pair the ids again."""
        ...

    def read(
        self,
        peer: Any,
        dest: Any,
        mode: ReadMode,
        local_ids: Sequence[int],
        remote_ids: Sequence[int],
        remote_request_id: str,
        *,
        layer_groups: int,
        timeout_s: float,
        remote_num_tokens: int | None,
        pool: StagingPool | None = None,
        slots: np.ndarray | None = None,
        gaps: Any = None,
        pairs: BlockPairs | None = None,
    ) -> Any:
        """Post the request's READs (one per layer group); the prefill is notified once all are DONE.
        ``gaps``: staged only, a ``spans.GapRead`` (or ``SpanGaps``) of blocks read into staging just to
        merge runs.
        ``pairs``: ``blocks``'s answer for these ids (else they are paired here); one checked under another
        pairing rule (ratios, block size) or out of this read's block counts is refused naming the field."""
        ...

    def poll(self, read: Any, now: float, *, notify: bool = True) -> bool:
        """True once every READ is DONE and (unless ``notify`` is False) the notification sent; raises on
        failure or deadline."""
        ...

    def notify_read(self, read: Any) -> None:
        """Send a finished read's notification, if ``poll(notify=False)`` left it unsent."""
        ...

    def abort(self, read: Any) -> bool:
        """Cancel a read and notify the prefill; True when nothing can still write into local memory."""
        ...

    def release(self, read: Any) -> bool:
        """Release a finished read's handles (after the answer went out); True when none is left."""
        ...

    def notify(self, peer: Any, remote_request_id: str) -> None:
        """Tell the prefill to free a request's blocks without reading them."""
        ...

    def heartbeat(self, peer: Any, remote_request_ids: Sequence[str]) -> None: ...
    def progress(self) -> None:
        """Let the transport move queued messages (when no progress thread does)."""
        ...

    def hold(self, blocking: bool = True) -> AbstractContextManager[bool]:
        """A context holding the transport (True); with ``blocking=False`` False at once if another thread
        is inside it (the poster thread posting)."""
        ...

    def thread_init(self) -> None:
        """Prepare the calling thread (the poster thread) for transport calls, e.g. its CUDA context."""
        ...

    def close(self) -> None: ...
