"""Helion kernels for FP8 MoE training: quantization and grouped GEMMs.

With no CUDA device, kernels run on CPU tensors through Triton's interpreter:
importing this package sets ``TRITON_INTERPRET=1`` in that case (unless it is set).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels_helion.fp8_format import FP8_DTYPES, fp8_max  # noqa: E402
from kernels_helion.quantize_rowwise import quantize_rowwise  # noqa: E402
from kernels_helion.quantize_expert_weights import (  # noqa: E402
    quantize_expert_weights,
    quantize_expert_weights_dual,
    quantize_expert_weights_transposed,
)
from kernels_helion.quantize_jagged import (  # noqa: E402
    quantize_jagged_colwise,
    quantize_jagged_colwise_dual,
    quantize_jagged_rowwise,
)
from kernels_helion.grouped_gemm import grouped_mm_2d3d  # noqa: E402
from kernels_helion.grouped_gemm_wgrad import grouped_mm_wgrad  # noqa: E402

__all__ = [
    "FP8_DTYPES",
    "fp8_max",
    "quantize_rowwise",
    "quantize_expert_weights",
    "quantize_expert_weights_transposed",
    "quantize_expert_weights_dual",
    "quantize_jagged_colwise",
    "quantize_jagged_colwise_dual",
    "quantize_jagged_rowwise",
    "grouped_mm_2d3d",
    "grouped_mm_wgrad",
]
