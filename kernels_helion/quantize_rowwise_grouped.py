"""Per-group columnwise FP8 quantization, written transposed: for wgrad's operands.

wgrad computes, per group ``g``, ``grad_w[g] = grad_out[g].T @ x[g]``: the
contraction runs over the group's tokens, so both operands are stored with
tokens contiguous (``(K, M)`` and ``(N, M)``) and scaled per ``(group, column)``.

Two kernels write it:

- For the padded layouts of the recipes (alignment a multiple of 16) with large
  groups, a jagged ``(M, K)`` tensor goes through the two passes of
  ``kernels_helion.quantize_rowwise_two_pass`` with the rowwise output off:
  an amax pass over whole ``(tokens, columns)`` tiles, then a cast pass that
  transposes whole tiles.
- Otherwise (small groups, the plain layout, and an input already transposed
  ``(K, M)``, ``quantize_rowwise_cols_grouped_from_transposed``) the column-strip kernel here. It sees its input
  as a logical ``(C, T)`` view (column, token; any strides). A program owns one
  ``(group, column strip)``: a first pass over the group's tokens reduces the
  amax, a second pass scales and stores. The first pass loads with
  ``evict_last`` and the second with ``evict_first`` so that the strip's second
  read comes from L2 when the strips of the programs in flight fit there (small
  and medium groups); for large groups the input is read twice from DRAM.

Tokens past ``offs[-1]`` belong to no group: their output columns are written
as 0 (so the whole output is defined and a GEMM over them adds nothing). With
``group_alignment > 1`` the output is in the padded token layout of
``kernels_helion.token_groups`` (each group from an aligned column, zeros
between groups and after the last): the layout the wgrad GEMM reads fastest.
The tail program (one past the last group) reads nothing and writes the zeros
after the last group.
Group ``g`` spans ``[clamp(offs[g-1]), max(clamp(offs[g]), start))``, clamped
into ``[0, M]``, so bad offsets never write out of bounds (decreasing offsets
give overlapping groups, whose outputs are then unspecified); an empty group gets
the scale of amax 0 (finite).
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
    FP8_DTYPES,
    abs_amax,
    abs_nan_as_inf,
    amax_to_scale,
    check_fp8_dtype,
    fp8_max,
    is_fnuz,
    scale_reciprocal,
    to_fp8_bits,
)
from kernels_helion.group_offsets import group_lanes
from kernels_helion.quantize_rowwise_two_pass import (
    TOKEN_TILE_QUANTUM,
    check_pairs,
    quantize_activation_two_pass,
    two_pass_cast_config,
)
from kernels_helion.token_groups import (
    WGRAD_GROUP_ALIGNMENT,
    check_group_alignment,
    group_token_span,
    padded_token_count,
)
from kernels_helion.validation import (
    FLOAT_INPUT_DTYPES,
    check_offsets,
    check_same_device,
    check_scales,
    check_tensor,
)
from kernels_helion.tuning import random_bf16, routed_offsets, vary, warps_for

# block_sizes = [tokens per step, columns per program]; loop_orders put the
# column strip fastest in the program id, so programs in flight share token rows;
# the token loops are software-pipelined (3 stages). Chosen by a manual sweep on
# the H200 (benchmarks/results/quant_h200.md).
DEFAULT_CONFIG = helion.Config(
    block_sizes=[256, 16],
    num_warps=4,
    num_stages=3,
    loop_orders=[[1, 0]],
    range_num_stages=[3, 3],
)

# Padded layouts go through the two-pass kernels when the groups average at least
# this many tokens: for smaller groups the strip kernel's second read comes from
# L2 and it is faster (H200, benchmarks.quant: 32768 tokens in 64 groups, strip
# 52% of copy against 37%; 16 groups, two-pass 47-49% against 41-49%; 1 group,
# 49-50% against 35-43%).
TWO_PASS_MIN_TOKENS_PER_GROUP = 2048


@helion.kernel(static_shapes=False)
def quantize_rowwise_cols_grouped_kernel(
    src: torch.Tensor,
    group_ends: torch.Tensor,
    out_tokens: int,
    max_fp8: hl.constexpr,
    fnuz: hl.constexpr,
    round_scales_to_power_of_2: hl.constexpr,
    groups_pow2: hl.constexpr,
    alignment: hl.constexpr,
    tokens_contiguous: hl.constexpr,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``src`` (a logical ``(C, T)`` view) per (group, column).

    ``tokens_contiguous``: ``src``'s stride along ``T`` is 1 (it picks the amax
    reduction measured faster for that layout).

    Returns token-contiguous fp8 bits ``(C, out_tokens)`` in the token layout of
    ``alignment`` and ``(G, C)`` scales. Program row ``G`` (one past the last
    group) reads nothing and zero-fills the columns past the last group.
    """
    cols, tokens = src.shape
    groups = group_ends.size(0)
    out = torch.empty([cols, out_tokens], dtype=torch.uint8, device=src.device)
    scales = torch.empty([groups, cols], dtype=torch.float32, device=src.device)
    block_t = hl.register_block_size(16, 512)
    for tile_g, tile_c in hl.tile([groups + 1, cols], block_size=[1, None]):
        g = tile_g.begin
        # Group g reads tokens [src_start, src_end) and writes output columns
        # [dst_start, dst_end): its quantized tokens, then zeros (the padding).
        src_start, src_end, dst_start, dst_end = group_token_span(
            group_ends, g, groups_pow2, tokens, alignment, out_tokens
        )
        dst_end = torch.where(hl.full([], g, dtype=torch.int32) >= groups, out_tokens, dst_end)
        amax = hl.zeros([tile_c], dtype=torch.float32)
        for tile_t in hl.tile(src_start, src_end, block_size=block_t):
            v = hl.load(src, [tile_c, tile_t], eviction_policy="evict_last").to(torch.float32)
            # The integer reduction of abs_amax is 6-22% faster on contiguous tokens, but 2-11%
            # slower in a transposing read (H200, benchmarks.quant: quantize_rowwise_cols_grouped_from_transposed, quantize_rowwise_cols_grouped).
            if tokens_contiguous:
                amax = torch.maximum(amax, abs_amax(v, dim=1))
            else:
                amax = torch.maximum(amax, torch.amax(abs_nan_as_inf(v), dim=1))
        scale = amax_to_scale(amax, max_fp8, round_scales_to_power_of_2)
        if g < groups:
            scales[g, tile_c] = scale
        inv_scale = scale_reciprocal(scale)[:, None]
        for tile_t in hl.tile(dst_start, dst_end, block_size=block_t):
            src_t = tile_t.index + (src_start - dst_start)
            in_group = (src_t < src_end)[None, :]
            v = hl.load(src, [tile_c, src_t], extra_mask=in_group, eviction_policy="evict_first")
            bits = to_fp8_bits(v.to(torch.float32) * inv_scale, max_fp8, fnuz)
            # Padding and the tail are 0 whatever the scale (even a NaN one).
            out[tile_c, tile_t] = torch.where(in_group, bits, 0)
    return out, scales


def quantize_groups_transposed(
    src: torch.Tensor,
    group_ends: torch.Tensor,
    float8_dtype: torch.dtype,
    round_scales_to_power_of_2: bool,
    group_alignment: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``quantize_rowwise_cols_grouped_kernel`` on a ``(C, T)`` view; view the bits as fp8.

    The output has ``padded_token_count(T, G, group_alignment)`` tokens.
    """
    require_interpreter_on_cpu(src)
    num_groups = group_ends.numel()
    out_tokens = padded_token_count(src.size(1), num_groups, group_alignment)
    key = {"C": src.size(0), "T": src.size(1), "G": num_groups}
    # Tokens already contiguous (quantize_rowwise_cols_grouped_from_transposed) want other tiles than a transposing read.
    tokens_contiguous = src.stride(1) == 1
    family = "quantize_rowwise_cols_grouped_from_transposed" if tokens_contiguous else "quantize_rowwise_cols_grouped"
    config = select_config(family, key, DEFAULT_CONFIG)
    args = (
        src,
        group_ends,
        out_tokens,
        fp8_max(float8_dtype),
        is_fnuz(float8_dtype),
        round_scales_to_power_of_2,
        group_lanes(num_groups),
        group_alignment,
        tokens_contiguous,
    )
    out, scales = launch(quantize_rowwise_cols_grouped_kernel, args, config)
    return out.view(float8_dtype), scales


def _check_2d(
    name: str, t: object, feature_dim: int, dtypes: tuple[torch.dtype, ...] = FLOAT_INPUT_DTYPES
) -> torch.Tensor:
    t = check_tensor(name, t, ndim=2, dtypes=dtypes)
    if t.size(feature_dim) == 0:
        raise ValueError(f"{name} must have at least one feature column, got shape {tuple(t.shape)}")
    return t


def quantize_rowwise_cols_grouped(
    x: torch.Tensor,
    offs: torch.Tensor,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    round_scales_to_power_of_2: bool = False,
    group_alignment: int = 1,
    token_multipliers: torch.Tensor | None = None,
    pair_tokens: torch.Tensor | None = None,
    pair_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each column of each token group of ``x``, written transposed.

    With ``pair_tokens`` and ``pair_weights`` the rows quantized are gathered and weighted, as
    in ``quantize_rowwise_rows_and_cols_grouped``: row ``t`` is ``x[pair_tokens[t]] * pair_weights[t]``,
    one float32 product rounded to ``x``'s dtype (the MoE combine's gradient rows read by index;
    a row outside ``[0, T)`` reads as 0), by the two-pass kernels: the padded layouts of their
    alignments only (a multiple of their token tile; the recipes' 128).

    Args:
        x: ``(M, K)`` bf16/fp16/fp32, contiguous (tokens along rows); or FP8 of ``float8_dtype`` (rows
            already quantized, read as their values: requantized per (group, column), typically with
            ``token_multipliers`` carrying their row scales), for the two-pass kernels' padded
            layouts and without ``pair_tokens``.
        offs: ``(G,)`` int32 cumulative group ends (as ``torch._grouped_mm``), on x's device.
        float8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e4m3fnuz``.
        round_scales_to_power_of_2: round each scale up to a power of two.
        group_alignment: 1 (tokens keep their columns) or the alignment ``A`` of
            each group's first column (padded layout, see below).
        token_multipliers: optional ``(M,)`` float32: quantize ``x * token_multipliers[:, None]``
            (the product in float32) instead of ``x``. Multiplied inside the kernels for the
            padded layouts of the two-pass kernels (the recipes' layout), else by PyTorch
            first (an extra float32 copy of ``x``).
        pair_tokens: optional ``(M,)`` int32/int64: the row of ``x (T, K)`` each row reads.
            Given with ``pair_weights``.
        pair_weights: optional ``(M,)`` float32: each row's weight (a routing probability).

    Returns:
        ``(xt_fp8, scales)``: ``xt_fp8`` is ``(K, columns)`` contiguous (tokens
        contiguous), ``scales`` is ``(G, K)`` float32 with
        ``x[t, k] ~= xt_fp8[k, column(t)] * scales[g, k]`` for token ``t`` of group ``g``.
        Columns: with ``group_alignment == 1``, token ``t``'s column is ``t``
        and columns of tokens past ``offs[-1]`` are 0. With ``group_alignment = A > 1``
        (the padded layout of ``kernels_helion.token_groups``, which the wgrad GEMM
        reads without masks) there are ``padded_token_count(M, G, A)`` columns and group
        ``g``'s tokens start at column ``sum(round_up(size[h], A) for h < g)``, followed
        by zeros up to the next multiple of ``A``; columns past the last group are 0.
    """
    _check_2d("x", x, 1, FLOAT_INPUT_DTYPES + FP8_DTYPES)
    check_fp8_dtype(float8_dtype)
    check_offsets(offs, x.device)
    alignment = check_group_alignment(group_alignment)
    pairs = check_pairs(pair_tokens, pair_weights, x.device)
    fp8_input = x.dtype in FP8_DTYPES
    if fp8_input and (x.dtype != float8_dtype or pairs is not None):
        raise ValueError(
            f"x in FP8 must be of float8_dtype ({float8_dtype}) and takes no pair_tokens, got {x.dtype}"
            f"{' with pair_tokens' if pairs is not None else ''}"
        )
    m = x.size(0) if pairs is None else pairs[0].size(0)
    if token_multipliers is not None:
        check_scales("token_multipliers", token_multipliers, (m,), x.device)
    # Token multipliers and gathered rows ride on the two-pass kernels whenever the layout allows,
    # whatever the group sizes.
    large_groups = (
        token_multipliers is not None or pairs is not None or fp8_input
        or m >= TWO_PASS_MIN_TOKENS_PER_GROUP * offs.size(0)
    )
    pair_rows = None if pairs is None else m
    cast_config = two_pass_cast_config(x, offs, alignment, pair_rows) if large_groups else None
    if cast_config is not None:
        _, _, xt, scales = quantize_activation_two_pass(
            x, offs, float8_dtype, round_scales_to_power_of_2, alignment, rowwise=False, cast_config=cast_config,
            token_multipliers=token_multipliers, pairs=pairs,
        )
        return xt, scales
    if pairs is not None or fp8_input:
        raise ValueError(
            f"gathered rows (pair_tokens) and FP8 rows are quantized by the two-pass kernels, which need "
            f"group_alignment a multiple of {TOKEN_TILE_QUANTUM} and of the cast pass's token tile; got "
            f"{group_alignment} (the recipes use {WGRAD_GROUP_ALIGNMENT})"
        )
    if token_multipliers is not None:
        x = x.to(torch.float32) * token_multipliers[:, None]
    return quantize_groups_transposed(x.t(), offs, float8_dtype, round_scales_to_power_of_2, alignment)


def quantize_rowwise_cols_grouped_from_transposed(
    xt: torch.Tensor,
    offs: torch.Tensor,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    round_scales_to_power_of_2: bool = False,
    group_alignment: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rowwise_cols_grouped`` for an input already transposed: ``xt`` is ``(K, M)``.

    Args:
        xt: ``(K, M)`` bf16/fp16/fp32, contiguous (tokens contiguous; groups run along columns).
        offs, float8_dtype, round_scales_to_power_of_2, group_alignment: as in ``quantize_rowwise_cols_grouped``.

    Returns:
        ``(xt_fp8, scales)``: ``(K, columns)`` fp8 and ``(G, K)`` float32, the same
        contract as ``quantize_rowwise_cols_grouped(xt.t())``.
    """
    _check_2d("xt", xt, 0)
    check_fp8_dtype(float8_dtype)
    check_offsets(offs, xt.device)
    alignment = check_group_alignment(group_alignment)
    return quantize_groups_transposed(xt, offs, float8_dtype, round_scales_to_power_of_2, alignment)


def quantize_rowwise_wgrad_operands(
    x: torch.Tensor,
    grad_out: torch.Tensor,
    offs: torch.Tensor,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    round_scales_to_power_of_2: bool = False,
    group_alignment: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both wgrad operands: ``quantize_rowwise_cols_grouped`` of ``x`` and of ``grad_out`` (both checked before either runs).

    Args:
        x: ``(M, K)``, grad_out: ``(M, N)``; bf16/fp16/fp32, contiguous, same device.
        offs, float8_dtype, round_scales_to_power_of_2, group_alignment: as in ``quantize_rowwise_cols_grouped``.

    Returns:
        ``(xt_fp8 (K, columns), x_scales (G, K), got_fp8 (N, columns), go_scales (G, N))``.
    """
    _check_2d("x", x, 1)
    _check_2d("grad_out", grad_out, 1)
    check_fp8_dtype(float8_dtype)
    check_same_device("grad_out", grad_out, x.device)
    if grad_out.size(0) != x.size(0):
        raise ValueError(
            f"grad_out must have as many rows (tokens) as x: x {tuple(x.shape)}, "
            f"grad_out {tuple(grad_out.shape)}"
        )
    check_offsets(offs, x.device)
    check_group_alignment(group_alignment)
    quant = (float8_dtype, round_scales_to_power_of_2, group_alignment)
    return (*quantize_rowwise_cols_grouped(x, offs, *quant), *quantize_rowwise_cols_grouped(grad_out, offs, *quant))


# Tuning: ``quantize_rowwise_cols_grouped_kernel`` per input layout, tokens strided (transposing) or contiguous.
def _register_tuning(name: str, transposing: bool) -> None:
    def make_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
        offs = routed_offsets(shape["M"], shape["G"], device)
        if transposing:
            x = random_bf16(shape["M"], shape["K"], device=device)
            return lambda: quantize_rowwise_cols_grouped(x, offs)
        xt = random_bf16(shape["K"], shape["M"], device=device)
        return lambda: quantize_rowwise_cols_grouped_from_transposed(xt, offs)

    def space(arch: str) -> list[helion.Config]:
        # [tokens per step, columns per program]: a transposing read wants many
        # columns a step, a contiguous one many tokens.
        if transposing:
            blocks = [[256, 16], [128, 32], [256, 32], [128, 64]]
        else:
            blocks = [[256, 16], [512, 4], [512, 8], [256, 8], [512, 16], [128, 16]]
        return vary(DEFAULT_CONFIG, block_sizes=blocks, num_warps=warps_for(arch))

    shapes = [{"M": 32768, "K": k, "G": g} for k in (5120, 7168) for g in (1, 16, 64)]
    register_tuning(name, DEFAULT_CONFIG, space, shapes, make_call, {"M": 70, "K": 48, "G": 3})


_register_tuning("quantize_rowwise_cols_grouped", transposing=True)
_register_tuning("quantize_rowwise_cols_grouped_from_transposed", transposing=False)
