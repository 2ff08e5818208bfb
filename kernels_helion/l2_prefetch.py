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
