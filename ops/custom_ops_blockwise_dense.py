"""The dense blockwise linear's own kernels (2-D operands, 128x1 scales, the three GEMM roles) as custom ops.

As ``ops.custom_ops``: one ``kernel_op`` declaration per launcher, opaque to
``torch.compile``; the launchers validate inputs. The 1x128 activation and
128x128 weight quantizers are the MoE recipe's (``ops.custom_ops_blockwise``),
which take 2-D operands too.
"""

from __future__ import annotations

import torch
from torch import Tensor

import kernels_helion as kernels
from ops.custom_ops_blockwise import fake_rows
from ops.op_helpers import F32, cdiv, empty_on
from ops.op_registry import kernel_op


def _fake_cols(x: Tensor, float8_dtype: torch.dtype, block: int, **_: object) -> tuple[Tensor, Tensor]:
    """fp8 ``(K, M)`` and 128x1 scales ``(ceil(M/128), K)``."""
    m, k = x.shape
    return empty_on(x, (k, m), float8_dtype), empty_on(x, (cdiv(m, block), k), F32)


def _gemm_blockwise_wgrad(
    grad_out_t: Tensor,
    grad_out_t_scales: Tensor,
    x_t: Tensor,
    x_t_scales: Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """``grad_out_t (N, M) @ x_t (K, M).T`` -> ``(N, K)``; see ``kernels_helion.gemm_blockwise_wgrad``."""
    return kernels.gemm_blockwise_wgrad(grad_out_t, grad_out_t_scales, x_t, x_t_scales, out_dtype=out_dtype)


# --- activations and gradients -------------------------------------------------------

quantize_blockwise_cols = kernel_op(kernels.quantize_blockwise_cols, _fake_cols)
quantize_blockwise_rows_and_cols = kernel_op(
    kernels.quantize_blockwise_rows_and_cols, lambda **a: (*fake_rows(**a), *_fake_cols(**a))
)

# --- GEMMs -----------------------------------------------------------------------------

gemm_blockwise_forward = kernel_op(
    kernels.gemm_blockwise_forward, lambda x, w, out_dtype, **_: empty_on(x, (x.shape[0], w.shape[0]), out_dtype)
)
gemm_blockwise_dgrad = kernel_op(
    kernels.gemm_blockwise_dgrad,
    lambda grad_out, w_t, out_dtype, **_: empty_on(grad_out, (grad_out.shape[0], w_t.shape[0]), out_dtype),
)
gemm_blockwise_wgrad = kernel_op(
    _gemm_blockwise_wgrad,
    lambda grad_out_t, x_t, out_dtype, **_: empty_on(grad_out_t, (grad_out_t.shape[0], x_t.shape[0]), out_dtype),
    name="gemm_blockwise_wgrad",
)
