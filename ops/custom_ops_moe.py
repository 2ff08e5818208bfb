"""The MoE layer's kernels as ``fp8moe`` custom ops, one ``kernel_op`` declaration each: the router's
top-k (``kernels_helion.router_topk``), the combine (``kernels_helion.moe_combine``), the fused
up-projection (``kernels_helion.grouped_gemm_swiglu``), the down-projection's dgrad with SwiGLU's backward in its epilogue
(``kernels_helion.grouped_gemm_swiglu_backward``) and SwiGLU's backward, alone, weighted by the
routing weights (with their gradient) or with the rowwise FP8 quantization of its result
(``kernels_helion.swiglu``).

``ops.moe.router_topk``, ``ops.moe.combine_pairs`` and ``ops.moe_fused`` supply the autograd formulas
around them.
"""

from __future__ import annotations

import torch

import kernels_helion as kernels
from ops.op_helpers import F32, empty_on
from ops.op_registry import kernel_op

router_topk = kernel_op(
    kernels.router_topk,
    lambda logits, top_k: (empty_on(logits, (logits.shape[0], top_k), F32),
                           empty_on(logits, (logits.shape[0], top_k), torch.int64)),
)
router_topk_backward = kernel_op(
    kernels.router_topk_backward, lambda logits, **_: empty_on(logits, logits.shape, logits.dtype)
)
moe_combine = kernel_op(kernels.moe_combine, lambda y, probs, **_: empty_on(y, (probs.shape[0], y.shape[1]), y.dtype))
moe_combine_grad_rows = kernel_op(
    kernels.moe_combine_grad_rows, lambda grad, order, **_: empty_on(grad, (order.shape[0], grad.shape[1]), grad.dtype)
)
moe_combine_grad_probs = kernel_op(
    kernels.moe_combine_grad_probs, lambda y, inverse, **_: empty_on(y, inverse.shape, torch.float32)
)
grouped_mm_swiglu = kernel_op(
    kernels.grouped_mm_swiglu,
    lambda a, rows, b_gate, out_dtype, **_: (
        empty_on(a, (rows.shape[0], b_gate.shape[1]), out_dtype),
        empty_on(a, (rows.shape[0], 2 * b_gate.shape[1]), out_dtype),
    ),
)
grouped_mm_swiglu_backward = kernel_op(
    kernels.grouped_mm_swiglu_backward,
    lambda a, gate_up, **_: (empty_on(a, gate_up.shape, gate_up.dtype), empty_on(a, gate_up.shape[:1], F32)),
)
swiglu_backward = kernel_op(
    kernels.swiglu_backward, lambda grad_h, gate_up: empty_on(grad_h, gate_up.shape, grad_h.dtype)
)
swiglu_backward_weighted = kernel_op(
    kernels.swiglu_backward_weighted,
    lambda grad_h, gate_up, pair_weights: (
        empty_on(grad_h, gate_up.shape, grad_h.dtype), empty_on(grad_h, grad_h.shape[:1], F32)
    ),
)
swiglu_backward_quantized = kernel_op(
    kernels.swiglu_backward_quantized,
    lambda grad_h, gate_up, float8_dtype, **_: (
        empty_on(grad_h, gate_up.shape, grad_h.dtype),
        empty_on(grad_h, gate_up.shape, float8_dtype),
        empty_on(grad_h, grad_h.shape[:1], F32),
    ),
)
