"""Rowwise FP8 quantization: ``(M, K)`` -> fp8 ``(M, K)`` row-major + one scale per row.

Used for the forward input ``x`` and for dgrad's ``grad_output``: the left GEMM
operand, with the contraction dimension ``K`` contiguous as Hopper's FP8 tensor
cores require. Each row is read once: the whole row is held on chip while its
amax is reduced, then scaled and stored.
"""

from __future__ import annotations

import helion
import helion.language as hl
import torch

from autotune_cache import select_config
from kernels_helion._launch import launch, on_cpu, require_interpreter_on_cpu
from kernels_helion.fp8_format import (
    abs_nan_as_inf,
    amax_to_scale,
    check_fp8_dtype,
    fp8_max,
    is_fnuz,
    scale_reciprocal,
    to_fp8_bits,
)
from kernels_helion.token_groups import WGRAD_GROUP_ALIGNMENT, check_group_alignment
from kernels_helion.transpose_token_groups import transpose_to_token_groups
from kernels_helion.validation import FLOAT_INPUT_DTYPES, check_offsets, check_tensor

DEFAULT_CONFIG = helion.Config(block_sizes=[1], num_warps=8, num_stages=1)
# Triton's CPU interpreter runs the programs one after another at a cost nearly
# independent of their size: whole blocks of rows per program (the GPU configs
# take 1-4) run the CPU tests' tensors many times faster.
CPU_CONFIG = helion.Config(block_sizes=[16], num_warps=4, num_stages=1)


@helion.kernel(static_shapes=False)
def quantize_rowwise_kernel(
    x: torch.Tensor,
    max_fp8: hl.constexpr,
    fnuz: hl.constexpr,
    round_scales_to_power_of_2: hl.constexpr,
) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    q_bits = torch.empty([m, k], dtype=torch.uint8, device=x.device)
    scales = torch.empty([m], dtype=torch.float32, device=x.device)
    for tile_m in hl.tile(m):
        rows = x[tile_m, :].to(torch.float32)
        amax = torch.amax(abs_nan_as_inf(rows), dim=1)
        scale = amax_to_scale(amax, max_fp8, round_scales_to_power_of_2)
        scales[tile_m] = scale
        q_bits[tile_m, :] = to_fp8_bits(rows * scale_reciprocal(scale)[:, None], max_fp8, fnuz)
    return q_bits, scales


def quantize_rowwise(
    x: torch.Tensor,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    round_scales_to_power_of_2: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of ``x`` to FP8 with its own scale.

    Args:
        x: ``(M, K)`` bf16/fp16/fp32, contiguous.
        float8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e4m3fnuz``.
        round_scales_to_power_of_2: round each scale up to a power of two.

    Returns:
        ``(x_fp8, scales)``: ``x_fp8`` is ``(M, K)`` row-major in ``float8_dtype``;
        ``scales`` is ``(M,)`` float32 with ``x[i] ~= x_fp8[i] * scales[i]``.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_INPUT_DTYPES)
    check_fp8_dtype(float8_dtype)
    require_interpreter_on_cpu(x)
    m, k = x.shape
    if k == 0:
        raise ValueError("x must have at least one column (K >= 1), got shape (M, 0)")
    if m == 0:
        empty = torch.empty((0, k), dtype=float8_dtype, device=x.device)
        return empty, torch.empty((0,), dtype=torch.float32, device=x.device)
    config = select_config("quantize_rowwise", {"M": m, "K": k}, CPU_CONFIG if on_cpu(x) else DEFAULT_CONFIG)
    args = (x, fp8_max(float8_dtype), is_fnuz(float8_dtype), round_scales_to_power_of_2)
    q_bits, scales = launch(quantize_rowwise_kernel, args, config)
    return q_bits.view(float8_dtype), scales


def quantize_rowwise_and_transpose(
    x: torch.Tensor,
    offs: torch.Tensor,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    round_scales_to_power_of_2: bool = False,
    group_alignment: int = WGRAD_GROUP_ALIGNMENT,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_rowwise(x)``, and the same FP8 values as columns of the padded token layout.

    The transposed copy (``transpose_to_token_groups``) is wgrad's ``x`` operand when
    the row scales are folded into ``grad_out`` (``ops.Fp8Recipe.fold_wgrad_input_scales``).

    Args:
        x: ``(M, K)`` bf16/fp16/fp32, contiguous.
        offs: ``(G,)`` int32 cumulative group ends, on x's device.
        float8_dtype, round_scales_to_power_of_2: as in ``quantize_rowwise``.
        group_alignment: as in ``transpose_to_token_groups``.

    Returns:
        ``(x_fp8 (M, K), scales (M,), xt_fp8 (K, padded_token_count(M, G, A)))``, the first two
        those of ``quantize_rowwise``, the third ``transpose_to_token_groups(x_fp8, offs, A)``.
    """
    # The copy's own checks would come after the first launch.
    check_offsets(offs, x.device)
    check_group_alignment(group_alignment)
    q, scales = quantize_rowwise(x, float8_dtype, round_scales_to_power_of_2)
    return q, scales, transpose_to_token_groups(q, offs, group_alignment)
