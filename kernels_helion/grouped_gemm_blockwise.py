"""FP8 grouped GEMM with blockwise scales (DeepSeek-V3's recipe), 2D x 3D: ``out[rows of g] = a[rows of g] @ b[g]^T``.

``a`` has one scale per 1x128 block of a row (``quantize_blockwise_rows``), ``b``
one per 128x128 block (``quantize_blockwise_weights``). Scales vary along the
contraction, so they cannot wait for the epilogue: each 128-wide K step's
product is scaled by its row scales and its weight block's scale before it is
added to the fp32 accumulator (as DeepGEMM does). The K tile is therefore the
scale block (128), and an N tile lies within one weight block (``BLOCK_N``
divides 128), so each K step needs one weight scale per tile.

Scheduling and guarantees are those of ``grouped_mm_2d3d``: row tiles cut from
each group's start (work items found on the device), rows past ``offs[-1]`` are
0, offsets are clamped into ``[0, M]``, any group sizes, no host sync,
deterministic. The row scales are read through their K-block-major layout: per
K step, ``BLOCK_M`` contiguous floats.

The kernel is ``kernels_helion.grouped_gemm.grouped_mm_2d3d_kernel`` with
``scaling="blockwise"``; this module holds its launcher and the checks of the
blockwise scale layouts.
"""

from __future__ import annotations

from collections.abc import Callable

import helion
import torch
import triton

from autotune_cache import select_config
from autotune_cache.registry import register_tuning
from kernels_helion._launch import on_cpu
from kernels_helion.fp8_format import BLOCKWISE_SCALE_BLOCK
from kernels_helion.grouped_gemm import check_2d3d_operands, launch_grouped_mm_2d3d
from kernels_helion.validation import check_same_device, check_scales, check_tensor
from kernels_helion.tuning import GEMM_SHAPES, GEMM_TEST_SHAPE, gemm_space, random_bf16, routed_offsets

# block_sizes = [BLOCK_M, BLOCK_N] (BLOCK_K is BLOCKWISE_SCALE_BLOCK). The fallback for shapes
# the autotune cache does not hold: the rowwise kernel's settings (TMA loads,
# L2-grouped tile order, persistent interleaved programs) with a 128-wide N tile,
# the widest that stays in one weight scale block.
DEFAULT_CONFIG = helion.Config(
    block_sizes=[128, 128],
    num_warps=8,
    num_stages=3,
    l2_groupings=[8],
    indexing="tensor_descriptor",
    pid_type="persistent_interleaved",
)
CPU_CONFIG = helion.Config(block_sizes=[32, 32], num_warps=4, num_stages=1)


def check_act_block_scales(a_scales: object, m: int, k_blocks: int, device: torch.device) -> torch.Tensor:
    """Check 1x128 activation scales: ``(M, k_blocks)`` float32 in ``quantize_blockwise_rows``'s K-block-major layout.

    Returns the ``(k_blocks, M)`` view with contiguous rows that the kernel reads.
    """
    check_tensor("a_scales", a_scales, ndim=2, dtypes=(torch.float32,), contiguous=False)
    assert isinstance(a_scales, torch.Tensor)
    if tuple(a_scales.shape) != (m, k_blocks):
        raise ValueError(f"a_scales must have shape {(m, k_blocks)}, got {tuple(a_scales.shape)}")
    check_same_device("a_scales", a_scales, device)
    scales_t = a_scales.t()
    # Row stride: a multiple of 4 floats (16 bytes, as TMA needs), as quantize_blockwise_rows pads it.
    if (m > 1 and scales_t.stride(1) != 1) or (k_blocks > 1 and (scales_t.stride(0) < m or scales_t.stride(0) % 4)):
        raise ValueError(
            "a_scales must be K-block-major as quantize_blockwise_rows returns it (strides (1, s) with s >= M, "
            f"s a multiple of 4), got strides {a_scales.stride()}"
        )
    return scales_t


def grouped_mm_2d3d_blockwise(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Grouped FP8 GEMM with 1x128 activation and 128x128 weight scales (DeepSeek-V3).

    ``out[i, j] = sum_kb (a[i, kb] @ b[g, j, kb]) * a_scales[i, kb] * b_scales[g, j // 128, kb]``
    over the 128-wide K blocks ``kb``, for the rows ``i`` of group ``g``
    (``offs[g-1] <= i < offs[g]``, ``offs[-1] = 0``). Rows past ``offs[-1]`` are
    written as 0. Offsets are clamped into ``[0, M]`` on the device, so bad
    offsets give wrong groups but never out-of-bounds accesses.

    Forward: ``a, a_scales = quantize_blockwise_rows(x)``, ``b, b_scales =
    quantize_blockwise_weights(W)``. Dgrad: ``a, a_scales =
    quantize_blockwise_rows(grad_out)``, ``b, b_scales =
    quantize_blockwise_weights_transposed(W)`` (``(E, K, N)``). K and N need not
    be multiples of 128 (partial last blocks).

    Args:
        a: ``(M, K)`` float8_e4m3fn, contiguous (row-major).
        a_scales: ``(M, ceil(K/128))`` float32, K-block-major (strides ``(1, s)``,
            ``s >= M`` a multiple of 4) as ``quantize_blockwise_rows`` returns it.
        b: ``(E, N, K)`` float8 (same dtype as ``a``), contiguous (K-major).
        b_scales: ``(E, ceil(N/128), ceil(K/128))`` float32, contiguous.
        offs: ``(E,)`` int32 cumulative group ends.
        out_dtype: bfloat16 (default), float16 or float32.

    Returns:
        ``(M, N)`` tensor of ``out_dtype``.
    """
    m, k, num_experts, n = check_2d3d_operands(a, b, offs, out_dtype)
    k_blocks = triton.cdiv(k, BLOCKWISE_SCALE_BLOCK)
    a_scales_t = check_act_block_scales(a_scales, m, k_blocks, a.device)
    check_scales("b_scales", b_scales, (num_experts, triton.cdiv(n, BLOCKWISE_SCALE_BLOCK), k_blocks), a.device)
    if m == 0:
        return torch.empty((0, n), dtype=out_dtype, device=a.device)
    key = {"M": m, "N": n, "K": k, "G": num_experts}
    config = select_config("grouped_mm_2d3d_blockwise", key, CPU_CONFIG if on_cpu(a) else DEFAULT_CONFIG)
    block_n = config.config["block_sizes"][1]
    if BLOCKWISE_SCALE_BLOCK % block_n:
        raise ValueError(
            f"grouped_mm_2d3d_blockwise config: BLOCK_N must divide {BLOCKWISE_SCALE_BLOCK}, got {block_n}"
        )
    return launch_grouped_mm_2d3d(a, a_scales_t, b, b_scales, offs, out_dtype, "blockwise", config)


# Tuning: BLOCK_K is fixed at 128 and BLOCK_N must divide 128 (one weight scale per tile).
def _tuning_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
    from kernels_helion.quantize_blockwise import quantize_blockwise_rows, quantize_blockwise_weights

    a, a_scales = quantize_blockwise_rows(random_bf16(shape["M"], shape["K"], device=device))
    b, b_scales = quantize_blockwise_weights(random_bf16(shape["G"], shape["N"], shape["K"], device=device))
    offs = routed_offsets(shape["M"], shape["G"], device)
    return lambda: grouped_mm_2d3d_blockwise(a, a_scales, b, b_scales, offs)


register_tuning(
    "grouped_mm_2d3d_blockwise",
    DEFAULT_CONFIG,
    gemm_space(DEFAULT_CONFIG, [[128, 128], [64, 128], [256, 128]], two_per_sm=True),
    GEMM_SHAPES,
    _tuning_call,
    GEMM_TEST_SHAPE,
    exact=False,
)
