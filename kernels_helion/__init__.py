"""Helion kernels for FP8 MoE training: quantization and grouped GEMMs.

With no CUDA device, kernels run on CPU tensors through Triton's interpreter:
importing this package sets ``TRITON_INTERPRET=1`` in that case (unless it is
set), which works when it is imported before helion or triton
(``kernels_helion.helion_setup``).
"""

from __future__ import annotations

from kernels_helion import helion_setup  # noqa: F401  (first: what must hold before helion loads)
from kernels_helion.fp8_format import FP8_DTYPES, fp8_max  # noqa: E402
from kernels_helion.quantize_rowwise import quantize_rowwise, quantize_rowwise_and_transpose  # noqa: E402
from kernels_helion.transpose_fp8 import transpose_fp8  # noqa: E402
from kernels_helion.transpose_token_groups import transpose_to_token_groups  # noqa: E402
from kernels_helion.quantize_expert_weights import (  # noqa: E402
    quantize_expert_weights,
    quantize_expert_weights_and_transpose,
    quantize_expert_weights_dual,
    quantize_expert_weights_transposed,
)
from kernels_helion.quantize_jagged import (  # noqa: E402
    quantize_jagged_colwise,
    quantize_jagged_colwise_dual,
    quantize_jagged_rowwise,
)
from kernels_helion.quantize_activation_dual import quantize_rowwise_and_jagged_colwise  # noqa: E402
from kernels_helion.quantize_blockwise import (  # noqa: E402
    quantize_blockwise_act,
    quantize_blockwise_act_colwise,
    quantize_blockwise_act_colwise_grouped,
    quantize_blockwise_act_dual,
    quantize_blockwise_act_dual_grouped,
    quantize_blockwise_weight,
    quantize_blockwise_weight_dual,
    quantize_blockwise_weight_transposed,
)
from kernels_helion.grouped_gemm import grouped_mm_2d3d  # noqa: E402
from kernels_helion.quantize_mx import (  # noqa: E402
    quantize_mx_dim0,
    quantize_mx_dim1,
    quantize_mx_expert_weights,
)
from kernels_helion.mx_blocked_layout import (  # noqa: E402
    to_blocked_scales,
    to_blocked_scales_grouped,
    to_blocked_scales_k_groups,
    to_blocked_scales_per_expert,
)
from kernels_helion.quantize_mx_grouped import quantize_mx_dim1_grouped, quantize_mx_dual_grouped  # noqa: E402
from kernels_helion.pad_groups import pad_token_groups, unpad_token_groups  # noqa: E402
from kernels_helion.grouped_gemm_wgrad import grouped_mm_wgrad  # noqa: E402
from kernels_helion.grouped_gemm_blockwise import grouped_mm_2d3d_blockwise  # noqa: E402
from kernels_helion.grouped_gemm_wgrad_blockwise import grouped_mm_wgrad_blockwise  # noqa: E402
from kernels_helion.grouped_gemm_mx import grouped_mm_2d3d_mx  # noqa: E402
from kernels_helion.grouped_gemm_wgrad_mx import grouped_mm_wgrad_mx  # noqa: E402
from kernels_helion.gemm_blockwise import (  # noqa: E402
    gemm_blockwise_dgrad,
    gemm_blockwise_forward,
    gemm_blockwise_wgrad,
)

__all__ = [
    "FP8_DTYPES",
    "fp8_max",
    "quantize_rowwise",
    "quantize_rowwise_and_transpose",
    "quantize_expert_weights",
    "quantize_expert_weights_transposed",
    "quantize_expert_weights_dual",
    "quantize_expert_weights_and_transpose",
    "transpose_fp8",
    "transpose_to_token_groups",
    "quantize_jagged_colwise",
    "quantize_jagged_colwise_dual",
    "quantize_jagged_rowwise",
    "quantize_rowwise_and_jagged_colwise",
    "quantize_blockwise_act",
    "quantize_blockwise_act_colwise",
    "quantize_blockwise_act_colwise_grouped",
    "quantize_blockwise_act_dual",
    "quantize_blockwise_act_dual_grouped",
    "quantize_blockwise_weight",
    "quantize_blockwise_weight_dual",
    "quantize_blockwise_weight_transposed",
    "grouped_mm_2d3d",
    "quantize_mx_dim0",
    "quantize_mx_dim1",
    "quantize_mx_expert_weights",
    "to_blocked_scales",
    "to_blocked_scales_grouped",
    "to_blocked_scales_k_groups",
    "quantize_mx_dim1_grouped",
    "quantize_mx_dual_grouped",
    "to_blocked_scales_per_expert",
    "pad_token_groups",
    "unpad_token_groups",
    "grouped_mm_wgrad",
    "grouped_mm_2d3d_blockwise",
    "grouped_mm_wgrad_blockwise",
    "grouped_mm_2d3d_mx",
    "grouped_mm_wgrad_mx",
    "gemm_blockwise_forward",
    "gemm_blockwise_dgrad",
    "gemm_blockwise_wgrad",
]
