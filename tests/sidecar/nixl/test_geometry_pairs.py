"""The poster's descriptors from the loop's checked pairs (``BlockPairs``) are exactly those it made from the
ids, in every mode; pairs checked under another geometry's rule are refused naming the field."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sidecar.nixl.geometry import BlockPairs, GeometryError, PairGeometry, StagingPool
from sidecar.nixl.runs import Descs
from sidecar.nixl.spans import GapRead
from tests.sidecar.nixl.test_geometry import HALF, PAGE, LocalMem, N, RemoteMem, plan_of, shuf, std

CASES = 300


def _case(rng: np.random.Generator) -> dict:
    """A random geometry and request: ratios on both sides, block padding, a token count or none, and a
    local list of any length that can pair (a prefix hit leaves it shorter than the remote's)."""
    layers = int(rng.integers(1, 4))
    remote_ratio, local_ratio = int(rng.choice([1, 2, 4])), int(rng.choice([1, 2]))
    nb_remote, nb_local = int(rng.integers(2, 10)), int(rng.integers(2, 10))  # logical blocks
    remote = rng.choice(nb_remote, int(rng.integers(1, nb_remote + 1)), replace=False)
    kernels = remote.size * remote_ratio
    tokens = int(rng.integers(1, kernels * N + 1)) if rng.random() < 0.5 else None
    # local logical blocks that can pair: no more kernels than the remote's, or those allocated for the tokens
    most = kernels // local_ratio if tokens is None else -(-tokens // (local_ratio * N))
    most = min(most, nb_local)
    n_local = 0 if most == 0 or rng.random() < 0.1 else int(rng.integers(1, most + 1))  # 0: a full prefix hit
    local = rng.choice(nb_local, n_local, replace=False)
    return dict(layers=layers, remote_ratio=remote_ratio, local_ratio=local_ratio, nb_remote=nb_remote,
                nb_local=nb_local * local_ratio, remote=remote, local=local, tokens=tokens,
                pad=int(rng.choice([0, 64])))


def _remote(c: dict) -> RemoteMem:
    return RemoteMem(c["layers"], c["nb_remote"] * c["remote_ratio"], pad=c["pad"], ratio=c["remote_ratio"])


def _same(a: Descs, b: Descs) -> None:
    assert np.array_equal(a.local, b.local) and np.array_equal(a.remote, b.remote)
    assert np.array_equal(a.layer_rows, b.layer_rows)


@pytest.mark.parametrize("seed", range(3))
def test_pairs_give_the_same_descriptors_as_the_ids_in_every_mode(seed):
    rng = np.random.default_rng(seed)
    modes = {"direct": 0, "plain": 0, "staged": 0, "staged+gaps": 0}
    for _ in range(CASES):
        c = _case(rng)
        ids = (c["local"], c["remote"], c["tokens"])
        rmem = _remote(c)
        planes = LocalMem(2 * c["layers"], c["nb_local"], HALF).planes()
        planes = dataclasses.replace(planes, blocks_per_logical=c["local_ratio"])
        direct = PairGeometry(plan_of(std(), shuf()), rmem.regions(), planes, "direct")
        pairs = direct.blocks(*ids)  # the loop's pairing (the port pairs on the direct geometry)
        modes["direct"] += 1
        a, b = direct.indices(*ids), direct.indices(*ids, pairs=pairs)
        assert np.array_equal(a.local, b.local) and np.array_equal(a.remote, b.remote)
        assert (a.layers, a.per_layer) == (b.layers, b.per_layer)
        _same(direct.descs(*ids), direct.descs(*ids, pairs=pairs))

        blocks = LocalMem(c["layers"], c["nb_local"], PAGE).blocks(ratio=c["local_ratio"])
        plain = PairGeometry(plan_of(std(), std()), rmem.regions(), blocks, "plain")
        plain_pairs = plain.blocks(*ids)
        assert np.array_equal(plain_pairs.local, pairs.local) and plain_pairs.rule == pairs.rule
        modes["plain"] += 1
        a, b = plain.indices(*ids), plain.indices(*ids, pairs=pairs)
        assert np.array_equal(a.local, b.local) and np.array_equal(a.remote, b.remote)
        for merge in (True, False):
            _same(plain.descs(*ids, merge=merge), plain.descs(*ids, merge=merge, pairs=pairs))

        n = pairs.count
        width = n + int(rng.integers(0, 4))
        pool = StagingPool(1 << 40, PAGE, c["layers"] * width + 8)
        staged = PairGeometry(plan_of(std(), shuf()), rmem.regions(), planes, "staged", pool=pool)
        order = rng.permutation(width)
        slots = (np.arange(c["layers"])[:, None] * width + order[None, :n]).astype(np.int64)
        gaps = None
        free = np.setdiff1d(np.arange(c["nb_remote"] * c["remote_ratio"]), pairs.remote)
        if free.size and rng.random() < 0.6 and width > n:
            g = rng.choice(free, min(free.size, width - n), replace=False)
            gap_slots = np.arange(c["layers"])[:, None] * width + order[None, n : n + g.size]
            gaps = GapRead(g, gap_slots.astype(np.int64))
            modes["staged+gaps"] += 1
        modes["staged"] += 1
        _same(
            staged.staged_descs(c["remote"], slots, local_block_ids=c["local"], remote_num_tokens=c["tokens"],
                                gaps=gaps),
            staged.staged_descs(c["remote"], slots, local_block_ids=c["local"], remote_num_tokens=c["tokens"],
                                gaps=gaps, pairs=pairs),
        )
    assert min(modes.values()) > CASES // 4, modes  # the sweep really compared that many per mode


def test_pairs_are_read_only_and_nobody_else_can_write_them():
    rmem, lmem = RemoteMem(2, 12), LocalMem(4, 10, HALF)
    geo = PairGeometry(plan_of(std(), shuf()), rmem.regions(), lmem.planes(), "direct")
    local, remote = np.array([3, 1, 4]), np.array([7, 8, 9])
    pairs = geo.blocks(local, remote)
    local[0] = remote[0] = 5  # the caller's arrays change afterwards: the pairs do not
    assert pairs.local.tolist() == [3, 1, 4] and pairs.remote.tolist() == [7, 8, 9]
    assert local.flags.writeable  # the caller's arrays stay the caller's
    for a in (pairs.local, pairs.remote):
        with pytest.raises(ValueError):
            a[0] = 0
    shared = np.array([3, 1, 4])
    view = shared[:]
    view.flags.writeable = False  # read-only, but over memory its owner can still write: copied
    kept = BlockPairs(view, view, pairs.rule)
    shared[0] = 9
    assert kept.local.tolist() == [3, 1, 4]
    frozen = np.array([3, 1, 4])
    frozen.flags.writeable = False  # read-only all the way down (the daemon's id arrays): used as is
    assert BlockPairs(frozen, frozen[1:2].repeat(3), pairs.rule).local is frozen
    with pytest.raises(GeometryError) as e:
        BlockPairs(np.array([1, 2]), np.array([3]), pairs.rule)
    assert e.value.field == "pairs"


def _geo(*, remote_ratio=1, local_ratio=1, nb_remote=12, nb_local=10, block_size=N):
    remote_fmt, local_fmt = std(block_size=block_size), shuf(block_size=block_size)
    rmem = RemoteMem(2, nb_remote, ratio=remote_ratio, block_size=block_size, block_len=remote_fmt.page_bytes)
    planes = LocalMem(4, nb_local, local_fmt.page_bytes // 2).planes()
    planes = dataclasses.replace(planes, blocks_per_logical=local_ratio)
    return PairGeometry(plan_of(remote_fmt, local_fmt), rmem.regions(), planes, "direct")


@pytest.mark.parametrize(
    "made,field",
    [
        (dict(remote_ratio=2, nb_remote=24), "pairs.remote_ratio"),
        (dict(local_ratio=2), "pairs.local_ratio"),
        (dict(block_size=32), "pairs.remote_block_size"),
    ],
)
def test_pairs_made_under_another_rule_are_refused_naming_the_field(made, field):
    other = _geo(**made)
    pairs = other.blocks([1], [3, 4], 32)
    geo = _geo()
    for build in (
        lambda: geo.indices([1], [3, 4], 32, pairs=pairs),
        lambda: geo.descs([1], [3, 4], 32, pairs=pairs),
    ):
        with pytest.raises(GeometryError) as e:
            build()
        assert e.value.field == field


def test_pairs_checked_against_more_blocks_are_checked_again():
    big = _geo(nb_remote=40, nb_local=30)
    geo = _geo()  # 12 remote, 10 local blocks
    ok = big.blocks([1, 2], [3, 4])
    assert geo.indices([1, 2], [3, 4], pairs=ok).count == geo.indices([1, 2], [3, 4]).count
    with pytest.raises(GeometryError) as e:
        geo.indices([1, 2], [3, 30], pairs=big.blocks([1, 2], [3, 30]))
    assert e.value.field == "remote_block_ids"
    with pytest.raises(GeometryError) as e:
        geo.descs([25, 2], [3, 4], pairs=big.blocks([25, 2], [3, 4]))
    assert e.value.field == "local_block_ids"
    # fewer blocks than this geometry's: ids checked within them fit here too, with no check again
    small = _geo(nb_remote=6, nb_local=4)
    assert geo.indices([1, 2], [3, 4], pairs=small.blocks([1, 2], [3, 4])).count == 2 * 2 * 2


def test_anything_but_block_pairs_is_refused():
    geo = _geo()
    lk, rk = np.array([1, 2]), np.array([3, 4])
    with pytest.raises(GeometryError) as e:
        geo.indices(lk, rk, pairs=(lk, rk))
    assert e.value.field == "pairs"


def test_staged_and_plain_refuse_another_rule_too():
    pairs = _geo(remote_ratio=2, nb_remote=24).blocks([1, 2], [3, 4], 64)
    rmem = RemoteMem(2, 12)
    pool = StagingPool(1 << 40, PAGE, 16)
    staged = PairGeometry(plan_of(std(), shuf()), rmem.regions(), LocalMem(4, 10, HALF).planes(), "staged",
                          pool=pool)
    with pytest.raises(GeometryError) as e:
        staged.staged_descs([3, 4], np.arange(4).reshape(2, 2), local_block_ids=[1, 2], pairs=pairs)
    assert e.value.field == "pairs.remote_ratio"
    plain = PairGeometry(plan_of(std(), std()), rmem.regions(), LocalMem(2, 10, PAGE).blocks(), "plain")
    with pytest.raises(GeometryError) as e:
        plain.descs([1, 2], [3, 4], pairs=pairs)
    assert e.value.field == "pairs.remote_ratio"
