"""FP8 grouped GEMM for MoE weight gradients with blockwise scales (DeepSeek-V3's recipe).

``out[g] = sum_j (a_t[:, block j of g] @ b_t[:, block j of g].T) * a_scales[r][:, None] * b_scales[r][None, :]``

``a_t`` (N, R*128) is ``grad_out^T`` and ``b_t`` (K, R*128) is ``x^T``, both
from ``quantize_blockwise_cols_grouped``: each group's tokens are cut into
128-token blocks starting at the group's first token, and block ``j`` of group
``g`` is block row ``r = group_block_starts[g] + j``: its per-column scales are
row ``r`` of the scales and its tokens columns ``[128 r, 128 r + 128)`` of the
operands ("block space", DeepGEMM's M-aligned layout), zero past the group's
last token. The scales vary along the contraction, so each block's product is
scaled before it is added to the fp32 accumulator (as DeepGEMM does); the token
tile is the scale block.

One program per (group, N tile, K tile), as ``grouped_mm_wgrad``: any group size
(0, 1, not a multiple of 16), bitwise deterministic, no atomics, optional fused
accumulation into an fp32 ``out``. Every block is a whole, 128-aligned slice of
the (rows, R, 128) view of the operands, so token loads need no mask. On NVIDIA
GPUs from Hopper on, the operand blocks load through TMA descriptors.
"""

from __future__ import annotations

from collections.abc import Callable

import helion
import helion.language as hl
import torch

from autotune_cache import select_config
from autotune_cache.registry import register_tuning
from kernels_helion._launch import has_tma, launch, on_cpu, require_interpreter_on_cpu
from kernels_helion.group_offsets import group_lanes
from kernels_helion.grouped_gemm import tile_dot
from kernels_helion.fp8_format import BLOCKWISE_SCALE_BLOCK
from kernels_helion.grouped_gemm_wgrad import check_wgrad_operands, tma_config, wgrad_output
from kernels_helion.validation import check_offsets, check_scales, check_tensor
from kernels_helion.tuning import GEMM_SHAPES, GEMM_TEST_SHAPE, gemm_space, random_bf16, routed_offsets

# block_sizes = [BLOCK_K, BLOCK_N]; the token tile is BLOCKWISE_SCALE_BLOCK. grouped_mm_wgrad's
# settings with 128x128 output tiles (tuned per shape in autotune_cache).
DEFAULT_CONFIG = helion.Config(
    block_sizes=[128, 128],
    num_warps=8,
    num_stages=3,
    l2_groupings=[8],
    pid_type="persistent_interleaved",
)
CPU_CONFIG = helion.Config(block_sizes=[32, 32], num_warps=4, num_stages=1)


@helion.kernel(static_shapes=False)
def grouped_mm_wgrad_blockwise_kernel(
    a_blocks: torch.Tensor,
    a_scales: torch.Tensor,
    b_blocks: torch.Tensor,
    b_scales: torch.Tensor,
    offs: torch.Tensor,
    group_block_starts: torch.Tensor,
    out: torch.Tensor,
    accumulate: hl.constexpr,
    groups_pow2: hl.constexpr,
    upcast_operands: hl.constexpr,
) -> torch.Tensor:
    n, scale_rows, _ = a_blocks.shape
    k = b_blocks.size(0)
    # A compile-time block length: the token dimension of a block is whole, no mask.
    token_block = hl.specialize(a_blocks.size(2))
    num_groups = offs.size(0)
    # K tiles vary fastest, groups slowest: neighbouring programs share a_t's tile.
    for tile_k, tile_n, tile_g in hl.tile([k, n, num_groups], block_size=[None, None, 1]):
        g = tile_g.begin
        # Group sizes from the offsets, clamped to >= 0 (the quantizer's block counts for valid offsets).
        group_idx = hl.arange(groups_pow2)
        ends = hl.load(offs, [group_idx], extra_mask=group_idx < num_groups)
        ends = torch.where(ends < 0, 0, ends)
        start = torch.amax(torch.where(group_idx == g - 1, ends, 0), dim=0)
        end = torch.amax(torch.where(group_idx == g, ends, 0), dim=0)
        block_count = torch.where(end > start, (end - start + (token_block - 1)) // token_block, 0)
        # The group's block rows, clamped into [0, R] so that a bad block map never reads out of bounds.
        first_block = hl.load(group_block_starts, [g])
        first_block = torch.where(first_block < 0, 0, torch.where(first_block < scale_rows, first_block, scale_rows))
        last_block = torch.where(block_count < scale_rows - first_block, first_block + block_count, scale_rows)
        acc = hl.zeros([tile_n, tile_k], dtype=torch.float32)
        for tile_j in hl.tile(first_block, last_block, block_size=1):
            # Whole aligned 128-token blocks, zero past the group's tokens: no token mask.
            block_product = tile_dot(
                hl.zeros([tile_n, tile_k], dtype=torch.float32),
                a_blocks[tile_n, tile_j.begin, :],
                b_blocks[tile_k, tile_j.begin, :],
                upcast_operands,
            )
            a_block_scales = a_scales[tile_j.begin, tile_n]
            b_block_scales = b_scales[tile_j.begin, tile_k]
            acc = acc + block_product * (a_block_scales[:, None] * b_block_scales[None, :])
        if accumulate:
            out[g, tile_n, tile_k] = out[g, tile_n, tile_k] + acc
        else:
            out[g, tile_n, tile_k] = acc.to(out.dtype)
    return out


def grouped_mm_wgrad_blockwise(
    a_t: torch.Tensor,
    a_scales: torch.Tensor,
    b_t: torch.Tensor,
    b_scales: torch.Tensor,
    offs: torch.Tensor,
    group_block_starts: torch.Tensor,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Per-group FP8 GEMM over each group's tokens with 128x1 block scales (MoE weight gradient).

    ``out[g] = sum_r (a_t[:, B_r] @ b_t[:, B_r].T) * a_scales[r][:, None] * b_scales[r][None, :]``
    over the group's block rows ``r = group_block_starts[g] + j``, ``j <
    ceil(size_g / 128)`` (``size_g = offs[g] - offs[g-1]``, ``offs[-1] = 0``),
    where ``B_r = [128 r, 128 (r + 1))`` are the columns of block ``r`` in the
    operands' block space (see ``quantize_blockwise_cols_grouped``).
    A group with no tokens gives 0. Offsets are clamped to ``>= 0`` and block
    rows into ``[0, R]`` on the device (bad inputs: wrong results, never
    out-of-bounds accesses).

    Usage: ``a_t, a_scales, starts = quantize_blockwise_cols_grouped(grad_out, offs)``,
    ``b_t, b_scales, _ = quantize_blockwise_cols_grouped(x, offs)`` (both
    give the same block map for the same ``offs``), then
    ``grad_W = grouped_mm_wgrad_blockwise(a_t, a_scales, b_t, b_scales, offs, starts)``.

    Args:
        a_t: ``(N, R * 128)`` float8_e4m3fn, contiguous, block space (e.g. ``grad_out^T``):
            columns of a block past its group's last token are 0.
        a_scales: ``(R, N)`` float32 contiguous, one row per token block (R >= 1).
        b_t: ``(K, R * 128)`` float8 (same dtype), contiguous, block space (e.g. ``x^T``).
        b_scales: ``(R, K)`` float32 contiguous, the same rows as ``a_scales``.
        offs: ``(G,)`` int32 cumulative group ends.
        group_block_starts: ``(G,)`` int32, each group's first block row.
        out: optional ``(G, N, K)`` float32 contiguous accumulator: the result is
            added to it in place (``out += ...``) and it is returned.
        out_dtype: dtype of a new output (bfloat16, float16, float32) when ``out`` is None.

    Returns:
        ``(G, N, K)``: ``out`` when given, else a new tensor of ``out_dtype``.
    """
    n, columns, k = check_wgrad_operands(a_t, b_t)
    check_offsets(offs, a_t.device)
    num_groups = offs.shape[0]
    check_tensor("a_scales", a_scales, ndim=2, dtypes=(torch.float32,))
    scale_rows = a_scales.shape[0]
    if scale_rows == 0:
        raise ValueError(f"a_scales must have at least one row, got shape {tuple(a_scales.shape)}")
    check_scales("a_scales", a_scales, (scale_rows, n), a_t.device)
    check_scales("b_scales", b_scales, (scale_rows, k), a_t.device)
    if columns != scale_rows * BLOCKWISE_SCALE_BLOCK:
        raise ValueError(
            f"a_t and b_t must have {BLOCKWISE_SCALE_BLOCK} block-space columns per scale row "
            f"({scale_rows} * {BLOCKWISE_SCALE_BLOCK} = {scale_rows * BLOCKWISE_SCALE_BLOCK}), got a_t {tuple(a_t.shape)}"
        )
    check_offsets(group_block_starts, a_t.device, name="group_block_starts")
    if group_block_starts.shape[0] != num_groups:
        raise ValueError(
            f"group_block_starts must have one entry per group ({num_groups}), "
            f"got shape {tuple(group_block_starts.shape)}"
        )
    out, accumulate = wgrad_output(out, out_dtype, (num_groups, n, k), a_t.device)
    require_interpreter_on_cpu(a_t)
    cpu = on_cpu(a_t)
    # M: the token count the quantizer's R = ceil(M/128) + G block rows stand for (rounded up to 128).
    key = {"M": max((scale_rows - num_groups) * BLOCKWISE_SCALE_BLOCK, 1), "N": n, "K": k, "G": num_groups}
    config = select_config("grouped_mm_wgrad_blockwise", key, CPU_CONFIG if cpu else DEFAULT_CONFIG)
    args = (
        a_t.view(n, scale_rows, BLOCKWISE_SCALE_BLOCK),
        a_scales,
        b_t.view(k, scale_rows, BLOCKWISE_SCALE_BLOCK),
        b_scales,
        offs,
        group_block_starts,
        out,
        accumulate,
        group_lanes(num_groups),
        cpu,
    )
    # Each step's two operand blocks through TMA: 5-15% faster than pointer loads on the H200
    # at the MoE shapes, bitwise the same result (``docs/experiments.md``).
    loads = ("a_blocks", "b_blocks") if has_tma(a_t.device) else ()
    kernel_config = tma_config(grouped_mm_wgrad_blockwise_kernel, args, config, out, accumulate, loads)
    launch(grouped_mm_wgrad_blockwise_kernel, args, kernel_config)
    return out


# Tuning: both operands from ``quantize_blockwise_cols_grouped``.
def _tuning_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
    from kernels_helion.quantize_blockwise import quantize_blockwise_cols_grouped

    offs = routed_offsets(shape["M"], shape["G"], device)
    a_t, a_scales, starts = quantize_blockwise_cols_grouped(random_bf16(shape["M"], shape["N"], device=device), offs)
    b_t, b_scales, _ = quantize_blockwise_cols_grouped(random_bf16(shape["M"], shape["K"], device=device), offs)
    return lambda: grouped_mm_wgrad_blockwise(a_t, a_scales, b_t, b_scales, offs, starts)


register_tuning(
    "grouped_mm_wgrad_blockwise",
    DEFAULT_CONFIG,
    gemm_space(DEFAULT_CONFIG, [[128, 128], [64, 128], [128, 64]], two_per_sm=True),
    GEMM_SHAPES,
    _tuning_call,
    GEMM_TEST_SHAPE,
    exact=False,
)
