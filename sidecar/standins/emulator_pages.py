"""The emulated prefill's KV cache, pure: deterministic page contents and where each page lives.

Every byte of every page is a function of (seed, tp_rank, layer, kernel block, generation), so a reader can
check what it got, and a block that was reused (generation bumped) reads back different bytes.
Elements are finite numbers in every supported dtype (the second-highest bit of each element is cleared: no
NaN/Inf exponent). ``expected_pages_torch`` computes the very same bytes with torch on any device (a GPU
emulator fills gigabytes of VRAM with it in a blink); torch is imported only there.
"""

from __future__ import annotations

import numpy as np

from sidecar.wire.formats import PageFormat

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_ELEM_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer, elementwise on uint64 (wrapping)."""
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _page_seeds(
    seed: int, tp_rank: int, layer: int, blocks: np.ndarray, generations: np.ndarray
) -> np.ndarray:
    z = _mix(np.array([seed], dtype=np.uint64))
    z = _mix(z ^ np.uint64(tp_rank))
    z = _mix(z ^ np.uint64(layer))
    z = _mix(z ^ blocks.astype(np.uint64))
    return _mix(z ^ generations.astype(np.uint64))


def expected_pages(
    seed: int,
    layer: int,
    blocks: np.ndarray | list[int],
    generations: np.ndarray | list[int] | int,
    fmt: PageFormat,
    tp_rank: int = 0,
) -> np.ndarray:
    """Pages of kernel ``blocks`` of ``layer`` at their ``generations``: uint8 [len(blocks), page_bytes]."""
    blocks = np.asarray(blocks, dtype=np.int64).reshape(-1)
    gens = np.broadcast_to(np.asarray(generations, dtype=np.int64), blocks.shape)
    if (blocks < 0).any() or (gens < 0).any() or min(seed, layer, tp_rank) < 0:
        raise ValueError("seed, tp_rank, layer, blocks and generations must be non-negative")
    page = fmt.page_bytes
    words = -(-page // 8)
    base = _page_seeds(seed, tp_rank, layer, blocks, gens)
    out = _mix(base[:, None] + np.arange(words, dtype=np.uint64)[None, :]).view(np.uint8)[:, :page]
    out = np.ascontiguousarray(out)
    elem = fmt.elem_bytes
    lanes = out.view(_ELEM_UINT[elem])
    lanes &= _ELEM_UINT[elem](~(1 << (8 * elem - 2)) & ((1 << (8 * elem)) - 1))
    return out


def _signed(value: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no general uint64 arithmetic)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _mix_torch(z):  # noqa: ANN001, ANN202 - torch.Tensor, imported lazily
    """``_mix`` on int64 tensors: add, xor and multiply wrap like uint64; right shifts made logical."""
    z = z + _signed(int(_GOLDEN))
    for shift, mult in ((30, int(_M1)), (27, int(_M2))):
        z = (z ^ ((z >> shift) & ((1 << (64 - shift)) - 1))) * _signed(mult)
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def expected_pages_torch(
    seed: int,
    layer: int,
    blocks: np.ndarray | list[int],
    generations: np.ndarray | list[int] | int,
    fmt: PageFormat,
    tp_rank: int = 0,
    *,
    device: str = "cpu",
    chunk_words: int = 1 << 24,
):  # noqa: ANN201 - torch.Tensor
    """``expected_pages`` computed by torch on ``device``: the same bytes, uint8 [len(blocks), page_bytes]."""
    import torch

    blocks = np.asarray(blocks, dtype=np.int64).reshape(-1)
    gens = np.broadcast_to(np.asarray(generations, dtype=np.int64), blocks.shape)
    if (blocks < 0).any() or (gens < 0).any() or min(seed, layer, tp_rank) < 0:
        raise ValueError("seed, tp_rank, layer, blocks and generations must be non-negative")
    page = fmt.page_bytes
    words = -(-page // 8)
    out = torch.empty((blocks.size, page), dtype=torch.uint8, device=device)
    if blocks.size == 0:
        return out
    base = torch.from_numpy(_page_seeds(seed, tp_rank, layer, blocks, gens).view(np.int64)).to(device)
    offsets = torch.arange(words, dtype=torch.int64, device=device)
    elem = fmt.elem_bytes
    lane_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[elem]
    mask = ~(1 << (8 * elem - 2)) & ((1 << (8 * elem)) - 1)
    if elem > 1 and mask >= 1 << (8 * elem - 1):
        mask -= 1 << (8 * elem)  # the same bits as a signed lane
    step = max(1, chunk_words // words)
    for lo in range(0, blocks.size, step):
        z = _mix_torch(base[lo : lo + step, None] + offsets[None, :])
        rows = z.view(torch.uint8)[:, :page]
        lanes = rows.contiguous().view(lane_dtype) if page % 8 else rows.view(lane_dtype)
        out[lo : lo + step] = (lanes & mask).view(torch.uint8)
    return out


def expected_page(
    seed: int, layer: int, block: int, generation: int, fmt: PageFormat, tp_rank: int = 0
) -> np.ndarray:
    """One page (kernel block ``block`` of ``layer``) as uint8 [page_bytes]."""
    return expected_pages(seed, layer, [block], [generation], fmt, tp_rank)[0]


def kernel_blocks(logical_blocks: list[int], ratio: int) -> list[int]:
    """vLLM's _logical_to_kernel_block_ids: logical L → kernel blocks L·ratio + j, in order."""
    return [b * ratio + j for b in logical_blocks for j in range(ratio)]


def page_offset(layer: int, kernel_block: int, num_kernel_blocks: int, page_bytes: int) -> int:
    """Byte offset of a page in the one LBHNC allocation: layer-major, then block."""
    return (layer * num_kernel_blocks + kernel_block) * page_bytes
