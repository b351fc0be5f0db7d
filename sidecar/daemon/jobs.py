"""Jobs: one accepted Pull each, its explicit ``Stage``, and the table that admits, cancels and retires them.

``JobTable`` owns the in-flight set: the limit on pulls worked at once (``max_inflight``) and waiting
(``max_queued``), each job's deadline timer, and the single way a job is stopped early (``cancel``: a
deadline, an Abort, shutdown or a re-registration). It does not know what a job does; ``pipeline`` does.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sidecar.wire import protocol as p

# Reasons that start a Done(ok=False); the shim may match on the leading word.
OVERLOADED = "overloaded"
SHUTTING_DOWN = "shutting down"


class Stage(enum.Enum):
    """Where a job is. The value is the name its time is reported under (``Done.timings``, metrics)."""

    QUEUE = "queue"  # waiting for an in-flight slot
    HANDSHAKE = "handshake"  # waiting for the prefill rank's handshake (cached after the first)
    TRANSFER = "transfer"  # staging slots, posting and reading; layer groups convert as they land
    CONVERT = "convert"  # what is left of the conversion once the last byte has landed
    DONE = "done"


class Outcome(enum.Enum):
    """How a job ended; the value is the ``outcome`` label of ``kv_sidecar_requests_total``."""

    OK = "ok"
    FAILED = "failed"
    REFUSED = "refused"
    ABORTED = "aborted"
    EXPIRED = "expired"


@dataclass
class Ending:
    """A job's outcome, why, and whether its blocks are safe (nothing can still write into them)."""

    outcome: Outcome
    reason: str | None = None
    field: str | None = None
    safe: bool = True


@dataclass(eq=False)
class Session:
    """One shim worker, known by its ROUTER identity."""

    identity: bytes
    hello: p.Hello | None = None
    last_seen: float = 0.0  # when it last sent a message (monotonic): the router forgets the longest idle

    @property
    def rank(self) -> int:
        return self.hello.worker_rank if self.hello else 0

    @property
    def tp_size(self) -> int:
        return self.hello.tp_size if self.hello else 1

    @property
    def shim(self) -> tuple[int, str, int] | None:
        """Who is behind the connection: (pid, engine id, rank) from its Hello; None before or without pid."""
        h = self.hello
        return (h.pid, h.engine_id, h.worker_rank) if h is not None and h.pid else None

    def same_shim(self, other: Session) -> bool:
        """This connection, or a new connection of the same shim process after a reconnect."""
        return self is other or (self.shim is not None and self.shim == other.shim)


@dataclass(eq=False)
class Job:
    """One accepted Pull. Each part keeps what it holds for the job in its own field."""

    msg: p.Pull
    envelope: list[bytes]
    session: Session
    received: float
    deadline: float
    timeout_s: float
    stage: Stage = Stage.QUEUE
    stage_started: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    task: asyncio.Task | None = None
    stop: Ending | None = None  # why it was cancelled (deadline, abort, shutdown), once it was
    abort_envelope: list[bytes] | None = None  # an Abort arrived: answer it with Aborted, not Done
    settled: bool = False  # the pipeline ended; only quiescing and the answer remain (no more cancels)
    running: bool = False  # holds one of the max_inflight slots
    caches: Any = None  # the Caches it reads into (counted in caches.users while held)
    # the generation of the caches its Pull was accepted for (0: none were registered): it reads into those
    # only, never into caches registered after it arrived (other buffers, maybe another shim's)
    registration: int = 0
    peer: Any = None  # port.PeerSet: the admitted prefill ranks it reads, once every handshake is through
    peer_entries: list[Any] = field(default_factory=list)  # peers.PeerEntry per rank: handshakes it holds
    read: Any = None  # the port's read handle once posted
    first_landed: float | None = None  # when a poll pass first saw one of its read's layer groups landed
    pairs: Any = None  # geometry.BlockPairs: the checked kernel blocks read (local: what gets converted)
    slots: tuple[int, int] | None = None  # staging: (first slot, count)
    gap_bytes: int = 0  # staging: bytes of gap blocks read only to merge descriptors (not the request's)
    mapped_bytes: int = 0  # mapped: bytes the conversion read through the mapping (it has no read)
    conversion: Any = None  # conversion.JobConversion

    @property
    def req_id(self) -> str:
        return self.msg.req_id

    def enter(self, stage: Stage, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self.stage_started and self.stage.value not in self.timings:
            self.timings[self.stage.value] = now - self.stage_started
        self.stage, self.stage_started = stage, now

    @functools.cached_property
    def id_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The Pull's (local, remote) block ids as int64 arrays, unpacked once for pairing, staging and the
        post (``geometry`` checks their dtype and shape)."""
        arrays = p.unpack_block_ids(self.msg.local_block_ids), p.unpack_block_ids(self.msg.remote_block_ids)
        for a in arrays:
            a.flags.writeable = False  # shared by the loop and the poster thread: nobody writes into them
        return arrays

    @property
    def cancellable(self) -> bool:
        return self.stop is None and not self.settled and self.task is not None and not self.task.done()


class JobTable:
    """The jobs in flight (queued or running), their limits and deadlines."""

    def __init__(self, max_inflight: int, max_queued: int) -> None:
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self._jobs: dict[str, Job] = {}
        self._running = asyncio.Semaphore(max_inflight)

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._jobs

    def get(self, req_id: str) -> Job | None:
        return self._jobs.get(req_id)

    def jobs(self) -> list[Job]:
        return list(self._jobs.values())

    def is_current(self, job: Job) -> bool:
        return self._jobs.get(job.req_id) is job

    def full(self) -> str | None:
        """Why one more Pull cannot be accepted, or None."""
        if len(self._jobs) >= self.max_inflight + self.max_queued:
            return (
                f"{OVERLOADED}: {len(self._jobs)} pulls in flight or queued "
                f"(max_inflight {self.max_inflight} + max_queued {self.max_queued})"
            )
        return None

    @staticmethod
    def timeout_for(msg: p.Pull, default_s: float, max_s: float) -> float:
        """The Pull's own deadline, else the default, never beyond ``max_s`` (config ``max_timeout_s``, read
        per Pull: SIGHUP may change it)."""
        timeout = msg.timeout_s if msg.timeout_s is not None else default_s
        return min(timeout, max_s)

    @staticmethod
    def deadline_for(msg: p.Pull, received: float, timeout_s: float) -> float:
        """When the Pull's time runs out: ``timeout_s`` from the shim's send (``sent_at_ns``: one host, one
        monotonic clock) where the Pull carries it, never from later than its receipt. The shim gives the
        blocks back to vLLM once its own deadline (plus a grace) has passed, so a Pull that sat in the socket
        while the daemon was starved or stalled must end by then too."""
        sent = msg.sent_at_ns / 1e9 if msg.sent_at_ns else received
        return min(sent, received) + timeout_s

    def add(
        self,
        msg: p.Pull,
        envelope: list[bytes],
        session: Session,
        received: float,
        timeout_s: float,
        deadline: float,
        run: Callable[[Job], Any],
    ) -> Job:
        """Accept a Pull: start ``run(job)`` as its task and arm its ``deadline`` (``deadline_for``'s)."""
        job = Job(
            msg=msg,
            envelope=envelope,
            session=session,
            received=received,
            deadline=deadline,
            timeout_s=timeout_s,
            stage_started=received,
        )
        self._jobs[msg.req_id] = job
        loop = asyncio.get_running_loop()
        # Fire a little early, so the Done leaves before the deadline even after stopping the transfer.
        margin = min(0.02, 0.1 * timeout_s)
        delay = max(0.0, job.deadline - margin - time.monotonic())
        timer = loop.call_at(loop.time() + delay, self._expire, job)
        job.task = asyncio.ensure_future(run(job))
        job.task.add_done_callback(lambda _t: timer.cancel())
        return job

    def cancel(self, job: Job, ending: Ending) -> bool:
        """Stop a job early (it answers with ``ending`` once quiet); False if it is already ending."""
        if not job.cancellable:
            return False
        job.stop = ending
        assert job.task is not None
        job.task.cancel()
        return True

    def _expire(self, job: Job) -> None:
        self.cancel(
            job, Ending(Outcome.EXPIRED, f"deadline: {job.timeout_s:g} s passed during {job.stage.value}")
        )

    async def wait_turn(self, job: Job) -> None:
        """Wait until fewer than ``max_inflight`` jobs run (the queue stage)."""
        await self._running.acquire()
        job.running = True

    def retire(self, job: Job) -> bool:
        """Take a job out of the table and let the next queued one run; False if it was not in."""
        if self._jobs.get(job.req_id) is not job:
            return False
        del self._jobs[job.req_id]
        if job.running:
            self._running.release()
            job.running = False
        return True

    async def cancel_all(self, ending: Ending) -> None:
        """Cancel every job and wait until each has been answered."""
        jobs = self.jobs()
        for job in jobs:
            self.cancel(job, Ending(ending.outcome, ending.reason))
        tasks = [j.task for j in jobs if j.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        while any(self.is_current(j) for j in jobs):  # answered by a follow-up task (cancelled early)
            await asyncio.sleep(0.001)
