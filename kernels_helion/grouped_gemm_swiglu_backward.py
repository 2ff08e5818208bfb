"""The MoE down-projection's dgrad as one FP8 grouped GEMM, with SwiGLU's backward and the routing weights' gradient in its epilogue.

For the pairs of a routed batch sorted by expert (row ``i`` of group ``g``), with
``a`` the rows of the combine's gradient ``grad_out[token of i]`` (not yet multiplied by
the pair's routing weight ``w[i]``), quantized rowwise, and ``b[g] = w2[g]^T``::

    u[i]          = (a[i] @ b[g]^T) * a_scales[i] * b_scales[g]     the gradient of h[i] per unit weight
    grad_h[i]     = u[i] * w[i]                                     rounded to gate_up's dtype
    grad_w[i]     = sum_j u[i, j] * h[i, j]                         float32 (the routing weight's gradient)
    grad_gate[i], grad_up[i] = SwiGLU's backward of grad_h[i]       (kernels_helion.swiglu, same formulas)

with ``gate``, ``up`` read from ``gate_up`` (kept by the up-projection,
``kernels_helion.grouped_gemm_swiglu``) and ``h = silu(gate) * up`` recomputed from them
exactly as that kernel's epilogue computed it (rounded to the same dtype). What the
unfused path writes and reads again, ``grad_h (M, H)`` and the combine's output rows
``y (M, D)`` kept for the weights' gradient (``moe_combine_grad_probs``), is neither
written nor kept: the weights' gradient is ``<grad_out[t], y[i]> = <u[i], h[i]>``.

A tile holds ``BLOCK_N`` of the ``H`` columns, so ``grad_w`` is summed over the tile's
columns in the epilogue and the ``ceil(H / BLOCK_N)`` partial sums are added by one
small reduction after the kernel, in a fixed order (no atomics: run-to-run bitwise).

Scheduling is ``grouped_mm_2d3d``'s: work items of row tiles cut from each group's
start (``work_item_rows``), any group sizes, no host sync; rows past ``offs[-1]``
get zeros.
"""

from __future__ import annotations

from collections.abc import Callable

import helion
import helion.language as hl
import torch

from autotune_cache import select_config
from autotune_cache.registry import register_tuning
from kernels_helion._launch import launch, on_cpu, split_leading_block, with_tma
from kernels_helion.group_offsets import group_lanes
from kernels_helion.grouped_gemm import check_2d3d_operands, tile_dot, work_item_rows
from kernels_helion.swiglu import swiglu_grad_values, swiglu_value
from kernels_helion.validation import FLOAT_INPUT_DTYPES, check_same_device, check_scales, check_tensor
from kernels_helion.tuning import GEMM_TEST_SHAPE, SWIGLU_SHAPES, fp8_operands, gemm_space, random_bf16, routed_offsets

# block_sizes = [BLOCK_M, BLOCK_N (hidden columns), BLOCK_K]: the epilogue holds the accumulator,
# gate and up tiles at once, so its tile is grouped_mm_2d3d's half (128x128, not 128x256).
DEFAULT_CONFIG = helion.Config(
    block_sizes=[128, 128, 128],
    num_warps=8,
    num_stages=3,
    l2_groupings=[8],
    pid_type="persistent_interleaved",
)
CPU_CONFIG = helion.Config(block_sizes=[16, 32, 64], num_warps=4, num_stages=1)


@helion.kernel(static_shapes=False)
def grouped_mm_swiglu_backward_kernel(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    offs: torch.Tensor,
    gate_up: torch.Tensor,
    pair_weights: torch.Tensor,
    grad_gate_up: torch.Tensor,
    weight_grad_parts: torch.Tensor,
    groups_pow2: hl.constexpr,
    block_m: hl.constexpr,
    upcast_operands: hl.constexpr,
) -> None:
    """``grad_gate_up (M, 2, H)`` and ``weight_grad_parts (ceil(H / BLOCK_N), M)`` written for the ``M`` pairs."""
    m, k = a.shape
    _, n, _ = b.shape
    num_groups = offs.size(0)
    row_items = (m + (num_groups + 1) * (block_m - 1)) // block_m
    for item, tile_n in hl.tile([row_items, n], block_size=[1, None]):
        group, row_begin, row_end = work_item_rows(offs, item.begin, m, block_m, groups_pow2)
        for tile_m in hl.tile(row_begin, row_end, block_size=block_m):
            in_rows = tile_m.index < row_end
            in_item = in_rows[:, None]
            if group < num_groups:
                for g in hl.grid(group, group + 1):
                    row_scales = a_scales[tile_m]
                    col_scales = b_scales[g, tile_n]
                    weights = pair_weights[tile_m]
                    # The epilogue's rows, read before the K loop so that their latency hides under it.
                    gate_in = gate_up[tile_m, 0, tile_n]
                    up_in = gate_up[tile_m, 1, tile_n]
                    acc = hl.zeros([tile_m, tile_n], dtype=torch.float32)
                    for tile_k in hl.tile(k):
                        acc = tile_dot(acc, a[tile_m, tile_k], b[g, tile_n, tile_k], upcast_operands)
                    unit_grad = acc * (row_scales[:, None] * col_scales[None, :])
                    gate = gate_in.to(torch.float32)
                    up = up_in.to(torch.float32)
                    sig = torch.sigmoid(gate)
                    # h as the up-projection's epilogue made it (grouped_mm_swiglu_kernel), rounded alike.
                    h = swiglu_value(gate, sig, up).to(gate_up.dtype).to(torch.float32)
                    hl.store(weight_grad_parts, [tile_n.id, tile_m], torch.sum(unit_grad * h, dim=1), extra_mask=in_rows)
                    grad_h = (unit_grad * weights[:, None]).to(gate_up.dtype).to(torch.float32)
                    grad_gate, grad_up = swiglu_grad_values(grad_h, gate, sig, up, gate_up.dtype)
                    hl.store(grad_gate_up, [tile_m, 0, tile_n], grad_gate, extra_mask=in_item)
                    hl.store(grad_gate_up, [tile_m, 1, tile_n], grad_up, extra_mask=in_item)
            if group == num_groups:
                zeros = hl.zeros([tile_m, tile_n], dtype=grad_gate_up.dtype)
                hl.store(weight_grad_parts, [tile_n.id, tile_m], hl.zeros([tile_m], dtype=torch.float32), extra_mask=in_rows)
                hl.store(grad_gate_up, [tile_m, 0, tile_n], zeros, extra_mask=in_item)
                hl.store(grad_gate_up, [tile_m, 1, tile_n], zeros, extra_mask=in_item)


def grouped_mm_swiglu_backward(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    offs: torch.Tensor,
    gate_up: torch.Tensor,
    pair_weights: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The down-projection's dgrad with SwiGLU's backward and the routing weights' gradient (see the module docstring).

    Args:
        a: ``(M, D)`` float8_e4m3fn, contiguous: each pair's row of the combine's gradient,
            not multiplied by its routing weight, quantized rowwise (with the folded dgrad:
            times its group's ``w2`` scales).
        a_scales: ``(M,)`` float32 row scales of ``a``.
        b: ``(E, H, D)`` float8 (``a``'s dtype), contiguous: ``w2``'s dgrad form ``w2^T``.
        b_scales: ``(E, H)`` float32 row scales of ``b`` (ones when folded into ``a``).
        offs: ``(E,)`` int32 cumulative group ends over the ``M`` pairs.
        gate_up: ``(M, 2 * H)`` bf16 / fp16 / fp32, contiguous: the up-projection's kept
            ``[gate | up]`` rows (``grouped_mm_swiglu``).
        pair_weights: ``(M,)`` float32: each pair's routing weight.

    Returns:
        ``(grad_gate_up, pair_weight_grads)``: ``(M, 2 * H)`` of ``gate_up``'s dtype, each row
        ``grad_gate`` then ``grad_up``; ``(M,)`` float32, each pair's routing weight's
        gradient. Rows past ``offs[-1]`` are 0.
    """
    check_tensor("gate_up", gate_up, ndim=2, dtypes=FLOAT_INPUT_DTYPES)
    m, k, num_experts, n = check_2d3d_operands(a, b, offs, gate_up.dtype)
    check_same_device("gate_up", gate_up, a.device)
    if tuple(gate_up.shape) != (m, 2 * n):
        raise ValueError(f"gate_up must be (M, 2 * H) = {(m, 2 * n)} for a {tuple(a.shape)} and b {tuple(b.shape)}, got {tuple(gate_up.shape)}")
    check_scales("a_scales", a_scales, (m,), a.device)
    check_scales("b_scales", b_scales, (num_experts, n), a.device)
    check_scales("pair_weights", pair_weights, (m,), a.device)
    grad_gate_up = torch.empty((m, 2, n), dtype=gate_up.dtype, device=a.device)
    if m == 0:
        return grad_gate_up.view(0, 2 * n), torch.zeros((0,), dtype=torch.float32, device=a.device)
    cpu = on_cpu(a)
    key = {"M": m, "N": n, "K": k, "G": num_experts}
    block_m, kernel_config = split_leading_block(
        select_config("grouped_mm_swiglu_backward", key, CPU_CONFIG if cpu else DEFAULT_CONFIG)
    )
    block_n = kernel_config.config["block_sizes"][0]
    parts = torch.empty(((n + block_n - 1) // block_n, m), dtype=torch.float32, device=a.device)
    args = (
        a, a_scales, b, b_scales, offs, gate_up.view(m, 2, n), pair_weights, grad_gate_up, parts,
        group_lanes(num_experts), block_m, cpu,
    )
    if not cpu:
        # The GEMM operands through TMA; the epilogue's rows (partial tiles of work items) through pointers.
        kernel_config = with_tma(grouped_mm_swiglu_backward_kernel, args, kernel_config, loads=("a", "b"))
    launch(grouped_mm_swiglu_backward_kernel, args, kernel_config)
    # The partial sums of each row, added in a fixed order.
    return grad_gate_up.view(m, 2 * n), parts.sum(dim=0)


# Tuning: the MoE layer benchmark's down-projections (M pairs, H hidden columns, D = K).
def _tuning_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
    a, a_scales = fp8_operands(shape["M"], shape["K"], device=device)
    b, b_scales = fp8_operands(shape["G"], shape["N"], shape["K"], device=device)
    gate_up = random_bf16(shape["M"], 2 * shape["N"], device=device)
    weights = torch.rand(shape["M"], device=device)
    offs = routed_offsets(shape["M"], shape["G"], device)
    return lambda: grouped_mm_swiglu_backward(a, a_scales, b, b_scales, offs, gate_up, weights)


register_tuning(
    "grouped_mm_swiglu_backward",
    DEFAULT_CONFIG,
    gemm_space(
        DEFAULT_CONFIG, [[128, 128, 128], [128, 64, 128], [64, 128, 128], [128, 128, 64], [128, 256, 64]],
        nvidia_warps=(4, 8),
    ),
    [{"M": m, "N": n, "K": k, "G": g} for m, n, k, g in SWIGLU_SHAPES],
    _tuning_call,
    GEMM_TEST_SHAPE,
    exact=False,
)
