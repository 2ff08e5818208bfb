"""FSDP2 all-gather of expert weights in FP8 (rowwise recipe), through FSDP2's tensor-subclass extension points.

``enable_fp8_all_gather(model)``, after ``ops.convert_to_fp8`` and before
``fully_shard``, wraps the data of every FP8 expert module's weights (rowwise
recipe) in ``Fp8AllGatherWeight``. FSDP2 then shards that tensor along dim 0
(the experts) and, before each forward and backward of the module:

- ``fsdp_pre_all_gather``: each rank quantizes its own shard ``(E/W, N, K)``, one
  scale per ``(e, n)`` over ``K`` (rows lie whole in a shard along ``E``, so the
  scales are those of the whole weight), and hands FSDP2 the FP8 values and the
  scales: ``N*K + 4*N`` bytes per expert instead of ``2*N*K`` in bf16. The
  quantized shard is kept until the next optimizer step or a write into the
  sharded parameter (``ops.weight_reuse``), so the gathers of all micro-batches
  between two optimizer steps quantize once;
- FSDP2 all-gathers them (its own collective, batched with the group's other parameters);
- ``fsdp_post_all_gather``: the gathered parts become an ``ops.Fp8WeightTensor``, the
  module's weight for this pass; the grouped linear uses it without quantizing it.

Gradients are bf16 (or ``mp_policy``'s dtype) and reduce-scattered by FSDP2 as
usual; the optimizer updates the high-precision shard, which the wrapper holds
(every op on it runs on that shard). ``state_dict`` gives plain tensors (DTensors
of the shard), and loading copies into the shard.

With expert parallelism (``ops.apply_expert_parallel`` first), the weights are
``DTensor``s on the EP mesh: ``enable_fp8_all_gather`` wraps their local experts, and
``fully_shard_expert_parallel`` shards those over the FSDP2 mesh; each rank then quantizes
``1 / (dp * ep)`` of the experts and gathers its EP rank's.

Refused, with an error: another recipe than rowwise; calling it after
``fully_shard``; a number of experts that the FSDP2 world size does not divide;
sharding along another dim than 0; running the wrapped module without FSDP2.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from ops.fp8_weight import Fp8WeightTensor
from ops.modules import Fp8GroupedExperts, Fp8GroupedLinear, Fp8GroupedMMSeam
from ops.op_registry import kernel_ops
from ops.weight_reuse import keep_or_quantize

# Ops whose results stay wrapped: FSDP2 pads, chunks, views and copies the weight to
# make its shard; nn.Parameter detaches it; module.to() copies it.
_PRESERVED_OPS = {
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten._pin_memory.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.chunk.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
}

class Fp8AllGatherWeight(Tensor):
    """A high-precision expert weight (or its FSDP2 shard) that FSDP2 all-gathers in FP8.

    Every op runs on the wrapped tensor ``hp`` (the optimizer's updates included); the
    ops that FSDP2 uses to shard it keep the wrapper. ``quant`` is the rowwise recipe's
    ``(float8_dtype, round_scales_to_power_of_2)``.
    """

    kernel_input_hint = (
        "an expert weight prepared for FSDP2's FP8 all-gather (ops.enable_fp8_all_gather) must be run under "
        "fully_shard, which hands the module the gathered FP8 weight"
    )

    hp: Tensor
    quant: tuple[torch.dtype, bool]

    @staticmethod
    def __new__(cls, hp: Tensor, quant: tuple[torch.dtype, bool]):
        return Tensor._make_wrapper_subclass(
            cls, hp.size(), strides=hp.stride(), storage_offset=hp.storage_offset(), dtype=hp.dtype,
            layout=hp.layout, device=hp.device, requires_grad=hp.requires_grad,
        )

    def __init__(self, hp: Tensor, quant: tuple[torch.dtype, bool]):
        self.hp = hp
        self.quant = quant

    def __repr__(self) -> str:
        return f"Fp8AllGatherWeight({self.hp!r}, quant={self.quant})"

    def __tensor_flatten__(self) -> tuple[list[str], tuple[object, ...]]:
        return ["hp"], (self.quant,)

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, Tensor], meta: tuple, outer_size, outer_stride) -> Fp8AllGatherWeight:
        return Fp8AllGatherWeight(inner["hp"], meta[0])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        quant = None

        def unwrap(t: Fp8AllGatherWeight) -> Tensor:
            nonlocal quant
            quant = t.quant
            return t.hp

        out = func(*tree_map_only(Fp8AllGatherWeight, unwrap, args), **tree_map_only(
            Fp8AllGatherWeight, unwrap, kwargs or {}))
        if func not in _PRESERVED_OPS:
            return out
        return tree_map_only(Tensor, lambda t: Fp8AllGatherWeight(t, quant), out)

    __torch_function__ = torch._C._disabled_torch_function_impl

    def fsdp_pre_all_gather(
        self,
        mesh: Any,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[Tensor, Tensor], None]:
        """This rank's shard quantized: FP8 values ``(E/W, N, K)`` and scales ``(E/W, N)``."""
        shard = self.hp
        world = mesh.size()
        if outer_size[0] % world:
            raise ValueError(
                f"FP8 all-gather needs the number of experts FSDP2 shards ({outer_size[0]}; with expert "
                f"parallelism those of one EP rank) to be a multiple of the FSDP2 mesh size ({world}): the "
                "scales cannot be padded as FSDP2 pads uneven shards"
            )
        if tuple(shard.shape[1:]) != tuple(outer_size[1:]):
            raise ValueError(
                f"FP8 all-gather needs expert weights sharded along dim 0 (experts); got a shard of shape "
                f"{tuple(shard.shape)} of a weight {tuple(outer_size)}"
            )
        quantize = lambda: kernel_ops.quantize_rowwise_expert_weights(shard.contiguous(), *self.quant)  # noqa: E731
        owner = _sharded_parameter(module, self)
        if owner is None:
            return quantize(), None
        # Kept until the next optimizer step or a write into the sharded parameter (its DTensor's
        # version counter; the shard itself is written below autograd): the gathers of every
        # micro-batch's forward and backward between two steps send the same FP8 values.
        return keep_or_quantize(shard, ("fsdp_shard", self.quant), quantize, owner=owner), None

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: Tensor | None = None,
    ) -> tuple[Fp8WeightTensor, tuple[Tensor, ...]] | None:
        """The gathered parts as the module's weight, an ``ops.Fp8WeightTensor`` of dtype ``param_dtype``."""
        if len(all_gather_outputs) != 2:
            # FSDP2 on a mesh of one rank gathers nothing and calls no fsdp_pre_all_gather.
            raise ValueError(
                "FP8 all-gather needs an FSDP2 mesh of two or more ranks (FSDP2 on one rank skips the gather); "
                "leave ops.enable_fp8_all_gather off there"
            )
        data, scales = all_gather_outputs
        if out is not None:
            # FSDP2 gathers again into the same buffers; the weight it made last time takes them.
            out.data_fp8, out.scales = data, scales
            return None
        return Fp8WeightTensor(data, scales, param_dtype, self.quant), (data, scales)


def _sharded_parameter(module: nn.Module, local: Tensor) -> Tensor | None:
    """The parameter of ``module`` whose local shard is ``local`` (FSDP2's sharded ``DTensor``), if any."""
    for p in module.parameters(recurse=False):
        if getattr(p, "_local_tensor", None) is local:
            return p
    return None


def _unwrap_state_dict(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """State-dict hook: the weights as plain tensors (DTensors of the plain shard under FSDP2), sharing storage."""
    for key, value in list(state_dict.items()):
        if not key.startswith(prefix):
            continue
        local = getattr(value, "_local_tensor", value)
        if isinstance(local, Fp8AllGatherWeight):
            if local is value:
                state_dict[key] = local.hp
            else:
                state_dict[key] = DTensor.from_local(
                    local.hp, value.device_mesh, value.placements, shape=value.shape, stride=value.stride()
                )


def _expert_parallel_local(module: nn.Module, data: Tensor) -> Tensor:
    """The local tensor of an expert weight sharded by ``ops.apply_expert_parallel`` (a 1-D ``DTensor`` on the EP
    mesh of a module that has its dispatcher), else ``data``: FSDP2 shards that local tensor over its own mesh."""
    if (
        isinstance(data, DTensor)
        and getattr(module, "expert_parallel", None) is not None
        and data.device_mesh.ndim == 1  # fully_shard makes it 2-D (its mesh and the EP mesh)
    ):
        return data._local_tensor
    return data


def enable_fp8_all_gather(model: nn.Module) -> nn.Module:
    """Make FSDP2 all-gather the expert weights of ``model``'s FP8 modules in FP8; returns ``model``.

    Call after ``ops.convert_to_fp8`` (rowwise recipe) and before ``fully_shard``.
    Each ``Fp8GroupedExperts`` / ``Fp8GroupedLinear``, and each module with torchtitan's GEMM
    seam that names its weights (``Fp8GroupedMMSeam.weight_names``), gets its weights' data wrapped in
    ``Fp8AllGatherWeight`` (the same ``Parameter`` objects, their values unchanged) and
    a state-dict hook that returns them plain. See the module docstring for what
    is gathered and what is refused.

    Raises:
        ValueError: a module's recipe is not rowwise, or ``model`` has no FP8 expert module.
        RuntimeError: ``fully_shard`` was already applied (its parameters are sharded DTensors).
    """
    found = False
    for fqn, module in model.named_modules():
        if not isinstance(module, (Fp8GroupedExperts, Fp8GroupedLinear, Fp8GroupedMMSeam)) or not module.weight_names:
            continue
        found = True
        recipe = module.recipe
        if not recipe.takes_prequantized_weights:
            raise ValueError(
                f"{fqn or 'model'}: FP8 all-gather gathers the rowwise recipe's weight form, which its recipe "
                f"{recipe.name!r} does not take (Fp8Recipe.takes_prequantized_weights)"
            )
        quant = (recipe.float8_dtype, recipe.round_scales_to_power_of_2)
        for name in module.weight_names:
            param = getattr(module, name)
            raw = param.data  # a new tensor object at each access
            data = _expert_parallel_local(module, raw)
            if isinstance(data, Fp8AllGatherWeight):
                continue
            if type(data) is not Tensor:
                raise RuntimeError(
                    f"{fqn}.{name} is a {type(data).__name__}: call ops.enable_fp8_all_gather before "
                    "fully_shard (FSDP2 reads its all-gather hooks when it shards a parameter)"
                )
            value = Fp8AllGatherWeight(data.detach(), quant)
            if data is not raw:  # the local experts of an expert-parallel DTensor
                value = DTensor.from_local(
                    value, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                    stride=param.stride(),
                )
            wrapped = nn.Parameter(value, requires_grad=param.requires_grad)
            # The same Parameter object takes the wrapper (as module.to() does with swapped tensors).
            torch.utils.swap_tensors(param, wrapped)
        module._register_state_dict_hook(_unwrap_state_dict)
    if not found:
        raise ValueError("model has no FP8 expert module: call ops.convert_to_fp8 first")
    return model


def fully_shard_expert_parallel(model: nn.Module, dp_mesh: Any, **fully_shard_kwargs: Any) -> list[nn.Module]:
    """``fully_shard`` each expert-parallel experts module of ``model`` over ``dp_mesh``; returns those modules.

    For FSDP2 with expert parallelism (``ops.apply_expert_parallel`` first, over the ``ep``
    dimension of a mesh whose ``dp`` dimension is ``dp_mesh``): each rank's experts are
    sharded over the ranks that hold the same experts, and their gradients divided by
    ``dp * ep``, the number of ranks whose tokens they saw (the EP exchange sums the ``ep``
    ranks' tokens, FSDP2's reduce-scatter the ``dp`` groups'), as FSDP2 divides the other
    parameters' by all ranks. Shard the rest of the model (the blocks, the root) over all
    ranks afterwards, as usual. ``fully_shard_kwargs`` go to ``fully_shard``.

    Raises:
        ValueError: ``model`` holds no expert-parallel experts module, ``dp_mesh`` is not 1-D,
            or it has one rank and the experts' weights are set up for FP8 all-gather.
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    found = [m for m in model.modules() if getattr(m, "expert_parallel", None) is not None]
    if not found:
        raise ValueError("model holds no expert-parallel experts module: call ops.apply_expert_parallel first")
    if getattr(dp_mesh, "ndim", None) != 1:
        raise ValueError(f"dp_mesh must be a 1-D DeviceMesh (the FSDP2 dimension), got {dp_mesh!r}")
    gathered_in_fp8 = any(isinstance(getattr(p, "_local_tensor", p), Fp8AllGatherWeight) for m in found for p in m.parameters())
    if dp_mesh.size() == 1 and gathered_in_fp8:
        raise ValueError(
            "FP8 all-gather needs an FSDP2 mesh of two or more ranks (FSDP2 on one rank skips the gather); "
            "dp_mesh has one: leave ops.enable_fp8_all_gather off"
        )
    for experts in found:
        fully_shard(experts, mesh=dp_mesh, **fully_shard_kwargs)
        experts.set_gradient_divide_factor(dp_mesh.size() * experts.expert_parallel.ep)
        if dist.get_backend(dp_mesh.get_group()) == "gloo":  # gloo has no PREMUL_SUM: FSDP2 divides, then sums
            experts.set_force_sum_reduction_for_comms(True)
    return found
