"""What users import: FP8 grouped GEMMs for MoE training, their modules and recipes.

    import ops
    out = ops.fp8_grouped_linear(x, w, offs)              # w: (E, N, K)
    gate, up = ops.fp8_grouped_linears(x, (w1, w3), offs)  # x quantized once for both
    out = ops.fp8_grouped_mm(x, w.transpose(-2, -1), offs=offs)  # torch._grouped_mm's call
    ops.convert_to_fp8(model, ops.Fp8Recipe(), filter_fn=lambda m, fqn: "experts" in fqn)
    ops.convert_to_float8_blockwise(model)                # dense nn.Linear -> Float8BlockwiseLinear
    # Each weight's FP8 forms are kept until it changes (Fp8Recipe.keep_quantized_weights):
    # once per optimizer step, whatever the number of micro-batches.
    ops.Fp8Recipe(options=ops.RowwiseOptions(wgrad_accumulation="main_grad"))  # dW added in the GEMM
    ops.zero_main_grads(model)                            # ... into fp32 p.main_grad (Megatron's form)
    ops.Fp8Recipe(options=ops.RowwiseOptions(deferred_wgrad=True))  # w1/w3 wgrad once a step:
    ops.run_deferred_wgrads(model)                        # ... after the last micro-batch's backward
    moe = ops.MoE(dim, hidden, num_experts, top_k)         # router + top-k + SwiGLU experts + combine
    ops.apply_expert_parallel(moe, mesh, fp8_dispatch=True)  # experts sharded over GPUs (after convert_to_fp8)
    ops.apply_expert_parallel(moe, mesh, capacity=C)        # ... without host syncs: C rows per pair of ranks
    ops.enable_fp8_all_gather(model)                      # FSDP2 gathers expert weights in FP8 (docs/fsdp.md)
    ops.fully_shard_expert_parallel(model, mesh["dp"])    # FSDP2 with EP: each rank's experts over dp

The kernels are also custom ops, ``torch.ops.fp8moe.*`` (see ``ops.op_registry``),
so ``torch.compile(fullgraph=True)`` traces through all of this.
"""

from ops.recipes import Fp8Recipe, MxOptions, RowwiseOptions, register_recipe, registered_recipes  # isort: skip
from ops.autograd import RowwiseFp8GroupedLinear
from ops.autograd_blockwise import BlockwiseFp8GroupedLinear
from ops.autograd_mx import MXFP8GroupedLinear
from ops.fp8_weight import Fp8WeightTensor
from ops.fsdp import Fp8AllGatherWeight, enable_fp8_all_gather, fully_shard_expert_parallel
from ops.functional import fp8_grouped_linear, fp8_grouped_linears, fp8_grouped_mm
from ops.linear_blockwise import (
    Float8BlockwiseLinear,
    Float8BlockwiseLinearFunction,
    convert_to_float8_blockwise,
    float8_blockwise_linear,
)
from ops.ep_overflow import CapacityOverflowError
from ops.expert_parallel import ExpertParallel, apply_expert_parallel
from ops.memory import saved_tensor_bytes
from ops.moe import MoE, combine_pairs, router_topk, sort_by_expert
from ops.modules import (
    Fp8GroupedExperts,
    Fp8GroupedLinear,
    Fp8GroupedMMSeam,
    GroupedExperts,
    GroupedLinear,
    convert_module_to_fp8,
    convert_to_fp8,
)
from ops.grad_accumulation import zero_main_grads
from ops.deferred_wgrad import drop_deferred_wgrads, has_deferred_wgrads, run_deferred_wgrads
from ops.weight_reuse import release_quantized_weights, reuse_quantized_weights

__all__ = [
    "BlockwiseFp8GroupedLinear",
    "CapacityOverflowError",
    "ExpertParallel",
    "Float8BlockwiseLinear",
    "Float8BlockwiseLinearFunction",
    "Fp8AllGatherWeight",
    "Fp8GroupedExperts",
    "Fp8GroupedLinear",
    "Fp8GroupedMMSeam",
    "Fp8Recipe",
    "Fp8WeightTensor",
    "GroupedExperts",
    "GroupedLinear",
    "MoE",
    "MXFP8GroupedLinear",
    "MxOptions",
    "RowwiseFp8GroupedLinear",
    "RowwiseOptions",
    "apply_expert_parallel",
    "combine_pairs",
    "convert_module_to_fp8",
    "convert_to_fp8",
    "enable_fp8_all_gather",
    "convert_to_float8_blockwise",
    "float8_blockwise_linear",
    "fp8_grouped_linear",
    "fp8_grouped_linears",
    "fp8_grouped_mm",
    "fully_shard_expert_parallel",
    "register_recipe",
    "registered_recipes",
    "release_quantized_weights",
    "reuse_quantized_weights",
    "saved_tensor_bytes",
    "router_topk",
    "sort_by_expert",
    "zero_main_grads",
    "run_deferred_wgrads",
    "drop_deferred_wgrads",
    "has_deferred_wgrads",
]


def __dir__() -> list[str]:
    """``dir(ops)`` lists the public API, ``__all__``; submodules and other attributes stay importable."""
    return sorted(__all__)
