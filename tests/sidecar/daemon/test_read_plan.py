"""``read_plan``'s pure choices: how many descriptors a staged read is estimated to post."""

from __future__ import annotations

import numpy as np
import pytest

from sidecar.daemon.read_plan import staged_descriptors


@pytest.mark.parametrize(
    ("remote", "runs"),
    [
        ([], 0),
        ([7], 1),
        ([3, 4, 5, 6], 1),  # one run
        ([6, 4, 5, 3], 1),  # in any order: pages go in remote-id order
        ([1, 2, 5, 6], 2),
        ([9, 1, 5], 3),
        ([2, 2, 3], 2),  # a repeated id is not consecutive
        (list(range(0, 512, 2)), 256),  # every other block: a run each
    ],
)
def test_a_staged_read_posts_a_descriptor_per_run_and_layer(remote, runs):
    for layers in (1, 36):
        assert staged_descriptors(np.array(remote, dtype=np.int64), layers) == layers * runs


def test_the_estimate_matches_runs_counted_by_hand_on_random_ids():
    rng = np.random.default_rng(0)
    for _ in range(200):
        ids = rng.choice(64, size=int(rng.integers(1, 40)), replace=False)
        ordered = sorted(ids.tolist())
        runs = 1 + sum(b != a + 1 for a, b in zip(ordered, ordered[1:], strict=False))
        assert staged_descriptors(ids, 3) == 3 * runs
