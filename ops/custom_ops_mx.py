"""The MXFP8 recipe's kernel launchers as ``fp8moe`` custom ops.

As ``ops.custom_ops``: one ``kernel_op`` declaration per launcher, opaque to
``torch.compile``; the launchers validate inputs.
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
from ops.op_helpers import cdiv, empty_on, grouped_mm_outputs, round_up, wgrad_outputs
from ops.op_registry import kernel_op

_E4M3 = torch.float8_e4m3fn  # the MXFP8 element format (fixed: the ops take no float8_dtype)
_U8 = torch.uint8  # e8m0 scales, stored as their biased exponents
_I32 = torch.int32  # group start rows or columns


def _rows(x: Tensor, **_: object) -> tuple[Tensor, Tensor]:
    """e4m3fn ``(M, K)`` and e8m0 ``(M, K/32)``."""
    m, k = x.shape
    return empty_on(x, (m, k), _E4M3), empty_on(x, (m, k // MX_BLOCK_SIZE), _U8)


def _cols_grouped(x: Tensor, offs: Tensor, **_: object) -> tuple[Tensor, Tensor, Tensor]:
    """e4m3fn ``(C, M)``, per-group 32x1 e8m0 ``(ceil(M/32) + G, C)``, block map ``(G,)``."""
    m, c = x.shape
    groups = offs.shape[0]
    return empty_on(x, (c, m), _E4M3), empty_on(x, (cdiv(m, MX_BLOCK_SIZE) + groups, c), _U8), empty_on(x, (groups,), _I32)


def _expert_weights(w: Tensor, transposed: bool, **_: object) -> tuple[Tensor, Tensor]:
    """``(E, N, K)`` -> e4m3fn ``(E, N, K)`` + e8m0 ``(E, N, K/32)``; transposed: ``(E, K, N)`` + ``(E, K, N/32)``."""
    e, n, k = w.shape
    rows, cols = (k, n) if transposed else (n, k)
    return empty_on(w, (e, rows, cols), _E4M3), empty_on(w, (e, rows, cols // MX_BLOCK_SIZE), _U8)


def _blocked_row_groups(scales: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
    """Blocked scales, each row group from a multiple of 128 rows, and the groups' start rows."""
    rows, cols = scales.shape
    groups = offs.shape[0]
    shape = (round_up(rows, TILE_ROWS) + groups * TILE_ROWS, round_up(cols, TILE_COLS))
    return empty_on(scales, shape, scales.dtype), empty_on(scales, (groups,), _I32)


def _blocked_col_groups(scales: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
    """Blocked scales, each column group from a multiple of 4 columns, and the groups' start columns."""
    rows, cols = scales.shape
    groups = offs.shape[0]
    shape = (round_up(rows, TILE_ROWS), round_up(cols, TILE_COLS) + groups * TILE_COLS)
    return empty_on(scales, shape, scales.dtype), empty_on(scales, (groups,), _I32)


def _blocked_per_expert(scales: Tensor) -> Tensor:
    """Blocked ``(E, ceil(rows/128) * 128, ceil(cols/4) * 4)``."""
    e, rows, cols = scales.shape
    return empty_on(scales, (e, round_up(rows, TILE_ROWS), round_up(cols, TILE_COLS)), scales.dtype)


def _grouped_mm_wgrad_mx(
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


# --- quantization ------------------------------------------------------------------

quantize_mx_rows = kernel_op(kernels.quantize_mx_rows, _rows)
quantize_mx_cols_grouped = kernel_op(kernels.quantize_mx_cols_grouped, _cols_grouped)
quantize_mx_rows_and_cols_grouped = kernel_op(
    kernels.quantize_mx_rows_and_cols_grouped, lambda **a: (*_rows(**a), *_cols_grouped(**a))
)
quantize_mx_expert_weights = kernel_op(kernels.quantize_mx_expert_weights, _expert_weights)

# --- blocked scale layouts (Blackwell's native MXFP8 grouped GEMM) ----------------------

to_blocked_scales_grouped = kernel_op(kernels.to_blocked_scales_grouped, _blocked_row_groups)
to_blocked_scales_per_expert = kernel_op(kernels.to_blocked_scales_per_expert, _blocked_per_expert)
to_blocked_scales_k_groups = kernel_op(kernels.to_blocked_scales_k_groups, _blocked_col_groups)

# --- grouped GEMMs (emulated with FP8 dots per 32-wide block) ----------------------------

grouped_mm_2d3d_mx = kernel_op(kernels.grouped_mm_2d3d_mx, grouped_mm_outputs)
grouped_mm_wgrad_mx = kernel_op(_grouped_mm_wgrad_mx, wgrad_outputs, name="grouped_mm_wgrad_mx")
