"""The dense blockwise linear's kernels (2-D operands, 1x128 / 128x1 / 128x128 scales) as custom ops.

As ``ops.custom_ops``: opaque to ``torch.compile``, with fake implementations
giving each output's shape, dtype and strides; the launchers validate inputs.
They live in their own namespace, ``fp8dense`` (the ``fp8moe`` ops are the MoE
recipes' grouped kernels). The scaling block is 128. One layout is not a plain
contiguous tensor, and the fakes describe it exactly: 1x128 scales ``(M,
ceil(K/128))`` are K-block-major, a transposed view of a contiguous
``(ceil(K/128), round_up(M, 4))`` buffer.
"""

from __future__ import annotations

import torch
from torch import Tensor

import kernels_helion as kernels
from kernels_helion.gemm_blockwise import SCALE_BLOCK as BLOCK
from kernels_helion.quantize_blockwise import _SCALE_ROW_ALIGN

NAMESPACE = "fp8dense"

_E4M3 = torch.float8_e4m3fn


def _empty(like: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    return torch.empty(shape, dtype=dtype, device=like.device)


def _cdiv(a, b: int):
    # Also for SymInts (fake tensors under dynamic shapes).
    return (a + b - 1) // b


def _fake_act(x: Tensor, float8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """fp8 ``(M, K)`` and 1x128 scales ``(M, ceil(K/128))``, K-block-major."""
    m, k = x.shape
    padded_rows = _cdiv(m, _SCALE_ROW_ALIGN) * _SCALE_ROW_ALIGN
    scales = _empty(x, (_cdiv(k, BLOCK), padded_rows), torch.float32)[:, :m].t()
    return _empty(x, (m, k), float8_dtype), scales


def _fake_act_colwise(x: Tensor, float8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """fp8 ``(K, M)`` and 128x1 scales ``(ceil(M/128), K)``."""
    m, k = x.shape
    return _empty(x, (k, m), float8_dtype), _empty(x, (_cdiv(m, BLOCK), k), torch.float32)


def _fake_weight(w: Tensor, float8_dtype: torch.dtype, transposed: bool) -> tuple[Tensor, Tensor]:
    rows, cols = tuple(w.shape)[::-1] if transposed else tuple(w.shape)
    return _empty(w, (rows, cols), float8_dtype), _empty(w, (_cdiv(rows, BLOCK), _cdiv(cols, BLOCK)), torch.float32)


# --- activations and gradients -------------------------------------------------------


@torch.library.custom_op(f"{NAMESPACE}::quantize_blockwise_act", mutates_args=())
def quantize_blockwise_act(
    x: Tensor, float8_dtype: torch.dtype = _E4M3, round_scales_to_power_of_2: bool = False
) -> tuple[Tensor, Tensor]:
    """``(M, K)`` -> fp8 ``(M, K)`` and 1x128 scales ``(M, ceil(K/128))`` (K-block-major)."""
    return kernels.quantize_blockwise_act(x, float8_dtype, round_scales_to_power_of_2, BLOCK)


@quantize_blockwise_act.register_fake
def _(x: Tensor, float8_dtype: torch.dtype = _E4M3, round_scales_to_power_of_2: bool = False):
    return _fake_act(x, float8_dtype)


@torch.library.custom_op(f"{NAMESPACE}::quantize_blockwise_act_colwise", mutates_args=())
def quantize_blockwise_act_colwise(
    x: Tensor, float8_dtype: torch.dtype = _E4M3, round_scales_to_power_of_2: bool = False
) -> tuple[Tensor, Tensor]:
    """``(M, K)`` -> fp8 ``(K, M)`` (tokens contiguous) and 128x1 scales ``(ceil(M/128), K)``."""
    return kernels.quantize_blockwise_act_colwise(x, float8_dtype, round_scales_to_power_of_2, BLOCK)


@quantize_blockwise_act_colwise.register_fake
def _(x: Tensor, float8_dtype: torch.dtype = _E4M3, round_scales_to_power_of_2: bool = False):
    return _fake_act_colwise(x, float8_dtype)


@torch.library.custom_op(f"{NAMESPACE}::quantize_blockwise_act_dual", mutates_args=())
def quantize_blockwise_act_dual(
    x: Tensor, float8_dtype: torch.dtype = _E4M3, round_scales_to_power_of_2: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``quantize_blockwise_act`` and ``quantize_blockwise_act_colwise`` from one read of ``x``."""
    return kernels.quantize_blockwise_act_dual(x, float8_dtype, round_scales_to_power_of_2, BLOCK)


@quantize_blockwise_act_dual.register_fake
def _(x: Tensor, float8_dtype: torch.dtype = _E4M3, round_scales_to_power_of_2: bool = False):
    return (*_fake_act(x, float8_dtype), *_fake_act_colwise(x, float8_dtype))


# --- weights ---------------------------------------------------------------------------


@torch.library.custom_op(f"{NAMESPACE}::quantize_blockwise_weight", mutates_args=())
def quantize_blockwise_weight(
    w: Tensor, float8_dtype: torch.dtype = _E4M3, round_scales_to_power_of_2: bool = False
) -> tuple[Tensor, Tensor]:
    """``(N, K)`` -> fp8 ``(N, K)`` and 128x128 scales ``(ceil(N/128), ceil(K/128))``."""
    return kernels.quantize_blockwise_weight(w, float8_dtype, round_scales_to_power_of_2, BLOCK)


@quantize_blockwise_weight.register_fake
def _(w: Tensor, float8_dtype: torch.dtype = _E4M3, round_scales_to_power_of_2: bool = False):
    return _fake_weight(w, float8_dtype, transposed=False)


@torch.library.custom_op(f"{NAMESPACE}::quantize_blockwise_weight_dual", mutates_args=())
def quantize_blockwise_weight_dual(
    w: Tensor, float8_dtype: torch.dtype = _E4M3, round_scales_to_power_of_2: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(N, K)`` -> fp8 ``(N, K)``, scales, and fp8 ``w.T`` ``(K, N)`` contiguous, transposed scales."""
    return kernels.quantize_blockwise_weight_dual(w, float8_dtype, round_scales_to_power_of_2, BLOCK)


@quantize_blockwise_weight_dual.register_fake
def _(w: Tensor, float8_dtype: torch.dtype = _E4M3, round_scales_to_power_of_2: bool = False):
    return (*_fake_weight(w, float8_dtype, transposed=False), *_fake_weight(w, float8_dtype, transposed=True))


# --- GEMMs -----------------------------------------------------------------------------


@torch.library.custom_op(f"{NAMESPACE}::gemm_blockwise_forward", mutates_args=())
def gemm_blockwise_forward(
    x: Tensor, x_scales: Tensor, w: Tensor, w_scales: Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """``x (M, K) @ w (N, K).T`` -> ``(M, N)``; see ``kernels_helion.gemm_blockwise_forward``."""
    return kernels.gemm_blockwise_forward(x, x_scales, w, w_scales, out_dtype)


@gemm_blockwise_forward.register_fake
def _(x, x_scales, w, w_scales, out_dtype=torch.bfloat16):
    return _empty(x, (x.shape[0], w.shape[0]), out_dtype)


@torch.library.custom_op(f"{NAMESPACE}::gemm_blockwise_dgrad", mutates_args=())
def gemm_blockwise_dgrad(
    grad_out: Tensor, grad_out_scales: Tensor, w_t: Tensor, w_t_scales: Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """``grad_out (M, N) @ w`` with ``w_t (K, N)`` -> ``(M, K)``; see ``kernels_helion.gemm_blockwise_dgrad``."""
    return kernels.gemm_blockwise_dgrad(grad_out, grad_out_scales, w_t, w_t_scales, out_dtype)


@gemm_blockwise_dgrad.register_fake
def _(grad_out, grad_out_scales, w_t, w_t_scales, out_dtype=torch.bfloat16):
    return _empty(grad_out, (grad_out.shape[0], w_t.shape[0]), out_dtype)


@torch.library.custom_op(f"{NAMESPACE}::gemm_blockwise_wgrad", mutates_args=())
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
    return _empty(grad_out_t, (grad_out_t.shape[0], x_t.shape[0]), out_dtype)
