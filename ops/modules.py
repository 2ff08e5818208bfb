"""Expert modules (bf16 references and FP8 counterparts) and ``convert_to_fp8``, which swaps one for the other.

- ``GroupedLinear`` / ``Fp8GroupedLinear``: a bank of per-expert linears,
  ``weight (E, N, K)``, ``forward(x, offs)``.
- ``GroupedExperts`` / ``Fp8GroupedExperts``: SwiGLU experts with torchtitan's
  parameter layout (``w1 (E, hidden, dim)``, ``w2 (E, dim, hidden)``,
  ``w3 (E, hidden, dim)``) and call, ``forward(x, num_tokens_per_expert)``.

Expert weights sharded by expert parallelism (``ops.apply_expert_parallel``: DTensors
``Shard(0)`` along E) enter the GEMMs as their local shards (``local_tensor``).

``convert_to_fp8(model, recipe, filter_fn)`` converts the selected modules in
place: each stays the same object with the same ``Parameter`` objects and only
changes class, so optimizers, state dicts, hooks (expert-parallel dispatch among
them) and FSDP2's ``fully_shard`` applied before or after conversion keep working.
Any module holding 3-D ``w1``/``w2``/``w3`` parameters in that layout is converted
as well. Torchtitan's experts (``GroupedExperts``, ``w1_EFD``/``w2_EDF``/``w3_EFD``,
and its variants) route their GEMMs through a ``_grouped_mm(*, A, B_t, offs)``
method; those modules keep their own forward and get an FP8 ``_grouped_mm``
(``Fp8GroupedMMSeam``). Hugging Face transformers 5's experts modules (``gate_up_proj`` /
``down_proj``) get an FP8 forward (``ops.transformers_experts``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ops.experts import EXPERT_WEIGHTS, GROUPED_LINEAR_WEIGHTS, is_experts
from ops.functional import DEFAULT_RECIPE, fp8_grouped_linear, fp8_grouped_linears, fp8_grouped_mm
from ops.grouped_linear_autograd import CombineRouting
from ops.moe_fused import down_projection_combine, fuses_experts, swiglu_up_projection
from ops.recipes import Fp8Recipe

FilterFn = Callable[[nn.Module, str], bool]


def _expert_weight(num_experts: int, rows: int, cols: int, dtype: torch.dtype | None, device) -> nn.Parameter:
    weight = torch.empty(num_experts, rows, cols, dtype=dtype, device=device)
    # nn.Linear's default: uniform(+-1/sqrt(fan_in)) per expert.
    bound = cols**-0.5
    return nn.Parameter(nn.init.uniform_(weight, -bound, bound))


def local_tensor(t: Tensor) -> Tensor:
    """``t``'s local shard if it is a ``DTensor`` (differentiable: gradients reach the DTensor), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def recipe_for_module(module: nn.Module, recipe: Fp8Recipe) -> Fp8Recipe:
    """``recipe`` as ``module`` runs it: under FSDP2 (``fully_shard`` manages the module) without its keeping of quantized weights.

    FSDP2 gathers such a module's weights again for every pass and frees them after
    it, so their quantized forms cannot be reused and must not outlive them (its FP8
    all-gather keeps each rank's quantized shard instead, ``ops.fsdp``). Their
    ``main_grad`` would bypass FSDP2's reduce-scatter: refused.
    """
    if not getattr(module, "_is_fsdp_managed_module", False):
        return recipe
    if recipe.deferred_wgrad:
        raise ValueError(
            f"deferred_wgrad does not work under FSDP2 ({type(module).__name__} is managed by fully_shard, which "
            "reduce-scatters the gradients after each backward, before ops.run_deferred_wgrads): use "
            "deferred_wgrad=False"
        )
    if recipe.wgrad_accumulation == "main_grad":
        raise ValueError(
            f"wgrad_accumulation='main_grad' does not work under FSDP2 ({type(module).__name__} is managed by "
            "fully_shard, which reduce-scatters .grad): use 'grad' (FSDP2 accumulates its unsharded .grad between "
            "reduce-scatters with set_requires_gradient_sync(False)) or 'off'"
        )
    if not recipe.keep_quantized_weights:
        return recipe
    cached = module.__dict__.get("_recipe_under_fsdp")
    if cached is None or cached[0] is not recipe:
        cached = (recipe, dataclasses.replace(recipe, keep_quantized_weights=False))
        module.__dict__["_recipe_under_fsdp"] = cached
    return cached[1]


def _offsets(num_tokens_per_expert: Tensor) -> Tensor:
    return torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)


class GroupedLinear(nn.Module):
    """bf16 reference: ``out[rows of g] = x[rows of g] @ weight[g]^T`` through ``torch._grouped_mm``."""

    weight_names = GROUPED_LINEAR_WEIGHTS

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        *,
        dtype: torch.dtype | None = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.weight = _expert_weight(num_experts, out_features, in_features, dtype, device)

    def forward(self, x: Tensor, offs: Tensor) -> Tensor:
        return torch._grouped_mm(x, self.weight.transpose(-2, -1), offs=offs)

    def extra_repr(self) -> str:
        e, n, k = self.weight.shape
        return f"num_experts={e}, in_features={k}, out_features={n}"


class _Fp8Weights:
    """What the FP8 modules share: their ``recipe``, and ``from_module`` sharing a bf16 module's weights."""

    recipe: Fp8Recipe
    weight_names: tuple[str, ...]

    def __init__(self, *args, recipe: Fp8Recipe = DEFAULT_RECIPE, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.recipe = recipe

    @classmethod
    def from_module(cls, module: nn.Module, recipe: Fp8Recipe = DEFAULT_RECIPE) -> nn.Module:
        """A ``cls`` sharing ``module``'s weights (those named by ``weight_names``; no copy)."""
        fp8 = cls.__new__(cls)
        nn.Module.__init__(fp8)
        for name in cls.weight_names:
            setattr(fp8, name, getattr(module, name))
        fp8.recipe = recipe
        return fp8

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}"


class Fp8GroupedLinear(_Fp8Weights, GroupedLinear):
    """``GroupedLinear`` whose GEMMs (forward, dgrad, wgrad) run in FP8 with ``recipe``."""

    def forward(self, x: Tensor, offs: Tensor) -> Tensor:
        return fp8_grouped_linear(x, self.weight, offs, recipe_for_module(self, self.recipe))


class GroupedExperts(nn.Module):
    """bf16 reference SwiGLU experts, torchtitan's layout: ``w2[g] @ (silu(w1[g] x) * w3[g] x)``."""

    weight_names = EXPERT_WEIGHTS

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        *,
        dtype: torch.dtype | None = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = _expert_weight(num_experts, hidden_dim, dim, dtype, device)
        self.w2 = _expert_weight(num_experts, dim, hidden_dim, dtype, device)
        self.w3 = _expert_weight(num_experts, hidden_dim, dim, dtype, device)

    def grouped_mm(self, x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
        """One expert GEMM, ``x @ w[g]^T`` per group (``w`` is ``(E, N, K)``)."""
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

    def forward(
        self,
        x: Tensor,
        num_tokens_per_expert: Tensor,
        *,
        x_fp8: tuple[Tensor, Tensor] | None = None,
        routing: tuple[Tensor, Tensor] | None = None,
        combine: tuple[CombineRouting, Tensor] | None = None,
    ) -> Tensor:
        """``x (T, dim)`` sorted by expert; ``num_tokens_per_expert (E_local,)``; returns ``(T, dim)``.

        ``E_local`` is the number of experts held here (all of them, or this rank's
        shard under expert parallelism). ``x_fp8``: ``x``'s rows already quantized
        (FP8 experts only; see ``Fp8GroupedExperts``). ``routing = (rows, inverse)``:
        ``x`` holds each token once and the experts read the pairs' rows by index
        (``rows (P,)`` int32, the token of each sorted pair; ``inverse (T, k)`` int64,
        each pair's sorted position); returns ``(P, dim)``. Only experts whose
        ``takes_routed_tokens`` is true accept it (``ops.MoE`` asks). ``combine = (CombineRouting,
        probs (T, k))``: the pairs' rows are combined back to their tokens
        (``moe_combine``) and ``(T, dim)`` returned; only experts whose ``takes_combine`` is true
        accept it.
        """
        offs = _offsets(num_tokens_per_expert)
        if combine is not None:
            return self.swiglu_down_projection_combine(x, offs, combine, x_fp8=x_fp8, routing=routing).type_as(x)
        h = self.swiglu(x, offs, x_fp8=x_fp8, routing=routing)
        return self.grouped_mm(h, local_tensor(self.w2), offs).type_as(x)

    @property
    def takes_routed_tokens(self) -> bool:
        """Whether ``forward`` takes ``routing`` (the tokens once, read by index)."""
        return False

    @property
    def takes_combine(self) -> bool:
        """Whether ``forward`` takes ``combine`` (the down-projection and the MoE combine as one op)."""
        return False

    def swiglu_down_projection_combine(
        self,
        x: Tensor,
        offs: Tensor,
        combine: tuple[CombineRouting, Tensor],
        x_fp8: tuple[Tensor, Tensor] | None = None,
        routing: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """The experts with ``w2``'s projection combined back to the tokens (experts with ``takes_combine``)."""
        raise ValueError(
            "combine (the down-projection with the MoE combine) needs experts with takes_combine; "
            f"{type(self).__name__} has none"
        )

    def swiglu(
        self,
        x: Tensor,
        offs: Tensor,
        x_fp8: tuple[Tensor, Tensor] | None = None,
        routing: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """``silu(x @ w1[g]^T) * (x @ w3[g]^T)``: the hidden rows that ``w2`` projects back."""
        if x_fp8 is not None:
            raise ValueError(
                f"x_fp8 (pre-quantized rows) needs FP8 experts; {type(self).__name__} computes in "
                f"{self.w1.dtype}: dispatch bf16 tokens, or convert the experts with ops.convert_to_fp8"
            )
        if routing is not None:
            raise ValueError(f"routing (tokens read by index) needs experts with takes_routed_tokens; {type(self).__name__} has none")
        gate = self.grouped_mm(x, local_tensor(self.w1), offs)
        up = self.grouped_mm(x, local_tensor(self.w3), offs)
        return F.silu(gate) * up

    def extra_repr(self) -> str:
        e, hidden, dim = self.w1.shape
        return f"dim={dim}, hidden_dim={hidden}, num_experts={e}"


class Fp8GroupedExperts(_Fp8Weights, GroupedExperts):
    """``GroupedExperts`` whose three grouped GEMMs run in FP8 with ``recipe``."""

    @classmethod
    def from_module(cls, module: nn.Module, recipe: Fp8Recipe = DEFAULT_RECIPE) -> Fp8GroupedExperts:
        """An ``Fp8GroupedExperts`` sharing ``module``'s ``w1``/``w2``/``w3`` (no copy)."""
        fp8 = super().from_module(module, recipe)
        fp8.num_experts = module.w1.shape[0]
        return fp8

    def grouped_mm(self, x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
        return fp8_grouped_linear(x, w, offs, recipe_for_module(self, self.recipe))

    @property
    def takes_routed_tokens(self) -> bool:
        """True when the recipe runs the fused up-projection (``ops.moe_fused.fuses_experts``)."""
        return fuses_experts(self.recipe)

    @property
    def takes_combine(self) -> bool:
        """True when the recipe runs the fused experts (``ops.moe_fused.down_projection_combine``)."""
        return fuses_experts(self.recipe)

    def swiglu_down_projection_combine(
        self,
        x: Tensor,
        offs: Tensor,
        combine: tuple[CombineRouting, Tensor],
        x_fp8: tuple[Tensor, Tensor] | None = None,
        routing: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """``ops.moe_fused.swiglu_up_projection`` then ``down_projection_combine``, given the
        up-projection's ``gate_up``: SwiGLU's backward then runs in the down-projection's backward
        with the routing weights' gradient (``grad_probs = <u, h>`` from ``gate_up``), so the
        combine's rows are not kept; in a kernel of its own after the dgrad, or in the dgrad's
        epilogue with ``RowwiseOptions.fused_swiglu_backward``."""
        recipe = recipe_for_module(self, self.recipe)
        rows, inverse = (None, None) if routing is None else routing
        w1, w3 = local_tensor(self.w1), local_tensor(self.w3)
        h, gate_up = swiglu_up_projection(
            x, (w1, w3), offs, recipe, rows=rows, inverse=inverse, x_fp8=x_fp8, with_gate_up=True
        )
        return down_projection_combine(h, local_tensor(self.w2), offs, recipe, *combine, gate_up=gate_up)

    def swiglu(
        self,
        x: Tensor,
        offs: Tensor,
        x_fp8: tuple[Tensor, Tensor] | None = None,
        routing: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """As ``GroupedExperts.swiglu``, in FP8. ``x_fp8 = (data, scales)``: ``x``'s rows already
        quantized rowwise with ``self.recipe`` (``x`` is then only the gradient anchor).

        With ``fuses_experts(recipe)``: ``ops.moe_fused.swiglu_up_projection`` (one GEMM for
        ``w1`` and ``w3``, SwiGLU in its epilogue, tokens read by index with ``routing``);
        otherwise both projections through ``ops.fp8_grouped_linears`` (one quantization of
        ``x`` and one saved FP8 ``x^T``) and an eager SwiGLU.
        """
        w1, w3 = local_tensor(self.w1), local_tensor(self.w3)
        recipe = recipe_for_module(self, self.recipe)
        if fuses_experts(recipe):
            rows, inverse = (None, None) if routing is None else routing
            return swiglu_up_projection(x, (w1, w3), offs, recipe, rows=rows, inverse=inverse, x_fp8=x_fp8)
        if routing is not None:
            raise ValueError(
                "routing (tokens read by index) needs the fused up-projection: a rowwise recipe with "
                "fused_experts and both folds on"
            )
        gate, up = fp8_grouped_linears(x, (w1, w3), offs, recipe, x_fp8=x_fp8)
        return F.silu(gate) * up


class Fp8GroupedMMSeam(nn.Module):
    """Mixin for modules whose grouped GEMMs all go through ``self._grouped_mm(*, A, B_t, offs)``.

    ``A @ B_t`` per expert group runs as ``ops.fp8_grouped_mm`` with
    ``self.recipe``; the module's own forward (casts, token layout, DTensor
    handling, biases) is untouched. ``convert_to_fp8`` puts a module of class
    ``C`` into class ``Fp8C(Fp8GroupedMMSeam, C)``, in place, as FSDP2's
    ``fully_shard`` does: the same object, parameters, hooks and state-dict keys.

    ``weight_names``: the 3-D weights ``w (E, N, K)`` that reach the seam as
    ``B_t = w.transpose(-2, -1)`` and nothing else, which FSDP2 may therefore gather in
    FP8 (``ops.enable_fp8_all_gather``). Empty unless the module's class is known to do
    so (``ops.torchtitan`` sets it for torchtitan's ``GroupedExperts``).
    """

    recipe: Fp8Recipe
    weight_names: tuple[str, ...] = ()

    def _grouped_mm(self, *, A: Tensor, B_t: Tensor, offs: Tensor) -> Tensor:
        """``torch._grouped_mm(A, B_t, offs=offs)`` in FP8: ``A (M, K)``, ``B_t (E, K, N)``, ``offs (E,)``."""
        return fp8_grouped_mm(A, B_t, offs=offs, recipe=recipe_for_module(self, self.recipe))

    def extra_repr(self) -> str:
        return ", ".join(filter(None, (super().extra_repr(), f"recipe={self.recipe.name}")))


_SEAM_ARGUMENTS = ("A", "B_t", "offs")


@functools.cache
def _has_grouped_mm_seam(cls: type) -> bool:
    """Whether ``cls`` defines torchtitan's seam: a method ``_grouped_mm(self, *, A, B_t, offs)``."""
    seam = getattr(cls, "_grouped_mm", None)
    if not inspect.isfunction(seam):
        return False
    parameters = inspect.signature(seam).parameters
    return all(
        name in parameters and parameters[name].kind is inspect.Parameter.KEYWORD_ONLY for name in _SEAM_ARGUMENTS
    )


@functools.cache
def _fp8_seam_class(cls: type) -> type:
    """``Fp8<cls>``: ``cls`` with ``Fp8GroupedMMSeam``'s ``_grouped_mm`` (one class per ``cls``)."""
    name = f"Fp8{cls.__name__}"
    return type(cls)(name, (Fp8GroupedMMSeam, cls), {"__module__": cls.__module__, "__qualname__": name})


def _fp8_class(module: nn.Module, fqn: str = "") -> type[nn.Module] | None:
    """The FP8 module class ``module`` converts to, or ``None`` if it is not convertible (or already FP8).

    Raises ``ValueError`` (naming ``fqn``) for transformers-style experts whose layout does not run in FP8.
    """
    from ops import transformers_experts as hf

    if isinstance(module, (Fp8GroupedLinear, Fp8GroupedExperts, Fp8GroupedMMSeam, hf.Fp8TransformersExperts)):
        return None
    if _has_grouped_mm_seam(type(module)):
        return _fp8_seam_class(type(module))
    if hf.looks_like_transformers_experts(module):
        hf.check_transformers_experts(module, fqn)
        return hf.fp8_transformers_experts_class(type(module))
    if isinstance(module, GroupedLinear):
        return Fp8GroupedLinear
    if is_experts(module):
        return Fp8GroupedExperts
    return None


# --- in-place conversion, keeping FSDP2's state ---------------------------------
# fully_shard keeps its state on the module object: its hooks, its parameters'
# (module, name) records, and its class, swapped for a subclass of (FSDPModule, cls).
# Converting in place changes only the class (and adds the recipe), so all of that
# survives: converting after fully_shard works as converting before it.

# (FSDP2's class of the module, FP8 class) -> FSDP2-style class of the FP8 class.
_wrapped_fp8_classes: dict[tuple[type, type], type] = {}


def _converted_class(cls: type[nn.Module], fp8_cls: type[nn.Module]) -> type[nn.Module]:
    """``fp8_cls``, wrapped as FSDP2 wraps ``cls`` when ``cls`` is one of its ``(FSDPModule, original)`` classes."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a build without torch.distributed
        return fp8_cls
    if FSDPModule not in cls.__bases__:
        return fp8_cls
    key = (cls, fp8_cls)
    wrapped = _wrapped_fp8_classes.get(key)
    if wrapped is None:
        # The FSDP class's own attributes (its __deepcopy__ guard) come along.
        own = {name: value for name, value in vars(cls).items() if name == "__deepcopy__"}
        wrapped = _wrapped_fp8_classes[key] = type(f"FSDP{fp8_cls.__name__}", (FSDPModule, fp8_cls), own)
    return wrapped


def convert_module_to_fp8(module: nn.Module, recipe: Fp8Recipe = DEFAULT_RECIPE, fqn: str = "") -> bool:
    """Make ``module`` its FP8 counterpart in place (same object, parameters, hooks, FSDP2 state); ``False`` if not convertible.

    ``GroupedLinear`` becomes ``Fp8GroupedLinear``; ``GroupedExperts`` and other experts with
    3-D ``w1``/``w2``/``w3`` become ``Fp8GroupedExperts`` (their other attributes stay on the
    object); a module with torchtitan's ``_grouped_mm`` seam, or a transformers 5 experts module
    (``ops.transformers_experts``), becomes ``Fp8<its class>``. ``fqn`` names the module in errors.
    """
    from ops.transformers_experts import Fp8TransformersExperts

    fp8_cls = _fp8_class(module, fqn)
    if fp8_cls is None:
        return False
    module.recipe = recipe
    if issubclass(fp8_cls, (Fp8GroupedMMSeam, Fp8TransformersExperts)):
        # Derived from the module's own class (FSDP2's included): only the seam changes.
        module.__class__ = fp8_cls
        return True
    if fp8_cls is Fp8GroupedExperts and not hasattr(module, "num_experts"):
        module.num_experts = module.w1.shape[0]
    module.__class__ = _converted_class(type(module), fp8_cls)
    return True


def convert_to_fp8(
    model: nn.Module, recipe: Fp8Recipe = DEFAULT_RECIPE, filter_fn: FilterFn | None = None
) -> nn.Module:
    """Swap the grouped GEMM modules of ``model`` for FP8 ones, in place; returns ``model``.

    Converted: ``GroupedLinear`` -> ``Fp8GroupedLinear``; ``GroupedExperts`` and
    other experts with 3-D ``w1``/``w2``/``w3`` parameters -> ``Fp8GroupedExperts``;
    modules with torchtitan's ``_grouped_mm(*, A, B_t, offs)`` seam (torchtitan's
    ``GroupedExperts`` and its variants) keep their forward, their class becoming
    ``Fp8<class>`` (``Fp8GroupedMMSeam``), whose seam runs ``fp8_grouped_mm``;
    transformers 5 experts modules (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3, gpt-oss, ...)
    become ``Fp8<class>`` (``ops.transformers_experts``), whose forward runs the FP8 GEMMs
    with the model's own activation; one whose layout does not run in FP8 raises a
    ``ValueError`` naming it and its parameter shapes (leave it out with ``filter_fn``).
    Each module is converted in place (``convert_module_to_fp8``): the same object
    with the same parameters, hooks and state-dict keys, so FSDP2's ``fully_shard``
    and ``ops.apply_expert_parallel`` applied before or after conversion, to the
    module or a parent, keep working.

    Args:
        model: the model (a convertible module itself is converted and returned).
        recipe: an ``ops.Fp8Recipe``; rowwise by default.
        filter_fn: ``filter_fn(module, fqn) -> bool`` picks which convertible
            modules to swap (as torchao's ``quantize_``); all when ``None``.
    """
    if not isinstance(recipe, Fp8Recipe):
        raise TypeError(f"recipe must be an ops.Fp8Recipe, got {type(recipe).__name__}")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"filter_fn must be callable(module, fqn) -> bool, got {type(filter_fn).__name__}")

    def replacement(module: nn.Module, fqn: str) -> nn.Module | None:
        if filter_fn is not None and not filter_fn(module, fqn):
            return None
        return module if convert_module_to_fp8(module, recipe, fqn) else None

    return swap_modules(model, replacement)


def swap_modules(model: nn.Module, replacement: Callable[[nn.Module, str], nn.Module | None]) -> nn.Module:
    """Replace, in place, each module for which ``replacement(module, fqn)`` returns one; returns ``model``.

    Walks ``model`` from the top (``fqn`` is the dotted name, ``""`` for ``model``
    itself, which is returned replaced when it matches); the children of a
    replaced module are not visited.
    """

    def swap(module: nn.Module, fqn: str) -> nn.Module:
        new_module = replacement(module, fqn)
        if new_module is not None:
            return new_module
        for name, child in list(module.named_children()):
            new_child = swap(child, f"{fqn}.{name}" if fqn else name)
            if new_child is not child:
                setattr(module, name, new_child)
        return module

    return swap(model, "")
