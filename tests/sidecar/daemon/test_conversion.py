"""``Conversions`` on the CPU twin: a group converts in the worker thread through the pairing's planes (an fp8
e4m3fn -> e4m3fnuz pairing re-encodes every byte and reports what did not keep its value)."""

from __future__ import annotations

import asyncio
import types

import numpy as np
import torch

from sidecar.convert import PlaneSet
from sidecar.convert.launch import convert_blocks
from sidecar.daemon.conversion import Conversions, reencode_planes
from sidecar.wire.formats import AITER_SHUFFLED, STANDARD, PageFormat, Plan, negotiate

H, N, D, BLOCKS, LAYERS = 2, 16, 64, 6, 2
GEOM = dict(num_heads=H, block_size=N, head_size=D)
# the decoder's scales twice the prefill's: the e4m3fn -> e4m3fnuz re-encode is then exact (no opt-in needed)
LOCAL = PageFormat(kind=AITER_SHUFFLED, layout="LHBNC", dtype="float8_e4m3fnuz", k_scale=2.0, v_scale=2.0,
                   **GEOM)
REMOTE = PageFormat(kind=STANDARD, layout="LBHNC", dtype="float8_e4m3fn", **GEOM)


def _caches(pages: torch.Tensor, ids: np.ndarray) -> types.SimpleNamespace:
    """CPU planes holding the standard pages in the blocks ``ids`` (a direct read's landing), the rest 0."""
    half = H * N * D
    fnuz = torch.float8_e4m3fnuz
    ks = [torch.zeros((BLOCKS, half), dtype=torch.uint8) for _ in range(LAYERS)]
    vs = [torch.zeros((BLOCKS, half), dtype=torch.uint8) for _ in range(LAYERS)]
    for layer in range(LAYERS):
        ks[layer][torch.from_numpy(ids)] = pages[layer, :, :half]
        vs[layer][torch.from_numpy(ids)] = pages[layer, :, half:]
    k, v = [t.view(fnuz) for t in ks], [t.view(fnuz) for t in vs]
    return types.SimpleNamespace(k_planes=k, v_planes=v, page_format=LOCAL, reencode_sets={},
                                 plane_set=PlaneSet(k, v, **GEOM), raw=(ks, vs))


def test_a_reencoding_pairing_converts_through_its_table_on_the_cpu_twin():
    plan = negotiate(REMOTE, LOCAL)
    assert isinstance(plan, Plan) and plan.reencode is not None
    ids = np.array([4, 1, 3])
    g = torch.Generator().manual_seed(5)
    pages = torch.randint(0, 256, (LAYERS, len(ids), 2 * H * N * D), generator=g, dtype=torch.int32)
    pages = pages.to(torch.uint8)
    caches, want = _caches(pages, ids), _caches(pages, ids)
    plain = _caches(pages, ids)
    reported = []
    conversions = Conversions(None, on_reencode=lambda sat, nan: reported.append((sat, nan)))
    job = types.SimpleNamespace(caches=caches, pairs=types.SimpleNamespace(local=ids), conversion=None,
                                timings={})

    async def main():
        conversions.begin(job, None, plan)
        conversions.convert_group(job, 0, 1)
        conversions.convert_group(job, 1, LAYERS)
        await conversions.finish(job, LAYERS)

    try:
        asyncio.run(main())
    finally:
        conversions.close()
    counts = convert_blocks(want, ids, LOCAL, None, None, None, reencode_planes(want, plan))
    convert_blocks(plain, ids, LOCAL, None)  # the same permutation without the table
    for got, expected, unmapped in zip(caches.raw, want.raw, plain.raw, strict=True):
        for layer in range(LAYERS):
            assert torch.equal(got[layer], expected[layer])
            assert not torch.equal(got[layer], unmapped[layer])  # the table changed the bytes
    assert reported == [tuple(int(c) for c in counts.tolist())]
    assert reported[0][1] > 0  # random bytes hold e4m3fn NaNs (0x7f, 0xff): counted, not hidden
