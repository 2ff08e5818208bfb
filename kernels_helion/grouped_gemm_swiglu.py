"""The MoE up-projection as one FP8 grouped GEMM: token rows gathered by index, gate and up together, SwiGLU in the epilogue.

For the pairs of a routed batch sorted by expert (row ``i`` of group ``g`` is the
pair of token ``rows[i]``)::

    gate[i] = (a[rows[i]] @ b_gate[g]^T) * a_scales[rows[i]] * b_gate_scales[g]
    up[i]   = (a[rows[i]] @ b_up[g]^T)   * a_scales[rows[i]] * b_up_scales[g]
    h[i]    = silu(gate[i]) * up[i]

``a`` holds each token's row once, quantized rowwise (a rowwise scale belongs to
the token, so its ``k`` pairs share it bitwise): the gather happens in the GEMM's
``a`` loads, so no permuted copy of the tokens is written, in bf16 or FP8. Both
weights are read against the same ``a`` tile, into two accumulators, so ``a`` is
loaded once for the two products. The epilogue rounds ``gate`` and ``up`` to the
output dtype (the values kept for backward), computes ``h`` from those rounded
values in float32 and rounds it once.

Scheduling is ``grouped_mm_2d3d``'s: work items of row tiles cut from each group's
start (``work_item_rows``), any group sizes, no host sync; rows past
``offs[-1]`` are written as 0. Row indices outside ``[0, T)`` are clamped into it
(never an out-of-bounds load; callers pass ``ops.sort_by_expert``'s tokens).
"""

from __future__ import annotations

from collections.abc import Callable

import helion
import helion.language as hl
import torch

from autotune_cache import select_config
from autotune_cache.registry import register_tuning
from kernels_helion._launch import launch, on_cpu, split_leading_block, with_tma
from kernels_helion.group_offsets import group_lanes
from kernels_helion.grouped_gemm import check_2d3d_operands, tile_dot, work_item_rows
from kernels_helion.swiglu import swiglu_value
from kernels_helion.validation import check_matrices_row_major, check_same_device, check_scales, check_tensor
from kernels_helion.tuning import GEMM_TEST_SHAPE, SWIGLU_SHAPES, fp8_operands, gemm_space, routed_offsets

# block_sizes = [BLOCK_M, BLOCK_N (hidden columns of each of gate and up), BLOCK_K]: two
# 128x128 accumulators hold what grouped_mm_2d3d's one 128x256 tile does.
DEFAULT_CONFIG = helion.Config(
    block_sizes=[128, 128, 128],
    num_warps=8,
    num_stages=3,
    l2_groupings=[8],
    pid_type="persistent_interleaved",
)
CPU_CONFIG = helion.Config(block_sizes=[16, 32, 64], num_warps=4, num_stages=1)

ROW_INDEX_DTYPES = (torch.int32, torch.int64)


def store_rows(h, gate_up, tile_m, tile_n, h_tile, gate, up, in_item) -> None:  # noqa: ANN001
    """Device side: a tile's ``h``, ``gate`` and ``up`` rows, those of this work item only."""
    hl.store(h, [tile_m, tile_n], h_tile, extra_mask=in_item)
    hl.store(gate_up, [tile_m, 0, tile_n], gate, extra_mask=in_item)
    hl.store(gate_up, [tile_m, 1, tile_n], up, extra_mask=in_item)


@helion.kernel(static_shapes=False)
def grouped_mm_swiglu_kernel(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    rows: torch.Tensor,
    b_gate: torch.Tensor,
    b_gate_scales: torch.Tensor,
    b_up: torch.Tensor,
    b_up_scales: torch.Tensor,
    offs: torch.Tensor,
    h: torch.Tensor,
    gate_up: torch.Tensor,
    groups_pow2: hl.constexpr,
    block_m: hl.constexpr,
    upcast_operands: hl.constexpr,
) -> None:
    """``h (M, H)``, ``gate_up (M, 2, H)`` (gate, then up, per row) written for the ``M = len(rows)`` pairs."""
    tokens, k = a.shape
    _, n, _ = b_gate.shape
    m = rows.size(0)
    num_groups = offs.size(0)
    row_items = (m + (num_groups + 1) * (block_m - 1)) // block_m
    for item, tile_n in hl.tile([row_items, n], block_size=[1, None]):
        group, row_begin, row_end = work_item_rows(offs, item.begin, m, block_m, groups_pow2)
        for tile_m in hl.tile(row_begin, row_end, block_size=block_m):
            in_item = (tile_m.index < row_end)[:, None]
            if group < num_groups:
                for g in hl.grid(group, group + 1):
                    source = torch.clamp(rows[tile_m], 0, tokens - 1)
                    row_scales = hl.load(a_scales, [source])
                    gate_scales = b_gate_scales[g, tile_n]
                    up_scales = b_up_scales[g, tile_n]
                    acc_gate = hl.zeros([tile_m, tile_n], dtype=torch.float32)
                    acc_up = hl.zeros([tile_m, tile_n], dtype=torch.float32)
                    for tile_k in hl.tile(k):
                        a_tile = hl.load(a, [source, tile_k])
                        acc_gate = tile_dot(acc_gate, a_tile, b_gate[g, tile_n, tile_k], upcast_operands)
                        acc_up = tile_dot(acc_up, a_tile, b_up[g, tile_n, tile_k], upcast_operands)
                    gate = (acc_gate * (row_scales[:, None] * gate_scales[None, :])).to(h.dtype)
                    up = (acc_up * (row_scales[:, None] * up_scales[None, :])).to(h.dtype)
                    gate_f = gate.to(torch.float32)
                    out = swiglu_value(gate_f, torch.sigmoid(gate_f), up.to(torch.float32)).to(h.dtype)
                    store_rows(h, gate_up, tile_m, tile_n, out, gate, up, in_item)
            if group == num_groups:
                zeros = hl.zeros([tile_m, tile_n], dtype=h.dtype)
                store_rows(h, gate_up, tile_m, tile_n, zeros, zeros, zeros, in_item)


def grouped_mm_swiglu(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    rows: torch.Tensor,
    b_gate: torch.Tensor,
    b_gate_scales: torch.Tensor,
    b_up: torch.Tensor,
    b_up_scales: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU experts' up-projection for routed pairs, reading each token's FP8 row by index.

    Args:
        a: ``(T, K)`` float8_e4m3fn, contiguous: each token's row once, quantized rowwise.
        a_scales: ``(T,)`` float32: their row scales.
        rows: ``(M,)`` int32/int64: the token of each pair, pairs sorted by expert.
        b_gate, b_up: ``(E, H, K)`` float8 (``a``'s dtype): the experts' ``w1`` and ``w3``, each
            expert's matrix row-major; contiguous, or the halves ``b[:, :H]``, ``b[:, H:]`` of one
            packed ``(E, 2H, K)`` weight (transformers' ``gate_up_proj``).
        b_gate_scales, b_up_scales: ``(E, H)`` float32 row scales of the weights.
        offs: ``(E,)`` int32 cumulative group ends over the ``M`` pairs.
        out_dtype: bfloat16 (default), float16 or float32.

    Returns:
        ``(h, gate_up)``: ``h (M, H) = silu(gate) * up`` and ``gate_up (M, 2 * H)``, each row
        its ``gate`` then its ``up`` (rounded to ``out_dtype``; ``h`` is computed from the
        rounded values). Rows past ``offs[-1]`` are 0.
    """
    _, k, num_experts, n = check_2d3d_operands(a, b_gate, offs, out_dtype, "b_gate", b_contiguous=False)
    tokens = a.shape[0]
    check_tensor("b_up", b_up, ndim=3, dtypes=(b_gate.dtype,), contiguous=False)
    check_matrices_row_major("b_up", b_up)
    if b_up.shape != b_gate.shape:
        raise ValueError(f"b_up must have b_gate's shape {tuple(b_gate.shape)}, got {tuple(b_up.shape)}")
    check_same_device("b_up", b_up, a.device)
    check_scales("a_scales", a_scales, (tokens,), a.device)
    check_scales("b_gate_scales", b_gate_scales, (num_experts, n), a.device)
    check_scales("b_up_scales", b_up_scales, (num_experts, n), a.device)
    check_tensor("rows", rows, ndim=1, dtypes=ROW_INDEX_DTYPES)
    check_same_device("rows", rows, a.device)
    m = rows.shape[0]
    h = torch.empty((m, n), dtype=out_dtype, device=a.device)
    gate_up = torch.empty((m, 2, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return h, gate_up.view(m, 2 * n)
    if tokens == 0:
        raise ValueError(f"rows index {m} pairs but a holds no token rows")
    cpu = on_cpu(a)
    key = {"M": m, "N": n, "K": k, "G": num_experts}
    block_m, kernel_config = split_leading_block(
        select_config("grouped_mm_swiglu", key, CPU_CONFIG if cpu else DEFAULT_CONFIG)
    )
    args = (
        a, a_scales, rows, b_gate, b_gate_scales, b_up, b_up_scales, offs, h, gate_up,
        group_lanes(num_experts), block_m, cpu,
    )
    if not cpu:
        # The weight tiles through TMA; the gathered token rows and the scales through pointers.
        kernel_config = with_tma(grouped_mm_swiglu_kernel, args, kernel_config, loads=("b_gate", "b_up"))
    launch(grouped_mm_swiglu_kernel, args, kernel_config)
    return h, gate_up.view(m, 2 * n)


# Tuning: the MoE layer benchmark's fused up-projections.
def _tuning_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
    tokens = max(shape["M"] // 8, 1)
    a, a_scales = fp8_operands(tokens, shape["K"], device=device)
    b_gate, gate_scales = fp8_operands(shape["G"], shape["N"], shape["K"], device=device)
    b_up, up_scales = fp8_operands(shape["G"], shape["N"], shape["K"], device=device)
    rows = torch.randint(0, tokens, (shape["M"],), dtype=torch.int32, device=device)
    offs = routed_offsets(shape["M"], shape["G"], device)
    return lambda: grouped_mm_swiglu(a, a_scales, rows, b_gate, gate_scales, b_up, up_scales, offs)


register_tuning(
    "grouped_mm_swiglu",
    DEFAULT_CONFIG,
    gemm_space(
        DEFAULT_CONFIG, [[128, 128, 128], [128, 64, 128], [64, 128, 128], [128, 128, 64], [64, 256, 64], [64, 256, 128]],
        nvidia_warps=(4, 8),
    ),
    [{"M": m, "N": n, "K": k, "G": g} for m, n, k, g in SWIGLU_SHAPES],
    _tuning_call,
    GEMM_TEST_SHAPE,
    exact=False,
)
