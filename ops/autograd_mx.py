"""The MXFP8 recipe's grouped linear: its kernels, in ``ops.grouped_linear_autograd``'s data flow.

Every GEMM operand is float8_e4m3fn with one e8m0 (power-of-two) scale per 32
elements along its contraction dimension (OCP MX; rounding ``recipe.mx_rounding``):

- forward: ``x`` 1x32 along ``K``, ``w`` 1x32 along ``K`` per expert;
- dgrad: ``grad_out`` 1x32 along ``N``, ``w`` 32x1 along ``N``, stored ``(E, K, N)``;
- wgrad: ``grad_out`` and ``x`` 32x1 along the tokens per group, stored
  transposed (``kernels_helion.quantize_mx_grouped``: blocks are 32-token cells
  cut at group boundaries, so any group sizes work without padding).

``x`` and ``grad_out`` each get both of their quantizations from one read
(``quantize_mx_rows_and_cols_grouped``).

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
from ops.grouped_linear_autograd import (
    QuantizedActivation,
    QuantizedWeight,
    QuantOptions,
    RecipeKernels,
    grouped_linear_function,
    register_grouped_linear,
)
from ops.op_registry import kernel_ops
from ops.recipes import Fp8Recipe, MxOptions

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
    a_blocked, _ = _ops.to_blocked_scales_grouped(a_scales, offs)
    b_blocked = _ops.to_blocked_scales_per_expert(b_scales).flatten(1)
    out = torch._scaled_grouped_mm(
        a, b.transpose(-2, -1), a_blocked.view(_E8M0), b_blocked.view(_E8M0), offs=offs, out_dtype=torch.bfloat16
    )
    routed = torch.arange(a.shape[0], device=a.device, dtype=offs.dtype) < offs[-1]
    return torch.where(routed[:, None], out, 0)


def _native_grouped_mm_wgrad(
    a_t: Tensor, a_scales: Tensor, b_t: Tensor, b_scales: Tensor, offs: Tensor, block_offs: Tensor
) -> Tensor:
    """sm100 only: ``grouped_mm_wgrad_mx``'s contract for token groups of multiples of 32, bf16."""
    a_blocked, _ = _ops.to_blocked_scales_k_groups(a_scales.t(), block_offs)
    b_blocked, _ = _ops.to_blocked_scales_k_groups(b_scales.t(), block_offs)
    return torch._scaled_grouped_mm(
        a_t, b_t.t(), a_blocked.view(_E8M0), b_blocked.view(_E8M0), offs=offs, out_dtype=torch.bfloat16
    )


class MXKernels(RecipeKernels):
    """The MXFP8 recipe's kernels; ``quant`` is ``(mx_rounding,)``."""

    def quant_options(self, recipe: Fp8Recipe) -> QuantOptions:
        return (recipe.mx_rounding,)

    def check_weight(self, w: Tensor) -> None:
        _, n, k = w.shape
        for name, size in (("K", k), ("N", n)):
            if size % MX_BLOCK_SIZE:
                raise ValueError(
                    f"the mxfp8 recipe needs {name} to be a multiple of the MX block size {MX_BLOCK_SIZE}, "
                    f"got w of shape {tuple(w.shape)}"
                )

    def quantize_activation(
        self, t: Tensor, offs: Tensor, quant: QuantOptions, rowwise: bool, wgrad: bool
    ) -> QuantizedActivation:
        if rowwise and wgrad:
            return QuantizedActivation(*_ops.quantize_mx_rows_and_cols_grouped(t, offs, *quant))
        if rowwise:
            return QuantizedActivation(*_ops.quantize_mx_rows(t, *quant), None, None, None)
        return QuantizedActivation(None, None, *_ops.quantize_mx_cols_grouped(t, offs, *quant))

    def quantize_weight(self, w: Tensor, quant: QuantOptions, forward: bool, transposed: bool) -> QuantizedWeight:
        # Two reads of w for both forms: the 1x32 and 32x1 blocks of a weight tile are cast apart anyway.
        w_fp8 = w_scales = wt = wt_scales = None
        if forward:
            w_fp8, w_scales = _ops.quantize_mx_expert_weights(w, *quant, False)
        if transposed:
            wt, wt_scales = _ops.quantize_mx_expert_weights(w, *quant, True)
        return QuantizedWeight(w_fp8, w_scales, wt, wt_scales)

    def grouped_mm(
        self, a: Tensor, a_scales: Tensor, b: Tensor, b_scales: Tensor, offs: Tensor, out_dtype: torch.dtype
    ) -> Tensor:
        if native_mx_grouped_mm_available(a):
            return _native_grouped_mm_2d3d(a, a_scales, b, b_scales, offs).to(out_dtype)
        return _ops.grouped_mm_2d3d_mx(a, a_scales, b, b_scales, offs, out_dtype)

    def grouped_mm_wgrad(
        self, grad_out: QuantizedActivation, x: QuantizedActivation, offs: Tensor, out_dtype: torch.dtype
    ) -> Tensor:
        args = (grad_out.data_t, grad_out.scales_t, x.data_t, x.scales_t, offs, grad_out.wgrad_layout)
        if native_mx_grouped_mm_available(grad_out.data_t):
            return _native_grouped_mm_wgrad(*args).to(out_dtype)
        return _ops.grouped_mm_wgrad_mx(*args, out_dtype)


MXFP8GroupedLinear = grouped_linear_function("MXFP8GroupedLinear", MXKernels())
register_grouped_linear("mxfp8", MXFP8GroupedLinear, MxOptions)
