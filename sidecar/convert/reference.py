"""Reference converter in plain torch (any device): the permute formula of page-formats.md, vectorised.

Only copies, never arithmetic, so no bit pattern (NaNs included) can change: planes are handled as int16
(uint8 for 1-byte dtypes such as fp8), and as 16-byte elements (complex128, moved as opaque 16-byte units)
where every tensor is 16-byte aligned, which makes the row gathers, the row scatters and the K permutation
(whole 16-byte x-groups) far cheaper on the CPU. On the CPU the blocks go in cache-sized chunks so the
temporaries never leave the cache. An fp8 re-encode (``job.lut``) maps each permuted byte through its
tensor's table before the scatter.
"""

from __future__ import annotations

import torch

from sidecar.convert.checks import BASE, ConversionJob, aligned16

CPU_CHUNK_BYTES = 2 << 20  # pairs per chunk on the CPU: gather, permute and scatter stay in L2/L3
WIDE = torch.complex128  # a 16-byte element type; only ever copied, never computed on


def run_reference(job: ConversionJob) -> None:
    """Convert every layer of a checked job with torch ops: gather each pair, permute, scatter the tiles."""
    h, n, d, x = job.num_heads, job.block_size, job.head_size, job.x
    m_all = job.ids.numel()
    if m_all == 0:
        return
    half = job.plane_block_elems
    base = BASE[job.elem_bytes]
    unit = x if aligned16(job) else 1  # base elements per moved element
    elem = WIDE if unit > 1 else base
    chunk = (m_all if job.device.type != "cpu"
             else max(1, min(m_all, CPU_CHUNK_BYTES // (2 * job.elem_bytes * half))))
    ids_all = job.ids.to(job.device)
    pages = torch.empty((chunk, 2 * half), dtype=base, device=job.device) if job.srcs is None else None
    k_out = torch.empty((chunk, half), dtype=base, device=job.device)
    v_out = torch.empty((chunk, half), dtype=base, device=job.device)
    wide = lambda t: t.view(elem)
    for layer, (kp, vp) in enumerate(zip(job.k_planes, job.v_planes, strict=False)):
        for c0 in range(0, m_all, chunk):
            ids = ids_all[c0:c0 + chunk]
            m = ids.numel()
            if job.srcs is None:
                # The whole pair is gathered before anything is written: destination aliases source.
                src = pages[:m]
                torch.index_select(wide(kp), 0, ids, out=wide(src)[:, : half // unit])
                torch.index_select(wide(vp), 0, ids, out=wide(src)[:, half // unit:])
            elif job.src_index is None:
                src = job.srcs[layer][c0:c0 + m]
            else:  # block ids[i] reads source row src_index[i]
                src = job.srcs[layer].index_select(0, job.src_index[c0:c0 + m].to(job.device))
            # K tile [H, D/x, N, x]: whole 16-byte x-groups move, so permute in units of `unit` elements.
            k_src = wide(src).view(m, h, n, 2, d // x, x // unit)[:, :, :, 0].permute(0, 1, 3, 2, 4)
            wide(k_out[:m]).view(m, h, d // x, n, x // unit).copy_(k_src)
            # V tile [H, N/x, D, x]: an element-wise transpose of x tokens by D dims.
            v_src = src.view(m, h, n // x, x, 2, d)[:, :, :, :, 1].permute(0, 1, 2, 4, 3)
            v_out[:m].view(m, h, n // x, d, x).copy_(v_src)
            if job.lut is not None:
                _reencode(job, k_out[:m], 0)
                _reencode(job, v_out[:m], 1)
            wide(kp).index_put_((ids,), wide(k_out[:m]))
            wide(vp).index_put_((ids,), wide(v_out[:m]))


def _reencode(job: ConversionJob, out: torch.Tensor, tensor: int) -> None:
    """Map the bytes of ``out`` (K: tensor 0, V: 1) through the job's table and count the flagged ones."""
    codes = job.lut[tensor][out.long()]
    out.copy_((codes & 0xFF).to(torch.uint8))
    if job.counts is not None:
        job.counts[0] += ((codes >> 8) & 1).sum()
        job.counts[1] += ((codes >> 9) & 1).sum()
