"""FP8 training recipes: a small validated config, and the registry that maps a recipe to its implementation.

A recipe says how a grouped linear is quantized (scaling granularity, FP8 dtype,
scale rounding) and what it keeps for backward. Each recipe name has one
implementation: a function ``(x, w, offs, recipe, out_dtype) -> out`` that is
differentiable in ``x`` and ``w``. A recipe may also register, with
``register_shared_input``, grouped linears of one input and several weights that
share work (``ops.fp8_grouped_linears``); without one, each weight gets its own call.
The built-in recipes register both through ``ops.grouped_linear_autograd``:
``rowwise`` in ``ops.autograd``, ``blockwise`` in ``ops.autograd_blockwise``,
``mxfp8`` in ``ops.autograd_mx``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kernels_helion.fp8_format import FP8_DTYPES
from kernels_helion.mx_format import check_rounding

GroupedLinearImpl = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, "Fp8Recipe", torch.dtype], torch.Tensor
]

OUT_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)

SharedInputImpl = Callable[
    [torch.Tensor, Sequence[torch.Tensor], torch.Tensor, "Fp8Recipe", torch.dtype], tuple[torch.Tensor, ...]
]

_IMPLEMENTATIONS: dict[str, GroupedLinearImpl] = {}
_SHARED_INPUT_IMPLEMENTATIONS: dict[str, SharedInputImpl] = {}


def register_recipe(name: str) -> Callable[[GroupedLinearImpl], GroupedLinearImpl]:
    """Decorator registering the grouped-linear implementation of recipe ``name``."""

    def decorator(impl: GroupedLinearImpl) -> GroupedLinearImpl:
        if name in _IMPLEMENTATIONS:
            raise ValueError(f"recipe {name!r} is already registered")
        _IMPLEMENTATIONS[name] = impl
        return impl

    return decorator


def register_shared_input(name: str) -> Callable[[SharedInputImpl], SharedInputImpl]:
    """Decorator registering recipe ``name``'s grouped linears of one input and several weights.

    ``(x, weights, offs, recipe, out_dtype) -> (x @ w[g]^T for w in weights)``, sharing
    what the weights can share (rowwise and blockwise quantize ``x`` once). Optional: a
    recipe without one runs its grouped linear once per weight.
    """

    def decorator(impl: SharedInputImpl) -> SharedInputImpl:
        if name in _SHARED_INPUT_IMPLEMENTATIONS:
            raise ValueError(f"recipe {name!r} already has a shared-input implementation")
        _SHARED_INPUT_IMPLEMENTATIONS[name] = impl
        return impl

    return decorator


def shared_input_implementation(recipe: Fp8Recipe) -> SharedInputImpl | None:
    """Recipe ``recipe.name``'s several-weights implementation, or ``None`` if it has none."""
    return _SHARED_INPUT_IMPLEMENTATIONS.get(recipe.name)


def registered_recipes() -> tuple[str, ...]:
    """Names of the recipes that have an implementation."""
    return tuple(sorted(_IMPLEMENTATIONS))


def recipe_implementation(recipe: Fp8Recipe) -> GroupedLinearImpl:
    """The grouped-linear implementation of ``recipe``."""
    return _IMPLEMENTATIONS[recipe.name]


@dataclass(frozen=True)
class Fp8Recipe:
    """How the FP8 grouped linear quantizes and what it saves for backward.

    Attributes:
        name: scaling granularity; ``"rowwise"`` (one scale per row of each GEMM
            operand along its contraction dimension, per expert group for wgrad);
            ``"blockwise"`` (DeepSeek-V3: activations and gradients per 1x128 block
            along the contraction, weights per 128x128 block, wgrad operands per
            128x1 block within each group; ``ops.autograd_blockwise``); ``"mxfp8"``
            (OCP MXFP8: one e8m0 scale per 32 elements along each GEMM's contraction;
            ``ops.autograd_mx``).
        float8_dtype: ``torch.float8_e4m3fn`` (NVIDIA) or ``torch.float8_e4m3fnuz`` (AMD MI300).
        round_scales_to_power_of_2: round every scale up to a power of two (scaling
            is then exact in the exponent).
        out_dtype: dtype of the forward output when the call does not give one.
        save_fp8_input: quantize ``x`` per group and column in forward and keep that
            (about half the bytes of bf16 ``x``) for wgrad, instead of keeping ``x``.
        save_fp8_weight: keep the FP8 transposed weight made in forward (with the
            forward layout) for dgrad; ``False`` re-quantizes ``w`` in
            backward instead, keeping nothing beyond the parameter itself.
        fold_dgrad_weight_scales: ``"rowwise"`` only; ``None`` (default) means ``True``
            for ``"rowwise"`` and ``False`` for the others. Dgrad multiplies ``grad_out``
            times the forward weight scales (per expert and output column), quantized
            rowwise, by the forward FP8 weight stored transposed, instead of
            ``grad_out`` by the weight quantized again along ``N``: ``w`` is read once
            instead of twice (the FP8 bytes are then copied transposed): the layer takes
            0.96-1.01x the time on the H200 (``benchmarks.fold_ab --fold dgrad``). Equal in
            exact arithmetic; a different rounding (about as accurate). Applies to a
            weight when ``dx`` and its ``dW`` are both computed.
        fold_wgrad_input_scales: ``"rowwise"`` only; ``None`` (default) means ``True``
            for ``"rowwise"`` and ``False`` for the others. Wgrad multiplies ``grad_out``
            times the forward's row scales of ``x`` (one per token), quantized per
            (group, column), by the forward's rowwise FP8 ``x`` copied transposed
            (``transpose_to_token_groups``), instead of ``grad_out`` by ``x`` quantized
            again per (group, column): ``x`` is read once in bf16 instead of twice
            (``benchmarks.fold_ab --fold wgrad``: 0.95-1.00x the layer's time on the H200).
            Equal in exact arithmetic; a different rounding (about as accurate). A NaN or
            Inf in a row of ``x`` reaches its whole group's ``dW`` (through that token's
            scale), not only the columns it sits in. Applies when a ``dW`` is computed.
        mx_rounding: how the ``"mxfp8"`` recipe rounds its e8m0 block scales:
            ``"rceil"`` (amax / 448 rounded up to a power of two, nothing saturates)
            or ``"floor"`` (the OCP MX spec's); see ``kernels_helion.mx_format``.
            MXFP8 elements are float8_e4m3fn only.
    """

    name: str = "rowwise"
    float8_dtype: torch.dtype = torch.float8_e4m3fn
    round_scales_to_power_of_2: bool = False
    out_dtype: torch.dtype = torch.bfloat16
    save_fp8_input: bool = True
    save_fp8_weight: bool = True
    fold_dgrad_weight_scales: bool | None = None
    fold_wgrad_input_scales: bool | None = None
    mx_rounding: str = "rceil"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or self.name not in _IMPLEMENTATIONS:
            raise ValueError(
                f"recipe name must be one of {list(registered_recipes())}, got {self.name!r}"
            )
        if self.float8_dtype not in FP8_DTYPES:
            raise TypeError(
                f"float8_dtype must be one of {[str(d) for d in FP8_DTYPES]}, got {self.float8_dtype}"
            )
        if self.out_dtype not in OUT_DTYPES:
            raise TypeError(f"out_dtype must be one of {[str(d) for d in OUT_DTYPES]}, got {self.out_dtype}")
        folds = ("fold_dgrad_weight_scales", "fold_wgrad_input_scales")
        for fold in folds:
            if getattr(self, fold) is None:
                # Frozen: the resolved default is set once, here.
                object.__setattr__(self, fold, self.name == "rowwise")
        for flag in ("round_scales_to_power_of_2", "save_fp8_input", "save_fp8_weight", *folds):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        for fold in folds:
            if getattr(self, fold) and self.name != "rowwise":
                raise ValueError(
                    f"{fold} is a rowwise-recipe option (its scales are one per row of an operand), got name={self.name!r}"
                )
        check_rounding(self.mx_rounding, "mx_rounding")
        if self.name == "mxfp8" and self.float8_dtype != torch.float8_e4m3fn:
            raise TypeError(
                f"the mxfp8 recipe's elements are float8_e4m3fn (OCP MX), got float8_dtype={self.float8_dtype}"
            )

