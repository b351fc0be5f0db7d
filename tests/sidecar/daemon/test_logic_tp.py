"""Heterogeneous TP in the daemon's logic, on ``FakePort``: which prefill ranks a decoder rank handshakes,
reads, notifies ("id:n", exactly once per rank on every path) and heartbeats, and what it refuses."""

from __future__ import annotations

import asyncio
import gc
import time
from collections import Counter

import msgspec
import pytest

from sidecar.wire import protocol as p
from sidecar.wire.formats import STANDARD
from tests.sidecar.daemon.test_logic import FMT, Harness, run

# The decoder's ranks hold H = 2 heads each (FMT); a prefill rank holds 2 * decoder TP / prefill TP.


def prefill_fmt(heads: int):
    return msgspec.structs.replace(FMT, kind=STANDARD, layout="LBHNC", num_heads=heads)


class TPHarness(Harness):
    def __init__(self, *, tp: int, rank: int, prefill_heads: int, **overrides) -> None:
        super().__init__(**overrides)
        self.tp, self.rank = tp, rank
        self.port.remote_format = prefill_fmt(prefill_heads)

    def send(self, msg: object, who: bytes = b"shim") -> None:
        if isinstance(msg, p.Hello):
            msg = msgspec.structs.replace(msg, worker_rank=self.rank, tp_size=self.tp)
        super().send(msg, who)


async def tp_started(**kw) -> TPHarness:
    h = TPHarness(**kw)
    await h.start()
    return h


def per_rank(h: Harness, rid: str) -> Counter:
    """(prefill rank, n) -> notifications sent for ``rid``."""
    return Counter((rank, n) for r, rank, n in h.port.notifications if r == rid)


async def until(cond, timeout=2.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)


# (decoder TP, decoder rank, prefill TP) -> {prefill rank: n} read and notified
CASES = {
    (1, 0, 2): {0: 1, 1: 1},
    (2, 0, 1): {0: 2},
    (2, 1, 1): {0: 2},
    (2, 1, 4): {2: 1, 3: 1},
    (4, 3, 2): {1: 2},
}


@pytest.mark.parametrize("case", list(CASES), ids=str)
def test_each_prefill_rank_read_is_handshaken_and_notified_once_with_its_n(case):
    tp, rank, remote_tp = case

    async def main():
        h = await tp_started(tp=tp, rank=rank, prefill_heads=2 * tp // remote_tp)
        try:
            h.pull("a", remote_tp_size=remote_tp)
            done = await h.reply(p.Done, "a")
            assert done.ok, done
            assert sorted(t.tp_rank for t in h.port.targets) == sorted(CASES[case])
            sides = {(t.remote_tp, t.local_tp, t.local_rank) for t in h.port.targets}
            assert sides == {(remote_tp, tp, rank)}
            await asyncio.sleep(0.02)
            assert per_rank(h, "r-a") == Counter({(r, n): 1 for r, n in CASES[case].items()})
        finally:
            await h.stop()

    run(main())


@pytest.mark.parametrize("how", ["fail", "disconnect", "abort_in_handshake", "abort_in_transfer", "refused"])
def test_every_rank_is_notified_exactly_once_when_the_read_does_not_happen(how):
    async def main():
        h = await tp_started(tp=1, rank=0, prefill_heads=1)  # reads prefill ranks 0 and 1
        try:
            if how == "fail":
                h.port.fail_reads = True
            elif how == "disconnect":
                h.port.disconnect_reads = True
            elif how == "abort_in_handshake":
                h.port.handshake_gate = asyncio.Event()
            elif how == "abort_in_transfer":
                h.port.auto_land = False
            elif how == "refused":
                h.port.refuse_handshake = "remote page format"
            h.pull("a", remote_tp_size=2)
            if how.startswith("abort"):
                await h.until_stage("a", how.split("_in_")[1])
                h.send(p.Abort(req_id="a"))
                if h.port.handshake_gate is not None:
                    h.port.handshake_gate.set()
                assert (await h.reply(p.Aborted, "a")).safe
            else:
                done = await h.reply(p.Done, "a")
                assert not done.ok
                if how == "refused":
                    assert done.reason.startswith("remote page format"), done.reason
            await until(lambda: len(per_rank(h, "r-a")) == 2)
            await asyncio.sleep(0.05)
            assert per_rank(h, "r-a") == Counter({(0, 1): 1, (1, 1): 1})
        finally:
            h.port.handshake_gate = None
            await h.stop()

    run(main())


def test_a_tp_ratio_that_does_not_divide_is_refused_naming_remote_tp_size_before_any_handshake():
    async def main():
        h = await tp_started(tp=2, rank=0, prefill_heads=2)
        try:
            h.pull("a", remote_tp_size=3)
            done = await h.reply(p.Done, "a")
            assert not done.ok and done.reason.startswith("remote_tp_size"), done.reason
            assert h.port.targets == [] and h.port.notifications == []
        finally:
            await h.stop()

    run(main())


def test_heads_that_do_not_divide_are_refused_and_the_rank_still_told():
    async def main():
        # a prefill rank of 3 heads (3 in all) cannot be split over decoder TP 2
        h = await tp_started(tp=2, rank=1, prefill_heads=3)
        try:
            h.pull("a", remote_tp_size=1)
            done = await h.reply(p.Done, "a")
            assert not done.ok and done.reason.startswith("local_tp") and "3 KV heads" in done.reason
            await until(lambda: per_rank(h, "r-a"))
            assert per_rank(h, "r-a") == Counter({(0, 2): 1})  # "id:2": the prefill waits for both ranks
        finally:
            await h.stop()

    run(main())


def test_heartbeats_go_to_every_prefill_rank_read():
    async def main():
        h = await tp_started(tp=1, rank=0, prefill_heads=1)
        try:
            target = p.HeartbeatTarget(remote_engine_id="prefill-0", remote_host="127.0.0.1",
                                       remote_port=5600, remote_request_ids=["r-w"], remote_tp_size=2)
            h.send(p.Heartbeat(targets=[target]))  # unknown ranks: both handshakes start early
            await until(lambda: {r for r, _ in h.port.heartbeat_ranks} == {0, 1})
            h.port.heartbeat_ranks.clear()
            h.send(p.Heartbeat(targets=[target]))  # admitted now: forwarded at once, to each rank
            await until(lambda: len(h.port.heartbeat_ranks) == 2)
            assert sorted(h.port.heartbeat_ranks) == [(0, ["r-w"]), (1, ["r-w"])]
            assert sorted(t.tp_rank for t in h.port.targets) == [0, 1]
        finally:
            await h.stop()

    run(main())


def test_a_handshake_that_fails_after_the_pull_was_aborted_logs_nothing_unretrieved():
    """Seen with real vLLM (interop, decoder TP 2): the shim aborted a pull waiting on a slow handshake, the
    handshake then failed, and asyncio logged "_GatheringFuture exception was never retrieved" at ERROR."""

    async def main():
        unhandled: list[dict] = []
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: unhandled.append(ctx))
        h = await tp_started(tp=1, rank=0, prefill_heads=1)  # reads prefill ranks 0 and 1
        try:
            h.port.handshake_gate = asyncio.Event()
            h.pull("a", remote_tp_size=2)
            await h.until_stage("a", "handshake")
            h.send(p.Abort(req_id="a"))
            assert (await h.reply(p.Aborted, "a")).safe
            h.port.refuse_handshake = "remote page format"
            h.port.handshake_gate.set()
            await until(lambda: len(per_rank(h, "r-a")) == 2)
            await asyncio.sleep(0.05)
            gc.collect()
            await asyncio.sleep(0)
            assert not [c.get("message") for c in unhandled], unhandled
        finally:
            h.port.handshake_gate = None
            await h.stop()

    run(main())


def test_a_pull_not_taken_is_told_with_the_n_of_the_decoders_tp_now_not_of_a_cached_handshake():
    """A decoder restarted at TP 2 (the daemon and the prefill stayed up) has its first Pull overtaken by
    its Abort: the prefill rank is told "id:2", as it now waits for both decoder ranks. Told through the
    handshake cached for the decoder's TP 1 before, it got "id:1" and freed the blocks at this rank's word
    while the other decoder rank may still read them."""

    async def main():
        h = await tp_started(tp=1, rank=0, prefill_heads=2, owner_grace_s=0.05)
        try:
            h.pull("a", remote_tp_size=1)
            assert (await h.reply(p.Done, "a")).ok
            assert per_rank(h, "r-a") == Counter({(0, 1): 1})
            h.daemon.registrations.shim_gone(b"shim")
            while h.daemon.caches.current is not None:
                await asyncio.sleep(0.005)
            h.tp = 2  # the new shim's Hello says TP 2, rank 0
            h.send(p.Hello(protocol_version=p.PROTOCOL_VERSION, package_version="test"), who=b"shim2")
            h.send(h.register_message(), who=b"shim2")
            while h.daemon.caches.current is None:
                await asyncio.sleep(0.005)
            h.send(p.Abort(req_id="b"), who=b"shim2")
            assert (await h.reply(p.Aborted, "b")).safe
            h.pull("b", remote_tp_size=1, who=b"shim2")
            assert not (await h.reply(p.Done, "b")).ok
            await until(lambda: per_rank(h, "r-b"))
            await asyncio.sleep(0.05)
            assert per_rank(h, "r-b") == Counter({(0, 2): 1})
        finally:
            await h.stop()

    run(main())
