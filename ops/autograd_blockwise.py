"""Autograd of the FP8 grouped linear, blockwise recipe (DeepSeek-V3): ``out = x @ w[g]^T`` per token group ``g``.

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
grouped_mm_wgrad_blockwise(grad_out^T, x^T)``. ``offs`` gets no gradient.
Nothing syncs with the host. Several weights on the same ``x`` (``blockwise_grouped_linears``)
share one quantization of ``x`` and one saved ``x^T``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

import ops.custom_ops_blockwise  # noqa: F401  (defines the fp8moe ops used below)
from ops.op_registry import kernel_ops
from ops.recipes import Fp8Recipe, register_recipe, register_shared_input

_ops = kernel_ops


class BlockwiseFp8GroupedLinear(torch.autograd.Function):
    """``(x (M, K), offs (E,), ..., w_1, ..., w_n (E, N_i, K)) -> (x @ w_i[g]^T for each i)``, blockwise FP8.

    Several weights share one quantization of ``x`` and one saved ``x^T`` (SwiGLU's
    ``w1`` and ``w3``); ``dx`` is the sum of their dgrads. One weight: the plain grouped linear.
    """

    @staticmethod
    def forward(
        ctx,
        x: Tensor,
        offs: Tensor,
        float8_dtype: torch.dtype,
        round_scales_to_power_of_2: bool,
        out_dtype: torch.dtype,
        save_fp8_input: bool,
        save_fp8_weight: bool,
        *weights: Tensor,
    ) -> tuple[Tensor, ...]:
        needs_dx = ctx.needs_input_grad[0]
        needs_dw = any(ctx.needs_input_grad[_FIRST_WEIGHT:])
        quant = (float8_dtype, round_scales_to_power_of_2)
        # Saved: x, xt_fp8, xt_scales (wgrad), offs, then per weight w, wt_fp8, wt_scales (dgrad); None if unused.
        saved_x = xt_fp8 = xt_scales = None
        if needs_dw and save_fp8_input:
            # The block map (last output) is recomputed with grad_out's in backward.
            x_fp8, x_scales, xt_fp8, xt_scales, _ = _ops.quantize_blockwise_act_dual_grouped(x, offs, *quant)
        else:
            x_fp8, x_scales = _ops.quantize_blockwise_act(x, *quant)
            saved_x = x if needs_dw else None
        outs, saved_weights = [], []
        for w in weights:
            saved_w = wt_fp8 = wt_scales = None
            if needs_dx and save_fp8_weight:
                w_fp8, w_scales, wt_fp8, wt_scales = _ops.quantize_blockwise_weight_dual(w, *quant)
            else:
                w_fp8, w_scales = _ops.quantize_blockwise_weight(w, *quant)
                saved_w = w if needs_dx else None
            outs.append(_ops.grouped_mm_2d3d_blockwise(x_fp8, x_scales, w_fp8, w_scales, offs, out_dtype))
            saved_weights += [saved_w, wt_fp8, wt_scales]
        ctx.save_for_backward(saved_x, xt_fp8, xt_scales, offs, *saved_weights)
        ctx.quant = quant
        ctx.x_dtype, ctx.w_dtypes = x.dtype, [w.dtype for w in weights]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outs: Tensor):
        needs_dx = ctx.needs_input_grad[0]
        x, xt_fp8, xt_scales, offs, *saved_weights = ctx.saved_tensors
        dx, dws = None, []
        for i, grad_out in enumerate(grad_outs):
            w, wt_fp8, wt_scales = saved_weights[3 * i : 3 * i + 3]
            needs_dw = ctx.needs_input_grad[_FIRST_WEIGHT + i]
            # Autograd may hand over an expanded (stride-0) gradient; kernels need rows.
            grad_out = grad_out.contiguous()
            dw = None
            if needs_dx and needs_dw:
                go_fp8, go_scales, got_fp8, got_scales, block_starts = _ops.quantize_blockwise_act_dual_grouped(
                    grad_out, offs, *ctx.quant
                )
            elif needs_dx:
                go_fp8, go_scales = _ops.quantize_blockwise_act(grad_out, *ctx.quant)
            elif needs_dw:
                got_fp8, got_scales, block_starts = _ops.quantize_blockwise_act_colwise_grouped(
                    grad_out, offs, *ctx.quant
                )
            if needs_dx:
                if wt_fp8 is None:
                    wt_fp8, wt_scales = _ops.quantize_blockwise_weight_transposed(w, *ctx.quant)
                dx_i = _ops.grouped_mm_2d3d_blockwise(go_fp8, go_scales, wt_fp8, wt_scales, offs, ctx.x_dtype)
                dx = dx_i if dx is None else dx + dx_i
            if needs_dw:
                if xt_fp8 is None:
                    # Same offs, same block map as grad_out's; quantized once for every weight's wgrad.
                    xt_fp8, xt_scales, _ = _ops.quantize_blockwise_act_colwise_grouped(x, offs, *ctx.quant)
                dw = _ops.grouped_mm_wgrad_blockwise(
                    got_fp8, got_scales, xt_fp8, xt_scales, offs, block_starts, ctx.w_dtypes[i]
                )
            dws.append(dw)
        return (dx, *([None] * (_FIRST_WEIGHT - 1)), *dws)


# Index of the first weight among BlockwiseFp8GroupedLinear.forward's inputs (after x, offs and 5 options).
_FIRST_WEIGHT = 7


@register_recipe("blockwise")
def blockwise_grouped_linear(
    x: Tensor, w: Tensor, offs: Tensor, recipe: Fp8Recipe, out_dtype: torch.dtype
) -> Tensor:
    """The blockwise recipe's grouped linear (inputs already validated by ``ops.functional``)."""
    return blockwise_grouped_linears(x, (w,), offs, recipe, out_dtype)[0]


@register_shared_input("blockwise")
def blockwise_grouped_linears(
    x: Tensor, weights: Sequence[Tensor], offs: Tensor, recipe: Fp8Recipe, out_dtype: torch.dtype
) -> tuple[Tensor, ...]:
    """``x @ w[g]^T`` for each of ``weights``, quantizing ``x`` once (inputs validated by ``ops.functional``)."""
    quant = (recipe.float8_dtype, recipe.round_scales_to_power_of_2)
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
        return BlockwiseFp8GroupedLinear.apply(
            x, offs, *quant, out_dtype, recipe.save_fp8_input, recipe.save_fp8_weight, *weights
        )
    # Inference: no transposed copies, nothing saved.
    x_fp8, x_scales = _ops.quantize_blockwise_act(x, *quant)
    outs = []
    for w in weights:
        w_fp8, w_scales = _ops.quantize_blockwise_weight(w, *quant)
        outs.append(_ops.grouped_mm_2d3d_blockwise(x_fp8, x_scales, w_fp8, w_scales, offs, out_dtype))
    return tuple(outs)
