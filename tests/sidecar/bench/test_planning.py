"""The planning bench: both orders run, both paths are timed and give the same descriptors (it checks)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sidecar.bench import planning


def test_it_times_every_path_of_both_orders(capsys):
    assert planning.main(["--layers", "3", "--blocks", "16", "--num-blocks", "256", "--reps", "5",
                          "--warmup", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["order"] for r in out["runs"]] == ["contiguous", "churned"]
    for run in out["runs"]:
        assert set(run["median_us"]) == {"loop_pairing", "poster_staged_from_ids", "poster_staged_from_pairs",
                                         "poster_direct_from_ids", "poster_direct_from_pairs"}
        assert all(v > 0 for v in run["median_us"].values())


@pytest.mark.parametrize("order", ["contiguous", "churned"])
def test_request_ids_are_read_only_distinct_and_in_the_caches(order):
    local, remote = planning.request_ids(order, 40, 512, seed=3)
    for ids in (local, remote):
        assert not ids.flags.writeable and ids.size == 40 and np.unique(ids).size == 40
        assert ids.min() >= 0 and ids.max() < 512


def test_against_another_geometry_times_its_path_too_and_checks_it_agrees(capsys):
    from sidecar.nixl import geometry

    assert planning.main(["--layers", "2", "--blocks", "8", "--num-blocks", "128", "--reps", "3", "--warmup",
                          "1", "--orders", "churned", "--against", geometry.__file__]) == 0
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    want = {"against_loop_pairing", "against_poster_staged_from_ids", "against_poster_direct_from_ids"}
    assert want <= set(run["median_us"])
