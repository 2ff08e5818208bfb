"""FP8 grouped GEMM with rowwise scales, 2D x 3D: ``out[rows of g] = a[rows of g] @ b[g]^T``.

The MoE forward (``x`` times each expert's weight) and dgrad (``grad_out`` times
each expert's transposed weight). Tokens are sorted by expert; ``offs`` holds the
cumulative group ends as in ``torch._grouped_mm``. Any group sizes work (0, 1, not
multiples of 16), without a device-to-host sync.

Scheduling: work is a list of (group, row tile) *slots* decided on the device.
Group ``g`` (rows ``[s_g, e_g)``) owns slots ``base_g + j`` for
``j < cdiv(e_g - s_g, BLOCK_M)``, with ``base_g = s_g // BLOCK_M + g``; these
ranges are disjoint and increasing, so ``cdiv(M, BLOCK_M) + G + 1`` slots cover
every group plus one extra *tail group* (rows past ``offs[-1]``, written as 0).
Each program finds its group by counting the ``base`` values at or below its
slot (a vector reduction over ``offs``); slots no group owns do nothing.

Operands are K-major, as Hopper's FP8 tensor cores need: ``a`` tiles are
``(BLOCK_M, BLOCK_K)`` and ``b`` tiles ``(BLOCK_N, BLOCK_K)``, transposed for the
dot. Scales are applied once, in the epilogue.
"""

from __future__ import annotations

import helion
import helion.language as hl
import torch
import triton

from autotune_cache import select_config
from kernels_helion._launch import launch, on_cpu, require_interpreter_on_cpu
from kernels_helion.fp8_format import check_fp8_dtype
from kernels_helion.validation import check_offsets, check_same_device, check_tensor

OUT_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)

# ``block_m``/``block_n`` are the output tile (constexprs of the kernel, since the
# slot count depends on ``block_m``); the rest is the Helion config
# (``block_sizes`` = [BLOCK_K]).
DEFAULT_CONFIG = helion.Config(
    block_m=128,
    block_n=128,
    block_sizes=[128],
    num_warps=8,
    num_stages=4,
    indexing="tensor_descriptor",
)
CPU_CONFIG = helion.Config(block_m=16, block_n=16, block_sizes=[32], num_warps=4, num_stages=1)


@helion.kernel(static_shapes=False)
def grouped_mm_2d3d_kernel(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b_flat: torch.Tensor,
    b_scales_flat: torch.Tensor,
    offs: torch.Tensor,
    n: int,
    out_dtype: hl.constexpr,
    block_m: hl.constexpr,
    block_n: hl.constexpr,
    groups_pow2: hl.constexpr,
    upcast_operands: hl.constexpr,
) -> torch.Tensor:
    m, k = a.shape
    num_groups = offs.size(0)
    out = torch.empty([m, n], dtype=out_dtype, device=a.device)
    num_slots = (m + block_m - 1) // block_m + num_groups + 1
    num_n_tiles = (n + block_n - 1) // block_n
    for slot, n_tile in hl.grid([num_slots, num_n_tiles]):
        # Group ends, clamped into [0, M]; entry ``num_groups`` is the tail group's end, M.
        group_idx = hl.arange(groups_pow2)
        ends = hl.load(offs, [group_idx], extra_mask=group_idx < num_groups)
        ends = torch.where(group_idx < num_groups, torch.where(ends < 0, 0, torch.where(ends > m, m, ends)), m)
        # First slot of group i + 1 is ends[i] // block_m + i + 1.
        next_base = ends // block_m + group_idx + 1
        owns_later = (group_idx < num_groups) & (next_base <= slot)
        group = torch.sum(owns_later.to(torch.int32), dim=0)
        start = torch.sum(torch.where(group_idx == group - 1, ends, 0), dim=0)
        end = torch.sum(torch.where(group_idx == group, ends, 0), dim=0)
        row0 = start + (slot - (start // block_m + group)) * block_m
        row_end = torch.where(row0 + block_m < end, row0 + block_m, end)
        is_real_group = group < num_groups
        # Clamped expert index: the tail group reads nothing but must index in bounds.
        expert = torch.where(is_real_group, group, num_groups - 1)
        col0 = expert * n + n_tile * block_n
        col_end = expert * n + min(n_tile * block_n + block_n, n)
        if (row0 >= start) & (row0 < row_end):
            for tile_m, tile_c in hl.tile([row0, col0], [row_end, col_end], block_size=[block_m, block_n]):
                acc = hl.zeros([tile_m, tile_c], dtype=torch.float32)
                if is_real_group:
                    for tile_k in hl.tile(k):
                        a_tile = a[tile_m, tile_k]
                        b_tile = b_flat[tile_c, tile_k]
                        if upcast_operands:
                            acc = hl.dot(a_tile.to(torch.float32), b_tile.to(torch.float32).T, acc=acc)
                        else:
                            acc = hl.dot(a_tile, b_tile.T, acc=acc)
                scales = a_scales[tile_m][:, None] * b_scales_flat[tile_c][None, :]
                result = torch.where(is_real_group, acc * scales, 0.0)
                out[tile_m, tile_c.index - expert * n] = result.to(out_dtype)
    return out
