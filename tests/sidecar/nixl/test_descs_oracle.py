"""Every descriptor builder against a naive oracle, as byte maps: over random geometries and requests.

The builders' output (explicit descriptors, or index form through the prepared tables) is expanded into
``(local start, remote start, length)`` copies, merged where contiguous on both sides, and compared with
what a per-block, per-layer loop written here says: every needed byte read into its one place, no local
byte written twice, nothing else written, each descriptor inside one registered region. Bad input must be
refused with a ``GeometryError`` naming the field, never turned into descriptors.

No memory is simulated (so pages of any size cost nothing); the pairing oracle works in tokens (local
kernel block at token position ``p`` receives the remote kernel block at ``p``), not in vLLM's tail rule.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from sidecar.nixl.geometry import (
    GeometryError,
    LocalRegions,
    PairGeometry,
    RemoteRegions,
    StagingPool,
    regions_per_layer,
)
from sidecar.nixl.runs import merge_runs
from sidecar.nixl.spans import GapRead, ReadCost, SpanGaps, SpanSlots, plan_span
from sidecar.nixl.tp import RankRead, SourceSlice, rank_read
from sidecar.wire.formats import AITER_SHUFFLED, STANDARD, PageFormat, Plan, negotiate

FAST = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
RDEV, LDEV, PDEV = 3, 5, 7


# -- oracle side ------------------------------------------------------------------------------------------


def canon(copies) -> list[tuple[int, int, int]]:
    """(local, remote, length) copies sorted by local address and merged where contiguous on both sides;
    refuses an empty copy and two copies writing one local byte."""
    out: list[tuple[int, int, int]] = []
    for la, ra, n in sorted(copies):
        assert n > 0, "an empty copy"
        if out:
            pla, pra, pn = out[-1]
            assert la >= pla + pn, f"local bytes [{la}, +{n}) written twice"
            if la == pla + pn and ra == pra + pn:
                out[-1] = (pla, pra, pn + n)
                continue
        out.append((la, ra, n))
    return out


def copies_of(local: np.ndarray, remote: np.ndarray, ldev: int, rdev: int) -> list[tuple[int, int, int]]:
    """Descriptor rows as copies; both sides Nx3 of equal lengths, on their devices."""
    assert local.ndim == 2 and local.shape[1] == 3 and local.shape == remote.shape
    assert local.dtype == np.uint64 and remote.dtype == np.uint64
    assert (local[:, 1] == remote[:, 1]).all()
    assert (local[:, 2] == ldev).all() and (remote[:, 2] == rdev).all()
    return list(zip(local[:, 0].tolist(), remote[:, 0].tolist(), local[:, 1].tolist(), strict=True))


def inside(rows: np.ndarray, spans: list[tuple[int, int]]) -> None:
    """Each descriptor inside one registered span [start, end) (NIXL reads one registration per row)."""
    for a, n in zip(rows[:, 0].tolist(), rows[:, 1].tolist(), strict=True):
        assert any(s <= a and a + n <= e for s, e in spans), f"[{a}, +{n}) crosses or leaves the regions"


def same_map(got_copies, want_copies) -> None:
    event("mapped" if want_copies else "mapped nothing")
    got, want = canon(got_copies), canon(want_copies)
    assert got == want


def expand(table: np.ndarray) -> np.ndarray:
    """NIXL's expansion of strided Nx5 rows into Nx3 (addr, len, dev)."""
    rows = [
        np.stack([np.full(c, a) + np.arange(c) * s, np.full(c, n), np.full(c, d)], axis=1)
        for a, n, d, s, c in table.astype(np.int64).tolist()
    ]
    return np.concatenate(rows).astype(np.uint64)


class Refused(Exception):
    """The oracle's verdict on a bad request: ``must`` (some refusal is due) and the fields it may name."""

    def __init__(self, fields: set[str]) -> None:
        super().__init__(sorted(fields))
        self.fields = fields


def kernels(logical: list[int], ratio: int) -> list[int]:
    return [b * ratio + j for b in logical for j in range(ratio)]


def oracle_pairs(
    local: list[int] | None, remote: list[int], tokens: int | None, *, lr: int, rr: int, n: int,
    l_limit: int, r_limit: int, slots_n: int | None = None,
) -> tuple[list[tuple[int, int]], set[str]]:
    """(local kernel, remote kernel) pairs by token position, and the fields a refusal may also name
    (ids out of range that are never read: a builder may refuse them or not). Raises ``Refused``.

    ``local`` None (a staged read without local ids): ``slots_n`` blocks, the last of the remote's."""
    must: set[str] = set()
    may: set[str] = set()
    rk = kernels(remote, rr)
    if any(not 0 <= b < r_limit // rr for b in remote):
        may.add("remote_block_ids")
    if local is not None:
        if any(not 0 <= b < l_limit // lr for b in local):
            may.add("local_block_ids")
        if len(set(local)) != len(local):
            must.add("local_block_ids")
    if tokens is not None and tokens < 0:
        raise Refused(must | may | {"remote_num_tokens"})
    if tokens is not None:
        used = -(-tokens // n)
        if len(rk) < used:
            must.add("remote_block_ids")
        rk = rk[:used]
    if local is None:
        assert slots_n is not None
        if slots_n > len(rk):  # more slots than the prefill's blocks: the slots are the culprit
            raise Refused(must | may | {"slots"})
        lk: list[int | None] = [None] * slots_n
        first = len(rk) - slots_n
    else:
        lk = list(kernels(local, lr))
        # without tokens, tail pairing: the local list ends where the remote's does; with them, where the
        # kernel blocks the decoder allocated for the tokens end
        total = len(rk) if tokens is None else lr * -(-tokens // (lr * n))
        first = total - len(lk)  # token position (in kernel blocks) of the first local kernel block
        if first < 0:
            must.add("local_block_ids")
    if must:
        raise Refused(must | may)
    pairs = []
    for i, lb in enumerate(lk):
        p = first + i
        if p >= len(rk):
            continue  # the empty tail of the decoder's last logical block
        rb = rk[p]
        if lb is not None and not 0 <= lb < l_limit:
            raise Refused({"local_block_ids"} | may)
        if not 0 <= rb < r_limit:
            raise Refused({"remote_block_ids"} | may)
        pairs.append((lb, rb))
    return pairs, may


def as_given(ids: list[int], how: str):
    """Ids as a caller may pass them: a list, or an int64 (the daemon's), int32 or read-only array."""
    if how == "list":
        return list(ids)
    a = np.array(ids, dtype=np.int32 if how == "int32" else np.int64)
    a.flags.writeable = how != "readonly"
    return a


IDS_AS = st.sampled_from(["list", "int64", "int32", "readonly"])


def refused(call, fields: set[str]) -> None:
    event(f"refused {sorted(fields)}")
    try:
        call()
    except GeometryError as e:
        assert e.field in fields, (e.field, fields, e.reason)
    else:
        raise AssertionError(f"accepted a request the oracle refuses ({sorted(fields)})")


# -- geometries -------------------------------------------------------------------------------------------


def fmt(kind: str, layout: str, heads: int, n: int, d: int, dtype: str = "bfloat16") -> PageFormat:
    return PageFormat(kind=kind, layout=layout, dtype=dtype, num_heads=heads, block_size=n, head_size=d)


def place(draw, sizes: list[int], start: int) -> list[int]:
    """Bases for regions of ``sizes`` bytes in a random order, back to back or with a hole between some."""
    order = draw(st.permutations(range(len(sizes))))
    bases = [0] * len(sizes)
    at = start
    for i in order:
        at += draw(st.sampled_from([0, 0, 0, 64]))
        bases[i] = at
        at += sizes[i]
    return bases


@st.composite
def remote_side(draw, layers: int, k: int, block_len: int, n: int, ratio: int, layout: str):
    pad = draw(st.sampled_from([0, 0, 32, block_len]))
    stride = block_len + pad
    logical = draw(st.integers(1, 8))
    total = logical * ratio
    counts = [total + draw(st.sampled_from([0, 0, 1, 3])) for _ in range(layers * k)]
    bases = place(draw, [c * stride for c in counts], 1 << 20)
    meta = SimpleNamespace(
        kv_caches_base_addr=bases, block_lens=[block_len] * len(bases), block_strides=[stride] * len(bases),
        physical_blocks_per_logical_kv_block=ratio, num_blocks=total, region_num_blocks=counts,
        device_id=RDEV, block_size=n, kv_cache_layout=layout, region_mem_types=["VRAM"] * len(bases),
    )
    regions = RemoteRegions.from_metadata(meta)
    spans = [(b, b + c * stride) for b, c in zip(bases, counts, strict=True)]
    return regions, spans


@st.composite
def local_side(draw, regions: int, block_len: int, ratio: int):
    pad = draw(st.sampled_from([0, 0, 16, block_len]))
    stride = block_len + pad
    logical = draw(st.integers(1, 8))
    counts = [logical * ratio + draw(st.sampled_from([0, 0, 1, 3])) for _ in range(regions)]
    bases = place(draw, [c * stride for c in counts], 1 << 32)
    loc = LocalRegions(
        base=np.array(bases, np.uint64), block_len=np.full(regions, block_len, np.int64),
        block_stride=np.full(regions, stride, np.int64), num_blocks=np.array(counts, np.int64),
        device_id=LDEV, mem_type="VRAM", blocks_per_logical=ratio,
    )
    spans = [(b, b + c * stride) for b, c in zip(bases, counts, strict=True)]
    return loc, spans


@st.composite
def id_list(draw, limit: int, ratio: int, most: int, least: int = 0):
    """Logical ids: mostly valid and unique (scattered or a contiguous run), now and then a duplicate or one
    outside the cache."""
    logical = max(1, limit // ratio)
    top = min(most, logical)
    size = draw(st.integers(min(least, top), top))
    shape = draw(st.sampled_from(["scattered", "scattered", "run", "run", "dup", "out", "out"]))
    if shape == "run":
        start = draw(st.integers(0, logical - size))
        ids = list(range(start, start + size))
        if draw(st.booleans()):
            ids.reverse()
        return ids
    ids = draw(st.lists(st.integers(0, logical - 1), min_size=size, max_size=size, unique=True))
    if shape == "dup" and ids:
        ids.insert(draw(st.integers(0, len(ids))), draw(st.sampled_from(ids)))
    elif shape == "out":  # at the end (read whatever the pairing) or anywhere
        at = draw(st.one_of(st.just(len(ids)), st.integers(0, len(ids))))
        ids.insert(at, draw(st.sampled_from([-1, logical, logical, logical + 5])))
    return ids


@st.composite
def request(draw, r_limit: int, l_limit: int, rr: int, lr: int, n: int, most: int):
    """(remote logical ids, local logical ids, remote_num_tokens) of one request."""
    rids = draw(id_list(r_limit, rr, most, least=1))
    r_kernels = len(rids) * rr
    # tokens: none, filling the remote's last logical block in part (as a prefill's), or any count
    filled = st.integers(max(0, (r_kernels - rr) * n + 1), r_kernels * n)
    tokens = draw(st.one_of(st.none(), filled, filled, st.integers(0, r_kernels * n + n), st.just(-1)))
    # local logical blocks that can pair: as many as the remote's kernels, or as the decoder allocated for
    # the tokens; fewer is a prefix hit; now and then more
    fits = r_kernels // lr if tokens is None or tokens < 0 else -(-tokens // (lr * n))
    top = fits if draw(st.integers(0, 5)) else fits + 2
    lids = draw(id_list(l_limit, lr, max(0, top), least=1 if draw(st.integers(0, 5)) else 0))
    return rids, lids, tokens


@st.composite
def pair_cases(draw, mode: str):
    """A geometry in ``mode`` and a request on it: ratios on both sides, padded blocks, per-region block
    counts, regions in any order, a token count or none, prefix hits (fewer local than remote blocks)."""
    layers = draw(st.integers(1, 3))
    n, d = draw(st.sampled_from([16, 32])), draw(st.sampled_from([64, 128]))
    heads = draw(st.integers(1, 3))
    dtype = draw(st.sampled_from(["bfloat16", "float8_e5m2"]))
    if mode == "plain":
        layout, kind = draw(st.sampled_from([("LBHNC", STANDARD), ("LHBNC", STANDARD),
                                             ("LHBNC", AITER_SHUFFLED), ("LBNHC", STANDARD)]))
        rf = lf = fmt(kind, layout, heads, n, d, dtype)
    else:
        rf, lf = fmt(STANDARD, "LBHNC", heads, n, d, dtype), fmt(AITER_SHUFFLED, "LHBNC", heads, n, d, dtype)
    plan = negotiate(rf, lf)
    assert isinstance(plan, Plan), plan
    rr, lr = draw(st.sampled_from([1, 1, 2, 3])), draw(st.sampled_from([1, 1, 2]))
    k_r, k_l = regions_per_layer(rf), regions_per_layer(lf)
    remote, rspans = draw(remote_side(layers, k_r, rf.page_bytes // k_r, n, rr, rf.layout))
    local, lspans = draw(local_side(layers * k_l, lf.page_bytes // k_l, lr))
    r_limit, l_limit = int(remote.num_blocks.min()), int(local.num_blocks.min())
    rids, lids, tokens = draw(request(r_limit, l_limit, rr, lr, n, 8))
    return dict(plan=plan, remote=remote, rspans=rspans, local=local, lspans=lspans, rr=rr, lr=lr, n=n,
                rids=rids, lids=lids, tokens=tokens, layers=layers, k=k_r, r_limit=r_limit, l_limit=l_limit)


def _oracle(c: dict, local: list[int] | None = None, slots_n: int | None = None):
    return oracle_pairs(c["lids"] if local is None and slots_n is None else local, c["rids"], c["tokens"],
                        lr=c["lr"], rr=c["rr"], n=c["n"], l_limit=c["l_limit"], r_limit=c["r_limit"],
                        slots_n=slots_n)


def _rows(regions, i: int, b: int) -> int:
    return int(regions.base[i]) + b * int(regions.block_stride[i])


# -- direct and plain: explicit and index forms ------------------------------------------------------------


def _want_direct(c: dict, pairs) -> list[list[tuple[int, int, int]]]:
    r, loc = c["remote"], c["local"]
    half = int(r.block_len[0]) // 2
    per_layer = []
    for layer in range(c["layers"]):
        cps = []
        for lb, rb in pairs:
            for h in (0, 1):
                cps.append((_rows(loc, 2 * layer + h, lb), _rows(r, layer, rb) + h * half, half))
        per_layer.append(cps)
    return per_layer


def _want_plain(c: dict, pairs) -> list[list[tuple[int, int, int]]]:
    r, loc, k = c["remote"], c["local"], c["k"]
    per_layer = []
    for layer in range(c["layers"]):
        cps = []
        for j in range(layer * k, layer * k + k):
            for lb, rb in pairs:
                cps.append((_rows(loc, j, lb), _rows(r, j, rb), int(r.block_len[j])))
        per_layer.append(cps)
    return per_layer


def _check_explicit(d, want_per_layer, c, ldev=LDEV, lspans=None) -> None:
    lspans = c["lspans"] if lspans is None else lspans
    assert d.layer_rows.size == c["layers"] + 1 and d.layer_rows[0] == 0 and d.layer_rows[-1] == d.count
    assert (np.diff(d.layer_rows) >= 0).all()
    inside(d.local, lspans)
    inside(d.remote, c["rspans"])
    every = []
    for layer, want in enumerate(want_per_layer):
        lo, re = d.layer_slice(layer, layer + 1)
        same_map(copies_of(lo, re, ldev, RDEV), want)
        every += want
    same_map(copies_of(d.local, d.remote, ldev, RDEV), every)  # and no byte written by two layers


@FAST
@given(pair_cases("direct"), IDS_AS)
def test_direct_descs_and_indices_move_exactly_the_oracle_s_bytes(c, how):
    geo = PairGeometry(c["plan"], c["remote"], c["local"], "direct")
    args = (as_given(c["lids"], how), as_given(c["rids"], how), c["tokens"])
    try:
        pairs, may = _oracle(c)
    except Refused as e:
        refused(lambda: geo.descs(*args), e.fields)
        refused(lambda: geo.indices(*args), e.fields)
        return
    try:
        d = geo.descs(*args)
    except GeometryError as e:  # ids never read may be refused, naming them
        assert e.field in may, (e.field, e.reason)
        return
    want = _want_direct(c, pairs)
    _check_explicit(d, want, c)
    idx = geo.indices(*args)
    assert idx.count == 2 * c["layers"] * len(pairs)
    lt, rt = expand(geo.local_table()), expand(geo.remote_table())
    for layer in range(c["layers"]):
        li, ri = idx.layer_slice(layer, layer + 1)
        same_map(copies_of(lt[li], rt[ri], LDEV, RDEV), want[layer])


@FAST
@given(pair_cases("plain"), st.booleans(), IDS_AS)
def test_plain_descs_and_indices_move_exactly_the_oracle_s_bytes(c, merge, how):
    geo = PairGeometry(c["plan"], c["remote"], c["local"], "plain")
    args = (as_given(c["lids"], how), as_given(c["rids"], how), c["tokens"])
    try:
        pairs, may = _oracle(c)
    except Refused as e:
        refused(lambda: geo.descs(*args, merge=merge), e.fields)
        refused(lambda: geo.indices(*args), e.fields)
        return
    try:
        d = geo.descs(*args, merge=merge)
    except GeometryError as e:
        assert e.field in may, (e.field, e.reason)
        return
    want = _want_plain(c, pairs)
    _check_explicit(d, want, c)
    if not merge:
        assert d.count == c["layers"] * c["k"] * len(pairs)
    idx = geo.indices(*args)
    lt, rt = expand(geo.local_table()), expand(geo.remote_table())
    for layer in range(c["layers"]):
        li, ri = idx.layer_slice(layer, layer + 1)
        same_map(copies_of(lt[li], rt[ri], LDEV, RDEV), want[layer])


# -- staged: slot matrices, gaps, compact spans ------------------------------------------------------------


def _pool(draw, c: dict, need: int) -> tuple[StagingPool, list[tuple[int, int]]]:
    page = c["plan"].remote.page_bytes
    slots = need + draw(st.integers(0, 4))
    pool = StagingPool(base=1 << 40, slot_bytes=page, num_slots=max(1, slots), device_id=PDEV,
                       mem_type="VRAM")
    return pool, [(pool.base, pool.base + pool.num_slots * page)]


def _want_staged(c, pool, remote_ids: list[int], slots: np.ndarray) -> list[list[tuple[int, int, int]]]:
    r = c["remote"]
    page = int(r.block_len[0])
    return [
        [(pool.base + int(slots[layer, i]) * page, _rows(r, layer, rb), page)
         for i, rb in enumerate(remote_ids)]
        for layer in range(c["layers"])
    ]


@st.composite
def slot_matrix(draw, layers: int, n: int, num_slots: int):
    """Slots [layers, n]: contiguous per layer, a shifted span, or any distinct slots; now and then broken
    (a slot twice, one past the pool, a negative one)."""
    shape = draw(st.sampled_from(["contiguous", "span", "any", "any", "broken"]))
    if shape == "contiguous" and layers * n <= num_slots:
        first = draw(st.integers(0, num_slots - layers * n))
        return first + np.arange(layers * n, dtype=np.int64).reshape(layers, n), True
    if shape == "span" and layers * n <= num_slots:
        width = draw(st.integers(n, num_slots // layers)) if n else 0
        first = draw(st.integers(0, num_slots - layers * width))
        pos = np.array(draw(st.permutations(range(width)))[:n], np.int64)
        return first + np.arange(layers)[:, None] * width + pos[None, :], True
    if shape != "broken" and layers * n <= num_slots:
        perm = draw(st.permutations(range(num_slots)))
        return np.array(perm[: layers * n], np.int64).reshape(layers, n), True
    m = np.array(draw(st.lists(st.integers(-2, num_slots + 1), min_size=layers * n, max_size=layers * n)),
                 np.int64).reshape(layers, n)
    ok = bool(m.size == 0 or (m.min() >= 0 and m.max() < num_slots and np.unique(m).size == m.size))
    return m, ok


@FAST
@given(st.data())
def test_staged_descs_from_a_slot_matrix_move_exactly_the_oracle_s_bytes(data):
    c = data.draw(pair_cases("staged"))
    with_local = data.draw(st.booleans())
    # the blocks a read of the request's local ids stages, or as many as the slots without them
    n = data.draw(st.integers(min(1, len(c["rids"])), len(c["rids"]) * c["rr"] + 1))
    try:
        if with_local:
            pairs, may = _oracle(c)
            n = len(pairs)
        else:
            pairs, may = _oracle(c, slots_n=n)
    except Refused as e:
        pairs, may = None, e.fields
    pool, pspans = _pool(data.draw, c, c["layers"] * n)
    geo = PairGeometry(c["plan"], c["remote"], c["local"], "staged", pool=pool)
    slots, ok = data.draw(slot_matrix(c["layers"], n, pool.num_slots))
    kw = dict(local_block_ids=c["lids"] if with_local else None, remote_num_tokens=c["tokens"])
    call = lambda: geo.staged_descs(c["rids"], slots, **kw)  # noqa: E731
    if pairs is None:
        refused(call, may | {"slots"})
        return
    if not ok:
        refused(call, may | {"slots"})
        return
    try:
        d = call()
    except GeometryError as e:
        assert e.field in may, (e.field, e.reason)
        return
    remote_ids = [rb for _, rb in pairs]
    _check_explicit(d, _want_staged(c, pool, remote_ids, slots), c, ldev=PDEV, lspans=pspans)
    if with_local and data.draw(st.booleans()):  # one slot too few or too many per layer for the pairs
        wrong = slots[:, :-1] if n and data.draw(st.booleans()) else np.zeros((c["layers"], n + 1), np.int64)
        refused(lambda: geo.staged_descs(c["rids"], wrong, **kw), may | {"slots"})


@st.composite
def span_cases(draw):
    """A staged request whose slots and gaps come from ``plan_span`` (as the daemon's), in the compact form
    or as matrices, or a span tampered with (rows twice, outside the span, the span outside the pool)."""
    c = draw(pair_cases("staged"))
    c["tokens"] = None
    c["lids"] = None
    logical = c["r_limit"] // c["rr"]
    rids = draw(st.lists(st.integers(0, logical - 1), min_size=1, max_size=min(logical, 10), unique=True))
    c["rids"] = rids
    ids = np.array(kernels(rids, c["rr"]), np.int64)
    page = c["plan"].remote.page_bytes
    cost = ReadCost(descriptor_us=draw(st.sampled_from([0.0, 5.0, 50.0])), gbps=page * 3 / 8.0 / 1e3)
    span = plan_span(ids, page, cost, draw(st.integers(0, 12)))
    return c, ids, span


@FAST
@given(span_cases(), st.data())
def test_staged_spans_with_gaps_move_exactly_the_oracle_s_bytes(case, data):
    c, ids, span = case
    layers, n = c["layers"], ids.size
    # plan_span's own promises: every block and gap has its own slot of the span, gaps between blocks
    pos, gap_pos, gap_ids = span.pos.tolist(), span.gap_pos.tolist(), span.gap_ids.tolist()
    assert span.width == n + len(gap_ids) and sorted(pos + gap_pos) == list(range(span.width))
    assert not set(gap_ids) & set(ids.tolist())
    assert all(ids.min() < g < ids.max() for g in gap_ids)
    order = sorted(range(n), key=lambda i: ids[i])
    assert [pos[i] for i in order] == sorted(pos)  # slots in remote order
    pool, pspans = _pool(data.draw, c, layers * span.width + data.draw(st.integers(0, 3)))
    geo = PairGeometry(c["plan"], c["remote"], c["local"], "staged", pool=pool)
    first = data.draw(st.integers(-1, pool.num_slots - layers * span.width + 1))
    form = data.draw(st.sampled_from(["compact", "span_gaps", "matrix", "compact+matrix gaps",
                                      "matrix+compact gaps"]))
    scramble = form != "span_gaps" and data.draw(st.booleans())
    if scramble:  # the span's rows in another order: still one slot each, no longer in remote order
        perm = np.array(data.draw(st.permutations(range(span.width))), np.int64)
        pos, gap_pos = perm[span.pos].tolist(), perm[span.gap_pos].tolist()
    slots = SpanSlots(first, layers, span.width, np.array(pos, np.int64))
    gap_slots = SpanSlots(first, layers, span.width, np.array(gap_pos, np.int64))
    if form == "span_gaps":
        gaps = SpanGaps(span, first, layers)
    else:
        gaps = GapRead(span.gap_ids, gap_slots if form.endswith("compact gaps") or form == "compact"
                       else np.asarray(gap_slots))
        if form.startswith("matrix"):
            slots = np.asarray(slots)
    call = lambda: geo.staged_descs(c["rids"], slots, gaps=gaps)  # noqa: E731
    if first < 0 or first + layers * span.width > pool.num_slots:  # every slot of the span is used
        refused(call, {"slots"})
        return
    d = call()
    every = np.concatenate([np.asarray(slots), np.asarray(gaps.slots)], axis=1)
    want = _want_staged(c, pool, ids.tolist() + gap_ids, every)
    _check_explicit(d, want, c, ldev=PDEV, lspans=pspans)
    # one descriptor a layer per run of remote ids that are adjacent in memory (reads merge across gaps)
    if int(c["remote"].block_stride[0]) == page_of(c) and not scramble:
        runs = 1 + int((np.diff(np.sort(np.concatenate([ids, span.gap_ids]))) != 1).sum())
        assert d.count == layers * runs


def page_of(c: dict) -> int:
    return c["plan"].remote.page_bytes


@FAST
@given(span_cases(), st.data())
def test_a_tampered_span_is_refused_naming_the_slots(case, data):
    c, ids, span = case
    layers, n = c["layers"], ids.size
    pool, _ = _pool(data.draw, c, layers * span.width)
    geo = PairGeometry(c["plan"], c["remote"], c["local"], "staged", pool=pool)
    rows = span.pos.copy()
    gap_rows = span.gap_pos.copy()
    how = data.draw(st.sampled_from(["row twice", "row outside", "negative row", "gap on a block",
                                     "gap outside", "layers"]))
    width = span.width
    if how == "row twice" and n > 1:
        rows[data.draw(st.integers(1, n - 1))] = rows[0]
    elif how == "row outside":
        rows[data.draw(st.integers(0, n - 1))] = width + data.draw(st.integers(0, 2))
    elif how == "negative row":
        rows[data.draw(st.integers(0, n - 1))] = -1
    elif how == "gap on a block" and gap_rows.size:
        gap_rows[0] = rows[data.draw(st.integers(0, n - 1))]
    elif how == "gap outside" and gap_rows.size:
        gap_rows[-1] = width
    elif how == "layers":
        layers += 1
    else:
        return
    slots = SpanSlots(0, layers, width, rows)
    gaps = GapRead(span.gap_ids, SpanSlots(0, layers, width, gap_rows))
    fields = {"slots", "gaps.slots"}
    refused(lambda: geo.staged_descs(c["rids"], slots, gaps=gaps), fields)
    # as matrices the span is gone: only slots twice or outside the pool (or a wrong shape) are wrong
    m = np.concatenate([np.asarray(slots), np.asarray(gaps.slots)], axis=1)
    if how == "layers" or m.min() < 0 or m.max() >= pool.num_slots or np.unique(m).size < m.size:
        refused(lambda: geo.staged_descs(c["rids"], np.asarray(slots),
                                         gaps=GapRead(span.gap_ids, np.asarray(gaps.slots))), fields)


def test_more_slots_than_the_prefill_s_blocks_are_refused_naming_the_slots():
    """Without local ids a staged read takes as many of the remote's last blocks as it has slots; more
    slots than blocks is the slots' fault (no local ids were given to blame)."""
    plan = negotiate(fmt(STANDARD, "LBHNC", 1, 16, 64), fmt(AITER_SHUFFLED, "LHBNC", 1, 16, 64))
    page = plan.remote.page_bytes
    remote = RemoteRegions.from_metadata(SimpleNamespace(
        kv_caches_base_addr=[1 << 20], block_lens=[page], block_strides=[page],
        physical_blocks_per_logical_kv_block=1, num_blocks=4, device_id=0, block_size=16,
        kv_cache_layout="LBHNC"))
    local = LocalRegions.planes([1 << 32], [1 << 33], page // 2, 4)
    geo = PairGeometry(plan, remote, local, "staged", pool=StagingPool(1 << 40, page, 8))
    for ids, tokens in (([0], None), ([0, 1], 16)):  # one block; two, of which the tokens fill one
        try:
            geo.staged_descs(ids, np.array([[0, 1]]), remote_num_tokens=tokens)
        except GeometryError as e:
            assert e.field == "slots", e
        else:
            raise AssertionError("two slots for one block accepted")


# -- heterogeneous TP: head slices -------------------------------------------------------------------------


@st.composite
def sliced_cases(draw):
    """A decoder rank reading one prefill rank's head slice (``rank_read``'s, or any byte range that fits)
    and a request, with the decoder's K/V planes (direct, staged) and its whole blocks (plain)."""
    n, d = draw(st.sampled_from([16, 32])), 64
    local_tp, remote_tp = draw(st.sampled_from([(1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2), (1, 1)]))
    total = draw(st.sampled_from([4, 8]))
    t = draw(st.integers(0, local_tp - 1))
    h = total // local_tp
    remote_fmt = fmt(STANDARD, "LBHNC", total // remote_tp, n, d)
    shuffled, whole = fmt(AITER_SHUFFLED, "LHBNC", h, n, d), fmt(STANDARD, "LBHNC", h, n, d)
    reads = [rank_read(remote_fmt, shuffled, local_tp=local_tp, local_rank=t, remote_tp=remote_tp,
                       remote_rank=r) for r in range(remote_tp)]
    mine = [rr for rr in reads if isinstance(rr, RankRead)]
    assert mine
    rr_ = draw(st.sampled_from(mine))
    view, src = rr_.view, rr_.source
    remote_page, local_page = remote_fmt.page_bytes, shuffled.page_bytes
    if draw(st.booleans()):  # any byte range inside both pages, in 16-byte steps
        unit = 16
        length = unit * draw(st.integers(1, min(remote_page, local_page) // unit))
        ro = unit * draw(st.integers(0, (remote_page - length) // unit))
        lo = unit * draw(st.integers(0, (local_page - length) // unit))
        src = SourceSlice(src.remote_rank, ro, lo, length)
    plans = {"planes": negotiate(view, shuffled), "blocks": negotiate(view, whole)}
    assert all(isinstance(p, Plan) for p in plans.values()), plans
    layers = draw(st.integers(1, 3))
    rr = draw(st.sampled_from([1, 2]))
    remote, rspans = draw(remote_side(layers, 1, remote_page, n, rr, "LBHNC"))
    lr = draw(st.sampled_from([1, 2]))
    planes, pspans = draw(local_side(2 * layers, local_page // 2, lr))
    blocks, bspans = draw(local_side(layers, local_page, lr))
    r_limit = int(remote.num_blocks.min())
    l_limit = max(int(planes.num_blocks.min()), int(blocks.num_blocks.min()))
    rids, lids, tokens = draw(request(r_limit, l_limit, rr, lr, n, 6))
    return dict(plans=plans, remote=remote, rspans=rspans, planes=(planes, pspans), blocks=(blocks, bspans),
                rr=rr, lr=lr, n=n, rids=rids, lids=lids, tokens=tokens, layers=layers, k=1, r_limit=r_limit,
                src=src, local_page=local_page)


@FAST
@given(sliced_cases(), st.data())
def test_sliced_descs_move_exactly_the_head_slice_the_oracle_says(c, data):
    """Each mode in turn on the same slice and request."""
    src = c["src"]
    r = c["remote"]
    ro, lo, length = src.remote_offset, src.local_offset, src.length
    half = c["local_page"] // 2
    for mode in ("direct", "staged", "plain"):
        loc, lspans = c["blocks"] if mode == "plain" else c["planes"]
        try:
            pairs, may = _oracle({**c, "l_limit": int(loc.num_blocks.min())})
        except Refused as e:
            pairs, may = None, e.fields
        n = len(pairs) if pairs is not None else 0
        plan = c["plans"]["blocks" if mode == "plain" else "planes"]
        pool, slots, ok = None, None, True
        if mode == "staged":
            pool, lspans = _pool(data.draw, {"plan": plan}, c["layers"] * max(n, 1))
            slots, ok = data.draw(slot_matrix(c["layers"], n, pool.num_slots))
        geo = PairGeometry(plan, r, loc, mode, pool=pool, source=src)
        call = lambda: geo.sliced_descs(c["lids"], c["rids"], c["tokens"], slots)  # noqa: E731, B023
        if pairs is None or not ok:
            refused(call, may | {"slots"} if mode == "staged" else may)
            continue
        try:
            d = call()
        except GeometryError as e:
            assert e.field in may, (e.field, e.reason)
            continue
        want = []
        for layer in range(c["layers"]):
            cps = []
            for i, (lb, rb) in enumerate(pairs):
                remote_at = _rows(r, layer, rb) + ro
                if mode == "staged":
                    cps.append((pool.base + int(slots[layer, i]) * pool.slot_bytes + lo, remote_at, length))
                elif mode == "plain":
                    cps.append((_rows(loc, layer, lb) + lo, remote_at, length))
                else:  # bytes [0, half) of the local page are its K plane block, [half, 2 half) its V plane's
                    for plane in (0, 1):
                        a, b = max(lo, plane * half), min(lo + length, (plane + 1) * half)
                        if a < b:
                            at = _rows(loc, 2 * layer + plane, lb) + a - plane * half
                            cps.append((at, remote_at + a - lo, b - a))
            want.append(cps)
        _check_explicit(d, want, c, ldev=PDEV if mode == "staged" else LDEV, lspans=lspans)


# -- runs: merge_runs against unit copies ------------------------------------------------------------------


@FAST
@given(st.data())
def test_merge_runs_is_the_unit_copies_in_maximal_runs(data):
    g, n = data.draw(st.integers(1, 4)), data.draw(st.integers(0, 12))
    unit = np.array([data.draw(st.sampled_from([8, 16, 24])) for _ in range(g)], np.int64)
    ra = np.zeros((g, n), np.uint64)
    la = np.zeros((g, n), np.uint64)
    for layer in range(g):
        u = int(unit[layer])
        r_at, l_at = (layer + 1) << 30, (layer + 1) << 20
        for i in range(n):  # a walk: the next unit adjacent, or elsewhere (never overlapping locally)
            if i:
                r_at += u if data.draw(st.booleans()) else u * data.draw(st.integers(-3, 3))
                l_at += u if data.draw(st.booleans()) else u * data.draw(st.integers(2, 3))
            ra[layer, i], la[layer, i] = r_at, l_at
    d = merge_runs(ra, la, unit, RDEV, LDEV)
    for layer in range(g):
        u = int(unit[layer])
        lo, re = d.layer_slice(layer, layer + 1)
        same_map(copies_of(lo, re, LDEV, RDEV), [(int(la[layer, i]), int(ra[layer, i]), u) for i in range(n)])
        # merged maximally, in request order: a descriptor starts wherever either side is not adjacent
        starts = [int(la[layer, i]) for i in range(n)
                  if i == 0 or ra[layer, i] != ra[layer, i - 1] + u or la[layer, i] != la[layer, i - 1] + u]
        assert lo[:, 0].tolist() == starts
