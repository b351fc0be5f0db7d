"""The daemon's logic in-process, on ``FakePort``: every stage aborted and expired, staging waits and
exhaustion, reloads, lost peers, failing and out-of-order reads. No process, no NIXL, no socket; the
caches are real shared memory and the conversion runs on them (the CPU twin's converter)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import sys
import threading
import time
import weakref
from typing import Any

import msgspec
import numpy as np
import pytest

from sidecar.daemon import conversion as conversion_mod
from sidecar.daemon import reads as reads_module
from sidecar.daemon.app import Daemon
from sidecar.daemon.peers import PEER_IDLE_S, Peers
from sidecar.nixl.peer_book import PeerBook
from sidecar.ops.config import Config
from sidecar.standins.fake_transfer import FakePort
from sidecar.wire import ipc
from sidecar.wire import protocol as p
from sidecar.wire.formats import PageFormat

H, N, D, B, LAYERS = 2, 16, 64, 8, 4
PLANE = N * H * D
FMT = PageFormat(
    kind="aiter_shuffled", layout="LHBNC", dtype="bfloat16", num_heads=H, block_size=N, head_size=D
)
PAGE_BYTES = 2 * PLANE * 2


class Harness:
    """A daemon on a FakePort, its replies collected instead of sent."""

    def __init__(self, **overrides) -> None:
        self.port = FakePort()
        values = {"socket": "ipc:///nonexistent/kvs.sock", "metrics_port": -1, **overrides}
        self.config = Config(**values)
        self.reloaded: Config | None = None
        self.daemon = Daemon(self.config, make_port=lambda _c: self.port, bind=False, reload=self._reload)
        self.sent: list[tuple[list[bytes], object]] = []
        self.daemon.router.send = lambda env, msg: self.sent.append((env, msg))
        self.shm = ipc.create_shm_buffer(LAYERS * 2 * B * PLANE * 2)

    def _reload(self) -> Config:
        assert self.reloaded is not None
        return self.reloaded

    async def start(self) -> None:
        await self.daemon.start()
        self.send(p.Hello(protocol_version=p.PROTOCOL_VERSION, package_version="test"))
        self.send(self.register_message())
        assert isinstance(await self.reply(p.Registered), p.Registered)

    def register_message(self) -> p.RegisterCaches:
        """The RegisterCaches of the harness's caches (every layer in the one shared-memory buffer)."""
        layers = [
            ipc.LayerView(
                name=f"model.layers.{i}.self_attn.attn",
                buffer_index=0,
                offset_bytes=i * 2 * B * PLANE * 2,
                shape=[B, 2, N, H * D],
                strides=[PLANE, B * PLANE, H * D, 1],
                dtype="bfloat16",
            )
            for i in range(LAYERS)
        ]
        return p.RegisterCaches(buffers=[self.shm.description], layers=layers, page_format=FMT)

    async def stop(self) -> None:
        await self.daemon.shutdown(0)
        self.shm.close()

    def send(self, msg: object, who: bytes = b"shim") -> None:
        self.daemon.router.dispatch([who], msg, time.monotonic())

    def pull(
        self,
        req_id: str,
        blocks: list[int] | None = None,
        remote: list[int] | None = None,
        who: bytes = b"shim",
        **kw,
    ) -> None:
        """A Pull of ``blocks`` (local ids) from ``remote`` (default: the same ids) of prefill-0 at :5600;
        ``kw`` sets or overrides any other field."""
        blocks = [1, 2, 3] if blocks is None else blocks
        fields = dict(
            req_id=req_id,
            remote_engine_id="prefill-0",
            remote_host="127.0.0.1",
            remote_port=5600,
            remote_request_id=f"r-{req_id}",
            remote_block_ids=p.pack_block_ids(blocks if remote is None else remote),
            local_block_ids=p.pack_block_ids(blocks),
        )
        self.send(p.Pull(**{**fields, **kw}), who=who)

    async def reply(self, kind: type, req_id: str | None = None, timeout: float = 2.0):
        """The first reply of ``kind`` (for ``req_id``), waiting for it; fails the test if none comes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for _env, msg in self.sent:
                if isinstance(msg, kind) and (req_id is None or getattr(msg, "req_id", None) == req_id):
                    return msg
            await asyncio.sleep(0.002)
        raise AssertionError(f"no {kind.__name__} for {req_id}; sent: {[m for _, m in self.sent]}")

    def answers(self, req_id: str) -> list[object]:
        return [m for _, m in self.sent if isinstance(m, p.Done | p.Aborted) and m.req_id == req_id]

    def job_stage(self, req_id: str) -> str | None:
        job = self.daemon.jobs.get(req_id)
        return job.stage.value if job is not None else None

    async def staging_all_free(self, timeout: float = 2.0) -> None:
        """Wait until every staging slot is back in the pool (fails the test if one is not in time)."""
        cut = self.daemon.staging._cut  # noqa: SLF001
        deadline = time.monotonic() + timeout
        while cut.allocator.free != cut.allocator.num_slots:
            taken = cut.allocator.num_slots - cut.allocator.free
            assert time.monotonic() < deadline, f"{taken} staging slots still taken"
            await asyncio.sleep(0.002)

    async def until_notified(self, remote_request_id: str, timeout: float = 2.0) -> None:
        """Until the prefill was told it may free the request's blocks."""
        deadline = time.monotonic() + timeout
        while remote_request_id not in self.port.notified:
            assert time.monotonic() < deadline, f"{remote_request_id} never notified: {self.port.notified}"
            await asyncio.sleep(0.002)

    async def admitted_by(self, beat: p.Heartbeat, key: tuple[str, int] = ("prefill-0", 0)) -> int:
        """Send ``beat`` and wait until its early handshake admitted ``key``; the port's connects then."""
        self.send(beat)
        while not self.daemon.peers.admitted(key):
            await asyncio.sleep(0.005)
        return self.port.connects

    async def until_stage(self, req_id: str, stage: str, timeout: float = 2.0) -> None:
        deadline = time.monotonic() + timeout
        while self.job_stage(req_id) != stage:
            assert time.monotonic() < deadline, f"{req_id} stayed in {self.job_stage(req_id)}, not {stage}"
            await asyncio.sleep(0.002)


@contextlib.asynccontextmanager
async def started(**overrides):
    """A started Harness, stopped on the way out."""
    h = Harness(**overrides)
    await h.start()
    try:
        yield h
    finally:
        await h.stop()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


@pytest.fixture
def blocked_conversion(monkeypatch):
    """Conversions wait for ``gate`` (set it to let them finish): holds a job in its convert stage."""
    gate = threading.Event()
    started = threading.Event()
    real = conversion_mod.convert_blocks

    def slow(*args, **kw):
        started.set()
        gate.wait(5)
        return real(*args, **kw)

    monkeypatch.setattr(conversion_mod, "convert_blocks", slow)
    yield gate, started
    gate.set()


# -- the happy paths ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_a_pull_is_read_converted_and_answered_once(mode):
    async def main():
        async with started(pull_mode=mode, staging_bytes=64 * PAGE_BYTES if mode == "staged" else 0) as h:
            h.pull("a")
            done = await h.reply(p.Done, "a")
            assert done.ok and done.safe, done
            assert {"queue", "handshake", "transfer", "convert", "end_to_end"} <= set(done.timings)
            assert 0 <= done.timings["accept"] <= done.timings["queue"]
            assert h.port.notified == ["r-a"]  # exactly one notification, after the reads
            assert h.port.reads[0].mode == mode
            assert h.port.pairings == 1  # paired once, on the loop: the post got those very pairs
            assert h.port.reads[0].pairs.local.tolist() == [1, 2, 3]
            await asyncio.sleep(0.01)
            assert h.port.reads[0].handles == []  # released after Done, on the poster thread
            assert h.port.post_threads == ["kv-sidecar-post_0"]  # posted off the event loop
            assert len(h.answers("a")) == 1 and len(h.daemon.jobs) == 0

    run(main())


def test_layer_groups_landing_out_of_order_are_all_converted():
    async def main():
        async with started(layer_groups=4) as h:
            h.port.auto_land = False
            h.pull("a")
            await h.until_stage("a", "transfer")
            while not h.port.reads:
                await asyncio.sleep(0.001)
            read = h.port.reads[0]
            assert len(read.groups) == 4
            for index in (2, 0, 1, 0):  # positions among those still pending: groups 2, 0, 1, 3
                h.port.land(read, index)
                await asyncio.sleep(0.005)
            done = await h.reply(p.Done, "a")
            assert done.ok, done
            assert h.daemon.jobs.get("a") is None

    run(main())


def test_done_says_how_far_apart_the_layer_groups_landed():
    """``landing_spread``: the first group seen landed to the last, so a bench can tell groups that land one
    after another (their conversions overlap later reads) from groups that land together."""

    async def main():
        async with started(layer_groups=3) as h:
            h.port.auto_land = False
            h.pull("a")
            while not h.port.reads:
                await asyncio.sleep(0.001)
            read = h.port.reads[0]
            for _ in range(3):
                h.port.land(read)
                await asyncio.sleep(0.02)
            spread = (await h.reply(p.Done, "a")).timings["landing_spread"]
            assert 0.02 <= spread < 1.0  # two 20 ms gaps (bounds loose for a loaded 2-core CI host)

            h.pull("b")  # every group in one poll pass: no spread
            while len(h.port.reads) < 2:
                await asyncio.sleep(0.001)
            read = h.port.reads[1]
            while read.groups:
                h.port.land(read)
            assert (await h.reply(p.Done, "b")).timings["landing_spread"] == 0.0  # seen in one poll pass

        async with started(layer_groups=1) as h:  # one group: nothing to spread
            h.pull("c")
            done = await h.reply(p.Done, "c")
            assert done.ok and "landing_spread" not in done.timings

    run(main())


def test_a_group_that_never_lands_fails_the_pull_even_if_the_others_converted():
    async def main():
        async with started(layer_groups=2) as h:
            h.port.auto_land = False
            h.pull("a", timeout_s=0.3)
            while not h.port.reads:
                await asyncio.sleep(0.001)
            h.port.land(h.port.reads[0], 1)
            done = await h.reply(p.Done, "a")
            assert not done.ok and done.reason.startswith("deadline") and "transfer" in done.reason

    run(main())


# -- abort and deadline in every stage -----------------------------------------------------------------


async def _hold_in(h: Harness, stage: str, gate_started=None) -> None:
    """Start pull "x" and hold it in ``stage``."""
    if stage == "queue":
        h.port.auto_land = False
        h.pull("blocker", timeout_s=5.0)  # max_inflight 1: "x" waits behind it
        await h.until_stage("blocker", "transfer")
    elif stage == "handshake":
        h.port.handshake_gate = asyncio.Event()
    elif stage == "transfer":
        h.port.auto_land = False
    h.pull("x")
    if stage == "convert":
        while not gate_started.is_set():
            await asyncio.sleep(0.002)
    await h.until_stage("x", stage)


@pytest.mark.parametrize("stage", ["queue", "handshake", "transfer", "convert"])
def test_abort_in_every_stage_is_answered_aborted_safe_and_the_prefill_freed(stage, blocked_conversion):
    gate, started = blocked_conversion

    async def main():
        h = Harness(max_inflight=1)
        await h.start()
        if stage != "convert":
            gate.set()
        try:
            await _hold_in(h, stage, started)
            h.send(p.Abort(req_id="x"))
            if stage == "convert":
                await asyncio.sleep(0.05)
                assert h.answers("x") == []  # not while the conversion still writes
                gate.set()
            if stage == "handshake":
                h.port.handshake_gate.set()
            aborted = await h.reply(p.Aborted, "x")
            assert aborted.safe, aborted
            assert not [m for m in h.answers("x") if isinstance(m, p.Done)]
            await h.until_notified("r-x")  # the prefill frees the blocks now, not at its lease's end
            assert h.daemon.metrics.requests.labels(outcome="aborted")._value.get() == 1
        finally:
            h.port.handshake_gate = None
            await h.stop()

    run(main())


@pytest.mark.parametrize("stage", ["queue", "handshake", "transfer", "convert"])
def test_deadline_in_every_stage_answers_failed_before_it(stage, blocked_conversion):
    gate, started = blocked_conversion

    async def main():
        h = Harness(max_inflight=1, default_timeout_s=0.25)
        await h.start()
        if stage != "convert":
            gate.set()
        try:
            t0 = time.monotonic()
            await _hold_in(h, stage, started)
            if stage == "convert":
                await asyncio.sleep(0.3)
                assert h.answers("x") == []  # the deadline waits for the conversion that writes
                gate.set()
                done = await h.reply(p.Done, "x")
                assert not done.ok and "convert" in done.reason
            else:
                done = await h.reply(p.Done, "x")
                assert time.monotonic() - t0 < 0.25 + 1.0  # by the deadline, not at some later event
                assert not done.ok and done.reason == f"deadline: 0.25 s passed during {stage}", done
            assert h.daemon.metrics.requests.labels(outcome="expired")._value.get() >= 1
        finally:
            if h.port.handshake_gate is not None:
                h.port.handshake_gate.set()
            await h.stop()

    run(main())


def test_a_deadline_beyond_max_timeout_is_cut_to_it():
    async def main():
        async with started(max_timeout_s=0.2, default_timeout_s=0.1) as h:
            h.port.auto_land = False
            h.pull("x", timeout_s=1e300)
            done = await h.reply(p.Done, "x")
            assert not done.ok and done.reason.startswith("deadline: 0.2 s"), done

    run(main())


def test_an_abort_of_a_read_nixl_will_not_release_at_once_waits_until_it_does():
    async def main():
        async with started() as h:
            h.port.auto_land = False
            h.port.stuck_abort = 3
            h.pull("x")
            await h.until_stage("x", "transfer")
            h.send(p.Abort(req_id="x"))
            aborted = await h.reply(p.Aborted, "x")
            assert aborted.safe and h.port.stuck_abort == 0

    run(main())


# -- posting on the poster thread ------------------------------------------------------------------------


def test_an_unsafe_answer_comes_within_the_shims_default_grace():
    """A read that will not stop is given up on (answered "blocks unsafe") before the shim stops waiting for
    an answer: with less than a second to spare, the shim says "no answer" and the cause is lost."""
    from vllm_glue.worker import DEFAULT_GRACE_S

    assert reads_module.RELEASE_GIVE_UP_S <= DEFAULT_GRACE_S - 1.0


@pytest.mark.parametrize("stuck", [0, 3, None])
def test_a_post_failing_midway_is_stopped_before_its_answer(monkeypatch, stuck):
    """A post that failed after posting part of its reads leaves handles NIXL may not release at once: the
    job's answer waits until they are (answered unsafe if they never are), and the prefill is told once."""
    from sidecar.daemon import reads

    monkeypatch.setattr(reads, "RELEASE_GIVE_UP_S", 0.3)

    async def main():
        async with started() as h:
            h.port.fail_post = h.port.fail_post_keeps_handles = True
            h.port.stuck_abort = 10**9 if stuck is None else stuck
            h.pull("x")
            done = await h.reply(p.Done, "x")
            assert not done.ok and "fake post failed midway" in done.reason, done
            assert ("blocks unsafe" in done.reason) == (stuck is None), done
            if stuck is not None:
                assert h.port.stuck_abort == 0 and h.port.reads[0].handles == []
            await asyncio.sleep(0.02)
            assert h.port.notified == ["r-x"]

    run(main())


@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_an_abort_in_the_pass_its_post_fails_keeps_the_read_to_stop(monkeypatch, mode):
    """The shim's Abort and a failing post's return reach the loop in one pass: what the post had posted is
    still the job's read, stopped before the answer (unsafe here: its handles never stop). Before, the read
    was dropped and the answer said safe while the transfers still wrote."""
    monkeypatch.setattr(reads_module, "RELEASE_GIVE_UP_S", 0.2)
    staged = {"pull_mode": "staged", "staging_bytes": LAYERS * 3 * PAGE_BYTES} if mode == "staged" else {}

    async def main():
        async with started(**staged) as h:
            loop = asyncio.get_running_loop()
            h.port.fail_post = h.port.fail_post_keeps_handles = True
            h.port.stuck_abort = 10**9  # what it posted is still in flight and never stops
            real_read = h.port.read

            def read(*args: Any, **kwargs: Any) -> Any:
                loop.call_soon_threadsafe(h.send, p.Abort(req_id="x"))  # queued before the post returns
                return real_read(*args, **kwargs)

            h.port.read = read
            h.pull("x")
            aborted = await h.reply(p.Aborted, "x")
            assert not aborted.safe and "not released" in aborted.reason, aborted

    run(main())


async def _posting(h: Harness, req_id: str, **pull: Any) -> None:
    """Start ``req_id`` with the fake's post held open (as a long NIXL post holds the agent)."""
    h.port.post_gate = threading.Event()
    h.pull(req_id, **pull)
    deadline = time.monotonic() + 2
    while not h.port.post_threads:
        assert time.monotonic() < deadline, "the post never started"
        await asyncio.sleep(0.002)


def test_pulls_are_received_and_planned_while_another_request_posts():
    async def main():
        async with started() as h:
            await _posting(h, "a")
            h.pull("b")
            # through queue, handshake and lease check while "a"'s post is held (its gate is still shut):
            # "b" did not wait behind it, whatever the host's speed
            await h.until_stage("b", "transfer")
            assert h.answers("a") == []
            h.port.post_gate.set()
            for req in ("a", "b"):
                done = await h.reply(p.Done, req)
                assert done.ok, done
            assert h.port.post_threads == ["kv-sidecar-post_0"] * 2  # one poster thread, in order
            assert sorted(h.port.notified) == ["r-a", "r-b"]

    run(main())


def test_a_new_prefill_is_loaded_on_the_poster_thread_after_the_post_in_progress():
    """A handshake's transport half (NIXL loading the prefill's agent waits for a post to end) runs on the
    poster thread: the loop serves on meanwhile, and the pull goes on once the post has returned."""

    async def main():
        async with started() as h:
            await _posting(h, "a")  # prefill-0 loaded before "a"'s post began
            h.send(p.Pull(req_id="b", remote_engine_id="prefill-1", remote_host="127.0.0.1", remote_port=5601,
                          remote_request_id="r-b", remote_block_ids=p.pack_block_ids([4]),
                          local_block_ids=p.pack_block_ids([4])))
            await h.until_stage("b", "handshake")
            await asyncio.sleep(0.05)  # this coroutine runs on the loop: it was not held by the post
            assert h.port.load_threads == ["kv-sidecar-post_0"] and h.job_stage("b") == "handshake"
            h.port.post_gate.set()
            for req in ("a", "b"):
                done = await h.reply(p.Done, req)
                assert done.ok, done
            assert h.port.load_threads == ["kv-sidecar-post_0"] * 2

    run(main())


def test_a_new_prefills_load_goes_ahead_of_the_posts_still_queued():
    """Calls other than posts (here a new prefill's load) run after the post in progress but ahead of the
    posts still queued, posts among themselves in order: a handshake waits for one post, not for every
    request queued to post."""

    async def main():
        async with started() as h:
            await _posting(h, "a")
            h.pull("b", [4])
            h.pull("c", [5])
            queued = h.daemon.reads._posts  # noqa: SLF001 - the posts handed over and not yet begun
            deadline = time.monotonic() + 2
            while len(queued) < 2:  # "b" and "c" wait behind "a"'s post
                assert time.monotonic() < deadline, "the posts never queued"
                await asyncio.sleep(0.002)
            h.send(p.Pull(req_id="d", remote_engine_id="prefill-1", remote_host="127.0.0.1", remote_port=5601,
                          remote_request_id="r-d", remote_block_ids=p.pack_block_ids([6]),
                          local_block_ids=p.pack_block_ids([6])))
            calls = h.daemon.reads._calls  # noqa: SLF001 - the other calls handed over and not yet begun
            deadline = time.monotonic() + 2
            while not calls:  # "d"'s load, behind "a"'s post and beside "b"'s and "c"'s
                assert time.monotonic() < deadline, "the load was never handed over"
                await asyncio.sleep(0.002)
            h.port.post_gate.set()
            for req in ("a", "b", "c", "d"):
                done = await h.reply(p.Done, req)
                assert done.ok, done
            assert h.port.transport_order == [
                "load prefill-0", "read r-a", "load prefill-1", "read r-b", "read r-c", "read r-d"
            ]

    run(main())


def test_a_peer_the_transport_let_go_is_forgotten_and_removed_at_the_next_admission():
    """A prefill restarted at the same address: the transport lets the old engine's peer go when it loads the
    new one (``unloaded``). The daemon then forgets the old engine and removes its peer at once (closing its
    mapping), not after ``mapping_idle_s``."""

    async def main():
        async with started() as h:
            h.pull("a")
            assert (await h.reply(p.Done, "a")).ok
            old = h.port.peers[0]
            old.unloaded = True  # as NIXL's add_peer does for a new engine at the same address
            h.send(p.Pull(req_id="b", remote_engine_id="prefill-1", remote_host="127.0.0.1", remote_port=5600,
                          remote_request_id="r-b", remote_block_ids=p.pack_block_ids([4]),
                          local_block_ids=p.pack_block_ids([4])))
            assert (await h.reply(p.Done, "b")).ok
            deadline = time.monotonic() + 2
            while not old.removed:
                assert time.monotonic() < deadline, "the let-go peer was never removed"
                await asyncio.sleep(0.002)
            assert not h.daemon.peers.known(("prefill-0", 0)) and h.daemon.peers.known(("prefill-1", 0))
            assert h.port.removal_threads == ["kv-sidecar-post_0"] and not h.port.peers[1].removed

    run(main())


def test_a_retired_peer_is_removed_on_the_poster_thread_once_its_pulls_let_go():
    """A reload re-admits a prefill while a pull still reads through its old admission: the old peer goes once
    that pull lets go, on the poster thread (NIXL's removal waits for a post, unmapping for conversions)."""

    async def main():
        async with started() as h:
            await _posting(h, "a")
            h.daemon.peers.invalidate()  # as a reload that changes the remotes does
            h.pull("b", [4])
            await h.until_stage("b", "handshake")
            await asyncio.sleep(0.05)
            old = h.port.peers[0]
            assert not old.removed and h.port.removal_threads == []
            h.port.post_gate.set()
            for req in ("a", "b"):
                done = await h.reply(p.Done, req)
                assert done.ok, done
            deadline = time.monotonic() + 2
            while not old.removed:
                assert time.monotonic() < deadline, "the retired peer was never removed"
                await asyncio.sleep(0.002)
            assert h.port.removal_threads == ["kv-sidecar-post_0"]
            assert [peer.removed for peer in h.port.peers] == [True, False]

    run(main())



def test_a_pull_stopped_before_its_read_is_told_before_its_retired_peer_is_removed(monkeypatch):
    """A reload retires the peer a pull holds while it waits for staging slots; the pull is aborted while
    the poster thread is busy. Its notification went to the poster thread after the peer's removal, which
    it queued on letting the peer go: NIXL had unloaded the prefill's agent (nothing else loaded it yet)
    before ``send_notif``, and the prefill held the blocks for the rest of its lease."""

    async def main():
        async with started(pull_mode="staged", staging_bytes=LAYERS * 3 * PAGE_BYTES) as h:
            told: list[tuple[str, list[bool]]] = []
            real_notify = h.port.notify

            def notify(peer, rid):
                told.append((rid, [m.removed for m in getattr(peer, "peers", (peer,))]))
                real_notify(peer, rid)

            monkeypatch.setattr(h.port, "notify", notify)
            other = {"remote_engine_id": "prefill-1", "remote_port": 5601}
            h.pull("warm", [4], **other)  # prefill-1's handshake, cached before the poster is held
            assert (await h.reply(p.Done, "warm")).ok
            h.pull("first", [5])  # prefill-0's handshake, cached
            assert (await h.reply(p.Done, "first")).ok
            await _posting(h, "b", **other)  # holds every staging slot; its post holds the port
            h.pull("a", [4, 5, 6])
            await h.until_stage("a", "transfer")  # through its cached handshake, waiting for slots
            h.daemon.peers.invalidate()  # as a reload that changes the remotes does
            h.pull("c", [7])  # retires the peer "a" holds
            await h.until_stage("c", "handshake")
            old = h.port.peers[1]
            h.send(p.Abort(req_id="a"))
            assert (await h.reply(p.Aborted, "a")).safe
            await asyncio.sleep(0.02)
            h.port.post_gate.set()
            await h.until_notified("r-a")
            for read in list(h.port.reads):
                while read.groups:
                    h.port.land(read)
            assert (await h.reply(p.Done, "b")).ok and (await h.reply(p.Done, "c")).ok
            assert old.removed
            assert ("r-a", [False]) in told, told  # told while its peer was still loaded

    run(main())



def test_a_pull_stopped_in_its_handshake_is_told_before_its_retired_peer_is_removed(monkeypatch):
    """The same for a pull stopped while its handshake runs, which a reload then retires: once through, the
    handshake's peer was removed (no pull held it) ahead of the notification waiting for that handshake."""

    async def main():
        async with started() as h:
            told: list[tuple[str, Any, bool]] = []
            real_notify, real_hold = h.port.notify, h.port.hold

            def notify(peer, rid):
                told.extend((rid, m, m.removed) for m in getattr(peer, "peers", (peer,)))
                real_notify(peer, rid)

            @contextlib.contextmanager
            def busy(blocking: bool = True):  # as while the poster thread is inside the transport
                if blocking:
                    with real_hold() as held:
                        yield held
                else:
                    yield False

            monkeypatch.setattr(h.port, "notify", notify)
            await _hold_in(h, "handshake")
            h.send(p.Abort(req_id="x"))
            assert (await h.reply(p.Aborted, "x")).safe
            h.daemon.peers.invalidate()  # as a reload that changes the remotes does
            h.pull("c", [7])  # handshakes anew: the running handshake is retired
            await h.until_stage("c", "handshake")
            monkeypatch.setattr(h.port, "hold", busy)
            h.port.handshake_gate.set()
            await h.until_notified("r-x")
            deadline = time.monotonic() + 2
            while not told[0][1].removed:
                assert time.monotonic() < deadline, "the retired peer was never removed"
                await asyncio.sleep(0.002)
            monkeypatch.setattr(h.port, "hold", real_hold)
            assert (await h.reply(p.Done, "c")).ok
            assert [(rid, removed) for rid, _, removed in told] == [("r-x", False)]  # before its removal

    run(main())


INLINE = {"pull_mode": "staged", "staging_bytes": 64 * PAGE_BYTES, "inline_post_max_descriptors": LAYERS}


@pytest.mark.parametrize(
    ("limit", "remote", "on_loop"),
    [
        (LAYERS, None, True),  # one run of blocks: LAYERS descriptors, within the limit
        (LAYERS, [1, 3, 5], False),  # three runs: 3 x LAYERS descriptors, over the limit
        (0, None, False),  # off
        (None, None, False),  # unset: off on the CPU twin
    ],
)
def test_a_lone_staged_read_is_posted_on_the_loop_only_within_the_limit(limit, remote, on_loop):
    """Config inline_post_max_descriptors: a read within the limit, the daemon's only pull, is posted on the
    loop with no thread hand-off; over the limit or with the key off, on the poster thread."""

    async def main():
        async with started(**{**INLINE, "inline_post_max_descriptors": limit}) as h:
            h.pull("a", [1, 2, 3], remote=remote)
            done = await h.reply(p.Done, "a")
            assert done.ok and (done.timings["poster_queue"] == 0.0) == on_loop, done
            want = threading.current_thread().name if on_loop else "kv-sidecar-post_0"
            assert h.port.post_threads == [want]

    run(main())


def test_an_abort_after_an_inline_post_stops_the_read_before_its_answer():
    """Posted on the loop, the read is stopped as any other: Aborted safe, nothing landing after it."""

    async def main():
        async with started(**INLINE) as h:
            h.port.auto_land = False
            h.pull("x", [1, 2, 3])
            await _posted(h, 1)
            assert h.port.post_threads == [threading.current_thread().name]
            h.send(p.Abort(req_id="x"))
            aborted = await h.reply(p.Aborted, "x")
            assert aborted.safe and not [m for m in h.answers("x") if isinstance(m, p.Done)], aborted
            assert h.port.reads[0].handles == []  # released: nothing can still write
            await h.until_notified("r-x")

    run(main())


def test_a_pull_beside_another_is_posted_on_the_poster_thread():
    """A post on the loop holds every other Pull back for its length: only a lone pull takes that path."""

    async def main():
        async with started(**INLINE) as h:
            h.port.auto_land = False
            h.pull("a", [1, 2, 3])
            await _posted(h, 1)
            h.pull("b", [4, 5, 6])  # "a" is still reading
            await _posted(h, 2)
            for read in h.port.reads:
                h.port.land(read)
            for req in ("a", "b"):
                assert (await h.reply(p.Done, req)).ok
            assert h.port.post_threads == [threading.current_thread().name, "kv-sidecar-post_0"]

    run(main())


def test_an_inline_post_never_waits_for_the_transport():
    """The transport held by another thread (the poster's release or abort): the loop does not wait for it,
    the post goes to the poster thread."""

    async def main():
        async with started(**INLINE) as h:
            h.pull("warm", [5])  # the prefill loaded (a handshake's load waits for the transport too)
            assert (await h.reply(p.Done, "warm")).ok
            held, let_go = threading.Event(), threading.Event()

            def hold_port() -> None:
                with h.port.hold():
                    held.set()
                    let_go.wait(10)

            holder = threading.Thread(target=hold_port)
            holder.start()
            held.wait(2)
            h.pull("a", [1, 2, 3])
            await h.until_stage("a", "transfer")
            await asyncio.sleep(0.02)  # the loop runs on meanwhile
            assert h.answers("a") == []
            let_go.set()
            holder.join(2)
            assert (await h.reply(p.Done, "a")).ok
            assert h.port.post_threads[1:] == ["kv-sidecar-post_0"]

    run(main())


def test_a_poll_pass_skips_while_the_poster_holds_the_port_and_runs_once_it_returns():
    async def main():
        async with started() as h:
            h.port.auto_land = False
            h.pull("a")
            await h.until_stage("a", "transfer")
            while not h.daemon.reads.poll(time.monotonic())[1]:  # "a" is posted and waiting
                await asyncio.sleep(0.002)
            await _posting(h, "b")
            while h.port.post_threads.count("kv-sidecar-post_0") < 2:
                await asyncio.sleep(0.002)
            await asyncio.sleep(0.02)
            assert h.daemon.reads.poll(time.monotonic()) == (False, False)  # skipped, not spun on
            assert h.port.held_skips >= 1
            h.port.auto_land = True
            h.port.post_gate.set()  # the post returns and wakes the poller: "a" lands without a new event
            assert (await h.reply(p.Done, "a")).ok and (await h.reply(p.Done, "b")).ok

    run(main())


@pytest.mark.parametrize("fails", [False, True], ids=["post-returns", "post-fails"])
def test_an_abort_during_a_post_waits_for_it_then_stops_it_and_notifies_once(fails):
    async def main():
        async with started() as h:
            h.port.auto_land = False
            h.port.fail_post = fails
            await _posting(h, "x")
            h.send(p.Abort(req_id="x"))
            await asyncio.sleep(0.05)
            assert h.answers("x") == []  # not while the post may still write
            h.port.post_gate.set()
            aborted = await h.reply(p.Aborted, "x")
            assert aborted.safe, aborted
            await asyncio.sleep(0.02)
            assert h.port.notified == ["r-x"]  # exactly once, by whichever path stopped it
            if not fails:
                assert h.port.reads[0].aborted and h.port.reads[0].handles == []
            assert len(h.answers("x")) == 1

    run(main())


def test_a_deadline_during_a_long_post_is_logged_and_answered_once_the_post_returns(monkeypatch, caplog):
    """A post that outlasts its job's deadline (a starved NIXL call) is named in the log while it is still
    out, so a shim that gave up waiting has a cause to show; the answer still waits for the post."""
    monkeypatch.setattr(reads_module, "POST_OVERDUE_S", 0.05)

    async def main():
        async with started() as h:
            h.port.auto_land = False
            await _posting(h, "x", timeout_s=0.5)  # long enough for the post to begin on a loaded host
            waited = time.monotonic() + 5
            while not (warned := [r for r in caplog.records if "post is still in NIXL" in r.getMessage()]):
                assert time.monotonic() < waited, "no warning about the post still out"
                await asyncio.sleep(0.01)
            assert h.answers("x") == []  # not while the post may still write
            (warning,) = warned
            assert "pull x was stopped (deadline: 0.5 s passed during transfer)" in warning.getMessage()
            h.port.post_gate.set()
            done = await h.reply(p.Done, "x")
            assert not done.ok and done.safe and "deadline" in done.reason, done

    run(main())


def test_a_nixl_call_that_does_not_return_fails_healthz_and_shows_in_the_gauge():
    """Config poster_stall_s: a post held past it makes /healthz fail (a liveness probe restarts the daemon,
    which is what frees a wedged NIXL call); kv_sidecar_poster_busy_seconds grows meanwhile; both recover
    once the call returns."""

    def busy(h: Harness) -> float:
        text = h.daemon.metrics.expose().decode()
        (line,) = [x for x in text.splitlines() if x.startswith("kv_sidecar_poster_busy_seconds ")]
        return float(line.split()[1])

    async def main():
        async with started(poster_stall_s=0.2) as h:
            assert h.daemon.health.healthy() == (True, "ok") and busy(h) == 0.0
            await _posting(h, "x")
            await asyncio.sleep(0.3)
            ok, why = h.daemon.health.healthy()
            assert not ok and why.startswith("poster thread inside one NIXL call for "), why
            assert "(poster_stall_s 0.2)" in why and busy(h) >= 0.3
            h.port.post_gate.set()
            assert (await h.reply(p.Done, "x")).ok
            assert h.daemon.health.healthy() == (True, "ok") and busy(h) == 0.0

    run(main())


def test_a_poll_pass_launches_what_landed_after_letting_the_port_go():
    """A post waiting for the port must not also wait for launches (each ~0.15-0.5 ms on a GPU)."""

    async def main():
        async with started(layer_groups=2) as h:
            reads = h.daemon.reads
            launch = reads._on_landed  # noqa: SLF001
            held_at_launch = []

            def watched(job, first, last):
                held_at_launch.append(h.port._lock._is_owned())  # noqa: SLF001
                launch(job, first, last)

            reads._on_landed = watched  # noqa: SLF001
            h.pull("a")
            assert (await h.reply(p.Done, "a")).ok
            assert held_at_launch == [False, False]

    run(main())


def test_a_read_finishing_while_the_port_is_busy_is_answered_and_notified_from_the_poster():
    """The loop never waits for the port: a notification that finds it held goes out on the poster thread."""

    async def main():
        async with started() as h:
            reads = h.daemon.reads
            launch = reads._on_landed  # noqa: SLF001
            notify = h.port.notify_read
            told = []
            h.port.notify_read = lambda read: (told.append(threading.current_thread().name), notify(read))
            release, holding = threading.Event(), threading.Event()

            def busy():  # as a post of another request would, right after this pass let the port go
                with h.port.hold():
                    holding.set()
                    release.wait(5)

            def launch_then_port_taken(job, first, last):
                launch(job, first, last)
                threading.Thread(target=busy, daemon=True).start()
                assert holding.wait(2)

            reads._on_landed = launch_then_port_taken  # noqa: SLF001
            h.pull("a")
            done = await h.reply(p.Done, "a")
            assert done.ok, done
            deadline = time.monotonic() + 2
            while not told:
                assert time.monotonic() < deadline, "never notified"
                await asyncio.sleep(0.002)
            assert told == ["kv-sidecar-post_0"] and h.port.notified == ["r-a"]
            release.set()

    run(main())


def test_a_pull_stopped_while_its_post_waits_behind_another_is_never_posted():
    async def main():
        async with started() as h:
            h.port.auto_land = False
            await _posting(h, "a")
            h.pull("b")
            await h.until_stage("b", "transfer")  # its post is queued behind "a"'s
            h.send(p.Abort(req_id="b"))
            await asyncio.sleep(0.05)
            assert h.answers("b") == []  # its turn on the poster thread has not come yet
            h.port.post_gate.set()
            aborted = await h.reply(p.Aborted, "b")
            assert aborted.safe, aborted
            await asyncio.sleep(0.02)
            assert len(h.port.post_threads) == 1 and len(h.port.reads) == 1  # only "a" was posted
            assert h.port.notified == ["r-b"]  # told once, without a read
            h.port.auto_land = True
            assert (await h.reply(p.Done, "a")).ok

    run(main())


def test_a_deadline_during_a_post_answers_after_stopping_what_it_posted():
    async def main():
        async with started(default_timeout_s=0.1) as h:
            h.port.auto_land = False
            await _posting(h, "x")
            await asyncio.sleep(0.2)
            assert h.answers("x") == []  # past its deadline, but the post still runs
            h.port.post_gate.set()
            done = await h.reply(p.Done, "x")
            assert not done.ok and done.reason.startswith("deadline: 0.1 s passed during transfer"), done
            assert h.port.reads[0].aborted and h.port.notified == ["r-x"]

    run(main())


def test_shutdown_during_a_post_waits_for_it_stops_it_and_notifies_once():
    async def main():
        h = Harness()
        await h.start()
        try:
            h.port.auto_land = False
            await _posting(h, "x")
            stopping = asyncio.ensure_future(h.daemon.shutdown(0))
            await asyncio.sleep(0.05)
            assert not stopping.done() and h.answers("x") == []
            h.port.post_gate.set()
            await asyncio.wait_for(stopping, 5)
            (done,) = h.answers("x")
            assert not done.ok and done.reason.startswith("shutting down"), done
            assert h.port.reads[0].aborted and h.port.notified == ["r-x"]
        finally:
            await h.stop()

    run(main())


def test_notifications_and_heartbeats_during_a_post_go_out_after_it_without_blocking_the_loop():
    async def main():
        async with started() as h:
            h.port.auto_land = False
            await _posting(h, "a")
            peer = h.port.peers[0]
            sent0 = h.daemon.metrics.heartbeats_sent._value.get()
            t0 = time.monotonic()
            h.daemon.peers.notify(peer, "r-other")
            h.daemon.leases.send((peer.engine_id, peer.tp_rank), peer, ["r-a"])
            assert time.monotonic() - t0 < 1.0  # queued behind the post: waiting would never return
            await asyncio.sleep(0.05)
            assert "r-other" not in h.port.notified and h.port.heartbeats == []
            h.port.post_gate.set()
            deadline = time.monotonic() + 2
            while h.daemon.metrics.heartbeats_sent._value.get() == sent0:
                assert time.monotonic() < deadline, h.port.heartbeats
                await asyncio.sleep(0.005)
            assert h.port.notified == ["r-other"] and h.port.heartbeats == [["r-a"]]
            h.port.auto_land = True
            assert (await h.reply(p.Done, "a")).ok

    run(main())


# -- staging -------------------------------------------------------------------------------------------


def test_a_staged_pull_waits_for_slots_and_goes_on_when_they_are_given_back():
    async def main():
        h = Harness(pull_mode="staged", staging_bytes=LAYERS * 3 * PAGE_BYTES)  # room for one 3-block pull
        await h.start()
        h.port.auto_land = False
        try:
            h.pull("a")
            await h.until_stage("a", "transfer")
            h.pull("b")
            await h.until_stage("b", "transfer")
            await asyncio.sleep(0.02)
            assert len(h.port.reads) == 1  # "b" waits for slots, nothing posted
            h.port.land(h.port.reads[0])
            assert (await h.reply(p.Done, "a")).ok
            while len(h.port.reads) < 2:
                await asyncio.sleep(0.002)
            h.port.land(h.port.reads[1])
            assert (await h.reply(p.Done, "b")).ok
        finally:
            await h.stop()

    run(main())


async def _posted(h: Harness, count: int, timeout: float = 2.0) -> list[str]:
    """The remote request ids of the reads posted, once there are ``count`` of them (in post order)."""
    deadline = time.monotonic() + timeout
    while len(h.port.reads) < count:
        assert time.monotonic() < deadline, [r.remote_request_id for r in h.port.reads]
        await asyncio.sleep(0.002)
    return [r.remote_request_id for r in h.port.reads]


def test_staged_pulls_get_slots_first_come_first_served():
    """A small pull that would fit does not jump the large pull waiting before it (which small pulls that
    keep fitting could otherwise starve until its deadline); the gauge says how many wait."""

    async def main():
        async with started(pull_mode="staged", staging_bytes=LAYERS * 4 * PAGE_BYTES) as h:
            h.port.auto_land = False
            waiting = h.daemon.metrics.staging_waiting
            h.pull("a", blocks=[1, 2])  # half the pool
            assert await _posted(h, 1) == ["r-a"]
            h.pull("big", blocks=[3, 4, 5, 6])  # the whole pool: waits for a
            await h.until_stage("big", "transfer")
            h.pull("small", blocks=[7])  # fits in the free half, but big came first
            await h.until_stage("small", "transfer")
            await asyncio.sleep(0.05)
            assert len(h.port.reads) == 1 and waiting._value.get() == 2
            h.port.land(h.port.reads[0])
            assert (await h.reply(p.Done, "a")).ok
            assert await _posted(h, 2) == ["r-a", "r-big"]
            await asyncio.sleep(0.02)
            assert len(h.port.reads) == 2 and waiting._value.get() == 1  # small: after big
            h.port.land(h.port.reads[1])
            assert (await h.reply(p.Done, "big")).ok
            assert await _posted(h, 3) == ["r-a", "r-big", "r-small"]
            h.port.land(h.port.reads[2])
            assert (await h.reply(p.Done, "small")).ok
            assert waiting._value.get() == 0
            await h.staging_all_free()

    run(main())


@pytest.mark.parametrize("how", ["abort", "deadline"])
def test_a_pull_stopped_while_in_line_lets_the_ones_behind_it_go(how):
    async def main():
        async with started(pull_mode="staged", staging_bytes=LAYERS * 4 * PAGE_BYTES) as h:
            h.port.auto_land = False
            h.pull("a", blocks=[1, 2])
            await _posted(h, 1)
            h.pull("big", blocks=[3, 4, 5, 6], **({"timeout_s": 0.2} if how == "deadline" else {}))
            await h.until_stage("big", "transfer")
            h.pull("small", blocks=[7])
            await h.until_stage("small", "transfer")
            if how == "abort":
                h.send(p.Abort(req_id="big"))
                assert (await h.reply(p.Aborted, "big")).safe
            else:
                done = await h.reply(p.Done, "big")
                assert not done.ok and done.reason.startswith("deadline"), done
            assert await _posted(h, 2) == ["r-a", "r-small"]  # a still holds its slots
            for read in h.port.reads:
                h.port.land(read)
            assert (await h.reply(p.Done, "a")).ok and (await h.reply(p.Done, "small")).ok
            assert h.daemon.metrics.staging_waiting._value.get() == 0
            await h.staging_all_free()  # the stopped pull took nothing with it

    run(main())


def test_a_pull_that_gives_up_its_gap_span_keeps_its_place_in_line():
    """b waits for a span with gap 5-6 (its gaps save 40 ms at 10 ms a descriptor); c, which would fit,
    waits behind it. When b's wait reaches what its gaps save, b takes its plain slots first, then c."""

    async def main():
        h = Harness(pull_mode="staged", staging_bytes=LAYERS * 6 * PAGE_BYTES, gap_pool_share=1.0,
                    read_descriptor_us=1e4, read_gbps=200.0)
        await h.start()
        h.port.auto_land = False
        try:
            h.pull("a", blocks=[1, 2, 3])  # half the pool
            await _posted(h, 1)
            h.pull("b", blocks=[7, 4])  # its span needs 4 slots a layer, 3 are free
            await h.until_stage("b", "transfer")
            h.pull("c", blocks=[0])
            await h.until_stage("c", "transfer")
            assert len(h.port.reads) == 1 and h.daemon.metrics.staging_waiting._value.get() == 2
            assert await _posted(h, 3) == ["r-a", "r-b", "r-c"]  # after b's 40 ms, a still reading
            assert h.port.reads[1].gaps is None
            span_waits = h.daemon.metrics.gap_span_waits
            assert span_waits.labels(outcome="gave_up")._value.get() == 1
            for read in h.port.reads:
                h.port.land(read)
            for req in ("a", "b", "c"):
                assert (await h.reply(p.Done, req)).ok
            await h.staging_all_free()
        finally:
            await h.stop()

    run(main())


def test_staging_slots_a_read_could_not_be_stopped_in_are_never_lent_again(monkeypatch):
    """A staged post that failed midway and whose handles NIXL never releases: the answer says the blocks are
    unsafe, and its staging slots stay out of use (the pool has room for one pull: the next one is never
    lent them, and, as nothing else can come free, it is refused at once)."""
    from sidecar.daemon import reads

    monkeypatch.setattr(reads, "RELEASE_GIVE_UP_S", 0.2)

    async def main():
        async with started(pull_mode="staged", staging_bytes=LAYERS * 3 * PAGE_BYTES) as h:
            h.port.fail_post = h.port.fail_post_keeps_handles = True
            h.port.stuck_abort = 10**9
            monkeypatch.setattr(h.port, "release", lambda read: False)  # nor later, in the background
            h.pull("a")
            done = await h.reply(p.Done, "a")
            assert not done.ok and not done.safe and "blocks unsafe" in done.reason, done
            # the shim's Abort after a reconnect must not hear "not in flight" as if nothing could write
            h.send(p.Abort(req_id="a"))
            aborted = await h.reply(p.Aborted, "a")
            assert not aborted.safe and "could not be stopped" in aborted.reason
            h.send(p.Abort(req_id="never-seen"))
            assert (await h.reply(p.Aborted, "never-seen")).safe
            h.port.fail_post = False
            h.pull("b")
            done = await h.reply(p.Done, "b")
            assert not done.ok and done.reason.startswith("staging_bytes:"), done
            assert len(h.port.reads) == 1  # "b" never read: "a"'s slots are kept out

    run(main())


def test_kept_out_slots_come_back_once_the_background_release_lets_go_of_every_handle(monkeypatch):
    """After an unsafe answer the read's handles are released once more in the background; when that lets
    go of every one (each READ has ended: nothing can write the slots any more), its slots are lent again.
    Until then they stay out: a pull that needs them is refused."""
    from sidecar.daemon import reads

    monkeypatch.setattr(reads, "RELEASE_GIVE_UP_S", 0.2)

    async def main():
        async with started(pull_mode="staged", staging_bytes=LAYERS * 3 * PAGE_BYTES) as h:
            sample = h.daemon.metrics.registry.get_sample_value
            h.port.fail_post = h.port.fail_post_keeps_handles = True
            h.port.stuck_abort = 10**9
            ended = threading.Event()  # the stuck READ ends: the background release then lets go of it
            real_release = h.port.release

            def release(read):
                ended.wait(5)
                return real_release(read)

            monkeypatch.setattr(h.port, "release", release)
            h.pull("a")
            assert not (await h.reply(p.Done, "a")).safe
            h.port.fail_post = False
            h.pull("b")  # the whole pool, while a's READ may still write
            done = await h.reply(p.Done, "b")
            assert not done.ok and done.reason.startswith("staging_bytes:"), done
            assert sample("kv_sidecar_staging_slots_kept_out") == 3 * LAYERS
            ended.set()
            deadline = time.monotonic() + 2.0
            while sample("kv_sidecar_staging_slots_kept_out"):
                assert time.monotonic() < deadline, "the released slots never came back"
                await asyncio.sleep(0.002)
            h.pull("c")
            assert (await h.reply(p.Done, "c")).ok
            assert [(r.remote_request_id, r.mode) for r in h.port.reads[1:]] == [("r-c", "staged")]
            await h.staging_all_free()

    run(main())


def test_the_kept_out_gauge_counts_the_staging_slots_a_read_could_not_be_stopped_in(monkeypatch):
    """kv_sidecar_staging_slots_kept_out: 0 while every read stops, then the slots of each pull answered
    with its blocks unsafe (never lent again), one pull after another."""
    from sidecar.daemon import reads

    monkeypatch.setattr(reads, "RELEASE_GIVE_UP_S", 0.2)

    async def main():
        async with started(pull_mode="staged", staging_bytes=LAYERS * 4 * PAGE_BYTES) as h:
            sample = h.daemon.metrics.registry.get_sample_value
            h.pull("ok", blocks=[1])
            assert (await h.reply(p.Done, "ok")).ok
            assert sample("kv_sidecar_staging_slots_kept_out") == 0
            h.port.fail_post = h.port.fail_post_keeps_handles = True
            h.port.stuck_abort = 10**9
            monkeypatch.setattr(h.port, "release", lambda read: False)
            h.pull("a", blocks=[2])
            assert not (await h.reply(p.Done, "a")).safe
            assert sample("kv_sidecar_staging_slots_kept_out") == LAYERS
            h.pull("b", blocks=[3, 4])
            assert not (await h.reply(p.Done, "b")).safe
            assert sample("kv_sidecar_staging_slots_kept_out") == 3 * LAYERS

    run(main())


@pytest.mark.parametrize("mode", ["staged", "auto"])
def test_a_pull_only_slots_kept_out_would_fit_is_answered_at_once_and_holds_up_nobody(
    monkeypatch, caplog, mode
):
    """Slots a read could not be stopped in stay out for good, so a pull needing more adjacent slots than
    can still come free never fits: it is answered at once (staged: refused naming staging_bytes; auto:
    read direct) instead of waiting in line for slots until its deadline with every pull behind it."""
    from sidecar.daemon import reads

    monkeypatch.setattr(reads, "RELEASE_GIVE_UP_S", 0.2)

    async def main():
        async with started(pull_mode=mode, staging_bytes=LAYERS * 3 * PAGE_BYTES) as h:
            h.port.fail_post = h.port.fail_post_keeps_handles = True
            h.port.stuck_abort = 10**9
            monkeypatch.setattr(h.port, "release", lambda read: False)  # NIXL never lets go of it
            h.pull("a", blocks=[1])  # its LAYERS slots are kept out
            assert not (await h.reply(p.Done, "a")).safe
            h.port.fail_post = False
            h.pull("big", blocks=[2, 3, 4])  # the whole pool: never again
            h.pull("small", blocks=[5, 6])  # fits in what can still come free
            big = await h.reply(p.Done, "big", timeout=1.0)
            assert (await h.reply(p.Done, "small", timeout=1.0)).ok
            refused = h.daemon.metrics.refusals.labels(field="staging_bytes")._value.get()
            posted = [(r.remote_request_id, r.mode) for r in h.port.reads[1:]]
            kept = set(np.asarray(h.port.reads[0].slots).ravel().tolist())
            small_read = next(r for r in h.port.reads if r.remote_request_id == "r-small")
            assert kept and kept.isdisjoint(np.asarray(small_read.slots).ravel().tolist())  # never lent
            if mode == "staged":
                assert not big.ok and big.reason.startswith("staging_bytes:"), big
                assert "could not be stopped" in big.reason and refused == 1
                assert posted == [("r-small", "staged")]
            else:
                assert big.ok and refused == 0
                assert sorted(posted) == [("r-big", "direct"), ("r-small", "staged")]
            said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
            assert len([m for m in said if "big" in m and "could not be stopped" in m]) == 1, said

    run(main())


@pytest.mark.parametrize("mode", ["staged", "auto"])
def test_pulls_in_line_that_kept_out_slots_leave_no_room_for_are_answered_before_their_deadline(
    monkeypatch, mode
):
    """A read that neither ends nor releases is answered unsafe at its deadline while others wait in line
    for slots: the one that needed its slots can no longer ever fit and is answered then (staged: refused;
    auto: read direct), not at its own deadline, and the one behind it gets its slots."""
    from sidecar.daemon import reads

    monkeypatch.setattr(reads, "RELEASE_GIVE_UP_S", 0.2)

    async def main():
        async with started(pull_mode=mode, staging_bytes=LAYERS * 3 * PAGE_BYTES) as h:
            h.port.auto_land = False
            h.port.stuck_abort = 10**9
            monkeypatch.setattr(h.port, "release", lambda read: False)
            h.pull("a", blocks=[1], timeout_s=0.5)  # its read never ends
            assert await _posted(h, 1) == ["r-a"]
            h.pull("big", blocks=[2, 3, 4])  # waits for the whole pool (30 s deadline)
            await h.until_stage("big", "transfer")
            h.pull("small", blocks=[5])  # fits now, but big came first
            await h.until_stage("small", "transfer")
            await asyncio.sleep(0.02)
            assert len(h.port.reads) == 1 and h.daemon.staging.waiting == 2
            assert not (await h.reply(p.Done, "a", timeout=3.0)).safe
            if mode == "staged":
                big = await h.reply(p.Done, "big", timeout=1.0)
                assert not big.ok and big.reason.startswith("staging_bytes:"), big
                assert "could not be stopped" in big.reason
                assert await _posted(h, 2) == ["r-a", "r-small"]
            else:
                assert sorted(await _posted(h, 3)) == ["r-a", "r-big", "r-small"]
            for read in h.port.reads[1:]:
                h.port.land(read)
            if mode == "auto":
                assert (await h.reply(p.Done, "big", timeout=1.0)).ok
                assert {r.remote_request_id: r.mode for r in h.port.reads}["r-big"] == "direct"
            assert (await h.reply(p.Done, "small", timeout=1.0)).ok
            assert h.daemon.staging.waiting == 0

    run(main())


def test_a_pull_overtaken_by_its_own_abort_reads_nothing():
    """The shim sends Pull and Abort on two sockets the daemon reads independently, so the Abort can come
    first: it is answered "not in flight" (the shim frees the blocks), and the Pull arriving after it is
    answered aborted without a read. Another connection's Abort of an unseen req_id blocks nothing."""

    async def main():
        async with started() as h:
            h.send(p.Abort(req_id="x"))
            assert (await h.reply(p.Aborted, "x")).safe
            h.pull("x")
            done = await h.reply(p.Done, "x")
            assert not done.ok and done.reason.startswith("aborted:"), done
            h.send(p.Abort(req_id="y"), who=b"stranger")
            await h.reply(p.Aborted, "y")
            h.pull("y")
            assert (await h.reply(p.Done, "y")).ok
            assert len(h.port.reads) == 1 and h.answers("x")[-1] == done  # "x" was never read
            await h.until_notified("r-x")  # its prefill frees the blocks now, not at its lease's end

    run(main())


def test_an_overloaded_pull_is_refused_and_its_prefill_told():
    """A Pull refused on arrival is never read: its prefill is told to free the blocks at once (the shim
    sends nothing of its own for a failed load), where before it held them for the rest of its lease."""

    async def main():
        async with started(max_inflight=1, max_queued=0) as h:
            h.port.auto_land = False
            h.pull("a")
            h.pull("b")
            done = await h.reply(p.Done, "b")
            assert not done.ok and done.reason.startswith("overloaded"), done
            await h.until_notified("r-b")
            assert "r-a" not in h.port.notified  # the one in flight is told once it ends
            await h.until_stage("a", "transfer")
            h.port.land(h.port.reads[0])
            assert (await h.reply(p.Done, "a")).ok

    run(main())


def test_two_registrations_in_flight_leave_the_newest_and_release_the_rest(monkeypatch):
    """Two RegisterCaches while a pull holds the current caches: handled one after the other, so the second
    replaces the first (released, deregistered) and only the newest stays registered. Before, both waited
    on the old caches' release, the older install came last and the newer one was never released."""
    monkeypatch.setattr(reads_module, "RELEASE_GIVE_UP_S", 0.2)

    async def main():
        async with started() as h:
            h.port.auto_land = False
            h.port.stuck_abort = 10**9  # the pull is answered unsafe; its handles keep the caches a while
            h.pull("a")
            await h.until_stage("a", "transfer")
            h.sent.clear()
            h.send(h.register_message())
            h.send(h.register_message())
            deadline = time.monotonic() + 5
            while len(registered := [m for _, m in h.sent if isinstance(m, p.Registered)]) < 2:
                assert time.monotonic() < deadline, h.sent
                await asyncio.sleep(0.01)
            assert registered[0].generation < registered[1].generation, registered
            assert h.daemon.caches.current.generation == registered[1].generation
            h.port.stuck_abort = 0
            assert h.port.registrations == 1

    run(main())


def test_a_pull_larger_than_the_whole_pool_is_refused_naming_staging_bytes():
    async def main():
        async with started(pull_mode="staged", staging_bytes=LAYERS * 2 * PAGE_BYTES) as h:
            h.pull("big", blocks=[1, 2, 3])
            done = await h.reply(p.Done, "big")
            assert not done.ok and done.reason.startswith("staging_bytes:"), done
            assert h.daemon.metrics.refusals.labels(field="staging_bytes")._value.get() == 1
            assert "r-big" in h.port.notified  # admitted, never read: the prefill is told at once

    run(main())


def test_each_pull_is_observed_once_per_stage():
    """kv_sidecar_stage_seconds is seconds per stage of a pull: a pull that makes a new handshake is one
    observation of stage "handshake", as of every other stage, not one for the pull and one for the
    handshake."""

    async def main():
        async with started() as h:
            h.pull("a")
            assert (await h.reply(p.Done, "a")).ok
            h.pull("b")  # the handshake is cached
            assert (await h.reply(p.Done, "b")).ok
            sample = h.daemon.metrics.registry.get_sample_value
            assert sample("kv_sidecar_handshakes_total", {"outcome": "ok"}) == 1
            counts = {s: sample("kv_sidecar_stage_seconds_count", {"stage": s})
                      for s in ("queue", "handshake", "transfer", "end_to_end")}
            assert counts == dict.fromkeys(counts, 2), counts

    run(main())


def test_a_failed_pull_whose_error_names_a_field_is_not_counted_as_a_refusal():
    """kv_sidecar_refusals_total counts refusals: a pull that failed on an error naming a field (the NIXL
    layer's TransferErrors name one) is counted failed, and nowhere among the refusals."""
    from sidecar.nixl.errors import TransferFailed

    async def main():
        async with started() as h:
            def blocks(*args, **kw):
                raise TransferFailed("NIXL rejected the descriptor arrays", "descs")

            h.port.blocks = blocks
            h.pull("a")
            done = await h.reply(p.Done, "a")
            assert not done.ok and "descs" in done.reason, done
            sample = h.daemon.metrics.registry.get_sample_value
            assert sample("kv_sidecar_requests_total", {"outcome": "failed"}) == 1
            assert sample("kv_sidecar_requests_total", {"outcome": "refused"}) == 0
            assert sample("kv_sidecar_refusals_total", {"field": "descs"}) is None

    run(main())


@pytest.mark.parametrize("mode", ["auto", "staged"])
def test_a_pull_of_no_blocks_is_answered_at_once_even_while_the_pool_is_held_whole(mode):
    """The shim's notify-only Pull (and a full local prefix hit) has no block to read: it is answered ok and
    its prefill told at once, without a staging slot, while another pull holds every slot of the pool."""

    async def main():
        async with started(pull_mode=mode, staging_bytes=LAYERS * 3 * PAGE_BYTES) as h:
            h.port.auto_land = False
            h.pull("a")  # the whole pool
            await _posted(h, 1)
            h.pull("none", blocks=[])
            assert await _posted(h, 2, timeout=1.0) == ["r-a", "r-none"]  # not behind a's slots
            h.port.land(h.port.reads[1])  # the fake's empty read (the real port posts none)
            done = await h.reply(p.Done, "none", timeout=1.0)
            assert done.ok and done.safe, done
            await h.until_notified("r-none")
            h.port.land(h.port.reads[0])
            assert (await h.reply(p.Done, "a")).ok
            await h.staging_all_free()

    run(main())


def test_the_staging_gauges_show_the_pool_and_what_a_pull_holds_of_it(blocked_conversion):
    """kv_sidecar_staging_bytes is the pool; _in_use, read when scraped, is the slots a pull holds until its
    answer (3 blocks x LAYERS pages while it converts), then 0 again."""
    gate, started_conversion = blocked_conversion

    async def main():
        async with started(pull_mode="staged", staging_bytes=64 * PAGE_BYTES + 5) as h:
            sample = h.daemon.metrics.registry.get_sample_value
            assert sample("kv_sidecar_staging_bytes") == 64 * PAGE_BYTES + 5
            assert sample("kv_sidecar_staging_bytes_in_use") == 0
            h.pull("a", blocks=[1, 2, 3], remote=[7, 9, 8])  # no gaps: ids 7..9 are one run
            while not started_conversion.is_set():
                await asyncio.sleep(0.002)
            assert sample("kv_sidecar_staging_bytes_in_use") == 3 * LAYERS * PAGE_BYTES
            gate.set()
            assert (await h.reply(p.Done, "a")).ok
            await h.staging_all_free()
            assert sample("kv_sidecar_staging_bytes_in_use") == 0

    run(main())


@pytest.mark.parametrize("mode", ["auto", "mapped"])
def test_auto_reads_a_pull_larger_than_the_whole_pool_direct(mode, caplog):
    """auto (and mapped, for a prefill that does not map) promise a read: a pull the pool could never hold
    is read direct, with a warning that names staging_bytes; one that fits is still staged."""

    async def main():
        async with started(pull_mode=mode, staging_bytes=LAYERS * 2 * PAGE_BYTES) as h:
            h.pull("big", blocks=[1, 2, 3])
            assert (await h.reply(p.Done, "big")).ok
            h.pull("small", blocks=[4, 5])
            assert (await h.reply(p.Done, "small")).ok
            reads = [(r.remote_request_id, r.mode) for r in h.port.reads]
            assert reads == [("r-big", "direct"), ("r-small", "staged")]
            m = h.daemon.metrics
            assert [m.read_modes.labels(mode=k)._value.get() for k in ("direct", "staged")] == [1, 1]
            assert m.refusals.labels(field="staging_bytes")._value.get() == 0
            (warning,) = [r for r in caplog.records if "read direct" in r.getMessage()]
            assert warning.levelname == "WARNING" and "staging_bytes" in warning.getMessage()
            await h.staging_all_free()

    run(main())


def test_a_reload_during_a_staged_wait_leaves_the_waiting_pull_to_finish():
    async def main():
        async with started(pull_mode="staged", staging_bytes=LAYERS * 3 * PAGE_BYTES) as h:
            h.port.auto_land = False
            h.pull("a")
            await h.until_stage("a", "transfer")
            h.pull("b")
            await asyncio.sleep(0.02)
            h.reloaded = Config(
                **{**_values(h.config), "default_timeout_s": 9.0, "heartbeat_interval_s": 2.0}
            )
            h.daemon.reload()
            assert h.daemon.config.default_timeout_s == 9.0
            h.port.land(h.port.reads[0])
            assert (await h.reply(p.Done, "a")).ok
            while len(h.port.reads) < 2:
                await asyncio.sleep(0.002)
            h.port.land(h.port.reads[1])
            assert (await h.reply(p.Done, "b")).ok

    run(main())


# -- the prefill side failing ------------------------------------------------------------------------


def test_pairs_that_do_not_fit_the_read_fail_the_pull_and_the_prefill_is_told_once():
    async def main():
        async with started() as h:
            made = h.port.blocks

            def foreign(*args):  # a pairing checked under another geometry's rule
                pairs = made(*args)
                return dataclasses.replace(pairs, rule=dataclasses.replace(pairs.rule, remote_ratio=2))

            h.port.blocks = foreign
            h.pull("a")
            done = await h.reply(p.Done, "a")
            assert not done.ok and "pairs" in done.reason, done
            assert h.port.reads == [] and h.port.notified == ["r-a"]
            h.port.blocks = made
            h.pull("b")
            assert (await h.reply(p.Done, "b")).ok

    run(main())


def test_a_failing_read_fails_the_pull_and_the_daemon_goes_on():
    async def main():
        async with started() as h:
            h.port.fail_reads = True
            h.pull("a")
            done = await h.reply(p.Done, "a")
            assert not done.ok and done.reason.startswith("transfer:"), done
            h.port.fail_reads = False
            h.pull("b")
            assert (await h.reply(p.Done, "b")).ok
            assert h.port.connects == 1  # a failed READ is not a lost peer

    run(main())


def test_a_peer_lost_between_handshake_and_read_is_handshaken_again():
    async def main():
        async with started() as h:
            h.pull("a")
            assert (await h.reply(p.Done, "a")).ok
            h.port.disconnect_reads = True  # the prefill restarted after the handshake
            h.pull("b")
            done = await h.reply(p.Done, "b")
            assert not done.ok and "disconnected" in done.reason
            h.port.disconnect_reads = False
            h.pull("c")
            assert (await h.reply(p.Done, "c")).ok
            assert h.port.connects == 2 and h.port.peers[0].removed

    run(main())


async def _status_peers(h: Harness, nonce: int) -> list[tuple[str, str, int]]:
    """The prefill ranks the daemon's StatusReply lists (what ``kv-sidecar doctor`` checks)."""
    h.send(p.Status(nonce=nonce), who=b"doctor")
    for _ in range(1000):
        reply = next((m for _, m in h.sent if isinstance(m, p.StatusReply) and m.nonce == nonce), None)
        if reply is not None:
            return sorted((s.address, s.engine_id, s.tp_rank) for s in reply.peers)
        await asyncio.sleep(0.002)
    raise AssertionError(f"no StatusReply {nonce}")


def test_status_lists_only_the_prefills_a_new_pull_would_read_without_a_handshake():
    """Status lists what the daemon holds admitted now: a peer dropped (a read found it gone), or admitted
    against older caches (or none now) or an older config, is handshaken again by the next pull, so it is
    not listed (doctor probes every listed prefill: a scaled-away one would fail it) until a pull admits it
    again."""
    here = [("127.0.0.1:5600", "prefill-0", 0)]

    async def main():
        async with started() as h:
            assert await _status_peers(h, 1) == []
            h.pull("a")
            assert (await h.reply(p.Done, "a")).ok
            assert await _status_peers(h, 2) == here
            h.port.disconnect_reads = True  # the prefill went away after its handshake
            h.pull("b")
            assert not (await h.reply(p.Done, "b")).ok
            assert await _status_peers(h, 3) == []
            h.port.disconnect_reads = False
            h.pull("c")
            assert (await h.reply(p.Done, "c")).ok
            assert await _status_peers(h, 4) == here
            h.sent.clear()
            h.send(h.register_message())  # new caches: every prefill is admitted again at its next pull
            assert isinstance(await h.reply(p.Registered), p.Registered)
            assert await _status_peers(h, 5) == []
            h.pull("d")
            assert (await h.reply(p.Done, "d")).ok
            assert await _status_peers(h, 6) == here
            h.daemon.peers.invalidate()  # as a reload does
            assert await _status_peers(h, 7) == []
            h.pull("e")
            assert (await h.reply(p.Done, "e")).ok
            assert await _status_peers(h, 8) == here
            h.send(p.Unregister())  # no caches: no pull reads through it, the next registration re-admits
            assert isinstance(await h.reply(p.Unregistered), p.Unregistered)
            assert await _status_peers(h, 9) == []
            assert h.port.connects == 4

    run(main())


def test_a_refused_handshake_is_answered_naming_the_field_and_not_cached():
    async def main():
        async with started() as h:
            h.port.refuse_handshake = "remote page format"
            h.pull("a")
            done = await h.reply(p.Done, "a")
            assert not done.ok and done.reason.startswith("remote page format:"), done
            await h.until_notified("r-a")  # refused, but told at once: its blocks are freed now
            h.port.refuse_handshake = None
            h.pull("b")
            assert (await h.reply(p.Done, "b")).ok
            assert h.port.connects == 2

    run(main())


def test_a_repeated_req_id_is_an_error_and_the_first_goes_on():
    async def main():
        async with started() as h:
            h.port.auto_land = False
            h.pull("a")
            h.pull("a")
            err = await h.reply(p.Error, "a")
            assert "already in flight" in err.reason
            await h.until_stage("a", "transfer")
            h.port.land(h.port.reads[0])
            assert (await h.reply(p.Done, "a")).ok

    run(main())


def _values(cfg: Config) -> dict:
    import msgspec

    return msgspec.structs.asdict(cfg)


# -- sessions own what they registered -------------------------------------------------------------------


def test_only_the_shim_that_registered_the_caches_may_pull_abort_or_unregister():
    async def main():
        async with started() as h:
            h.port.auto_land = False
            h.send(
                p.Pull(
                    req_id="intruder",
                    remote_engine_id="e",
                    remote_host="h",
                    remote_port=1,
                    remote_request_id="r",
                    remote_block_ids=p.pack_block_ids([0]),
                    local_block_ids=p.pack_block_ids([0]),
                ),
                who=b"stranger",
            )
            done = await h.reply(p.Done, "intruder")
            assert not done.ok and done.reason.startswith("session: say Hello"), done
            h.send(p.Hello(protocol_version=p.PROTOCOL_VERSION, package_version="t"), who=b"stranger")
            h.send(
                p.Pull(
                    req_id="intruder2",
                    remote_engine_id="e",
                    remote_host="h",
                    remote_port=1,
                    remote_request_id="r",
                    remote_block_ids=p.pack_block_ids([0]),
                    local_block_ids=p.pack_block_ids([0]),
                ),
                who=b"stranger",
            )
            done = await h.reply(p.Done, "intruder2")
            assert not done.ok and "another shim connection" in done.reason, done
            h.pull("mine")
            await h.until_stage("mine", "transfer")
            h.send(p.Abort(req_id="mine"), who=b"stranger")
            err = await h.reply(p.Error, "mine")
            assert err.reason.startswith("session:") and h.job_stage("mine") == "transfer"
            h.send(p.Unregister(), who=b"stranger")
            await asyncio.sleep(0.02)
            assert [m for _, m in h.sent if isinstance(m, p.Error) and m.in_reply_to == "Unregister"]
            assert h.daemon.caches.current is not None
            h.port.land(h.port.reads[0])
            assert (await h.reply(p.Done, "mine")).ok
            assert h.daemon.metrics.foreign_messages._value.get() == 4

    run(main())


def test_more_block_ids_than_the_caches_hold_are_refused_before_any_read_and_the_prefill_told():
    """Refused before its handshake: nothing read, but the prefill is told (through a handshake made for
    that, or the cached one) so it frees the blocks now rather than at its lease's end."""

    async def main():
        async with started() as h:
            h.pull("huge", blocks=list(range(B + 1)))
            done = await h.reply(p.Done, "huge")
            assert not done.ok and done.reason.startswith("local_block_ids:"), done
            await h.until_notified("r-huge")
            assert h.port.reads == [] and h.port.connects == 1
            h.pull("a")
            assert (await h.reply(p.Done, "a")).ok
            h.pull("huge-2", blocks=list(range(B + 1)))
            await h.reply(p.Done, "huge-2")
            await h.until_notified("r-huge-2")
            assert h.port.connects == 1 and h.port.notified.count("r-huge") == 1  # the cached one

    run(main())


def test_a_queued_pull_failed_by_unregister_tells_the_prefill_through_its_cached_handshake():
    async def main():
        async with started(max_inflight=1) as h:
            h.port.auto_land = False
            h.pull("blocker")
            await h.until_stage("blocker", "transfer")
            h.pull("queued")
            await h.until_stage("queued", "queue")
            h.send(p.Unregister())
            assert not (await h.reply(p.Done, "queued")).ok
            await h.until_notified("r-queued")
            assert h.port.connects == 1

    run(main())


def test_the_caches_of_a_shim_that_went_away_are_released_after_the_grace():
    async def main():
        async with started(owner_grace_s=0.05) as h:
            h.port.auto_land = False
            h.pull("a")
            await h.until_stage("a", "transfer")
            h.daemon.registrations.shim_gone(b"someone-else")  # not the owner: nothing happens
            await asyncio.sleep(0.1)
            assert h.daemon.caches.current is not None
            h.daemon.registrations.shim_gone(b"shim")
            done = await h.reply(p.Done, "a")
            assert not done.ok and "disconnected" in done.reason
            while h.daemon.caches.current is not None:
                await asyncio.sleep(0.005)
            assert h.daemon.metrics.ready._value.get() == 0 and h.port.registrations == 0

    run(main())


# -- staged spans: slots in remote order, gaps read into free staging slots --------------------------------


@pytest.fixture
def conversion_calls(monkeypatch):
    """Every conversion's (block ids, source rows, source index), recorded, then run for real."""
    calls = []
    real = conversion_mod.convert_blocks

    def record(caches, block_ids, fmt, src, layers=None, limits=None, planes=None, src_index=None):
        calls.append((list(block_ids), None if src is None else tuple(src.shape), src_index))
        return real(caches, block_ids, fmt, src, layers, limits, planes, src_index)

    monkeypatch.setattr(conversion_mod, "convert_blocks", record)
    return calls


def test_scattered_blocks_get_slots_in_remote_order_and_gaps_read_into_staging(conversion_calls):
    async def main():
        async with started(pull_mode="staged", staging_bytes=64 * PAGE_BYTES) as h:
            h.pull("a", blocks=[5, 1, 3])
            assert (await h.reply(p.Done, "a")).ok
            read = h.port.reads[0]
            # every remote id 1..5 in order: block 5 -> row 4, 1 -> row 0, 3 -> row 2; 2 and 4 are gaps
            slots = np.asarray(read.slots)
            first = int(slots.min())
            assert slots.tolist() == [[first + 5 * lay + r for r in (4, 0, 2)] for lay in range(LAYERS)]
            assert read.gaps.remote_ids.tolist() == [2, 4]
            want_gap_slots = [[first + 5 * lay + r for r in (1, 3)] for lay in range(LAYERS)]
            assert np.asarray(read.gaps.slots).tolist() == want_gap_slots
            assert h.daemon.metrics.gap_bytes_read._value.get() == LAYERS * 2 * PAGE_BYTES
            assert h.daemon.metrics.bytes_pulled._value.get() == LAYERS * 3 * PAGE_BYTES  # the request's own
            ids, shape, index = conversion_calls[0]
            assert ids == [5, 1, 3] and shape[:2] == (LAYERS, 5) and list(index) == [4, 0, 2]
            await asyncio.sleep(0.01)
            cut = h.daemon.staging._cut  # noqa: SLF001
            assert cut.allocator.free == cut.allocator.num_slots  # gap slots given back with the run

    run(main())


def test_without_gap_coalescing_slots_are_still_in_remote_order(conversion_calls):
    async def main():
        async with started(pull_mode="staged", staging_bytes=64 * PAGE_BYTES, gap_coalescing=False) as h:
            h.pull("a", blocks=[5, 1, 3])
            assert (await h.reply(p.Done, "a")).ok
            read = h.port.reads[0]
            slots = np.asarray(read.slots)
            first = int(slots.min())
            assert read.gaps is None
            assert slots.tolist() == [[first + 3 * lay + r for r in (2, 0, 1)] for lay in range(LAYERS)]
            assert h.daemon.metrics.gap_bytes_read._value.get() == 0
            assert list(conversion_calls[0][2]) == [2, 0, 1] and conversion_calls[0][1][:2] == (LAYERS, 3)

    run(main())


@pytest.mark.parametrize(
    ("staging_slots", "share", "gaps"),
    [
        (LAYERS * 3, 0.25, None),  # the pool holds just the request: no slot to spare for a gap
        (LAYERS * 4, 1.0, [6]),  # room for one gap block a layer: the 1-block gap only
        (64, 0.0, None),  # no share of the pool for gaps
        (64, 0.05, None),  # 3 slots: less than one gap block in each of 4 layers
        (64, 0.13, [6]),  # 8 slots: 2 gap blocks a layer -> the 1-block gap only (the other is 3 long)
        (64, 0.25, [2, 3, 4, 6]),  # 16 slots: both gaps
    ],
)
def test_gaps_take_only_free_slots_within_the_share(conversion_calls, staging_slots, share, gaps):
    async def main():
        pool = staging_slots * PAGE_BYTES
        async with started(pull_mode="staged", staging_bytes=pool, gap_pool_share=share) as h:
            h.pull("a", blocks=[5, 1, 7])  # remote 1, 5, 7: gaps 2-4 and 6
            assert (await h.reply(p.Done, "a")).ok
            read = h.port.reads[0]
            got = None if read.gaps is None else read.gaps.remote_ids.tolist()
            assert got == gaps
            width = 3 + (0 if gaps is None else len(gaps))
            assert conversion_calls[0][1][:2] == (LAYERS, width)
            assert h.daemon.metrics.gap_bytes_read._value.get() == LAYERS * (width - 3) * PAGE_BYTES

    run(main())


# A 2-block gap (5-6) between remote blocks 4 and 7: at 1.4 GB/s a 4 KiB page reads in 2.9 µs, so the gap
# (5.9 µs) beats a descriptor (8 µs) but waiting for one more page a layer (2.9 µs) eats what it saves (2.1).
# At 200 GB/s waiting costs next to nothing, but a wait is never longer than what the gaps save: 32 µs at
# 8 µs a descriptor (so b reads without them while a holds its slots), 0.4 s at 100 ms a descriptor.
@pytest.mark.parametrize(
    ("gbps", "descriptor_us", "waits"), [(1.4, 8.0, False), (200.0, 8.0, False), (200.0, 1e5, True)]
)
def test_a_busy_pool_is_waited_for_only_when_and_while_the_gaps_save_more(gbps, descriptor_us, waits):
    async def main():
        pool = LAYERS * 6 * PAGE_BYTES
        h = Harness(pull_mode="staged", staging_bytes=pool, gap_pool_share=1.0, read_gbps=gbps,
                    read_descriptor_us=descriptor_us)
        await h.start()
        h.port.auto_land = False
        try:
            h.pull("a", blocks=[1, 2, 3])  # takes half the pool
            await h.until_stage("a", "transfer")
            while not h.port.reads:
                await asyncio.sleep(0.002)
            h.pull("b", blocks=[7, 4])  # gap 5-6 needs 4 slots a layer: only 3 are free
            await h.until_stage("b", "transfer")
            await asyncio.sleep(0.05)
            assert len(h.port.reads) == (1 if waits else 2)
            h.port.land(h.port.reads[0])
            assert (await h.reply(p.Done, "a")).ok
            while len(h.port.reads) < 2:
                await asyncio.sleep(0.002)
            gaps = h.port.reads[1].gaps
            assert (gaps.remote_ids.tolist() if gaps else None) == ([5, 6] if waits else None)
            h.port.land(h.port.reads[1])
            assert (await h.reply(p.Done, "b")).ok
            span_waits = h.daemon.metrics.gap_span_waits
            counted = {o: span_waits.labels(outcome=o)._value.get() for o in ("taken", "gave_up")}
            gave_up = descriptor_us == 8.0 and gbps == 200.0  # worth waiting, but only for 32 µs
            assert counted == {"taken": float(waits), "gave_up": float(gave_up)}
            await h.staging_all_free()
        finally:
            await h.stop()

    run(main())


def test_a_pull_waiting_for_its_gap_span_can_be_aborted():
    async def main():
        h = Harness(pull_mode="staged", staging_bytes=LAYERS * 6 * PAGE_BYTES, gap_pool_share=1.0,
                    read_descriptor_us=1e5)
        await h.start()
        h.port.auto_land = False
        try:
            h.pull("a", blocks=[1, 2, 3])
            await h.until_stage("a", "transfer")
            h.pull("b", blocks=[7, 4])  # waits for a's slots to read gap 5-6
            await h.until_stage("b", "transfer")
            h.send(p.Abort(req_id="b"))
            assert (await h.reply(p.Aborted, "b")).safe
            h.port.land(h.port.reads[0])
            assert (await h.reply(p.Done, "a")).ok
            assert len(h.port.reads) == 1  # b never read
            await h.staging_all_free()
        finally:
            await h.stop()

    run(main())


@pytest.mark.parametrize(("setting", "nbytes", "want"), [(0, 0, 1), (0, (1 << 30) - 1, 1), (0, 1 << 30, 4),
                                                          (0, 10 << 30, 4), (1, 10 << 30, 1), (12, 1, 12)])
def test_layer_groups_auto_is_four_from_one_gib(setting, nbytes, want):
    from sidecar.daemon.read_plan import layer_groups_for

    assert layer_groups_for(setting, nbytes) == want


def test_layer_groups_auto_reads_a_small_request_in_one_group():
    async def main():
        async with started(pull_mode="staged", staging_bytes=64 * PAGE_BYTES) as h:
            assert h.config.layer_groups == 0
            h.port.auto_land = False
            h.pull("a")
            while not h.port.reads:
                await asyncio.sleep(0.001)
            assert h.port.reads[0].groups == [(0, LAYERS)]  # one READ of every layer
            h.port.land(h.port.reads[0])
            assert (await h.reply(p.Done, "a")).ok

    run(main())


def test_the_gil_switch_interval_is_the_configured_one_while_serving_and_given_back_after():
    before = sys.getswitchinterval()

    async def main():
        async with started(gil_switch_interval_us=50) as h:
            assert sys.getswitchinterval() == pytest.approx(50e-6)
            h.pull("a")
            assert (await h.reply(p.Done, "a")).ok

    run(main())
    assert sys.getswitchinterval() == before


@pytest.mark.parametrize("heartbeat_first", [False, True])
def test_a_lapsed_lease_start_is_honoured_after_a_heartbeat_named_the_request(heartbeat_first):
    """The shim saw the request 6 s ago (lease 5 s). A Heartbeat naming it before its Pull must not restart
    the lease at the heartbeat: the Pull is refused either way, nothing read."""

    async def main():
        async with started(lease_s=5.0, lease_margin_s=0.5, heartbeat_interval_s=1.0) as h:
            if heartbeat_first:
                h.send(p.Heartbeat(targets=[p.HeartbeatTarget(
                    remote_engine_id="prefill-0", remote_host="127.0.0.1", remote_port=5600,
                    remote_request_ids=["r-a"])]))
                await asyncio.sleep(0.05)
            h.pull("a", lease_started_at_ns=time.monotonic_ns() - 6 * 10**9)
            done = await h.reply(p.Done, "a")
            assert not done.ok and done.reason.startswith("lease: cannot vouch"), done
            assert h.port.reads == []

    run(main())


def test_a_pull_for_a_restarted_prefill_handshakes_anew_while_old_pulls_still_read():
    """A newer registration generation replaces the cached peer at once, even while a pull of the old one
    reads through it (under steady load it might never be idle); the old peer goes when that pull is done."""

    async def main():
        async with started(max_inflight=4) as h:
            h.port.auto_land = False
            h.pull("a", remote_registration_generation=1)
            await h.until_stage("a", "transfer")
            old = h.daemon.jobs.get("a").peer.peers[0]
            h.pull("b", blocks=[4, 5], remote_registration_generation=2)  # the prefill restarted
            await h.until_stage("b", "transfer")
            assert [peer.generation for peer in h.daemon.jobs.get("b").peer.peers] == [2]
            assert h.port.connects == 2 and not old.removed  # "a" still reads through it
            for read in list(h.port.reads):
                while read.groups:
                    h.port.land(read)
            assert (await h.reply(p.Done, "a")).ok and (await h.reply(p.Done, "b")).ok
            for _ in range(100):
                if old.removed:
                    break
                await asyncio.sleep(0.01)
            assert old.removed

    run(main())


def test_a_pull_of_an_older_registration_than_the_admitted_one_reads_nothing():
    """A prefill that registered again (sleep/wake) holds other bytes under the same block ids: a Pull that
    names the older registration fails without a read instead of reading the newer one's blocks."""

    async def main():
        async with started() as h:
            h.pull("new", remote_registration_generation=2)
            assert (await h.reply(p.Done, "new")).ok
            reads = len(h.port.reads)
            h.pull("old", blocks=[4, 5], remote_registration_generation=1)
            done = await h.reply(p.Done, "old")
            assert not done.ok and done.reason.startswith("remote_registration_generation: "), done
            assert len(h.port.reads) == reads and h.port.connects == 1
            h.pull("unversioned", blocks=[6], remote_registration_generation=0)  # v14: no generation
            assert (await h.reply(p.Done, "unversioned")).ok

    run(main())


@pytest.mark.parametrize("owner", ["same", "new"])
def test_a_pull_for_new_caches_does_not_join_a_handshake_admitted_against_the_old(owner):
    """Caches registered again with another dtype of the same width (same page size, so no geometry check
    sees it) while a handshake made against the old ones still runs: a Pull into the new caches must be
    admitted against them (bf16 standard pages are refused for fp16 caches), not join that handshake and
    convert bf16 bytes into fp16 caches. The owner registers again, or a new shim after the old one went."""

    async def main():
        async with started(owner_grace_s=0.05) as h:
            h.port.remote_format = msgspec.structs.replace(FMT, kind="standard", layout="LBHNC")  # bf16
            h.port.handshake_gate = asyncio.Event()
            h.pull("old")
            await h.until_stage("old", "handshake")
            fp16 = msgspec.structs.replace(FMT, dtype="float16")
            msg = h.register_message()
            layers = [msgspec.structs.replace(v, dtype="float16") for v in msg.layers]
            msg = msgspec.structs.replace(msg, page_format=fp16, layers=layers)
            who = b"shim"
            if owner == "new":
                h.daemon.registrations.shim_gone(b"shim")
                while h.daemon.caches.current is not None:
                    await asyncio.sleep(0.005)
                who = b"shim2"
                h.send(p.Hello(protocol_version=p.PROTOCOL_VERSION, package_version="test"), who=who)
            h.send(msg, who=who)
            while h.daemon.caches.current is None or h.daemon.caches.current.page_format != fp16:
                await asyncio.sleep(0.005)
            assert not (await h.reply(p.Done, "old")).ok
            h.pull("new", who=who)
            await h.until_stage("new", "handshake")
            h.port.handshake_gate.set()
            done = await h.reply(p.Done, "new")
            assert not done.ok and done.reason.startswith("dtype"), done
            assert h.port.reads == []  # nothing read into the fp16 caches
            while not h.port.peers[0].removed:  # the old caches' admission let go once through
                await asyncio.sleep(0.005)

    run(main())


@pytest.mark.parametrize("first_pull_failed", [False, True])
def test_heartbeats_reach_the_prefill_after_a_handshake_that_failed_under_a_pull(first_pull_failed):
    """A failed handshake is forgotten even while a pull holds it: kept, it made the rank "known" without a
    peer, and the shim's heartbeats for it were neither sent nor started a new handshake."""

    async def main():
        async with started() as h:
            if first_pull_failed:
                h.port.fail_handshake = True  # one failure, then the prefill is reachable
                h.pull("a")
                assert not (await h.reply(p.Done, "a")).ok
                h.port.fail_handshake = False
            connects = h.port.connects
            for _ in range(3):
                h.send(p.Heartbeat(targets=[p.HeartbeatTarget(
                    remote_engine_id="prefill-0", remote_host="127.0.0.1", remote_port=5600,
                    remote_request_ids=["r-waiting"])]))
                await asyncio.sleep(0.05)
            assert h.port.connects == connects + 1 and ["r-waiting"] in h.port.heartbeats

    run(main())


@pytest.mark.parametrize("first", ["pull", "heartbeat"])
def test_heartbeats_do_not_handshake_again_with_a_prefill_the_reloaded_rules_refuse(first):
    """A reload whose rules refuse a prefill: each shim Heartbeat naming its requests started a handshake with
    it, refused every time and counted as failed (KvSidecarHandshakesFailing fired with nothing broken). The
    refusal is counted as refused and remembered until the rules change again."""
    beat = p.Heartbeat(targets=[p.HeartbeatTarget(
        remote_engine_id="prefill-0", remote_host="127.0.0.1", remote_port=5600, remote_request_ids=["r-w"])])

    async def main():
        async with started() as h:
            sample = h.daemon.metrics.registry.get_sample_value
            if first == "pull":
                h.pull("a")
                assert (await h.reply(p.Done, "a")).ok
            h.reloaded = Config(**{**_values(h.config), "verify_model_identity": False})
            h.daemon.reload()
            h.port.refuse_handshake = "compatibility_hash"  # the new rules refuse the prefill
            if first == "pull":
                h.pull("b", blocks=[4, 5])
                assert not (await h.reply(p.Done, "b")).ok
            connects = h.port.connects
            for _ in range(4):
                h.send(beat)
                await asyncio.sleep(0.05)
            assert h.port.connects - connects == (0 if first == "pull" else 1)
            assert sample("kv_sidecar_handshakes_total", {"outcome": "failed"}) == 0
            assert sample("kv_sidecar_handshakes_total", {"outcome": "refused"}) == 1
            assert ["r-w"] not in h.port.heartbeats
            h.reloaded = Config(**{**_values(h.config), "verify_model_identity": True})
            h.daemon.reload()  # the rules changed again: the next heartbeat handshakes, once
            h.port.refuse_handshake = None
            connects = h.port.connects
            for _ in range(3):
                h.send(beat)
                await asyncio.sleep(0.05)
            assert h.port.connects == connects + 1 and ["r-w"] in h.port.heartbeats

    run(main())


def test_a_remembered_refusal_holds_neither_the_released_caches_nor_an_old_rule_generation():
    """The refusal memory kept the refused handshake's task: its exception's traceback holds the handshake's
    frame, and with it the caches it was admitted against. Released (Unregister, or replaced by a
    re-registration), those caches stayed referenced, their mappings with them, for as long as the rank was
    not handshaken again: a prefill refused once and gone since kept them for the daemon's lifetime. An
    invalidated refusal is never asked again either: it is forgotten, not kept."""
    beat = p.Heartbeat(targets=[p.HeartbeatTarget(
        remote_engine_id="prefill-0", remote_host="127.0.0.1", remote_port=5600, remote_request_ids=["r-w"])])

    async def main():
        async with started() as h:
            h.port.refuse_handshake = "compatibility_hash"
            h.send(beat)
            await asyncio.sleep(0.05)
            assert h.port.connects == 1 and h.daemon.peers.refused(h.port.targets[-1])
            caches = weakref.ref(h.daemon.caches.current)
            h.sent.clear()
            h.send(h.register_message())  # the decoder restarted: its new caches replace the old ones
            assert isinstance(await h.reply(p.Registered), p.Registered)
            gc.collect()
            assert caches() is None, [type(r).__name__ for r in gc.get_referrers(caches())]
            assert not h.daemon.peers._refusals  # noqa: SLF001 - forgotten with the rules they held under

    run(main())


def _loaded_by_a_peer_book(port: FakePort) -> None:
    """The fake's loads and removals kept by a real ``PeerBook``, as ``RemotePeers`` keeps NIXL's: a load the
    book turns down raises what NIXL's side raises. One agent, its metadata unchanged (no restart)."""
    book = PeerBook()
    load, remove = port._load, port.remove_peer  # noqa: SLF001

    def loaded(peer: Any) -> Any:
        key = (peer.engine_id, peer.tp_rank)
        for old in book.replaced_by(key, peer.generation, b"agent-md", peer.address, peer.tp_rank):
            book.unload(old)
        peer.key, peer.agent_name, peer.agent_metadata = key, "agent", b"agent-md"
        book.add(peer)
        return load(peer)

    def removed(peer: Any) -> None:
        if book.forget(peer):
            book.unload(peer)
        remove(peer)

    port._load, port.remove_peer = loaded, removed  # noqa: SLF001


def test_a_handshake_a_loaded_peer_stands_in_the_way_of_fails_and_is_not_remembered_as_refused():
    """A pull naming an older registration generation than the peer a running pull still reads through
    (replaced by a reload, not yet removed): the transport cannot load it. That is what is loaded, not a rule
    of ours, yet it was counted a refused handshake, answered refused on remote_registration_generation
    (KvSidecarRefusing) and remembered as the rules' refusal: the shim's heartbeats for that rank started no
    handshake and reached no prefill until the next pull or reload, though the peer in the way was gone."""
    beat = p.Heartbeat(targets=[p.HeartbeatTarget(
        remote_engine_id="prefill-0", remote_host="127.0.0.1", remote_port=5600, remote_request_ids=["r-w"])])

    async def main():
        async with started() as h:
            sample = h.daemon.metrics.registry.get_sample_value
            _loaded_by_a_peer_book(h.port)
            h.port.auto_land = False  # "a" reads through the generation 2 peer until the test lands it
            h.pull("a", remote_registration_generation=2)
            await h.until_stage("a", "transfer")
            h.daemon.peers.invalidate()  # as a reload that changes the remotes does
            h.pull("b", [4], remote_registration_generation=1)
            done = await h.reply(p.Done, "b")
            assert not done.ok and "generation 1 is older than the loaded 2" in done.reason, done
            assert not h.daemon.peers.refused(h.port.targets[-1])
            assert sample("kv_sidecar_handshakes_total", {"outcome": "refused"}) == 0
            assert sample("kv_sidecar_handshakes_total", {"outcome": "failed"}) == 1
            assert sample("kv_sidecar_requests_total", {"outcome": "failed"}) == 1
            assert sample("kv_sidecar_refusals_total", {"field": "remote_registration_generation"}) is None
            h.port.auto_land = True
            assert (await h.reply(p.Done, "a")).ok
            old = h.port.peers[0]
            while not old.removed:  # "a" let go: the peer in the way goes
                await asyncio.sleep(0.005)
            connects = h.port.connects
            for _ in range(3):
                h.send(beat)
                await asyncio.sleep(0.05)
            assert h.port.connects == connects + 1 and ["r-w"] in h.port.heartbeats

    run(main())


def test_a_heartbeats_handshake_re_admits_a_prefill_whose_known_generation_a_pull_holds():
    """The shim's heartbeats name no registration generation (0: unknown). A pull holds the generation 2 peer
    after a reload, and the re-handshake that would have replaced its entry failed; a heartbeat then
    handshakes. Generation 0 counted as older than the loaded 2: the heartbeat's handshake failed (the
    prefill's lease went unrenewed), and so did a pull naming generation 2 that joined it ("generation 0 is
    older than the loaded 2"), though the prefill was the same registration. Such a pull now handshakes on its
    own (a later registration than the heartbeat's reply may be), beside the heartbeat's."""
    beat = p.Heartbeat(targets=[p.HeartbeatTarget(
        remote_engine_id="prefill-0", remote_host="127.0.0.1", remote_port=5600, remote_request_ids=["r-w"])])

    async def main():
        async with started() as h:
            _loaded_by_a_peer_book(h.port)
            h.port.auto_land = False  # "a" reads through the generation 2 peer until the test lands it
            h.pull("a", remote_registration_generation=2)
            await h.until_stage("a", "transfer")
            h.daemon.peers.invalidate()  # as a reload that changes the remotes does
            h.port.fail_handshake = True  # the re-handshake fails: the rank's entry is forgotten
            h.pull("b", [4], remote_registration_generation=2)
            assert not (await h.reply(p.Done, "b")).ok
            assert not h.daemon.peers.known(("prefill-0", 0))
            h.port.fail_handshake = False
            h.port.handshake_gate = asyncio.Event()
            connects = h.port.connects
            h.send(beat)  # handshakes, generation 0
            while h.port.connects == connects:
                await asyncio.sleep(0.005)
            assert h.port.targets[-1].generation == 0
            # past the first registration: not joined (the heartbeat's reply may be older), its own handshake
            h.pull("c", [5], remote_registration_generation=2)
            await h.until_stage("c", "handshake")
            h.port.handshake_gate.set()
            h.port.auto_land = True
            done = await h.reply(p.Done, "c")
            assert done.ok, done
            assert h.port.connects == connects + 2 and h.port.targets[-1].generation == 2
            assert ["r-w"] in h.port.heartbeats  # the heartbeat went out through the admitted peer
            assert (await h.reply(p.Done, "a")).ok

    run(main())


def test_a_pull_is_newer_than_a_handshake_only_past_the_first_registration_it_could_have_read():
    """Every pair of 0 (unknown), the first registration and two later ones: 0 read stands for 1."""
    from sidecar.daemon.peers import newer_than_read

    newer = {(2, 0), (2, 1), (3, 0), (3, 1), (3, 2)}  # (pull's, read): a later registration than it read
    for pull in range(4):
        for read in range(4):
            assert newer_than_read(pull, read) == ((pull, read) in newer), (pull, read)


@pytest.mark.parametrize("generation, handshakes", [(1, 0), (2, 1)])
def test_a_heartbeats_peer_is_read_for_a_later_registration_only_after_a_handshake(generation, handshakes):
    """A heartbeat's handshake names no registration (0), and its peer was taken as current for any pull that
    came after it. A prefill that registered again (sleep/wake: generation 2) after answering that handshake
    had its pulls read through the older metadata's regions. A pull past the first publish (1: the prefill
    has no other metadata) now handshakes again; at 1 it reads through the heartbeat's peer."""
    beat = p.Heartbeat(targets=[p.HeartbeatTarget(
        remote_engine_id="prefill-0", remote_host="127.0.0.1", remote_port=5600, remote_request_ids=["r-w"])])

    async def main():
        async with started() as h:
            connects = await h.admitted_by(beat)
            assert h.port.targets[-1].generation == 0
            h.pull("a", remote_registration_generation=generation)
            done = await h.reply(p.Done, "a")
            assert done.ok, done
            assert h.port.connects == connects + handshakes
            assert h.port.targets[-1].generation == (generation if handshakes else 0)
            h.pull("b", [4], remote_registration_generation=generation)  # the peer is now that registration's
            assert (await h.reply(p.Done, "b")).ok
            assert h.port.connects == connects + handshakes

    run(main())


@pytest.mark.parametrize("moved", [{"remote_port": 5601}, {"remote_host": "127.0.0.2"},
                                   {"remote_tp_size": 2}])
def test_a_prefill_of_a_known_engine_id_at_another_address_or_tp_is_handshaken_with_again(moved):
    """A cached handshake was reused for any pull naming its engine id and rank: a prefill restarted under a
    fixed engine id at another address or TP size was read through the old one's peer (its regions, and for
    another TP the old head slice and "id:n" count). It is another prefill: the pull handshakes again."""

    async def main():
        async with started() as h:
            h.port.auto_land = True
            h.pull("a")
            assert (await h.reply(p.Done, "a")).ok
            before = len(h.port.targets)
            h.pull("b", [4], **moved)
            await h.reply(p.Done, "b")
            (target,) = [t for t in h.port.targets[before:] if t.tp_rank == 0]  # rank 0 handshaken again
            assert (target.port, target.host, target.remote_tp) == (
                moved.get("remote_port", 5600), moved.get("remote_host", "127.0.0.1"),
                moved.get("remote_tp_size", 1))

    run(main())


def test_a_prefill_rank_unused_for_peer_idle_s_is_let_go_and_handshaken_with_again():
    """An admitted prefill rank stayed in the daemon, its NIXL agent loaded, until the daemon exited: a
    fleet's prefills restart under new engine ids, and every dead one kept an agent (a UCX endpoint to a gone
    process). Unused by pulls and heartbeats for PEER_IDLE_S, it is let go; a pull in flight or a heartbeat
    keeps it, and a later pull handshakes again."""
    beat = p.Heartbeat(targets=[p.HeartbeatTarget(
        remote_engine_id="prefill-0", remote_host="127.0.0.1", remote_port=5600, remote_request_ids=["r-w"])])

    async def main():
        async with started() as h:
            peers = h.daemon.peers
            h.port.auto_land = False
            h.pull("a")
            await h.until_stage("a", "transfer")
            later = time.monotonic() + PEER_IDLE_S + 1
            assert peers.let_go_idle(PEER_IDLE_S, later) == 0  # a pull holds it
            h.port.auto_land = True
            assert (await h.reply(p.Done, "a")).ok
            h.send(beat)  # used by a heartbeat since
            await asyncio.sleep(0.01)
            assert peers.let_go_idle(PEER_IDLE_S, time.monotonic() + PEER_IDLE_S - 1) == 0
            (peer,) = h.port.peers
            assert not peer.removed
            assert peers.let_go_idle(PEER_IDLE_S, time.monotonic() + PEER_IDLE_S + 1) == 1
            while not peer.removed:
                await asyncio.sleep(0.005)
            assert peers.admitted(("prefill-0", 0)) is None
            connects = h.port.connects
            h.pull("b", [4])
            assert (await h.reply(p.Done, "b")).ok
            assert h.port.connects == connects + 1

    run(main())


def test_a_heartbeat_naming_the_registration_spares_its_pulls_a_second_handshake():
    """A heartbeat that names the prefill's registration (protocol 6) handshakes for it: a pull of that
    registration reads through the heartbeat's peer instead of handshaking again, and one of a later
    registration still handshakes."""
    beat = p.Heartbeat(targets=[p.HeartbeatTarget(
        remote_engine_id="prefill-0", remote_host="127.0.0.1", remote_port=5600, remote_request_ids=["r-w"],
        remote_registration_generation=2)])

    async def main():
        async with started() as h:
            connects = await h.admitted_by(beat)
            assert h.port.targets[-1].generation == 2
            h.pull("a", remote_registration_generation=2)
            assert (await h.reply(p.Done, "a")).ok
            assert h.port.connects == connects
            h.pull("b", [4], remote_registration_generation=3)
            assert (await h.reply(p.Done, "b")).ok
            assert h.port.connects == connects + 1 and h.port.targets[-1].generation == 3

    run(main())


@pytest.mark.parametrize("how", ["heartbeat", "expired pulls"])
def test_handshakes_no_pull_waits_for_are_bounded_and_leave_room_for_a_pulls(how):
    """Heartbeats naming 1,000 prefills started 1,000 handshakes at once (and expired Pulls one each, to
    tell their prefills): against silent prefills each held two of the process's 1,023 ZMQ sockets until
    its timeout, so a real pull's handshake failed with "Too many open files". At most
    MAX_UNAWAITED_HANDSHAKES such run at once; a pull's own handshake still starts."""
    from sidecar.daemon.peers import MAX_UNAWAITED_HANDSHAKES

    async def main():
        async with started() as h:
            h.port.handshake_gate = asyncio.Event()  # every prefill is silent until the gate opens
            if how == "heartbeat":
                for beat in p.heartbeats([p.HeartbeatTarget(  # 16 Heartbeats: 64 targets at most in one
                        remote_engine_id=f"flood-{i}", remote_host="127.0.0.1", remote_port=6000,
                        remote_request_ids=[f"r-flood-{i}"]) for i in range(1000)]):
                    h.send(beat)
            else:
                for i in range(300):  # sent at the clock's origin: expired on arrival, answered at once
                    h.pull(f"x{i}", remote_engine_id=f"flood-{i}", sent_at_ns=1)
            await asyncio.sleep(0.05)
            assert h.port.connects <= MAX_UNAWAITED_HANDSHAKES, h.port.connects
            connects = h.port.connects
            h.pull("a")
            await h.until_stage("a", "handshake")
            await asyncio.sleep(0.01)
            assert h.port.connects == connects + 1  # the pull's own handshake is never held back
            h.port.handshake_gate.set()
            assert (await h.reply(p.Done, "a")).ok

    run(main())


def test_a_registration_that_fails_unexpectedly_is_answered_and_the_old_one_kept(monkeypatch):
    """RegisterCaches runs as a spawned task, out of the router's catch-all: an error other than a refusal
    (a view torch cannot build raised TypeError) left the shim waiting out its timeout with no reply."""

    async def main():
        async with started() as h:
            before = h.daemon.caches.current

            async def broken(session, msg):
                raise TypeError("a view torch could not build")

            monkeypatch.setattr(h.daemon.caches, "map", broken)
            h.sent.clear()
            layer = ipc.LayerView(name="l0", buffer_index=0, offset_bytes=0, shape=[B, 2, N, H * D],
                                  strides=[PLANE, B * PLANE, H * D, 1], dtype="bfloat16")
            h.send(p.RegisterCaches(buffers=[h.shm.description], layers=[layer], page_format=FMT))
            err = await h.reply(p.Error)
            assert err.in_reply_to == "RegisterCaches" and "internal error: TypeError" in err.reason
            assert h.daemon.caches.current is before
            h.pull("a")
            assert (await h.reply(p.Done, "a")).ok

    run(main())


def test_a_reloaded_max_timeout_caps_the_next_pulls():
    """SIGHUP said max_timeout_s was applied, but the job table kept the value it was built with."""

    async def main():
        async with started(max_timeout_s=60.0, default_timeout_s=5.0) as h:
            h.reloaded = msgspec.structs.replace(h.daemon.config, max_timeout_s=2.0, default_timeout_s=1.0)
            h.daemon.reload()
            h.port.auto_land = False
            h.pull("a", timeout_s=30.0)
            await h.until_stage("a", "transfer")
            assert h.daemon.jobs.get("a").timeout_s == 2.0

    run(main())


def test_a_loop_the_daemon_cannot_serve_without_ending_fails_healthz(monkeypatch):
    """A crashed background loop was only logged: /healthz still said ok (the loop ticked), so nothing
    restarted a daemon that would never answer again."""
    from sidecar.daemon import polling

    async def crashed(self):
        raise RuntimeError("injected")

    monkeypatch.setattr(polling.Poller, "loop", crashed)

    async def main():
        async with started() as h:
            deadline = time.monotonic() + 2
            while h.daemon.health.healthy()[0]:
                assert time.monotonic() < deadline, "a dead poller left /healthz ok"
                await asyncio.sleep(0.01)
            assert h.daemon.health.healthy() == (False, "poller ended: RuntimeError: injected")

    run(main())


def test_a_reload_whose_live_keys_do_not_fit_the_running_ones_applies_nothing(caplog):
    """pull_mode 'staged' (live) with staging_bytes (restart-only) set in the same file: merged with the
    running staging_bytes = 0 the config is invalid. The ValueError escaped the signal handler, and no other
    changed key was applied."""

    async def main():
        async with started() as h:
            h.reloaded = msgspec.structs.replace(h.daemon.config, pull_mode="staged", staging_bytes=1 << 30,
                                                 log_level="DEBUG")
            h.daemon.reload()
            assert h.daemon.config.pull_mode == "auto" and h.daemon.config.log_level == "INFO"
            assert "configuration not reloaded" in caplog.text and "staging_bytes" in caplog.text
            h.pull("a")
            assert (await h.reply(p.Done, "a")).ok

    run(main())


def test_a_pull_stopped_in_its_handshake_at_shutdown_still_tells_the_prefill():
    """Shutdown answers a pull whose handshake is still running; the handshake comes through a moment
    later, while the daemon is still stopping: the prefill is told then, not left to its lease."""

    async def main():
        h = Harness()
        await h.start()
        try:
            await _hold_in(h, "handshake")
            stopping = asyncio.ensure_future(h.daemon.shutdown(0))
            done = await h.reply(p.Done, "x")
            assert not done.ok and done.reason.startswith("shutting down"), done
            await asyncio.sleep(0.05)
            h.port.handshake_gate.set()
            await asyncio.wait_for(stopping, 5)
            assert h.port.notified == ["r-x"]
        finally:
            h.port.handshake_gate = None
            await h.stop()

    run(main())


def test_a_queued_pull_answered_at_shutdown_tells_the_prefill_through_its_cached_handshake():
    async def main():
        h = Harness(max_inflight=1)
        await h.start()
        try:
            await _hold_in(h, "queue")
            await h.daemon.shutdown(0)
            (done,) = h.answers("x")
            assert not done.ok and done.reason.startswith("shutting down"), done
            assert sorted(h.port.notified) == ["r-blocker", "r-x"]
        finally:
            await h.stop()

    run(main())


def test_caches_a_read_could_not_be_stopped_in_stay_registered_and_mapped(monkeypatch):
    """A read NIXL neither ends nor releases (its handle still in progress, as NixlTransfer.release keeps
    one): the pull is answered unsafe, and when the shim then unregisters, the caches stay registered and
    mapped. Deregistered and unmapped, a late reply of that READ would land in whatever the daemon maps at
    that address next (the shim's next registration, other blocks than the request's)."""
    from sidecar.daemon import reads

    monkeypatch.setattr(reads, "RELEASE_GIVE_UP_S", 0.2)

    async def main():
        async with started() as h:
            h.port.auto_land = False
            h.port.stuck_abort = 10**9
            monkeypatch.setattr(h.port, "release", lambda read: False)
            closed = []
            monkeypatch.setattr("sidecar.daemon.caches.close_caches", closed.append)
            h.pull("a", timeout_s=0.3)
            done = await h.reply(p.Done, "a", timeout=3.0)
            assert not done.ok and not done.safe, done
            h.send(p.Unregister())
            await h.reply(p.Unregistered)
            assert h.port.registrations == 1 and closed == []

    run(main())


def test_a_pull_arriving_during_shutdown_tells_the_prefill_through_its_cached_handshake():
    """A Pull that arrives while the daemon drains is refused; the prefill is told through the handshake
    cached for its rank, and no handshake is made for a rank that has none."""

    async def main():
        h = Harness()
        await h.start()
        try:
            h.pull("a")
            assert (await h.reply(p.Done, "a")).ok
            h.port.auto_land = False
            h.pull("held", timeout_s=5.0)  # keeps the daemon draining
            await h.until_stage("held", "transfer")
            stopping = asyncio.ensure_future(h.daemon.shutdown(5))
            await asyncio.sleep(0.01)
            h.pull("late")
            done = await h.reply(p.Done, "late")
            assert not done.ok and done.reason.endswith("not accepting pulls"), done
            connects = h.port.connects
            h.pull("elsewhere", [1], remote_engine_id="prefill-1", remote_port=5601)
            assert not (await h.reply(p.Done, "elsewhere")).ok
            await h.until_notified("r-late")
            while h.port.reads[-1].groups:
                h.port.land(h.port.reads[-1])
            await asyncio.wait_for(stopping, 5)
            assert (await h.reply(p.Done, "held")).ok
            assert h.port.connects == connects and "r-elsewhere" not in h.port.notified
            assert sorted(h.port.notified) == ["r-a", "r-held", "r-late"]
        finally:
            await h.stop()

    run(main())



def test_a_pull_arriving_after_shutdown_released_the_caches_is_still_told_through_its_cached_handshake():
    """Shutdown releases the caches, then waits for the notifications still owed (``Peers.told``); a Pull
    that arrives meanwhile is answered "shutting down". Its prefill was told through the cached handshake
    only while the caches were registered: once released, the refusal told nobody, and the prefill held
    the blocks for its whole lease, as a pull refused after its handshake began never does."""

    async def main():
        h = Harness()
        await h.start()
        other = {"remote_engine_id": "prefill-1", "remote_port": 5601}
        try:
            h.pull("a", [4], **other)
            assert (await h.reply(p.Done, "a")).ok  # prefill-1's handshake is cached
            await _hold_in(h, "handshake")  # "x" keeps the shutdown waiting for its notification
            stopping = asyncio.ensure_future(h.daemon.shutdown(0))
            deadline = time.monotonic() + 2
            while h.daemon.caches.current is not None:
                assert time.monotonic() < deadline, "the caches were never released"
                await asyncio.sleep(0.002)
            h.pull("late", [5], **other)
            done = await h.reply(p.Done, "late")
            assert not done.ok and done.reason.endswith("not accepting pulls"), done
            await h.until_notified("r-late")
            h.port.handshake_gate.set()
            await asyncio.wait_for(stopping, 5)
            assert sorted(h.port.notified) == ["r-a", "r-late", "r-x"]
        finally:
            h.port.handshake_gate = None
            await h.stop()

    run(main())


def test_a_pull_admitted_before_a_reload_keeps_its_lease_when_the_new_rules_refuse_its_prefill():
    """README: a reload that refuses a prefill lets its pulls in flight finish under their admission. Lease
    renewals went through the prefill rank's *current* handshake: once the first pull under the new rules
    was refused, that was gone, and the pull still reading got no renewal: it failed on its lease."""

    async def main():
        async with started(lease_s=3.0, lease_margin_s=0.5, heartbeat_interval_s=0.2) as h:
            h.port.auto_land = False
            h.pull("a", timeout_s=8.0)
            await h.until_stage("a", "transfer")
            h.reloaded = Config(**{**_values(h.config), "verify_model_identity": False})
            h.daemon.reload()  # the rules changed: the next pull is admitted anew
            h.port.refuse_handshake = "remote page format"  # ... and refused under them
            h.pull("b", blocks=[4, 5])
            assert not (await h.reply(p.Done, "b")).ok
            renewed = len(h.port.heartbeats)
            await asyncio.sleep(3.0)  # past the lease: only renewals vouch for "a" now
            for read in list(h.port.reads):
                while read.groups:
                    h.port.land(read)
            done = await h.reply(p.Done, "a")
            assert done.ok, (done.reason, len(h.port.heartbeats) - renewed)
            assert ["r-a"] in h.port.heartbeats[renewed:]

    run(main())


def test_the_lease_tick_lets_prefill_ranks_idle_for_peer_idle_s_go(monkeypatch):
    """The renewals' tick asks ``Peers.let_go_idle`` for PEER_IDLE_S (or the lease and its margin, if longer)
    each quarter lease, as it does the notify-only loads."""
    calls = []
    monkeypatch.setattr(Peers, "let_go_idle", lambda self, idle_s, now=None: calls.append(idle_s) or 0)

    async def main():
        async with started(lease_s=3.0, lease_margin_s=0.5, heartbeat_interval_s=0.2):
            while not calls:
                await asyncio.sleep(0.02)
            assert calls == [PEER_IDLE_S]

    run(main())


def test_the_lease_tick_lets_idle_notify_only_loads_go_on_the_poster_thread():
    """A refused prefill's agent, loaded only to notify it, is let go once unused for a lease and its margin
    (``NixlPort.let_go_notify_only``, on real NIXL in test_remote_agents.py): the lease renewals' tick asks
    the port every quarter of that, on the poster thread (NIXL's removal waits for a post in progress)."""

    async def main():
        async with started(lease_s=3.0, lease_margin_s=0.5, heartbeat_interval_s=0.2) as h:
            while not h.port.let_go_calls:
                await asyncio.sleep(0.02)
            assert h.port.let_go_calls == [(3.5, "kv-sidecar-post_0")]
            await asyncio.sleep(0.4)  # several renewal ticks, but not a quarter of 3.5 s
            assert len(h.port.let_go_calls) == 1
            while len(h.port.let_go_calls) < 2:
                await asyncio.sleep(0.02)

    run(main())
