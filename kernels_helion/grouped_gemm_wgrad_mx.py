"""MXFP8 grouped GEMM for MoE weight gradients, emulated: a jagged contraction over each group's tokens.

``out[g] = sum_b (a_t[:, block b] @ b_t[:, block b].T) * 2**(ea[b] - 127)[:, None] * 2**(eb[b] - 127)[None, :]``

over group ``g``'s 32x1 scale blocks ``b``. ``a_t`` (N, M) is ``grad_out^T`` and
``b_t`` (K, M) is ``x^T``, tokens contiguous, both from
``quantize_mx_cols_grouped`` (or ``quantize_mx_rows_and_cols_grouped``) with the same
``offs``: blocks are the aligned 32-token cells cut at group boundaries, and
group ``g``'s block in cell ``c`` has its e8m0 scales in row ``block_offs[g-1] +
c - start_g // 32`` of ``a_scales (R, N)`` and ``b_scales (R, K)``.

For GPUs without MX tensor cores (Hopper): the scales vary along the
contraction, so each cell is one FP8 tensor-core dot (K step 32), scaled and
added into an fp32 accumulator. On Blackwell the recipe calls PyTorch's native
MXFP8 grouped GEMM instead (see ``ops.autograd_mx``).

Scheduling is ``grouped_mm_wgrad``'s: one program per (group, N tile, K tile)
loops over its group's cells, so a group of any size (0, 1, not a multiple of
32) works, the result is bitwise deterministic (no atomics), and with ``out``
given it is added to an fp32 accumulator. Cells are aligned to the tensor:
the group's first and last cells are loaded whole and masked to the group in
registers, the cells between are read through a ``(rows, M // 32, 32)`` view
with no token mask.
"""

from __future__ import annotations

from collections.abc import Callable

import helion
import helion.language as hl
import torch

from autotune_cache import select_config
from autotune_cache.registry import register_tuning
from kernels_helion._launch import launch, on_cpu, require_interpreter_on_cpu
from kernels_helion.group_offsets import group_lanes
from kernels_helion.grouped_gemm import tile_dot
from kernels_helion.grouped_gemm_mx import E8M0_SCALE_DTYPES, check_e8m0_scales
from kernels_helion.grouped_gemm_wgrad import check_wgrad_operands, edge_dot, wgrad_output
from kernels_helion.mx_format import MX_BLOCK_SIZE, e8m0_to_scale
from kernels_helion.validation import check_offsets, check_tensor
from kernels_helion.tuning import GEMM_SHAPES, GEMM_TEST_SHAPE, gemm_space, random_bf16, routed_offsets

# block_sizes = [BLOCK_K, BLOCK_N]; the token step is one 32-token cell.
# 128x64 tiles on one warp group (4 warps), 3 stages, on a flat (non-persistent)
# grid: each 32-token step waits for its dot before scaling it, so more resident
# programs per SM hide more of that wait. On the H200 this runs 1.45-1.67x as fast as
# 128x128 or 256x128 tiles on 8 warps in persistent programs at three MoE shapes,
# outputs bitwise equal (`docs/experiments.md`).
DEFAULT_CONFIG = helion.Config(
    block_sizes=[128, 64],
    num_warps=4,
    num_stages=3,
    l2_groupings=[8],
    pid_type="flat",
)
CPU_CONFIG = helion.Config(block_sizes=[32, 32], num_warps=4, num_stages=1)


def _block_scales(a_scales, b_scales, row, tile_n, tile_k) -> torch.Tensor:  # noqa: ANN001
    """fp32 ``2**(ea - 127) * 2**(eb - 127)`` of scale row ``row`` (clamped into the tensors), ``(BN, BK)``."""
    last = a_scales.size(0) - 1
    row = torch.where(row < 0, 0, torch.where(row > last, last, row))
    scale_a = e8m0_to_scale(hl.load(a_scales, [row, tile_n]).to(torch.int32))
    scale_b = e8m0_to_scale(hl.load(b_scales, [row, tile_k]).to(torch.int32))
    return scale_a.unsqueeze(1) * scale_b.unsqueeze(0)


@helion.kernel(static_shapes=False)
def grouped_mm_wgrad_mx_kernel(
    a_t: torch.Tensor,
    a_cells: torch.Tensor,
    a_scales: torch.Tensor,
    b_t: torch.Tensor,
    b_cells: torch.Tensor,
    b_scales: torch.Tensor,
    offs: torch.Tensor,
    block_offs: torch.Tensor,
    out: torch.Tensor,
    accumulate: hl.constexpr,
    groups_pow2: hl.constexpr,
    upcast_operands: hl.constexpr,
) -> torch.Tensor:
    n, m = a_t.shape
    k = b_t.size(0)
    cell = hl.specialize(a_cells.size(2))
    num_groups = offs.size(0)
    # K tiles vary fastest, groups slowest: neighbouring programs share a_t's tile.
    for tile_k, tile_n, tile_g in hl.tile([k, n, num_groups], block_size=[None, None, 1]):
        g = tile_g.begin
        # Group bounds, clamped into [0, M] (a vector load over all groups, then a select).
        group_idx = hl.arange(groups_pow2)
        ends = hl.load(offs, [group_idx], extra_mask=group_idx < num_groups)
        ends = torch.where(ends < 0, 0, torch.where(ends > m, m, ends))
        start = torch.amax(torch.where(group_idx == g - 1, ends, 0), dim=0)
        end = torch.amax(torch.where(group_idx == g, ends, 0), dim=0)
        first_row = hl.load(block_offs, [g - 1], extra_mask=g > 0)
        acc = hl.zeros([tile_n, tile_k], dtype=torch.float32)
        if end > start:
            first = start // cell
            last = (end - 1) // cell
            first_token = first * cell
            for tile_first in hl.tile(
                first_token, torch.where(first_token + cell < m, first_token + cell, m), block_size=cell
            ):
                product = edge_dot(
                    hl.zeros([tile_n, tile_k], dtype=torch.float32),
                    a_t, b_t, tile_n, tile_k, tile_first, start, end, upcast_operands,
                )
                acc = acc + product * _block_scales(a_scales, b_scales, first_row, tile_n, tile_k)
            for tile_j in hl.tile(first + 1, last, block_size=1):
                product = tile_dot(
                    hl.zeros([tile_n, tile_k], dtype=torch.float32),
                    a_cells[tile_n, tile_j.begin, :],
                    b_cells[tile_k, tile_j.begin, :],
                    upcast_operands,
                )
                row = first_row + tile_j.begin - first
                acc = acc + product * _block_scales(a_scales, b_scales, row, tile_n, tile_k)
            if last > first:
                last_token = last * cell
                for tile_last in hl.tile(
                    last_token, torch.where(last_token + cell < m, last_token + cell, m), block_size=cell
                ):
                    product = edge_dot(
                        hl.zeros([tile_n, tile_k], dtype=torch.float32),
                        a_t, b_t, tile_n, tile_k, tile_last, start, end, upcast_operands,
                    )
                    row = first_row + last - first
                    acc = acc + product * _block_scales(a_scales, b_scales, row, tile_n, tile_k)
        if accumulate:
            # An empty group leaves the accumulator exactly as it was.
            previous = out[g, tile_n, tile_k]
            out[g, tile_n, tile_k] = torch.where(end > start, previous + acc, previous)
        else:
            out[g, tile_n, tile_k] = acc.to(out.dtype)
    return out


def grouped_mm_wgrad_mx(
    a_t: torch.Tensor,
    a_scales: torch.Tensor,
    b_t: torch.Tensor,
    b_scales: torch.Tensor,
    offs: torch.Tensor,
    block_offs: torch.Tensor,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Per-group MXFP8 GEMM over each group's tokens (MoE weight gradient), emulated with FP8 dots per 32 tokens.

    ``out[g] = sum_c (a_t[:, T_c] @ b_t[:, T_c].T) * sa_c[:, None] * sb_c[None, :]``
    with ``sa_c = 2**(a_scales[r_c] - 127)``, ``sb_c = 2**(b_scales[r_c] - 127)``,
    summed over the cells ``c`` that group ``g`` (tokens ``[s, e)``, ``s = offs[g-1]``, 0 for
    the first group, ``e = offs[g]``) touches, ``T_c = [32 c, 32 c + 32) ∩ [s, e)``,
    ``r_c = block_offs[g-1] + c - s // 32``. Tokens past ``offs[-1]`` are ignored; a
    group with no tokens gives 0 (its scales are never read). Offsets are clamped
    into ``[0, M]`` and scale rows into the scale tensors on the device (bad inputs:
    wrong results, never out-of-bounds accesses). An e8m0 scale of 255 (NaN) makes
    the outputs its block touches NaN.

    Usage: ``got, go_scales, block_offs = quantize_mx_cols_grouped(grad_out, offs)``,
    ``xt, x_scales, _ = quantize_mx_cols_grouped(x, offs)`` (the same block map for
    the same ``offs``), then ``grad_W = grouped_mm_wgrad_mx(got, go_scales, xt, x_scales, offs, block_offs)``.

    Args:
        a_t: ``(N, M)`` float8_e4m3fn, contiguous (tokens contiguous), e.g. ``grad_out^T``.
        a_scales: ``(R, N)`` uint8 e8m0 exponents (or float8_e8m0fnu), contiguous, R >= 1.
        b_t: ``(K, M)`` float8_e4m3fn, contiguous, e.g. ``x^T``.
        b_scales: ``(R, K)`` e8m0, the same rows as ``a_scales``.
        offs: ``(G,)`` int32 cumulative group ends.
        block_offs: ``(G,)`` int32 cumulative ends of each group's scale rows.
        out: optional ``(G, N, K)`` float32 contiguous accumulator: the result is
            added to it in place (``out += ...``; an empty group leaves it unchanged)
            and it is returned.
        out_dtype: dtype of a new output (bfloat16, float16, float32) when ``out`` is None.

    Returns:
        ``(G, N, K)``: ``out`` when given, else a new tensor of ``out_dtype``.
    """
    n, m, k = check_wgrad_operands(a_t, b_t)
    if a_t.dtype != torch.float8_e4m3fn:
        raise TypeError(f"a_t and b_t must be float8_e4m3fn (the MXFP8 element type), got {a_t.dtype}")
    check_offsets(offs, a_t.device)
    num_groups = offs.shape[0]
    check_tensor("a_scales", a_scales, ndim=2, dtypes=E8M0_SCALE_DTYPES)
    if a_scales.size(0) == 0:
        raise ValueError(f"a_scales must have at least one scale row, got shape {tuple(a_scales.shape)}")
    scale_rows = a_scales.size(0)
    a_scales = check_e8m0_scales("a_scales", a_scales, (scale_rows, n), a_t.device)
    b_scales = check_e8m0_scales("b_scales", b_scales, (scale_rows, k), a_t.device)
    check_offsets(block_offs, a_t.device, name="block_offs")
    if block_offs.shape[0] != num_groups:
        raise ValueError(
            f"block_offs must have one entry per group ({num_groups}), got shape {tuple(block_offs.shape)}"
        )
    out, accumulate = wgrad_output(out, out_dtype, (num_groups, n, k), a_t.device)
    require_interpreter_on_cpu(a_t)
    cpu = on_cpu(a_t)
    key = {"M": max(m, 1), "N": n, "K": k, "G": num_groups}
    config = select_config("grouped_mm_wgrad_mx", key, CPU_CONFIG if cpu else DEFAULT_CONFIG)
    whole_cells = m // MX_BLOCK_SIZE
    a_cells = a_t.as_strided((n, whole_cells, MX_BLOCK_SIZE), (m, MX_BLOCK_SIZE, 1))
    b_cells = b_t.as_strided((k, whole_cells, MX_BLOCK_SIZE), (m, MX_BLOCK_SIZE, 1))
    args = (
        a_t,
        a_cells,
        a_scales,
        b_t,
        b_cells,
        b_scales,
        offs,
        block_offs,
        out,
        accumulate,
        group_lanes(num_groups),
        cpu,
    )
    launch(grouped_mm_wgrad_mx_kernel, args, config)
    return out


# Tuning: flat and persistent grids (the flat one runs 1.45-1.67x faster on the H200).
def _tuning_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
    from kernels_helion.quantize_mx_grouped import quantize_mx_cols_grouped

    offs = routed_offsets(shape["M"], shape["G"], device)
    a_t, a_scales, block_offs = quantize_mx_cols_grouped(random_bf16(shape["M"], shape["N"], device=device), offs)
    b_t, b_scales, _ = quantize_mx_cols_grouped(random_bf16(shape["M"], shape["K"], device=device), offs)
    return lambda: grouped_mm_wgrad_mx(a_t, a_scales, b_t, b_scales, offs, block_offs)


register_tuning(
    "grouped_mm_wgrad_mx",
    DEFAULT_CONFIG,
    gemm_space(DEFAULT_CONFIG, [[64, 128], [128, 128], [128, 64], [256, 128]], nvidia_warps=(4, 8),
               pid_types=("flat", "persistent_interleaved")),
    GEMM_SHAPES,
    _tuning_call,
    GEMM_TEST_SHAPE,
    exact=False,
)
