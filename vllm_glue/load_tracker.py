"""The worker half's load bookkeeping (pure logic): outstanding pulls → vLLM's finished/failed/bad-block sets.

Rules (vLLM 0.32/0.33 ``get_transfer_results`` + ``get_block_ids_with_load_errors``):

* an awaited load is reported exactly once in ``finished_recving``: after its Done, or after the daemon
  confirmed an abort (Aborted safe), or when it failed (then also in ``failed_recving``, and its blocks in the
  load-error set of the same step, so ``kv_load_failure_policy`` applies);
* vLLM frees an aborted request's blocks on that one report; reporting it twice would free them twice;
* a load whose daemon vanished, or that got no answer by its deadline plus a grace, fails: nothing hangs;
* a load is tied to the connection (``epoch``) it was sent on: a lost connection touches only its own loads,
  and a reply from another connection is not theirs;
* a load whose connection dropped is *orphaned*, not failed: the daemon may still be writing into its blocks,
  so vLLM gets them back only once nothing can write — the daemon process is gone (:meth:`gone`), a later
  connection confirmed the abort (Aborted safe or Done), or the deadline plus the grace passed (the daemon
  ends every pull by its deadline);
* a load answered with ``Done(safe=False)`` (a transfer into its blocks could not be stopped) is held the
  same way: its blocks go back only once that daemon is gone or the deadline plus the grace has passed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# How many LoadOutcomes a tracker keeps (the latest): vLLM never reads them, and a long-running engine must
# not keep one for every load it served. The stand-ins read and clear them each poll, far below this.
OUTCOMES_KEPT = 4096


@dataclass
class _Load:
    local_block_ids: list[int]
    awaiting: bool
    deadline: float
    abort_requested: bool = False
    epoch: int | None = None  # the client connection it was sent on; None: not sent (yet)
    orphaned: str | None = None  # why its connection dropped; the blocks stay held until it is safe
    abort_sent_on: int | None = None  # the epoch its last Abort went out on


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
        self.outcomes: deque[LoadOutcome] = deque(maxlen=OUTCOMES_KEPT)  # the latest, for logs and tests

    def outstanding(self) -> frozenset[str]:
        return frozenset(self._loads)

    def is_outstanding(self, req_id: str) -> bool:
        return req_id in self._loads

    def started(
        self,
        req_id: str,
        local_block_ids: list[int],
        awaiting: bool,
        deadline: float,
        epoch: int | None = None,
    ) -> None:
        if req_id in self._loads:
            raise ValueError(f"request {req_id!r} already has a load in flight")
        self._loads[req_id] = _Load(list(local_block_ids), awaiting, deadline, epoch=epoch)

    def sent(self, req_id: str, epoch: int) -> None:
        """The load's Pull went to the daemon on connection ``epoch``."""
        load = self._loads.get(req_id)
        if load is not None:
            load.epoch = epoch

    def abort_requested(self, req_id: str) -> bool:
        """Mark an abort; True if the daemon must be told (a load is still outstanding on a live connection).

        An orphan is not told here: its abort goes out once a connection is back (:meth:`aborts_owed`), as
        does one whose Abort could not be sent now.
        """
        load = self._loads.get(req_id)
        if load is None or load.abort_requested:
            return False
        load.abort_requested = True
        return load.orphaned is None

    def epoch_of(self, req_id: str) -> int | None:
        load = self._loads.get(req_id)
        return None if load is None else load.epoch

    def release_unsent(self, req_id: str, reason: str, received_at: float = 0.0) -> bool:
        """An aborted load whose Pull never reached a daemon: nothing can write, release it now."""
        load = self._loads.get(req_id)
        if load is None or load.epoch is not None:
            return False
        return self.fail(req_id, reason, received_at)

    def done(
        self,
        req_id: str,
        ok: bool,
        reason: str | None = None,
        timings: dict[str, float] | None = None,
        received_at: float = 0.0,
        epoch: int | None = None,
        safe: bool = True,
    ) -> bool:
        """A Done arrived (on connection ``epoch``). False if the request was not outstanding (late or
        duplicate) or the Done came over another connection than its Pull: ignored.

        An orphan's Done from a later connection ends it too (the daemon is quiet on it), but never as ok:
        the shim already gave up on the load. An unsafe Done makes the load an orphan: held, not reported.
        """
        load = self._loads.get(req_id)
        if load is None or not self._from_its_daemon(load, epoch):
            return False
        if not safe:
            load.orphaned = f"kv-sidecar could not stop a transfer into its blocks ({reason})"
            return True
        del self._loads[req_id]
        if load.orphaned is not None:
            ok, reason = False, f"{load.orphaned} (then {reason or 'completed'})"
        self.outcomes.append(LoadOutcome(req_id, ok, reason, dict(timings or {}), received_at))
        # An aborted request is already finished in vLLM: it only needs its blocks back, never a failure.
        self._report(req_id, load, failed=not ok and not load.abort_requested)
        return True

    def aborted(
        self,
        req_id: str,
        safe: bool,
        reason: str | None = None,
        received_at: float = 0.0,
        epoch: int | None = None,
    ) -> bool:
        """An Aborted arrived. Only a safe one releases the blocks; an unsafe one keeps waiting for Done."""
        load = self._loads.get(req_id)
        if load is None or not safe or not self._from_its_daemon(load, epoch):
            return False
        del self._loads[req_id]
        if load.orphaned is not None:
            reason = f"{load.orphaned} (then aborted: {reason or 'safe'})"
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
        """Fail every load (only when nothing can write any more, e.g. the shim shuts down its caches)."""
        ids = list(self._loads)
        for req_id in ids:
            self.fail(req_id, reason, received_at)
        return ids

    def lost(self, epoch: int, reason: str) -> list[str]:
        """Connection ``epoch`` dropped: its loads become orphans (held, not reported). Loads sent on another
        connection, or not sent yet, are untouched."""
        ids = [r for r, load in self._loads.items() if load.epoch == epoch and load.orphaned is None]
        for req_id in ids:
            self._loads[req_id].orphaned = reason
        return ids

    def gone(self, epochs: frozenset[int] | set[int], reason: str, received_at: float = 0.0) -> list[str]:
        """The daemon process that served these connections has exited: nothing can write into their loads'
        blocks any more; fail them now."""
        ids = [r for r, load in self._loads.items() if load.epoch in epochs]
        for req_id in ids:
            load = self._loads[req_id]
            self.fail(req_id, f"{load.orphaned}; {reason}" if load.orphaned else reason, received_at)
        return ids

    def aborts_owed(self, epoch: int) -> list[str]:
        """Loads whose Abort must go out on connection ``epoch`` and has not yet (:meth:`abort_sent`): every
        orphan of an earlier connection, and an aborted load of this one whose Abort could not be sent."""
        return [r for r, load in self._loads.items() if _owes_abort(load, epoch)]

    def abort_sent(self, req_id: str, epoch: int) -> None:
        """The load's Abort went out on connection ``epoch``."""
        load = self._loads.get(req_id)
        if load is not None:
            load.abort_sent_on = epoch

    def orphans(self) -> frozenset[str]:
        return frozenset(r for r, load in self._loads.items() if load.orphaned is not None)

    @staticmethod
    def _from_its_daemon(load: _Load, epoch: int | None) -> bool:
        """A reply on connection ``epoch`` may end ``load``: its own connection, or for an orphan a later one
        (the Abort sent there). None: the caller does not track connections."""
        if epoch is None or load.epoch is None:
            return True
        return epoch == load.epoch or (load.orphaned is not None and epoch > load.epoch)

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


def _owes_abort(load: _Load, epoch: int) -> bool:
    """Whether ``load`` needs an Abort on connection ``epoch`` that has not gone out there yet."""
    if load.abort_sent_on == epoch or load.epoch is None:
        return False
    if load.orphaned is not None:
        return load.epoch < epoch  # an unsafe Done's orphan was answered on its own connection already
    # one of an earlier connection waits for that connection's Lost: then it is an orphan
    return load.abort_requested and load.epoch == epoch
