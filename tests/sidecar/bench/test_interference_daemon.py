"""The interference bench's daemon source: its pure parts, its refusals, its bit-exact check, and a real run
on the CPU at a tiny size (prefill emulator, ``kv-sidecar serve`` and the decoder with the shim: real
processes, real NIXL over UCX loopback, real ZMQ)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from sidecar.bench import break_even, interference
from sidecar.bench.interference_daemon import DaemonPlan, analyse, daemon_plan, parse_cells
from sidecar.bench.interference_decoder import PhaseReply, PullRecord
from sidecar.bench.interference_roles import Setting


def _table() -> dict[str, Setting]:
    p = interference.argparse.ArgumentParser()
    interference.add_arguments(p)
    return interference.settings_table(p.parse_args([]))


def test_settings_map_to_daemon_keys_or_are_refused() -> None:
    t = _table()
    assert daemon_plan(t["none"], 50.0) == DaemonPlan("none", {}, False, 0, False)
    assert daemon_plan(t["slice"], 50.0).config == {"conversion_max_step_delay_us": "50.0"}
    assert daemon_plan(t["mps-cap"], 50.0) == DaemonPlan("mps-cap", {}, True, 20, False)
    assert daemon_plan(t["mps"], 50.0).mps and daemon_plan(t["priority"], 50.0).decoder_high_priority
    for name in ("grid", "paced", "mps-cap-paced"):
        with pytest.raises(ValueError, match=rf"setting '{name}'.*--source launch"):
            daemon_plan(t[name], 50.0)


def test_cells() -> None:
    want = [(4096, 10.0), (4096, 20.0), (4096, 50.0), (16384, 10.0)]
    assert parse_cells("4096:0,10,20,50 16384:0,10") == want
    assert parse_cells("64:2.5") == [(64, 2.5)]
    for bad in ("", "4096", "4096:", "x:1", "4096:1;2", "0:5", "4096:-1"):
        with pytest.raises(ValueError, match="--cells"):
            parse_cells(bad)


def test_refusals_before_any_process(tmp_path) -> None:
    base = ["--tiny", "--device", "cpu", "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match="grid.*--source launch"):
        interference.main([*base, "--settings", "none,grid"])
    with pytest.raises(SystemExit, match="--cells: only with --source daemon"):
        interference.main([*base, "--source", "launch", "--cells", "64:1"])
    with pytest.raises(SystemExit, match="--cells"):
        interference.main([*base, "--cells", "64"])


def test_analyse_counts_pulls_and_steps_overlapping_them() -> None:
    steps = [(0.0, 0.010), (0.010, 0.030), (0.030, 0.040), (0.040, 0.050)]
    pulls = [PullRecord(arrival=0.011, sent=0.012, done=0.025, ok=True, reason="",
                        timings={"convert": 0.002}),
             PullRecord(arrival=0.041, sent=0.0415, done=0.045, ok=False, reason="boom", timings={})]
    r = analyse(PhaseReply(steps=steps, pulls=pulls, unanswered=1, sent_late=3, not_sent=2,
                           emulator_errors=[], emulator_full=4, verified=None),
                {"p50": 10.0, "p99": 10.0}, 0.010)
    assert r["collided"]["count"] == 2  # the 2nd and the 4th step overlap a pull in flight
    assert r["conversions"] == 1 and r["conversion_e2e"]["n"] == 1
    assert r["conversion_e2e"]["p50"] == pytest.approx(13.0)
    assert r["arrival_to_done"]["p50"] == pytest.approx(14.0)
    assert r["pulls"] == {"answered": 2, "ok": 1, "failed": 1, "unanswered": 1, "sent_late": 3,
                          "not_sent": 2, "emulator_full": 4, "failures": ["boom"], "emulator_errors": []}
    assert r["daemon_stages"]["convert"]["p50"] == pytest.approx(2.0)
    assert r["step_p50_ratio"] == pytest.approx(1.0)
    # mean step 12.5 ms against 10 ms over 4 steps, one conversion: 10 ms of extra step time
    assert r["interference_ms_per_conversion"] == pytest.approx(10.0)


def test_problems_fail_the_run() -> None:
    from sidecar.bench.interference_daemon import problems

    ok_pulls = {"failed": 0, "unanswered": 0, "not_sent": 0, "emulator_errors": []}
    good = {"setting": "none", "context": 64, "rate": 20.0, "pulls": ok_pulls,
            "verified": {"requests": 1, "mismatches": 0}}
    assert problems({"groups": [{"settings": ["none"], "phases": [good]}, {"skipped": "MPS"}]}) == []
    bad = [{**good, "pulls": {**ok_pulls, "failed": 1}}, {**good, "verified": None},
           {**good, "verified": {"requests": 1, "mismatches": 3}}]
    groups = [{"settings": ["none"], "phases": bad}, {"settings": ["mps"], "error": "boom"}]
    out = problems({"groups": groups})
    assert len(out) == 4 and out[0] == "['mps']: boom" and all("none 64 @ 20/s" in o for o in out[1:])


def test_bit_exact_check_finds_one_flipped_byte() -> None:
    """The check the bench runs per phase: the decoder's blocks hold the reference conversion of the
    emulator's pages -> no mismatch; one byte changed -> exactly that (layer, block, plane)."""
    from sidecar.bench.e2e_roles import mismatched_planes
    from sidecar.standins.decoder import DecoderStandin, StandinShape, expected_planes
    from sidecar.standins.emulator_control import NewRequestReply

    shape = StandinShape(layers=2, heads=2, head_size=64, block_size=16, num_blocks=16)
    kb, gens, local = [5, 2, 9], [0, 3, 1], [7, 1, 12]
    reply = NewRequestReply(kv_transfer_params={}, kernel_block_ids=kb, block_generations=gens,
                            num_tokens=48)
    with DecoderStandin("ipc:///tmp/kvs-unused.sock", shape, compat_factors={}) as standin:
        for layer in range(2):
            k, v = expected_planes(reply, 4, shape.remote_fmt, layer, 3)
            ids = torch.tensor(local)
            standin.k_plane(layer).view(torch.uint8)[ids] = torch.from_numpy(k)
            standin.v_plane(layer).view(torch.uint8)[ids] = torch.from_numpy(v)
        assert mismatched_planes(standin, kb, gens, local, 4, shape.remote_fmt, [0, 1]) == []
        standin.v_plane(1).view(torch.uint8)[12, 77] ^= 1
        assert mismatched_planes(standin, kb, gens, local, 4, shape.remote_fmt, [0, 1]) == [
            "layer 1 block 12 V plane"]
        assert mismatched_planes(standin, kb, gens, local, 5, shape.remote_fmt, [0]) != []  # other seed


def test_daemon_source_end_to_end_on_cpu(tmp_path, capsys) -> None:
    rc = interference.main(["--tiny", "--device", "cpu", "--batch", "2", "--context-min", "32",
                            "--context-max", "64", "--cells", "64:0,20 128:20", "--settings", "none,mps",
                            "--phase-s", "1", "--alone-reps", "2", "--pull-slots", "3",
                            "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    r = json.loads((tmp_path / "interference.json").read_text())
    assert (tmp_path / "interference.png").stat().st_size > 0
    assert r["source"] == "daemon" and r["device"] == "cpu" and r["date"] and "--cells" in r["command"]
    assert r["cells"] == [[64, 20.0], [128, 20.0]]
    run, skipped = r["groups"]
    assert skipped == {"settings": ["mps"], "skipped": "MPS needs an NVIDIA GPU and nvidia-cuda-mps-control"}
    assert "error" not in run, run.get("daemon_log_tail")
    assert run["settings"] == ["none"] and run["daemon_config"] == {}
    assert run["daemon_mode_line"].startswith("conversions: CPU twin")  # logged by the real daemon
    for c in ("64", "128"):
        assert run["alone"][c]["ok"] == 2 and run["alone_ms"]["none"][c] > 0
    assert run["baseline"]["n"] > 10 and run["baseline_end"]["n"] > 10
    assert [(p["setting"], p["context"], p["rate"]) for p in run["phases"]] == [("none", 64, 20.0),
                                                                                ("none", 128, 20.0)]
    for p in run["phases"]:
        assert p["step"]["n"] > 10 and 0 <= p["collided"]["count"] <= p["step"]["n"]
        pulls = p["pulls"]
        assert pulls["ok"] >= 5 and pulls["ok"] == pulls["answered"] == p["conversions"], pulls
        assert pulls["unanswered"] == pulls["not_sent"] == 0, pulls
        assert pulls["failures"] == [] and pulls["emulator_errors"] == [], pulls
        assert p["conversion_e2e"]["n"] == pulls["ok"] and 0 < p["conversion_e2e"]["p50"] < 5000
        assert p["arrival_to_done"]["p50"] >= p["conversion_e2e"]["p50"] - 1e-6
        assert p["daemon_stages"]["end_to_end"]["n"] == pulls["ok"]
        assert p["verified"] == {"requests": 1, "layers": [0, 1], "mismatches": 0, "first": [], "error": ""}
    assert "| none | off | 128 | 20 |" in out
    assert break_even.main([str(tmp_path / "interference.json")]) == 0
    be = json.loads((tmp_path / "break-even.json").read_text())
    assert {(row["setting"], row["context"]) for row in be["rows"]} == {("none", 64), ("none", 128)}
    assert np.isfinite(be["rows"][0]["kernel_ms"])
