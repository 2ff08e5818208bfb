"""FP8 grouped GEMMs in torchtitan 0.3's MoE experts, switched on from torchtitan's config.

Torchtitan 0.3 builds its model from a config tree and changes that tree, before the
model is built, with ``ModelConfigConverter``s (listed in a config_registry function)
and with ``@override`` factories (listed in ``override.imports``, on the command line
too). This module provides one of each; both replace every experts config in the tree
(``GroupedExperts.Config`` and its subclasses, gpt-oss's among them) with its FP8
counterpart, ``Fp8ExpertsConfig``, whose ``build()`` builds torchtitan's module and
converts it in place with ``ops.convert_module_to_fp8``: the module keeps its class's
forward, parameters and state-dict keys, and its ``_grouped_mm`` runs
``ops.fp8_grouped_mm`` with the config's ``recipe``.

- override, for a job's command line or ``Trainer.Config.override.imports``::

      --override.imports ops.torchtitan.fp8_grouped_experts
      --override.imports 'ops.torchtitan.fp8_grouped_experts={"recipe": "blockwise"}'

- converter, in a config_registry function::

      model_registry("30B-A3B", converters=[Fp8GroupedExpertsConverter.Config(recipe="rowwise")])

``recipe`` is an ``ops.Fp8Recipe`` name (``ops.registered_recipes()``), with that
recipe's default options.

Parallelism: torchtitan's own ``fully_shard`` and token dispatchers apply as usual
after the converter. FSDP2 gathers the experts' weights in their own dtype and each
pass quantizes the gathered weights (``ops.modules.recipe_for_module``), or, with
``fp8_all_gather=True`` (rowwise recipe, torchtitan's ``GroupedExperts``), in FP8: the
built module's ``w1_EFD``/``w2_EDF``/``w3_EFD`` are prepared for ``ops.enable_fp8_all_gather``
before torchtitan shards them, each rank quantizes its shard once per optimizer step, and
the forward's ``w.bfloat16().transpose(-2, -1)`` keeps the gathered FP8 weight
(``ops.Fp8WeightTensor``) for the GEMM seam. It needs FSDP2 over two or more ranks on the
experts (a one-rank mesh gathers nothing and is refused at the first forward); without
``fully_shard`` the weights run as plain ones. Expert parallelism exchanges the tokens in
bf16, or, with ``fp8_dispatch=True`` (rowwise recipe), its dispatch all-to-all in FP8: the
converter gives every routed-experts config ``ops.torchtitan_dispatch``'s dispatcher, in place of
torchtitan's standard one (the override ``ops.torchtitan_dispatch.fp8_token_dispatch`` does the
same from the command line); with no EP mesh nothing changes.

    --override.imports 'ops.torchtitan.fp8_grouped_experts={"recipe": "rowwise", "fp8_all_gather": true}' \
        ops.torchtitan_dispatch.fp8_token_dispatch

Importing this module registers the override; ``import ops`` does not import torchtitan.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from torchtitan.components.quantization import QuantizationConverter
from torchtitan.config import derive, override
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.protocols.module import Module

from ops.fsdp import enable_fp8_all_gather
from ops.modules import convert_module_to_fp8
from ops.recipes import Fp8Recipe, check_recipe_name
from ops.torchtitan_dispatch import check_dispatch_recipe, fp8_dispatch_configs

DEFAULT_RECIPE_NAME = "rowwise"
# torchtitan's GroupedExperts weights, each (E, N, K) as its forward hands them to the GEMM seam transposed.
GROUPED_EXPERTS_WEIGHTS = ("w1_EFD", "w2_EDF", "w3_EFD")

__all__ = [
    "DEFAULT_RECIPE_NAME",
    "Fp8ExpertsConfig",
    "Fp8GroupedExpertsConverter",
    "fp8_experts_config",
    "fp8_experts_configs",
    "fp8_grouped_experts",
]


def check_fp8_all_gather(fp8_all_gather: object, recipe: str, option: str) -> bool:
    """``fp8_all_gather`` if it is a bool, and ``False`` or with a recipe whose weights FSDP2 can gather in FP8;
    else a ``ValueError`` naming ``option``."""
    if not isinstance(fp8_all_gather, bool):
        raise ValueError(f"{option} must be a bool, got {fp8_all_gather!r}")
    if fp8_all_gather and not Fp8Recipe(name=recipe).takes_prequantized_weights:
        raise ValueError(
            f"{option}: FSDP2 gathers the rowwise recipe's weight form in FP8, which recipe {recipe!r} does not take"
        )
    return fp8_all_gather


class Fp8ExpertsConfig:
    """Base of the FP8 experts configs: ``fp8_experts_config`` derives one per torchtitan experts config class.

    Such a config has its torchtitan class's fields and ``recipe``; ``build()``
    builds the torchtitan module and converts it with ``ops.convert_module_to_fp8``.
    """

    __slots__ = ()
    recipe: str
    fp8_all_gather: bool

    def __post_init__(self) -> None:
        check_recipe_name(self.recipe, f"{type(self).__qualname__}.recipe")
        check_fp8_all_gather(self.fp8_all_gather, self.recipe, f"{type(self).__qualname__}.fp8_all_gather")
        base_post_init = getattr(super(), "__post_init__", None)
        if base_post_init is not None:
            base_post_init()

    def build(self, **kwargs: Any) -> Module:
        """Torchtitan's experts module, its grouped GEMMs in FP8 with ``self.recipe``."""
        module = super().build(**kwargs)
        if not convert_module_to_fp8(module, Fp8Recipe(name=self.recipe)):
            raise TypeError(
                f"{type(module).__name__} has no FP8 counterpart: its grouped GEMMs do not go through "
                "torchtitan's _grouped_mm(*, A, B_t, offs) seam"
            )
        if self.fp8_all_gather:
            if type(module).forward is not GroupedExperts.forward:
                raise TypeError(
                    f"fp8_all_gather: {type(module).__name__} has its own forward; FP8 all-gather needs torchtitan's "
                    f"GroupedExperts.forward, which hands the GEMM seam {list(GROUPED_EXPERTS_WEIGHTS)} as "
                    "w.bfloat16().transpose(-2, -1) and nothing else"
                )
            module.weight_names = GROUPED_EXPERTS_WEIGHTS
            enable_fp8_all_gather(module)
        return module


@functools.cache
def _fp8_config_class(config_cls: type[GroupedExperts.Config]) -> type:
    """``config_cls`` with a ``recipe`` field, whose ``build()`` gives the FP8 module (one class per ``config_cls``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Fp8ExpertsConfig, config_cls):
        recipe: str = DEFAULT_RECIPE_NAME
        fp8_all_gather: bool = False

    owner = config_cls._owner.__name__ if config_cls._owner is not None else config_cls.__name__
    Config.__qualname__ = f"Fp8{owner}.Config"
    Config.__module__ = __name__
    return Config


def fp8_experts_config(
    config: GroupedExperts.Config, recipe: str = DEFAULT_RECIPE_NAME, fp8_all_gather: bool = False
) -> GroupedExperts.Config:
    """The FP8 counterpart of one experts config: its fields, ``recipe`` and ``fp8_all_gather``; an FP8 config
    is returned as it is."""
    if isinstance(config, Fp8ExpertsConfig):
        return config
    check_recipe_name(recipe, "recipe")
    check_fp8_all_gather(fp8_all_gather, recipe, "fp8_all_gather")
    return derive(config, _fp8_config_class(type(config)), recipe=recipe, fp8_all_gather=fp8_all_gather)


def fp8_experts_configs(
    model_config: Module.Config,
    recipe: str = DEFAULT_RECIPE_NAME,
    fqns: list[str] | tuple[str, ...] = (),
    fp8_all_gather: bool = False,
) -> Module.Config:
    """Replace, in ``model_config``'s tree, each experts config whose FQN contains one of ``fqns`` (all when
    empty) with its FP8 counterpart; returns the root (replaced if it is an experts config itself).

    Raises:
        ValueError: ``recipe`` is not a registered recipe name, or no experts config is selected.
    """
    check_recipe_name(recipe, "recipe")
    check_fp8_all_gather(fp8_all_gather, recipe, "fp8_all_gather")
    selected = [
        (fqn, config, parent, attr)
        for fqn, config, parent, attr in model_config.traverse(GroupedExperts.Config)
        if not fqns or any(name in fqn for name in fqns)
    ]
    if not selected:
        raise ValueError(
            f"{type(model_config).__qualname__} has no MoE experts config (GroupedExperts.Config)"
            + (f" whose FQN contains one of fqns={list(fqns)}" if fqns else "")
        )
    for _fqn, config, parent, attr in selected:
        fp8 = fp8_experts_config(config, recipe, fp8_all_gather)
        if parent is None:
            model_config = fp8
        elif isinstance(parent, list):
            parent[attr] = fp8
        else:
            setattr(parent, attr, fp8)
    return model_config


class Fp8GroupedExpertsConverter(QuantizationConverter):
    """Model converter: the MoE experts' grouped GEMMs in FP8 (``ops.fp8_grouped_mm``).

    A ``QuantizationConverter``, so torchtitan orders it before LoRA. Its inherited
    ``model_compile_enabled`` changes nothing here.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        recipe: str = DEFAULT_RECIPE_NAME
        """``ops.Fp8Recipe`` name: "rowwise", "blockwise" or "mxfp8" (``ops.registered_recipes()``)."""
        fqns: list[str] = field(default_factory=list)
        """Convert only the experts whose FQN contains one of these; all of them when empty."""
        fp8_all_gather: bool = False
        """FSDP2 gathers the experts' weights in FP8 (rowwise recipe; torchtitan's ``GroupedExperts``; FSDP2 over
        two or more ranks)."""
        fp8_dispatch: bool = False
        """Expert parallelism's dispatch all-to-all moves the token rows in FP8 (rowwise recipe; torchtitan's
        standard dispatcher, ``ops.torchtitan_dispatch``); every routed-experts config, whatever ``fqns``."""

        def __post_init__(self) -> None:
            check_recipe_name(self.recipe, "Fp8GroupedExpertsConverter.Config.recipe")
            check_fp8_all_gather(self.fp8_all_gather, self.recipe, "Fp8GroupedExpertsConverter.Config.fp8_all_gather")
            option = "Fp8GroupedExpertsConverter.Config.fp8_dispatch"
            if not isinstance(self.fp8_dispatch, bool):
                raise ValueError(f"{option} must be a bool, got {self.fp8_dispatch!r}")
            if self.fp8_dispatch:
                check_dispatch_recipe(self.recipe, option)

    def __init__(self, config: Config) -> None:
        self.config = config

    def convert(self, model_config: Module.Config) -> Module.Config:
        """``model_config`` with its experts configs FP8 (``fp8_experts_configs``) and, with ``fp8_dispatch``,
        its token dispatchers too (``fp8_dispatch_configs``)."""
        config = self.config
        model_config = fp8_experts_configs(model_config, config.recipe, config.fqns, config.fp8_all_gather)
        return fp8_dispatch_configs(model_config, config.recipe) if config.fp8_dispatch else model_config


@override(target=GroupedExperts.Config, description="ops: FP8 grouped GEMMs in the MoE experts")
def fp8_grouped_experts(
    config: GroupedExperts.Config, *, recipe: str = DEFAULT_RECIPE_NAME, fp8_all_gather: bool = False
) -> GroupedExperts.Config:
    """Override factory (``--override.imports ops.torchtitan.fp8_grouped_experts``): each experts config's FP8
    counterpart; ``recipe`` and ``fp8_all_gather`` come from the entry's kwargs,
    ``'...fp8_grouped_experts={"recipe": "mxfp8"}'``."""
    option = "ops.torchtitan.fp8_grouped_experts's"
    check_recipe_name(recipe, f"{option} recipe")
    check_fp8_all_gather(fp8_all_gather, recipe, f"{option} fp8_all_gather")
    return fp8_experts_config(config, recipe, fp8_all_gather)
