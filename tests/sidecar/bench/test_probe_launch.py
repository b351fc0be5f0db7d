"""``kv-sidecar bench launch`` on the CPU: both paths run, and its bytes check fails a wrong path."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from sidecar.bench import probe_launch as pl


def test_layer_groups_cover_every_layer_once():
    for layers in range(1, 40):
        for per in range(1, layers + 2):
            got = pl.layer_groups(layers, per)
            assert [lay for lo, hi in got for lay in range(lo, hi)] == list(range(layers))
            assert all(0 < hi - lo <= per for lo, hi in got)


def test_quantiles_in_microseconds():
    got = pl.quantiles([1e-6 * v for v in range(1, 101)])
    assert got["n"] == 100 and got["max_us"] == 100.0
    assert 50 <= got["p50_us"] <= 51 and 98 <= got["p99_us"] <= 100


def test_cpu_run_writes_every_cell_verified(tmp_path):
    out = tmp_path / "launch.json"
    assert pl.main(["--device", "cpu", "--iters", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["all_verified"] is True
    cells = {(c["path"], c["mode"], c["layers_per_launch"], c["stream"]) for c in report["cells"]}
    layers = pl.CPU_SHAPE.layers
    want = {(p, m, per, "idle") for p in ("old", "new") for m in pl.MODES for per in (layers, 3)}
    assert cells == want
    assert all(c["n"] == 2 and c["p50_us"] > 0 for c in report["cells"])


def test_a_run_with_a_nixl_agent_loaded_and_rests_says_so_and_stays_verified(tmp_path):
    out = tmp_path / "launch.json"
    argv = ["--device", "cpu", "--iters", "2", "--modes", "staged", "--nixl", "--rest-us", "200",
            "--out", str(out)]
    assert pl.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["all_verified"] is True
    assert report["settings"]["nixl_agent"] is True and report["settings"]["rest_us"] == 200


def _rig():
    return pl.LaunchRig(pl.CPU_SHAPE, torch.device("cpu"), seed=3)


def test_verify_fails_a_path_that_writes_nothing():
    rig = _rig()
    for mode in pl.MODES:
        assert not pl.verify(rig, None, lambda *a: None, mode, 3), mode


def test_verify_fails_a_path_that_converts_the_wrong_rows():
    rig = _rig()

    def shifted(rig_, stream, ids, src, layers, index):  # every block reads its neighbour's source row
        rows = np.roll(np.arange(len(ids)), 1) if index is None else np.roll(index, 1)
        pl.cpu_new(rig_, stream, ids, src, layers, rows)

    for mode in ("staged", "staged_gaps"):
        assert not pl.verify(rig, None, shifted, mode, 3), mode
        assert pl.verify(rig, None, pl.cpu_new, mode, 3), mode


def test_each_way_to_rest_takes_its_time_and_a_sweep_touches_its_scratch():
    scratch = np.zeros(pl.SWEEP_BYTES, np.uint8)
    for how in pl.REST_HOW:
        t0 = time.perf_counter()
        pl.rest(0.003, how, scratch)
        assert time.perf_counter() - t0 >= 0.003, how
    assert scratch[0] > 0  # the sweep wrote into it
    with pytest.raises(ValueError, match="unknown way 'nap'"):
        pl.rest(0.001, "nap")


def test_a_run_that_rests_by_sweeping_says_so(tmp_path):
    out = tmp_path / "launch.json"
    argv = ["--device", "cpu", "--iters", "2", "--modes", "staged", "--rest-us", "300", "--rest-how", "sweep",
            "--out", str(out)]
    assert pl.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["all_verified"] is True and report["settings"]["rest_how"] == "sweep"


def test_an_unknown_primer_is_refused_and_none_touches_nothing():
    pl.prime(None, "none", None)
    with pytest.raises(ValueError, match="unknown primer 'poke'"):
        pl.prime(None, "poke", None)
