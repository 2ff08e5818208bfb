"""Autograd of the FP8 grouped linear, rowwise recipe: ``out = x @ w[g]^T`` per token group ``g``.

Forward: ``x`` is quantized per row (and, for wgrad, per (group, column) by the
same kernels: ``quantize_rowwise_and_jagged_colwise``, two reads of ``x``), ``w``
per (expert, output row) in both the forward layout and the transposed one dgrad
needs, and the FP8 grouped GEMM runs.

Saved for backward (never a bf16 copy; ``x`` and ``w`` only by reference when chosen):
  - ``recipe.save_fp8_weight`` (default): ``W^T`` in FP8 ``(E, K, N)`` + scales
    ``(E, K)``, made by the same kernel as the forward layout; otherwise ``w``
    itself (a parameter: no extra memory) is re-quantized transposed in backward.
  - ``recipe.save_fp8_input`` (default): ``x`` quantized per (group, column),
    tokens contiguous + scales ``(G, K)``, in the padded token layout (each group
    from a multiple of 128 columns: ``(K, (ceil(M/128) + G) * 128)``, which the wgrad
    GEMM reads with no masks): about half the bytes of bf16 ``x``, for the same
    memory traffic as quantizing it in backward; otherwise
    ``x`` itself (free when other ops keep it alive anyway).
``ops.saved_tensor_bytes`` measures this against the bf16 reference.

Backward: ``dx = grad_out_fp8 @ W^T`` (FP8 grouped GEMM with the saved ``W^T``),
``dW[g] = grad_out[g]^T @ x[g]`` (FP8 wgrad from per-(group, column) quantization
of ``grad_out`` and ``x``); ``grad_out``'s two forms come from one
``quantize_rowwise_and_jagged_colwise``. ``offs`` gets no gradient. Nothing syncs with the host.

Several weights applied to the same ``x`` (SwiGLU's ``w1`` and ``w3``:
``rowwise_grouped_linears``) share one quantization of ``x`` and one saved ``x^T``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

import ops.custom_ops  # noqa: F401  (defines the fp8moe ops used below)
from kernels_helion.token_groups import WGRAD_GROUP_ALIGNMENT
from ops.op_registry import kernel_ops
from ops.recipes import Fp8Recipe, register_recipe, register_shared_input

_ops = kernel_ops


class RowwiseFp8GroupedLinear(torch.autograd.Function):
    """``(x (M, K), offs (E,), ..., w_1, ..., w_n (E, N_i, K)) -> (x @ w_i[g]^T for each i)``, rowwise FP8.

    Several weights share one quantization of ``x`` in forward (SwiGLU's gate and
    up projections read the same tokens), and one saved FP8 ``x^T`` for their wgrads;
    ``dx`` is the sum of their dgrads. With one weight this is the plain grouped linear.
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
            # Both forms of x from two reads of it (forward GEMM; wgrad, padded token layout).
            x_fp8, x_scales, xt_fp8, xt_scales = _ops.quantize_rowwise_and_jagged_colwise(
                x, offs, *quant, WGRAD_GROUP_ALIGNMENT
            )
        else:
            x_fp8, x_scales = _ops.quantize_rowwise(x, *quant)
            saved_x = x if needs_dw else None
        outs, saved_weights = [], []
        for w in weights:
            saved_w = wt_fp8 = wt_scales = None
            if needs_dx and save_fp8_weight:
                w_fp8, w_scales, wt_fp8, wt_scales = _ops.quantize_expert_weights_dual(w, *quant)
            else:
                w_fp8, w_scales = _ops.quantize_expert_weights(w, *quant)
                saved_w = w if needs_dx else None
            outs.append(_ops.grouped_mm_2d3d(x_fp8, x_scales, w_fp8, w_scales, offs, out_dtype))
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
            go_fp8 = got_fp8 = dw = None
            if needs_dx and needs_dw and xt_fp8 is not None:
                # grad_out for dgrad (rowwise) and wgrad (per group and column) from two reads of it.
                go_fp8, go_scales, got_fp8, got_scales = _ops.quantize_rowwise_and_jagged_colwise(
                    grad_out, offs, *ctx.quant, WGRAD_GROUP_ALIGNMENT
                )
            if needs_dx:
                if go_fp8 is None:
                    go_fp8, go_scales = _ops.quantize_rowwise(grad_out, *ctx.quant)
                if wt_fp8 is None:
                    wt_fp8, wt_scales = _ops.quantize_expert_weights_transposed(w, *ctx.quant)
                dx_i = _ops.grouped_mm_2d3d(go_fp8, go_scales, wt_fp8, wt_scales, offs, ctx.x_dtype)
                dx = dx_i if dx is None else dx + dx_i
            if needs_dw:
                if xt_fp8 is None:
                    # x was kept as is: quantize it once for every weight's wgrad.
                    xt_fp8, xt_scales, got_fp8, got_scales = _ops.quantize_jagged_colwise_dual(
                        x, grad_out, offs, *ctx.quant, WGRAD_GROUP_ALIGNMENT
                    )
                elif got_fp8 is None:
                    got_fp8, got_scales = _ops.quantize_jagged_colwise(
                        grad_out, offs, *ctx.quant, WGRAD_GROUP_ALIGNMENT
                    )
                dw = _ops.grouped_mm_wgrad(
                    got_fp8, got_scales, xt_fp8, xt_scales, offs, ctx.w_dtypes[i], WGRAD_GROUP_ALIGNMENT
                )
            dws.append(dw)
        return (dx, *([None] * (_FIRST_WEIGHT - 1)), *dws)


# Index of the first weight among RowwiseFp8GroupedLinear.forward's inputs (after x, offs and 5 options).
_FIRST_WEIGHT = 7


@register_recipe("rowwise")
def rowwise_grouped_linear(
    x: Tensor, w: Tensor, offs: Tensor, recipe: Fp8Recipe, out_dtype: torch.dtype
) -> Tensor:
    """The rowwise recipe's grouped linear (inputs already validated by ``ops.functional``)."""
    return rowwise_grouped_linears(x, (w,), offs, recipe, out_dtype)[0]


@register_shared_input("rowwise")
def rowwise_grouped_linears(
    x: Tensor, weights: Sequence[Tensor], offs: Tensor, recipe: Fp8Recipe, out_dtype: torch.dtype
) -> tuple[Tensor, ...]:
    """``x @ w[g]^T`` for each of ``weights``, quantizing ``x`` once (inputs validated by ``ops.functional``)."""
    quant = (recipe.float8_dtype, recipe.round_scales_to_power_of_2)
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
        return RowwiseFp8GroupedLinear.apply(
            x, offs, *quant, out_dtype, recipe.save_fp8_input, recipe.save_fp8_weight, *weights
        )
    # Inference: no transposed weights, nothing saved.
    x_fp8, x_scales = _ops.quantize_rowwise(x, *quant)
    outs = []
    for w in weights:
        w_fp8, w_scales = _ops.quantize_expert_weights(w, *quant)
        outs.append(_ops.grouped_mm_2d3d(x_fp8, x_scales, w_fp8, w_scales, offs, out_dtype))
    return tuple(outs)
