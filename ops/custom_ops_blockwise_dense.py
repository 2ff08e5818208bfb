"""The dense blockwise linear's own kernels (2-D operands, 128x1 scales, the three GEMM roles) as custom ops.

As ``ops.custom_ops``: opaque to ``torch.compile``, with fake implementations
giving each output's shape, dtype and strides; the launchers validate inputs.
The 1x128 activation and 128x128 weight quantizers are the MoE recipe's
(``ops.custom_ops_blockwise``), which take 2-D operands too.
"""

from __future__ import annotations

import torch
from torch import Tensor

import kernels_helion as kernels
from kernels_helion.fp8_format import BLOCKWISE_SCALE_BLOCK
from ops.custom_ops_blockwise import fake_act_block_scales
from ops.op_helpers import DEFAULT_FLOAT8_DTYPE, cdiv, empty_on
from ops.op_registry import fp8moe_op


def _fake_cols(x: Tensor, float8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """fp8 ``(K, M)`` and 128x1 scales ``(ceil(M/128), K)``."""
    m, k = x.shape
    return empty_on(x, (k, m), float8_dtype), empty_on(x, (cdiv(m, BLOCKWISE_SCALE_BLOCK), k), torch.float32)


# --- activations and gradients -------------------------------------------------------


@fp8moe_op("quantize_blockwise_cols")
def quantize_blockwise_cols(
    x: Tensor, float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE, round_scales_to_power_of_2: bool = False
) -> tuple[Tensor, Tensor]:
    """``(M, K)`` -> fp8 ``(K, M)`` (tokens contiguous) and 128x1 scales ``(ceil(M/128), K)``."""
    return kernels.quantize_blockwise_cols(x, float8_dtype, round_scales_to_power_of_2, BLOCKWISE_SCALE_BLOCK)


@quantize_blockwise_cols.register_fake
def _(x: Tensor, float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE, round_scales_to_power_of_2: bool = False):
    return _fake_cols(x, float8_dtype)


@fp8moe_op("quantize_blockwise_rows_and_cols")
def quantize_blockwise_rows_and_cols(
    x: Tensor, float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE, round_scales_to_power_of_2: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``quantize_blockwise_rows`` and ``quantize_blockwise_cols`` from one read of ``x``."""
    return kernels.quantize_blockwise_rows_and_cols(x, float8_dtype, round_scales_to_power_of_2, BLOCKWISE_SCALE_BLOCK)


@quantize_blockwise_rows_and_cols.register_fake
def _(x: Tensor, float8_dtype: torch.dtype = DEFAULT_FLOAT8_DTYPE, round_scales_to_power_of_2: bool = False):
    return empty_on(x, tuple(x.shape), float8_dtype), fake_act_block_scales(x), *_fake_cols(x, float8_dtype)


# --- GEMMs -----------------------------------------------------------------------------


@fp8moe_op("gemm_blockwise_forward")
def gemm_blockwise_forward(
    x: Tensor, x_scales: Tensor, w: Tensor, w_scales: Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """``x (M, K) @ w (N, K).T`` -> ``(M, N)``; see ``kernels_helion.gemm_blockwise_forward``."""
    return kernels.gemm_blockwise_forward(x, x_scales, w, w_scales, out_dtype)


@gemm_blockwise_forward.register_fake
def _(x, x_scales, w, w_scales, out_dtype=torch.bfloat16):
    return empty_on(x, (x.shape[0], w.shape[0]), out_dtype)


@fp8moe_op("gemm_blockwise_dgrad")
def gemm_blockwise_dgrad(
    grad_out: Tensor, grad_out_scales: Tensor, w_t: Tensor, w_t_scales: Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """``grad_out (M, N) @ w`` with ``w_t (K, N)`` -> ``(M, K)``; see ``kernels_helion.gemm_blockwise_dgrad``."""
    return kernels.gemm_blockwise_dgrad(grad_out, grad_out_scales, w_t, w_t_scales, out_dtype)


@gemm_blockwise_dgrad.register_fake
def _(grad_out, grad_out_scales, w_t, w_t_scales, out_dtype=torch.bfloat16):
    return empty_on(grad_out, (grad_out.shape[0], w_t.shape[0]), out_dtype)


@fp8moe_op("gemm_blockwise_wgrad")
def gemm_blockwise_wgrad(
    grad_out_t: Tensor,
    grad_out_t_scales: Tensor,
    x_t: Tensor,
    x_t_scales: Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """``grad_out_t (N, M) @ x_t (K, M).T`` -> ``(N, K)``; see ``kernels_helion.gemm_blockwise_wgrad``."""
    return kernels.gemm_blockwise_wgrad(grad_out_t, grad_out_t_scales, x_t, x_t_scales, out_dtype=out_dtype)


@gemm_blockwise_wgrad.register_fake
def _(grad_out_t, grad_out_t_scales, x_t, x_t_scales, out_dtype=torch.bfloat16):
    return empty_on(grad_out_t, (grad_out_t.shape[0], x_t.shape[0]), out_dtype)
