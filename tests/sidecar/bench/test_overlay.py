"""The overlay of a batch's longest wait and the daemon's slow calls (``bench/overlay.py``)."""

from __future__ import annotations

import json

from sidecar.bench import overlay


def _e2e(start_s: float = 100.0) -> dict:
    requests = [
        {"sent_at": 0.1, "delivery": 0.2, "accept": 0.5},
        {"sent_at": 0.1, "delivery": 0.2, "accept": 6.0},  # received at +0.3, first step at +6.3 ms
    ]
    batch = {"max_accept_ms": 6.0, "start_s": start_s, "requests": requests}
    cell = {"mode": "staged", "order": "contiguous", "context": 4096, "concurrency": 8, "timelines": [batch]}
    return {"cells": [cell]}


def test_only_calls_that_overlap_the_longest_wait_are_listed():
    slow = [
        # ends at +0.2 ms, before the Pull came in
        {"piece": "poll", "thread": "MainThread", "began_s": 100.0001, "wall_us": 100.0, "cpu_us": 90.0},
        {"piece": "poll", "thread": "MainThread", "began_s": 100.002, "wall_us": 3000.0, "cpu_us": 2900.0},
        {"piece": "post", "thread": "post_0", "began_s": 100.006, "wall_us": 1000.0, "cpu_us": None},
        # begins at +6.5 ms, after the Pull's first step
        {"piece": "answer", "thread": "MainThread", "began_s": 100.0065, "wall_us": 600.0, "cpu_us": 500.0},
    ]
    (w,) = overlay.waits(_e2e(), slow)
    assert (w.cell, w.accept_ms, w.received_ms, w.started_ms) == ("staged/contiguous 4096 x 8", 6.0, 0.3, 6.3)
    assert [(c.piece, c.began_ms, c.ended_ms, c.cpu_ms) for c in w.overlapping] == [
        ("poll", 2.0, 5.0, 2.9),
        ("post", 6.0, 7.0, None),
    ]


def test_a_file_from_before_the_start_was_kept_is_skipped():
    e2e = _e2e()
    del e2e["cells"][0]["timelines"][0]["start_s"]
    assert overlay.waits(e2e, []) == []


def test_the_command_prints_each_wait(tmp_path, capsys):
    (tmp_path / "e2e.json").write_text(json.dumps(_e2e()))
    slow = [{"piece": "poll", "thread": "MainThread", "began_s": 100.002, "wall_us": 3e3, "cpu_us": 2.9e3}]
    (tmp_path / "p.slow.json").write_text(json.dumps(slow))
    assert overlay.main([str(tmp_path / "e2e.json"), str(tmp_path / "p.slow.json")]) == 0
    out = capsys.readouterr().out
    assert "accept 6.00 ms, received at +0.30, first step at +6.30 ms; 1 slow calls" in out
    assert "poll" in out and "+2.00 .. +5.00 ms, cpu 2.90" in out
