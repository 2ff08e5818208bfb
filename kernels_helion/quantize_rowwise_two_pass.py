"""Rowwise and per-group columnwise FP8 quantization of one activation, in two reads of it.

The rowwise recipe needs each activation in two forms: ``x`` rowwise for the
forward GEMM and per (group, column), tokens contiguous, for wgrad; the same for
``grad_out`` (dgrad and wgrad). Done apart, ``quantize_rowwise_rows`` reads the tensor
once and ``quantize_rowwise_cols_grouped`` twice (amax pass, cast pass): three reads.
Here the two share their passes:

1. ``quantize_rowwise_rows_and_cols_grouped_amax_kernel``, one program per ``(token tile, column tile)``,
   token tiles taken within groups (the tokens laid out with each group padded
   to the tile, so no tile spans two groups): the row amaxes and the group's
   column amaxes of the tile, combined across programs by an int32
   ``atomic_max`` on the float bits (as in ``quantize_rowwise_expert_weights``: amaxes
   are >= 0, so the bit order is the float order and the result does not depend
   on the order: deterministic).
2. ``quantize_rowwise_rows_and_cols_grouped_cast_kernel``, one program per token tile of the padded
   layout, walking the columns tile by tile: it reads its tokens once and stores them
   row-major, scaled per row, and transposed, scaled per (group, column).

The transposed output is the padded token layout of ``kernels_helion.token_groups``
(each group from a multiple of the alignment ``A``). A cast-pass token tile
divides ``A``, so it lies inside one group's padded span (its tokens, then
zeros) or past the last group. The tokens past ``offs[-1]`` (no group) are
mapped just past the last group, so that their rowwise output is written too;
their transposed columns, like all padding, are 0.

With ``rowwise`` off the two passes skip the row amaxes and the row-major
output: ``quantize_rowwise_cols_grouped`` takes this path for the padded layouts (a
transposing read in whole tiles, instead of one program per column strip).

The results are bitwise those of ``quantize_rowwise_rows`` and of ``quantize_rowwise_cols_grouped``'s
column-strip kernel (same scale and cast helpers; the tests hold all to one reference).
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
    FP8_DTYPES,
    abs_amax,
    amax_to_scale,
    check_fp8_dtype,
    emulates_fp8_cast,
    fp8_bits_to_float,
    fp8_max,
    is_fnuz,
    scale_reciprocal,
    to_fp8_bits,
)
from kernels_helion.group_offsets import group_lanes
from kernels_helion.token_groups import (
    WGRAD_GROUP_ALIGNMENT,
    check_group_alignment,
    padded_token_count,
    token_tile_source,
)
from kernels_helion.validation import FLOAT_INPUT_DTYPES, check_offsets, check_same_device, check_scales, check_tensor
from kernels_helion.tuning import ACTIVATION_SHAPES, random_bf16, routed_offsets, routed_pairs, vary

# The cast pass's token tile must divide the layout's alignment: alignments are
# multiples of this, and so are the cast pass's token tiles.
TOKEN_TILE_QUANTUM = 16

# Amax pass: block_sizes = [tokens, column span, column tile] per program (the span walked tile by tile).
AMAX_DEFAULT_CONFIG = helion.Config(block_sizes=[64, 64, 64], num_warps=2, num_stages=1)
# Cast pass: block_sizes = [tokens, column tile]; its token tile must divide the alignment.
CAST_DEFAULT_CONFIG = helion.Config(block_sizes=[32, 128], num_warps=2, num_stages=1)
# Under the CPU interpreter a program costs about the same whatever its size: wide tiles, and,
# where the alignment allows it, a cast program takes a whole 128-token span (the recipes' alignment).
CPU_AMAX_CONFIG = helion.Config(block_sizes=[128, 128, 128], num_warps=4, num_stages=1)
CPU_WIDE_CAST_CONFIG = helion.Config(block_sizes=[128, 128], num_warps=4, num_stages=1)


def _group_row_multiplier(
    row_multipliers: torch.Tensor, group: torch.Tensor, routed: torch.Tensor, tile_k: hl.Tile
) -> torch.Tensor:
    """Device side: the tile's group's row multipliers over ``tile_k`` (1 for unrouted tokens)."""
    return torch.where(routed, hl.load(row_multipliers, [group, tile_k]), 1.0)


def _token_scaled(
    v: torch.Tensor, token_multipliers: torch.Tensor, tokens: torch.Tensor, has_token: torch.Tensor, fold: bool
) -> torch.Tensor:
    """Device side: the tile ``v`` (tokens x columns) times each token's multiplier if ``fold``, else ``v``.

    Rows without a token load multiplier 0 (their ``v`` is 0 already).
    """
    if fold:
        return v * hl.load(token_multipliers, [tokens], extra_mask=has_token).unsqueeze(1)
    return v


def _pair_sources(
    pair_tokens: torch.Tensor, pair_weights: torch.Tensor, tokens: torch.Tensor, has_token: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device side: ``(source row, its weight, valid)`` of each pair row of a tile (``gathered``).

    A source outside ``[0, num_tokens)`` reads as a zero row, its weight as 0 (never out of bounds).
    """
    source = hl.load(pair_tokens, [tokens], extra_mask=has_token)
    valid = has_token & (source >= 0) & (source < num_tokens)
    return source, hl.load(pair_weights, [tokens], extra_mask=valid), valid


def _load_rows(
    x: torch.Tensor,
    rows: torch.Tensor,
    valid: torch.Tensor,
    tile_k: hl.Tile,
    weight: torch.Tensor,
    gathered: bool,
    weight_rows: bool,
    fp8_bits: bool,
    fnuz: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Device side: ``(rowwise values, columnwise values)``, the float32 tile of ``x`` at ``rows``
    (``valid``, ``weight``: ``(rows, 1)``). If ``gathered``, the columnwise values are each row times
    its ``weight`` rounded to ``x``'s dtype (``moe_combine_grad_rows``'s product: one float32
    product, rounded once), and so are the rowwise ones if ``weight_rows``, else they are the row itself.
    ``fp8_bits``: ``x`` holds FP8 values as uint8 bits (e4m3fnuz if ``fnuz``), decoded here."""
    v = hl.load(x, [rows, tile_k], extra_mask=valid)
    v = fp8_bits_to_float(v, fnuz) if fp8_bits else v.to(torch.float32)
    if gathered:
        weighted = (v * weight).to(x.dtype).to(torch.float32)
        if weight_rows:
            return weighted, weighted
        return v, weighted
    return v, v


@helion.kernel(static_shapes=False)
def quantize_rowwise_rows_and_cols_grouped_amax_kernel(
    x: torch.Tensor,
    offs: torch.Tensor,
    row_multipliers: torch.Tensor,
    token_multipliers: torch.Tensor,
    pair_tokens: torch.Tensor,
    pair_weights: torch.Tensor,
    out_tokens: int,
    groups_pow2: hl.constexpr,
    alignment: hl.constexpr,
    rowwise: hl.constexpr,
    fold_rows: hl.constexpr,
    fold_tokens: hl.constexpr,
    gathered: hl.constexpr,
    weight_rows: hl.constexpr,
    fp8_bits: hl.constexpr,
    fnuz: hl.constexpr,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row amax ``(M,)`` (``(0,)`` unless ``rowwise``) and per-group column amax ``(G * K,)`` of ``x``, as float32 bits in int32.

    Tiles run over the token columns of a padded layout (``alignment``: a multiple
    of the token tile), like the cast pass: each lies in one group (or past the
    last), so its column amax needs no mask (rows without a token load as 0,
    which leaves an amax unchanged). With ``fold_rows``, the row amaxes are those
    of ``x[t, :] * row_multipliers[group of t, :]``; with ``fold_tokens``, the
    column amaxes those of ``x[t, :] * token_multipliers[t]``. With ``gathered``, row ``t``
    is ``x[pair_tokens[t]] * pair_weights[t]`` (``M = pair_tokens.size(0)``), for the row amaxes
    only if ``weight_rows`` (else ``x[pair_tokens[t]]``). ``fp8_bits``: ``x`` holds FP8 bits (uint8;
    e4m3fnuz if ``fnuz``).
    """
    m = pair_tokens.size(0) if gathered else x.size(0)
    k = x.size(1)
    num_groups = offs.size(0)
    row_amax_bits = torch.zeros([m if rowwise else 0], dtype=torch.int32, device=x.device)
    col_amax_bits = torch.zeros([num_groups * k], dtype=torch.int32, device=x.device)
    # A program takes a token tile and a span of columns, which it walks tile by tile: the tile's
    # group and tokens are found once for the span (block_sizes: [tokens, span, column tile]).
    for tile_d, span in hl.tile([out_tokens, k]):
        group, routed, tokens, has_token, _, _ = token_tile_source(offs, tile_d, m, groups_pow2, alignment)
        if gathered:
            sources, weights, valid = _pair_sources(pair_tokens, pair_weights, tokens, has_token, x.size(0))
        else:
            sources, weights, valid = tokens, tokens, has_token
        valid, weights = valid[:, None], weights[:, None]
        for tile_k in hl.tile(span.begin, span.end):
            v_rows, v = _load_rows(x, sources, valid, tile_k, weights, gathered, weight_rows, fp8_bits, fnuz)
            if rowwise:
                if fold_rows:
                    # Rows without a token stay 0 whatever the multipliers (even NaN ones).
                    multiplier = _group_row_multiplier(row_multipliers, group, routed, tile_k)
                    v_rows = torch.where(has_token[:, None], v_rows * multiplier[None, :], 0.0)
                # Rows without a token (padding, past M) hold 0: a max with 0 changes no row, so they go
                # to rows in bounds, distinct ones (many atomics on one address would serialize).
                hl.atomic_max(row_amax_bits, [tokens % m], abs_amax(v_rows, dim=1).view(torch.int32))
            # Unrouted tokens add to no group (an atomic max with 0 changes nothing).
            v_cols = _token_scaled(v, token_multipliers, tokens, has_token, fold_tokens)
            col_amax = torch.where(routed, abs_amax(v_cols, dim=0), 0.0)
            hl.atomic_max(col_amax_bits, [tile_k.index + group * k], col_amax.view(torch.int32))
    return row_amax_bits, col_amax_bits


@helion.kernel(static_shapes=False)
def quantize_rowwise_rows_and_cols_grouped_cast_kernel(
    x: torch.Tensor,
    row_amax: torch.Tensor,
    col_amax: torch.Tensor,
    offs: torch.Tensor,
    row_multipliers: torch.Tensor,
    token_multipliers: torch.Tensor,
    pair_tokens: torch.Tensor,
    pair_weights: torch.Tensor,
    out_tokens: int,
    max_fp8: hl.constexpr,
    fnuz: hl.constexpr,
    round_scales_to_power_of_2: hl.constexpr,
    groups_pow2: hl.constexpr,
    alignment: hl.constexpr,
    rowwise: hl.constexpr,
    fold_rows: hl.constexpr,
    fold_tokens: hl.constexpr,
    gathered: hl.constexpr,
    weight_rows: hl.constexpr,
    fp8_bits: hl.constexpr,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cast each token tile once, store it transposed (padded layout) and, if ``rowwise``, row-major, with the scales.

    With ``fold_rows``, the row-major output is that of ``x[t, :] * row_multipliers[group of t, :]``;
    with ``fold_tokens``, the transposed output that of ``x[t, :] * token_multipliers[t]``; with
    ``gathered``, row ``t`` is ``x[pair_tokens[t]] * pair_weights[t]`` (``M = pair_tokens.size(0)``),
    for the row-major output only if ``weight_rows`` (else ``x[pair_tokens[t]]``). ``fp8_bits``: ``x``
    holds FP8 bits (uint8) of the output's format.
    """
    m = pair_tokens.size(0) if gathered else x.size(0)
    k = x.size(1)
    num_groups = offs.size(0)
    q_bits = torch.empty([m if rowwise else 0, k], dtype=torch.uint8, device=x.device)
    row_scales = torch.empty([m if rowwise else 0], dtype=torch.float32, device=x.device)
    qt_bits = torch.empty([k, out_tokens], dtype=torch.uint8, device=x.device)
    col_scales = torch.empty([num_groups * k], dtype=torch.float32, device=x.device)
    # A program takes one token tile and walks the columns: the tile's group, tokens, row scales
    # and token multipliers are found once for all of them (1.1-1.2x over a program per
    # (token tile, column tile), which looked them up for every column tile).
    for tile_d in hl.tile(out_tokens):
        group, routed, tokens, has_token, first_here, stop_here = token_tile_source(
            offs, tile_d, m, groups_pow2, alignment
        )
        if rowwise:
            row_scale = amax_to_scale(hl.load(row_amax, [tokens], extra_mask=has_token), max_fp8, round_scales_to_power_of_2)
            hl.store(row_scales, [tokens], row_scale, extra_mask=has_token)
            row_reciprocal = scale_reciprocal(row_scale)
        if fold_tokens:
            # Rows without a token load multiplier 0 (their values are 0 already).
            token_multiplier = hl.load(token_multipliers, [tokens], extra_mask=has_token)
        if gathered:
            sources, weights, valid = _pair_sources(pair_tokens, pair_weights, tokens, has_token, x.size(0))
        else:
            sources, weights, valid = tokens, tokens, has_token
        valid, weights = valid[:, None], weights[:, None]
        for tile_k in hl.tile(k):
            v_rows, v = _load_rows(x, sources, valid, tile_k, weights, gathered, weight_rows, fp8_bits, fnuz)
            if rowwise:
                if fold_rows:
                    v_rows = v_rows * _group_row_multiplier(row_multipliers, group, routed, tile_k)[None, :]
                row_bits = to_fp8_bits(v_rows * row_reciprocal[:, None], max_fp8, fnuz)
                hl.store(q_bits, [tokens, tile_k], row_bits, extra_mask=has_token[:, None])
            col_scale = amax_to_scale(hl.load(col_amax, [tile_k.index + group * k]), max_fp8, round_scales_to_power_of_2)
            v_cols = v
            if fold_tokens:
                v_cols = v * token_multiplier[:, None]
            col_bits = to_fp8_bits(v_cols * scale_reciprocal(col_scale)[None, :], max_fp8, fnuz)
            # Padding, the tail and unrouted tokens are 0 whatever the scale (even a NaN one).
            col_bits = torch.where(has_token[:, None] & routed, col_bits, 0)
            qt_bits[tile_k, tile_d] = col_bits.permute(1, 0)
            # Each group's scales from the token tile where its span starts (empty groups too).
            for g in hl.grid(first_here, stop_here):
                amax = hl.load(col_amax, [tile_k.index + g * k])
                col_scales[tile_k.index + g * k] = amax_to_scale(amax, max_fp8, round_scales_to_power_of_2)
    return q_bits, row_scales, qt_bits, col_scales


def _config_key(x: torch.Tensor, num_groups: int, pair_rows: int | None) -> dict[str, int]:
    """The passes' cache key: ``M`` rows of ``K`` in ``G`` groups; for gathered rows (``pair_rows``
    of them), also the ``T`` rows of ``x`` they read (gathered reads tune apart: fewer warps win);
    for FP8 rows, ``FP8: 1`` (a byte an element: they tune apart too)."""
    if pair_rows is not None:
        return {"M": pair_rows, "K": x.size(1), "G": num_groups, "T": x.size(0)}
    if x.dtype in FP8_DTYPES:
        return {"M": x.size(0), "K": x.size(1), "G": num_groups, "FP8": 1}
    return {"M": x.size(0), "K": x.size(1), "G": num_groups}


def _cast_config(x: torch.Tensor, num_groups: int, group_alignment: int, pair_rows: int | None) -> helion.Config:
    wide = on_cpu(x) and group_alignment % CPU_WIDE_CAST_CONFIG.config["block_sizes"][0] == 0
    default = CPU_WIDE_CAST_CONFIG if wide else CAST_DEFAULT_CONFIG
    return select_config("quantize_rowwise_rows_and_cols_grouped_cast", _config_key(x, num_groups, pair_rows), default)


def two_pass_cast_config(
    x: torch.Tensor, offs: torch.Tensor, group_alignment: int, pair_rows: int | None = None
) -> helion.Config | None:
    """The cast pass's config for this shape if it writes the padded layout of ``group_alignment``, else ``None``.

    ``pair_rows``: the number of rows when they are gathered from ``x`` (``pair_tokens``). The cast
    pass's token tiles must lie inside one group's padded span, so the selected config's token
    tile must divide the alignment.
    """
    config = _cast_config(x, offs.size(0), group_alignment, pair_rows)
    return config if group_alignment % config.config["block_sizes"][0] == 0 else None


def quantize_activation_two_pass(
    x: torch.Tensor,
    offs: torch.Tensor,
    float8_dtype: torch.dtype,
    round_scales_to_power_of_2: bool,
    group_alignment: int,
    rowwise: bool,
    cast_config: helion.Config,
    row_multipliers: torch.Tensor | None = None,
    token_multipliers: torch.Tensor | None = None,
    pairs: tuple[torch.Tensor, torch.Tensor] | None = None,
    weight_rows: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the amax and cast passes on checked inputs, ``cast_config`` from ``two_pass_cast_config``.

    Returns ``(x_fp8 (M, K), row_scales (M,), xt_fp8, col_scales (G, K))``; the
    rowwise pair is empty (0 rows) unless ``rowwise``, and is that of
    ``x * row_multipliers[group of each token]`` when they are given (checked, ``(G, K)``);
    the transposed pair is that of ``x * token_multipliers[:, None]`` when they are given (checked, ``(M,)``).
    ``pairs = (pair_tokens, pair_weights)`` (checked, ``(M,)`` each): row ``t`` is
    ``x[pair_tokens[t]] * pair_weights[t]`` rounded to ``x``'s dtype, ``M = pair_tokens.size(0)``;
    ``weight_rows=False``: the rowwise pair is that of ``x[pair_tokens[t]]`` (the columnwise one keeps the weights).
    ``x`` may hold FP8 values of ``float8_dtype`` (not with ``pairs``): they are read as their float32 values.
    """
    require_interpreter_on_cpu(x)
    # FP8 input where Triton cannot read the type itself (the interpreter, e4m3fnuz off ROCm): its bits.
    fp8_bits = x.dtype in FP8_DTYPES and emulates_fp8_cast(is_fnuz(x.dtype))
    x_read = x.view(torch.uint8) if fp8_bits else x
    m = x.size(0) if pairs is None else pairs[0].size(0)
    k = x.size(1)
    num_groups = offs.size(0)
    out_tokens = padded_token_count(m, num_groups, group_alignment)
    if m == 0:
        # No tokens: nothing to read; every group gets the scale of amax 0 (the helpers are plain torch ops).
        no_amax = torch.zeros((num_groups, k), dtype=torch.float32, device=x.device)
        return (
            torch.empty((0, k), dtype=float8_dtype, device=x.device),
            torch.empty((0,), dtype=torch.float32, device=x.device),
            torch.zeros((k, out_tokens), dtype=float8_dtype, device=x.device),
            amax_to_scale(no_amax, fp8_max(float8_dtype), round_scales_to_power_of_2),
        )
    groups_pow2 = group_lanes(num_groups)
    amax_default = CPU_AMAX_CONFIG if on_cpu(x) else AMAX_DEFAULT_CONFIG
    pair_rows = None if pairs is None else m
    amax_config = select_config(
        "quantize_rowwise_rows_and_cols_grouped_amax", _config_key(x, num_groups, pair_rows), amax_default
    )
    # The amax pass only needs tiles that stay inside one group: it walks a layout padded
    # to its own token tile, which has fewer empty tiles than the output's.
    amax_tile = amax_config.config["block_sizes"][0]
    amax_columns = padded_token_count(m, num_groups, amax_tile)
    fold_rows = row_multipliers is not None
    fold_tokens = token_multipliers is not None
    gathered = pairs is not None
    # Without multipliers (or pairs) the kernels never read the argument: any tensor on the device will do.
    multipliers = row_multipliers if fold_rows else offs
    per_token = token_multipliers if fold_tokens else offs
    pair_tokens, pair_weights = pairs if gathered else (offs, offs)
    row_amax_bits, col_amax_bits = launch(
        quantize_rowwise_rows_and_cols_grouped_amax_kernel,
        (
            x_read, offs, multipliers, per_token, pair_tokens, pair_weights, amax_columns, groups_pow2, amax_tile,
            rowwise, fold_rows, fold_tokens, gathered, weight_rows, fp8_bits, is_fnuz(float8_dtype),
        ),
        amax_config,
    )
    args = (
        x_read,
        row_amax_bits.view(torch.float32),
        col_amax_bits.view(torch.float32),
        offs,
        multipliers,
        per_token,
        pair_tokens,
        pair_weights,
        out_tokens,
        fp8_max(float8_dtype),
        is_fnuz(float8_dtype),
        round_scales_to_power_of_2,
        groups_pow2,
        group_alignment,
        rowwise,
        fold_rows,
        fold_tokens,
        gathered,
        weight_rows,
        fp8_bits,
    )
    q_bits, row_scales, qt_bits, col_scales = launch(
        quantize_rowwise_rows_and_cols_grouped_cast_kernel, args, cast_config
    )
    return q_bits.view(float8_dtype), row_scales, qt_bits.view(float8_dtype), col_scales.view(num_groups, k)


def quantize_rowwise_rows_and_cols_grouped(
    x: torch.Tensor,
    offs: torch.Tensor,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    round_scales_to_power_of_2: bool = False,
    group_alignment: int = WGRAD_GROUP_ALIGNMENT,
    row_multipliers: torch.Tensor | None = None,
    token_multipliers: torch.Tensor | None = None,
    pair_tokens: torch.Tensor | None = None,
    pair_weights: torch.Tensor | None = None,
    weight_rows: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_rowwise_rows(x)`` and ``quantize_rowwise_cols_grouped(x, offs, group_alignment=A)`` in two reads of ``x``.

    With ``pair_tokens`` and ``pair_weights`` the rows quantized are gathered and weighted:
    row ``t`` is ``x[pair_tokens[t]] * pair_weights[t]``, one float32 product rounded to
    ``x``'s dtype, bitwise ``moe_combine_grad_rows``'s rows (the MoE combine's gradient,
    read by index instead of written out in bf16 and read again).

    Args:
        x: ``(M, K)`` bf16/fp16/fp32, contiguous (tokens along rows); with ``pair_tokens``,
            ``(T, K)``: the rows the pairs read.
        offs: ``(G,)`` int32 cumulative group ends, on x's device.
        float8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e4m3fnuz``.
        round_scales_to_power_of_2: round each scale up to a power of two.
        group_alignment: ``A``, the padded layout's alignment: a multiple of 16
            (the recipes use 128).
        row_multipliers: optional ``(G, K)`` float32: the rowwise form is then
            ``quantize_rowwise_rows`` of ``x[t, :] * row_multipliers[g, :]`` for each token
            ``t`` of group ``g`` (tokens past ``offs[-1]``: multiplier 1). The rowwise
            recipe's folded dgrad passes the forward weight scales here.
        token_multipliers: optional ``(M,)`` float32: the per-group columnwise form is
            then ``quantize_rowwise_cols_grouped`` of ``x * token_multipliers[:, None]``. The
            rowwise recipe's folded wgrad passes the row scales of the input's rowwise
            FP8 form here (``Fp8Recipe.fold_wgrad_input_scales``).
        pair_tokens: optional ``(M,)`` int32/int64: the row of ``x`` each row reads (a row
            outside ``[0, T)`` reads as 0). Given with ``pair_weights``.
        pair_weights: optional ``(M,)`` float32: each row's weight (a routing probability).
        weight_rows: with ``pair_tokens``, whether the rowwise form is of the weighted rows
            (default) or of ``x[pair_tokens[t]]`` alone (the columnwise form is of the weighted
            rows either way): the fused down-projection dgrad multiplies by the weights in its
            epilogue (``grouped_mm_swiglu_backward``), which needs the product before them.

    Returns:
        ``(x_fp8 (M, K), row_scales (M,), xt_fp8 (K, padded_token_count(M, G, A)), col_scales (G, K))``,
        bitwise equal to the two functions' results (on the multiplied inputs).
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_INPUT_DTYPES)
    check_fp8_dtype(float8_dtype)
    check_offsets(offs, x.device)
    alignment = check_group_alignment(group_alignment)
    if alignment % TOKEN_TILE_QUANTUM:
        raise ValueError(
            f"group_alignment must be a multiple of {TOKEN_TILE_QUANTUM} here, got {group_alignment} "
            "(quantize_rowwise_rows and quantize_rowwise_cols_grouped take any alignment)"
        )
    if x.size(1) == 0:
        raise ValueError("x must have at least one column (K >= 1), got shape (M, 0)")
    if row_multipliers is not None:
        check_scales("row_multipliers", row_multipliers, (offs.size(0), x.size(1)), x.device)
    pairs = check_pairs(pair_tokens, pair_weights, x.device)
    m = x.size(0) if pairs is None else pairs[0].size(0)
    if token_multipliers is not None:
        check_scales("token_multipliers", token_multipliers, (m,), x.device)
    pair_rows = None if pairs is None else m
    cast_config = two_pass_cast_config(x, offs, alignment, pair_rows)
    if cast_config is None:
        raise ValueError(
            f"group_alignment must be a multiple of the selected config's token tile "
            f"({_cast_config(x, offs.size(0), alignment, pair_rows).config['block_sizes'][0]}), "
            f"got {alignment}; the recipes use {WGRAD_GROUP_ALIGNMENT}"
        )
    return quantize_activation_two_pass(
        x, offs, float8_dtype, round_scales_to_power_of_2, alignment, True, cast_config, row_multipliers,
        token_multipliers, pairs, weight_rows,
    )


def check_pairs(
    pair_tokens: torch.Tensor | None, pair_weights: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(pair_tokens, pair_weights)`` checked (1-D int32/int64 indices, float32 weights of the same length,
    both contiguous on ``device``), or ``None`` when neither is given."""
    if pair_tokens is None and pair_weights is None:
        return None
    if pair_tokens is None or pair_weights is None:
        raise ValueError("pair_tokens and pair_weights go together: give both (gathered rows) or neither")
    check_tensor("pair_tokens", pair_tokens, ndim=1, dtypes=(torch.int32, torch.int64))
    check_same_device("pair_tokens", pair_tokens, device)
    check_scales("pair_weights", pair_weights, (pair_tokens.size(0),), device)
    return pair_tokens, pair_weights


# Tuning: the two passes of ``quantize_rowwise_rows_and_cols_grouped`` (amax, then the cast to rows and columns).
def _tuning_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
    # As the default recipe calls it (both folds on): each row times its group's weight scales
    # (folded dgrad), each token's column value times its input row scale (folded wgrad); the
    # multipliers are compile-time switches, so a call without them would tune another kernel.
    gen = torch.Generator(device=device).manual_seed(0)
    row_multipliers = torch.rand(shape["G"], shape["K"], generator=gen, device=device) + 0.5
    token_multipliers = torch.rand(shape["M"], generator=gen, device=device) + 0.5
    folds = {"row_multipliers": row_multipliers, "token_multipliers": token_multipliers}
    if "FP8" in shape:
        # FP8 rows requantized per (group, column) with each row's multiplier, as w2's wgrad on token
        # rows calls it for h (``RowwiseOptions.down_wgrad_token_rows``): the column form alone.
        from kernels_helion.quantize_rowwise_grouped import quantize_rowwise_cols_grouped  # imports this module

        offs = routed_offsets(shape["M"] - 7, shape["G"], device)
        x = random_bf16(shape["M"], shape["K"], device=device).to(torch.float8_e4m3fn)
        return lambda: quantize_rowwise_cols_grouped(
            x, offs, group_alignment=WGRAD_GROUP_ALIGNMENT, token_multipliers=token_multipliers
        )
    if "T" not in shape:
        offs = routed_offsets(shape["M"] - 7, shape["G"], device)
        x = random_bf16(shape["M"], shape["K"], device=device)
        return lambda: quantize_rowwise_rows_and_cols_grouped(x, offs, **folds)
    # Gathered rows as the MoE combine's gradient reads them: each of T tokens k = M / T times, in expert
    # order (a group's tokens ascending: the order sets how often a token's row is found in L2); the
    # rowwise form of each row before its weight, as the fused down-projection's dgrad takes it.
    pair_tokens, offs = routed_pairs(shape["T"], shape["M"] // shape["T"], shape["G"], device)
    grad = random_bf16(shape["T"], shape["K"], device=device)
    pair_weights = torch.rand(pair_tokens.size(0), generator=gen, device=device)
    return lambda: quantize_rowwise_rows_and_cols_grouped(
        grad, offs, pair_tokens=pair_tokens, pair_weights=pair_weights, weight_rows=False, **folds
    )


# The MoE layer's gathered calls (``ops.moe_fused.down_projection_combine``): T tokens of top-8 pairs, w2's
# output width K, G experts (Qwen3-30B-like and DeepSeek-V3-like, 8192 and 32768 tokens).
GATHERED_SHAPES = [
    {"M": 8 * t, "K": k, "G": g, "T": t}
    for t, k, g in ((32768, 2048, 128), (32768, 7168, 32), (8192, 2048, 128), (8192, 7168, 256))
]
# Its calls on h's FP8 rows (w2's wgrad on token rows): T * 8 pairs of the hidden width K, G experts.
FP8_ROW_SHAPES = [
    {"M": 8 * t, "K": k, "G": g, "FP8": 1}
    for t, k, g in ((32768, 768, 128), (32768, 2048, 32), (8192, 768, 128), (8192, 2048, 256))
]


def _amax_tuning_space(arch: str) -> list[helion.Config]:
    # [token tile (a divisor of the recipes' alignment, 128), column span, column tile]. Small tiles
    # with few warps read fastest on the H200 (64x64 with 1-2 warps; 128x128 with 4: 0.4-0.6x of
    # them); the row amaxes are atomics either way. Long spans pay at many tokens (1.1-1.2x at
    # 262144 tokens and at 7168 columns), a span of one tile at 32768-65536 tokens of 1536-2048.
    blocks = [[64, 64, 64], [32, 64, 64], [64, 512, 64], [32, 512, 64], [64, 8192, 64], [32, 8192, 64], [256, 64, 64]]
    return vary(AMAX_DEFAULT_CONFIG, block_sizes=blocks, num_warps=[1, 2])


def _cast_tuning_space(arch: str) -> list[helion.Config]:
    # [token tile (a divisor of the recipes' alignment, 128), column tile]
    # (8 warps measured 0.6-0.8x the best at every activation shape.)
    blocks = [[64, 64], [32, 128], [64, 128], [128, 64], [32, 256], [16, 256]]
    return vary(CAST_DEFAULT_CONFIG, block_sizes=blocks, num_warps=[2, 4])


# Keys of three forms: rows read as stored, gathered rows (with T), FP8 rows (with FP8).
_TEST_SHAPE, _GATHERED_TEST_SHAPE = {"M": 70, "K": 48, "G": 3}, {"M": 60, "K": 48, "G": 3, "T": 20}
_FP8_TEST_SHAPE = {"M": 70, "K": 48, "G": 3, "FP8": 1}
register_tuning("quantize_rowwise_rows_and_cols_grouped_amax", AMAX_DEFAULT_CONFIG, _amax_tuning_space,
                ACTIVATION_SHAPES + GATHERED_SHAPES + FP8_ROW_SHAPES, _tuning_call, _TEST_SHAPE,
                other_test_shapes=[_GATHERED_TEST_SHAPE, _FP8_TEST_SHAPE])
register_tuning("quantize_rowwise_rows_and_cols_grouped_cast", CAST_DEFAULT_CONFIG, _cast_tuning_space,
                ACTIVATION_SHAPES + GATHERED_SHAPES + FP8_ROW_SHAPES, _tuning_call, _TEST_SHAPE,
                other_test_shapes=[_GATHERED_TEST_SHAPE, _FP8_TEST_SHAPE])
