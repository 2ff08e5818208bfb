"""Hugging Face transformers 5.x experts in FP8: which modules they are, their layouts, the forward that runs them.

transformers 5 keeps a MoE layer's experts as one module of 3-D parameters (``Qwen3MoeExperts``,
``Qwen2MoeExperts``, ``MixtralExperts``, ``DeepseekV3Experts``, ``GptOssExperts``, ...), called as
``experts(hidden_states (T, D), top_k_index (T, k), top_k_weights (T, k)) -> (T, D)``. Its class
is decorated by ``transformers.integrations.moe.use_experts_implementation``, which records the
layout on every instance:

- ``has_gate``: a gated activation over ``gate_up_proj`` (else an activation over ``up_proj``);
- ``is_transposed``: weights stored ``(E, in, out)`` (gpt-oss) instead of ``(E, out, in)``;
- ``is_concatenated``: gate and up as two blocks ``[gate; up]`` (else interleaved, gpt-oss);
- ``has_bias``: ``gate_up_proj_bias (E, 2I)`` / ``up_proj_bias`` and ``down_proj_bias (E, D)``.

``ops.convert_to_fp8`` puts such a module of class ``C`` into class ``Fp8C``
(``Fp8TransformersExperts``, then ``C``), in place: the same object, parameters, names, layouts
and hooks, so optimizers, ``state_dict``, ``save_pretrained`` / ``from_pretrained`` and PEFT's
module names keep working. We swap the class rather than select an implementation through
transformers' switch (``config._experts_implementation``) because that switch is read from the
config every experts module of a model shares: it cannot give modules their own recipe or
leave some of them in bf16 (``filter_fn``), and it lives in the config that ``save_pretrained``
writes.

The FP8 forward sorts the ``(token, choice)`` pairs by expert on the device (``ops.sort_by_expert``:
no host sync, deterministic) and combines the experts' rows back with the routing weights in
float32 (``ops.combine_pairs``). In between:

- SwiGLU experts in the ``[gate; up]`` layout without biases (Qwen3-MoE, Qwen2-MoE, Mixtral,
  DeepSeek-V3) with a recipe that fuses experts: the fused up-projection reads each token's FP8
  row by index and ``gate_up_proj (E, 2I, D)`` packed as it is (``swiglu_up_projection``), then
  ``down_proj`` as a grouped linear.
- Any other layout (gpt-oss's interleaved, transposed, biased and clamped SwiGLU; other recipes):
  both projections as FP8 grouped GEMMs over the pairs' rows, the module's own activation
  (``_apply_gate`` or ``act_fn``) in between, unchanged and in the model's dtype, and the biases
  added per pair. Transposed weights ``(E, in, out)`` go to ``ops.fp8_grouped_mm`` as stored: the
  rowwise recipe quantizes them in that layout and makes their gradients in it
  (``Fp8Recipe.takes_transposed_weights``); other recipes copy them to ``(E, out, in)`` first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ops.functional import DIM_ALIGNMENT, fp8_grouped_linear, fp8_grouped_mm
from ops.moe import ExpertOrder, combine_pairs, rows_of_pairs, sort_by_expert
from ops.moe_fused import fuses_experts, swiglu_up_projection
from ops.recipes import Fp8Recipe

# What transformers' use_experts_implementation records on an experts module.
_LAYOUT_ATTRIBUTES = ("has_gate", "has_bias", "is_transposed", "is_concatenated")
_WEIGHT_NAMES = ("gate_up_proj", "up_proj", "down_proj")


def _shapes(module: nn.Module) -> str:
    """``name (shape)`` of each parameter of ``module``, for error messages."""
    return ", ".join(f"{name} {tuple(p.shape)}" for name, p in module.named_parameters(recurse=False)) or "none"


def looks_like_transformers_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds transformers-style 3-D expert weights (``gate_up_proj``/``up_proj``/``down_proj``)."""
    return any(
        isinstance(getattr(module, name, None), nn.Parameter) and getattr(module, name).dim() == 3
        for name in _WEIGHT_NAMES
    )


def is_transformers_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers 5 experts module (its class decorated by ``use_experts_implementation``)."""
    return looks_like_transformers_experts(module) and all(hasattr(module, a) for a in _LAYOUT_ATTRIBUTES)


def check_transformers_experts(module: nn.Module, fqn: str) -> None:
    """Raise a ``ValueError`` naming ``fqn``, the class and the parameter shapes unless ``module``'s layout runs in FP8."""
    where = f"{type(module).__name__} at {fqn or '<model>'!r} (parameters: {_shapes(module)})"
    if not is_transformers_experts(module):
        raise ValueError(
            f"{where} holds 3-D expert weights but is not a transformers 5 experts module (its class is not "
            "decorated by transformers.integrations.moe.use_experts_implementation), so its call and layout "
            "are unknown; leave it out with convert_to_fp8(..., filter_fn=...)"
        )
    up_name = "gate_up_proj" if module.has_gate else "up_proj"
    up, down = getattr(module, up_name, None), getattr(module, "down_proj", None)
    if not all(isinstance(p, nn.Parameter) and p.dim() == 3 for p in (up, down)):
        raise ValueError(f"{where}: expected 3-D parameters {up_name} and down_proj")
    for p in (up, down):
        if not p.dtype.is_floating_point or p.element_size() < 2:
            raise ValueError(f"{where}: expert weights must be bf16/fp16/fp32 (high precision) to run in FP8")
    # (E, out, in) as stored, whatever the layout.
    up_shape = up.shape if not module.is_transposed else up.transpose(-2, -1).shape
    down_shape = down.shape if not module.is_transposed else down.transpose(-2, -1).shape
    num_experts, up_out, dim = up_shape
    hidden = up_out // 2 if module.has_gate else up_out
    if (module.has_gate and up_out % 2) or tuple(down_shape) != (num_experts, dim, hidden):
        raise ValueError(
            f"{where}: {up_name} and down_proj do not fit one layout (has_gate={module.has_gate}, "
            f"is_transposed={module.is_transposed}): expected down_proj as (E, D, I) = ({num_experts}, {dim}, {hidden}) "
            "in (E, out, in) order"
        )
    for name, size in (("hidden size D", dim), ("expert intermediate size I", hidden)):
        if size % DIM_ALIGNMENT:
            raise ValueError(
                f"{where}: the {name} = {size} must be a multiple of {DIM_ALIGNMENT} for the FP8 GEMMs "
                "(FP8 rows start on 16-byte boundaries)"
            )
    if module.has_bias:
        for name, shape in ((f"{up_name}_bias", (num_experts, up_out)), ("down_proj_bias", (num_experts, dim))):
            bias = getattr(module, name, None)
            if not isinstance(bias, nn.Parameter) or tuple(bias.shape) != shape:
                raise ValueError(f"{where}: has_bias needs {name} of shape {shape}")


@functools.cache
def _is_silu(act_type: type) -> bool:
    from transformers.activations import SiLUActivation

    return issubclass(act_type, (nn.SiLU, SiLUActivation))


@functools.cache
def _has_default_gate(cls: type) -> bool:
    """Whether ``cls`` gates with transformers' default ``act_fn(gate) * up`` over ``[gate; up]``."""
    from transformers.integrations import moe

    return getattr(cls, "_apply_gate", None) is moe._default_apply_gate


def runs_fused(module: nn.Module, recipe: Fp8Recipe) -> bool:
    """Whether ``module`` runs the fused SwiGLU up-projection with ``recipe`` (see the module docstring)."""
    return (
        fuses_experts(recipe)
        and module.has_gate
        and module.is_concatenated
        and not module.is_transposed
        and not module.has_bias
        and _has_default_gate(type(module))
        and _is_silu(type(getattr(module, "act_fn", None)))
    )


def _expert_of_pairs(top_k_index: Tensor, order: ExpertOrder, num_experts: int, dtype: torch.dtype) -> Tensor:
    """``(P, E)`` one-hot of each sorted pair's expert (all zeros for pairs routed to no expert here)."""
    experts = top_k_index.flatten().index_select(0, order.order)
    bins = torch.where((experts >= 0) & (experts < num_experts), experts, num_experts)
    return F.one_hot(bins, num_experts + 1)[:, :num_experts].to(dtype)


def _add_pair_bias(y: Tensor, bias: Tensor, one_hot: Tensor) -> Tensor:
    """``y[i] + bias[expert of pair i]``. The gather is a product with the one-hot (exact: one
    term per row), so that the bias gradient is one GEMM (deterministic) instead of an atomic
    scatter-add."""
    return y + (one_hot @ bias).to(y.dtype)


Projection = Callable[[Tensor, Tensor, Tensor], Tensor]
"""``project(rows, weight, offs)``: ``rows @ w[g]^T`` per expert group, ``weight`` the parameter as stored."""


def experts_on_pairs(
    experts: nn.Module, x: Tensor, top_k_index: Tensor, order: ExpertOrder, offs: Tensor, project: Projection
) -> Tensor:
    """A transformers experts module over the sorted pairs, unfused: ``project`` for both GEMMs, the
    module's own activation (``_apply_gate`` or ``act_fn``) between them and its biases per pair; ``(P, D)``."""
    up_name = "gate_up_proj" if experts.has_gate else "up_proj"
    proj = project(rows_of_pairs(x, order, top_k_index.shape[-1]), getattr(experts, up_name), offs)
    if experts.has_bias:
        up_bias = getattr(experts, f"{up_name}_bias")
        one_hot = _expert_of_pairs(top_k_index, order, experts.down_proj.shape[0], up_bias.dtype)
        proj = _add_pair_bias(proj, up_bias, one_hot)
    h = experts._apply_gate(proj) if experts.has_gate else experts.act_fn(proj)
    y = project(h.contiguous(), experts.down_proj, offs)
    return _add_pair_bias(y, experts.down_proj_bias, one_hot) if experts.has_bias else y


class Fp8TransformersExperts(nn.Module):
    """Mixin for a transformers 5 experts module: its forward in FP8 with ``self.recipe`` (see the module docstring)."""

    recipe: Fp8Recipe

    def _project(self, x: Tensor, weight: Tensor, offs: Tensor, recipe: Fp8Recipe) -> Tensor:
        """``x @ weight[g]^T`` per expert group in FP8, ``weight`` stored ``(E, out, in)`` or transposed."""
        if self.is_transposed:
            return fp8_grouped_mm(x, weight, offs=offs, recipe=recipe)
        return fp8_grouped_linear(x, weight, offs, recipe)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """``(T, D)`` tokens, ``(T, k)`` experts and weights -> ``(T, D)``, as the module's own forward."""
        from ops.modules import recipe_for_module

        recipe = recipe_for_module(self, self.recipe)
        top_k = top_k_index.shape[-1]
        x = hidden_states.contiguous()
        order = sort_by_expert(top_k_index, self.down_proj.shape[0])
        offs = torch.cumsum(order.num_tokens_per_expert, 0, dtype=torch.int32)
        if runs_fused(self, recipe):
            rows = (order.order // top_k).to(torch.int32)
            h = swiglu_up_projection(x, self.gate_up_proj, offs, recipe, rows=rows, inverse=order.inverse.view(-1, top_k))
            y = fp8_grouped_linear(h, self.down_proj, offs, recipe)
        else:
            y = experts_on_pairs(self, x, top_k_index, order, offs, functools.partial(self._project, recipe=recipe))
        return combine_pairs(y, order, top_k_weights).to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return ", ".join(filter(None, (super().extra_repr(), f"recipe={self.recipe.name}")))


@functools.cache
def fp8_transformers_experts_class(cls: type) -> type:
    """``Fp8<cls>``: ``cls`` with ``Fp8TransformersExperts``' forward (one class per ``cls``)."""
    name = f"Fp8{cls.__name__}"
    return type(cls)(name, (Fp8TransformersExperts, cls), {"__module__": cls.__module__, "__qualname__": name})
