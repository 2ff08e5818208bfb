"""Helion kernels for FP8 MoE training: quantization, grouped GEMMs, and the MoE layer's combine.

With no CUDA device, kernels run on CPU tensors through Triton's interpreter:
importing this package sets ``TRITON_INTERPRET=1`` in that case (unless it is
set), which works when it is imported before helion or triton
(``kernels_helion.helion_setup``), and makes the interpreter's runs faster
(``kernels_helion.interpreter_speedups``).
"""

from __future__ import annotations

from kernels_helion import helion_setup  # noqa: F401  (first: what must hold before helion loads)
from kernels_helion import interpreter_speedups  # noqa: E402

interpreter_speedups.install()  # CPU only: faster Triton interpreter runs, same results
from kernels_helion.fp8_format import FP8_DTYPES, fp8_max  # noqa: E402
from kernels_helion.quantize_rowwise import quantize_rowwise_rows, quantize_rowwise_rows_and_transpose  # noqa: E402
from kernels_helion.transpose_fp8 import transpose_fp8  # noqa: E402
from kernels_helion.transpose_token_groups import transpose_to_token_groups  # noqa: E402
from kernels_helion.quantize_rowwise_weights import (  # noqa: E402
    quantize_rowwise_expert_weights,
    quantize_rowwise_expert_weights_and_transpose,
    quantize_rowwise_expert_weights_both_layouts,
    quantize_rowwise_expert_weights_transposed,
)
from kernels_helion.quantize_rowwise_grouped import (  # noqa: E402
    quantize_rowwise_cols_grouped,
    quantize_rowwise_cols_grouped_from_transposed,
    quantize_rowwise_wgrad_operands,
)
from kernels_helion.quantize_rowwise_two_pass import quantize_rowwise_rows_and_cols_grouped  # noqa: E402
from kernels_helion.quantize_blockwise import (  # noqa: E402
    quantize_blockwise_rows,
    quantize_blockwise_cols,
    quantize_blockwise_cols_grouped,
    quantize_blockwise_rows_and_cols,
    quantize_blockwise_rows_and_cols_grouped,
    quantize_blockwise_weights,
    quantize_blockwise_weights_both_layouts,
    quantize_blockwise_weights_transposed,
)
from kernels_helion.grouped_gemm import grouped_mm_2d3d, grouped_mm_2d3d_split  # noqa: E402
from kernels_helion.grouped_gemm_swiglu import grouped_mm_swiglu  # noqa: E402
from kernels_helion.grouped_gemm_swiglu_backward import grouped_mm_swiglu_backward  # noqa: E402
from kernels_helion.swiglu import swiglu_backward, swiglu_backward_quantized, swiglu_backward_weighted  # noqa: E402
from kernels_helion.quantize_mx import (  # noqa: E402
    quantize_mx_rows,
    quantize_mx_cols,
    quantize_mx_expert_weights,
)
from kernels_helion.mx_blocked_layout import (  # noqa: E402
    to_blocked_scales,
    to_blocked_scales_grouped,
    to_blocked_scales_k_groups,
    to_blocked_scales_per_expert,
)
from kernels_helion.quantize_mx_grouped import quantize_mx_cols_grouped, quantize_mx_rows_and_cols_grouped  # noqa: E402
from kernels_helion.pad_groups import pad_token_groups, unpad_token_groups  # noqa: E402
from kernels_helion.grouped_gemm_wgrad import grouped_mm_wgrad  # noqa: E402
from kernels_helion.grouped_gemm_wgrad_bf16 import grouped_mm_wgrad_bf16  # noqa: E402
from kernels_helion.grouped_gemm_blockwise import grouped_mm_2d3d_blockwise  # noqa: E402
from kernels_helion.grouped_gemm_wgrad_blockwise import grouped_mm_wgrad_blockwise  # noqa: E402
from kernels_helion.grouped_gemm_mx import grouped_mm_2d3d_mx  # noqa: E402
from kernels_helion.grouped_gemm_wgrad_mx import grouped_mm_wgrad_mx  # noqa: E402
from kernels_helion.moe_combine import moe_combine, moe_combine_grad_probs, moe_combine_grad_rows  # noqa: E402
from kernels_helion.router_topk import router_topk, router_topk_backward  # noqa: E402
from kernels_helion.gemm_blockwise import (  # noqa: E402
    gemm_blockwise_dgrad,
    gemm_blockwise_forward,
    gemm_blockwise_wgrad,
)

__all__ = [
    "FP8_DTYPES",
    "fp8_max",
    "quantize_rowwise_rows",
    "quantize_rowwise_rows_and_transpose",
    "quantize_rowwise_expert_weights",
    "quantize_rowwise_expert_weights_transposed",
    "quantize_rowwise_expert_weights_both_layouts",
    "quantize_rowwise_expert_weights_and_transpose",
    "transpose_fp8",
    "transpose_to_token_groups",
    "quantize_rowwise_cols_grouped",
    "quantize_rowwise_cols_grouped_from_transposed",
    "quantize_rowwise_wgrad_operands",
    "quantize_rowwise_rows_and_cols_grouped",
    "quantize_blockwise_rows",
    "quantize_blockwise_cols",
    "quantize_blockwise_cols_grouped",
    "quantize_blockwise_rows_and_cols",
    "quantize_blockwise_rows_and_cols_grouped",
    "quantize_blockwise_weights",
    "quantize_blockwise_weights_both_layouts",
    "quantize_blockwise_weights_transposed",
    "grouped_mm_2d3d",
    "grouped_mm_2d3d_split",
    "grouped_mm_swiglu",
    "grouped_mm_swiglu_backward",
    "swiglu_backward",
    "swiglu_backward_quantized",
    "swiglu_backward_weighted",
    "quantize_mx_rows",
    "quantize_mx_cols",
    "quantize_mx_expert_weights",
    "to_blocked_scales",
    "to_blocked_scales_grouped",
    "to_blocked_scales_k_groups",
    "quantize_mx_cols_grouped",
    "quantize_mx_rows_and_cols_grouped",
    "to_blocked_scales_per_expert",
    "pad_token_groups",
    "unpad_token_groups",
    "grouped_mm_wgrad",
    "grouped_mm_wgrad_bf16",
    "grouped_mm_2d3d_blockwise",
    "grouped_mm_wgrad_blockwise",
    "grouped_mm_2d3d_mx",
    "grouped_mm_wgrad_mx",
    "gemm_blockwise_forward",
    "gemm_blockwise_dgrad",
    "gemm_blockwise_wgrad",
    "moe_combine",
    "moe_combine_grad_rows",
    "moe_combine_grad_probs",
    "router_topk",
    "router_topk_backward",
]
