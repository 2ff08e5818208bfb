"""MXFP8 quantization: float8_e4m3fn elements with one e8m0 scale per 32 along one dimension.

Two kernels, one per direction of the blocks:

- ``quantize_mx_rows_kernel``: blocks along the contiguous dimension. It sees its input
  as ``(B, R, C // 32, 32)``, whose last dimension is a scale block, and writes
  ``(B, R, C)`` plus ``(B, R, C // 32)`` uint8 scales. ``quantize_mx_rows``:
  ``x (M, K)`` blocked along ``K`` (1x32); ``quantize_mx_expert_weights``: ``w (E, N, K)``
  blocked along ``K``.
- ``quantize_mx_cols_kernel``: blocks along the rows of ``(B, T, F)``, written
  transposed ``(B, F, T)`` with ``(B, F, T // 32)`` scales. ``quantize_mx_cols``:
  ``x (M, K)`` blocked along ``M`` (32x1), tokens contiguous in the output;
  ``quantize_mx_expert_weights(..., transposed=True)``: ``w (E, N, K)`` blocked along
  ``N``, written ``(E, K, N)``.

Where the transposed kernel's scales live is its launcher's choice, for the GEMM
that reads them. ``quantize_mx_cols``'s are stored block-major, ``(M // 32, K)``
contiguous, and returned as their ``(K, M // 32)`` transposed view: the layout of
``quantize_mx_cols_grouped``'s scales (a wgrad operand's, read one block's ``K``
scales at a time). A program's scales are then 2 rows of 128 bytes, where stored
``(K, M // 32)`` they would be 2 bytes on each of 128 rows; on the H200 the kernel
runs at 89-98% of copy bandwidth this way, 80-87% the other (`docs/experiments.md`).
The expert weights' scales stay ``(E, K, N // 32)`` contiguous, as the dgrad's
2D x 3D MX GEMM reads them: block-major would make this kernel 7% faster at
16x1536x2048 (44.5 -> 41.4 us), but that GEMM ran up to 9% slower on them
(5.49 -> 5.99 ms at 32768x7168x2048; the tuned configs, TMA loads).

Scale and element math: ``kernels_helion.mx_format``.
"""

from __future__ import annotations

from collections.abc import Callable

import helion
import helion.language as hl
import torch

from autotune_cache import select_config
from autotune_cache.registry import register_tuning
from kernels_helion._launch import launch, require_interpreter_on_cpu, split_leading_block
from kernels_helion.fp8_format import abs_amax, abs_nan_as_inf
from kernels_helion.mx_format import (
    MX_BLOCK_SIZE,
    amax_to_e8m0,
    check_rounding,
    e8m0_inverse_scale,
    to_mx_element_bits,
)
from kernels_helion.validation import FLOAT_INPUT_DTYPES, check_tensor
from kernels_helion.tuning import is_amd, random_bf16, vary, warps_for

# block_sizes = [batches, rows, scale blocks] per program; tuned configs in autotune_cache (``quantize_mx_rows``).
DEFAULT_CONFIG = helion.Config(block_sizes=[1, 32, 4], num_warps=4, num_stages=1)
# block_sizes = [rows (a multiple of 32), columns] of the input per program; tuned configs in
# autotune_cache (``quantize_mx_cols``). Measured best on the H200 for the MoE shapes,
# with the programs ordered tokens fastest, then columns, then batches (expert weights along
# N: 81-89% of copy against 78-85% with batches fastest, Helion's default order).
TRANSPOSED_DEFAULT_CONFIG = helion.Config(block_sizes=[64, 128], num_warps=2, num_stages=1, loop_orders=[[1, 2, 0]])


@helion.kernel(static_shapes=False)
def quantize_mx_rows_kernel(src: torch.Tensor, round_up: hl.constexpr) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``src`` ``(B, R, NB, 32)``: e4m3fn bits ``(B, R, NB, 32)``, e8m0 scales ``(B, R, NB)``."""
    batches, rows, blocks, block = src.shape
    block = hl.specialize(block)
    q_bits = torch.empty([batches, rows, blocks, block], dtype=torch.uint8, device=src.device)
    scales = torch.empty([batches, rows, blocks], dtype=torch.uint8, device=src.device)
    for tile_b, tile_r, tile_nb in hl.tile([batches, rows, blocks]):
        v = src[tile_b, tile_r, tile_nb, :].to(torch.float32)
        exponent = amax_to_e8m0(torch.amax(abs_nan_as_inf(v), dim=3), round_up)
        scales[tile_b, tile_r, tile_nb] = exponent.to(torch.uint8)
        inverse_scale = e8m0_inverse_scale(exponent)[:, :, :, None]
        q_bits[tile_b, tile_r, tile_nb, :] = to_mx_element_bits(v, inverse_scale)
    return q_bits, scales


@helion.kernel(static_shapes=False)
def quantize_mx_cols_kernel(
    src: torch.Tensor, scales: torch.Tensor, block_t: hl.constexpr, block: hl.constexpr, round_up: hl.constexpr
) -> torch.Tensor:
    """Quantize ``src`` ``(B, T, F)`` in 32x1 blocks along ``T``: returns e4m3fn bits ``(B, F, T)``; e8m0 scales into ``scales``.

    ``scales``: ``(B, F, T // 32)`` uint8, any strides (the caller picks their storage).

    ``T`` is a multiple of ``block`` (32), and so is ``block_t`` (rows of ``src`` per program).
    ``block`` is the MX block size passed as an argument: Helion turns a module constant
    into a runtime value, which ``hl.arange`` and ``reshape`` cannot take as a size.
    The tile is read along ``F``, the contiguous dimension, and transposed at the
    store, as a plain transposing copy is (91-97% of copy bandwidth on the H200).
    It stays in the input's dtype until the cast: an fp32 copy of it, which the
    amax would otherwise keep live, spilled at the tile sizes that read whole
    blocks in one thread.
    """
    batches, tokens, features = src.shape
    q_bits = torch.empty([batches, features, tokens], dtype=torch.uint8, device=src.device)
    for tile_b, tile_t, tile_f in hl.tile([batches, tokens, features], block_size=[1, block_t, None]):
        b = tile_b.begin
        # evict_last on this read-once stream: 1-3% faster on the H200 for expert weights along N
        # and activations, evict_first 5-12% slower (docs/experiments.md).
        v = hl.load(src, [b, tile_t, tile_f], eviction_policy="evict_last")
        v = v.reshape(tile_t.block_size // block, block, tile_f.block_size)
        exponent = amax_to_e8m0(abs_amax(v, dim=1), round_up)
        block_index = tile_t.begin // block + hl.arange(tile_t.block_size // block)
        # A partial last tile's blocks past the end are not stored (past the end of the scales, or wrapped
        # into the next row of contiguous ones).
        in_range = (block_index < tokens // block)[None, :]
        hl.store(scales, [b, tile_f, block_index], exponent.T.to(torch.uint8), extra_mask=in_range)
        elements = to_mx_element_bits(v.to(torch.float32), e8m0_inverse_scale(exponent)[:, None, :])
        q_bits[b, tile_f, tile_t] = elements.reshape(tile_t.block_size, tile_f.block_size).T
    return q_bits


def _quantize_blocks(src: torch.Tensor, rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize contiguous ``(B, R, C)`` in blocks along ``C``: ``(B, R, C)`` e4m3fn and ``(B, R, C // 32)`` scales."""
    require_interpreter_on_cpu(src)
    batches, rows, cols = src.shape
    if src.numel() == 0:
        q = torch.empty((batches, rows, cols), dtype=torch.float8_e4m3fn, device=src.device)
        return q, torch.empty((batches, rows, cols // MX_BLOCK_SIZE), dtype=torch.uint8, device=src.device)
    config = select_config("quantize_mx_rows", {"R": rows, "C": cols}, DEFAULT_CONFIG)
    blocked = src.unflatten(2, (cols // MX_BLOCK_SIZE, MX_BLOCK_SIZE))
    q_bits, scales = launch(quantize_mx_rows_kernel, (blocked, rounding == "rceil"), config)
    return q_bits.view(torch.float8_e4m3fn).view(batches, rows, cols), scales


def _quantize_blocks_transposed(
    src: torch.Tensor, rounding: str, block_major_scales: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize contiguous ``(B, T, F)`` in blocks along ``T``: ``(B, F, T)`` e4m3fn and ``(B, F, T // 32)`` scales.

    ``block_major_scales``: the scales are the transposed view of ``(B, T // 32, F)`` contiguous.
    """
    require_interpreter_on_cpu(src)
    batches, tokens, features = src.shape
    if features == 1 and src.numel() > 0:
        # (B, T, 1) blocked along T is (B, 1, T) blocked along its contiguous dimension, which the
        # other kernel takes (Helion cannot reduce this kernel's tile with a feature dimension of size 1).
        # With one feature, both storages of the scales are the same bytes.
        return _quantize_blocks(src.transpose(1, 2), rounding)
    blocks = tokens // MX_BLOCK_SIZE
    if block_major_scales:
        scales = torch.empty((batches, blocks, features), dtype=torch.uint8, device=src.device).transpose(1, 2)
    else:
        scales = torch.empty((batches, features, blocks), dtype=torch.uint8, device=src.device)
    if src.numel() == 0:
        return torch.empty((batches, features, tokens), dtype=torch.float8_e4m3fn, device=src.device), scales
    # Keyed by the output's shape: rows R = F, columns C = T.
    config = select_config("quantize_mx_cols", {"R": features, "C": tokens}, TRANSPOSED_DEFAULT_CONFIG)
    # The config names the token tile first; the kernel takes it as ``block_t``.
    block_t, kernel_config = split_leading_block(config)
    args = (src, scales, block_t, MX_BLOCK_SIZE, rounding == "rceil")
    q_bits = launch(quantize_mx_cols_kernel, args, kernel_config)
    return q_bits.view(torch.float8_e4m3fn), scales


def _check_block_multiple(name: str, t: torch.Tensor, dim: int, dim_name: str) -> None:
    if t.size(dim) % MX_BLOCK_SIZE != 0:
        raise ValueError(
            f"{name}'s {dim_name} (dim {dim}) must be a multiple of the MX block size "
            f"{MX_BLOCK_SIZE}, got shape {tuple(t.shape)}"
        )


def quantize_mx_rows(x: torch.Tensor, rounding: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
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


def quantize_mx_cols(x: torch.Tensor, rounding: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 of ``x`` with 32x1 blocks along ``M``, written transposed (tokens contiguous).

    Args:
        x: ``(M, K)`` bf16/fp16/fp32, contiguous; ``M`` a multiple of 32.
        rounding: ``'rceil'`` or ``'floor'``.

    Returns:
        ``(q_t, scales)``: ``q_t`` ``(K, M)`` contiguous float8_e4m3fn, ``scales``
        ``(K, M // 32)`` uint8, ``x[m, k] ~= q_t[k, m] * 2**(scales[k, m // 32] - 127)``.
        ``scales`` is the transposed view of a contiguous ``(M // 32, K)`` tensor
        (block-major, as ``quantize_mx_cols_grouped`` stores its scales; see the
        module docstring).
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_INPUT_DTYPES)
    check_rounding(rounding)
    _check_block_multiple("x", x, 0, "M")
    q, scales = _quantize_blocks_transposed(x.unsqueeze(0), rounding, block_major_scales=True)
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
        return _quantize_blocks_transposed(w, rounding, block_major_scales=False)
    _check_block_multiple("w", w, 2, "K")
    return _quantize_blocks(w, rounding)


# Tuning: ``quantize_mx_rows_kernel`` through ``quantize_mx_rows`` (blocks along the contiguous dimension)
# and ``quantize_mx_cols_kernel`` through ``quantize_mx_cols`` (blocks along tokens, written
# transposed), the latter on expert weights along N too.
# The transposing quantizer's [tokens (a multiple of 32), features] per program; the read is
# contiguous along the features, the store along the tokens.
_MX_TOKEN_TILES = [[64, 128], [32, 128], [32, 256], [64, 64], [64, 256], [128, 64], [128, 128], [32, 64]]


def _register_tuning(name: str, transposed: bool) -> None:
    default = TRANSPOSED_DEFAULT_CONFIG if transposed else DEFAULT_CONFIG

    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        if "E" in shape:
            # Expert weights (E, N=M, K) blocked along N: the same kernel, batched over experts.
            w = random_bf16(shape["E"], shape["M"], shape["K"], device=device)
            return lambda: quantize_mx_expert_weights(w, transposed=True)
        x = random_bf16(shape["M"], shape["K"], device=device)
        quantize = quantize_mx_cols if transposed else quantize_mx_rows
        return lambda: quantize(x)

    def space(arch: str) -> list[helion.Config]:
        if transposed:
            # Program order [tokens, features, experts] (fastest first) against the default
            # [experts, tokens, features]: on the H200, 81-89% of copy against 78-85% for
            # expert weights along N, the same for activations.
            orders = [[[1, 2, 0]], [[0, 1, 2]]]
            return vary(default, block_sizes=_MX_TOKEN_TILES, num_warps=warps_for(arch), loop_orders=orders)
        # [batches, rows, 32-element blocks] per program.
        blocks = [[1, 32, 4], [1, 8, 16], [1, 16, 8], [1, 4, 32], [1, 16, 16], [1, 2, 64], [1, 4, 64],
                  [1, 8, 32], [1, 2, 32]]
        configs = vary(default, block_sizes=blocks, num_warps=warps_for(arch))
        if not is_amd(arch):
            # TMA stores of the elements (load, scale store, element store: the memory ops in order).
            configs += vary(default, block_sizes=blocks, num_warps=[4, 8],
                            indexing=[["pointer", "pointer", "tensor_descriptor"]])[1:]
        return configs

    shapes = [{"M": 32768, "K": k} for k in (2048, 5120, 7168)]
    if transposed:
        shapes += [{"E": 16, "M": 1536, "K": 2048}, {"E": 8, "M": 2048, "K": 7168}, {"E": 4, "M": 8192, "K": 5120}]
    register_tuning(name, default, space, shapes, make_call, {"M": 64, "K": 96})


_register_tuning("quantize_mx_rows", transposed=False)
_register_tuning("quantize_mx_cols", transposed=True)
