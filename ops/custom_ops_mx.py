"""The MXFP8 recipe's kernel launchers as ``fp8moe`` custom ops.

As ``ops.custom_ops``: opaque to ``torch.compile``, with fake implementations
that give each output's shape, dtype and strides; the launchers validate inputs.
e8m0 scales are uint8 biased exponents. Shapes that depend on group sizes are
upper bounds known from the shapes alone (no sync): per-group 32x1 scales have
``ceil(M/32) + G`` rows, blocked layouts ``ceil(rows/128) * 128 + G * 128``
rows (groups along rows) or ``ceil(cols/4) * 4 + G * 4`` columns (along columns).
"""

from __future__ import annotations

import torch
from torch import Tensor

import kernels_helion as kernels
from kernels_helion.mx_blocked_layout import TILE_COLS, TILE_ROWS
from kernels_helion.mx_format import MX_BLOCK_SIZE
from ops.op_helpers import cdiv, empty_on, round_up
from ops.op_registry import fp8moe_op

_E4M3 = torch.float8_e4m3fn  # the MXFP8 element format (fixed: the ops take no float8_dtype)
_U8 = torch.uint8  # e8m0 scales, stored as their biased exponents


# --- quantization ------------------------------------------------------------------


@fp8moe_op("quantize_mx_rows")
def quantize_mx_rows(x: Tensor, rounding: str = "rceil") -> tuple[Tensor, Tensor]:
    """``(M, K)`` -> e4m3fn ``(M, K)`` and e8m0 ``(M, K/32)`` (1x32 blocks); see ``kernels_helion.quantize_mx``."""
    return kernels.quantize_mx_rows(x, rounding)


@quantize_mx_rows.register_fake
def _(x: Tensor, rounding: str = "rceil"):
    m, k = x.shape
    return empty_on(x, (m, k), _E4M3), empty_on(x, (m, k // MX_BLOCK_SIZE), _U8)


def _fake_cols_grouped(x: Tensor, offs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    m, c = x.shape
    groups = offs.shape[0]
    return (
        empty_on(x, (c, m), _E4M3),
        empty_on(x, (cdiv(m, MX_BLOCK_SIZE) + groups, c), _U8),
        empty_on(x, (groups,), torch.int32),
    )


@fp8moe_op("quantize_mx_cols_grouped")
def quantize_mx_cols_grouped(x: Tensor, offs: Tensor, rounding: str = "rceil") -> tuple[Tensor, Tensor, Tensor]:
    """``(M, C)`` -> e4m3fn ``(C, M)``, per-group 32x1 e8m0 ``(ceil(M/32) + G, C)``, block map ``(G,)``."""
    return kernels.quantize_mx_cols_grouped(x, offs, rounding)


@quantize_mx_cols_grouped.register_fake
def _(x: Tensor, offs: Tensor, rounding: str = "rceil"):
    return _fake_cols_grouped(x, offs)


@fp8moe_op("quantize_mx_rows_and_cols_grouped")
def quantize_mx_rows_and_cols_grouped(
    x: Tensor, offs: Tensor, rounding: str = "rceil"
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``quantize_mx_rows`` and ``quantize_mx_cols_grouped`` of ``x`` from one read."""
    return kernels.quantize_mx_rows_and_cols_grouped(x, offs, rounding)


@quantize_mx_rows_and_cols_grouped.register_fake
def _(x: Tensor, offs: Tensor, rounding: str = "rceil"):
    m, c = x.shape
    return (empty_on(x, (m, c), _E4M3), empty_on(x, (m, c // MX_BLOCK_SIZE), _U8), *_fake_cols_grouped(x, offs))


@fp8moe_op("quantize_mx_expert_weights")
def quantize_mx_expert_weights(w: Tensor, rounding: str = "rceil", transposed: bool = False) -> tuple[Tensor, Tensor]:
    """``(E, N, K)`` -> e4m3fn ``(E, N, K)`` + e8m0 ``(E, N, K/32)``; transposed: ``(E, K, N)`` + ``(E, K, N/32)``."""
    return kernels.quantize_mx_expert_weights(w, rounding, transposed)


@quantize_mx_expert_weights.register_fake
def _(w: Tensor, rounding: str = "rceil", transposed: bool = False):
    e, n, k = w.shape
    rows, cols = (k, n) if transposed else (n, k)
    return empty_on(w, (e, rows, cols), _E4M3), empty_on(w, (e, rows, cols // MX_BLOCK_SIZE), _U8)


# --- blocked scale layouts (Blackwell's native MXFP8 grouped GEMM) ----------------------


@fp8moe_op("mx_blocked_scales_grouped")
def mx_blocked_scales_grouped(scales: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
    """Token-group scales ``(rows, cols)`` -> blocked, each group from a multiple of 128 rows, and its start rows."""
    return kernels.to_blocked_scales_grouped(scales, offs)


@mx_blocked_scales_grouped.register_fake
def _(scales: Tensor, offs: Tensor):
    rows, cols = scales.shape
    groups = offs.shape[0]
    shape = (round_up(rows, TILE_ROWS) + groups * TILE_ROWS, round_up(cols, TILE_COLS))
    return empty_on(scales, shape, scales.dtype), empty_on(scales, (groups,), torch.int32)


@fp8moe_op("mx_blocked_scales_per_expert")
def mx_blocked_scales_per_expert(scales: Tensor) -> Tensor:
    """Expert scales ``(E, rows, cols)`` -> blocked ``(E, ceil(rows/128) * 128, ceil(cols/4) * 4)``."""
    return kernels.to_blocked_scales_per_expert(scales)


@mx_blocked_scales_per_expert.register_fake
def _(scales: Tensor):
    e, rows, cols = scales.shape
    return empty_on(scales, (e, round_up(rows, TILE_ROWS), round_up(cols, TILE_COLS)), scales.dtype)


@fp8moe_op("mx_blocked_scales_k_groups")
def mx_blocked_scales_k_groups(scales: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
    """Scales ``(rows, cols)`` grouped along the columns -> blocked per group, and each group's start column."""
    return kernels.to_blocked_scales_k_groups(scales, offs)


@mx_blocked_scales_k_groups.register_fake
def _(scales: Tensor, offs: Tensor):
    rows, cols = scales.shape
    groups = offs.shape[0]
    shape = (round_up(rows, TILE_ROWS), round_up(cols, TILE_COLS) + groups * TILE_COLS)
    return empty_on(scales, shape, scales.dtype), empty_on(scales, (groups,), torch.int32)


# --- grouped GEMMs (emulated with FP8 dots per 32-wide block) ----------------------------


@fp8moe_op("grouped_mm_2d3d_mx")
def grouped_mm_2d3d_mx(
    a: Tensor,
    a_scales: Tensor,
    b: Tensor,
    b_scales: Tensor,
    offs: Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """MXFP8 ``(M, K) x (E, N, K) -> (M, N)``, each token group times its expert."""
    return kernels.grouped_mm_2d3d_mx(a, a_scales, b, b_scales, offs, out_dtype=out_dtype)


@grouped_mm_2d3d_mx.register_fake
def _(a, a_scales, b, b_scales, offs, out_dtype=torch.bfloat16):
    return empty_on(a, (a.shape[0], b.shape[1]), out_dtype)


@fp8moe_op("grouped_mm_wgrad_mx")
def grouped_mm_wgrad_mx(
    a_t: Tensor,
    a_scales: Tensor,
    b_t: Tensor,
    b_scales: Tensor,
    offs: Tensor,
    block_offs: Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """MXFP8 ``out[g] = a_t[:, tokens of g] @ b_t[:, tokens of g]^T`` with per-group 32x1 scales: ``-> (G, N, K)``."""
    return kernels.grouped_mm_wgrad_mx(a_t, a_scales, b_t, b_scales, offs, block_offs, out_dtype=out_dtype)


@grouped_mm_wgrad_mx.register_fake
def _(a_t, a_scales, b_t, b_scales, offs, block_offs, out_dtype=torch.bfloat16):
    return empty_on(a_t, (offs.shape[0], a_t.shape[0], b_t.shape[0]), out_dtype)
