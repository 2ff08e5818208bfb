"""The MoE layer's kernels as ``fp8moe`` custom ops, with their fakes: the combine
(``kernels_helion.moe_combine``), the fused up-projection (``kernels_helion.grouped_gemm_swiglu``)
and SwiGLU's backward (``kernels_helion.swiglu``).

``ops.moe.combine_pairs`` and ``ops.moe_fused`` supply the autograd formulas around them.
"""

from __future__ import annotations

import torch
from torch import Tensor

import kernels_helion as kernels
from ops.op_helpers import empty_on
from ops.op_registry import fp8moe_op


@fp8moe_op("moe_combine")
def moe_combine(y: Tensor, inverse: Tensor, probs: Tensor) -> Tensor:
    """``sum_j probs[t, j] * y[inverse[t, j]]`` in float32: ``(T, D)`` of ``y``'s dtype; see ``kernels_helion.moe_combine``."""
    return kernels.moe_combine(y, inverse, probs)


@moe_combine.register_fake
def _(y, inverse, probs):
    return empty_on(y, (probs.shape[0], y.shape[1]), y.dtype)


@fp8moe_op("moe_combine_grad_rows")
def moe_combine_grad_rows(grad: Tensor, order: Tensor, probs: Tensor, y: Tensor) -> Tensor:
    """``moe_combine``'s gradient for ``y``: ``(T * k, D)``; see ``kernels_helion.moe_combine_grad_rows``."""
    return kernels.moe_combine_grad_rows(grad, order, probs, y)


@moe_combine_grad_rows.register_fake
def _(grad, order, probs, y):
    return empty_on(y, y.shape, y.dtype)


@fp8moe_op("moe_combine_grad_probs")
def moe_combine_grad_probs(grad: Tensor, y: Tensor, inverse: Tensor) -> Tensor:
    """``moe_combine``'s gradient for ``probs``: ``(T, k)`` float32; see ``kernels_helion.moe_combine_grad_probs``."""
    return kernels.moe_combine_grad_probs(grad, y, inverse)


@moe_combine_grad_probs.register_fake
def _(grad, y, inverse):
    return empty_on(y, inverse.shape, torch.float32)


@fp8moe_op("grouped_mm_swiglu")
def grouped_mm_swiglu(
    a: Tensor,
    a_scales: Tensor,
    rows: Tensor,
    b_gate: Tensor,
    b_gate_scales: Tensor,
    b_up: Tensor,
    b_up_scales: Tensor,
    offs: Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> tuple[Tensor, Tensor]:
    """``(h (M, H), gate_up (M, 2H))`` of the pairs ``rows``; see ``kernels_helion.grouped_mm_swiglu``."""
    return kernels.grouped_mm_swiglu(a, a_scales, rows, b_gate, b_gate_scales, b_up, b_up_scales, offs, out_dtype)


@grouped_mm_swiglu.register_fake
def _(a, a_scales, rows, b_gate, b_gate_scales, b_up, b_up_scales, offs, out_dtype=torch.bfloat16):
    m, n = rows.shape[0], b_gate.shape[1]
    return empty_on(a, (m, n), out_dtype), empty_on(a, (m, 2 * n), out_dtype)


@fp8moe_op("swiglu_backward")
def swiglu_backward(grad_h: Tensor, gate_up: Tensor) -> Tensor:
    """``(M, 2H)``: the gradients of gate and up; see ``kernels_helion.swiglu_backward``."""
    return kernels.swiglu_backward(grad_h, gate_up)


@swiglu_backward.register_fake
def _(grad_h, gate_up):
    return empty_on(grad_h, gate_up.shape, grad_h.dtype)
