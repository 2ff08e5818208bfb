"""FP8 token dispatch for torchtitan 0.3's expert parallelism.

``Fp8AllToAllTokenDispatcher`` is torchtitan's standard ``AllToAllTokenDispatcher`` (its
``moe_comm_backend="standard"``) whose dispatch all-to-all moves each routed token row in FP8:
the rows are quantized rowwise with the recipe's FP8 format (``quantize_rowwise_rows``), and
each row travels as its ``D`` FP8 bytes followed by its float32 scale, ``D + 4`` bytes in one
all-to-all instead of ``2 * D`` in bf16. The receiving rank dequantizes the rows to the input's
dtype for torchtitan's expert-major permute and its experts; FP8 experts quantize them rowwise
again. For bf16 rows and scales not rounded to powers of two, that gives back bitwise the FP8
values and scales that were sent: a row's amax is a bf16 value, which the dequantized row holds
again, and every other product ``q * s`` rounds to bf16 within ``2**-9`` of itself, far inside an
FP8 step (tested). With ``round_scales_to_power_of_2`` a row may come back as twice its values at
half its scale: the same products in other bits. A row holding a NaN or an Inf is sent with scale
Inf and arrives all NaN, as the experts' GEMM output of that row is either way. Backward sends the
rows' gradient back in its own dtype through the reverse all-to-all, as torchtitan's dispatcher
does (a cast's gradient is the identity, as in the FP8 recipes). The token counts' exchange and its host sync, the permute
and the combine are torchtitan's, and so are the exchanges themselves (its functional collective
or ``spmd_types`` all-to-all, by the job's SPMD backend); with no EP mesh (EP=1) dispatch is
torchtitan's local reorder, nothing is quantized.

``ops.torchtitan`` switches it on: ``Fp8GroupedExpertsConverter.Config(fp8_dispatch=True)``, or
the override ``--override.imports ops.torchtitan_dispatch.fp8_token_dispatch``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed import _functional_collectives as funcol
from torchtitan.config import override
from torchtitan.models.common.moe import RoutedExperts
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher
from torchtitan.protocols.module import Module

from ops.op_registry import kernel_ops
from ops.recipes import Fp8Recipe, check_recipe_name

__all__ = ["DISPATCH_OVERRIDE", "Fp8AllToAllTokenDispatcher", "fp8_dispatch_configs", "fp8_token_dispatch"]

DISPATCH_OVERRIDE = "ops.torchtitan_dispatch.fp8_token_dispatch"
"""The override's name for ``override.imports``."""

_SCALE_BYTES = 4  # a float32 scale after each row's FP8 bytes


def check_dispatch_recipe(recipe: object, option: str) -> str:
    """``recipe`` if it names a recipe that quantizes rows rowwise (the rowwise recipe); else a ``ValueError``
    naming ``option``."""
    check_recipe_name(recipe, option)
    if not Fp8Recipe(name=recipe).takes_prequantized_weights:
        raise ValueError(f"{option}: FP8 dispatch sends rows quantized rowwise (the rowwise recipe), not {recipe!r}")
    return recipe


Exchange = Callable[[Tensor], Tensor]
"""An all-to-all of a tensor's rows with fixed splits (torchtitan's, over its EP group)."""


def _waited(t: Tensor) -> Tensor:
    """``t``, its all-to-all finished (torchtitan's exchanges return ``AsyncCollectiveTensor``s)."""
    return funcol.wait_tensor(t) if isinstance(t, funcol.AsyncCollectiveTensor) else t


class _Fp8TokenExchange(torch.autograd.Function):
    """``apply(rows, dispatch, reverse, float8_dtype, pow2)``: the rows' ``dispatch`` exchange in FP8 (rowwise
    values and scales in one message), dequantized on arrival; the gradient's ``reverse`` exchange in its dtype."""

    @staticmethod
    def forward(
        ctx, rows: Tensor, dispatch: Exchange, reverse: Exchange, float8_dtype: torch.dtype, pow2: bool
    ) -> Tensor:
        ctx.reverse = reverse
        n, d = rows.shape
        if n:
            data, scales = kernel_ops.quantize_rowwise_rows(rows.contiguous(), float8_dtype, pow2)
        else:
            data = torch.empty((0, d), dtype=float8_dtype, device=rows.device)
            scales = torch.empty((0,), dtype=torch.float32, device=rows.device)
        packed = torch.cat([data.view(torch.uint8), scales.view(torch.uint8).view(n, _SCALE_BYTES)], dim=1)
        received = _waited(dispatch(packed))
        values = received[:, :d].contiguous().view(float8_dtype)
        row_scales = received[:, d:].contiguous().view(torch.float32)
        return (values.to(torch.float32) * row_scales).to(rows.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        return _waited(ctx.reverse(grad.contiguous())), None, None, None, None


class Fp8AllToAllTokenDispatcher(AllToAllTokenDispatcher):
    """Torchtitan's all-to-all token dispatcher with the dispatch exchange in FP8 (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(AllToAllTokenDispatcher.Config):
        recipe: str = "rowwise"
        """The ``ops.Fp8Recipe`` whose FP8 format and scale rounding quantize the rows (rowwise)."""

        def __post_init__(self) -> None:
            check_dispatch_recipe(self.recipe, "Fp8AllToAllTokenDispatcher.Config.recipe")

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.recipe = Fp8Recipe(name=config.recipe)

    def _dispatch_token_exchange(
        self, routed_input_ND: Tensor, pg: object, output_splits: list[int], input_splits: list[int]
    ) -> Tensor:
        """The dispatch all-to-all in FP8, through torchtitan's own exchanges (its collective for the job's
        SPMD backend): the dispatch one for the FP8 rows, the combine one (the reverse) for their gradient."""

        def dispatch(t: Tensor) -> Tensor:
            return AllToAllTokenDispatcher._dispatch_token_exchange(self, t, pg, output_splits, input_splits)

        def reverse(t: Tensor) -> Tensor:
            return AllToAllTokenDispatcher._combine_token_exchange(self, t, pg, input_splits, output_splits)

        recipe = self.recipe
        return _Fp8TokenExchange.apply(
            routed_input_ND, dispatch, reverse, recipe.float8_dtype, recipe.round_scales_to_power_of_2
        )


def fp8_dispatcher_config(config: AllToAllTokenDispatcher.Config, recipe: str) -> Fp8AllToAllTokenDispatcher.Config:
    """The FP8 counterpart of torchtitan's standard dispatcher config; an FP8 one is returned as it is."""
    if isinstance(config, Fp8AllToAllTokenDispatcher.Config):
        return config
    if type(config) is not AllToAllTokenDispatcher.Config:
        raise ValueError(
            f"FP8 dispatch replaces torchtitan's standard all-to-all token dispatcher (moe_comm_backend "
            f"'standard'); this MoE has {type(config).__qualname__}"
        )
    return Fp8AllToAllTokenDispatcher.Config(num_experts=config.num_experts, top_k=config.top_k, recipe=recipe)


def fp8_dispatch_configs(model_config: Module.Config, recipe: str = "rowwise") -> Module.Config:
    """Give every routed-experts config in ``model_config``'s tree the FP8 dispatcher; returns ``model_config``.

    Raises:
        ValueError: ``recipe`` does not quantize rows rowwise, the tree has no routed experts, or one of them
            has a dispatcher other than torchtitan's standard all-to-all one (DeepEP, HybridEP, torchao's).
    """
    check_dispatch_recipe(recipe, "recipe")
    routed = list(model_config.traverse(RoutedExperts.Config))
    if not routed:
        raise ValueError(f"{type(model_config).__qualname__} has no routed experts (RoutedExperts.Config) to dispatch")
    for fqn, config, _parent, _attr in routed:
        try:
            config.token_dispatcher = fp8_dispatcher_config(config.token_dispatcher, recipe)
        except ValueError as error:
            raise ValueError(f"{fqn}: {error}") from None
    return model_config


@override(target=AllToAllTokenDispatcher.Config, exact=True, description="ops: the EP dispatch all-to-all in FP8")
def fp8_token_dispatch(
    config: AllToAllTokenDispatcher.Config, *, recipe: str = "rowwise"
) -> Fp8AllToAllTokenDispatcher.Config:
    """Override factory (``--override.imports ops.torchtitan_dispatch.fp8_token_dispatch``): torchtitan's standard
    token dispatcher with its dispatch exchange in FP8."""
    check_dispatch_recipe(recipe, "ops.torchtitan_dispatch.fp8_token_dispatch's recipe")
    return fp8_dispatcher_config(config, recipe)
