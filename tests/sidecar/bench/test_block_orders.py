"""Block orders (pure): vLLM's free queue replayed, churn, and density."""

from __future__ import annotations

import random

import pytest

from sidecar.bench.block_orders import FreeQueue, churned, runs, spread


def test_a_fresh_queue_hands_out_contiguous_ids_from_one():
    q = FreeQueue(10)
    assert q.take(3) == [1, 2, 3] and q.take(2) == [4, 5] and len(q) == 4


def test_finished_blocks_go_back_tail_first_at_the_end():
    q = FreeQueue(8)
    a, b = q.take(3), q.take(2)  # [1,2,3], [4,5]; free: 6,7
    q.give(a)
    assert q.peek(5) == [6, 7, 3, 2, 1]
    q.give(b)
    assert q.take(7) == [6, 7, 3, 2, 1, 5, 4]
    with pytest.raises(ValueError):
        q.take(1)


def test_blocks_taken_elsewhere_leave_the_queue_and_may_come_back():
    q = FreeQueue(6)
    q.remove([2, 4, 9])
    assert q.peek(5) == [1, 3, 5]
    q.give([4, 2])
    assert q.take(5) == [1, 3, 5, 2, 4]


def test_a_block_cannot_be_given_back_twice():
    q = FreeQueue(5)
    a = q.take(2)
    q.give(a)
    with pytest.raises(ValueError):
        q.give(a[:1])


def test_churn_scatters_a_new_request_into_many_runs_and_loses_no_block():
    rng = random.Random(7)
    q = churned(4096, rng, rounds=3000)
    assert len(q) == 4095  # every block back in the queue
    assert sorted(q.peek(4095)) == list(range(1, 4096))
    ids = q.take(256)
    assert len(set(ids)) == 256
    assert 8 < runs(ids) < 256  # neither one contiguous run nor every block alone
    assert ids != sorted(ids)


def test_churn_is_reproducible_from_its_seed():
    assert churned(512, random.Random(3)).peek(64) == churned(512, random.Random(3)).peek(64)


@pytest.mark.parametrize("density", [1.0, 0.5, 0.25, 0.125])
def test_spread_fills_the_asked_share_of_its_span(density):
    rng = random.Random(1)
    ids = spread(range(1, 10_000), 256, density, rng)
    assert ids == sorted(ids) and len(set(ids)) == 256
    span = ids[-1] - ids[0] + 1
    assert span <= 256 / density + 1 and (density == 1.0) == (runs(ids) == 1)


def test_spread_refuses_what_cannot_be():
    with pytest.raises(ValueError):
        spread(range(10), 4, 0.0, random.Random(0))
    with pytest.raises(ValueError):
        spread(range(3), 4, 1.0, random.Random(0))


def test_runs():
    assert runs([]) == 0 and runs([5]) == 1 and runs([1, 2, 3, 7, 8, 4]) == 3
