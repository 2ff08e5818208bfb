"""Autograd of the FP8 grouped linear, one data flow for every recipe: ``out_i = x @ w_i[g]^T`` per token group ``g``.

A recipe supplies its kernels as a ``RecipeKernels``: how it quantizes an
activation (rowwise for the 2D x 3D GEMM, per group along the tokens for wgrad,
or both from one read), how it quantizes a weight (for the forward, transposed
for dgrad, or both), and its two grouped GEMMs. ``grouped_linear_function``
builds the recipe's ``torch.autograd.Function`` around them:

Forward: ``x`` is quantized once for every weight (SwiGLU's gate and up
projections read the same tokens), together with its wgrad form when a weight
gradient is needed and ``recipe.save_fp8_input``; each weight in its forward
form and, when ``dx`` is needed and ``recipe.save_fp8_weight``, its transposed
dgrad form from the same read; one grouped GEMM per weight.

Saved for backward (never a bf16 copy; ``x`` and ``w`` only by reference when chosen):
  - ``save_fp8_weight``: each ``W^T`` in FP8 + scales; otherwise ``w`` itself
    (a parameter: no extra memory), quantized transposed in backward.
  - ``save_fp8_input``: one FP8 ``x^T`` (wgrad form) + scales for all weights (with the
    folded wgrad, also ``x``'s row scales); otherwise ``x`` itself, quantized once in
    backward for all weights.
Both choices give bitwise the same results. ``ops.saved_tensor_bytes`` measures them.

Pre-quantized input (``x_fp8``: FP8 rows and their row scales made by the recipe's
rowwise quantization elsewhere, e.g. before an expert-parallel all-to-all): the forward
GEMMs read those rows instead of quantizing ``x``, and ``x`` is only the gradient
anchor (its values are never read; ``dx`` is returned for it). The wgrad's ``x^T``
is then built from the same FP8 rows (``RecipeKernels.fold_quantized_input``), which
needs the folded wgrad with the FP8 input saved: ``ops.functional`` refuses other
settings, which would need a bf16 ``x``.

Folded dgrad (``recipe.fold_dgrad_weight_scales``, for a weight when ``dx`` is computed):
``dx = (grad_out * s_w[g]) @ W_fp8[g]`` with ``s_w`` the forward weight
scales, which vary along dgrad's contraction ``N`` and so are multiplied into
``grad_out`` before its rowwise quantization (with its wgrad form when that is FP8,
else alone, in one read). ``W^T`` is then the forward FP8 values transposed, made
with them, with scales 1.

Folded wgrad (``recipe.fold_wgrad_input_scales``, when a ``dW`` is computed):
``dW = (grad_out * s_x)^T @ x_fp8`` per group, with ``s_x`` the forward's row
scales of ``x`` (one per token), which vary along wgrad's contraction (the
tokens) and so are multiplied into ``grad_out`` before its per-(group, column)
quantization. ``x^T`` is then the forward's rowwise FP8 values copied into
wgrad's layout, with scales 1; ``s_x`` is saved with it.

Backward, per weight: ``grad_out`` in the forms needed (both from one read when
``dx`` and ``dW`` are); ``dx = sum_i grouped_mm(grad_out_i, W_i^T)``;
``dW_i = grouped_mm_wgrad(grad_out_i^T, x^T)``. ``offs`` gets no gradient.
Nothing syncs with the host.

bf16 wgrad (``Fp8Recipe.wgrad_precision``, ``ops.wgrad_precision``; resolved per call on the
host from shapes): ``x`` is saved as it is, ``grad_out`` is quantized only rowwise (for dgrad,
which then does not fold: the fold rides on the two-form quantization), and
``dW = torch._grouped_mm(grad_out^T, x)`` in bf16.

Every weight quantization goes through ``quantize_weight_forms``, which keeps each
form with its weight until the weight changes (``Fp8Recipe.keep_quantized_weights``),
or makes it once inside an ``ops.reuse_quantized_weights()`` block (``ops.weight_reuse``).
With ``RowwiseOptions.wgrad_accumulation`` the wgrad GEMM adds ``dW`` into the
weight's gradient in its epilogue (``ops.grad_accumulation``).
A weight that arrives quantized (``ops.Fp8WeightTensor``, FSDP2's FP8 all-gather)
is not quantized: its forward form is used as it is, and its dgrad always folds
(``RecipeKernels.prequantized_weight_forms``), the only dgrad form its FP8 values give.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

import ops.custom_ops_moe  # noqa: F401  (defines the fp8moe combine ops used below)
from kernels_helion.quantize_rowwise_weights import is_stored_transposed
from ops.deferred_wgrad import DownProjectionWgradInputs, check_deferred_weight, defer_wgrad, defers
from ops.down_dgrad_token_rows import resolve_down_dgrad_token_rows
from ops.fp8_weight import Fp8WeightTensor
from ops.grad_accumulation import accumulate_wgrad, check_accumulation_weight
from ops.op_registry import kernel_ops
from ops.recipes import Fp8Recipe, register_recipe, register_shared_input
from ops.weight_reuse import keep_or_quantize, kept_forms, reuse_or_quantize
from ops.wgrad_precision import grouped_mm_wgrad_bf16, resolve_wgrad_precision

# The recipe's quantization options, passed through to its kernels (e.g. (float8_dtype, round_scales_to_power_of_2)).
QuantOptions = tuple[object, ...]


class QuantizedActivation(NamedTuple):
    """An activation's quantized forms; a form not asked for is ``None``."""

    data: Tensor | None  # rowwise form, the left operand of the 2D x 3D GEMM
    scales: Tensor | None
    data_t: Tensor | None  # wgrad form, tokens contiguous
    scales_t: Tensor | None
    wgrad_layout: Tensor | None  # the recipe's device-side map of the wgrad form's blocks, if it has one


class QuantizedWeight(NamedTuple):
    """An expert weight's quantized forms; a form not asked for is ``None``."""

    data: Tensor | None  # forward form (E, N, K)
    scales: Tensor | None
    data_t: Tensor | None  # dgrad form, transposed (E, K, N)
    scales_t: Tensor | None
    # Folded dgrad (``quantize_folded_weight``): the (E, N) scales that grad_out's rowwise form is
    # multiplied by; ``data_t`` then holds the forward FP8 values transposed and ``scales_t`` ones.
    grad_multipliers: Tensor | None = None


class CombineRouting(NamedTuple):
    """The MoE combine that follows a grouped linear (``grouped_linear_function``'s ``combine``).

    The linear's output rows are the (token, choice) pairs sorted by expert; the combine
    sums each token's ``k`` rows weighted by its routing probabilities
    (``kernels_helion.moe_combine``).
    """

    order: Tensor  # (T * k,) int64: the pair (token * k + choice) of each sorted row
    inverse: Tensor  # (T, k) int64: each pair's sorted row
    pair_tokens: Tensor  # (T * k,) int32: the token of each sorted row (order // k)


class RecipeKernels(abc.ABC):
    """The kernels of one recipe, in the shapes the shared data flow asks for."""

    @abc.abstractmethod
    def quant_options(self, recipe: Fp8Recipe) -> QuantOptions:
        """The options every quantization of this recipe takes, from ``recipe``."""

    def check_weight(self, w: Tensor) -> None:  # noqa: B027  (optional hook)
        """Raise a clear error if ``w`` breaks a rule of this recipe (beyond ``ops.functional``'s checks)."""

    @abc.abstractmethod
    def quantize_activation(
        self, t: Tensor, offs: Tensor, quant: QuantOptions, rowwise: bool, wgrad: bool
    ) -> QuantizedActivation:
        """``t (M, K)`` in its rowwise form, its wgrad form, or both (at least one is asked for)."""

    @abc.abstractmethod
    def quantize_weight(self, w: Tensor, quant: QuantOptions, forward: bool, transposed: bool) -> QuantizedWeight:
        """``w (E, N, K)`` in its forward form, its transposed dgrad form, or both."""

    def quantize_folded_weight(self, w: Tensor, quant: QuantOptions, forward: bool) -> QuantizedWeight:
        """``w`` for a dgrad that folds its forward scales into ``grad_out`` (``Fp8Recipe.fold_dgrad_weight_scales``).

        Returns the forward form if ``forward``, and ``data_t`` (the forward FP8
        values transposed), ``scales_t`` (ones) and ``grad_multipliers`` (the forward
        scales). Only recipes that offer the option implement it.
        """
        raise NotImplementedError(f"{type(self).__name__} does not fold weight scales into grad_out")

    def quantize_folded_input(self, x: Tensor, offs: Tensor, quant: QuantOptions) -> QuantizedActivation:
        """``x`` for a wgrad that folds its row scales into ``grad_out`` (``Fp8Recipe.fold_wgrad_input_scales``).

        Returns the rowwise form (``data``, ``scales``: the scales to fold) and, as the
        wgrad form, the same FP8 values in the wgrad layout (``data_t``) with scales 1
        (``scales_t``). Only recipes that offer the option implement it.
        """
        raise NotImplementedError(f"{type(self).__name__} does not fold input scales into grad_out")

    def fold_quantized_input(self, data: Tensor, scales: Tensor, offs: Tensor) -> QuantizedActivation:
        """``quantize_folded_input``'s result from rows already quantized rowwise (``data``, ``scales``).

        Only recipes whose forward operand is quantized per row implement it.
        """
        raise NotImplementedError(f"{type(self).__name__} does not take pre-quantized input rows")

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
        """``grad_out``'s wgrad form if ``wgrad`` and its rowwise form if ``rowwise``, with scales folded in.

        The rowwise form is that of each token's row times its group's
        ``grad_multipliers`` (folded dgrad; given only with ``rowwise``), the wgrad
        form that of each token's row times its ``token_multipliers`` entry (folded
        wgrad); ``None`` folds nothing into that form.
        """
        raise NotImplementedError(f"{type(self).__name__} does not fold scales into grad_out")

    def quantize_combined_grad_output(
        self,
        grad: Tensor,
        pairs: tuple[Tensor, Tensor],
        offs: Tensor,
        quant: QuantOptions,
        grad_multipliers: Tensor,
        token_multipliers: Tensor | None,
        weight_rows: bool = True,
    ) -> QuantizedActivation | None:
        """``quantize_folded_grad_output(rows, offs, quant, True, grad_multipliers, token_multipliers)``
        of the combine's gradient rows ``rows[s] = grad[pair_tokens[s]] * pair_weights[s]``
        (``moe_combine_grad_rows``), read by index from ``grad (T, N)`` (``pairs = (pair_tokens,
        pair_weights)``) instead of written out; ``None`` where the recipe cannot (the caller
        then writes the rows out). ``weight_rows=False``: the rowwise form is that of
        ``grad[pair_tokens[s]]`` (``grouped_mm_swiglu_backward``'s operand)."""
        return None

    def quantize_pair_grad_rows(
        self, grad: Tensor, pair_tokens: Tensor, offs: Tensor, quant: QuantOptions, grad_multipliers: Tensor | None
    ) -> QuantizedActivation:
        """The rowwise form of ``grad[pair_tokens[s]]`` (times its group's ``grad_multipliers``: folded
        dgrad), read by index from ``grad (T, N)``: ``grouped_mm_swiglu_backward``'s operand when no
        FP8 wgrad form is made. Only recipes with ``grouped_mm_swiglu_backward`` implement it."""
        raise NotImplementedError(f"{type(self).__name__} has no fused SwiGLU backward")

    def quantize_token_grad_output(
        self,
        grad: Tensor,
        pairs: tuple[Tensor, Tensor],
        offs: Tensor,
        quant: QuantOptions,
        token_multipliers: Tensor | None,
        wgrad: bool,
    ) -> QuantizedActivation:
        """The down-projection's gradient with its dgrad form per token: ``grad (T, N)``'s token rows
        quantized rowwise once (``data``, ``scales``: ``T`` rows, which the dgrad reads by index,
        ``grouped_mm_token_rows``) and, with ``wgrad``, the per-group column form of the combine's
        gradient rows ``grad[pair_tokens[s]] * pair_weights[s]`` read by index (``pairs``), times
        ``token_multipliers`` (folded wgrad). Only recipes with ``grouped_mm_token_rows`` implement it."""
        raise NotImplementedError(f"{type(self).__name__} has no dgrad on token rows")

    def token_rows_wgrad_operands(
        self,
        grad_rows: QuantizedActivation,
        pairs: tuple[Tensor, Tensor],
        x: QuantizedActivation,
        offs: Tensor,
        quant: QuantOptions,
    ) -> tuple[QuantizedActivation, QuantizedActivation]:
        """The down-projection's FP8 wgrad operands from the token rows (``RowwiseOptions.down_wgrad_token_rows``).

        ``grad_rows``: ``quantize_token_grad_output``'s rowwise form of the gradient's ``T`` token rows
        (``q[t]``, scale ``s[t]``); ``pairs = (pair_tokens, pair_weights)``; ``x``: the pairs' rowwise FP8
        rows and scales (``x[i] ~= r[i] * xq[i]``). ``dW[g] = sum_i w[i] * grad[t_i]^T x[i] =
        sum_i q[t_i]^T (w[i] * s[t_i] * r[i] * xq[i])``: the gradient's operand is its token rows' FP8
        bytes gathered into the padded token layout (scales 1), and ``x``'s is its FP8 rows times those
        multipliers, quantized per (group, column). Returns ``(grad form, x form)`` (``data_t``,
        ``scales_t`` set). Only recipes with ``grouped_mm_token_rows`` implement it."""
        raise NotImplementedError(f"{type(self).__name__} has no wgrad on token rows")

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
        """``grouped_mm`` whose row ``i`` is ``a``'s row ``rows[i]``, read by index inside the GEMM (``a``
        holds each token's row once). Only recipes whose rowwise form has one scale per row implement it."""
        raise NotImplementedError(f"{type(self).__name__} has no dgrad on token rows")

    def grouped_mm_swiglu_backward(
        self, a: QuantizedActivation, b: Tensor, b_scales: Tensor, offs: Tensor, gate_up: Tensor, pair_weights: Tensor
    ) -> tuple[Tensor, Tensor]:
        """The down-projection's dgrad with SwiGLU's backward in its epilogue: ``a``'s rowwise form
        (the combine's gradient rows before their weights) times the dgrad form ``b`` ->
        ``(grad_gate_up, pair_weight_grads)`` (``kernels_helion.grouped_gemm_swiglu_backward``).
        Only recipes that offer it implement it."""
        raise NotImplementedError(f"{type(self).__name__} has no fused SwiGLU backward")

    def prequantized_weight_forms(self, w: Fp8WeightTensor, forward: bool, transposed: bool) -> QuantizedWeight:
        """The forms of a weight that arrives quantized: ``w``'s own (forward), the folded dgrad form (``transposed``).

        The folded dgrad form is that of ``quantize_folded_weight``. Only recipes whose
        forward weight form ``Fp8WeightTensor`` holds implement it.
        """
        raise NotImplementedError(f"{type(self).__name__} takes no pre-quantized (FP8-gathered) weights")

    @abc.abstractmethod
    def grouped_mm(
        self, a: Tensor, a_scales: Tensor, b: Tensor, b_scales: Tensor, offs: Tensor, out_dtype: torch.dtype
    ) -> Tensor:
        """2D x 3D: ``a (M, K)`` rowwise form times each group's ``b[g] (N, K)`` forward (or dgrad) form."""

    @abc.abstractmethod
    def grouped_mm_wgrad(
        self, grad_out: QuantizedActivation, x: QuantizedActivation, offs: Tensor, out_dtype: torch.dtype
    ) -> Tensor:
        """Jagged 2D x 2D: ``dW[g] = grad_out[g]^T @ x[g]`` from the wgrad forms -> ``(E, N, K)``.

        ``grad_out.wgrad_layout`` is the block map of both (they share the offsets).
        """

    def grouped_mm_wgrad_accumulate(
        self, grad_out: QuantizedActivation, x: QuantizedActivation, offs: Tensor, out: Tensor
    ) -> None:
        """``grouped_mm_wgrad``'s result added into the gradient ``out (E, N, K)`` in place.

        For ``RowwiseOptions.wgrad_accumulation``: only recipes that offer it implement it.
        """
        raise NotImplementedError(f"{type(self).__name__} does not add weight gradients in place")


class WeightFormKey(NamedTuple):
    """What a weight's quantized forms were made by and for (``ops.weight_reuse``'s key)."""

    kernels: int  # id of the recipe's ``RecipeKernels``
    quant: QuantOptions
    fold: bool
    forward: bool
    transposed: bool
    stored_transposed: bool


def quantize_weight_forms(
    kernels: RecipeKernels,
    w: Tensor,
    quant: QuantOptions,
    fold: bool,
    forward: bool,
    transposed: bool,
    keep: bool = False,
) -> QuantizedWeight:
    """``kernels.quantize_folded_weight`` if ``fold`` (``transposed`` is then implied), else ``quantize_weight``.

    ``keep``: the forms are kept with ``w`` until it changes (``Fp8Recipe.keep_quantized_weights``);
    a form asked for only for the forward pass is taken from the kept forms that hold it
    too (those of training). Made once per weight and form inside an
    ``ops.reuse_quantized_weights()`` block either way. A pre-quantized weight
    (``Fp8WeightTensor``) gives its own forms and takes the folded dgrad form whenever
    ``transposed`` (its FP8 values give no other).
    """
    if isinstance(w, Fp8WeightTensor):
        return kernels.prequantized_weight_forms(w, forward=forward, transposed=fold or transposed)

    def quantize() -> QuantizedWeight:
        if fold:
            return kernels.quantize_folded_weight(w, quant, forward=forward)
        return kernels.quantize_weight(w, quant, forward=forward, transposed=transposed)

    # A weight stored transposed arrives as a new view each call: its forms are cached under the
    # tensor it views (the parameter), with the orientation in the key.
    stored_transposed = None if torch.compiler.is_compiling() else stored_transposed_base(w)
    anchor = w if stored_transposed is None else stored_transposed
    key = WeightFormKey(id(kernels), quant, fold, forward, fold or transposed, stored_transposed is not None)
    if not keep:
        return reuse_or_quantize(anchor, key, quantize)
    if forward and not (fold or transposed) and stored_transposed is None:
        # Only forms that the same recipe's kernels made with the same options for a forward pass.
        for kept_key, form in kept_forms(w).items():
            same_forward_form = (
                isinstance(kept_key, WeightFormKey)
                and kept_key.kernels == id(kernels)
                and kept_key.quant == quant
                and kept_key.forward
                and not kept_key.stored_transposed
            )
            if same_forward_form and isinstance(form, QuantizedWeight) and form.data is not None:
                return QuantizedWeight(form.data, form.scales, None, None)
    return keep_or_quantize(anchor, key, quantize)


def stored_transposed_base(w: Tensor) -> Tensor | None:
    """The contiguous ``(E, K, N)`` tensor of which ``w`` is exactly the ``transpose(-2, -1)`` view, else ``None``."""
    base = w._base
    if base is None or base.dim() != 3 or not base.is_contiguous() or w.is_contiguous():
        return None
    view = base.transpose(-2, -1)
    same = view.shape == w.shape and view.stride() == w.stride() and base.storage_offset() == w.storage_offset()
    return base if same and base.dtype == w.dtype else None


# Index of the first weight among the Function's inputs (x, x_data, x_scales, offs, quant, out_dtype,
# save_fp8_input, save_fp8_weight, fold_dgrad_weight_scales, fold_wgrad_input_scales,
# keep_quantized_weights, wgrad_accumulation, bf16_wgrad, combine, probs, gate_up, swiglu_in_dgrad,
# down_dgrad_token_rows, down_wgrad_token_rows, deferred_wgrad).
_FIRST_WEIGHT = 20
_PROBS = 14
_GATE_UP = 15
# Saved per weight: w, W^T, its scales, its grad multipliers (folded dgrad); None if unused.
_SAVED_PER_WEIGHT = 4


def grouped_linear_function(name: str, kernels: RecipeKernels) -> type[torch.autograd.Function]:
    """The ``torch.autograd.Function`` of a recipe.

    ``apply(x, x_data, x_scales, offs, quant, out_dtype, save_fp8_input, save_fp8_weight,
    fold_dgrad_weight_scales, fold_wgrad_input_scales, keep_quantized_weights,
    wgrad_accumulation, bf16_wgrad, combine, probs, gate_up, swiglu_in_dgrad, down_dgrad_token_rows,
    down_wgrad_token_rows, deferred_wgrad, *weights)``

    Returns one output ``x @ w_i[g]^T`` per weight. ``x_data``, ``x_scales``: ``x``'s FP8
    rows and row scales when made elsewhere (``x`` is then only the gradient anchor),
    else ``None``. With ``combine`` (a ``CombineRouting``; one weight, ``x``'s rows the sorted
    pairs) and ``probs (T, k)``, the output is the MoE combine of ``y = x @ w[g]^T``,
    ``moe_combine(y, combine.inverse, probs)``, differentiable in ``probs`` too; backward
    quantizes the combine's gradient rows read by index from the output's gradient where
    the recipe can (``RecipeKernels.quantize_combined_grad_output``) instead of writing them
    out. With ``gate_up`` too (``x = silu(gate) * up``, SwiGLU's output, from the ``(M, 2H)``
    rows ``gate_up`` that produced it), the gradient goes to ``gate_up`` instead of ``x``: the
    dgrad's operand is each pair's gradient row before its routing weight, and SwiGLU's
    backward applies the weight and sums the weight's gradient ``<u, h>`` (``u`` the dgrad's
    row, ``h`` recomputed from ``gate_up``), so the combine's rows ``y`` are not kept. SwiGLU's
    backward runs in a kernel of its own after the dgrad (``swiglu_backward_weighted``) or,
    with ``swiglu_in_dgrad``, in the dgrad's epilogue (``RecipeKernels.grouped_mm_swiglu_backward``:
    ``x``'s gradient is then not written either). With ``down_dgrad_token_rows`` instead (and a weight
    that does not arrive quantized), the dgrad reads the output gradient's token rows, quantized
    rowwise once, by index (``RecipeKernels.quantize_token_grad_output``, ``grouped_mm_token_rows``)
    against the weight quantized along ``N`` (the dgrad unfolded): no ``T * k`` pair rows are
    quantized for it. With ``down_wgrad_token_rows`` too and an FP8 wgrad, the wgrad reads them as well
    (``RecipeKernels.token_rows_wgrad_operands``): ``x`` is kept as its FP8 rows and quantized per
    (group, column) in backward, with the gradient's token scales folded in. With ``deferred_wgrad`` (``gate_up``
    too, an FP8 wgrad) ``x`` is kept as its FP8 rows likewise and the wgrad's inputs are kept for
    ``ops.run_deferred_wgrads`` (``ops.deferred_wgrad``), which makes the token-row forms over every
    micro-batch. The class carries ``kernels``.
    """

    def forward(
        ctx,
        x: Tensor,
        x_data: Tensor | None,
        x_scales: Tensor | None,
        offs: Tensor,
        quant: QuantOptions,
        out_dtype: torch.dtype,
        save_fp8_input: bool,
        save_fp8_weight: bool,
        fold_dgrad_weight_scales: bool,
        fold_wgrad_input_scales: bool,
        keep_quantized_weights: bool,
        wgrad_accumulation: str,
        bf16_wgrad: bool,
        combine: CombineRouting | None,
        probs: Tensor | None,
        gate_up: Tensor | None,
        swiglu_in_dgrad: bool,
        down_dgrad_token_rows: bool,
        down_wgrad_token_rows: bool,
        deferred_wgrad: bool,
        *weights: Tensor,
    ) -> tuple[Tensor, ...]:
        # SwiGLU's backward in the dgrad's epilogue: the gradient goes to gate_up (x's is not made).
        swiglu = combine is not None and gate_up is not None and ctx.needs_input_grad[_GATE_UP]
        needs_dx = ctx.needs_input_grad[0] or swiglu
        needs_dw = any(ctx.needs_input_grad[_FIRST_WEIGHT:])
        for i, w in enumerate(weights):
            if ctx.needs_input_grad[_FIRST_WEIGHT + i]:
                check_accumulation_weight(w, wgrad_accumulation)
                if deferred_wgrad:
                    check_deferred_weight(w)
        # A bf16 wgrad reads x itself (saved as it is); an FP8 one its wgrad form.
        fp8_wgrad = needs_dw and not bf16_wgrad
        # A deferred FP8 wgrad (the down-projection's, ops.deferred_wgrad) keeps x's FP8 rows, as on token rows.
        deferred = deferred_wgrad and swiglu and fp8_wgrad and len(weights) == 1 and not (
            isinstance(weights[0], Fp8WeightTensor) or is_stored_transposed(weights[0])
        )
        # The dgrad on token rows (w2's, down_dgrad_token_rows) needs the weight quantized along N (unfolded).
        token_rows = swiglu and down_dgrad_token_rows and not swiglu_in_dgrad and not any(
            isinstance(w, Fp8WeightTensor) for w in weights
        )
        # The FP8 wgrad on token rows too: x's FP8 rows are kept, its wgrad form made in backward.
        wgrad_token_rows = (token_rows and down_wgrad_token_rows and fp8_wgrad) or deferred
        fold_x = fold_wgrad_input_scales and fp8_wgrad and not wgrad_token_rows
        # x's wgrad form is made here (same read) only when it is to be saved.
        if x_data is not None:
            # ops.functional guarantees fold_x and save_fp8_input where a wgrad needs x.
            if fold_x:
                xq = kernels.fold_quantized_input(x_data, x_scales, offs)
            else:
                xq = QuantizedActivation(x_data, x_scales, None, None, None)
        elif fold_x and save_fp8_input:
            xq = kernels.quantize_folded_input(x, offs, quant)
        else:
            xq = kernels.quantize_activation(
                x, offs, quant, rowwise=True, wgrad=fp8_wgrad and save_fp8_input and not wgrad_token_rows
            )
        if wgrad_token_rows:
            # The rowwise form is saved in place of the wgrad form (data_t) and its scales (x_token_scales).
            saved_x, xq = None, xq._replace(data_t=xq.data)
            x_token_scales = xq.scales
        else:
            saved_x = x if needs_dw and xq.data_t is None else None
            x_token_scales = xq.scales if fold_x and xq.data_t is not None else None
        outs, saved_weights, folds = [], [], []
        for i, w in enumerate(weights):
            # Folded, the weight's dgrad form is its forward FP8 bytes transposed (one read of w) and
            # grad_out's rowwise form carries the scales; a pre-quantized weight has no other dgrad form.
            prequantized = isinstance(w, Fp8WeightTensor)
            fold = needs_dx and (prequantized or fold_dgrad_weight_scales) and not token_rows
            folds.append(fold)
            wq = quantize_weight_forms(
                kernels, w, quant, fold and save_fp8_weight, forward=True, transposed=needs_dx and save_fp8_weight,
                keep=keep_quantized_weights,
            )
            outs.append(kernels.grouped_mm(xq.data, xq.scales, wq.data, wq.scales, offs, out_dtype))
            saved_w = w if needs_dx and wq.data_t is None else None
            saved_weights += [saved_w, wq.data_t, wq.scales_t, wq.grad_multipliers]
        y = None
        if combine is not None:
            # The weights' gradient reads the combine's rows, unless the fused dgrad makes it from gate_up.
            y = None if swiglu else outs[0]
            outs = [kernel_ops.moe_combine(outs[0], combine.inverse, probs)]
        ctx.combine = combine
        # Saved: x, x^T, its scales (wgrad), x's row scales (folded wgrad), offs, the combine's rows,
        # probabilities and gate_up, then _SAVED_PER_WEIGHT per weight.
        ctx.save_for_backward(
            saved_x, xq.data_t, xq.scales_t, x_token_scales, offs, y, probs, gate_up if swiglu else None,
            *saved_weights,
        )
        ctx.quant, ctx.folds, ctx.fold_x, ctx.swiglu, ctx.swiglu_in_dgrad = quant, folds, fold_x, swiglu, swiglu_in_dgrad
        ctx.wgrad_token_rows = wgrad_token_rows
        ctx.keep, ctx.wgrad_accumulation, ctx.bf16_wgrad = keep_quantized_weights, wgrad_accumulation, bf16_wgrad
        ctx.deferred_wgrad = deferred
        # The weights themselves, for the accumulation targets (their .grad / .main_grad) and the deferred wgrad.
        ctx.weights = weights if wgrad_accumulation != "off" or deferred else None
        ctx.x_dtype, ctx.w_dtypes = x.dtype, [w.dtype for w in weights]
        ctx.stored_transposed = [not isinstance(w, Fp8WeightTensor) and is_stored_transposed(w) for w in weights]
        return tuple(outs)

    def backward(ctx, *grad_outs: Tensor) -> tuple[Tensor | None, ...]:
        swiglu = ctx.swiglu
        needs_dx = ctx.needs_input_grad[0] or swiglu
        x, xt, xt_scales, x_token_scales, offs, y, probs, gate_up, *saved_weights = ctx.saved_tensors
        combine, grad_probs, grad_gate_up = ctx.combine, None, None
        if combine is not None and ctx.needs_input_grad[_PROBS] and not swiglu:
            grad = grad_outs[0].contiguous()
            grad_probs = kernel_ops.moe_combine_grad_probs(grad, y, combine.inverse).to(probs.dtype)
        if x is not None and not ctx.bf16_wgrad:
            # x was kept as is: quantized once for every weight's wgrad.
            if ctx.fold_x:
                _, x_token_scales, xt, xt_scales, _ = kernels.quantize_folded_input(x, offs, ctx.quant)
            else:
                _, _, xt, xt_scales, _ = kernels.quantize_activation(x, offs, ctx.quant, rowwise=False, wgrad=True)
        dx, dws = None, []
        for i, grad_out in enumerate(grad_outs):
            w, wt, wt_scales, multipliers = saved_weights[_SAVED_PER_WEIGHT * i : _SAVED_PER_WEIGHT * (i + 1)]
            needs_dw = ctx.needs_input_grad[_FIRST_WEIGHT + i]
            dw = None
            if not (needs_dx or needs_dw):
                dws.append(dw)
                continue
            fold = ctx.folds[i]
            if needs_dx and wt is None:
                wq = quantize_weight_forms(kernels, w, ctx.quant, fold, forward=False, transposed=True, keep=ctx.keep)
                wt, wt_scales, multipliers = wq.data_t, wq.scales_t, wq.grad_multipliers
            # Autograd may hand over an expanded (stride-0) gradient; kernels need rows.
            grad_out = grad_out.contiguous()
            fp8_wgrad = needs_dw and not ctx.bf16_wgrad
            # The deferred wgrad's forms are made from its kept inputs (below): the dgrad's alone here.
            deferred = fp8_wgrad and ctx.deferred_wgrad
            fp8_wgrad = fp8_wgrad and not deferred
            token_multipliers = x_token_scales if fp8_wgrad else None
            goq = None
            token_rows = swiglu and not fold  # the forward chose the dgrad on token rows (down_dgrad_token_rows)
            if swiglu:
                # The dgrad's rows are the combine's gradient rows before their weights (SwiGLU's backward
                # applies them), read by index; the FP8 wgrad's columns, or the bf16 wgrad's rows, are weighted.
                pair_weights = probs.reshape(-1)[combine.order].float()
                row_multipliers = multipliers if fold else None
                if token_rows:
                    # Each token's row once, rowwise (its scale is the token's): the dgrad reads it by index.
                    pairs = (combine.pair_tokens, pair_weights)
                    goq = kernels.quantize_token_grad_output(
                        grad_out, pairs, offs, ctx.quant, token_multipliers, fp8_wgrad and not ctx.wgrad_token_rows
                    )
                    if ctx.wgrad_token_rows and fp8_wgrad:
                        # xt holds x's rowwise FP8 rows and x_token_scales their scales (see forward).
                        goq_t, xq_t = kernels.token_rows_wgrad_operands(
                            goq, pairs, QuantizedActivation(xt, x_token_scales, None, None, None), offs, ctx.quant
                        )
                        goq = goq._replace(data_t=goq_t.data_t, scales_t=goq_t.scales_t)
                        xt, xt_scales = xq_t.data_t, xq_t.scales_t
                elif fp8_wgrad:
                    pairs = (combine.pair_tokens, pair_weights)
                    goq = kernels.quantize_combined_grad_output(
                        grad_out, pairs, offs, ctx.quant, row_multipliers, token_multipliers, weight_rows=False
                    )
                else:
                    goq = kernels.quantize_pair_grad_rows(grad_out, combine.pair_tokens, offs, ctx.quant, row_multipliers)
                if needs_dw and not fp8_wgrad and not deferred:  # the bf16 wgrad reads the combine's rows written out
                    grad_out = kernel_ops.moe_combine_grad_rows(grad_out, combine.order, probs)
            elif combine is not None and needs_dx and fold and token_multipliers is not None:
                # Both forms of the combine's gradient rows, read by index: no (T * k, N) rows written out.
                pairs = (combine.pair_tokens, probs.reshape(-1)[combine.order].float())
                goq = kernels.quantize_combined_grad_output(
                    grad_out, pairs, offs, ctx.quant, multipliers, token_multipliers
                )
            if goq is None:
                if combine is not None:  # the combine's gradient rows, written out
                    grad_out = kernel_ops.moe_combine_grad_rows(grad_out, combine.order, probs)
                if fold or token_multipliers is not None:
                    goq = kernels.quantize_folded_grad_output(
                        grad_out, offs, ctx.quant, needs_dx, multipliers if fold else None, token_multipliers, fp8_wgrad
                    )
                elif needs_dx or fp8_wgrad:
                    goq = kernels.quantize_activation(grad_out, offs, ctx.quant, rowwise=needs_dx, wgrad=fp8_wgrad)
            if swiglu:
                if ctx.swiglu_in_dgrad:
                    grad_gate_up, pair_weight_grads = kernels.grouped_mm_swiglu_backward(
                        goq, wt, wt_scales, offs, gate_up, pair_weights
                    )
                else:
                    if token_rows:
                        unit_grad_h = kernels.grouped_mm_token_rows(
                            goq.data, goq.scales, combine.pair_tokens, wt, wt_scales, offs, ctx.x_dtype
                        )
                    else:
                        unit_grad_h = kernels.grouped_mm(goq.data, goq.scales, wt, wt_scales, offs, ctx.x_dtype)
                    grad_gate_up, pair_weight_grads = kernel_ops.swiglu_backward_weighted(
                        unit_grad_h, gate_up, pair_weights
                    )
                if ctx.needs_input_grad[_PROBS]:
                    grad_probs = pair_weight_grads[combine.inverse].to(probs.dtype)
            elif needs_dx:
                dx_i = kernels.grouped_mm(goq.data, goq.scales, wt, wt_scales, offs, ctx.x_dtype)
                dx = dx_i if dx is None else dx + dx_i
            if deferred:
                # x's FP8 rows (xt) and their scales were kept (forward); the token-row wgrad forms are made in
                # ops.run_deferred_wgrads over every micro-batch, or here where the wgrad cannot be deferred.
                inputs = DownProjectionWgradInputs(
                    grad_out, combine.pair_tokens, pair_weights, xt, x_token_scales, offs
                )
                if defers(ctx.weights[i]):
                    defer_wgrad(
                        (ctx.weights[i],), [True], kernels, ctx.quant, ctx.wgrad_accumulation, inputs
                    )
                    dws.append(None)
                    continue
                goq, xq = inputs.wgrad_operands(kernels, ctx.quant, [True])[0]
                xt, xt_scales = xq.data_t, xq.scales_t
            if needs_dw:
                xq = QuantizedActivation(None, None, xt, xt_scales, None)

                def gemm(out: Tensor | None, out_dtype: torch.dtype, goq=goq, xq=xq, grad_out=grad_out) -> Tensor:
                    if ctx.bf16_wgrad:
                        return grouped_mm_wgrad_bf16(grad_out, x, offs, out_dtype, out=out)
                    if out is None:
                        return kernels.grouped_mm_wgrad(goq, xq, offs, out_dtype)
                    kernels.grouped_mm_wgrad_accumulate(goq, xq, offs, out)
                    return out

                if ctx.stored_transposed[i]:
                    # The weight is stored (E, K, N): dW^T from the same GEMM with its operands swapped, so
                    # the parameter's gradient is made in its own layout (no transposing copy of dW).
                    if ctx.bf16_wgrad:
                        dw = grouped_mm_wgrad_bf16(x, grad_out, offs, ctx.w_dtypes[i])
                    else:
                        dw = kernels.grouped_mm_wgrad(xq, goq, offs, ctx.w_dtypes[i])
                    dw = dw.transpose(-2, -1)
                elif ctx.weights is None:
                    dw = gemm(None, ctx.w_dtypes[i])
                else:
                    dw = accumulate_wgrad(ctx.weights[i], ctx.wgrad_accumulation, gemm)
            dws.append(dw)
        return (dx, *([None] * (_PROBS - 1)), grad_probs, grad_gate_up, *([None] * (_FIRST_WEIGHT - _GATE_UP - 1)), *dws)

    namespace = {
        "forward": staticmethod(forward),
        "backward": staticmethod(backward),
        "kernels": kernels,
        "__doc__": f"The FP8 grouped linear's autograd with {type(kernels).__name__}: see {__name__}.",
    }
    return type(name, (torch.autograd.Function,), namespace)


def register_grouped_linear(
    recipe_name: str, function: type[torch.autograd.Function], options_type: type | None = None
) -> None:
    """Register ``function`` (from ``grouped_linear_function``) as recipe ``recipe_name``'s grouped linear(s).

    Both entries of ``ops.recipes``: one weight, and several weights sharing ``x``.
    Inputs reach them validated by ``ops.functional``. ``options_type``: the type of the
    recipe's own options (``Fp8Recipe.options``), ``None`` if it has none.
    """
    kernels: RecipeKernels = function.kernels

    def grouped_linears(
        x: Tensor,
        weights: Sequence[Tensor],
        offs: Tensor,
        recipe: Fp8Recipe,
        out_dtype: torch.dtype,
        x_fp8: tuple[Tensor, Tensor] | None = None,
        combine: tuple[CombineRouting, Tensor] | tuple[CombineRouting, Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, ...]:
        # combine = (routing, probs[, gate_up]): the one output is the MoE combine of x @ w[g]^T
        # (grouped_linear_function; with gate_up, x is SwiGLU of it and the gradient goes there).
        for w in weights:
            kernels.check_weight(w)
        routing, probs, gate_up = (None, None, None) if combine is None else (*combine, None)[:3]
        quant = kernels.quant_options(recipe)
        x_data, x_scales = (None, None) if x_fp8 is None else x_fp8
        combine_needs_grad = any(t is not None and t.requires_grad for t in (probs, gate_up))
        if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights) or combine_needs_grad):
            needs_dw = any(w.requires_grad for w in weights)
            bf16_wgrad = needs_dw and all(
                resolve_wgrad_precision(recipe, x, x.shape[0], offs.shape[0], w.shape[-2], x_data is None)
                for w in weights
            )
            token_rows = resolve_down_dgrad_token_rows(
                recipe, x, x.shape[0], offs.shape[0], fp8_wgrad=needs_dw and not bf16_wgrad
            )
            return function.apply(
                x, x_data, x_scales, offs, quant, out_dtype, recipe.save_fp8_input, recipe.save_fp8_weight,
                recipe.fold_dgrad_weight_scales, recipe.fold_wgrad_input_scales, recipe.keep_quantized_weights,
                recipe.wgrad_accumulation, bf16_wgrad, routing, probs, gate_up, recipe.fused_swiglu_backward,
                token_rows, recipe.down_wgrad_token_rows, recipe.deferred_wgrad, *weights,
            )
        # Inference: no wgrad or dgrad forms, nothing saved.
        if x_data is None:
            x_data, x_scales, *_ = kernels.quantize_activation(x, offs, quant, rowwise=True, wgrad=False)
        outs = []
        for w in weights:
            wq = quantize_weight_forms(
                kernels, w, quant, fold=False, forward=True, transposed=False, keep=recipe.keep_quantized_weights
            )
            outs.append(kernels.grouped_mm(x_data, x_scales, wq.data, wq.scales, offs, out_dtype))
        if routing is not None:
            outs = [kernel_ops.moe_combine(outs[0], routing.inverse, probs)]
        return tuple(outs)

    def grouped_linear(x: Tensor, w: Tensor, offs: Tensor, recipe: Fp8Recipe, out_dtype: torch.dtype) -> Tensor:
        return grouped_linears(x, (w,), offs, recipe, out_dtype)[0]

    register_shared_input(recipe_name)(grouped_linears)
    register_recipe(recipe_name, options_type)(grouped_linear)
