"""Autograd of the FP8 grouped linear, MXFP8 recipe: ``out = x @ w[g]^T`` per token group ``g``.

Every GEMM operand is float8_e4m3fn with one e8m0 (power-of-two) scale per 32
elements along its contraction dimension (OCP MX; rounding ``recipe.mx_rounding``):

- forward: ``x`` 1x32 along ``K``, ``w`` 1x32 along ``K`` per expert;
- dgrad: ``grad_out`` 1x32 along ``N``, ``w`` 32x1 along ``N``, stored ``(E, K, N)``;
- wgrad: ``grad_out`` and ``x`` 32x1 along the tokens per group, stored
  transposed (``kernels_helion.quantize_mx_grouped``: blocks are 32-token cells
  cut at group boundaries, so any group sizes work without padding).

``x`` and ``grad_out`` each get both of their quantizations from one read
(``quantize_mx_dual_grouped``).

Saved for backward (never a bf16 copy; ``x`` and ``w`` only by reference when chosen):
  - ``recipe.save_fp8_weight``: the 32x1 ``W^T`` in FP8 ``(E, K, N)`` + scales;
    otherwise ``w`` (a parameter: no extra memory), quantized in backward.
  - ``recipe.save_fp8_input``: ``x^T`` in FP8 ``(K, M)`` + per-group 32x1 scales
    (made by the forward's read of ``x``); otherwise ``x``, quantized in backward.
Both choices give bitwise the same results.

GEMMs: on GPUs without MX tensor cores (Hopper) and on the CPU interpreter, the
emulated kernels (``grouped_mm_2d3d_mx``, ``grouped_mm_wgrad_mx``: one FP8 dot
per 32-wide block, scaled in fp32). On Blackwell (compute capability 10.x),
PyTorch's native MXFP8 grouped GEMM (``torch._scaled_grouped_mm`` with
float8_e8m0fnu scales in the blocked layout); see ``native_mx_grouped_mm_available``.
``offs`` gets no gradient. Nothing syncs with the host.
"""

from __future__ import annotations

import torch
from torch import Tensor

import ops.custom_ops_mx  # noqa: F401  (defines the fp8moe ops used below)
from kernels_helion.mx_format import MX_BLOCK_SIZE
from ops.op_registry import kernel_ops
from ops.recipes import Fp8Recipe, register_recipe

_ops = kernel_ops

_E8M0 = torch.float8_e8m0fnu


# --- Blackwell: PyTorch's native MXFP8 grouped GEMM ----------------------------------------
#
# NOT RUN HERE: no sm100 GPU was available to this project, so this path has
# never run on the hardware. It follows the contract of torch._scaled_grouped_mm
# with float8_e8m0fnu scales as PyTorch's shape checks and torchao's MXFP8 MoE
# training use it (bf16 output only; 2D x 3D with the A scales blocked per group
# of rows, the B scales blocked per expert and flattened; 2D x 2D with the scales
# blocked per group along the contraction); tests/test_ops_mx.py checks these
# arguments against a float64 model of that contract. Its 2D x 2D (wgrad) call
# also needs every token group size to be a multiple of 32 (then our 32-token
# cells are the groups' own blocks) and M a multiple of 16; torchtitan's MXFP8
# token-group alignment gives that. On sm90 (Hopper) the same call fails and
# leaves the CUDA context unusable, so it is reachable only through
# native_mx_grouped_mm_available.


def native_mx_grouped_mm_available(t: Tensor) -> bool:
    """Whether ``t``'s device runs PyTorch's native MXFP8 grouped GEMM: an NVIDIA GPU of compute capability 10.x.

    False on sm90 (Hopper) and every other architecture, and on ROCm and CPU.
    """
    return t.device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(t.device)[0] == 10


def _native_grouped_mm_2d3d(a: Tensor, a_scales: Tensor, b: Tensor, b_scales: Tensor, offs: Tensor) -> Tensor:
    """sm100 only: ``grouped_mm_2d3d_mx``'s contract (rows past ``offs[-1]`` are 0), bf16."""
    a_blocked, _ = _ops.mx_blocked_scales_grouped(a_scales, offs)
    b_blocked = _ops.mx_blocked_scales_per_expert(b_scales).flatten(1)
    out = torch._scaled_grouped_mm(
        a, b.transpose(-2, -1), a_blocked.view(_E8M0), b_blocked.view(_E8M0), offs=offs, out_dtype=torch.bfloat16
    )
    routed = torch.arange(a.shape[0], device=a.device, dtype=offs.dtype) < offs[-1]
    return torch.where(routed[:, None], out, 0)


def _native_grouped_mm_wgrad(
    a_t: Tensor, a_scales: Tensor, b_t: Tensor, b_scales: Tensor, offs: Tensor, block_offs: Tensor
) -> Tensor:
    """sm100 only: ``grouped_mm_wgrad_mx``'s contract for token groups of multiples of 32, bf16."""
    a_blocked, _ = _ops.mx_blocked_scales_k_groups(a_scales.t(), block_offs)
    b_blocked, _ = _ops.mx_blocked_scales_k_groups(b_scales.t(), block_offs)
    return torch._scaled_grouped_mm(
        a_t, b_t.t(), a_blocked.view(_E8M0), b_blocked.view(_E8M0), offs=offs, out_dtype=torch.bfloat16
    )


# --- GEMM dispatch ---------------------------------------------------------------------------


def _grouped_mm(
    a: Tensor, a_scales: Tensor, b: Tensor, b_scales: Tensor, offs: Tensor, out_dtype: torch.dtype
) -> Tensor:
    if native_mx_grouped_mm_available(a):
        return _native_grouped_mm_2d3d(a, a_scales, b, b_scales, offs).to(out_dtype)
    return _ops.grouped_mm_2d3d_mx(a, a_scales, b, b_scales, offs, out_dtype)


def _grouped_mm_wgrad(
    a_t: Tensor,
    a_scales: Tensor,
    b_t: Tensor,
    b_scales: Tensor,
    offs: Tensor,
    block_offs: Tensor,
    out_dtype: torch.dtype,
) -> Tensor:
    if native_mx_grouped_mm_available(a_t):
        return _native_grouped_mm_wgrad(a_t, a_scales, b_t, b_scales, offs, block_offs).to(out_dtype)
    return _ops.grouped_mm_wgrad_mx(a_t, a_scales, b_t, b_scales, offs, block_offs, out_dtype)


class MXFP8GroupedLinear(torch.autograd.Function):
    """``(x (M, K), w (E, N, K), offs (E,)) -> (M, N)`` with MXFP8 GEMMs."""

    @staticmethod
    def forward(
        ctx,
        x: Tensor,
        w: Tensor,
        offs: Tensor,
        rounding: str,
        out_dtype: torch.dtype,
        save_fp8_input: bool,
        save_fp8_weight: bool,
    ) -> Tensor:
        needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # Saved slots: x, xt, xt_scales (wgrad); w, wt, wt_scales (dgrad); None if unused.
        saved_x = xt = xt_scales = saved_w = wt = wt_scales = None
        if needs_dw and save_fp8_input:
            # The block map (last output) is recomputed with grad_out's in backward.
            x_fp8, x_scales, xt, xt_scales, _ = _ops.quantize_mx_dual_grouped(x, offs, rounding)
        else:
            x_fp8, x_scales = _ops.quantize_mx_dim0(x, rounding)
            saved_x = x if needs_dw else None
        w_fp8, w_scales = _ops.quantize_mx_expert_weights(w, rounding, False)
        if needs_dx and save_fp8_weight:
            wt, wt_scales = _ops.quantize_mx_expert_weights(w, rounding, True)
        elif needs_dx:
            saved_w = w
        out = _grouped_mm(x_fp8, x_scales, w_fp8, w_scales, offs, out_dtype)
        ctx.save_for_backward(saved_x, xt, xt_scales, saved_w, wt, wt_scales, offs)
        ctx.rounding = rounding
        ctx.x_dtype, ctx.w_dtype = x.dtype, w.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        x, xt, xt_scales, w, wt, wt_scales, offs = ctx.saved_tensors
        rounding = ctx.rounding
        # Autograd may hand over an expanded (stride-0) gradient; kernels need rows.
        grad_out = grad_out.contiguous()
        dx = dw = None
        if needs_dw:
            if needs_dx:
                go_fp8, go_scales, got, got_scales, block_offs = _ops.quantize_mx_dual_grouped(grad_out, offs, rounding)
            else:
                got, got_scales, block_offs = _ops.quantize_mx_dim1_grouped(grad_out, offs, rounding)
            if xt is None:
                xt, xt_scales, _ = _ops.quantize_mx_dim1_grouped(x, offs, rounding)
            dw = _grouped_mm_wgrad(got, got_scales, xt, xt_scales, offs, block_offs, ctx.w_dtype)
        elif needs_dx:
            go_fp8, go_scales = _ops.quantize_mx_dim0(grad_out, rounding)
        if needs_dx:
            if wt is None:
                wt, wt_scales = _ops.quantize_mx_expert_weights(w, rounding, True)
            dx = _grouped_mm(go_fp8, go_scales, wt, wt_scales, offs, ctx.x_dtype)
        return dx, dw, None, None, None, None, None


def _check_mx_shapes(w: Tensor) -> None:
    _, n, k = w.shape
    for name, size in (("K", k), ("N", n)):
        if size % MX_BLOCK_SIZE:
            raise ValueError(
                f"the mxfp8 recipe needs {name} to be a multiple of the MX block size {MX_BLOCK_SIZE}, "
                f"got w of shape {tuple(w.shape)}"
            )


@register_recipe("mxfp8")
def mxfp8_grouped_linear(x: Tensor, w: Tensor, offs: Tensor, recipe: Fp8Recipe, out_dtype: torch.dtype) -> Tensor:
    """The MXFP8 recipe's grouped linear (inputs already validated by ``ops.functional``; K, N multiples of 32)."""
    _check_mx_shapes(w)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return MXFP8GroupedLinear.apply(
            x, w, offs, recipe.mx_rounding, out_dtype, recipe.save_fp8_input, recipe.save_fp8_weight
        )
    # Inference: no transposed operands, nothing saved.
    x_fp8, x_scales = _ops.quantize_mx_dim0(x, recipe.mx_rounding)
    w_fp8, w_scales = _ops.quantize_mx_expert_weights(w, recipe.mx_rounding, False)
    return _grouped_mm(x_fp8, x_scales, w_fp8, w_scales, offs, out_dtype)
