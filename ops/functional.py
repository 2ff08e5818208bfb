"""Functional FP8 grouped GEMMs for MoE experts, differentiable in the input and the weights.

``fp8_grouped_linear(x, w, offs)``: ``w`` is ``(E, N, K)``, each expert an
``nn.Linear`` weight (``out = x @ w[g]^T``); ``fp8_grouped_linears(x, (w1, w3), offs)``
applies several such weights to the same tokens, quantizing ``x`` once. ``fp8_grouped_mm(a, b, offs=...)``
takes ``torch._grouped_mm``'s arguments, so ``torch._grouped_mm(x,
w.transpose(-2, -1), offs=offs)`` becomes ``fp8_grouped_mm(x, w.transpose(-2, -1),
offs=offs)``.

Every input is checked here, before any kernel launches; offsets' *values* are
not (that would sync with the host): kernels clamp them into ``[0, M]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

import ops.autograd  # noqa: F401  (registers the rowwise recipe)
from kernels_helion.validation import (
    FLOAT_INPUT_DTYPES,
    check_offsets,
    check_out_dtype,
    check_same_device,
    check_scales,
    check_tensor,
)
from kernels_helion.quantize_rowwise_weights import check_weight_layout
from ops.fp8_weight import Fp8WeightTensor
from ops.recipes import Fp8Recipe, recipe_implementation, shared_input_implementation

# FP8 rows of x (M, K), w (E, N, K) and its transpose (E, K, N) start on 16-byte
# boundaries, as TMA and the FP8 tensor-core loads need: K and N multiples of 16.
DIM_ALIGNMENT = 16

DEFAULT_RECIPE = Fp8Recipe()


def _check_grouped_linear_inputs(
    x: object, w: object, offs: object, recipe: object, out_dtype: object, x_contiguous: bool = True
) -> None:
    check_tensor("x", x, ndim=2, dtypes=FLOAT_INPUT_DTYPES, contiguous=x_contiguous)
    check_tensor("w", w, ndim=3, dtypes=FLOAT_INPUT_DTYPES, contiguous=False, subclasses=(Fp8WeightTensor,))
    assert isinstance(x, Tensor) and isinstance(w, Tensor)
    check_weight_layout(w, isinstance(recipe, Fp8Recipe) and recipe.takes_transposed_weights)
    check_same_device("w", w, x.device)
    offs = check_offsets(offs, x.device)
    if not isinstance(recipe, Fp8Recipe):
        raise TypeError(f"recipe must be an ops.Fp8Recipe, got {type(recipe).__name__}")
    if isinstance(w, Fp8WeightTensor):
        _check_prequantized_weight(w, recipe)
    check_out_dtype(out_dtype)
    if recipe.float8_dtype == torch.float8_e4m3fnuz and torch.version.hip is None:
        raise TypeError("recipe.float8_dtype float8_e4m3fnuz needs a ROCm build of PyTorch; use float8_e4m3fn")
    num_experts, n, k = w.shape
    if offs.shape[0] != num_experts:
        raise ValueError(
            f"offs must hold one group end per expert: shape ({num_experts},) for w of shape "
            f"{tuple(w.shape)}, got {tuple(offs.shape)}"
        )
    if x.shape[1] != k:
        raise ValueError(f"x.shape[1] (K={x.shape[1]}) must equal w.shape[2] (K={k})")
    for name, size in (("K", k), ("N", n)):
        if size == 0 or size % DIM_ALIGNMENT:
            raise ValueError(
                f"{name}={size} must be a positive multiple of {DIM_ALIGNMENT} "
                "(FP8 rows must start on 16-byte boundaries)"
            )


def _check_prequantized_weight(w: Fp8WeightTensor, recipe: Fp8Recipe) -> None:
    """A weight gathered in FP8 must be in the form ``recipe`` would have made."""
    if not recipe.takes_prequantized_weights:
        raise ValueError(
            "w is an FP8-gathered weight (rowwise form), which only a recipe with takes_prequantized_weights (the "
            f"rowwise recipe) takes; got recipe {recipe.name!r}"
        )
    expected = (recipe.float8_dtype, recipe.round_scales_to_power_of_2)
    if tuple(w.quant) != expected:
        raise ValueError(
            f"w was quantized with (float8_dtype, round_scales_to_power_of_2) = {tuple(w.quant)}, but the recipe "
            f"asks for {expected}: enable FP8 all-gather with the module's recipe"
        )


def fp8_grouped_linear(
    x: Tensor,
    w: Tensor,
    offs: Tensor,
    recipe: Fp8Recipe = DEFAULT_RECIPE,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """Per-expert linear layers in FP8: ``out[rows of g] = x[rows of g] @ w[g]^T``.

    Args:
        x: ``(M, K)`` bf16/fp16/fp32, contiguous, tokens sorted by expert.
        w: ``(E, N, K)`` bf16/fp16/fp32, contiguous (``nn.Linear`` layout per expert), or an
            ``ops.Fp8WeightTensor`` (already quantized, rowwise recipe: FSDP2's FP8 all-gather), or,
            with a recipe that ``takes_transposed_weights``, the ``transpose(-2, -1)`` view of a
            contiguous ``(E, K, N)`` tensor (read as stored; its gradient comes in that layout).
        offs: ``(E,)`` int32, cumulative group ends (as ``torch._grouped_mm``);
            rows past ``offs[-1]`` get 0 in the output and in ``dx``.
        recipe: an ``ops.Fp8Recipe``; rowwise by default.
        out_dtype: output dtype; ``recipe.out_dtype`` (bf16) when ``None``.

    Returns:
        ``(M, N)`` in ``out_dtype``, differentiable in ``x`` and ``w``.
    """
    out_dtype = recipe.out_dtype if out_dtype is None and isinstance(recipe, Fp8Recipe) else out_dtype
    _check_grouped_linear_inputs(x, w, offs, recipe, out_dtype)
    return recipe_implementation(recipe)(x, w, offs, recipe, out_dtype)


def _check_quantized_rows(x: Tensor, x_fp8: object, recipe: Fp8Recipe) -> tuple[Tensor, Tensor]:
    """Check ``x_fp8 = (data, scales)``: ``x``'s rows quantized rowwise with ``recipe``'s options."""
    if not recipe.takes_prequantized_rows:
        raise ValueError(
            "x_fp8 (pre-quantized rows) needs a recipe with takes_prequantized_rows: the rowwise recipe with "
            "fold_wgrad_input_scales=True, save_fp8_input=True and wgrad_precision other than 'bf16' (the wgrad's "
            "x^T is built from the FP8 rows, and there is no bf16 x to quantize again or to read); got recipe "
            f"{recipe.name!r}, options {recipe.options}, save_fp8_input={recipe.save_fp8_input}, "
            f"wgrad_precision={recipe.wgrad_precision!r}"
        )
    if not isinstance(x_fp8, (tuple, list)) or len(x_fp8) != 2:
        raise TypeError("x_fp8 must be a pair (data, scales) of x's FP8 rows and their float32 row scales")
    data, scales = x_fp8
    check_tensor("x_fp8 data", data, ndim=2, dtypes=(recipe.float8_dtype,))
    check_same_device("x_fp8 data", data, x.device)
    if tuple(data.shape) != tuple(x.shape):
        raise ValueError(f"x_fp8 data must have x's shape {tuple(x.shape)}, got {tuple(data.shape)}")
    check_scales("x_fp8 scales", scales, (x.shape[0],), x.device)
    return data, scales


def fp8_grouped_linears(
    x: Tensor,
    weights: Sequence[Tensor],
    offs: Tensor,
    recipe: Fp8Recipe = DEFAULT_RECIPE,
    out_dtype: torch.dtype | None = None,
    *,
    x_fp8: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, ...]:
    """``fp8_grouped_linear(x, w, offs)`` for each ``w`` of ``weights``, sharing work on ``x``.

    For several expert weights applied to the same tokens, such as SwiGLU's gate
    and up projections (``w1``, ``w3``). The built-in recipes quantize ``x`` once
    for all of them and keep one FP8 ``x^T`` for their wgrads; a recipe registered
    without a shared-input implementation runs one grouped linear per weight.
    Arguments as ``fp8_grouped_linear``; each weight may have its own ``N``.

    ``x_fp8 = (data, scales)``: ``x``'s rows already quantized by the rowwise recipe
    (``torch.ops.fp8moe.quantize_rowwise_rows(x, recipe.float8_dtype,
    recipe.round_scales_to_power_of_2)``, e.g. before an expert-parallel all-to-all):
    the GEMMs read them instead of quantizing ``x``, whose values are then never read
    (it may be any ``(M, K)`` tensor of x's dtype, even an expanded one: the anchor
    that receives ``dx``). Needs a recipe with ``takes_prequantized_rows`` (the rowwise
    recipe with ``fold_wgrad_input_scales`` and ``save_fp8_input``, its wgrad not fixed to
    bf16: the wgrad's ``x^T`` comes from the FP8 rows).

    Returns:
        One ``(M, N_i)`` output per weight, differentiable in ``x`` and the weights.
    """
    out_dtype = recipe.out_dtype if out_dtype is None and isinstance(recipe, Fp8Recipe) else out_dtype
    if isinstance(weights, Tensor) or not isinstance(weights, Sequence) or not weights:
        raise TypeError("weights must be a non-empty sequence of (E, N, K) tensors")
    for w in weights:
        _check_grouped_linear_inputs(x, w, offs, recipe, out_dtype, x_contiguous=x_fp8 is None)
    shared = shared_input_implementation(recipe)
    if x_fp8 is not None:
        assert shared is not None  # the rowwise recipe has one
        return tuple(shared(x, tuple(weights), offs, recipe, out_dtype, _check_quantized_rows(x, x_fp8, recipe)))
    if shared is None:
        single = recipe_implementation(recipe)
        return tuple(single(x, w, offs, recipe, out_dtype) for w in weights)
    return tuple(shared(x, tuple(weights), offs, recipe, out_dtype))


def fp8_grouped_mm(
    mat_a: Tensor,
    mat_b: Tensor,
    offs: Tensor | None = None,
    bias: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    recipe: Fp8Recipe = DEFAULT_RECIPE,
) -> Tensor:
    """Drop-in FP8 replacement of ``torch._grouped_mm`` for the MoE case (2-D x 3-D with ``offs``).

    Args:
        mat_a: ``(M, K)`` tokens sorted by expert.
        mat_b: ``(E, K, N)``: ``w.transpose(-2, -1)`` of a contiguous ``(E, N, K)`` weight, or of an
            ``ops.Fp8WeightTensor`` (FSDP2's FP8 all-gather; its FP8 parts are used as they are), or,
            with a recipe that ``takes_transposed_weights``, contiguous itself (gpt-oss's layout: read as
            stored, its gradient made in that layout); any other layout is copied into ``(E, N, K)`` first.
        offs: ``(E,)`` int32 cumulative group ends (required).
        bias: not supported (must be ``None``), as in ``torch._grouped_mm`` on CUDA.
        out_dtype: output dtype; ``recipe.out_dtype`` (bf16) when ``None``.
        recipe: an ``ops.Fp8Recipe``.

    Returns:
        ``(M, N)``, differentiable in ``mat_a`` and ``mat_b``.
    """
    if offs is None:
        raise ValueError("offs is required: fp8_grouped_mm supports 2-D mat_a x 3-D mat_b with offsets")
    if bias is not None:
        raise ValueError("bias is not supported by fp8_grouped_mm; add it after the GEMM")
    check_tensor("mat_a", mat_a, ndim=2, dtypes=FLOAT_INPUT_DTYPES)
    check_tensor("mat_b", mat_b, ndim=3, dtypes=FLOAT_INPUT_DTYPES, contiguous=False, subclasses=(Fp8WeightTensor,))
    w = mat_b.transpose(-2, -1)
    if not (w.is_contiguous() or (isinstance(recipe, Fp8Recipe) and recipe.takes_transposed_weights and mat_b.is_contiguous())):
        w = w.contiguous()
    return fp8_grouped_linear(mat_a, w, offs, recipe, out_dtype)
