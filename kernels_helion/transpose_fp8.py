"""Transposed copy of FP8 matrices: ``(E, R, C)`` -> ``(E, C, R)``, the same bytes.

The folded dgrad (``ops.Fp8Recipe.fold_dgrad_weight_scales``) multiplies by the
forward FP8 weight ``W_fp8 (E, N, K)`` with the contraction over ``N``, which
Hopper's FP8 tensor cores need contiguous: ``W_fp8`` stored ``(E, K, N)``.
Copying the FP8 bytes moves 2 bytes per weight; quantizing ``W`` again from
bf16 into that layout would read 2 and write 1, after an amax pass.

One program per ``(e, R tile, C tile)``: it loads the tile as bytes and stores
it transposed (Triton moves it through shared memory).
"""

from __future__ import annotations

from collections.abc import Callable

import helion
import helion.language as hl
import torch

from autotune_cache import select_config
from autotune_cache.registry import register_tuning
from kernels_helion._launch import launch, require_interpreter_on_cpu
from kernels_helion.fp8_format import FP8_DTYPES
from kernels_helion.validation import check_tensor
from kernels_helion.tuning import EXPERT_WEIGHT_SHAPES, random_bf16, vary, warps_for

# block_sizes = [rows (R), columns (C)] per program.
# H200, 8x2048x7168: 128x256 with 8 warps 67 us (3.5 TB/s), 64x128 with 4 warps 69 us, 64x64 80 us.
DEFAULT_CONFIG = helion.Config(block_sizes=[128, 256], num_warps=8, num_stages=1)


@helion.kernel(static_shapes=False)
def transpose_fp8_kernel(src: torch.Tensor) -> torch.Tensor:
    """``src (E, R, C)`` uint8 -> ``(E, C, R)`` uint8 with ``out[e, c, r] == src[e, r, c]``."""
    experts, rows, cols = src.shape
    out = torch.empty([experts, cols, rows], dtype=torch.uint8, device=src.device)
    for tile_e, tile_r, tile_c in hl.tile([experts, rows, cols], block_size=[1, None, None]):
        e = tile_e.begin
        out[e, tile_c, tile_r] = src[e, tile_r, tile_c].permute(1, 0)
    return out


def transpose_fp8(t: torch.Tensor) -> torch.Tensor:
    """The last two dimensions of an FP8 tensor swapped, stored contiguous: ``(E, R, C)`` -> ``(E, C, R)``.

    Args:
        t: ``(E, R, C)`` float8_e4m3fn / float8_e4m3fnuz, contiguous.

    Returns:
        ``(E, C, R)`` contiguous tensor of ``t``'s dtype, bitwise ``t.transpose(1, 2)``.
    """
    check_tensor("t", t, ndim=3, dtypes=FP8_DTYPES)
    require_interpreter_on_cpu(t)
    experts, rows, cols = t.shape
    if t.numel() == 0:
        return torch.empty((experts, cols, rows), dtype=t.dtype, device=t.device)
    config = select_config("transpose_fp8", {"E": experts, "R": rows, "C": cols}, DEFAULT_CONFIG)
    return launch(transpose_fp8_kernel, (t.view(torch.uint8),), config).view(t.dtype)


# Tuning: on the expert weights' FP8 forward layout (the folded dgrad's ``W^T``).
def _tuning_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
    t = random_bf16(shape["E"], shape["R"], shape["C"], device=device).to(torch.float8_e4m3fn)
    return lambda: transpose_fp8(t)


def _tuning_space(arch: str) -> list[helion.Config]:
    blocks = [[64, 128], [128, 128], [64, 256], [128, 256], [256, 128], [256, 256]]
    configs = vary(DEFAULT_CONFIG, block_sizes=blocks, num_warps=warps_for(arch))
    # 256x256 tiles at 16 warps write out of bounds on the H200 (illegal address,
    # Triton 3.6, even on a 2x40x72 tensor), which poisons the CUDA context.
    return [c for c in configs if not (c.config["block_sizes"] == [256, 256] and c.config["num_warps"] == 16)]


register_tuning(
    "transpose_fp8",
    DEFAULT_CONFIG,
    _tuning_space,
    [{"E": s["E"], "R": s["N"], "C": s["K"]} for s in EXPERT_WEIGHT_SHAPES],
    _tuning_call,
    {"E": 2, "R": 40, "C": 72},
)
