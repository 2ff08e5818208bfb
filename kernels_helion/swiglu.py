"""SwiGLU's backward in one pass: ``(grad_h, gate_up) -> grad_gate_up``.

With ``h = silu(gate) * up`` (``kernels_helion.grouped_gemm_swiglu``'s epilogue) and
``s = sigmoid(gate)``::

    grad_gate = grad_h * up * s * (1 + gate * (1 - s))
    grad_up   = grad_h * silu(gate)

computed in float32 from the stored values and rounded once (``swiglu_grad_values``, the
formulas every SwiGLU backward kernel here uses). The result keeps
``gate_up``'s layout (each row its gate half, then its up half), which is the left
operand of the up-projection's dgrad (one GEMM over both halves: ``dx = grad_gate @
w1 + grad_up @ w3``) and, transposed, of its two wgrads. Eager PyTorch spends five
passes over these tensors (sigmoid, products, sums) where this reads each once.

``swiglu_backward_quantized`` also quantizes the result for the folded dgrad, rowwise
to FP8 with each row times its group's multipliers, as ``quantize_rowwise_rows(...,
offs=, row_multipliers=)`` does, bitwise: a program holds whole rows; its first loop
over the column tiles computes each tile, stores it (``grad_h``'s dtype) and reduces
the folded row's amax; its second loop computes the tiles again from the same rounded
values and stores them in FP8 with the row's scale. It re-reads ``grad_h`` and
``gate_up`` rather than the stored tiles, which other threads of the program wrote
with no barrier in between. Against ``swiglu_backward`` then ``quantize_rowwise_rows``,
this saves a launch and the quantizer's read of ``grad_gate_up``.

``swiglu_backward_weighted`` takes ``grad_h`` per unit routing weight (the down-projection's
dgrad of each pair's gradient row before its weight ``w``) and also returns the routing
weights' gradient: ``grad_h = u * w`` (rounded to the dtype), and the weight's gradient
``<u, h>`` with ``h = silu(gate) * up`` recomputed as the up-projection's epilogue made it
(``swiglu_value``, rounded alike). That is the combine's ``<grad_out[token], y[pair]>``
(``y = h @ w2^T``), so the combine's rows ``y`` need not be kept for backward. A program
holds a ``(rows, columns)`` tile; each tile's partial sums go to their own slot and the
``ceil(H / columns)`` partials are added after the kernel in a fixed order (no atomics).
"""

from __future__ import annotations

from collections.abc import Callable

import helion
import helion.language as hl
import torch

from autotune_cache import select_config
from autotune_cache.registry import register_tuning
from kernels_helion._launch import launch, require_interpreter_on_cpu
from kernels_helion.fp8_format import (
    abs_nan_as_inf,
    amax_to_scale,
    check_fp8_dtype,
    fp8_max,
    is_fnuz,
    scale_reciprocal,
    to_fp8_bits,
)
from kernels_helion.group_offsets import group_lanes
from kernels_helion.quantize_rowwise import group_multipliers, row_groups
from kernels_helion.validation import FLOAT_INPUT_DTYPES, check_offsets, check_same_device, check_scales, check_tensor
from kernels_helion.tuning import SWIGLU_SHAPES, random_bf16, routed_offsets, vary

# block_sizes = [rows, hidden columns] per program.
DEFAULT_CONFIG = helion.Config(block_sizes=[16, 256], num_warps=4, num_stages=1)
# block_sizes = [rows, hidden columns of the amax loop, hidden columns of the FP8 loop].
QUANTIZED_CONFIG = helion.Config(block_sizes=[4, 256, 256], num_warps=4, num_stages=1)


def swiglu_value(gate: torch.Tensor, sig: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Device side: ``h = silu(gate) * up`` in float32 from float32 ``gate``, ``sig = sigmoid(gate)``
    and ``up``, multiplied in the order every SwiGLU kernel here uses (callers round it once)."""
    return gate * sig * up


def swiglu_grad_values(
    grad: torch.Tensor, gate: torch.Tensor, sig: torch.Tensor, up: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Device side: ``(grad_gate, grad_up)`` rounded to ``dtype`` from float32 ``grad`` (of ``h``),
    ``gate``, ``sig = sigmoid(gate)`` and ``up`` (the module docstring's formulas)."""
    grad_gate = (grad * up * sig * (1.0 + gate * (1.0 - sig))).to(dtype)
    return grad_gate, (grad * gate * sig).to(dtype)


def swiglu_grads(
    grad_h: torch.Tensor, gate_up: torch.Tensor, tile_m: hl.Tile, tile_n: hl.Tile, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Device side: ``(grad_gate, grad_up)`` of a ``(tile_m, tile_n)`` tile, computed in float32 from
    ``grad_h (M, H)`` and ``gate_up (M, 2, H)`` and rounded to ``dtype`` (see the module docstring)."""
    gate = gate_up[tile_m, 0, tile_n].to(torch.float32)
    return swiglu_grad_values(
        grad_h[tile_m, tile_n].to(torch.float32), gate, torch.sigmoid(gate), gate_up[tile_m, 1, tile_n].to(torch.float32),
        dtype,
    )


@helion.kernel(static_shapes=False)
def swiglu_backward_kernel(
    grad_h: torch.Tensor,
    gate_up: torch.Tensor,
    pair_weights: torch.Tensor,
    weight_grad_parts: torch.Tensor,
    weighted: hl.constexpr,
) -> torch.Tensor:
    """``grad_h (M, H)``, ``gate_up (M, 2, H)`` -> ``(M, 2, H)`` of ``grad_h``'s dtype.

    ``weighted``: ``grad_h`` is per unit routing weight; each row's is ``pair_weights (M,)``, and
    ``weight_grad_parts (ceil(H / BLOCK_N), M)`` gets each column tile's part of ``<grad_h, h>``
    (unused otherwise)."""
    m, n = grad_h.shape
    out = torch.empty([m, 2, n], dtype=grad_h.dtype, device=grad_h.device)
    for tile_m, tile_n in hl.tile([m, n]):
        grad = grad_h[tile_m, tile_n].to(torch.float32)
        gate = gate_up[tile_m, 0, tile_n].to(torch.float32)
        up = gate_up[tile_m, 1, tile_n].to(torch.float32)
        sig = torch.sigmoid(gate)
        if weighted:
            # h as the up-projection's epilogue made it (rounded alike); lanes past H hold 0.
            h = swiglu_value(gate, sig, up).to(out.dtype).to(torch.float32)
            weight_grad_parts[tile_n.id, tile_m] = torch.sum(grad * h, dim=1)
            grad = (grad * pair_weights[tile_m][:, None]).to(out.dtype).to(torch.float32)
        grad_gate, grad_up = swiglu_grad_values(grad, gate, sig, up, out.dtype)
        out[tile_m, 0, tile_n] = grad_gate
        out[tile_m, 1, tile_n] = grad_up
    return out


@helion.kernel(static_shapes=False)
def swiglu_backward_quantized_kernel(
    grad_h: torch.Tensor,
    gate_up: torch.Tensor,
    offs: torch.Tensor,
    row_multipliers: torch.Tensor,
    max_fp8: hl.constexpr,
    fnuz: hl.constexpr,
    round_scales_to_power_of_2: hl.constexpr,
    groups_pow2: hl.constexpr,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``grad_h (M, H)``, ``gate_up (M, 2, H)``, ``row_multipliers`` flattened ``(G * 2H,)`` ->
    ``(M, 2, H)`` of ``grad_h``'s dtype, its folded rows' fp8 bits ``(M, 2, H)`` uint8 and scales ``(M,)``."""
    m, n = grad_h.shape
    out = torch.empty([m, 2, n], dtype=grad_h.dtype, device=grad_h.device)
    q_bits = torch.empty([m, 2, n], dtype=torch.uint8, device=grad_h.device)
    scales = torch.empty([m], dtype=torch.float32, device=grad_h.device)
    for tile_m in hl.tile(m):
        # Rows past offs[-1] belong to no group (multiplier 1).
        group = row_groups(offs, tile_m.index, m, groups_pow2)
        routed = (group < offs.size(0))[:, None]
        row_start = group[:, None] * (2 * n)
        amax = hl.zeros([tile_m], dtype=torch.float32)
        for tile_n in hl.tile(n):
            grad_gate, grad_up = swiglu_grads(grad_h, gate_up, tile_m, tile_n, out.dtype)
            out[tile_m, 0, tile_n] = grad_gate
            out[tile_m, 1, tile_n] = grad_up
            cols = tile_n.index[None, :]
            in_row = cols < n
            gate_mult = group_multipliers(row_multipliers, row_start + cols, routed, in_row)
            up_mult = group_multipliers(row_multipliers, row_start + n + cols, routed, in_row)
            # Lanes past H hold 0 (masked loads) times 1: they leave the amax as it is.
            tile_amax = torch.maximum(
                torch.amax(abs_nan_as_inf(grad_gate.to(torch.float32) * gate_mult), dim=1),
                torch.amax(abs_nan_as_inf(grad_up.to(torch.float32) * up_mult), dim=1),
            )
            amax = torch.maximum(amax, tile_amax)
        scale = amax_to_scale(amax, max_fp8, round_scales_to_power_of_2)
        scales[tile_m] = scale
        inv_scale = scale_reciprocal(scale)[:, None]
        for tile_n in hl.tile(n):
            grad_gate, grad_up = swiglu_grads(grad_h, gate_up, tile_m, tile_n, out.dtype)
            cols = tile_n.index[None, :]
            in_row = cols < n
            gate_mult = group_multipliers(row_multipliers, row_start + cols, routed, in_row)
            up_mult = group_multipliers(row_multipliers, row_start + n + cols, routed, in_row)
            q_bits[tile_m, 0, tile_n] = to_fp8_bits(grad_gate.to(torch.float32) * gate_mult * inv_scale, max_fp8, fnuz)
            q_bits[tile_m, 1, tile_n] = to_fp8_bits(grad_up.to(torch.float32) * up_mult * inv_scale, max_fp8, fnuz)
    return out, q_bits, scales


def check_swiglu_inputs(grad_h: torch.Tensor, gate_up: torch.Tensor) -> tuple[int, int]:
    """Raise unless ``grad_h (M, H)`` and ``gate_up (M, 2 * H)`` are as the launchers take them; ``(M, H)``."""
    check_tensor("grad_h", grad_h, ndim=2, dtypes=FLOAT_INPUT_DTYPES)
    check_tensor("gate_up", gate_up, ndim=2, dtypes=(grad_h.dtype,))
    check_same_device("gate_up", gate_up, grad_h.device)
    m, n = grad_h.shape
    if tuple(gate_up.shape) != (m, 2 * n):
        raise ValueError(f"gate_up must be (M, 2 * H) = {(m, 2 * n)} for grad_h {tuple(grad_h.shape)}, got {tuple(gate_up.shape)}")
    return m, n


def swiglu_backward(grad_h: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """The gradients of ``gate`` and ``up`` from that of ``h = silu(gate) * up``.

    Args:
        grad_h: ``(M, H)`` bf16 / fp16 / fp32, contiguous.
        gate_up: ``(M, 2 * H)`` of ``grad_h``'s dtype, contiguous: each row its gate, then its up.

    Returns:
        ``(M, 2 * H)`` of ``grad_h``'s dtype: each row ``grad_gate``, then ``grad_up``.
    """
    m, n = check_swiglu_inputs(grad_h, gate_up)
    require_interpreter_on_cpu(grad_h)
    if m == 0 or n == 0:
        return torch.empty((m, 2 * n), dtype=grad_h.dtype, device=grad_h.device)
    config = select_config("swiglu_backward", {"M": m, "N": n}, DEFAULT_CONFIG)
    unused = torch.empty((0,), dtype=torch.float32, device=grad_h.device)
    args = (grad_h, gate_up.view(m, 2, n), unused, unused.view(0, 0), False)
    return launch(swiglu_backward_kernel, args, config).view(m, 2 * n)


def swiglu_backward_weighted(
    grad_h: torch.Tensor, gate_up: torch.Tensor, pair_weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU's backward of ``grad_h * pair_weights[:, None]``, and the routing weights' gradient.

    ``grad_h`` is the gradient of each pair's ``h`` per unit routing weight (the down-projection's
    dgrad of the combine's gradient rows before their weights); see the module docstring.

    Args:
        grad_h: ``(M, H)`` bf16 / fp16 / fp32, contiguous.
        gate_up: ``(M, 2 * H)`` of ``grad_h``'s dtype, contiguous: each row its gate, then its up.
        pair_weights: ``(M,)`` float32: each row's routing weight ``w``.

    Returns:
        ``(grad_gate_up, pair_weight_grads)``: ``swiglu_backward(grad_h * w, gate_up)`` with the
        product rounded to ``grad_h``'s dtype first, ``(M, 2 * H)``; and ``(M,)`` float32, each
        row's ``<grad_h, h>`` (``h = silu(gate) * up`` rounded to the dtype), summed in float32.
    """
    m, n = check_swiglu_inputs(grad_h, gate_up)
    check_scales("pair_weights", pair_weights, (m,), grad_h.device)
    require_interpreter_on_cpu(grad_h)
    if m == 0 or n == 0:
        device = grad_h.device
        return torch.empty((m, 2 * n), dtype=grad_h.dtype, device=device), torch.zeros((m,), device=device)
    config = select_config("swiglu_backward_weighted", {"M": m, "N": n}, DEFAULT_CONFIG)
    block_n = config.config["block_sizes"][1]
    parts = torch.empty(((n + block_n - 1) // block_n, m), dtype=torch.float32, device=grad_h.device)
    args = (grad_h, gate_up.view(m, 2, n), pair_weights, parts, True)
    out = launch(swiglu_backward_kernel, args, config)
    # The partial sums of each row, added in a fixed order.
    return out.view(m, 2 * n), parts.sum(dim=0)


def swiglu_backward_quantized(
    grad_h: torch.Tensor,
    gate_up: torch.Tensor,
    offs: torch.Tensor,
    row_multipliers: torch.Tensor,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    round_scales_to_power_of_2: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``swiglu_backward(grad_h, gate_up)`` and its folded rows quantized rowwise, in one kernel.

    Args:
        grad_h, gate_up: as in ``swiglu_backward``.
        offs: ``(G,)`` int32 cumulative group ends of the ``M`` rows.
        row_multipliers: ``(G, 2 * H)`` float32: row ``t`` of group ``g`` is quantized as
            ``grad_gate_up[t, :] * row_multipliers[g, :]`` (rows past ``offs[-1]``: multiplier 1).
            The fused up-projection's dgrad passes the forward weight scales ``[s_w1 | s_w3]``.
        float8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e4m3fnuz``.
        round_scales_to_power_of_2: round each scale up to a power of two.

    Returns:
        ``(grad_gate_up, grad_fp8, scales)``: ``grad_gate_up`` is ``swiglu_backward``'s
        ``(M, 2 * H)`` result, ``(grad_fp8, scales)`` are bitwise
        ``quantize_rowwise_rows(grad_gate_up, float8_dtype, round_scales_to_power_of_2, offs, row_multipliers)``.
    """
    m, n = check_swiglu_inputs(grad_h, gate_up)
    if n == 0:
        raise ValueError("grad_h must have at least one column (H >= 1), got shape (M, 0)")
    check_offsets(offs, grad_h.device)
    check_scales("row_multipliers", row_multipliers, (offs.size(0), 2 * n), grad_h.device)
    check_fp8_dtype(float8_dtype)
    require_interpreter_on_cpu(grad_h)
    if m == 0:
        device = grad_h.device
        return (
            torch.empty((0, 2 * n), dtype=grad_h.dtype, device=device),
            torch.empty((0, 2 * n), dtype=float8_dtype, device=device),
            torch.empty((0,), dtype=torch.float32, device=device),
        )
    config = select_config("swiglu_backward_quantized", {"M": m, "N": n}, QUANTIZED_CONFIG)
    quant = (fp8_max(float8_dtype), is_fnuz(float8_dtype), round_scales_to_power_of_2)
    args = (grad_h, gate_up.view(m, 2, n), offs, row_multipliers.view(-1), *quant, group_lanes(offs.size(0)))
    out, q_bits, scales = launch(swiglu_backward_quantized_kernel, args, config)
    return out.view(m, 2 * n), q_bits.view(float8_dtype).view(m, 2 * n), scales


# Tuning: at the MoE layer benchmark's fused up-projections.
def _tuning_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
    grad_h = random_bf16(shape["M"], shape["N"], device=device)
    gate_up = random_bf16(shape["M"], 2 * shape["N"], device=device)
    return lambda: swiglu_backward(grad_h, gate_up)


def _tuning_space(arch: str) -> list[helion.Config]:
    return vary(DEFAULT_CONFIG, block_sizes=[[16, 256], [8, 256], [32, 128], [4, 512]], num_warps=[4, 8])


register_tuning("swiglu_backward", DEFAULT_CONFIG, _tuning_space, [{"M": m, "N": n} for m, n, _, _ in SWIGLU_SHAPES],
                _tuning_call, {"M": 70, "N": 48})


def _weighted_tuning_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
    grad_h = random_bf16(shape["M"], shape["N"], device=device)
    gate_up = random_bf16(shape["M"], 2 * shape["N"], device=device)
    weights = torch.rand(shape["M"], device=device)
    return lambda: swiglu_backward_weighted(grad_h, gate_up, weights)


# exact=False: the weights' gradient is summed per column tile, so other tile widths add in another order.
register_tuning(
    "swiglu_backward_weighted", DEFAULT_CONFIG, _tuning_space, [{"M": m, "N": n} for m, n, _, _ in SWIGLU_SHAPES],
    _weighted_tuning_call, {"M": 70, "N": 48}, exact=False,
)


def _quantized_tuning_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
    grad_h = random_bf16(shape["M"], shape["N"], device=device)
    gate_up = random_bf16(shape["M"], 2 * shape["N"], device=device)
    offs = routed_offsets(shape["M"], shape["G"], device)
    multipliers = torch.rand(shape["G"], 2 * shape["N"], device=device) + 0.5
    return lambda: swiglu_backward_quantized(grad_h, gate_up, offs, multipliers)


def _quantized_tuning_space(arch: str) -> list[helion.Config]:
    return vary(QUANTIZED_CONFIG, block_sizes=[[4, 256, 256], [2, 512, 512], [8, 128, 128], [4, 512, 256]],
                num_warps=[4, 8])


register_tuning(
    "swiglu_backward_quantized", QUANTIZED_CONFIG, _quantized_tuning_space,
    [{"M": m, "N": n, "G": g} for m, n, _, g in SWIGLU_SHAPES], _quantized_tuning_call, {"M": 70, "N": 48, "G": 3},
)
