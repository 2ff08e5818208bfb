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

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kernels_helion.fp8_format import FP8_DTYPES
from kernels_helion.mx_format import check_rounding
from kernels_helion.validation import check_out_dtype
from ops.down_dgrad_token_rows import check_down_dgrad_token_rows
from ops.grad_accumulation import check_wgrad_accumulation
from ops.wgrad_precision import check_wgrad_precision

GroupedLinearImpl = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, "Fp8Recipe", torch.dtype], torch.Tensor
]

SharedInputImpl = Callable[
    [torch.Tensor, Sequence[torch.Tensor], torch.Tensor, "Fp8Recipe", torch.dtype], tuple[torch.Tensor, ...]
]

_IMPLEMENTATIONS: dict[str, GroupedLinearImpl] = {}
_SHARED_INPUT_IMPLEMENTATIONS: dict[str, SharedInputImpl] = {}
# Recipe name -> the type of its own options (``Fp8Recipe.options``); absent: it has none.
_OPTION_TYPES: dict[str, type] = {}


def register_recipe(name: str, options_type: type | None = None) -> Callable[[GroupedLinearImpl], GroupedLinearImpl]:
    """Decorator registering the grouped-linear implementation of recipe ``name``.

    ``options_type``: the (frozen dataclass) type of the recipe's own options, built with
    its defaults when an ``Fp8Recipe`` gives none; ``None``: the recipe has no options.
    """

    def decorator(impl: GroupedLinearImpl) -> GroupedLinearImpl:
        if name in _IMPLEMENTATIONS:
            raise ValueError(f"recipe {name!r} is already registered")
        _IMPLEMENTATIONS[name] = impl
        if options_type is not None:
            _OPTION_TYPES[name] = options_type
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


def check_recipe_name(recipe: object, option: str) -> str:
    """``recipe`` if it names a registered ``ops.Fp8Recipe``; else a ``ValueError`` naming ``option``."""
    names = registered_recipes()
    if not isinstance(recipe, str) or recipe not in names:
        raise ValueError(f"{option} must be one of {list(names)} (an ops.Fp8Recipe name), got {recipe!r}")
    return recipe


def recipe_implementation(recipe: Fp8Recipe) -> GroupedLinearImpl:
    """The grouped-linear implementation of ``recipe``."""
    return _IMPLEMENTATIONS[recipe.name]


@dataclass(frozen=True)
class RowwiseOptions:
    """The ``"rowwise"`` recipe's own options.

    Attributes:
        fold_dgrad_weight_scales: dgrad multiplies ``grad_out`` times the forward weight
            scales (per expert and output column), quantized rowwise, by the forward FP8
            weight stored transposed, instead of ``grad_out`` by the weight quantized again
            along ``N``: ``w`` is read once instead of twice (the FP8 bytes are then copied
            transposed): the layer takes 0.96-1.01x the time on the H200
            (``benchmarks.fold_ab --fold dgrad``). Equal in exact arithmetic; a different
            rounding (about as accurate). Applies to a weight whenever ``dx`` is computed.
        fold_wgrad_input_scales: wgrad multiplies ``grad_out`` times the forward's row
            scales of ``x`` (one per token), quantized per (group, column), by the forward's
            rowwise FP8 ``x`` copied transposed (``transpose_to_token_groups``), instead of
            ``grad_out`` by ``x`` quantized again per (group, column): ``x`` is read once in
            bf16 instead of twice (``benchmarks.fold_ab --fold wgrad``: 0.95-1.00x the
            layer's time on the H200). Equal in exact arithmetic; a different rounding
            (about as accurate). A NaN or Inf in a row of ``x`` reaches its whole group's
            ``dW`` (through that token's scale), not only the columns it sits in. Applies
            when a ``dW`` is computed.
        fused_experts: SwiGLU experts (``ops.Fp8GroupedExperts``, and through it ``ops.MoE``)
            run their up-projection as fused kernels (``ops.moe_fused``): each token quantized
            once and read by index inside the GEMM, ``w1`` and ``w3`` in one GEMM with SwiGLU
            in its epilogue, one dgrad over both. Needs both folds; with either off the
            experts run the unfused path (three grouped linears and eager SwiGLU).
        fused_swiglu_backward: with ``fused_experts``, SwiGLU's backward and the routing
            weights' gradient, which ``ops.MoE``'s down-projection backward runs after its dgrad
            (``kernels_helion.swiglu.swiglu_backward_weighted``), run in the dgrad's epilogue
            instead (``kernels_helion.grouped_gemm_swiglu_backward``): ``h``'s gradient is not
            written, the bytes saved for backward are the same, and the speed on the H200 is
            1.00x / 0.95x at Qwen3-30B-like 8192 / 32768 tokens (its epilogue holds the
            ``gate``/``up`` tiles, which caps its tile at 128x64: ``benchmarks.moe_layer``,
            ``docs/performance.md``). Off by default. It applies where the experts take the
            combine (``ops.MoE`` on its GPU); under expert parallelism the combine follows the
            token return and SwiGLU's backward runs in the up-projection's.
        wgrad_accumulation: where an expert weight's gradient goes (``ops.grad_accumulation``):
            ``"off"`` returns it to autograd, which adds it to ``.grad`` in a separate pass;
            ``"grad"`` adds it into ``w.grad`` inside the wgrad GEMM's epilogue; ``"main_grad"``
            into an fp32 ``w.main_grad`` (Megatron-LM's form). Off by default: the
            ``benchmarks.moe_layer`` four-micro-batch column measures where it pays.
        down_dgrad_token_rows: with ``fused_experts``, the form of the down-projection's (``w2``'s)
            dgrad where the experts take the combine (``ops.MoE`` on its GPU; under expert
            parallelism the combine follows the token return and this does not apply;
            ``ops.down_dgrad_token_rows``). ``True``: the dgrad reads the output gradient's ``T``
            token rows, each quantized rowwise once (a rowwise scale belongs to its token), by index
            inside the GEMM, against ``w2`` quantized along ``N`` (the dgrad unfolded, as with
            ``fold_dgrad_weight_scales=False``); the FP8 wgrad then reads the token rows too
            (``down_wgrad_token_rows``), or takes the per-group column form of the ``T * k`` pair
            rows, made without their rowwise form. ``False`` (folded): the
            ``T * k`` pair rows are quantized rowwise with ``w2``'s forward scales multiplied in,
            and the dgrad takes ``w2``'s forward FP8 bytes copied transposed. ``"auto"`` (default):
            token rows on Hopper with the FP8 wgrad at ``TOKEN_ROWS_MIN_ROWS_PER_GROUP`` (2048) rows
            per expert and more, where they measured faster, else folded. A weight that arrives
            quantized (``ops.Fp8WeightTensor``) and ``fused_swiglu_backward`` keep the folded form.
        down_wgrad_token_rows: where ``w2``'s dgrad reads token rows and its wgrad is FP8, the wgrad
            reads them too: its gradient operand is the token rows' FP8 bytes gathered into the
            padded token layout (``transpose_to_token_groups(..., rows=)``), and ``h``'s FP8 rows,
            times each pair's probability, token scale and row scale, are quantized per (group,
            column) (``quantize_rowwise_cols_grouped`` on FP8 rows). The two passes then run over
            ``T * k`` rows of ``H`` instead of ``D`` (``H < D`` in the fine-grained MoEs), and ``h``
            is not copied into the token layout in forward. Equal in exact arithmetic; ``h`` is
            rounded to FP8 twice (``dW``'s SQNR against the bf16 layer 23.6 dB instead of 23.7). On
            by default: on an H100, 1.019-1.024x the layer's speed at Qwen3-30B-like 32768 tokens
            and 1.018-1.032x at DeepSeek-V3-like 32 experts, two runs (``benchmarks/results/
            wgrad_token_rows*/``). ``False``: the pair rows' per-group column form, from two passes
            over the gathered gradient rows.
        deferred_wgrad: with ``fused_experts``, the experts' (``w1``, ``w3``, ``w2``) FP8 wgrads run
            once per optimizer step over every micro-batch's pairs, in ``ops.run_deferred_wgrads(model)``
            after the last backward, instead of once per micro-batch (``ops.deferred_wgrad``): each
            gradient is written once a step. Until that call their ``.grad`` / ``main_grad`` lack the
            deferred micro-batches; an ``optimizer.step()`` before it raises. Off by default: on an
            H100, 4 micro-batches with ``dW`` into ``.grad``, 1.76x bf16 instead of 1.30x at
            DeepSeek-V3-like 256 experts, 1.24x instead of 1.39x at Qwen3-30B-like 32768 tokens
            (``benchmarks/results/deferred_wgrad/``). Refused under FSDP2; not for DDP.
    """

    fold_dgrad_weight_scales: bool = True
    fold_wgrad_input_scales: bool = True
    fused_experts: bool = True
    fused_swiglu_backward: bool = False
    wgrad_accumulation: str = "off"
    down_dgrad_token_rows: bool | str = "auto"
    down_wgrad_token_rows: bool = True
    deferred_wgrad: bool = False

    def __post_init__(self) -> None:
        for flag in (
            "fold_dgrad_weight_scales", "fold_wgrad_input_scales", "fused_experts", "fused_swiglu_backward",
            "down_wgrad_token_rows", "deferred_wgrad",
        ):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        check_wgrad_accumulation(self.wgrad_accumulation)
        check_down_dgrad_token_rows(self.down_dgrad_token_rows)


@dataclass(frozen=True)
class MxOptions:
    """The ``"mxfp8"`` recipe's own options.

    Attributes:
        rounding: how the e8m0 block scales are rounded: ``"rceil"`` (amax / 448 rounded
            up to a power of two, nothing saturates) or ``"floor"`` (the OCP MX spec's);
            see ``kernels_helion.mx_format``.
    """

    rounding: str = "rceil"

    def __post_init__(self) -> None:
        check_rounding(self.rounding, "rounding")


@dataclass(frozen=True, init=False)
class Fp8Recipe:
    """How the FP8 grouped linear quantizes and what it saves for backward.

    Attributes:
        name: scaling granularity; ``"rowwise"`` (one scale per row of each GEMM
            operand along its contraction dimension, per expert group for wgrad);
            ``"blockwise"`` (DeepSeek-V3: activations and gradients per 1x128 block
            along the contraction, weights per 128x128 block, wgrad operands per
            128x1 block within each group; ``ops.autograd_blockwise``); ``"mxfp8"``
            (OCP MXFP8: one e8m0 scale per 32 elements along each GEMM's contraction,
            elements float8_e4m3fn only; ``ops.autograd_mx``).
        float8_dtype: ``torch.float8_e4m3fn`` (NVIDIA) or ``torch.float8_e4m3fnuz`` (AMD MI300).
        round_scales_to_power_of_2: round every scale up to a power of two (scaling
            is then exact in the exponent).
        out_dtype: dtype of the forward output when the call does not give one.
        save_fp8_input: quantize ``x`` per group and column in forward and keep that
            (about half the bytes of bf16 ``x``) for wgrad, instead of keeping ``x``.
        save_fp8_weight: keep the FP8 transposed weight made in forward (with the
            forward layout) for dgrad; ``False`` re-quantizes ``w`` in
            backward instead, keeping nothing beyond the parameter itself.
        keep_quantized_weights: keep each weight's quantized forms with the weight and
            make them again only when it changes (its version counter or storage: an
            optimizer step, ``load_state_dict``, an in-place edit), so that every
            micro-batch between two optimizer steps reuses them; one byte per element
            per form stays allocated between steps (``ops.weight_reuse``). ``False``:
            quantized at every use (outside ``ops.reuse_quantized_weights()`` blocks).
        wgrad_precision: the precision of the weight gradient's GEMM (``ops.wgrad_precision``):
            ``"fp8"`` (the recipe's FP8 wgrad), ``"bf16"`` (``torch._grouped_mm`` on ``x`` and
            ``grad_out`` as they are; ``x`` is then saved for backward in its own dtype), or
            ``"auto"``: bf16 where it measured faster (the rowwise recipe on Hopper, groups
            averaging fewer than ``ops.wgrad_precision.BF16_WGRAD_MAX_ROWS_PER_GROUP`` rows), else FP8.
        options: the recipe's own options: ``RowwiseOptions`` for ``"rowwise"``,
            ``MxOptions`` for ``"mxfp8"``, ``None`` for ``"blockwise"`` (it has none).
            Left out: the recipe's defaults. A recipe's own option is set here only
            (``options=ops.RowwiseOptions(fold_dgrad_weight_scales=False)``); the
            read-only attributes ``fold_dgrad_weight_scales``, ``fold_wgrad_input_scales``,
            ``fused_experts``, ``wgrad_accumulation`` and ``mx_rounding`` read it.
    """

    name: str
    float8_dtype: torch.dtype
    round_scales_to_power_of_2: bool
    out_dtype: torch.dtype
    save_fp8_input: bool
    save_fp8_weight: bool
    keep_quantized_weights: bool
    wgrad_precision: str
    options: object

    def __init__(
        self,
        name: str = "rowwise",
        float8_dtype: torch.dtype = torch.float8_e4m3fn,
        round_scales_to_power_of_2: bool = False,
        out_dtype: torch.dtype = torch.bfloat16,
        save_fp8_input: bool = True,
        save_fp8_weight: bool = True,
        *,
        keep_quantized_weights: bool = True,
        wgrad_precision: str = "auto",
        options: object = None,
        **misplaced: object,
    ) -> None:
        if misplaced:
            raise TypeError(_misplaced_option_message(misplaced))
        if not isinstance(name, str) or name not in _IMPLEMENTATIONS:
            raise ValueError(f"recipe name must be one of {list(registered_recipes())}, got {name!r}")
        if float8_dtype not in FP8_DTYPES:
            raise TypeError(f"float8_dtype must be one of {[str(d) for d in FP8_DTYPES]}, got {float8_dtype}")
        check_out_dtype(out_dtype)
        for flag, value in (
            ("round_scales_to_power_of_2", round_scales_to_power_of_2),
            ("save_fp8_input", save_fp8_input),
            ("save_fp8_weight", save_fp8_weight),
            ("keep_quantized_weights", keep_quantized_weights),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"{flag} must be a bool, got {value!r}")
        check_wgrad_precision(wgrad_precision)
        options = _resolve_options(name, options)
        if name == "mxfp8" and float8_dtype != torch.float8_e4m3fn:
            raise TypeError(f"the mxfp8 recipe's elements are float8_e4m3fn (OCP MX), got float8_dtype={float8_dtype}")
        for field, value in (
            ("name", name),
            ("float8_dtype", float8_dtype),
            ("round_scales_to_power_of_2", round_scales_to_power_of_2),
            ("out_dtype", out_dtype),
            ("save_fp8_input", save_fp8_input),
            ("save_fp8_weight", save_fp8_weight),
            ("keep_quantized_weights", keep_quantized_weights),
            ("wgrad_precision", wgrad_precision),
            ("options", options),
        ):
            object.__setattr__(self, field, value)

    @property
    def fold_dgrad_weight_scales(self) -> bool:
        """``RowwiseOptions.fold_dgrad_weight_scales``; ``False`` for the other recipes."""
        return isinstance(self.options, RowwiseOptions) and self.options.fold_dgrad_weight_scales

    @property
    def fold_wgrad_input_scales(self) -> bool:
        """``RowwiseOptions.fold_wgrad_input_scales``; ``False`` for the other recipes."""
        return isinstance(self.options, RowwiseOptions) and self.options.fold_wgrad_input_scales

    @property
    def fused_experts(self) -> bool:
        """``RowwiseOptions.fused_experts``; ``False`` for the other recipes."""
        return isinstance(self.options, RowwiseOptions) and self.options.fused_experts

    @property
    def fused_swiglu_backward(self) -> bool:
        """``RowwiseOptions.fused_swiglu_backward``; ``False`` for the other recipes."""
        return isinstance(self.options, RowwiseOptions) and self.options.fused_swiglu_backward

    @property
    def down_dgrad_token_rows(self) -> bool | str:
        """``RowwiseOptions.down_dgrad_token_rows`` (``True``, ``False`` or ``"auto"``); ``False`` for the other recipes."""
        return isinstance(self.options, RowwiseOptions) and self.options.down_dgrad_token_rows

    @property
    def down_wgrad_token_rows(self) -> bool:
        """``RowwiseOptions.down_wgrad_token_rows``; ``False`` for the other recipes."""
        return isinstance(self.options, RowwiseOptions) and self.options.down_wgrad_token_rows

    @property
    def deferred_wgrad(self) -> bool:
        """``RowwiseOptions.deferred_wgrad``; ``False`` for the other recipes."""
        return isinstance(self.options, RowwiseOptions) and self.options.deferred_wgrad

    @property
    def wgrad_accumulation(self) -> str:
        """``RowwiseOptions.wgrad_accumulation``; ``"off"`` for the other recipes."""
        return self.options.wgrad_accumulation if isinstance(self.options, RowwiseOptions) else "off"

    @property
    def auto_wgrad_may_take_bf16(self) -> bool:
        """Whether ``wgrad_precision="auto"`` may take the bf16 wgrad (``ops.wgrad_precision``): the
        rowwise recipe, where it was measured; the blockwise and MXFP8 recipes keep their FP8 wgrad."""
        return isinstance(self.options, RowwiseOptions)

    @property
    def takes_prequantized_weights(self) -> bool:
        """Whether the grouped linear takes a weight quantized beforehand in its forward form
        (``ops.Fp8WeightTensor``: one scale per expert and row along ``K``, which a shard along ``E``
        holds whole), as FSDP2's FP8 all-gather makes it (``ops.enable_fp8_all_gather``): the rowwise recipe.
        """
        return isinstance(self.options, RowwiseOptions)

    @property
    def takes_transposed_weights(self) -> bool:
        """Whether the grouped linear takes a weight ``w (E, N, K)`` stored transposed (the
        ``transpose(-2, -1)`` view of a contiguous ``(E, K, N)`` tensor, gpt-oss's layout) as it is, its
        FP8 forms quantized as stored and its gradient made in that layout: the rowwise recipe without
        ``wgrad_accumulation`` (which adds into a weight's own ``.grad``). ``ops.fp8_grouped_mm`` copies
        other weights into ``(E, N, K)`` first.
        """
        return isinstance(self.options, RowwiseOptions) and self.wgrad_accumulation == "off"

    @property
    def takes_prequantized_rows(self) -> bool:
        """Whether the grouped linear takes ``x``'s rows quantized beforehand (``x_fp8``, as expert
        parallelism's FP8 dispatch sends them): the rowwise recipe (one scale per row of ``x``) with
        ``fold_wgrad_input_scales`` and ``save_fp8_input``, so that wgrad builds ``x^T`` from those FP8 rows,
        and a wgrad that may run in FP8 (``wgrad_precision`` other than ``"bf16"``, which needs ``x``'s values).
        """
        return self.fold_wgrad_input_scales and self.save_fp8_input and self.wgrad_precision != "bf16"

    @property
    def mx_rounding(self) -> str:
        """``MxOptions.rounding`` (the ``"mxfp8"`` recipe only)."""
        if not isinstance(self.options, MxOptions):
            raise AttributeError(f"mx_rounding is an mxfp8-recipe option; this recipe is {self.name!r}")
        return self.options.rounding


def _resolve_options(name: str, options: object) -> object:
    """Recipe ``name``'s options: ``options``, checked against its option type, or that type's defaults."""
    options_type = _OPTION_TYPES.get(name)
    if options is None:
        return options_type() if options_type is not None else None
    if options_type is None or not isinstance(options, options_type):
        expected = options_type.__name__ if options_type is not None else "None (it has no options)"
        raise TypeError(f"the {name!r} recipe's options must be {expected}, got {type(options).__name__}")
    return options


def _misplaced_option_message(keywords: dict[str, object]) -> str:
    """Why ``Fp8Recipe`` refuses ``keywords``: a recipe's own option is set through ``options=``."""
    # Keyword -> (options type, field): every option type's fields, and ``mx_rounding`` for MxOptions.rounding.
    owners = {f.name: (t, f.name) for t in _OPTION_TYPES.values() for f in dataclasses.fields(t)}
    owners["mx_rounding"] = (MxOptions, "rounding")
    keyword = next(iter(keywords))
    if keyword not in owners:
        return f"Fp8Recipe got an unexpected keyword argument {keyword!r}"
    owner, field = owners[keyword]
    return (
        f"{keyword} is a recipe's own option, set through options=ops.{owner.__name__}({field}=...), "
        f"e.g. ops.Fp8Recipe(options=ops.{owner.__name__}({field}={keywords[keyword]!r}))"
    )
