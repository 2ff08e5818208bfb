"""The blockwise FP8 recipe's grouped linear (DeepSeek-V3): its kernels, in ``ops.grouped_linear_autograd``'s data flow.

Scales: activations and gradients one per 1x128 block along the contraction,
weights one per 128x128 block, and the wgrad operands (contraction over tokens)
one per 128x1 block of a column, the blocks starting at each group's first token.

Forward: ``x`` -> 1x128 (and, for wgrad, its per-group 128x1 transposed copy from
the same read), ``w`` -> 128x128 (and its transposed copy for dgrad from the same
read), then ``grouped_mm_2d3d_blockwise``.

Saved for backward (never a bf16 copy; ``x`` and ``w`` only by reference when chosen):
  - ``recipe.save_fp8_weight``: ``W^T`` in FP8 ``(E, K, N)`` + 128x128 scales;
    otherwise ``w`` (a parameter: no extra memory) is quantized transposed in backward.
  - ``recipe.save_fp8_input``: ``x^T`` in FP8, ``(K, R * 128)`` in block space with
    ``R = ceil(M/128) + G`` (each 128-token block zero-padded to a whole aligned
    slot), + per-group 128x1 scales (about half the bytes of bf16 ``x``);
    otherwise ``x``, quantized in backward.
Both choices give bitwise the same results.

Backward: ``grad_out`` -> 1x128 for dgrad and per-group 128x1 for wgrad from one
read; ``dx = grouped_mm_2d3d_blockwise(grad_out, W^T)``, ``dW =
grouped_mm_wgrad_blockwise(grad_out^T, x^T)``, the wgrad GEMM walking
``grad_out``'s block map (``x^T``'s is the same: same offsets).
"""

from __future__ import annotations

import torch
from torch import Tensor

import ops.custom_ops_blockwise  # noqa: F401  (defines the fp8moe ops used below)
from ops.grouped_linear_autograd import (
    QuantizedActivation,
    QuantizedWeight,
    QuantOptions,
    RecipeKernels,
    grouped_linear_function,
    register_grouped_linear,
)
from ops.op_registry import kernel_ops
from ops.recipes import Fp8Recipe

_ops = kernel_ops


class BlockwiseKernels(RecipeKernels):
    """The blockwise recipe's kernels; ``quant`` is ``(float8_dtype, round_scales_to_power_of_2)``."""

    def quant_options(self, recipe: Fp8Recipe) -> QuantOptions:
        return (recipe.float8_dtype, recipe.round_scales_to_power_of_2)

    def quantize_activation(
        self, t: Tensor, offs: Tensor, quant: QuantOptions, rowwise: bool, wgrad: bool
    ) -> QuantizedActivation:
        if rowwise and wgrad:
            return QuantizedActivation(*_ops.quantize_blockwise_rows_and_cols_grouped(t, offs, *quant))
        if rowwise:
            return QuantizedActivation(*_ops.quantize_blockwise_rows(t, *quant), None, None, None)
        return QuantizedActivation(None, None, *_ops.quantize_blockwise_cols_grouped(t, offs, *quant))

    def quantize_weight(self, w: Tensor, quant: QuantOptions, forward: bool, transposed: bool) -> QuantizedWeight:
        if forward and transposed:
            return QuantizedWeight(*_ops.quantize_blockwise_weights_both_layouts(w, *quant))
        if forward:
            return QuantizedWeight(*_ops.quantize_blockwise_weights(w, *quant), None, None)
        return QuantizedWeight(None, None, *_ops.quantize_blockwise_weights_transposed(w, *quant))

    def grouped_mm(
        self, a: Tensor, a_scales: Tensor, b: Tensor, b_scales: Tensor, offs: Tensor, out_dtype: torch.dtype
    ) -> Tensor:
        return _ops.grouped_mm_2d3d_blockwise(a, a_scales, b, b_scales, offs, out_dtype)

    def grouped_mm_wgrad(
        self, grad_out: QuantizedActivation, x: QuantizedActivation, offs: Tensor, out_dtype: torch.dtype
    ) -> Tensor:
        operands = (grad_out.data_t, grad_out.scales_t, x.data_t, x.scales_t)
        return _ops.grouped_mm_wgrad_blockwise(*operands, offs, grad_out.wgrad_layout, out_dtype)


BlockwiseFp8GroupedLinear = grouped_linear_function("BlockwiseFp8GroupedLinear", BlockwiseKernels())
register_grouped_linear("blockwise", BlockwiseFp8GroupedLinear)
