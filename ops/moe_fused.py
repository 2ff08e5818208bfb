"""The SwiGLU experts as fused FP8 kernels with their autograd: the up-projection; the down-projection and the combine.

``swiglu_up_projection(x, (w1, w3), offs, recipe, rows=..., inverse=...)`` returns
``h = silu(x[rows] @ w1[g]^T) * (x[rows] @ w3[g]^T)`` for the pairs of a routed
batch sorted by expert (``rows[i]``: the token of sorted pair ``i``), the rowwise
recipe with both folds (``RowwiseOptions``). The weights may also come packed as one
``w13 (E, 2H, D)`` (transformers' ``gate_up_proj``): quantized as one weight (a row's
scale is the same either way), its halves read in place by the GEMM, its dgrad one
contraction over ``2H`` and its wgrad one GEMM. Forward, backward and what is kept:

- ``x``'s ``T`` token rows are quantized once (``quantize_rowwise_rows``: a rowwise
  scale belongs to the token, so its ``k`` pairs get bitwise the operand that
  quantizing ``k`` gathered copies gives). The up-projection GEMM reads them by
  index, ``w1`` and ``w3`` against one ``a`` tile, SwiGLU in its epilogue
  (``grouped_mm_swiglu``): no permuted copy of ``x``, no separate activation pass.
- Saved for backward: ``x``'s FP8 rows and scales (``T`` rows, not ``T * k``), the
  pairs' ``gate_up`` (what SwiGLU's backward needs), the weights' dgrad forms.
- Backward: SwiGLU's gradient in one pass (``swiglu_backward``) into ``[grad_gate |
  grad_up]``, quantized once for both GEMM forms with the folds' multipliers (the
  forward weight scales of ``w1`` and ``w3`` side by side for dgrad, each pair's
  token scale for wgrad; without an FP8 wgrad, dgrad's folded rows alone, made by
  SwiGLU's backward kernel itself: ``swiglu_backward_quantized``); dgrad as one
  contraction over both halves (``grouped_mm_2d3d_split``); the pairs' ``dx`` summed
  back to tokens by a gather-sum in a fixed order (``moe_combine`` with unit weights;
  no atomics); the wgrads from ``x``'s FP8 rows gathered into the padded token layout
  (``transpose_to_token_groups(..., rows=rows)``), or, with a bf16 wgrad
  (``Fp8Recipe.wgrad_precision``), from ``x`` itself (saved instead of its FP8 rows)
  gathered to the pairs once, by ``torch._grouped_mm`` on ``grad_gate_up``'s halves.
- With ``with_gate_up`` (what ``ops.MoE``'s experts ask for), ``gate_up`` is an output too and
  ``down_projection_combine(..., gate_up=)`` returns its gradient, SwiGLU's backward done there
  with the routing weights' gradient: the backward above then starts from ``grad_gate_up``
  (no ``swiglu_backward``).

``down_projection_combine(h, w2, offs, recipe, routing, probs)`` is the experts' other end:
``w2``'s FP8 grouped linear and the MoE combine as one autograd op (``ops.MoE`` runs it
when its experts ``takes_combine``). Its backward quantizes the combine's gradient rows
``grad[token] * prob`` for the folded dgrad and the FP8 wgrad by reading each pair's token
row by index inside the two-pass quantizer: the ``(T * k, dim)`` bf16 rows are not written
out and read back.

``rows``/``inverse`` ``None``: ``x`` holds the pairs themselves (expert parallelism's
received rows). ``x_fp8``: ``x``'s rows already quantized rowwise (the FP8 dispatch).
Nothing syncs with the host; results are run-to-run bitwise reproducible.
"""

from __future__ import annotations

import torch
from torch import Tensor

import ops.custom_ops_moe  # noqa: F401  (defines the fp8moe ops used below)
from kernels_helion.moe_combine import PROBS_DTYPES
from kernels_helion.token_groups import WGRAD_GROUP_ALIGNMENT
from ops.autograd import RowwiseFp8GroupedLinear
from ops.functional import DIM_ALIGNMENT, _check_grouped_linear_inputs, _check_quantized_rows
from ops.deferred_wgrad import (
    UpProjectionWgradInputs,
    check_deferred_weight,
    defer_wgrad,
    defers,
    up_projection_wgrad_forms,
)
from ops.grad_accumulation import accumulate_wgrad, check_accumulation_weight
from ops.grouped_linear_autograd import CombineRouting, QuantOptions, quantize_weight_forms
from ops.op_registry import kernel_ops
from ops.recipes import Fp8Recipe, shared_input_implementation
from ops.row_gather import sum_pair_rows
from ops.wgrad_precision import grouped_mm_wgrad_bf16, resolve_wgrad_precision

_KERNELS = RowwiseFp8GroupedLinear.kernels

# Index of the first weight among the Function's inputs.
_FIRST_WEIGHT = 12


class _SwiGLUUpProjection(torch.autograd.Function):
    """``apply(x, x_data, x_scales, rows, inverse, offs, quant, save_fp8_weight, keep_quantized_weights,
    wgrad_accumulation, bf16_wgrad, deferred_wgrad, *weights) -> h``; ``weights``: ``(w1, w3)``, or ``(w13,)`` packed
    (``w13 = [w1; w3]`` along its rows: one quantization, one dgrad GEMM and one wgrad GEMM over both)."""

    @staticmethod
    def forward(
        ctx,
        x: Tensor,
        x_data: Tensor | None,
        x_scales: Tensor | None,
        rows: Tensor,
        inverse: Tensor | None,
        offs: Tensor,
        quant: QuantOptions,
        save_fp8_weight: bool,
        keep_quantized_weights: bool,
        wgrad_accumulation: str,
        bf16_wgrad: bool,
        deferred_wgrad: bool,
        *weights: Tensor,
    ) -> tuple[Tensor, Tensor]:
        needs_dx = ctx.needs_input_grad[0]
        needs_dw = any(ctx.needs_input_grad[_FIRST_WEIGHT:])
        # Backward gets h's gradient, gate_up's (the fused down-projection's dgrad), or both.
        ctx.set_materialize_grads(False)
        for i, w in enumerate(weights):
            if ctx.needs_input_grad[_FIRST_WEIGHT + i]:
                check_accumulation_weight(w, wgrad_accumulation)
                if deferred_wgrad:
                    check_deferred_weight(w)
        if x_data is None:
            x_data, x_scales = kernel_ops.quantize_rowwise_rows(x, *quant)
        forms = [
            quantize_weight_forms(
                _KERNELS, w, quant, needs_dx and save_fp8_weight, forward=True, transposed=False,
                keep=keep_quantized_weights,
            )
            for w in weights
        ]
        h, gate_up = kernel_ops.grouped_mm_swiglu(x_data, x_scales, rows, *_gate_and_up(forms), offs, x.dtype)
        saved_weights = []
        for w, form in zip(weights, forms):
            kept = form.data_t is not None
            saved_weights += [None if kept or not needs_dx else w, form.data_t, form.grad_multipliers]
        # The wgrad's x: the FP8 token rows and scales, or x itself for a bf16 wgrad.
        wgrad_x = (x, None, None) if bf16_wgrad and needs_dw else (None, x_data, x_scales)
        ctx.save_for_backward(*wgrad_x, rows, inverse, offs, gate_up, *saved_weights)
        ctx.quant, ctx.x_dtype, ctx.w_dtypes = quant, x.dtype, tuple(w.dtype for w in weights)
        ctx.keep, ctx.wgrad_accumulation, ctx.bf16_wgrad = keep_quantized_weights, wgrad_accumulation, bf16_wgrad
        ctx.deferred_wgrad = deferred_wgrad and not bf16_wgrad
        ctx.weights = weights if wgrad_accumulation != "off" or ctx.deferred_wgrad else None
        return h, gate_up

    @staticmethod
    def backward(ctx, grad_h: Tensor | None, grad_gate_up: Tensor | None) -> tuple[Tensor | None, ...]:
        x, x_data, x_scales, rows, inverse, offs, gate_up, *saved_weights = ctx.saved_tensors
        needs_dx = ctx.needs_input_grad[0]
        needs_dw = ctx.needs_input_grad[_FIRST_WEIGHT:]
        if grad_h is None and grad_gate_up is None:
            return (None,) * (_FIRST_WEIGHT + len(needs_dw))
        hidden = gate_up.shape[1] // 2
        # Each weight's rows of grad_gate_up: w1's and w3's halves, or all of them for a packed w13.
        parts = [slice(0, 2 * hidden)] if len(needs_dw) == 1 else [slice(0, hidden), slice(hidden, 2 * hidden)]
        weights_t, multipliers = [], []
        if needs_dx:
            for i in range(len(parts)):
                w, wt, mult = saved_weights[3 * i : 3 * i + 3]
                if wt is None:
                    form = quantize_weight_forms(
                        _KERNELS, w, ctx.quant, True, forward=False, transposed=True, keep=ctx.keep
                    )
                    wt, mult = form.data_t, form.grad_multipliers
                weights_t.append(wt)
                multipliers.append(mult)
        fp8_wgrad = any(needs_dw) and not ctx.bf16_wgrad
        # A deferred wgrad (ops.deferred_wgrad) keeps grad_gate_up instead: its FP8 form is made in the run.
        deferred = fp8_wgrad and ctx.deferred_wgrad and all(defers(w) for w, n in zip(ctx.weights, needs_dw) if n)
        fp8_wgrad = fp8_wgrad and not deferred
        # The FP8 wgrad folds each pair's token scale into grad_gate_up (the FP8 x^T then has scales 1).
        token_scales = x_scales[rows] if fp8_wgrad else None
        goq = None
        if grad_h is not None and grad_gate_up is not None:
            grad_gate_up = grad_gate_up + kernel_ops.swiglu_backward(grad_h.contiguous(), gate_up)
        if grad_h is not None and grad_gate_up is None and needs_dx and not fp8_wgrad:
            # dgrad's folded rows alone: quantized in SwiGLU's backward kernel itself.
            grad_gate_up, goq = _KERNELS.swiglu_backward_folded_rows(
                grad_h.contiguous(), gate_up, offs, ctx.quant, torch.cat(multipliers, dim=1)
            )
        else:
            if grad_gate_up is None:
                grad_gate_up = kernel_ops.swiglu_backward(grad_h.contiguous(), gate_up)
            grad_gate_up = grad_gate_up.contiguous()
            if needs_dx:
                goq = _KERNELS.quantize_folded_grad_output(
                    grad_gate_up, offs, ctx.quant, True, torch.cat(multipliers, dim=1), token_scales, fp8_wgrad
                )
            elif fp8_wgrad:
                goq = _KERNELS.quantize_folded_grad_output(grad_gate_up, offs, ctx.quant, False, None, token_scales)
        dx = None
        if needs_dx:
            ones_w = torch.ones(weights_t[0].shape[:2], dtype=torch.float32, device=gate_up.device)
            if len(weights_t) == 1:
                dx = kernel_ops.grouped_mm_2d3d(goq.data, goq.scales, weights_t[0], ones_w, offs, ctx.x_dtype)
            else:
                dx = kernel_ops.grouped_mm_2d3d_split(
                    goq.data, goq.scales, weights_t[0], weights_t[1], ones_w, offs, ctx.x_dtype
                )
            if inverse is not None:
                dx = sum_pair_rows(dx, inverse)
        dws = [None] * len(parts)
        if deferred:
            defer_wgrad(
                ctx.weights, list(needs_dw), _KERNELS, ctx.quant, ctx.wgrad_accumulation,
                UpProjectionWgradInputs(grad_gate_up.contiguous(), x_data, x_scales, rows, offs),
            )
        elif any(needs_dw):
            # x holds the pairs themselves when there is no inverse (rows is then 0..P-1).
            token_rows = None if inverse is None else rows
            x_pairs: list[Tensor] = []  # x gathered to the pairs once, for torch._grouped_mm's new gradients
            if not ctx.bf16_wgrad:
                forms = up_projection_wgrad_forms(goq, x_data, rows, offs, list(needs_dw))
            for i, part in enumerate(parts):
                if not needs_dw[i]:
                    continue
                if ctx.bf16_wgrad:
                    operands = (grad_gate_up[:, part],)
                else:
                    grad, xq = forms[i]
                    operands = (grad.data_t, grad.scales_t, xq.data_t, xq.scales_t, offs)

                def gemm(out: Tensor | None, out_dtype: torch.dtype, operands=operands) -> Tensor:
                    if ctx.bf16_wgrad:
                        if out is not None:  # the kernel reads the tokens by index and adds in its epilogue
                            return grouped_mm_wgrad_bf16(operands[0], x, offs, out_dtype, token_rows, out)
                        if not x_pairs:
                            x_pairs.append(x if token_rows is None else x.index_select(0, token_rows))
                        return grouped_mm_wgrad_bf16(operands[0], x_pairs[0], offs, out_dtype)
                    if out is None:
                        return kernel_ops.grouped_mm_wgrad(*operands, out_dtype, WGRAD_GROUP_ALIGNMENT)
                    kernel_ops.grouped_mm_wgrad_accumulate(*operands, out, WGRAD_GROUP_ALIGNMENT)
                    return out

                if ctx.weights is None:
                    dws[i] = gemm(None, ctx.w_dtypes[i])
                else:
                    dws[i] = accumulate_wgrad(ctx.weights[i], ctx.wgrad_accumulation, gemm)
        return (dx, *([None] * (_FIRST_WEIGHT - 1)), *dws)


def _gate_and_up(forms: list) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(w1, w1 scales, w3, w3 scales)`` in FP8 from the forward forms of ``(w1, w3)`` or of a packed ``w13``."""
    if len(forms) == 2:
        return forms[0].data, forms[0].scales, forms[1].data, forms[1].scales
    data, scales = forms[0].data, forms[0].scales
    hidden = data.shape[1] // 2
    # The halves of the FP8 weight are read in place; their (E, H) scales are copied (small).
    return data[:, :hidden], scales[:, :hidden].contiguous(), data[:, hidden:], scales[:, hidden:].contiguous()


def fuses_experts(recipe: Fp8Recipe) -> bool:
    """Whether SwiGLU experts with ``recipe`` run the fused up-projection (``RowwiseOptions.fused_experts``)."""
    return recipe.fused_experts and recipe.fold_dgrad_weight_scales and recipe.fold_wgrad_input_scales


def swiglu_up_projection(
    x: Tensor,
    weights: tuple[Tensor, Tensor] | Tensor,
    offs: Tensor,
    recipe: Fp8Recipe,
    *,
    rows: Tensor | None = None,
    inverse: Tensor | None = None,
    x_fp8: tuple[Tensor, Tensor] | None = None,
    with_gate_up: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """``silu(x[rows] @ w1[g]^T) * (x[rows] @ w3[g]^T)`` per expert group, in FP8 (see the module docstring).

    Args:
        x: ``(T, D)`` bf16/fp16/fp32, contiguous: the tokens (each once), or the sorted pairs
            themselves when ``rows`` is ``None``.
        weights: ``(w1, w3)``, two ``(E, H, D)`` expert weights (``ops.Fp8WeightTensor`` too:
            FSDP2's FP8 all-gather), or one packed ``w13 (E, 2H, D)``, ``w1``'s rows then ``w3``'s
            (transformers' ``gate_up_proj``), quantized and differentiated as one weight.
        offs: ``(E,)`` int32 cumulative group ends over the pairs.
        recipe: a rowwise ``ops.Fp8Recipe`` with both folds on (``fuses_experts``).
        rows: ``(P,)`` int32: the token of each sorted pair (``order // k`` of ``ops.sort_by_expert``).
        inverse: ``(T, k)`` int64: each pair's sorted position (``rows`` and ``inverse`` go together).
        x_fp8: ``(data, scales)``: ``x``'s rows quantized rowwise by the recipe (the FP8 dispatch).
        with_gate_up: also return ``gate_up (P, 2H)``, the ``[gate | up]`` rows ``h`` is made of,
            for ``down_projection_combine(..., gate_up=)``: a gradient that reaches it is taken as
            SwiGLU's input gradient (its backward then runs in the down-projection's dgrad).

    Returns:
        ``h (P, H)`` in ``x``'s dtype (with ``with_gate_up``: ``(h, gate_up)``); rows past ``offs[-1]``
        are 0. Differentiable in ``x`` and the weights.
    """
    if not isinstance(recipe, Fp8Recipe) or not fuses_experts(recipe):
        raise ValueError("swiglu_up_projection needs a rowwise recipe with fused_experts and both folds on")
    weights = (weights,) if isinstance(weights, Tensor) else tuple(weights)
    if len(weights) not in (1, 2):
        raise TypeError(f"weights must be (w1, w3) or one packed w13 tensor, got {len(weights)} tensors")
    for w in weights:
        _check_grouped_linear_inputs(x, w, offs, recipe, x.dtype, x_contiguous=x_fp8 is None)
    if len(weights) == 2 and weights[1].shape != weights[0].shape:
        raise ValueError(f"w3 must have w1's shape {tuple(weights[0].shape)}, got {tuple(weights[1].shape)}")
    if len(weights) == 1 and weights[0].shape[1] % (2 * DIM_ALIGNMENT):
        raise ValueError(
            f"a packed w13 (E, 2H, D) needs H a multiple of {DIM_ALIGNMENT} (its halves are w1 and w3), "
            f"got shape {tuple(weights[0].shape)}"
        )
    if (rows is None) != (inverse is None):
        raise ValueError("rows and inverse go together: give both (routed tokens) or neither (sorted pairs)")
    if rows is None:
        rows = torch.arange(x.shape[0], dtype=torch.int32, device=x.device)
    else:
        if not isinstance(rows, Tensor) or rows.dim() != 1 or rows.dtype != torch.int32 or rows.device != x.device:
            raise ValueError(f"rows must be a 1-D int32 tensor on {x.device} (the token of each pair)")
        if not isinstance(inverse, Tensor) or inverse.dtype != torch.int64 or inverse.dim() != 2:
            raise ValueError("inverse must be a (T, k) int64 tensor (each pair's sorted position)")
        if inverse.shape[0] != x.shape[0] or inverse.numel() != rows.shape[0] or inverse.device != x.device:
            raise ValueError(
                f"inverse must be (T, k) with T = {x.shape[0]} tokens and T * k = {rows.shape[0]} pairs on {x.device}, "
                f"got {tuple(inverse.shape)} on {inverse.device}"
            )
    x_data, x_scales = (None, None) if x_fp8 is None else _check_quantized_rows(x, x_fp8, recipe)
    quant = _KERNELS.quant_options(recipe)
    hidden = weights[0].shape[-2] // (2 if len(weights) == 1 else 1)
    bf16_wgrad = any(w.requires_grad for w in weights) and resolve_wgrad_precision(
        recipe, x, rows.shape[0], offs.shape[0], hidden, x_fp8 is None
    )
    h, gate_up = _SwiGLUUpProjection.apply(
        x, x_data, x_scales, rows, inverse, offs, quant, recipe.save_fp8_weight,
        recipe.keep_quantized_weights, recipe.wgrad_accumulation, bf16_wgrad, recipe.deferred_wgrad, *weights,
    )
    return (h, gate_up) if with_gate_up else h


def down_projection_combine(
    h: Tensor,
    w2: Tensor,
    offs: Tensor,
    recipe: Fp8Recipe,
    routing: CombineRouting,
    probs: Tensor,
    gate_up: Tensor | None = None,
) -> Tensor:
    """``moe_combine(h @ w2[g]^T, routing.inverse, probs)``: the down-projection and the MoE combine, in FP8.

    The combine's rows come out of the ``w2`` GEMM in ``h``'s dtype (``fp8_grouped_linear(h, w2,
    offs, recipe, h.dtype)``). In backward the output's gradient ``(T, D)`` is not expanded to the
    pairs' ``(T * k, D)`` rows in bf16 when both of their FP8 forms are made (folded dgrad, FP8
    wgrad): the two-pass quantizer reads each pair's token row by index and multiplies it by its
    probability (``quantize_rowwise_rows_and_cols_grouped``'s ``pair_tokens``), bitwise the rows
    ``moe_combine_grad_rows`` writes otherwise.

    With ``gate_up`` (``swiglu_up_projection(..., with_gate_up=True)``'s, ``h = silu(gate) * up``)
    the gradient goes to ``gate_up``: the dgrad's operand is each pair's token row of the
    gradient before the weight (quantized by index, ``weight_rows=False``), giving ``u``, the
    gradient of ``h`` per unit weight; SwiGLU's backward multiplies by the weight and sums
    ``grad_probs = <u, h>`` with ``h`` recomputed from ``gate_up``: in a kernel of its own after
    the dgrad (``swiglu_backward_weighted``), or in the dgrad's epilogue
    (``grouped_mm_swiglu_backward``, ``RowwiseOptions.fused_swiglu_backward``; ``u`` is then not
    written either). The combine's rows ``y (T * k, D)``, which the weights' gradient reads
    otherwise, are not kept for backward.

    Args:
        h: ``(T * k, H)``: the pairs' hidden rows, sorted by expert.
        w2: ``(E, D, H)`` expert weight (``ops.Fp8WeightTensor`` too).
        offs: ``(E,)`` int32 cumulative group ends over the pairs.
        recipe: a rowwise ``ops.Fp8Recipe`` (``fuses_experts``).
        routing: the pairs' order (``CombineRouting``).
        probs: ``(T, k)`` routing weights, float32 (or bf16 / fp16).
        gate_up: optional ``(T * k, 2H)`` of ``h``'s dtype: the rows ``h`` is SwiGLU of.

    Returns:
        ``(T, D)`` in ``h``'s dtype, differentiable in ``h`` (or, with ``gate_up``, in it instead),
        ``w2`` and ``probs``.
    """
    if not isinstance(recipe, Fp8Recipe) or not fuses_experts(recipe):
        raise ValueError("down_projection_combine needs a rowwise recipe with fused_experts and both folds on")
    _check_grouped_linear_inputs(h, w2, offs, recipe, h.dtype)
    if not isinstance(probs, Tensor) or probs.dtype not in PROBS_DTYPES or probs.shape != routing.inverse.shape:
        raise ValueError(
            "probs must be a float32 (or bf16 / fp16) tensor of the routing's (T, k) shape "
            f"{tuple(routing.inverse.shape)}, got "
            f"{getattr(probs, 'dtype', type(probs))} {tuple(getattr(probs, 'shape', ()))}"
        )
    pairs = h.shape[0]
    if routing.inverse.numel() != pairs or routing.order.shape != (pairs,) or routing.pair_tokens.shape != (pairs,):
        raise ValueError(
            f"the routing must cover h's {h.shape[0]} pair rows: inverse (T, k), order and pair_tokens (T * k,); got "
            f"{tuple(routing.inverse.shape)}, {tuple(routing.order.shape)}, {tuple(routing.pair_tokens.shape)}"
        )
    if gate_up is not None and (
        not isinstance(gate_up, Tensor) or gate_up.dtype != h.dtype or gate_up.shape != (pairs, 2 * h.shape[1])
        or not gate_up.is_contiguous() or gate_up.device != h.device
    ):
        raise ValueError(
            f"gate_up must be a contiguous {h.dtype} tensor (T * k, 2H) = {(pairs, 2 * h.shape[1])} on {h.device} "
            f"(the rows h is SwiGLU of), got {getattr(gate_up, 'dtype', type(gate_up))} "
            f"{tuple(getattr(gate_up, 'shape', ()))}"
        )
    shared = shared_input_implementation(recipe)
    assert shared is not None  # the rowwise recipe has one
    combine = (routing, probs.contiguous()) if gate_up is None else (routing, probs.contiguous(), gate_up)
    return shared(h, (w2,), offs, recipe, h.dtype, None, combine)[0]
