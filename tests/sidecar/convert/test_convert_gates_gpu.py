"""Gated graph launches (``sidecar.convert.gates``, ``Prepared.queue``) on a GPU: a launch queued behind a
closed gate writes nothing until the gate opens, then the same bytes as the ordinary launch; one disarmed
before its gate opens writes only the scratch block (the planes are compared whole: every block is canary),
and the next request that takes its graph converts right again. The daemon's ``Conversions`` with gates on:
a group that landed converts, one that never landed is disarmed when the job settles."""

from __future__ import annotations

import asyncio
import time
import types

import numpy as np
import pytest
import torch

from sidecar.convert.launch import launch_gpu, make_stream
from sidecar.wire.formats import AITER_SHUFFLED
from tests.sidecar.convert.test_convert_graphs_gpu import DEV, GraphRig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]


def _wait(event, seconds: float = 10.0) -> None:
    """Until ``event`` completes (never ``synchronize``: a gate left closed would hang the test)."""
    end = time.monotonic() + seconds
    while not event.query():
        assert time.monotonic() < end, "the gated work did not run"
        time.sleep(0.001)


def _planes(rig: GraphRig) -> list[torch.Tensor]:
    return [t.clone() for t in rig.k + rig.v]


def _unchanged(rig: GraphRig, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(a.view(torch.int16), b.view(torch.int16))
               for a, b in zip(rig.k + rig.v, before, strict=True))


def _captured(rig: GraphRig, ids, src, rows, layers) -> None:
    """One launch of the key the ordinary way (it captures the graph a queue replays)."""
    assert rig.both(ids, src, rows, layers) is not None
    rig.assert_same("captured")


def test_a_gated_launch_writes_nothing_until_its_gate_opens_then_converts_like_the_ordinary_launch():
    from sidecar.convert.gates import Gates

    rig = GraphRig(8, 16, 128, seed=21)
    gates = Gates(4)
    ids, src, rows = rig.request(12, True)
    _captured(rig, ids, src, rows, (0, 3))
    ids, _, rows = rig.request(12, True)
    before = _planes(rig)
    prepared = rig.graphs.prepare(ids, src, (0, 3), rows)
    event, slot = prepared.queue(rig.stream, gates)
    time.sleep(0.05)
    assert not event.query() and not gates.is_open(slot)
    assert _unchanged(rig, before), "a launch behind a closed gate wrote"
    gates.open(slot)
    _wait(event)
    launch_gpu(rig.stream, rig.ordinary, ids, AITER_SHUFFLED, src, (0, 3), None, None, None, rows)
    rig.assert_same("opened")
    gates.give_back(slot)
    assert gates.free == 4
    assert rig.graphs.stats["gated"] == 1


@pytest.mark.parametrize("in_place", [False, True], ids=["staged", "in-place"])
def test_a_disarmed_launch_writes_only_the_scratch_block_and_its_graph_converts_the_next_request(in_place):
    from sidecar.convert.gates import Gates

    rig = GraphRig(8, 16, 128, seed=22)
    rig.graphs.per_key = 1  # one graph for the key: the next request must take the disarmed one's
    gates = Gates(2)
    ids, src, rows = rig.request(9, True)
    if in_place:  # a direct read's launch: its blocks converted where they are
        src = rows = None
    _captured(rig, ids, src, rows, (0, 3))
    before = _planes(rig)
    ids, _, new_rows = rig.request(9, True)
    rows = None if in_place else new_rows
    prepared = rig.graphs.prepare(ids, src, (0, 3), rows, hold_limit=1)
    rig.graphs._scratch_offsets()  # made here so that it starts known
    if in_place:  # converted in place, zeros stay zeros: start from random bytes
        rig.graphs._scratch.random_(1, 256)
    else:
        rig.graphs._scratch.zero_()
    scratch = rig.graphs._scratch.clone()
    torch.cuda.synchronize()  # set (on the current stream) before the launch can write it
    event, slot = prepared.queue(rig.stream, gates)
    prepared.disarm()
    gates.open(slot)
    _wait(event)
    assert _unchanged(rig, before), "a disarmed launch wrote into the planes"
    wrote = not torch.equal(rig.graphs._scratch, scratch)
    assert wrote, "a disarmed launch wrote nowhere (it should write the scratch block)"
    gates.give_back(slot)
    ids, _, new_rows = rig.request(9, True)  # the same graph, its meta written again by this fill
    rows = None if in_place else new_rows
    assert rig.both(ids, src, rows, (0, 3)) is not None
    rig.assert_same("the request after a disarmed one")
    assert rig.graphs.count == 1 and rig.graphs.stats["disarmed"] == 1


def test_gates_run_out_and_a_closed_one_is_never_given_back():
    from sidecar.convert.gates import Gates

    gates = Gates(1)
    slot = gates.take()
    assert slot is not None and gates.take() is None
    with pytest.raises(ValueError, match="closed"):
        gates.give_back(slot)
    gates.open(slot)
    gates.give_back(slot)
    assert gates.take() == slot


def test_while_a_gate_holds_work_no_graph_is_captured_or_made_and_no_call_waits_for_it():
    """The daemon hung in ``cudaGraphInstantiate`` with a gate closed (an H100, 2026-12-06): instantiating
    waits for the device, so for the gated work, whose gate that same thread opens. While ``held`` says so, a
    launch whose graph is not captured yet goes the ordinary way (a later one captures) and one that would
    need a new graph is declined. A timer opens the gate after 20 s: it must not have been needed."""
    import threading

    from sidecar.convert.gates import Gates
    from sidecar.convert.graphs import GraphLaunches

    rig = GraphRig(8, 16, 128, seed=24)
    gates = Gates(2)
    rig.graphs = GraphLaunches(rig.ps, per_key=2, held=lambda: gates.closed > 0)
    ids, src, rows = rig.request(12, True)
    _captured(rig, ids, src, rows, (0, 3))
    b_ids, _, b_rows = rig.request(5, True)
    made = rig.graphs.prepare(b_ids, src[0:1], (0, 1), b_rows)  # a graph made, not captured, gate open
    a_ids, _, a_rows = rig.request(12, True)
    event, slot = rig.graphs.prepare(a_ids, src, (0, 3), a_rows).queue(rig.stream, gates)
    assert gates.closed == 1
    rescued = threading.Event()
    timer = threading.Timer(20.0, lambda: (rescued.set(), gates.open(slot)))
    timer.start()
    try:
        other = make_stream(torch.device(DEV))
        b_event = made.fire(other)  # it would capture now: deferred
        c_ids, _, c_rows = rig.request(7, True)
        declined = rig.graphs.launch(other, c_ids, src[1:3], (1, 3), c_rows)  # a new key: no graph made
    finally:
        timer.cancel()
    assert not rescued.is_set(), "a launch waited for the work behind the closed gate"
    assert declined is None and not event.query()
    assert rig.graphs.stats["deferred"] == 1 and rig.graphs.stats["captures"] == 1
    _wait(b_event)
    gates.open(slot)
    _wait(event)
    gates.give_back(slot)
    assert gates.closed == 0
    launch_gpu(rig.stream, rig.ordinary, b_ids, AITER_SHUFFLED, src[0:1], (0, 1), None, None, None, b_rows)
    launch_gpu(rig.stream, rig.ordinary, a_ids, AITER_SHUFFLED, src, (0, 3), None, None, None, a_rows)
    rig.assert_same("the deferred and the gated launch")
    b_ids, _, b_rows = rig.request(5, True)
    assert rig.both(b_ids, src, b_rows, (0, 1)) is not None  # the gate open: this fire captures
    rig.assert_same("the launch after the gate opened")
    assert rig.graphs.stats["captures"] == 2


class DaemonRig:
    """The daemon's ``Conversions`` with gates on, its events polled by a running ``Poller`` and its gate
    guard reading a ``Health`` tick as in the daemon, converting into a ``GraphRig``'s planes (4 layers, two
    layer groups); ``ordinary`` does the same requests the ordinary way for the comparison. Use inside
    ``async with``."""

    groups = [(0, 2), (2, 4)]

    def __init__(self, seed: int, in_place: bool = False) -> None:
        self.rig = GraphRig(8, 16, 128, layers=4, seed=seed)
        self.in_place = in_place
        self.caches = types.SimpleNamespace(plane_set=self.rig.ps, graphs=None, reencode_sets={})
        self.plan = types.SimpleNamespace(reencode=None)

    async def __aenter__(self) -> DaemonRig:
        from sidecar.daemon.conversion import Conversions
        from sidecar.daemon.polling import Pacer, Poller
        from sidecar.ops.metrics import Health

        poller = Poller(Pacer(lambda: 0.05, lambda: 0.001))
        self.health = Health()
        self.conv = Conversions(0, wake=poller.wake, graphs=lambda: True, gates=lambda: True,
                                loop_seen=lambda: self.health.last_tick)
        self.conv.make_stream()
        poller.add(self.conv.poll)
        self._tasks = [asyncio.create_task(poller.loop()), asyncio.create_task(self.health.beat(0.05))]
        return self

    async def __aexit__(self, *exc) -> None:
        for task in self._tasks:
            task.cancel()
        self.conv.close()

    def begin(self):
        """A new request (random blocks; staged from random source rows, or in place), begun and its groups'
        launches made ready while it "reads"."""
        ids, src, rows = self.rig.request(10, True)
        src, rows = (None, None) if self.in_place else (src, rows)
        job = types.SimpleNamespace(caches=self.caches, pairs=types.SimpleNamespace(local=ids), req_id="r",
                                    timings={}, conversion=None)
        self.conv.begin(job, src, self.plan, rows)
        self.conv.prepare(job, self.groups)
        return job, src, rows

    def ordinary(self, job, src, rows, layers) -> None:
        part = None if src is None else src[layers[0] : layers[1]]
        launch_gpu(self.rig.stream, self.rig.ordinary, job.pairs.local, AITER_SHUFFLED, part, layers, None,
                   None, None, rows)

    async def first_request(self) -> None:
        """A size's first request: no graph is captured yet to queue behind a gate, so each group is made
        ready, launched at landing (and captured)."""
        job, src, rows = self.begin()
        assert not job.conversion.gated
        for layers in self.groups:
            self.conv.convert_group(job, *layers)
            self.ordinary(job, src, rows, layers)
        await self.conv.finish(job, 4)
        self.rig.assert_same("the first request")


@pytest.mark.parametrize("in_place", [False, True], ids=["staged", "direct"])
def test_the_daemons_conversions_open_landed_groups_and_disarm_the_rest_when_the_job_settles(in_place):
    """Gates on: the first request of a size launches at landing (it captures); the next one's groups are
    queued ahead, group 0 lands and converts, group 1 never lands: settling disarms and opens it, and the
    planes hold group 0's conversion and group 1's layers untouched. Direct: the same, converted in place."""

    async def main():
        async with DaemonRig(23, in_place) as d:
            await d.first_request()
            second, src, rows = d.begin()
            assert set(second.conversion.gated) == set(d.groups)
            d.conv.convert_group(second, *d.groups[0])  # landed
            await d.conv.settle(second)  # the job ends: group 1 never lands
            d.ordinary(second, src, rows, d.groups[0])
            d.rig.assert_same("group 0 converted, group 1 disarmed")
            assert d.conv._gates.free == len(d.conv._gates.words)  # every gate back once its work ran
            return second.timings

    timings = asyncio.run(main())
    assert timings["launch"] < timings["launch_prep"]  # the landing only opened a gate


def test_a_loop_stuck_in_a_call_that_waits_for_the_device_is_let_go_and_its_pull_fails(monkeypatch):
    """The gate guard on a GPU: with a request's launches behind gates, the loop calls
    ``torch.cuda.synchronize()``, which waits for the gated work, so for ever. The guard forces the gates
    after GATE_STALL_S (1 s here): the launches run disarmed, the call returns, the group landing after that
    fails its job, and the planes hold only the first request's conversion."""
    from sidecar.daemon import conversion as conversion_module
    from sidecar.daemon.errors import Failed

    monkeypatch.setattr(conversion_module, "GATE_STALL_S", 1.0)

    async def main():
        async with DaemonRig(25) as d:
            await d.first_request()
            second, _, _ = d.begin()
            assert set(second.conversion.gated) == set(d.groups)
            t0 = time.monotonic()
            d.health.tick()  # the loop's last tick: from here it is stuck
            torch.cuda.synchronize()  # waits for the gated work: only the guard can let it go
            stalled = time.monotonic() - t0
            d.conv.convert_group(second, *d.groups[0])  # its bytes land after the guard let the launch go
            with pytest.raises(Failed, match="let run disarmed"):
                await d.conv.finish(second, 4)
            await d.conv.settle(second)
            d.rig.assert_same("the forced launches wrote none of the planes")
            assert d.conv._gates.free == len(d.conv._gates.words) and d.conv._gates.closed == 0
            return stalled

    stalled = asyncio.run(main())
    assert 1.0 <= stalled < 10.0


def test_gate_words_are_one_pinned_page():
    from sidecar.convert.gates import OPEN, Gates

    gates = Gates(8)
    assert gates.words.dtype == np.int32 and (gates.words == OPEN).all()


def _fp8_planes(h: int, n: int, d: int, blocks: int = 16, seed: int = 0):
    """Random fnuz planes of one layer (their raw bytes [2, blocks, row]), their PlaneSet and the re-encoding
    one of an fp8 pairing (scales all 1), both over the same bytes."""
    from sidecar.convert import PlaneSet
    from sidecar.wire import fp8

    g = torch.Generator(device=DEV).manual_seed(seed)
    raw = torch.randint(0, 256, (2, blocks, h * n * d), dtype=torch.int32, device=DEV, generator=g)
    raw = raw.to(torch.uint8)
    k, v = raw[0].view(torch.float8_e4m3fnuz), raw[1].view(torch.float8_e4m3fnuz)
    geom = dict(num_heads=h, block_size=n, head_size=d)
    return raw, PlaneSet([k], [v], **geom), PlaneSet([k], [v], **geom, lut=fp8.pair_table(1.0, 1.0, 1.0, 1.0))


def _staging(h: int, n: int, d: int, rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    pages = torch.randint(0, 256, (1, rows, 2 * h * n * d), dtype=torch.int32, device=DEV, generator=g)
    return pages.to(torch.uint8).view(torch.float8_e4m3fn)


def _new_variants(fn) -> int:
    """How many kernel variants ``fn``'s launches went through Triton for (a compile or a module load)."""
    from sidecar.convert import triton_kernel as tk

    def count() -> int:
        return sum(len(k._compiled) for k in tk._DIRECT.values())

    before = count()
    fn()
    torch.cuda.synchronize()
    return count() - before


def test_warmed_fp8_planes_reencode_without_loading_a_kernel_even_behind_a_closed_gate():
    """An fp8 pairing's re-encode launches kernel variants of its own, and a variant's first launch loads a
    module, which waits for the device: with a gate closed, for the gated work (the gate probe, an H100,
    2026-12-06). ``warm_up`` of 1-byte planes (at registration) now loads them. Geometries no other test uses:
    unwarmed, the same launches go through Triton; warmed, none does, and behind a closed gate they return (a
    timer opens the gate after 20 s: it must not have been needed) and, once it opens, convert as the same
    launches with no gate do."""
    import threading

    from sidecar.convert.gates import Gates

    ids, src_rows = np.array([9, 2, 5]), np.array([2, 0, 1])
    _, _, cold = _fp8_planes(2, 32, 64, seed=1)
    assert _new_variants(lambda: cold.convert_arrays(ids, src=_staging(2, 32, 64, 3, 1),
                                                     src_index=src_rows)) > 0  # the test can fail

    raw, plain, reencode = _fp8_planes(4, 16, 64, seed=2)
    want_raw, _, want = _fp8_planes(4, 16, 64, seed=2)
    staged = _staging(4, 16, 64, 3, 2)
    plain.warm_up()
    gates, stream = Gates(1), make_stream(torch.device(DEV))
    slot = gates.take()
    gates.close_on(stream, slot)
    rescued = threading.Event()
    timer = threading.Timer(20.0, lambda: (rescued.set(), gates.open(slot)))
    timer.start()

    def gated() -> None:
        with torch.cuda.stream(stream):
            reencode.convert_arrays(ids)  # in place
            reencode.convert_arrays(ids, src=staged, src_index=src_rows)
            event = torch.cuda.Event()
            event.record(stream)
        assert not rescued.is_set(), "a warmed re-encode launch waited for the work behind the gate"
        assert not event.query()
        gates.open(slot)
        _wait(event)

    try:
        assert _new_variants(gated) == 0
    finally:
        timer.cancel()
    gates.give_back(slot)
    want.convert_arrays(ids)
    want.convert_arrays(ids, src=staged, src_index=src_rows)
    torch.cuda.synchronize()
    assert torch.equal(raw, want_raw)
