"""The worker half's load bookkeeping (pure logic): outstanding pulls → vLLM's finished/failed/bad-block sets.

Rules (vLLM 0.32/0.33 ``get_transfer_results`` + ``get_block_ids_with_load_errors``):

* an awaited load is reported exactly once in ``finished_recving``: after its Done, or after the daemon
  confirmed an abort (Aborted safe), or when it failed (then also in ``failed_recving``, and its blocks in the
  load-error set of the same step, so ``kv_load_failure_policy`` applies);
* vLLM frees an aborted request's blocks on that one report; reporting it twice would free them twice;
* a load whose daemon vanished, or that got no answer by its deadline plus a grace, fails: nothing hangs.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Load:
    local_block_ids: list[int]
    awaiting: bool
    deadline: float
    abort_requested: bool = False


@dataclass
class TransferResults:
    finished: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)


@dataclass
class LoadOutcome:
    """How one load ended, for logs and tests."""

    req_id: str
    ok: bool
    reason: str | None
    timings: dict[str, float]
    received_at: float


class LoadTracker:
    """Not thread-safe: the engine thread drives it; the client's receiver thread only queues events."""

    def __init__(self, *, grace_s: float = 5.0) -> None:
        self.grace_s = grace_s
        self._loads: dict[str, _Load] = {}
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self._bad_blocks: set[int] = set()
        self.outcomes: list[LoadOutcome] = []

    def outstanding(self) -> frozenset[str]:
        return frozenset(self._loads)

    def is_outstanding(self, req_id: str) -> bool:
        return req_id in self._loads

    def started(self, req_id: str, local_block_ids: list[int], awaiting: bool, deadline: float) -> None:
        if req_id in self._loads:
            raise ValueError(f"request {req_id!r} already has a load in flight")
        self._loads[req_id] = _Load(list(local_block_ids), awaiting, deadline)

    def abort_requested(self, req_id: str) -> bool:
        """Mark an abort; True if the daemon must be told (a load is still outstanding)."""
        load = self._loads.get(req_id)
        if load is None or load.abort_requested:
            return False
        load.abort_requested = True
        return True

    def done(
        self,
        req_id: str,
        ok: bool,
        reason: str | None = None,
        timings: dict[str, float] | None = None,
        received_at: float = 0.0,
    ) -> bool:
        """A Done arrived. False if the request was not outstanding (late or duplicate: ignored)."""
        load = self._loads.pop(req_id, None)
        if load is None:
            return False
        self.outcomes.append(LoadOutcome(req_id, ok, reason, dict(timings or {}), received_at))
        # An aborted request is already finished in vLLM: it only needs its blocks back, never a failure.
        self._report(req_id, load, failed=not ok and not load.abort_requested)
        return True

    def aborted(self, req_id: str, safe: bool, reason: str | None = None, received_at: float = 0.0) -> bool:
        """An Aborted arrived. Only a safe one releases the blocks; an unsafe one keeps waiting for Done."""
        load = self._loads.get(req_id)
        if load is None or not safe:
            return False
        del self._loads[req_id]
        self.outcomes.append(LoadOutcome(req_id, False, reason or "aborted", {}, received_at))
        self._report(req_id, load, failed=not load.abort_requested)
        return True

    def fail(self, req_id: str, reason: str, received_at: float = 0.0) -> bool:
        """The load cannot complete (daemon unreachable, send refused, deadline passed)."""
        load = self._loads.pop(req_id, None)
        if load is None:
            return False
        self.outcomes.append(LoadOutcome(req_id, False, reason, {}, received_at))
        self._report(req_id, load, failed=not load.abort_requested)
        return True

    def fail_all(self, reason: str, received_at: float = 0.0) -> list[str]:
        ids = list(self._loads)
        for req_id in ids:
            self.fail(req_id, reason, received_at)
        return ids

    def expire(self, now: float) -> list[str]:
        """Fail loads whose deadline plus the grace has passed without any answer."""
        late = [r for r, load in self._loads.items() if now > load.deadline + self.grace_s]
        for req_id in late:
            self.fail(
                req_id, f"no answer from kv-sidecar within the deadline (+{self.grace_s:g} s grace)", now
            )
        return late

    def take_results(self) -> TransferResults:
        """This step's finished (failed ones included) and failed request ids; both cleared."""
        out = TransferResults(self._finished, self._failed)
        self._finished, self._failed = set(), set()
        return out

    def take_bad_blocks(self) -> set[int]:
        out, self._bad_blocks = self._bad_blocks, set()
        return out

    def _report(self, req_id: str, load: _Load, *, failed: bool) -> None:
        if not load.awaiting:
            return  # vLLM never waited for it (full local hit or cleanup)
        self._finished.add(req_id)
        if failed:
            self._failed.add(req_id)
            self._bad_blocks.update(load.local_block_ids)
