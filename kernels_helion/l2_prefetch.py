"""Device helper: ask L2 for a tile of a gradient that the program's epilogue will read.

The FP8 wgrad (``grouped_mm_wgrad``) adding into an existing 16-bit gradient reads the
gradient's tile in its epilogue, after the contraction. With a few hundred rows a group
the contraction is short and Triton 3.6 does not overlap one tile's epilogue with the next tile's loads
on sm90, so that read's DRAM latency is exposed in every tile. Loading the tile early
costs registers the kernel does not have (docs/experiments.md). ``prefetch.global.L2``
costs none: one instruction per 128-byte line, no result, no wait, and it never faults
(addresses are also clamped into the tensor). It gave the DeepSeek-V3-like 256-expert
wgrads 1.12-1.14x on the H100 and H200 (``python -m benchmarks.wgrad_prefetch``); the bf16
wgrad, whose 16-bit operand loads already keep memory busy, ran 0.95-1.03x with it and
does not issue it.
"""

from __future__ import annotations

import helion.language as hl
import torch

# One prefetch per line of this many bytes.
LINE_BYTES = 128
# Whether the FP8 wgrad prefetches an accumulated gradient's tiles (benchmarks turn it off to compare).
PREFETCH_GRADIENT = True


def gradient_prefetch(out: torch.Tensor, accumulate: bool, cpu: bool) -> int:
    """The FP8 wgrad's ``prefetch_out`` argument: ``out``'s element size when its tiles are prefetched, else 0.

    Only an accumulated gradient is read, and only a 16-bit one is prefetched (an fp32
    ``main_grad`` ran 0.93-1.01x with it). The prefetch is NVIDIA PTX: neither the CPU
    interpreter nor a ROCm build issues it.
    """
    nvidia = not cpu and torch.version.hip is None
    return out.element_size() if accumulate and out.element_size() == 2 and PREFETCH_GRADIENT and nvidia else 0


def prefetch_tile_l2(
    t: torch.Tensor, group: object, tile_n: object, tile_k: object, n: object, k: object, element_size: int
) -> None:
    """Device helper: prefetch the lines of ``t[group, tile_n, tile_k]`` into L2 (``t`` contiguous ``(G, n, k)``)."""
    hl.inline_triton(
        """
        pf_rows = tl.minimum({1} + tl.arange(0, {2}), {5} - 1)
        pf_cols = tl.minimum({3} + tl.arange(0, ({4} + {7} - 1) // {7}) * {7}, {6} - 1)
        pf_ptrs = {0} + ({8} * {5} + pf_rows[:, None]).to(tl.int64) * {6} + pf_cols[None, :]
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [pf_ptrs], dtype=tl.int32, is_pure=False, pack=1
        )
        """,
        args=(t, tile_n.begin, tile_n.block_size, tile_k.begin, tile_k.block_size, n, k,
              LINE_BYTES // element_size, group),
        output_like=None,
    )


def prefetch_tile_ahead_l2(
    t: torch.Tensor, group: object, tile_n: object, tile_k: object, n: object, k: object, groups: object,
    element_size: int, ahead: int, l2_grouping: int,
) -> None:
    """Device helper: prefetch into L2 the lines of the tile that comes ``ahead`` tiles after this one.

    The order is that of Helion's tile loop over ``[k, n, groups]`` (``block_size=[BK, BN, 1]``): with
    ``l2_grouping == 1`` K tiles vary fastest, then N tiles, then groups; with ``L > 1`` the (K, N)
    tiles of a group go in bands of ``L`` K tiles, N slower within a band. Its position is found by
    inverting that order at this tile, adding ``ahead``, and mapping back; past the last tile it is
    the last tile (a prefetch of nothing new).
    """
    if l2_grouping == 1:
        position = """
        pf_lin = {8} * pf_tiles + pf_pn * pf_nk + pf_pk
        pf_nxt = tl.minimum(pf_lin + {10}, {9} * pf_tiles - 1)
        pf_g = pf_nxt // pf_tiles
        pf_in = pf_nxt % pf_tiles
        pf_pk2 = pf_in % pf_nk
        pf_pn2 = pf_in // pf_nk
        """
    else:
        position = """
        pf_first = (pf_pk // {11}) * {11}
        pf_size = tl.minimum(pf_nk - pf_first, {11})
        pf_lin = {8} * pf_tiles + pf_first * pf_nn + pf_pn * pf_size + (pf_pk - pf_first)
        pf_nxt = tl.minimum(pf_lin + {10}, {9} * pf_tiles - 1)
        pf_g = pf_nxt // pf_tiles
        pf_in = pf_nxt % pf_tiles
        pf_first2 = (pf_in // ({11} * pf_nn)) * {11}
        pf_size2 = tl.minimum(pf_nk - pf_first2, {11})
        pf_pk2 = pf_first2 + (pf_in % ({11} * pf_nn)) % pf_size2
        pf_pn2 = (pf_in % ({11} * pf_nn)) // pf_size2
        """
    hl.inline_triton(
        """
        pf_nk = tl.cdiv({6}, {4})
        pf_nn = tl.cdiv({5}, {2})
        pf_tiles = pf_nk * pf_nn
        pf_pk = {3} // {4}
        pf_pn = {1} // {2}
        """
        + position
        + """
        pf_rows = tl.minimum(pf_pn2 * {2} + tl.arange(0, {2}), {5} - 1)
        pf_cols = tl.minimum(pf_pk2 * {4} + tl.arange(0, ({4} + {7} - 1) // {7}) * {7}, {6} - 1)
        pf_ptrs = {0} + (pf_g * {5} + pf_rows[:, None]).to(tl.int64) * {6} + pf_cols[None, :]
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [pf_ptrs], dtype=tl.int32, is_pure=False, pack=1
        )
        """,
        args=(t, tile_n.begin, tile_n.block_size, tile_k.begin, tile_k.block_size, n, k,
              LINE_BYTES // element_size, group, groups, ahead, l2_grouping),
        output_like=None,
    )
