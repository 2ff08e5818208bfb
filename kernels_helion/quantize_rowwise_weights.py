"""FP8 quantization of expert weights ``W (E, N, K)`` for the forward and dgrad GEMMs.

- Forward (``x @ W[e].T``, contraction over ``K``): ``W`` as is, one scale per
  ``(e, n)`` over ``K``. This is rowwise quantization of the ``(E*N, K)`` view,
  done by ``quantize_rowwise_rows``'s kernel (one read of ``W``).
- Dgrad (``grad_out @ W[e]``, contraction over ``N``): ``W[e].T`` stored
  ``(E, K, N)`` with ``N`` contiguous, one scale per ``(e, k)`` over ``N``.
- Both at once (``quantize_rowwise_expert_weights_both_layouts``).
- The forward layout and the same FP8 values stored transposed
  (``quantize_rowwise_expert_weights_and_transpose``): for a dgrad that folds the
  forward scales into ``grad_out`` instead (``grad_out[m, n] * scales[e, n]``,
  quantized rowwise, times ``W_fp8[e]``, see ``ops.autograd``). One read of
  ``W`` (the forward layout), then a copy of its FP8 bytes, transposed
  (``transpose_fp8``): 5 bytes moved per weight against ``..._both_layouts``' 6, in two
  kernels that run near the copy rate. A ``W`` stored transposed (``W = Wt.transpose(-2, -1)``
  of a contiguous ``Wt (E, K, N)``, gpt-oss's layout) is read as stored instead: its
  per-``(e, n)`` amaxes reduce over ``Wt``'s rows, and one cast per tile stores the
  forward layout (transposed) and the same values in ``Wt``'s own layout, the dgrad
  operand: no bf16 transposed copy of ``W``, no separate FP8 transpose.

The dgrad layout, alone or with the forward one, takes two launches that read
``W`` twice in all: the first reduces the amaxes (one program per 2-D tile,
partial amaxes combined by ``atomic_max``), the second casts each ``W`` tile
once and stores it transposed (and, for both layouts, as is). The amax pass's
``forward_layout`` flag says whether the row amaxes are reduced too; the cast
pass's ``as_is`` (``AS_IS_*``) what it stores in the input's own layout.
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
from kernels_helion.quantize_rowwise import quantize_rowwise_rows
from kernels_helion.transpose_fp8 import transpose_fp8
from kernels_helion.validation import FLOAT_INPUT_DTYPES, check_tensor
from kernels_helion.tuning import EXPERT_WEIGHT_SHAPES, random_bf16, vary, warps_for

# What the cast pass stores in ``w``'s own layout besides the transposed, column-scaled values:
AS_IS_NONE = 0  # nothing
AS_IS_ROW_SCALED = 1  # the values scaled per row (the forward layout of a W (E, N, K))
AS_IS_COL_SCALED = 2  # the transposed values untransposed (the dgrad layout of a W stored (E, K, N))

# block_sizes = [rows (N), columns (K)] per program (one tile each).
AMAX_DEFAULT_CONFIG = helion.Config(block_sizes=[64, 128], num_warps=4, num_stages=1)
# block_sizes = [rows (N), columns (K)] per program.
BOTH_LAYOUTS_CAST_DEFAULT_CONFIG = helion.Config(block_sizes=[64, 64], num_warps=4, num_stages=1)


@helion.kernel(static_shapes=False)
def quantize_rowwise_expert_weights_both_layouts_amax_kernel(
    w: torch.Tensor, forward_layout: hl.constexpr
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row amax ``(E, N)`` (over K; ``(E, 0)`` unless ``forward_layout``) and column amax ``(E, K)`` (over N), as float32 bits.

    One program per ``(e, N tile, K tile)``, so that every SM has work even for a
    few experts; partial amaxes meet through ``atomic_max`` (amax >= 0, so 0 is its
    identity, and max is order-independent: the result is deterministic).
    The maxima are taken on the float32 bit patterns as int32: for non-negative
    floats (+Inf included, which stands for NaN) the integer order is the float
    order, and an int32 atomic max is one instruction where a float one is two
    (Triton splits it by sign): 10-17% faster on the H200 (the pass is atomic-bound).
    """
    experts, n, k = w.shape
    row_amax_bits = torch.zeros([experts, n if forward_layout else 0], dtype=torch.int32, device=w.device)
    col_amax_bits = torch.zeros([experts, k], dtype=torch.int32, device=w.device)
    for tile_e, tile_n, tile_k in hl.tile([experts, n, k], block_size=[1, None, None]):
        e = tile_e.begin
        a = abs_nan_as_inf(w[e, tile_n, tile_k].to(torch.float32))
        if forward_layout:
            hl.atomic_max(row_amax_bits, [e, tile_n], torch.amax(a, dim=1).view(torch.int32))
        hl.atomic_max(col_amax_bits, [e, tile_k], torch.amax(a, dim=0).view(torch.int32))
    return row_amax_bits, col_amax_bits


@helion.kernel(static_shapes=False)
def quantize_rowwise_expert_weights_both_layouts_cast_kernel(
    w: torch.Tensor,
    row_amax: torch.Tensor,
    col_amax: torch.Tensor,
    max_fp8: hl.constexpr,
    fnuz: hl.constexpr,
    round_scales_to_power_of_2: hl.constexpr,
    as_is: hl.constexpr,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cast each tile of ``w`` once, store it transposed ``(E, K, N)`` scaled per column and, as ``as_is``
    says (``AS_IS_*``), in ``w``'s layout ``(E, N, K)`` scaled per row or with the same column-scaled values."""
    experts, n, k = w.shape
    q_bits = torch.empty([experts, 0 if as_is == AS_IS_NONE else n, k], dtype=torch.uint8, device=w.device)
    qt_bits = torch.empty([experts, k, n], dtype=torch.uint8, device=w.device)
    row_scales = torch.empty([experts, n if as_is == AS_IS_ROW_SCALED else 0], dtype=torch.float32, device=w.device)
    col_scales = torch.empty([experts, k], dtype=torch.float32, device=w.device)
    for tile_e, tile_n, tile_k in hl.tile([experts, n, k], block_size=[1, None, None]):
        e = tile_e.begin
        v = w[e, tile_n, tile_k].to(torch.float32)
        if as_is == AS_IS_ROW_SCALED:
            row_scale = amax_to_scale(row_amax[e, tile_n], max_fp8, round_scales_to_power_of_2)
            if tile_k.begin == 0:
                row_scales[e, tile_n] = row_scale
            q_bits[e, tile_n, tile_k] = to_fp8_bits(v * scale_reciprocal(row_scale)[:, None], max_fp8, fnuz)
        col_scale = amax_to_scale(col_amax[e, tile_k], max_fp8, round_scales_to_power_of_2)
        if tile_n.begin == 0:
            col_scales[e, tile_k] = col_scale
        qt = to_fp8_bits(v * scale_reciprocal(col_scale)[None, :], max_fp8, fnuz)
        qt_bits[e, tile_k, tile_n] = qt.permute(1, 0)
        if as_is == AS_IS_COL_SCALED:
            q_bits[e, tile_n, tile_k] = qt
    return q_bits, row_scales, qt_bits, col_scales


def is_stored_transposed(w: torch.Tensor) -> bool:
    """Whether ``w (E, N, K)`` is the transposed view of a contiguous ``(E, K, N)`` tensor (gpt-oss's layout)."""
    return not w.is_contiguous() and w.transpose(-2, -1).is_contiguous()


def check_weight_layout(w: torch.Tensor, stored_transposed: bool) -> None:
    """Raise unless ``w`` is contiguous or, where ``stored_transposed`` is allowed, ``is_stored_transposed``."""
    if not (w.is_contiguous() or (stored_transposed and is_stored_transposed(w))):
        allowed = "contiguous, or the transpose(-2, -1) view of a contiguous tensor" if stored_transposed else "contiguous"
        raise ValueError(f"w must be {allowed} (row-major), got shape {tuple(w.shape)} and strides {w.stride()}")


def _check_weights(w: object, float8_dtype: torch.dtype, stored_transposed: bool = False) -> torch.Tensor:
    """``w`` checked: 3-D float, contiguous (or, if ``stored_transposed`` is allowed, a transposed view of one)."""
    w = check_tensor("w", w, ndim=3, dtypes=FLOAT_INPUT_DTYPES, contiguous=False)
    check_weight_layout(w, stored_transposed)
    check_fp8_dtype(float8_dtype)
    if w.numel() == 0:
        raise ValueError(f"w must have E, N, K >= 1, got shape {tuple(w.shape)}")
    require_interpreter_on_cpu(w)
    return w


def quantize_rowwise_expert_weights(
    w: torch.Tensor,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    round_scales_to_power_of_2: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize expert weights for the forward GEMM: one scale per ``(e, n)`` over ``K``.

    Args:
        w: ``(E, N, K)`` bf16/fp16/fp32, contiguous.
        float8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e4m3fnuz``.
        round_scales_to_power_of_2: round each scale up to a power of two.

    Returns:
        ``(w_fp8, scales)``: ``(E, N, K)`` fp8 (K contiguous) and ``(E, N)`` float32,
        ``w[e, n] ~= w_fp8[e, n] * scales[e, n]``.
    """
    _check_weights(w, float8_dtype)
    e, n, k = w.shape
    q, scales = quantize_rowwise_rows(w.view(e * n, k), float8_dtype, round_scales_to_power_of_2)
    return q.view(e, n, k), scales.view(e, n)


def quantize_rowwise_expert_weights_transposed(
    w: torch.Tensor,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    round_scales_to_power_of_2: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize expert weights for the dgrad GEMM: ``W[e].T`` with one scale per ``(e, k)`` over ``N``.

    Args:
        w: ``(E, N, K)`` bf16/fp16/fp32, contiguous.
        float8_dtype, round_scales_to_power_of_2: as in ``quantize_rowwise_expert_weights``.

    Returns:
        ``(wt_fp8, scales)``: ``(E, K, N)`` contiguous fp8 (N contiguous) and
        ``(E, K)`` float32, ``w[e, n, k] ~= wt_fp8[e, k, n] * scales[e, k]``.
    """
    _check_weights(w, float8_dtype)
    _, _, wt, scales = _quantize_with_transposed(w, float8_dtype, round_scales_to_power_of_2, AS_IS_NONE)
    return wt, scales


def quantize_rowwise_expert_weights_both_layouts(
    w: torch.Tensor,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    round_scales_to_power_of_2: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both layouts of ``quantize_rowwise_expert_weights`` and ``quantize_rowwise_expert_weights_transposed``.

    ``W`` is read twice in all (amaxes, then one cast per tile stored both ways).

    Returns:
        ``(w_fp8 (E, N, K), scales (E, N), wt_fp8 (E, K, N), scales_t (E, K))``,
        bitwise equal to the two functions' results.
    """
    _check_weights(w, float8_dtype)
    return _quantize_with_transposed(w, float8_dtype, round_scales_to_power_of_2, AS_IS_ROW_SCALED)


def quantize_rowwise_expert_weights_and_transpose(
    w: torch.Tensor,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    round_scales_to_power_of_2: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_rowwise_expert_weights(w)``, and the same FP8 values stored transposed.

    The transposed copy is the dgrad operand when the forward scales are folded
    into ``grad_out`` (``ops.Fp8Recipe.fold_dgrad_weight_scales``): it is scaled
    per ``(e, n)`` along ``K``, unlike ``quantize_rowwise_expert_weights_transposed``'s.

    Args:
        w: ``(E, N, K)`` bf16/fp16/fp32: contiguous (one read, then ``transpose_fp8``), or
            ``wt.transpose(-2, -1)`` of a contiguous ``wt (E, K, N)`` (read as stored: an amax
            pass and one cast storing both layouts).
        float8_dtype, round_scales_to_power_of_2: as in ``quantize_rowwise_expert_weights``.

    Returns:
        ``(w_fp8 (E, N, K), scales (E, N), wt_fp8 (E, K, N))``, all contiguous, with
        ``wt_fp8[e, k, n] == w_fp8[e, n, k]``, the first two those of ``quantize_rowwise_expert_weights``
        (of ``w.contiguous()``).
    """
    _check_weights(w, float8_dtype, stored_transposed=True)
    if is_stored_transposed(w):
        # Read as stored, wt's columns are W's rows: column scales, the transposed store is W's layout.
        wt_fp8, _, w_fp8, scales = _quantize_with_transposed(
            w.transpose(-2, -1), float8_dtype, round_scales_to_power_of_2, AS_IS_COL_SCALED
        )
        return w_fp8, scales, wt_fp8
    q, scales = quantize_rowwise_expert_weights(w, float8_dtype, round_scales_to_power_of_2)
    return q, scales, transpose_fp8(q)


def _quantize_with_transposed(
    w: torch.Tensor, float8_dtype: torch.dtype, round_scales_to_power_of_2: bool, as_is: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the amax and cast passes on checked, contiguous weights: ``(q, row_scales, qt, col_scales)``,
    ``q`` empty for ``AS_IS_NONE``, ``row_scales`` empty unless ``AS_IS_ROW_SCALED``."""
    # Keyed by the whole shape: the best tile changes with the number of experts
    # (amax pass on the H200: 128x128 tiles up to 32 experts, 64x128 for 128 experts of 8192x5120).
    key = dict(zip("ENK", w.shape))
    amax_config = select_config("quantize_rowwise_expert_weights_both_layouts_amax", key, AMAX_DEFAULT_CONFIG)
    row_amax_bits, col_amax_bits = launch(
        quantize_rowwise_expert_weights_both_layouts_amax_kernel, (w, as_is == AS_IS_ROW_SCALED), amax_config
    )
    row_amax, col_amax = row_amax_bits.view(torch.float32), col_amax_bits.view(torch.float32)
    cast_config = select_config("quantize_rowwise_expert_weights_both_layouts_cast", key, BOTH_LAYOUTS_CAST_DEFAULT_CONFIG)
    quant = (fp8_max(float8_dtype), is_fnuz(float8_dtype), round_scales_to_power_of_2)
    args = (w, row_amax, col_amax, *quant, as_is)
    q_bits, row_scales, qt_bits, col_scales = launch(
        quantize_rowwise_expert_weights_both_layouts_cast_kernel, args, cast_config
    )
    return q_bits.view(float8_dtype), row_scales, qt_bits.view(float8_dtype), col_scales


# Tuning: search space and shapes (registered for the tuner, python -m kernels_helion.tune).
def _register_tuning(name: str, default: helion.Config) -> None:
    """One of ``quantize_rowwise_expert_weights_both_layouts``'s two kernels (the amax pass, then the cast)."""

    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        w = random_bf16(shape["E"], shape["N"], shape["K"], device=device)
        return lambda: quantize_rowwise_expert_weights_both_layouts(w)

    def space(arch: str) -> list[helion.Config]:
        blocks = [[64, 64], [128, 64], [64, 128], [128, 128], [256, 64]]
        return vary(default, block_sizes=blocks, num_warps=warps_for(arch))

    register_tuning(name, default, space, EXPERT_WEIGHT_SHAPES, make_call, {"E": 2, "N": 40, "K": 72})


_register_tuning("quantize_rowwise_expert_weights_both_layouts_amax", AMAX_DEFAULT_CONFIG)
_register_tuning("quantize_rowwise_expert_weights_both_layouts_cast", BOTH_LAYOUTS_CAST_DEFAULT_CONFIG)
