"""The loop's pieces (``ops/pieces.py``): every named function exists, wrapping times each call and keeps
what the function returns or raises, and the samples are written as p50 / p90 / n."""

from __future__ import annotations

import gc
import json
import threading
import time

import pytest

from sidecar.ops import pieces


@pytest.mark.parametrize(("piece", "target"), sorted(pieces.PIECES.items()))
def test_every_piece_names_a_function_that_exists(piece, target):
    """A renamed function must fail here, not leave the piece silently untimed."""
    owner, name, fn = pieces.resolve(target)
    assert callable(fn) and getattr(owner, name) is fn, piece


def test_a_missing_function_is_an_error():
    with pytest.raises(AttributeError):
        pieces.resolve("sidecar.daemon.reads:Reads.no_such_method")


class _Work:
    def spin(self, seconds: float) -> str:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass
        return "done"

    def fail(self) -> None:
        raise ValueError("boom")


def test_wrapped_calls_are_timed_and_behave_as_before(tmp_path, monkeypatch):
    timing = pieces.Pieces(str(tmp_path / "p.json"))
    monkeypatch.setattr(_Work, "spin", timing.wrap("spin", _Work.spin))
    monkeypatch.setattr(_Work, "fail", timing.wrap("fail", _Work.fail))
    work = _Work()
    assert [work.spin(0.002) for _ in range(5)] == ["done"] * 5
    with pytest.raises(ValueError, match="boom"):
        work.fail()
    timing.dump()
    got = json.loads((tmp_path / "p.json").read_text())
    assert got["spin"]["n"] == 5 and got["fail"]["n"] == 1
    assert 2000 <= got["spin"]["p50_us"] < 50_000  # 2 ms of thread CPU spun, measured as thread CPU
    assert got["spin"]["p90_us"] >= got["spin"]["p50_us"]
    assert got["spin"]["wall_p50_us"] >= got["spin"]["p50_us"] * 0.9  # wall never far below CPU


def test_a_waiting_call_shows_wall_time_above_its_cpu(tmp_path):
    timing = pieces.Pieces(str(tmp_path / "p.json"))
    nap = timing.wrap("nap", lambda: time.sleep(0.01))
    for _ in range(3):
        nap()
    got = timing.summary()["nap"]
    assert got["wall_p50_us"] >= 10_000 and got["p50_us"] < 5_000, got


def test_a_coroutine_is_timed_by_wall_time_only(tmp_path):
    import asyncio

    timing = pieces.Pieces(str(tmp_path / "p.json"))

    async def nap() -> str:
        await asyncio.sleep(0.01)
        return "woke"

    timed = timing.wrap("nap", nap)
    assert asyncio.run(timed()) == "woke"
    got = timing.summary()["nap"]
    assert set(got) == {"wall_p50_us", "wall_p90_us", "wall_max_us", "n", "calls"}
    assert got["wall_p50_us"] >= 10_000


class _Static:
    @staticmethod
    def double(x: int) -> int:
        return 2 * x


def test_a_staticmethod_stays_static_when_installed(tmp_path, monkeypatch):
    monkeypatch.setattr(_Static, "double", _Static.__dict__["double"])  # restored after the test
    timing = pieces.install(str(tmp_path / "p.json"), {"double": f"{__name__}:_Static.double"})
    assert _Static().double(21) == 42 and _Static.double(4) == 8  # not handed the instance as x
    assert timing.calls["double"] == 2


def test_samples_are_written_while_running_by_a_thread_and_only_the_latest_are_kept(tmp_path, monkeypatch):
    """The file is rewritten by the pieces' own thread, not inside a timed call (sorting every piece's
    samples took 50-130 ms there); the slow calls only at exit."""
    monkeypatch.setattr(pieces, "DUMP_EVERY_S", 0.01)
    monkeypatch.setattr(pieces, "KEEP", 5)
    path = tmp_path / "p.json"
    timing = pieces.Pieces(str(path))
    for i in range(8):
        timing.add("x", (i + 1) * 1e-6)
    timing.add("y", 0.001, 0.001, time.perf_counter())  # one slow call
    assert not path.exists()  # adding never writes
    timing.start()
    try:
        deadline = time.monotonic() + 5
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        timing.stop()  # after the write in progress: the file is whole
    got = json.loads(path.read_text())["x"]
    # samples 4..8 us: the first 3 dropped
    assert got == {"p50_us": 6.0, "p90_us": 7.0, "max_us": 8.0, "n": 5, "calls": 8}
    # the slow calls wait for the dump at exit: encoding them all would hold the GIL against the loop
    assert not (tmp_path / "p.slow.json").exists()
    timing.dump()
    assert [c["piece"] for c in json.loads((tmp_path / "p.slow.json").read_text())] == ["y"]


def test_slow_calls_are_kept_one_by_one_with_when_they_began(tmp_path, monkeypatch):
    timing = pieces.Pieces(str(tmp_path / "p.json"))
    monkeypatch.setattr(_Work, "spin", timing.wrap("spin", _Work.spin))
    before = time.perf_counter()
    _Work().spin(0.002)  # 2 ms: slow
    _Work().spin(0.0)  # quick: in the summary only
    timing.dump()
    (slow,) = json.loads((tmp_path / "p.slow.json").read_text())
    assert slow["piece"] == "spin" and slow["thread"] == threading.current_thread().name
    assert before <= slow["began_s"] <= time.perf_counter()
    assert slow["wall_us"] >= slow["cpu_us"] * 0.9 >= 1500
    assert json.loads((tmp_path / "p.json").read_text())["spin"]["calls"] == 2


def test_the_slow_threshold_is_the_callers(tmp_path, monkeypatch):
    """``loop_pieces_slow_us`` sets it: a call of 0.3 ms of CPU is kept at 0.1 ms, not at 1 s."""
    for slow_s, kept in ((1.0, 0), (0.0001, 1)):
        timing = pieces.Pieces(str(tmp_path / f"p{kept}.json"), slow_s)
        monkeypatch.setattr(_Work, "spin", timing.wrap("spin", _Work.spin))
        _Work().spin(0.0003)
        timing.dump()
        assert len(json.loads((tmp_path / f"p{kept}.slow.json").read_text())) == kept


def test_a_file_that_cannot_be_written_is_logged_once(tmp_path, caplog):
    timing = pieces.Pieces(str(tmp_path / "no-such-dir" / "p.json"))
    timed = timing.wrap("f", lambda: 42)
    assert [timed() for _ in range(3)] == [42, 42, 42]
    timing.dump()
    timing.dump()
    assert timing.calls["f"] == 3
    assert sum("cannot write" in r.message for r in caplog.records) == 1


def test_garbage_collections_are_timed_by_generation(tmp_path):
    timing = pieces.Pieces(str(tmp_path / "p.json"))
    callback = pieces.time_collections(timing, serving_only=False)
    try:
        gc.collect(0)
        gc.collect(2)
    finally:
        gc.callbacks.remove(callback)
    got = timing.summary()
    assert got["gc.gen0"]["calls"] >= 1 and got["gc.gen2"]["calls"] >= 1, got
    assert got["gc.gen2"]["wall_max_us"] > 0


def test_collections_before_the_start_up_freeze_are_not_timed(tmp_path):
    timing = pieces.Pieces(str(tmp_path / "p.json"))
    callback = pieces.time_collections(timing)
    try:
        gc.unfreeze()  # an in-process daemon of an earlier test may have frozen the test process's objects
        gc.collect(2)
        assert timing.summary() == {}
        gc.freeze()
        gc.collect(2)
    finally:
        gc.unfreeze()
        gc.callbacks.remove(callback)
    assert timing.summary()["gc.gen2"]["calls"] == 1
