"""Graph-replayed launches (``GraphLaunches``) on a GPU, out of place (staged) and in place (direct): the same
bytes as the ordinary launch for every request, captured once and replayed with each new request's tables,
nothing written outside a request's own blocks (the planes are compared whole: every other block is canary,
and so is a guard row on each side of every plane, where a padding row's id -1 would land), the ordinary way
taken when no graph is free or a capture failed, and bad input refused before anything is queued."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sidecar.convert import PlaneSet
from sidecar.convert.launch import launch_gpu, make_stream
from sidecar.wire import fp8
from sidecar.wire.formats import AITER_SHUFFLED

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]
DEV = "cuda:0"
BLOCKS = 64


class GraphRig:
    """Two copies of random planes: one converted by graphs, one by the ordinary launch, then compared."""

    def __init__(self, h: int, n: int, d: int, layers: int = 3, seed: int = 0, dtype=torch.bfloat16) -> None:
        from sidecar.convert.graphs import GraphLaunches

        self.h, self.n, self.d, self.layers = h, n, d, layers
        self.row = h * n * d
        gen = torch.Generator(device=DEV).manual_seed(seed)
        # each plane is the middle of a buffer with a guard row on either side
        self.buffers = [self._random((BLOCKS + 2, self.row), gen, dtype) for _ in range(2 * layers)]
        self.guards = [torch.stack([b[0], b[-1]]).clone() for b in self.buffers]
        self.k = [b[1:-1] for b in self.buffers[:layers]]
        self.v = [b[1:-1] for b in self.buffers[layers:]]
        self.k2 = [t.clone() for t in self.k]
        self.v2 = [t.clone() for t in self.v]
        geom = dict(num_heads=h, block_size=n, head_size=d)
        self.ps = PlaneSet(self.k, self.v, **geom)
        self.ordinary = type("Caches", (), {"plane_set": PlaneSet(self.k2, self.v2, **geom)})()
        self.src = self._random((layers, 3 * BLOCKS, 2 * self.row), gen, dtype)
        self.stream = make_stream(torch.device(DEV))
        self.stream.wait_stream(torch.cuda.current_stream(DEV))
        self.graphs = GraphLaunches(self.ps, per_key=2)
        self.rng = np.random.default_rng(seed)

    @staticmethod
    def _random(shape, gen, dtype):
        t = torch.empty(shape, dtype=torch.int16, device=DEV)
        t.random_(-(2**15), 2**15, generator=gen)
        return t.view(dtype)

    def request(self, m: int, indexed: bool):
        ids = self.rng.choice(BLOCKS, m, replace=False).astype(np.int64)
        if not indexed:
            return ids, self.src[:, :m], None
        return ids, self.src, self.rng.choice(self.src.shape[1], m, replace=False).astype(np.int64)

    def both(self, ids, src, rows, layers):
        """The request through graphs and the ordinary way; the graphs' event (None: not taken). ``src``
        None: in place."""
        part = None if src is None else src[layers[0] : layers[1]]
        event = self.graphs.launch(self.stream, ids, part, layers, rows)
        launch_gpu(self.stream, self.ordinary, ids, AITER_SHUFFLED, part, layers, None, None, None, rows)
        return event

    def assert_same(self, what: str) -> None:
        self.stream.synchronize()
        for a, b, name in ((self.k, self.k2, "K"), (self.v, self.v2, "V")):
            for layer, (x, y) in enumerate(zip(a, b, strict=True)):
                same = torch.equal(x.view(torch.int16), y.view(torch.int16))
                assert same, f"{what}: {name} plane of layer {layer} differs from the ordinary launch"
        for i, (buf, guard) in enumerate(zip(self.buffers, self.guards, strict=True)):
            kept = torch.equal(torch.stack([buf[0], buf[-1]]).view(torch.int16), guard.view(torch.int16))
            assert kept, f"{what}: a guard row of plane buffer {i} was written"


@pytest.mark.parametrize(("h", "n", "d"), [(8, 16, 128), (3, 32, 64), (1, 16, 256)], ids=str)
@pytest.mark.parametrize("indexed", [False, True], ids=["staged", "indexed"])
def test_replays_convert_each_new_request_like_the_ordinary_launch(h, n, d, indexed):
    from sidecar.convert.graph_tables import bucket

    rig = GraphRig(h, n, d, seed=h + n + d)
    # sizes that share a bucket (17 and 18), pad (19 -> 20), come back after others, and one block
    sizes, groups = (5, 5, 17, 18, 19, 5, 1, 33, 33, 20, 18, 5), ((0, 3), (0, 1), (1, 3))
    for m in sizes:
        for layers in groups:
            ids, src, rows = rig.request(m, indexed)
            event = rig.both(ids, src, rows, layers)
            assert event is not None, f"{m} blocks, layers {layers}: not taken"
            rig.assert_same(f"{m} blocks, layers {layers}")
    # each launch found its key's graph idle (synchronised above): one capture per key, the rest replays
    keys = {(last - first, bucket(m)) for m in sizes for first, last in groups}
    assert rig.graphs.stats == {"captures": len(keys), "replays": len(sizes) * len(groups) - len(keys),
                                "declined": 0}


@pytest.mark.parametrize(("h", "n", "d"), [(8, 16, 128), (3, 32, 64), (1, 16, 256)], ids=str)
def test_in_place_replays_convert_each_new_request_like_the_ordinary_launch(h, n, d):
    """Direct reads convert in place: a padding row there must write nothing (its id is PAD_ID, -1, whose
    block would be the guard row before the plane), and each request converts exactly its own blocks."""
    from sidecar.convert.graph_tables import bucket

    rig = GraphRig(h, n, d, seed=2 * h + n + d)
    sizes, groups = (5, 17, 19, 19, 33, 1, 20, 5), ((0, 3), (1, 3))  # 19 -> 20 and 33 -> 36 pad
    for m in sizes:
        for layers in groups:
            ids = rig.rng.choice(BLOCKS, m, replace=False).astype(np.int64)
            assert rig.both(ids, None, None, layers) is not None, f"{m} blocks, layers {layers}: not taken"
            rig.assert_same(f"in place, {m} blocks, layers {layers}")
    keys = {(last - first, bucket(m)) for m in sizes for first, last in groups}
    assert rig.graphs.stats == {"captures": len(keys), "replays": len(sizes) * len(groups) - len(keys),
                                "declined": 0}


def test_in_place_and_out_of_place_graphs_of_one_size_are_kept_apart():
    """One bucket and layer count, both forms alternating: each replays its own graph (its own kernel)."""
    rig = GraphRig(8, 16, 128, seed=21)
    for i in range(6):
        ids, src, rows = rig.request(12, True)
        assert rig.both(ids, None if i % 2 else src, None if i % 2 else rows, (0, 3)) is not None
        rig.assert_same(f"launch {i} ({'in place' if i % 2 else 'out of place'})")
    assert rig.graphs.stats == {"captures": 2, "replays": 4, "declined": 0}


def test_an_in_place_launch_with_source_rows_is_refused():
    rig = GraphRig(8, 16, 128, seed=22)
    with pytest.raises(ValueError, match="src_index needs a source"):
        rig.graphs.launch(rig.stream, np.array([1, 2]), None, (0, 3), np.array([0, 1]))
    rig.assert_same("refused")


def test_a_graph_taken_by_another_layer_range_or_source_gets_that_ones_meta():
    """Layer ranges of one length share a graph; a table is given a new meta only when the launch's layers or
    source differ from its last one, so alternating them must still convert each request from its own."""
    rig = GraphRig(8, 16, 128, seed=9)
    other = GraphRig._random(tuple(rig.src.shape), torch.Generator(device=DEV).manual_seed(99), rig.src.dtype)
    plan = [((0, 1), rig.src), ((1, 2), rig.src), ((1, 2), other), ((2, 3), other), ((0, 1), rig.src),
            ((0, 1), rig.src), ((2, 3), rig.src)]
    for i, (layers, src) in enumerate(plan):
        ids = rig.rng.choice(BLOCKS, 7, replace=False).astype(np.int64)
        rows = rig.rng.choice(src.shape[1], 7, replace=False).astype(np.int64)
        assert rig.both(ids, src, rows, layers) is not None, f"launch {i}: not taken"
        rig.assert_same(f"launch {i}: layers {layers}")
    assert rig.graphs.stats == {"captures": 1, "replays": len(plan) - 1, "declined": 0}


def test_a_busy_graph_is_never_rewritten():
    """Launches queued behind a long kernel: each key's graphs are in use, so the third launch of a key is
    declined (per_key 2) and converts nothing; the two taken convert their own requests exactly."""
    rig = GraphRig(8, 16, 128, seed=5)
    ids, src, rows = rig.request(8, True)
    rig.both(ids, src, rows, (0, 3))  # captured
    rig.assert_same("first")
    with torch.cuda.stream(rig.stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: the replays below queue behind it
    taken = []
    for _ in range(3):
        ids, src, rows = rig.request(8, True)
        event = rig.graphs.launch(rig.stream, ids, src, (0, 3), rows)
        if event is not None:
            launch_gpu(rig.stream, rig.ordinary, ids, AITER_SHUFFLED, src, (0, 3), None, None, None, rows)
        taken.append(event is not None)
    assert taken == [True, True, False]
    rig.assert_same("queued")


def test_a_failed_capture_leaves_the_request_converted_and_graphs_off(monkeypatch):
    rig = GraphRig(8, 16, 128, seed=6)

    def refuse(*_args, **_kwargs):
        raise RuntimeError("no capture here")

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", refuse)
    ids, src, rows = rig.request(9, False)
    assert rig.both(ids, src, rows, (0, 3)) is not None  # queued the ordinary way before the capture
    rig.assert_same("converted before the failed capture")
    assert "no capture here" in rig.graphs.broken
    ids, src, rows = rig.request(9, False)
    assert rig.graphs.launch(rig.stream, ids, src, (0, 3), rows) is None
    rig.assert_same("declined after it")  # the declined launch wrote nothing


def test_prepared_launches_write_nothing_until_fired_then_convert_like_the_ordinary_launch():
    """Launches made ready ahead of their bytes (the daemon does this while a read is on its way): preparing
    queues nothing, each fires with its own table in whatever order the groups land; a graph's first launch
    (not yet captured) still converts the ordinary way and captures, and the next request's replay."""
    from sidecar.convert.graphs import GraphLaunches

    rig = GraphRig(8, 16, 128, seed=11)
    rig.graphs = GraphLaunches(rig.ps)  # the daemon's default: 8 graphs a key, 4 of them held at most
    groups = [(0, 1), (1, 2), (2, 3)]  # one key: three graphs held at once
    for request in range(2):
        ids, _, rows = rig.request(12, True)
        prepared = [rig.graphs.prepare(ids, rig.src[a:b], (a, b), rows) for a, b in groups]
        assert all(p is not None for p in prepared)
        rig.assert_same(f"request {request}: prepared, none fired")  # nothing was queued
        for i in (2, 0, 1):
            a, b = groups[i]
            assert prepared[i].fire(rig.stream) is not None
            part = rig.src[a:b]
            launch_gpu(rig.stream, rig.ordinary, ids, AITER_SHUFFLED, part, (a, b), None, None, None, rows)
            rig.assert_same(f"request {request}: group {groups[i]} fired")
    assert rig.graphs.stats == {"captures": 3, "replays": 3, "declined": 0}


def test_a_held_graph_is_not_given_to_another_launch_and_a_dropped_one_writes_nothing(monkeypatch):
    """per_key 2: one graph of a key may be held; the next prepare is declined before its checks, a launch
    takes the other graph and the held one's table is still its own request's when it fires. A dropped launch
    queues nothing and its graph is free again."""
    from sidecar.convert import graphs

    rig = GraphRig(8, 16, 128, seed=12)
    ids_a, src, rows_a = rig.request(8, True)
    first = rig.graphs.prepare(ids_a, src, (0, 3), rows_a)
    assert first is not None
    ids_b, _, rows_b = rig.request(8, True)
    checked = []
    real_launch_ids = graphs.launch_ids
    monkeypatch.setattr(graphs, "launch_ids", lambda *a: checked.append(1) or real_launch_ids(*a))
    assert rig.graphs.prepare(ids_b, src, (0, 3), rows_b) is None  # half the key's graphs held already
    assert checked == []  # declined before the checks: the launch at landing makes them
    assert rig.both(ids_b, src, rows_b, (0, 3)) is not None  # a launch takes the key's other graph
    rig.assert_same("the other graph")
    first.fire(rig.stream)
    launch_gpu(rig.stream, rig.ordinary, ids_a, AITER_SHUFFLED, src, (0, 3), None, None, None, rows_a)
    rig.assert_same("the held graph, fired after the other")
    ids_c, _, rows_c = rig.request(8, True)
    dropped = rig.graphs.prepare(ids_c, src, (0, 3), rows_c)
    assert dropped is not None
    dropped.drop()
    rig.assert_same("dropped")  # nothing of ids_c was converted in either copy
    assert rig.graphs.count == 2  # the dropped launch's graph was free for the next: no third one
    ids_d, _, rows_d = rig.request(8, True)
    assert rig.graphs.prepare(ids_d, src, (0, 3), rows_d) is not None


@pytest.mark.parametrize(
    ("ids", "rows", "match"),
    [
        (np.array([1, 64]), None, "out of range"),
        (np.array([3, 3]), None, "duplicates"),
        (np.array([1, 2]), np.array([0, 999]), "src_index holds 999"),
        (np.array([1, 2]), np.array([0]), "src_index shape"),
        (np.array([1.0, 2.0]), None, "integer type"),
    ],
)
def test_bad_input_is_refused_before_anything_is_queued(ids, rows, match):
    rig = GraphRig(8, 16, 128, seed=7)
    src = rig.src if rows is not None else rig.src[:, : len(ids)]
    with pytest.raises(ValueError, match=match):
        rig.graphs.launch(rig.stream, ids, src, (0, 3), rows)
    rig.assert_same("refused")


def test_a_source_of_the_wrong_shape_is_refused():
    rig = GraphRig(8, 16, 128, seed=8)
    with pytest.raises(ValueError, match="src shape"):
        rig.graphs.launch(rig.stream, np.array([1, 2, 3]), rig.src[:, :2], (0, 3), None)
    with pytest.raises(ValueError, match="layers"):
        rig.graphs.launch(rig.stream, np.array([1, 2]), rig.src[:, :2], (2, 5), None)
    rig.assert_same("refused")


def test_graphs_do_not_take_a_reencoding_plane_set():
    from sidecar.convert.graphs import GraphLaunches

    fnuz = torch.float8_e4m3fnuz
    k = [torch.zeros((4, 8 * 16 * 128), dtype=torch.uint8, device=DEV).view(fnuz)]
    v = [torch.zeros((4, 8 * 16 * 128), dtype=torch.uint8, device=DEV).view(fnuz)]
    ps = PlaneSet(k, v, num_heads=8, block_size=16, head_size=128, lut=fp8.pair_table(1.0, 1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match="re-encode"):
        GraphLaunches(ps)
