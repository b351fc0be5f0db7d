"""The interference bench end to end on the CPU at a tiny size: real decoder and converter processes."""

from __future__ import annotations

import json

from sidecar.bench import break_even, interference


def test_bench_runs_and_writes_json(tmp_path, capsys):
    rc = interference.main(["--source", "launch", "--tiny", "--device", "cpu", "--batch", "2",
                            "--context-min", "32", "--context-max", "64", "--contexts", "64", "--rates", "20",
                            "--settings", "none,slice,mps", "--phase-s", "0.4", "--alone-reps", "2",
                            "--out", str(tmp_path)])
    assert rc == 0
    r = json.loads((tmp_path / "interference.json").read_text())
    assert (tmp_path / "interference.png").stat().st_size > 0
    run, skipped = r["groups"]
    assert "MPS" in skipped["skipped"]
    assert run["verified"] == {"none": True, "slice": True}
    assert run["baseline"]["n"] > 0 and run["baseline_end"]["n"] > 0
    assert set(run["alone_ms"]) == {"none", "slice"} and run["alone_ms"]["none"]["64"] > 0
    assert [(p["setting"], p["context"], p["rate"]) for p in run["phases"]] == [("none", 64, 20.0),
                                                                                ("slice", 64, 20.0)]
    for p in run["phases"]:
        assert p["step"]["n"] > 0 and p["collided"]["count"] <= p["step"]["n"]
        assert p["conversions"] == p["conversion_e2e"]["n"]
    assert "| none | off | 64 | 20 |" in capsys.readouterr().out
    assert break_even.main([str(tmp_path / "interference.json")]) == 0
    be = json.loads((tmp_path / "break-even.json").read_text())
    assert {row["setting"] for row in be["rows"]} == {"none", "slice"}
    assert (tmp_path / "break-even.png").stat().st_size > 0
