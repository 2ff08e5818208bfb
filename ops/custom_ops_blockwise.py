"""The blockwise recipe's kernel launchers (DeepSeek-V3: 1x128 / 128x1 / 128x128 scales) as ``fp8moe`` custom ops.

As ``ops.custom_ops``: opaque to ``torch.compile``, with fake implementations
that give each output's shape, dtype and strides, and called without the
dispatcher in eager mode (``ops.op_registry.kernel_ops``); the launchers
validate inputs.
The scaling block is 128 (what the blockwise GEMMs take). Two layouts are not
plain contiguous tensors, and the fakes describe them exactly:

- 1x128 scales ``(M, ceil(K/128))`` are K-block-major, a transposed view of a
  contiguous ``(ceil(K/128), round_up(M, 4))`` buffer (``quantize_blockwise_rows``);
- per-group 128x1 scales have ``R = ceil(M/128) + G`` rows, an upper bound on the
  number of token blocks known from the shapes alone (no sync), and the
  transposed fp8 tensor they scale is ``(K, R * 128)`` in block space (block
  ``r`` owns columns ``[128 r, 128 r + 128)``, zero-padded).
"""

from __future__ import annotations

import torch
from torch import Tensor

import kernels_helion as kernels
from kernels_helion.fp8_format import BLOCKWISE_SCALE_BLOCK as BLOCK
from kernels_helion.quantize_blockwise import SCALE_ROW_ALIGN
from ops.op_helpers import DEFAULT_FLOAT8_DTYPE, cdiv, empty_on, round_up
from ops.op_registry import fp8moe_op


def fake_act_block_scales(x: Tensor) -> Tensor:
    """Fake 1x128 scales of ``x (M, K)``: ``(M, ceil(K/128))`` fp32, K-block-major as ``quantize_blockwise_rows``
    lays them out (a transposed view of a ``(ceil(K/128), round_up(M, SCALE_ROW_ALIGN))`` buffer)."""
    m, k = x.shape
    return empty_on(x, (cdiv(k, BLOCK), round_up(m, SCALE_ROW_ALIGN)), torch.float32)[:, :m].t()


def _fake_cols_grouped(x: Tensor, offs: Tensor, float8_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """fp8 ``(K, R * 128)`` (block space), per-group 128x1 scales ``(R, K)``, block map ``(G,)``."""
    m, k = x.shape
    block_rows = cdiv(m, BLOCK) + offs.shape[0]
    return (
        empty_on(x, (k, block_rows * BLOCK), float8_dtype),
        empty_on(x, (block_rows, k), torch.float32),
        empty_on(x, (offs.shape[0],), torch.int32),
    )


# --- activations and gradients -------------------------------------------------------


@fp8moe_op("quantize_blockwise_rows")
def quantize_blockwise_rows(
    x: Tensor, float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE, round_scales_to_power_of_2: bool = False
) -> tuple[Tensor, Tensor]:
    """``(M, K)`` -> fp8 ``(M, K)`` and 1x128 scales ``(M, ceil(K/128))`` (K-block-major)."""
    return kernels.quantize_blockwise_rows(x, float8_dtype, round_scales_to_power_of_2, BLOCK)


@quantize_blockwise_rows.register_fake
def _(x: Tensor, float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE, round_scales_to_power_of_2: bool = False):
    return empty_on(x, tuple(x.shape), float8_dtype), fake_act_block_scales(x)


@fp8moe_op("quantize_blockwise_cols_grouped")
def quantize_blockwise_cols_grouped(
    x: Tensor,
    offs: Tensor,
    float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE,
    round_scales_to_power_of_2: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(M, K)`` -> fp8 ``(K, R * 128)`` in block space, per-group 128x1 scales ``(R, K)``, block map ``(G,)``.

    ``R = ceil(M/128) + G`` (see ``quantize_blockwise_cols_grouped`` in ``kernels_helion``).
    """
    xt, scales, starts = kernels.quantize_blockwise_cols_grouped(
        x, offs, float8_dtype, round_scales_to_power_of_2, BLOCK
    )
    # The launcher's block map is a view into a larger buffer: return a tensor of its own.
    return xt, scales, starts.clone()


@quantize_blockwise_cols_grouped.register_fake
def _(
    x: Tensor, offs: Tensor, float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE, round_scales_to_power_of_2: bool = False
):
    return _fake_cols_grouped(x, offs, float8_dtype)


@fp8moe_op("quantize_blockwise_rows_and_cols_grouped")
def quantize_blockwise_rows_and_cols_grouped(
    x: Tensor,
    offs: Tensor,
    float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE,
    round_scales_to_power_of_2: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``quantize_blockwise_rows`` and ``quantize_blockwise_cols_grouped`` from one read of ``x``."""
    q, scales, qt, scales_t, starts = kernels.quantize_blockwise_rows_and_cols_grouped(
        x, offs, float8_dtype, round_scales_to_power_of_2, BLOCK
    )
    return q, scales, qt, scales_t, starts.clone()


@quantize_blockwise_rows_and_cols_grouped.register_fake
def _(
    x: Tensor, offs: Tensor, float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE, round_scales_to_power_of_2: bool = False
):
    return (
        empty_on(x, tuple(x.shape), float8_dtype),
        fake_act_block_scales(x),
        *_fake_cols_grouped(x, offs, float8_dtype),
    )


# --- expert weights --------------------------------------------------------------------


def _fake_weight_blocks(w: Tensor, float8_dtype: torch.dtype, transposed: bool) -> tuple[Tensor, Tensor]:
    """``([E,] rows, cols)`` fp8 and 128x128 scales, for ``(N, K)`` or ``(E, N, K)`` weights."""
    *experts, n, k = w.shape
    rows, cols = (k, n) if transposed else (n, k)
    return (
        empty_on(w, (*experts, rows, cols), float8_dtype),
        empty_on(w, (*experts, cdiv(rows, BLOCK), cdiv(cols, BLOCK)), torch.float32),
    )


@fp8moe_op("quantize_blockwise_weights")
def quantize_blockwise_weights(
    w: Tensor, float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE, round_scales_to_power_of_2: bool = False
) -> tuple[Tensor, Tensor]:
    """``([E,] N, K)`` -> fp8 of the same shape and 128x128 scales ``([E,] ceil(N/128), ceil(K/128))``."""
    return kernels.quantize_blockwise_weights(w, float8_dtype, round_scales_to_power_of_2, BLOCK)


@quantize_blockwise_weights.register_fake
def _(w: Tensor, float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE, round_scales_to_power_of_2: bool = False):
    return _fake_weight_blocks(w, float8_dtype, transposed=False)


@fp8moe_op("quantize_blockwise_weights_transposed")
def quantize_blockwise_weights_transposed(
    w: Tensor, float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE, round_scales_to_power_of_2: bool = False
) -> tuple[Tensor, Tensor]:
    """``(E, N, K)`` -> fp8 ``(E, K, N)`` (contiguous) and scales ``(E, ceil(K/128), ceil(N/128))``."""
    return kernels.quantize_blockwise_weights_transposed(w, float8_dtype, round_scales_to_power_of_2, BLOCK)


@quantize_blockwise_weights_transposed.register_fake
def _(w: Tensor, float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE, round_scales_to_power_of_2: bool = False):
    return _fake_weight_blocks(w, float8_dtype, transposed=True)


@fp8moe_op("quantize_blockwise_weights_both_layouts")
def quantize_blockwise_weights_both_layouts(
    w: Tensor, float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE, round_scales_to_power_of_2: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Both layouts of ``quantize_blockwise_weights`` and ``..._transposed`` from one read of ``w``."""
    return kernels.quantize_blockwise_weights_both_layouts(w, float8_dtype, round_scales_to_power_of_2, BLOCK)


@quantize_blockwise_weights_both_layouts.register_fake
def _(w: Tensor, float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE, round_scales_to_power_of_2: bool = False):
    return (
        *_fake_weight_blocks(w, float8_dtype, transposed=False),
        *_fake_weight_blocks(w, float8_dtype, transposed=True),
    )


# --- grouped GEMMs ---------------------------------------------------------------------


@fp8moe_op("grouped_mm_2d3d_blockwise")
def grouped_mm_2d3d_blockwise(
    a: Tensor,
    a_scales: Tensor,
    b: Tensor,
    b_scales: Tensor,
    offs: Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """``(M, K) x (E, N, K) -> (M, N)`` with 1x128 scales on ``a`` and 128x128 scales on ``b``."""
    return kernels.grouped_mm_2d3d_blockwise(a, a_scales, b, b_scales, offs, out_dtype=out_dtype)


@grouped_mm_2d3d_blockwise.register_fake
def _(a, a_scales, b, b_scales, offs, out_dtype=torch.bfloat16):
    return empty_on(a, (a.shape[0], b.shape[1]), out_dtype)


@fp8moe_op("grouped_mm_wgrad_blockwise")
def grouped_mm_wgrad_blockwise(
    a_t: Tensor,
    a_scales: Tensor,
    b_t: Tensor,
    b_scales: Tensor,
    offs: Tensor,
    group_block_starts: Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """``out[g] = a_t[:, blocks of g] @ b_t[:, blocks of g]^T`` with per-group 128x1 scales: ``-> (G, N, K)``.

    ``a_t (N, R * 128)`` and ``b_t (K, R * 128)`` are in block space (``quantize_blockwise_cols_grouped``).
    """
    return kernels.grouped_mm_wgrad_blockwise(
        a_t, a_scales, b_t, b_scales, offs, group_block_starts, out_dtype=out_dtype
    )


@grouped_mm_wgrad_blockwise.register_fake
def _(a_t, a_scales, b_t, b_scales, offs, group_block_starts, out_dtype=torch.bfloat16):
    return empty_on(a_t, (offs.shape[0], a_t.shape[0], b_t.shape[0]), out_dtype)
