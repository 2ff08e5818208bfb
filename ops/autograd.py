"""The rowwise FP8 recipe's grouped linear: its kernels, in ``ops.grouped_linear_autograd``'s data flow.

Scales: activations and gradients one per row (token) for the 2D x 3D GEMMs,
and one per (group, column) over the group's tokens for wgrad, whose operands
are stored tokens contiguous in the padded token layout (each group from a
multiple of 128 columns: ``(K, (ceil(M/128) + G) * 128)``, which the wgrad GEMM
reads with no masks); by default (``Fp8Recipe.fold_wgrad_input_scales``) wgrad's
``x`` operand is instead the forward's rowwise FP8 ``x`` copied into that layout
(``quantize_rowwise_rows_and_transpose``), its row scales folded into ``grad_out``'s
wgrad form; weights one per (expert, output row) for the forward and,
for dgrad, stored transposed ``(E, K, N)``: by default the forward's FP8 values
with their scales folded into ``grad_out``, else quantized again per (expert,
input column).

An activation's two forms come from one read of it and a copy of the FP8 bytes
(``x`` with the folded wgrad) or from two reads (``quantize_rowwise_rows_and_cols_grouped``:
``grad_out``, and ``x`` without the fold); without an FP8 wgrad ``grad_out``'s rowwise form alone,
folded, in one read (``quantize_rowwise_rows`` with ``row_multipliers``). A weight's forms come from two reads
(``quantize_rowwise_expert_weights_both_layouts``), or from one read and a transposed copy of
the FP8 bytes with ``Fp8Recipe.fold_dgrad_weight_scales``
(``quantize_rowwise_expert_weights_and_transpose``: dgrad then takes the forward scales
in ``grad_out``'s rowwise form). The saved
FP8 ``x^T`` is about half the bytes of bf16 ``x``.
"""

from __future__ import annotations

import torch
from torch import Tensor

import ops.custom_ops  # noqa: F401  (defines the fp8moe ops used below)
import ops.custom_ops_moe  # noqa: F401  (swiglu_backward_quantized)
from kernels_helion.quantize_rowwise_weights import is_stored_transposed
from kernels_helion.token_groups import WGRAD_GROUP_ALIGNMENT
from ops.fp8_weight import Fp8WeightTensor
from ops.grouped_linear_autograd import (
    QuantizedActivation,
    QuantizedWeight,
    QuantOptions,
    RecipeKernels,
    grouped_linear_function,
    register_grouped_linear,
)
from ops.op_registry import kernel_ops
from ops.recipes import Fp8Recipe, RowwiseOptions

_ops = kernel_ops


class RowwiseKernels(RecipeKernels):
    """The rowwise recipe's kernels; ``quant`` is ``(float8_dtype, round_scales_to_power_of_2)``."""

    def quant_options(self, recipe: Fp8Recipe) -> QuantOptions:
        return (recipe.float8_dtype, recipe.round_scales_to_power_of_2)

    def quantize_activation(
        self, t: Tensor, offs: Tensor, quant: QuantOptions, rowwise: bool, wgrad: bool
    ) -> QuantizedActivation:
        if rowwise and wgrad:
            return QuantizedActivation(
                *_ops.quantize_rowwise_rows_and_cols_grouped(t, offs, *quant, WGRAD_GROUP_ALIGNMENT), None
            )
        if rowwise:
            return QuantizedActivation(*_ops.quantize_rowwise_rows(t, *quant), None, None, None)
        return QuantizedActivation(None, None, *_ops.quantize_rowwise_cols_grouped(t, offs, *quant, WGRAD_GROUP_ALIGNMENT), None)

    def quantize_weight(self, w: Tensor, quant: QuantOptions, forward: bool, transposed: bool) -> QuantizedWeight:
        if is_stored_transposed(w):
            # Read as stored: wt's rowwise form is W's dgrad form, its transposed form W's forward form.
            wt = w.transpose(-2, -1)
            if forward and transposed:
                dq, ds, q, scales = _ops.quantize_rowwise_expert_weights_both_layouts(wt, *quant)
                return QuantizedWeight(q, scales, dq, ds)
            if forward:
                return QuantizedWeight(*_ops.quantize_rowwise_expert_weights_transposed(wt, *quant), None, None)
            return QuantizedWeight(None, None, *_ops.quantize_rowwise_expert_weights(wt, *quant))
        if forward and transposed:
            return QuantizedWeight(*_ops.quantize_rowwise_expert_weights_both_layouts(w, *quant))
        if forward:
            return QuantizedWeight(*_ops.quantize_rowwise_expert_weights(w, *quant), None, None)
        return QuantizedWeight(None, None, *_ops.quantize_rowwise_expert_weights_transposed(w, *quant))

    def quantize_folded_weight(self, w: Tensor, quant: QuantOptions, forward: bool) -> QuantizedWeight:
        q, scales, qt = _ops.quantize_rowwise_expert_weights_and_transpose(w, *quant)
        return _folded_forms(q, scales, qt, forward)

    def prequantized_weight_forms(self, w: Fp8WeightTensor, forward: bool, transposed: bool) -> QuantizedWeight:
        q, scales = w.data_fp8, w.scales
        if not transposed:
            return QuantizedWeight(q, scales, None, None)
        # The scales are copied: the folded dgrad keeps them for backward, apart from the
        # gathered buffer, which FSDP2 frees after forward.
        return _folded_forms(q, scales.clone(), _ops.transpose_fp8(q), forward)

    def quantize_folded_input(self, x: Tensor, offs: Tensor, quant: QuantOptions) -> QuantizedActivation:
        q, scales, qt = _ops.quantize_rowwise_rows_and_transpose(x, offs, *quant, WGRAD_GROUP_ALIGNMENT)
        return _folded_input(q, scales, qt, offs)

    def fold_quantized_input(self, data: Tensor, scales: Tensor, offs: Tensor) -> QuantizedActivation:
        return _folded_input(data, scales, _ops.transpose_to_token_groups(data, offs, WGRAD_GROUP_ALIGNMENT), offs)

    def quantize_folded_grad_output(
        self,
        grad_out: Tensor,
        offs: Tensor,
        quant: QuantOptions,
        rowwise: bool,
        grad_multipliers: Tensor | None,
        token_multipliers: Tensor | None,
        wgrad: bool = True,
    ) -> QuantizedActivation:
        if rowwise and not wgrad:
            # dgrad only (a bf16 wgrad, a frozen weight): the folded rows in one read.
            folded = (offs, grad_multipliers) if grad_multipliers is not None else ()
            return QuantizedActivation(*_ops.quantize_rowwise_rows(grad_out, *quant, *folded), None, None, None)
        if rowwise:
            forms = _ops.quantize_rowwise_rows_and_cols_grouped(
                grad_out, offs, *quant, WGRAD_GROUP_ALIGNMENT, grad_multipliers, token_multipliers
            )
            return QuantizedActivation(*forms, None)
        wgrad_form = _ops.quantize_rowwise_cols_grouped(grad_out, offs, *quant, WGRAD_GROUP_ALIGNMENT, token_multipliers)
        return QuantizedActivation(None, None, *wgrad_form, None)

    def quantize_combined_grad_output(
        self,
        grad: Tensor,
        pairs: tuple[Tensor, Tensor],
        offs: Tensor,
        quant: QuantOptions,
        grad_multipliers: Tensor,
        token_multipliers: Tensor | None,
        weight_rows: bool = True,
    ) -> QuantizedActivation:
        forms = _ops.quantize_rowwise_rows_and_cols_grouped(
            grad, offs, *quant, WGRAD_GROUP_ALIGNMENT, grad_multipliers, token_multipliers, *pairs, weight_rows
        )
        return QuantizedActivation(*forms, None)

    def quantize_pair_grad_rows(
        self, grad: Tensor, pair_tokens: Tensor, offs: Tensor, quant: QuantOptions, grad_multipliers: Tensor | None
    ) -> QuantizedActivation:
        folded = (offs, grad_multipliers) if grad_multipliers is not None else (None, None)
        data, scales = _ops.quantize_rowwise_rows(grad, *quant, *folded, pair_tokens)
        return QuantizedActivation(data, scales, None, None, None)

    def quantize_token_grad_output(
        self,
        grad: Tensor,
        pairs: tuple[Tensor, Tensor],
        offs: Tensor,
        quant: QuantOptions,
        token_multipliers: Tensor | None,
        wgrad: bool,
    ) -> QuantizedActivation:
        data, scales = _ops.quantize_rowwise_rows(grad, *quant)
        if not wgrad:
            return QuantizedActivation(data, scales, None, None, None)
        data_t, scales_t = _ops.quantize_rowwise_cols_grouped(
            grad, offs, *quant, WGRAD_GROUP_ALIGNMENT, token_multipliers, *pairs
        )
        return QuantizedActivation(data, scales, data_t, scales_t, None)

    def token_rows_wgrad_operands(
        self,
        grad_rows: QuantizedActivation,
        pairs: tuple[Tensor, Tensor],
        x: QuantizedActivation,
        offs: Tensor,
        quant: QuantOptions,
    ) -> tuple[QuantizedActivation, QuantizedActivation]:
        pair_tokens = pairs[0]
        grad_t = _ops.transpose_to_token_groups(grad_rows.data, offs, WGRAD_GROUP_ALIGNMENT, pair_tokens)
        ones = torch.ones((offs.size(0), grad_rows.data.size(1)), dtype=torch.float32, device=grad_t.device)
        multipliers = _pair_row_multipliers(grad_rows.scales, pairs, x.scales)
        xt, xt_scales = _ops.quantize_rowwise_cols_grouped(x.data, offs, *quant, WGRAD_GROUP_ALIGNMENT, multipliers)
        return QuantizedActivation(None, None, grad_t, ones, None), QuantizedActivation(None, None, xt, xt_scales, None)

    def grouped_mm_token_rows(
        self,
        a: Tensor,
        a_scales: Tensor,
        rows: Tensor,
        b: Tensor,
        b_scales: Tensor,
        offs: Tensor,
        out_dtype: torch.dtype,
    ) -> Tensor:
        return _ops.grouped_mm_2d3d(a, a_scales, b, b_scales, offs, out_dtype, rows)

    def grouped_mm_swiglu_backward(
        self, a: QuantizedActivation, b: Tensor, b_scales: Tensor, offs: Tensor, gate_up: Tensor, pair_weights: Tensor
    ) -> tuple[Tensor, Tensor]:
        return _ops.grouped_mm_swiglu_backward(a.data, a.scales, b, b_scales, offs, gate_up, pair_weights)

    def swiglu_backward_folded_rows(
        self, grad_h: Tensor, gate_up: Tensor, offs: Tensor, quant: QuantOptions, grad_multipliers: Tensor
    ) -> tuple[Tensor, QuantizedActivation]:
        """SwiGLU's ``grad_gate_up`` and its folded dgrad form, in one kernel (``swiglu_backward_quantized``).

        The second is ``quantize_folded_grad_output(grad_gate_up, offs, quant, True, grad_multipliers,
        None, False)`` bitwise: the fused up-projection's backward when no FP8 wgrad form is needed.
        """
        grad_gate_up, data, scales = _ops.swiglu_backward_quantized(grad_h, gate_up, offs, grad_multipliers, *quant)
        return grad_gate_up, QuantizedActivation(data, scales, None, None, None)

    def grouped_mm(
        self, a: Tensor, a_scales: Tensor, b: Tensor, b_scales: Tensor, offs: Tensor, out_dtype: torch.dtype
    ) -> Tensor:
        return _ops.grouped_mm_2d3d(a, a_scales, b, b_scales, offs, out_dtype)

    def grouped_mm_wgrad(
        self, grad_out: QuantizedActivation, x: QuantizedActivation, offs: Tensor, out_dtype: torch.dtype
    ) -> Tensor:
        return _ops.grouped_mm_wgrad(
            grad_out.data_t, grad_out.scales_t, x.data_t, x.scales_t, offs, out_dtype, WGRAD_GROUP_ALIGNMENT
        )

    def grouped_mm_wgrad_accumulate(
        self, grad_out: QuantizedActivation, x: QuantizedActivation, offs: Tensor, out: Tensor
    ) -> None:
        _ops.grouped_mm_wgrad_accumulate(
            grad_out.data_t, grad_out.scales_t, x.data_t, x.scales_t, offs, out, WGRAD_GROUP_ALIGNMENT
        )


def _pair_row_multipliers(token_scales: Tensor, pairs: tuple[Tensor, Tensor], row_scales: Tensor) -> Tensor:
    """``pair_weights[i] * token_scales[pair_tokens[i]] * row_scales[i]`` in float32, 0 where ``pair_tokens[i]``
    is outside ``[0, T)`` (such a pair reads a zero row, as in the gathered kernels)."""
    pair_tokens, pair_weights = pairs
    num_tokens = token_scales.size(0)
    valid = (pair_tokens >= 0) & (pair_tokens < num_tokens)
    scales = token_scales.index_select(0, pair_tokens.clamp(0, max(num_tokens - 1, 0)))
    return torch.where(valid, pair_weights * scales * row_scales, 0.0)


def _folded_input(q: Tensor, scales: Tensor, qt: Tensor, offs: Tensor) -> QuantizedActivation:
    """The folded wgrad's forms of ``x``: rowwise ``(q, scales)``, wgrad ``qt`` with scales 1.

    The wgrad GEMM's x scales are ones: the real ones (per token) are folded into grad_out.
    """
    ones = torch.ones((offs.size(0), q.size(1)), dtype=torch.float32, device=q.device)
    return QuantizedActivation(q, scales, qt, ones, None)


def _folded_forms(q: Tensor, scales: Tensor, qt: Tensor, forward: bool) -> QuantizedWeight:
    """The folded dgrad's weight forms from the forward FP8 values ``q``, their ``scales`` and ``qt`` (``q`` transposed)."""
    # The dgrad GEMM's weight scales: the real ones are folded into grad_out.
    ones = torch.ones(qt.shape[:2], dtype=torch.float32, device=qt.device)
    if forward:
        return QuantizedWeight(q, scales, qt, ones, scales)
    return QuantizedWeight(None, None, qt, ones, scales)


RowwiseFp8GroupedLinear = grouped_linear_function("RowwiseFp8GroupedLinear", RowwiseKernels())
register_grouped_linear("rowwise", RowwiseFp8GroupedLinear, RowwiseOptions)
