"""Heterogeneous TP rules pinned against vLLM 0.33's NixlConnector (values worked out from its source, see
sidecar/nixl/tp.py), and exhaustively: every decoder rank's slices tile the heads exactly once."""

import itertools

import pytest

from sidecar.nixl.tp import SourceSlice, TPPlan, tp_plan
from sidecar.wire.formats import Refusal

HEAD = 16 * 2 * 128 * 2  # bytes of one head of a page: N=16, 2D=256, bf16


def plan(lt, rank, rt, heads=8):
    return tp_plan(local_tp=lt, local_rank=rank, remote_tp=rt, total_kv_heads=heads,
                   local_page_bytes=heads // lt * HEAD, remote_page_bytes=heads // rt * HEAD)


# (local_tp, local_rank, remote_tp) -> (sources as (rank, remote_off_heads, local_off_heads, heads), notif n)
PINNED = {
    (2, 0, 1): ([(0, 0, 0, 4)], 2),   # vLLM: tp_ratio 2, compute_head_offset = 0 % 2, local_consumers 2
    (2, 1, 1): ([(0, 4, 0, 4)], 2),
    (4, 3, 2): ([(1, 2, 0, 2)], 2),   # rank 3 // 2 = remote 1, offset factor 3 % 2 = 1
    (1, 0, 2): ([(0, 0, 0, 4), (1, 0, 4, 4)], 1),  # tp_ratio -2: reads ranks 0, 1, one consumer each
    (2, 1, 4): ([(2, 0, 0, 2), (3, 0, 2, 2)], 1),
    (1, 0, 1): ([(0, 0, 0, 8)], 1),
}


@pytest.mark.parametrize("key", list(PINNED), ids=str)
def test_pinned_vllm_rules(key):
    srcs, n = PINNED[key]
    p = plan(*key)
    assert isinstance(p, TPPlan)
    assert p.sources == tuple(SourceSlice(r, ro * HEAD, lo * HEAD, h * HEAD) for r, ro, lo, h in srcs)
    assert p.notif_count == n
    assert p.heartbeat_ranks == tuple(s.remote_rank for s in p.sources)


@pytest.mark.parametrize("heads", [1, 2, 4, 8, 16])
def test_every_ratio_tiles_all_heads_once(heads):
    for lt, rt in itertools.product([1, 2, 4, 8, 16], repeat=2):
        if heads % lt or heads % rt:
            assert isinstance(plan(lt, 0, rt, heads), Refusal)
            continue
        covered = {}  # (remote rank, head) -> reader count
        for rank in range(lt):
            p = plan(lt, rank, rt, heads)
            assert isinstance(p, TPPlan), (lt, rt, p)
            local = sorted((s.local_offset, s.length) for s in p.sources)
            assert local[0][0] == 0 and sum(n for _, n in local) == heads // lt * HEAD  # fills its page
            for s in p.sources:
                for h in range(s.remote_offset // HEAD, (s.remote_offset + s.length) // HEAD):
                    covered[(s.remote_rank, h)] = covered.get((s.remote_rank, h), 0) + 1
            readers = {s.remote_rank for s in p.sources}
            assert p.notif_count == max(1, lt // rt)
            assert all(0 <= r < rt for r in readers)
        assert sorted(covered) == [(r, h) for r in range(rt) for h in range(heads // rt)]
        assert set(covered.values()) == {1}


@pytest.mark.parametrize("kw,field", [
    (dict(local_tp=3, remote_tp=2, total_kv_heads=6), "local_tp"),
    (dict(local_tp=2, remote_tp=3, total_kv_heads=6), "remote_tp"),
    (dict(local_tp=4, remote_tp=1, total_kv_heads=2), "local_tp"),
    (dict(local_tp=1, remote_tp=4, total_kv_heads=2), "remote_tp"),
    (dict(local_tp=0, remote_tp=1, total_kv_heads=2), "local_tp"),
])
def test_refusals_name_the_field(kw, field):
    h = kw["total_kv_heads"]
    lt, rt = max(kw["local_tp"], 1), kw["remote_tp"]
    pages = dict(local_page_bytes=max(1, h // lt) * HEAD, remote_page_bytes=max(1, h // rt) * HEAD)
    out = tp_plan(local_rank=0, **pages, **kw)
    assert isinstance(out, Refusal) and out.field == field


def test_bytes_per_head_must_match():
    out = tp_plan(local_tp=2, local_rank=0, remote_tp=1, total_kv_heads=8, local_page_bytes=4 * HEAD,
                  remote_page_bytes=8 * HEAD * 2)
    assert isinstance(out, Refusal) and out.field == "page_bytes"


def test_head_offsets_match_vllm_compute_head_offset():
    """vLLM's compute_head_offset, compiled from the downloaded wheel (skips without it), as the oracle."""
    import ast
    import os
    import pathlib
    import zipfile

    rel = "vllm/distributed/kv_transfer/kv_connector/v1/nixl/tp_mapping.py"
    wheel_dir = pathlib.Path(os.environ.get("KV_SIDECAR_VLLM_WHEEL_DIR", "/tmp/vllm-wheel"))
    wheels = sorted(wheel_dir.glob("vllm-*.whl"))
    if not wheels:
        pytest.skip("no vLLM wheel in KV_SIDECAR_VLLM_WHEEL_DIR")
    with zipfile.ZipFile(wheels[-1]) as z:
        tree = ast.parse(z.read(rel).decode())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "compute_head_offset")
    ns: dict = {}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), rel, "exec"), ns)  # noqa: S102 -- test oracle
    for heads, lt, rt in itertools.product([1, 2, 4, 8, 16], repeat=3):
        if heads % lt or heads % rt or lt < rt:
            continue
        for rank in range(lt):
            p = plan(lt, rank, rt, heads)
            factor = ns["compute_head_offset"](rank, lt, rt, heads)
            assert p.sources[0].remote_offset == factor * p.sources[0].length, (heads, lt, rt, rank)
            assert p.sources[0].remote_rank == rank * rt // lt  # vLLM: attn_ranks = [tp_rank * P // D]


def test_read_ranks_and_notif_count_agree_with_the_full_plan():
    from sidecar.nixl.tp import notif_count, read_ranks

    for lt, rt in itertools.product([1, 2, 3, 4, 6, 8], repeat=2):
        for rank in range(lt):
            ranks = read_ranks(local_tp=lt, local_rank=rank, remote_tp=rt)
            p = plan(lt, rank, rt, heads=24)
            if lt % rt and rt % lt:
                assert isinstance(ranks, Refusal) and ranks.field == "remote_tp_size"
                assert isinstance(p, Refusal)
                continue
            assert isinstance(p, TPPlan), (lt, rt, p)
            assert ranks == p.heartbeat_ranks == tuple(s.remote_rank for s in p.sources)
            assert notif_count(local_tp=lt, remote_tp=rt) == p.notif_count
