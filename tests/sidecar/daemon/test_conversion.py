"""``Conversions`` on the CPU twin: a group converts in the worker thread through the pairing's planes (an fp8
e4m3fn -> e4m3fnuz pairing re-encodes every byte and reports what did not keep its value). And, with
``GraphLaunches`` stood in for, the GPU's launch bookkeeping: launches made ready during the read, fired as
their groups land, the rest dropped; with gates on, launches queued behind gates opened as their groups
land, the rest disarmed before their gates open, every gate given back only once the work behind it ran (the
graphs and gates themselves are tested on a GPU: ``test_convert_graphs_gpu.py``,
``test_convert_gates_gpu.py``)."""

from __future__ import annotations

import asyncio
import time
import types

import numpy as np
import pytest
import torch

from sidecar.convert import PlaneSet
from sidecar.convert.gates import GatesUnavailable
from sidecar.convert.launch import convert_blocks
from sidecar.daemon.conversion import GATE_STALL_S, Conversions, reencode_planes
from sidecar.daemon.errors import Failed
from sidecar.wire.formats import AITER_SHUFFLED, STANDARD, PageFormat, Plan, negotiate

H, N, D, BLOCKS, LAYERS = 2, 16, 64, 6, 2
GEOM = dict(num_heads=H, block_size=N, head_size=D)
# the decoder's scales twice the prefill's: the e4m3fn -> e4m3fnuz re-encode is then exact (no opt-in needed)
LOCAL = PageFormat(kind=AITER_SHUFFLED, layout="LHBNC", dtype="float8_e4m3fnuz", k_scale=2.0, v_scale=2.0,
                   **GEOM)
REMOTE = PageFormat(kind=STANDARD, layout="LBHNC", dtype="float8_e4m3fn", **GEOM)


def _caches(pages: torch.Tensor, ids: np.ndarray) -> types.SimpleNamespace:
    """CPU planes holding the standard pages in the blocks ``ids`` (a direct read's landing), the rest 0."""
    half = H * N * D
    fnuz = torch.float8_e4m3fnuz
    ks = [torch.zeros((BLOCKS, half), dtype=torch.uint8) for _ in range(LAYERS)]
    vs = [torch.zeros((BLOCKS, half), dtype=torch.uint8) for _ in range(LAYERS)]
    for layer in range(LAYERS):
        ks[layer][torch.from_numpy(ids)] = pages[layer, :, :half]
        vs[layer][torch.from_numpy(ids)] = pages[layer, :, half:]
    k, v = [t.view(fnuz) for t in ks], [t.view(fnuz) for t in vs]
    return types.SimpleNamespace(k_planes=k, v_planes=v, page_format=LOCAL, reencode_sets={},
                                 plane_set=PlaneSet(k, v, **GEOM), raw=(ks, vs))


def test_a_reencoding_pairing_converts_through_its_table_on_the_cpu_twin():
    plan = negotiate(REMOTE, LOCAL)
    assert isinstance(plan, Plan) and plan.reencode is not None
    ids = np.array([4, 1, 3])
    g = torch.Generator().manual_seed(5)
    pages = torch.randint(0, 256, (LAYERS, len(ids), 2 * H * N * D), generator=g, dtype=torch.int32)
    pages = pages.to(torch.uint8)
    caches, want = _caches(pages, ids), _caches(pages, ids)
    plain = _caches(pages, ids)
    reported = []
    conversions = Conversions(None, on_reencode=lambda sat, nan: reported.append((sat, nan)))
    job = types.SimpleNamespace(caches=caches, pairs=types.SimpleNamespace(local=ids), conversion=None,
                                timings={})

    async def main():
        conversions.begin(job, None, plan)
        conversions.convert_group(job, 0, 1)
        conversions.convert_group(job, 1, LAYERS)
        await conversions.finish(job, LAYERS)

    try:
        asyncio.run(main())
    finally:
        conversions.close()
    counts = convert_blocks(want, ids, LOCAL, None, None, None, reencode_planes(want, plan))
    convert_blocks(plain, ids, LOCAL, None)  # the same permutation without the table
    for got, expected, unmapped in zip(caches.raw, want.raw, plain.raw, strict=True):
        for layer in range(LAYERS):
            assert torch.equal(got[layer], expected[layer])
            assert not torch.equal(got[layer], unmapped[layer])  # the table changed the bytes
    assert reported == [tuple(int(c) for c in counts.tolist())]
    assert reported[0][1] > 0  # random bytes hold e4m3fn NaNs (0x7f, 0xff): counted, not hidden


class _Event:
    def query(self) -> bool:
        return True


class _Prepared:
    def __init__(self, calls: list, layers: tuple[int, int]) -> None:
        self.calls, self.layers = calls, layers

    def fire(self, stream) -> _Event:
        self.calls.append(("fire", self.layers))
        return _Event()

    def drop(self) -> None:
        self.calls.append(("drop", self.layers))


class _Graphs:
    """``GraphLaunches``' calls as the daemon makes them: prepared ahead, fired, dropped or launched whole."""

    def __init__(self, take: bool = True, fail: bool = False) -> None:
        self.calls: list[tuple[str, tuple[int, int]]] = []
        self.ids: list = []  # the ids each prepare and launch was handed
        self.take, self.fail = take, fail

    def prepare(self, ids, src, layers, src_index):
        if self.fail:
            raise ValueError("block_ids: bad")
        self.ids.append(ids)
        self.calls.append(("prepare", layers))
        assert src is None or src.shape[0] == layers[1] - layers[0]  # the group's own layers if staged
        return _Prepared(self.calls, layers) if self.take else None

    def launch(self, stream, ids, src, layers, src_index):
        if self.fail:
            raise ValueError("block_ids: bad")
        self.ids.append(ids)
        self.calls.append(("launch", layers))
        return _Event()


def _graph_job(graphs: _Graphs, groups_on: bool = True, in_place: bool = False, ids=(0, 1)):
    conversions = Conversions(None, graphs=lambda: groups_on)
    conversions._stream = object()  # as on a GPU: launches go through the graphs, not the worker thread
    planes = torch.zeros((2, BLOCKS, H * N * D), dtype=torch.bfloat16)
    caches = types.SimpleNamespace(graphs=graphs, page_format=LOCAL,
                                   plane_set=PlaneSet([planes[0]], [planes[1]], **GEOM))
    job = types.SimpleNamespace(caches=caches, pairs=types.SimpleNamespace(local=np.array(ids)),
                                conversion=None, timings={}, req_id="r")
    conversions.begin(job, None if in_place else torch.zeros((3, 2, 8)), negotiate(REMOTE, REMOTE))
    return conversions, job


async def _settle(conversions: Conversions, job) -> None:
    task = asyncio.ensure_future(conversions.settle(job))
    await asyncio.sleep(0)
    conversions.poll(0.0)  # the daemon's Poller: the events are complete
    await task


def test_prepared_launches_fire_as_their_groups_land_and_the_unlanded_are_dropped():
    graphs = _Graphs()
    conversions, job = _graph_job(graphs)

    async def main():
        conversions.prepare(job, [(0, 1), (1, 2), (2, 3)])
        conversions.convert_group(job, 1, 2)  # groups land in any order
        conversions.convert_group(job, 0, 1)
        await _settle(conversions, job)  # the job ends before (2, 3) lands: its graph is let go unfired

    try:
        asyncio.run(main())
    finally:
        conversions.close()
    assert graphs.calls == [("prepare", (0, 1)), ("prepare", (1, 2)), ("prepare", (2, 3)),
                            ("fire", (1, 2)), ("fire", (0, 1)), ("drop", (2, 3))]
    assert job.conversion.prepared == {} and job.conversion.layers == 2
    assert "launch_prep" in job.timings and "launch" in job.timings


def test_a_group_not_prepared_launches_whole_when_it_lands():
    """No graph to hold (``prepare`` declined) or graphs off: the launch at landing does everything."""
    for graphs, on in ((_Graphs(take=False), True), (_Graphs(), False)):
        conversions, job = _graph_job(graphs, groups_on=on)

        async def main(conversions=conversions, job=job, on=on):
            conversions.prepare(job, [(0, 3)])
            if on:
                conversions.convert_group(job, 0, 3)
                await _settle(conversions, job)

        try:
            asyncio.run(main())
        finally:
            conversions.close()
        want = [("prepare", (0, 3)), ("launch", (0, 3))] if on else []
        assert graphs.calls == want
        assert job.conversion.prepared == {}


def test_a_prepare_that_fails_leaves_the_error_to_the_launch_at_landing():
    """Bad input fails the job as it did before launches were prepared: at the group's launch, as a Failed
    naming the conversion, not from inside the post."""
    graphs = _Graphs(fail=True)
    conversions, job = _graph_job(graphs)

    async def main():
        conversions.prepare(job, [(0, 1), (1, 3)])
        assert job.conversion.prepared == {}
        conversions.convert_group(job, 0, 1)
        conversions.convert_group(job, 1, 3)
        await conversions.finish(job, 3)

    try:
        with pytest.raises(Failed, match="convert: block_ids: bad"):
            asyncio.run(main())
    finally:
        conversions.close()
    assert graphs.calls == []


def test_a_jobs_ids_are_checked_once_for_all_its_groups(monkeypatch):
    """Every group's prepare and launch is handed the same ``CheckedIds``, made by one pass of the checks."""
    from sidecar.convert import checks

    passes = []
    real = checks._check_id_values
    monkeypatch.setattr(checks, "_check_id_values", lambda *a: passes.append(a) or real(*a))
    graphs = _Graphs(take=False)  # every group declined ahead: each launches whole at landing
    conversions, job = _graph_job(graphs, ids=(5, 0, 3))

    async def main():
        conversions.prepare(job, [(0, 1), (1, 2), (2, 3)])
        for group in ((0, 1), (1, 2), (2, 3)):
            conversions.convert_group(job, *group)
        await _settle(conversions, job)

    try:
        asyncio.run(main())
    finally:
        conversions.close()
    assert len(graphs.ids) == 6 and all(ids is graphs.ids[0] for ids in graphs.ids)
    assert isinstance(graphs.ids[0], checks.CheckedIds) and graphs.ids[0].ids.tolist() == [5, 0, 3]
    assert len(passes) == 1


def test_ids_out_of_the_caches_fail_the_job_at_its_first_launch_and_nothing_is_launched():
    """The converter's own check still stands behind the pairing's: an id past the caches is refused before
    any graph is handed it, and the job fails naming it."""
    graphs = _Graphs()
    conversions, job = _graph_job(graphs, ids=(1, BLOCKS))

    async def main():
        conversions.prepare(job, [(0, 3)])  # refused here too, quietly: the launch at landing says why
        conversions.convert_group(job, 0, 3)
        await conversions.finish(job, 3)

    try:
        with pytest.raises(Failed, match=f"block_ids holds {BLOCKS}, out of range"):
            asyncio.run(main())
    finally:
        conversions.close()
    assert graphs.calls == []


class _Gates:
    """``Gates`` as the daemon uses them (the real ones need a GPU: ``test_convert_gates_gpu.py``). A gated
    event completes once its gate is open and ``running`` lets the stood-in GPU get to it."""

    def __init__(self, calls: list, count: int = 8) -> None:
        self.calls, self.free_slots, self.opened = calls, list(range(count)), set()
        self.running, self.refuse = True, False
        self.taken = [0] * count  # times each slot was taken: an event waits on one taking
        self.opened_at: dict[int, int] = {}  # slot -> the taking it was last opened in
        self.forced: set[int] = set()  # slots opened by ``force`` in their current taking

    @property
    def closed(self) -> int:
        return sum(1 for s in range(len(self.taken)) if s not in self.free_slots and s not in self.opened)

    def take(self):
        if not self.free_slots:
            return None
        slot = self.free_slots.pop(0)
        self.taken[slot] += 1
        self.forced.discard(slot)
        return slot

    def taking(self, slot) -> int:
        return self.taken[slot]

    def close_on(self, stream, slot) -> None:
        if self.refuse:
            raise GatesUnavailable("cuStreamWaitValue32: CUDA error 801")
        self.calls.append(("close", slot, stream))

    def open(self, slot) -> bool:
        if slot in self.forced:
            self.calls.append(("open refused", slot))
            return False
        self.calls.append(("open", slot))
        self.opened.add(slot)
        self.opened_at[slot] = self.taken[slot]
        return True

    def force(self, slot, taking, disarm) -> bool:
        closed = slot not in self.free_slots and slot not in self.opened
        if not closed or slot in self.forced or self.taken[slot] != taking:
            return False
        self.forced.add(slot)
        disarm()
        self.calls.append(("force", slot))
        self.opened.add(slot)
        self.opened_at[slot] = self.taken[slot]
        return True

    def give_back(self, slot) -> None:
        assert slot in self.opened, f"gate {slot} given back closed"
        assert self.running, f"gate {slot} given back before the work behind it ran"
        self.calls.append(("give_back", slot))
        self.opened.discard(slot)
        self.free_slots.append(slot)


class _GatedEvent:
    def __init__(self, gates: _Gates, slot: int) -> None:
        self.gates, self.slot, self.taking = gates, slot, gates.taken[slot]

    def query(self) -> bool:
        return self.gates.opened_at.get(self.slot) == self.taking and self.gates.running


class _QueuedPrepared(_Prepared):
    def queue(self, stream, gates):
        slot = gates.take()
        if slot is None:
            return None
        try:
            gates.close_on(stream, slot)
        except GatesUnavailable:  # as GraphLaunches._queue: nothing queued, the gate back at once
            gates.open(slot)
            gates.give_back(slot)
            raise
        self.calls.append(("queue", self.layers))
        return _GatedEvent(gates, slot), slot

    def disarm(self) -> None:
        self.calls.append(("disarm", self.layers))


class _GatedGraphs(_Graphs):
    def prepare(self, ids, src, layers, src_index):
        self.calls.append(("prepare", layers))
        return _QueuedPrepared(self.calls, layers)


def _gated_job(gates_on: bool = True, count: int = 8, in_place: bool = False):
    graphs = _GatedGraphs()
    conversions, job = _graph_job(graphs, in_place=in_place)
    conversions._gated = lambda: gates_on
    conversions._gates = gates = _Gates(graphs.calls, count)
    conversions._gate_streams, conversions._gates_tried = ["s0", "s1"], True
    paths: list[str] = []
    conversions._on_launch = paths.append
    return conversions, job, graphs.calls, gates, paths


async def _settle_held(conversions: Conversions, job, gates: _Gates, calls: list) -> None:
    """Settle ``job`` while the stood-in GPU has not run the work behind its gates: still settling a few
    poll passes on, no gate given back; then the work runs and the settle ends."""
    gates.running = False
    given = len(calls)
    task = asyncio.ensure_future(conversions.settle(job))
    for _ in range(3):
        await asyncio.sleep(0)
        conversions.poll(0.0)
    assert not task.done() and not any(c[0] == "give_back" for c in calls[given:])
    gates.running = True
    conversions.poll(0.0)
    await task


def _run(conversions: Conversions, main) -> None:
    try:
        asyncio.run(main())
    finally:
        conversions.close()


def _slot_of(calls: list, layers: tuple[int, int]) -> int:
    """The gate a group was queued behind (its ``close`` comes right before its ``queue``)."""
    at = calls.index(("queue", layers))
    return calls[at - 1][1]


def test_gated_launches_open_as_their_groups_land_and_the_unlanded_are_disarmed_before_opening():
    conversions, job, calls, gates, paths = _gated_job()
    groups = [(0, 1), (1, 2), (2, 3)]

    async def main():
        conversions.prepare(job, groups)
        assert set(job.conversion.gated) == set(groups) and job.conversion.prepared == {}
        conversions.convert_group(job, 1, 2)  # groups land in any order: landing only opens
        conversions.convert_group(job, 0, 1)
        await _settle(conversions, job)  # the job ends before (2, 3) lands

    _run(conversions, main)
    slots = {g: _slot_of(calls, g) for g in groups}
    assert len(set(slots.values())) == 3 and {c[2] for c in calls if c[0] == "close"} == {"s1"}  # one stream
    opens = [c[1] for c in calls if c[0] == "open"]
    assert opens == [slots[(1, 2)], slots[(0, 1)], slots[(2, 3)]]
    assert calls.index(("disarm", (2, 3))) < calls.index(("open", slots[(2, 3)]))  # pointed away first
    assert ("fire", (0, 1)) not in calls and ("disarm", (0, 1)) not in calls
    assert paths == ["gated", "gated"] and job.conversion.layers == 2
    assert sorted(gates.free_slots) == list(range(8))  # every gate back once its work had run
    assert job.conversion.gated == {} and "launch" in job.timings


def test_settle_waits_until_the_work_behind_opened_gates_has_run():
    """A job is answered only once nothing it queued can still write: opening a gate is not enough."""
    conversions, job, calls, gates, _ = _gated_job()

    async def main():
        conversions.prepare(job, [(0, 1), (1, 3)])
        conversions.convert_group(job, 0, 1)
        await _settle_held(conversions, job, gates, calls)

    _run(conversions, main)
    assert sorted(gates.free_slots) == list(range(8))


def test_a_disarm_after_the_jobs_wait_was_made_is_waited_for_too():
    """The conversion's wait was made (finish) before a group was found never to land: settling still waits
    for that group's disarmed launch."""
    conversions, job, calls, gates, _ = _gated_job()

    async def main():
        conversions.prepare(job, [(0, 1), (1, 3)])
        conversions.convert_group(job, 0, 1)
        with pytest.raises(Failed, match="1 of 3 layers"):
            task = asyncio.ensure_future(conversions.finish(job, 3))
            await asyncio.sleep(0)
            conversions.poll(0.0)
            await task
        await _settle_held(conversions, job, gates, calls)  # (1, 3) is disarmed and opened, not yet run

    _run(conversions, main)
    assert ("disarm", (1, 3)) in calls and sorted(gates.free_slots) == list(range(8))


def test_a_group_launched_before_its_prepare_is_not_queued_again():
    """A read can land before the loop gets back from its post: that group launches at landing, and the
    prepare that follows queues only the others."""
    conversions, job, calls, gates, paths = _gated_job()

    async def main():
        conversions.convert_group(job, 0, 1)
        conversions.prepare(job, [(0, 1), (1, 3)])
        conversions.convert_group(job, 1, 3)
        await _settle(conversions, job)

    _run(conversions, main)
    assert ("prepare", (0, 1)) not in calls and ("queue", (1, 3)) in calls
    assert paths == ["graph", "gated"]


def test_without_a_free_gate_or_with_gates_off_a_launch_is_made_ready_as_before():
    for gates_on, count, queued in ((True, 1, [(0, 1)]), (False, 8, [])):
        conversions, job, calls, gates, paths = _gated_job(gates_on, count)

        async def main(conversions=conversions, job=job):
            conversions.prepare(job, [(0, 1), (1, 3)])
            conversions.convert_group(job, 0, 1)
            conversions.convert_group(job, 1, 3)
            await _settle(conversions, job)

        _run(conversions, main)
        assert [c[1] for c in calls if c[0] == "queue"] == queued
        assert ("fire", (1, 3)) in calls  # made ready, fired at landing
        assert paths == ["gated" if queued else "graph", "graph"]
        assert sorted(gates.free_slots) == list(range(count))


def test_in_place_launches_are_queued_behind_gates_as_staged_ones_are():
    """A direct read converts in place: with gates on, its launches are queued while it reads, as staged ones
    are (they once hung the daemon: ``GraphLaunches`` instantiated a graph with a gate closed)."""
    conversions, job, calls, gates, paths = _gated_job(in_place=True)

    async def main():
        conversions.prepare(job, [(0, 1), (1, 3)])
        assert set(job.conversion.gated) == {(0, 1), (1, 3)} and job.conversion.prepared == {}
        conversions.convert_group(job, 1, 3)
        conversions.convert_group(job, 0, 1)
        await _settle(conversions, job)

    _run(conversions, main)
    assert [c[1] for c in calls if c[0] == "queue"] == [(0, 1), (1, 3)]
    assert not any(c[0] == "fire" for c in calls)
    assert paths == ["gated", "gated"] and sorted(gates.free_slots) == list(range(8))


def test_graph_launches_are_told_while_a_gate_holds_gpu_work(monkeypatch):
    """``GraphLaunches`` captures and makes no graph while a gate is closed (instantiating one waits for the
    device): the daemon's say so from its gates, closed while a group reads, open once it landed."""
    from sidecar.convert import graphs as graphs_module

    conversions, job, calls, gates, _ = _gated_job()
    made = []
    monkeypatch.setattr(graphs_module, "GraphLaunches", lambda planes, held: made.append(held) or "graphs")
    caches = types.SimpleNamespace(graphs=None, plane_set="planes")
    assert conversions._graph_launches(caches) == "graphs" and made == [conversions._gates_held]
    assert not conversions._gates_held()

    async def main():
        conversions.prepare(job, [(0, 1), (1, 3)])
        assert conversions._gates_held() and gates.closed == 2
        conversions.convert_group(job, 0, 1)
        assert conversions._gates_held() and gates.closed == 1
        conversions.convert_group(job, 1, 3)
        assert not conversions._gates_held()
        await _settle(conversions, job)

    _run(conversions, main)
    conversions._gates = None  # gates off or unavailable: nothing is ever held
    assert not conversions._gates_held()


def test_a_stalled_loop_has_its_held_launches_let_run_disarmed_and_their_pull_fails():
    """The gate guard sees the loop silent for GATE_STALL_S with launches behind gates (stuck in a host call
    that waits for the device, so for them): it points each away from the decoder's blocks and opens its
    gate. A group that lands after that finds its gate forced, and the job fails rather than answer with
    bytes never converted. A loop that ran lately is left alone, and a gate is forced once."""
    conversions, job, calls, gates, paths = _gated_job()
    told: list[int] = []
    conversions._on_forced = told.append  # the daemon's kv_sidecar_conversion_gates_forced_total

    async def main():
        conversions.prepare(job, [(0, 1), (1, 3)])
        now = time.monotonic()
        assert conversions.force_stalled(now) == 0  # the loop ran just now
        assert conversions.force_stalled(now + GATE_STALL_S + 0.1) == 2
        assert conversions.force_stalled(now + GATE_STALL_S + 0.2) == 0
        conversions.convert_group(job, 0, 1)  # lands after the guard let it go
        with pytest.raises(Failed, match="loop stalled 5 s .* let run disarmed"):
            await asyncio.wait_for(_finish(conversions, job), 5)
        await _settle(conversions, job)

    _run(conversions, main)
    slots = [_slot_of(calls, g) for g in [(0, 1), (1, 3)]]
    # each pointed away, then opened; settling points the one that never landed away again (harmless)
    assert [c[0] for c in calls if c[0] in ("disarm", "force")] == ["disarm", "force"] * 2 + ["disarm"]
    assert [c for c in calls if c[0] in ("open", "open refused")] == [("open refused", s) for s in slots]
    assert sorted(gates.free_slots) == list(range(8))  # given back once the disarmed work had run
    assert told == [2]


async def _finish(conversions: Conversions, job) -> None:
    task = asyncio.ensure_future(conversions.finish(job, 1))
    await asyncio.sleep(0)
    conversions.poll(0.0)
    await task


@pytest.mark.parametrize("stuck", [True, False], ids=["loop-stuck", "loop-waiting"])
def test_the_gate_guard_thread_forces_gates_only_while_the_loop_is_stuck(stuck, monkeypatch):
    """The guard's own thread, reading the loop's ``Health`` tick as the daemon's does: the loop blocked in a
    call (a sleep stands in for a driver call that waits for the device) has its gates forced; a loop that
    only awaits (a long read) keeps them."""
    from sidecar.daemon import conversion as conversion_module
    from sidecar.ops.metrics import Health

    monkeypatch.setattr(conversion_module, "GATE_STALL_S", 0.3)
    monkeypatch.setattr(conversion_module, "GUARD_TICK_S", 0.02)
    conversions, job, calls, gates, _ = _gated_job()
    health = Health()
    conversions._loop_seen = lambda: health.last_tick

    async def main():
        beat = asyncio.ensure_future(health.beat(0.02))
        await asyncio.sleep(0)
        conversions.prepare(job, [(0, 1)])
        if stuck:
            time.sleep(1.0)
        else:
            await asyncio.sleep(1.0)
        forced = [c for c in calls if c[0] == "force"]
        beat.cancel()
        conversions.convert_group(job, 0, 1)
        await _settle(conversions, job)
        return forced

    forced = []
    _run(conversions, lambda: _collect(main(), forced))
    assert len(forced) == (1 if stuck else 0), calls
    assert job.conversion.forced is stuck


async def _collect(coro, into: list) -> None:
    into.extend(await coro)


def test_a_driver_that_refuses_the_gates_wait_turns_gates_off_and_launches_at_landing(caplog):
    conversions, job, calls, gates, paths = _gated_job()
    gates.refuse = True

    async def main():
        conversions.prepare(job, [(0, 1), (1, 3)])
        conversions.convert_group(job, 0, 1)
        conversions.convert_group(job, 1, 3)
        await _settle(conversions, job)

    with caplog.at_level("WARNING", logger="kv_sidecar.conversion"):
        _run(conversions, main)
    assert ("fire", (0, 1)) in calls and ("fire", (1, 3)) in calls and paths == ["graph", "graph"]
    assert conversions._gate_stream() is None  # off for good
    assert caplog.text.count("conversion gates off: cuStreamWaitValue32: CUDA error 801") == 1
    assert sorted(gates.free_slots) == list(range(8))


def test_gates_are_opened_only_once_they_are_asked_for(caplog, monkeypatch):
    """With conversion_gates off (the default) nothing is tried, so a host without stream memory waits (ROCm)
    logs nothing; turned on later, the first prepare tries once, and where they are missing says so once."""
    from sidecar.convert import gates as gates_module

    def missing(*args, **kwargs):
        raise GatesUnavailable("no CUDA driver library: libcuda.so.1")

    monkeypatch.setattr(gates_module, "Gates", missing)
    on = [False]
    conversions = Conversions(None, graphs=lambda: True, gates=lambda: on[0])
    conversions._stream = object()
    try:
        with caplog.at_level("WARNING", logger="kv_sidecar.conversion"):
            assert conversions._gate_stream() is None
            assert "gates off" not in caplog.text
            on[0] = True
            assert conversions._gate_stream() is None and conversions._gate_stream() is None
    finally:
        conversions.close()
    assert caplog.text.count("conversion gates off: no CUDA driver library") == 1


@pytest.mark.parametrize("loading", [None, "LAZY", "EAGER"])
def test_gates_opened_under_lazy_module_loading_say_how_to_load_eagerly(loading, caplog, monkeypatch):
    """A kernel's first launch behind a closed gate holds every stream's later work with lazy loading (an
    H100, 2026-12-06), eager loading not: gates opened under lazy loading (unset: torch's default) warn once,
    naming the variable."""
    from sidecar.convert import gates as gates_module
    from sidecar.daemon import conversion as conversion_module

    monkeypatch.setattr(gates_module, "Gates", lambda count: object())
    monkeypatch.setattr(conversion_module, "make_stream", lambda gpu, limits=None: object())
    if loading is None:
        monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    else:
        monkeypatch.setenv("CUDA_MODULE_LOADING", loading)
    conversions = Conversions(0, graphs=lambda: True, gates=lambda: True)
    conversions._stream = object()
    try:
        with caplog.at_level("WARNING", logger="kv_sidecar.conversion"):
            assert conversions._gate_stream() is not None and conversions._gate_stream() is not None
    finally:
        conversions.close()
    assert caplog.text.count("set CUDA_MODULE_LOADING=EAGER") == (0 if loading == "EAGER" else 1)


def test_a_failed_launch_beside_a_gated_one_still_gives_its_gate_back():
    """A group whose launch fails on the host fails the job, but the gated launch beside it ran (its event
    was seen complete): its gate is free again. Before, any error in the job's wait kept every gate of the
    job out of use for good, and each such pull took gates until none were left."""
    conversions, job, calls, gates, _ = _gated_job()
    graphs = job.caches.graphs

    async def main():
        conversions.prepare(job, [(0, 1)])  # (1, 3) is not made ready: it launches whole when it lands
        conversions.convert_group(job, 0, 1)
        graphs.fail = True
        conversions.convert_group(job, 1, 3)  # its launch fails on the host: nothing of it was queued
        task = asyncio.ensure_future(conversions.finish(job, 3))
        await asyncio.sleep(0)
        conversions.poll(0.0)
        with pytest.raises(Failed, match="block_ids: bad"):
            await task
        await _settle(conversions, job)

    _run(conversions, main)
    assert sorted(gates.free_slots) == list(range(8))


class _Stream:
    """A GPU stream stood in for: its work in order, each item marked run by the test."""

    def __init__(self) -> None:
        self.queued: list[dict] = []


class _StreamEvent:
    """``torch.cuda.Event`` on ``_Stream``: complete once the work queued before its record has run."""

    def __init__(self) -> None:
        self.before: list[dict] = []

    def record(self, stream: _Stream) -> None:
        self.before = list(stream.queued)

    def query(self) -> bool:
        return all(work["ran"] for work in self.before)


def test_work_a_failed_launch_queued_before_failing_is_waited_for_before_the_job_settles(monkeypatch):
    """A sliced launch queues its slices one by one; one that fails after an earlier slice was queued leaves
    that slice on the stream, reading the staging slots and writing the decoder's blocks. The job's wait (so
    its answer and the slots' return) must cover it, not only the event of the group before."""
    from sidecar.daemon import conversion as conversion_mod

    monkeypatch.setattr(torch.cuda, "Event", _StreamEvent)
    stream = _Stream()

    def launch_gpu(on, caches, ids, fmt, src, layers, *rest):
        on.queued.append({"ran": False, "layers": layers})  # a slice queued
        if layers == (1, 2):
            raise RuntimeError("CUDA error: out of memory")  # the next slice's launch fails
        event = _StreamEvent()
        event.record(on)
        return event

    monkeypatch.setattr(conversion_mod, "launch_gpu", launch_gpu)
    conversions = Conversions(None)
    conversions._stream = stream  # as on a GPU; graphs off: the ordinary launch
    caches = types.SimpleNamespace(page_format=LOCAL, graphs=None)
    job = types.SimpleNamespace(caches=caches, pairs=types.SimpleNamespace(local=np.array([0, 1])),
                                conversion=None, timings={}, req_id="r")
    conversions.begin(job, torch.zeros((LAYERS, 2, 8)), negotiate(REMOTE, REMOTE))

    async def main():
        conversions.convert_group(job, 0, 1)
        conversions.convert_group(job, 1, 2)  # fails, its first slice queued
        stream.queued[0]["ran"] = True
        settle = asyncio.ensure_future(conversions.settle(job))
        for _ in range(5):
            await asyncio.sleep(0)
            conversions.poll(0.0)
        assert not settle.done()  # the failed launch's slice still runs
        stream.queued[1]["ran"] = True
        conversions.poll(0.0)
        await asyncio.wait_for(settle, 1.0)
        with pytest.raises(Failed, match="out of memory"):
            await conversions.finish(job, LAYERS)

    try:
        asyncio.run(main())
    finally:
        conversions.close()
