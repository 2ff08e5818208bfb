"""Expert modules (bf16 references and FP8 counterparts) and ``convert_to_fp8``, which swaps one for the other.

- ``GroupedLinear`` / ``Fp8GroupedLinear``: a bank of per-expert linears,
  ``weight (E, N, K)``, ``forward(x, offs)``.
- ``GroupedExperts`` / ``Fp8GroupedExperts``: SwiGLU experts with torchtitan's
  parameter layout (``w1 (E, hidden, dim)``, ``w2 (E, dim, hidden)``,
  ``w3 (E, hidden, dim)``) and call, ``forward(x, num_tokens_per_expert)``.

``convert_to_fp8(model, recipe, filter_fn)`` converts the selected modules in
place: each stays the same object with the same ``Parameter`` objects and only
changes class, so optimizers, state dicts, hooks and FSDP2's ``fully_shard``
applied before or after conversion keep working.
Torchtitan's own ``GroupedExperts`` (any module holding 3-D ``w1``/``w2``/``w3``
parameters in that layout) is converted as well.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ops.functional import DEFAULT_RECIPE, fp8_grouped_linear, fp8_grouped_linears
from ops.recipes import Fp8Recipe

FilterFn = Callable[[nn.Module, str], bool]


def _expert_weight(num_experts: int, rows: int, cols: int, dtype: torch.dtype | None, device) -> nn.Parameter:
    weight = torch.empty(num_experts, rows, cols, dtype=dtype, device=device)
    # nn.Linear's default: uniform(+-1/sqrt(fan_in)) per expert.
    bound = cols**-0.5
    return nn.Parameter(nn.init.uniform_(weight, -bound, bound))


def _offsets(num_tokens_per_expert: Tensor) -> Tensor:
    return torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)


class GroupedLinear(nn.Module):
    """bf16 reference: ``out[rows of g] = x[rows of g] @ weight[g]^T`` through ``torch._grouped_mm``."""

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


class Fp8GroupedLinear(GroupedLinear):
    """``GroupedLinear`` whose GEMMs (forward, dgrad, wgrad) run in FP8 with ``recipe``."""

    def __init__(self, *args, recipe: Fp8Recipe = DEFAULT_RECIPE, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.recipe = recipe

    @classmethod
    def from_module(cls, module: nn.Module, recipe: Fp8Recipe = DEFAULT_RECIPE) -> Fp8GroupedLinear:
        """An ``Fp8GroupedLinear`` sharing ``module.weight`` (no copy)."""
        fp8 = cls.__new__(cls)
        nn.Module.__init__(fp8)
        fp8.weight = module.weight
        fp8.recipe = recipe
        return fp8

    def forward(self, x: Tensor, offs: Tensor) -> Tensor:
        return fp8_grouped_linear(x, self.weight, offs, self.recipe)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}"


class GroupedExperts(nn.Module):
    """bf16 reference SwiGLU experts, torchtitan's layout: ``w2[g] @ (silu(w1[g] x) * w3[g] x)``."""

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

    def forward(self, x: Tensor, num_tokens_per_expert: Tensor) -> Tensor:
        """``x (T, dim)`` sorted by expert; ``num_tokens_per_expert (E,)``; returns ``(T, dim)``."""
        offs = _offsets(num_tokens_per_expert)
        gate, up = self.gate_and_up(x, offs)
        return self.grouped_mm(F.silu(gate) * up, self.w2, offs).type_as(x)

    def gate_and_up(self, x: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
        """``(x @ w1[g]^T, x @ w3[g]^T)``: the two projections of the same tokens."""
        return self.grouped_mm(x, self.w1, offs), self.grouped_mm(x, self.w3, offs)

    def extra_repr(self) -> str:
        e, hidden, dim = self.w1.shape
        return f"dim={dim}, hidden_dim={hidden}, num_experts={e}"


class Fp8GroupedExperts(GroupedExperts):
    """``GroupedExperts`` whose three grouped GEMMs run in FP8 with ``recipe``."""

    def __init__(self, *args, recipe: Fp8Recipe = DEFAULT_RECIPE, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.recipe = recipe

    @classmethod
    def from_module(cls, module: nn.Module, recipe: Fp8Recipe = DEFAULT_RECIPE) -> Fp8GroupedExperts:
        """An ``Fp8GroupedExperts`` sharing ``module``'s ``w1``/``w2``/``w3`` (no copy)."""
        fp8 = cls.__new__(cls)
        nn.Module.__init__(fp8)
        fp8.num_experts = module.w1.shape[0]
        fp8.w1, fp8.w2, fp8.w3 = module.w1, module.w2, module.w3
        fp8.recipe = recipe
        return fp8

    def grouped_mm(self, x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
        return fp8_grouped_linear(x, w, offs, self.recipe)

    def gate_and_up(self, x: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
        # One quantization of x (and one saved FP8 x^T) for both GEMMs, where the recipe can share it.
        gate, up = fp8_grouped_linears(x, (self.w1, self.w3), offs, self.recipe)
        return gate, up

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}"


def _is_grouped_experts(module: nn.Module) -> bool:
    """Torchtitan-style experts: 3-D ``w1 (E, H, D)``, ``w2 (E, D, H)``, ``w3 (E, H, D)`` parameters."""
    params = [getattr(module, name, None) for name in ("w1", "w2", "w3")]
    if not all(isinstance(p, nn.Parameter) and p.dim() == 3 for p in params):
        return False
    w1, w2, w3 = params
    e, hidden, dim = w1.shape
    return tuple(w3.shape) == (e, hidden, dim) and tuple(w2.shape) == (e, dim, hidden)


def _fp8_class(module: nn.Module) -> type[nn.Module] | None:
    """The FP8 module class ``module`` converts to, or ``None`` if it is not convertible (or already FP8)."""
    if isinstance(module, (Fp8GroupedLinear, Fp8GroupedExperts)):
        return None
    if isinstance(module, GroupedLinear):
        return Fp8GroupedLinear
    if _is_grouped_experts(module):
        return Fp8GroupedExperts
    return None


# --- in-place conversion, keeping FSDP2's state ---------------------------------
# fully_shard keeps its state on the module object: its hooks, its parameters'
# (module, name) records, and its class, swapped for a subclass of (FSDPModule, cls).
# Converting in place changes only the class (and adds the recipe), so all of that
# survives and conversion after fully_shard behaves as before it.

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


def convert_module_to_fp8(module: nn.Module, recipe: Fp8Recipe = DEFAULT_RECIPE) -> bool:
    """Make ``module`` its FP8 counterpart in place (same object, parameters, hooks, FSDP2 state); ``False`` if not convertible.

    ``GroupedLinear`` becomes ``Fp8GroupedLinear``; ``GroupedExperts`` and torchtitan-style
    experts become ``Fp8GroupedExperts`` (their other attributes stay on the object).
    """
    fp8_cls = _fp8_class(module)
    if fp8_cls is None:
        return False
    if fp8_cls is Fp8GroupedExperts and not hasattr(module, "num_experts"):
        module.num_experts = module.w1.shape[0]
    module.__class__ = _converted_class(type(module), fp8_cls)
    module.recipe = recipe
    return True


def convert_to_fp8(
    model: nn.Module, recipe: Fp8Recipe = DEFAULT_RECIPE, filter_fn: FilterFn | None = None
) -> nn.Module:
    """Swap the grouped GEMM modules of ``model`` for FP8 ones, in place; returns ``model``.

    Converted: ``GroupedLinear`` -> ``Fp8GroupedLinear``; ``GroupedExperts`` and
    torchtitan-style experts (3-D ``w1``/``w2``/``w3`` parameters) ->
    ``Fp8GroupedExperts``. Each module is converted in place
    (``convert_module_to_fp8``): the same object with the same parameters, so
    FSDP2's ``fully_shard`` applied before or after conversion, to the module or
    a parent, keeps working.

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
        return module if convert_module_to_fp8(module, recipe) else None

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
