"""Rowwise FP8 quantization: ``(M, K)`` -> fp8 ``(M, K)`` row-major + one scale per row.

Used for the forward input ``x`` and for dgrad's ``grad_output``: the left GEMM
operand, with the contraction dimension ``K`` contiguous as Hopper's FP8 tensor
cores require. Each row is read once: the whole row is held on chip while its
amax is reduced, then scaled and stored.

A program holds a row as two power-of-two pieces (``row_pieces``): a head of
the largest power of two that fits in ``K``, unmasked, and a masked tail for the
rest. One piece padded to the next power of two would leave 37.5% of its lanes
idle at ``K = 5120`` (8192 lanes); the two pieces (4096 + 1024) run 1.10-1.15x
faster there on the H200 (96-102% of copy bandwidth, against 83-90%), and the same
at ``K = 7168`` (``benchmarks/results/quant_h200.md``, ``docs/experiments.md``).
"""

from __future__ import annotations

from collections.abc import Callable

import helion
import helion.language as hl
import torch

from autotune_cache import select_config
from autotune_cache.registry import register_tuning
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
from kernels_helion.group_offsets import group_lanes
from kernels_helion.validation import FLOAT_INPUT_DTYPES, check_offsets, check_same_device, check_scales, check_tensor
from kernels_helion.tuning import random_bf16, vary, warps_for

DEFAULT_CONFIG = helion.Config(block_sizes=[1], num_warps=4, num_stages=1)
# Triton's CPU interpreter runs the programs one after another at a cost nearly
# independent of their size: whole blocks of rows per program (the GPU configs
# take 1-4) run the CPU tests' tensors many times faster.
CPU_CONFIG = helion.Config(block_sizes=[16], num_warps=4, num_stages=1)


def row_pieces(k: int) -> tuple[int, int]:
    """``(head, tail)`` lanes of a row of ``k`` columns: ``head`` the largest power of two ``<= k``,
    ``tail`` the power of two (at least 16) that covers the remaining ``k - head`` columns."""
    head = 1 << (k.bit_length() - 1)
    rest = k - head
    tail = 1 << (rest - 1).bit_length() if rest > 0 else 0
    return head, max(16, tail)


def row_groups(offs: torch.Tensor, rows: torch.Tensor, num_rows: int, groups_pow2: int) -> torch.Tensor:
    """Device side: the group of each of ``rows``, the number of groups ending at or before it.

    ``offs`` is clamped into ``[0, num_rows]``; rows past ``offs[-1]`` get ``G`` (no group). Bad
    offsets give wrong groups, never an index out of bounds. ``groups_pow2``: ``group_lanes(G)``.
    """
    lanes = hl.arange(groups_pow2)
    is_group = lanes < offs.size(0)
    ends = torch.clamp(hl.load(offs, [lanes], extra_mask=is_group), 0, num_rows)
    # unsqueeze, not [None, :]: in a helper, Helion traces the slice as one it cannot lower.
    ended = (ends.unsqueeze(0) <= rows.unsqueeze(1)) & is_group.unsqueeze(0)
    return torch.sum(ended.to(torch.int32), dim=1)


def group_multipliers(
    row_multipliers: torch.Tensor, index: torch.Tensor, routed: torch.Tensor, in_row: torch.Tensor
) -> torch.Tensor:
    """Device side: ``row_multipliers`` (flattened ``(G * K,)``) at ``index`` (group * K + column), 1 where not ``routed & in_row``.

    (Helion traces the ``[:, None]`` broadcasts only in the kernel body: the caller makes them.)
    """
    mask = routed & in_row
    return torch.where(mask, hl.load(row_multipliers, [index], extra_mask=mask), 1.0)


@helion.kernel(static_shapes=False)
def quantize_rowwise_rows_kernel(
    x: torch.Tensor,
    offs: torch.Tensor,
    row_multipliers: torch.Tensor,
    max_fp8: hl.constexpr,
    fnuz: hl.constexpr,
    round_scales_to_power_of_2: hl.constexpr,
    head_cols: hl.constexpr,
    tail_cols: hl.constexpr,
    groups_pow2: hl.constexpr,
    fold_rows: hl.constexpr,
    rows: torch.Tensor,
    gathered: hl.constexpr,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``head_cols, tail_cols = row_pieces(K)``; the tail's lanes past ``K`` are masked
    (all of them when ``K`` is a power of two: 16 idle lanes cost nothing measurable).
    With ``fold_rows``, each row is first multiplied by its group's ``row_multipliers``
    (flattened ``(G * K,)``; groups from ``offs``), else neither is read. With ``gathered``,
    output row ``t`` is ``x[rows[t]]`` (a row outside ``x`` reads as 0), else ``rows`` is not read."""
    m = rows.size(0) if gathered else x.size(0)
    k = x.size(1)
    q_bits = torch.empty([m, k], dtype=torch.uint8, device=x.device)
    scales = torch.empty([m], dtype=torch.float32, device=x.device)
    for tile_m in hl.tile(m):
        head_cols_idx = hl.arange(head_cols)
        tail_cols_idx = head_cols + hl.arange(tail_cols)
        in_row = (tail_cols_idx < k)[None, :]
        if gathered:
            source = rows[tile_m]
            valid = ((source >= 0) & (source < x.size(0)))[:, None]
            head = hl.load(x, [source, head_cols_idx], extra_mask=valid).to(torch.float32)
            tail = hl.load(x, [source, tail_cols_idx], extra_mask=valid & in_row).to(torch.float32)
        else:
            head = hl.load(x, [tile_m, head_cols_idx]).to(torch.float32)
            tail = hl.load(x, [tile_m, tail_cols_idx], extra_mask=in_row).to(torch.float32)
        if fold_rows:
            # Rows past offs[-1] belong to no group (multiplier 1).
            group = row_groups(offs, tile_m.index, m, groups_pow2)
            routed = (group < offs.size(0))[:, None]
            head = head * group_multipliers(row_multipliers, group[:, None] * k + head_cols_idx[None, :], routed, True)
            tail = tail * group_multipliers(row_multipliers, group[:, None] * k + tail_cols_idx[None, :], routed, in_row)
        amax = torch.maximum(torch.amax(abs_nan_as_inf(head), dim=1), torch.amax(abs_nan_as_inf(tail), dim=1))
        scale = amax_to_scale(amax, max_fp8, round_scales_to_power_of_2)
        scales[tile_m] = scale
        inv_scale = scale_reciprocal(scale)[:, None]
        hl.store(q_bits, [tile_m, head_cols_idx], to_fp8_bits(head * inv_scale, max_fp8, fnuz))
        hl.store(q_bits, [tile_m, tail_cols_idx], to_fp8_bits(tail * inv_scale, max_fp8, fnuz), extra_mask=in_row)
    return q_bits, scales


def quantize_rowwise_rows(
    x: torch.Tensor,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    round_scales_to_power_of_2: bool = False,
    offs: torch.Tensor | None = None,
    row_multipliers: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of ``x`` (or of ``x[rows]``) to FP8 with its own scale.

    Args:
        x: ``(M, K)`` bf16/fp16/fp32, contiguous.
        float8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e4m3fnuz``.
        round_scales_to_power_of_2: round each scale up to a power of two.
        offs: ``(G,)`` int32 cumulative group ends of ``x``'s rows; given with ``row_multipliers``.
        row_multipliers: optional ``(G, K)`` float32: the rows quantized are then
            ``x[t, :] * row_multipliers[g, :]`` for each row ``t`` of group ``g`` (rows past
            ``offs[-1]``: multiplier 1), bitwise the rowwise form of
            ``quantize_rowwise_rows_and_cols_grouped(x, offs, row_multipliers=...)`` in one read.
            The rowwise recipe's folded dgrad passes the forward weight scales here when
            no wgrad form of ``grad_out`` is needed.
        rows: optional ``(M,)`` int32/int64: the rows quantized are then ``x[rows[t]]``, read by
            index (a row outside ``[0, x.size(0))`` reads as 0; groups and scales are those of
            the ``M`` output rows): the MoE combine's gradient rows for the fused down-projection
            dgrad, read from the tokens' gradient without a gathered copy.

    Returns:
        ``(x_fp8, scales)``: ``x_fp8`` is ``(M, K)`` row-major in ``float8_dtype``;
        ``scales`` is ``(M,)`` float32 with ``x[i] ~= x_fp8[i] * scales[i]`` (of the multiplied rows).
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_INPUT_DTYPES)
    check_fp8_dtype(float8_dtype)
    fold_rows = row_multipliers is not None
    if (offs is None) != (row_multipliers is None):
        raise ValueError("offs and row_multipliers must be given together (or neither)")
    if fold_rows:
        check_offsets(offs, x.device)
        check_scales("row_multipliers", row_multipliers, (offs.size(0), x.size(1)), x.device)
    if rows is not None:
        check_tensor("rows", rows, ndim=1, dtypes=(torch.int32, torch.int64))
        check_same_device("rows", rows, x.device)
    require_interpreter_on_cpu(x)
    m, k = (x.size(0) if rows is None else rows.size(0)), x.size(1)
    if k == 0:
        raise ValueError("x must have at least one column (K >= 1), got shape (M, 0)")
    if m == 0:
        empty = torch.empty((0, k), dtype=float8_dtype, device=x.device)
        return empty, torch.empty((0,), dtype=torch.float32, device=x.device)
    config = select_config("quantize_rowwise_rows", {"M": m, "K": k}, CPU_CONFIG if on_cpu(x) else DEFAULT_CONFIG)
    args = quantize_rowwise_rows_args(x, float8_dtype, round_scales_to_power_of_2, offs, row_multipliers, rows)
    q_bits, scales = launch(quantize_rowwise_rows_kernel, args, config)
    return q_bits.view(float8_dtype), scales


def quantize_rowwise_rows_args(
    x: torch.Tensor,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    round_scales_to_power_of_2: bool = False,
    offs: torch.Tensor | None = None,
    row_multipliers: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> tuple[object, ...]:
    """``quantize_rowwise_rows_kernel``'s arguments for checked inputs (also for tools that bind the kernel)."""
    fold_rows = row_multipliers is not None
    # Without the fold the kernel reads neither offs nor the multipliers: any tensors will do.
    groups = (offs, row_multipliers.reshape(-1)) if fold_rows else (x, x)
    pieces = row_pieces(x.size(1))
    lanes = group_lanes(offs.size(0)) if fold_rows else 1
    quant = (fp8_max(float8_dtype), is_fnuz(float8_dtype), round_scales_to_power_of_2)
    # Without rows the kernel does not read them: any tensor will do.
    return (x, *groups, *quant, *pieces, lanes, fold_rows, x if rows is None else rows, rows is not None)


def quantize_rowwise_rows_and_transpose(
    x: torch.Tensor,
    offs: torch.Tensor,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    round_scales_to_power_of_2: bool = False,
    group_alignment: int = WGRAD_GROUP_ALIGNMENT,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_rowwise_rows(x)``, and the same FP8 values as columns of the padded token layout.

    The transposed copy (``transpose_to_token_groups``) is wgrad's ``x`` operand when
    the row scales are folded into ``grad_out`` (``ops.Fp8Recipe.fold_wgrad_input_scales``).

    Args:
        x: ``(M, K)`` bf16/fp16/fp32, contiguous.
        offs: ``(G,)`` int32 cumulative group ends, on x's device.
        float8_dtype, round_scales_to_power_of_2: as in ``quantize_rowwise_rows``.
        group_alignment: as in ``transpose_to_token_groups``.

    Returns:
        ``(x_fp8 (M, K), scales (M,), xt_fp8 (K, padded_token_count(M, G, A)))``, the first two
        those of ``quantize_rowwise_rows``, the third ``transpose_to_token_groups(x_fp8, offs, A)``.
    """
    # The copy's own checks would come after the first launch.
    check_offsets(offs, x.device)
    check_group_alignment(group_alignment)
    q, scales = quantize_rowwise_rows(x, float8_dtype, round_scales_to_power_of_2)
    return q, scales, transpose_to_token_groups(q, offs, group_alignment)


# Tuning: search space and shapes (registered for the tuner, python -m kernels_helion.tune).
# Fine-grained experts' weights as (E * N, K) rows (Qwen3-30B-A3B's w2 on 1 and 2 GPUs, its w1/w3) too.
TUNING_SHAPES = [{"M": m, "K": k} for m in (16384, 32768, 65536) for k in (2048, 5120, 7168)] + [
    {"M": m, "K": k} for m, k in ((131072, 768), (262144, 768), (196608, 2048))
]


def _tuning_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
    x = random_bf16(shape["M"], shape["K"], device=device)
    return lambda: quantize_rowwise_rows(x)


def _tuning_space(arch: str) -> list[helion.Config]:
    return vary(DEFAULT_CONFIG, block_sizes=[[1], [2], [4]], num_warps=warps_for(arch))


register_tuning("quantize_rowwise_rows", DEFAULT_CONFIG, _tuning_space, TUNING_SHAPES, _tuning_call, {"M": 5, "K": 96})
