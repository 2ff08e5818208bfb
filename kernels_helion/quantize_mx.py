"""MXFP8 quantization: float8_e4m3fn elements with one e8m0 scale per 32 along one dimension.

One kernel serves every layout. It sees its input as a logical
``(B, R, C // 32, 32)`` view (any strides) whose last dimension is a scale
block, and writes a contiguous ``(B, R, C)`` output plus ``(B, R, C // 32)``
uint8 scales:

- ``quantize_mx_dim0``: ``x (M, K)`` blocked along ``K`` (1x32): ``(1, M, K)``.
- ``quantize_mx_dim1``: ``x (M, K)`` blocked along ``M`` (32x1), written
  transposed ``(K, M)`` (tokens contiguous): ``(1, K, M)``, a strided view of ``x``.
- ``quantize_mx_expert_weights``: ``w (E, N, K)`` blocked along ``K``, or along ``N``
  and written ``(E, K, N)`` (``transposed``).

Scale and element math: ``kernels_helion.mx_format``.
"""

from __future__ import annotations

import helion
import helion.language as hl
import torch

from autotune_cache import select_config
from kernels_helion._launch import launch, require_interpreter_on_cpu
from kernels_helion.fp8_format import abs_nan_as_inf
from kernels_helion.mx_format import (
    MX_BLOCK_SIZE,
    amax_to_e8m0,
    check_rounding,
    e8m0_inverse_scale,
    to_mx_element_bits,
)
from kernels_helion.transposed_store import reload_stored_scales
from kernels_helion.validation import FLOAT_INPUT_DTYPES, check_tensor

# block_sizes = [batches, rows, scale blocks] per program; tuned configs per family in autotune_cache.
DEFAULT_CONFIG = helion.Config(block_sizes=[1, 32, 4], num_warps=4, num_stages=1)


@helion.kernel(static_shapes=False)
def quantize_mx_kernel(
    src: torch.Tensor,
    round_up: hl.constexpr,
    transposing: hl.constexpr,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``src`` ``(B, R, NB, 32)``: e4m3fn bits ``(B, R, NB, 32)``, e8m0 scales ``(B, R, NB)``.

    ``transposing``: ``src``'s last dimension is strided (blocks along a strided dimension), so the
    store transposes the tile.
    """
    batches, rows, blocks, block = src.shape
    block = hl.specialize(block)
    q_bits = torch.empty([batches, rows, blocks, block], dtype=torch.uint8, device=src.device)
    scales = torch.empty([batches, rows, blocks], dtype=torch.uint8, device=src.device)
    for tile_b, tile_r, tile_nb in hl.tile([batches, rows, blocks]):
        v = src[tile_b, tile_r, tile_nb, :].to(torch.float32)
        exponent = amax_to_e8m0(torch.amax(abs_nan_as_inf(v), dim=3), round_up)
        scales[tile_b, tile_r, tile_nb] = exponent.to(torch.uint8)
        if transposing:
            # Read back, so that Triton transposes the tile as bf16 (``transposed_store``): with its
            # re-tuned tile, 5-9% faster on the H200. (The grouped quantizer, which reads through a
            # transposed view instead, was 8-13% slower so.)
            exponent = reload_stored_scales(scales, [tile_b, tile_r, tile_nb]).to(torch.int32)
        inverse_scale = e8m0_inverse_scale(exponent)[:, :, :, None]
        q_bits[tile_b, tile_r, tile_nb, :] = to_mx_element_bits(v, inverse_scale)
    return q_bits, scales


def _quantize_blocks(src: torch.Tensor, rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel on a ``(B, R, C)`` view blocked along ``C``; ``(B, R, C)`` e4m3fn and scales."""
    require_interpreter_on_cpu(src)
    batches, rows, cols = src.shape
    if src.numel() == 0:
        q = torch.empty((batches, rows, cols), dtype=torch.float8_e4m3fn, device=src.device)
        return q, torch.empty((batches, rows, cols // MX_BLOCK_SIZE), dtype=torch.uint8, device=src.device)
    # Blocks along a strided dimension (dim1, transposed weights) are a transposing read: other tiles.
    family = "quantize_mx" if src.stride(2) == 1 else "quantize_mx_transposed"
    config = select_config(family, {"R": rows, "C": cols}, DEFAULT_CONFIG)
    blocked = src.unflatten(2, (cols // MX_BLOCK_SIZE, MX_BLOCK_SIZE))
    q_bits, scales = launch(quantize_mx_kernel, (blocked, rounding == "rceil", family == "quantize_mx_transposed"), config)
    return q_bits.view(torch.float8_e4m3fn).view(batches, rows, cols), scales


def _check_block_multiple(name: str, t: torch.Tensor, dim: int, dim_name: str) -> None:
    if t.size(dim) % MX_BLOCK_SIZE != 0:
        raise ValueError(
            f"{name}'s {dim_name} (dim {dim}) must be a multiple of the MX block size "
            f"{MX_BLOCK_SIZE}, got shape {tuple(t.shape)}"
        )


def quantize_mx_dim0(x: torch.Tensor, rounding: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 of ``x`` with 1x32 blocks along ``K`` (the forward's left operand).

    Args:
        x: ``(M, K)`` bf16/fp16/fp32, contiguous; ``K`` a multiple of 32.
        rounding: ``'rceil'`` or ``'floor'`` (see ``kernels_helion.mx_format``).

    Returns:
        ``(q, scales)``: ``q`` ``(M, K)`` float8_e4m3fn, ``scales`` ``(M, K // 32)``
        uint8 biased exponents, ``x[m, k] ~= q[m, k] * 2**(scales[m, k // 32] - 127)``.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_INPUT_DTYPES)
    check_rounding(rounding)
    _check_block_multiple("x", x, 1, "K")
    q, scales = _quantize_blocks(x.unsqueeze(0), rounding)
    return q[0], scales[0]


def quantize_mx_dim1(x: torch.Tensor, rounding: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 of ``x`` with 32x1 blocks along ``M``, written transposed (tokens contiguous).

    Args:
        x: ``(M, K)`` bf16/fp16/fp32, contiguous; ``M`` a multiple of 32.
        rounding: ``'rceil'`` or ``'floor'``.

    Returns:
        ``(q_t, scales)``: ``q_t`` ``(K, M)`` contiguous float8_e4m3fn, ``scales``
        ``(K, M // 32)`` uint8, ``x[m, k] ~= q_t[k, m] * 2**(scales[k, m // 32] - 127)``.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_INPUT_DTYPES)
    check_rounding(rounding)
    _check_block_multiple("x", x, 0, "M")
    q, scales = _quantize_blocks(x.t().unsqueeze(0), rounding)
    return q[0], scales[0]


def quantize_mx_expert_weights(
    w: torch.Tensor, rounding: str = "rceil", transposed: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 of expert weights ``w (E, N, K)``.

    Args:
        w: ``(E, N, K)`` bf16/fp16/fp32, contiguous.
        rounding: ``'rceil'`` or ``'floor'``.
        transposed: ``False``: blocks along ``K`` (``K`` a multiple of 32), output
            ``(E, N, K)``, scales ``(E, N, K // 32)``. ``True``: blocks along ``N``
            (``N`` a multiple of 32), output ``(E, K, N)`` contiguous, scales
            ``(E, K, N // 32)``.

    Returns:
        ``(q, scales)``: float8_e4m3fn and uint8 biased exponents as above.
    """
    check_tensor("w", w, ndim=3, dtypes=FLOAT_INPUT_DTYPES)
    check_rounding(rounding)
    if transposed:
        _check_block_multiple("w", w, 1, "N")
        return _quantize_blocks(w.transpose(1, 2), rounding)
    _check_block_multiple("w", w, 2, "K")
    return _quantize_blocks(w, rounding)
