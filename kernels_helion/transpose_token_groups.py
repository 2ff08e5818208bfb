"""FP8 rows copied transposed into the padded token layout: ``(M, K)`` -> ``(K, padded_token_count(M, G, A))``.

The rowwise recipe's folded wgrad (``ops.Fp8Recipe.fold_wgrad_input_scales``)
uses the forward's rowwise FP8 input as wgrad's right operand: the same values,
stored tokens contiguous in the padded token layout of ``kernels_helion.token_groups``
that the wgrad GEMM reads, with the row scales folded into ``grad_out``'s wgrad
form. Copying the FP8 bytes moves 2 bytes per element, where quantizing the bf16
input per (group, column) reads it twice (amax pass, cast pass) and writes once.

One program per ``(token tile of the padded layout, column tile)``, as in the
cast pass of ``kernels_helion.quantize_rowwise_two_pass``: the token tile divides
the alignment, so it lies inside one group's padded span (its tokens, then
zeros) or past the last group. Padding columns, and the columns past the last
group, are 0 (tokens past ``offs[-1]`` belong to no group and are not copied).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import helion
import helion.language as hl
import torch

from autotune_cache import select_config
from autotune_cache.registry import register_tuning
from kernels_helion._launch import config_with, launch, require_interpreter_on_cpu
from kernels_helion.fp8_format import FP8_DTYPES
from kernels_helion.group_offsets import group_lanes
from kernels_helion.token_groups import WGRAD_GROUP_ALIGNMENT, check_group_alignment, padded_token_count, token_tile_source
from kernels_helion.validation import check_offsets, check_same_device, check_tensor
from kernels_helion.tuning import ACTIVATION_SHAPES, random_bf16, routed_offsets, vary, warps_for

# block_sizes = [tokens (padded-layout columns), source columns] per program; the token tile
# is cut to a divisor of the alignment at launch.
DEFAULT_CONFIG = helion.Config(block_sizes=[128, 256], num_warps=8, num_stages=1)


@helion.kernel(static_shapes=False)
def transpose_to_token_groups_kernel(
    src: torch.Tensor,
    rows: torch.Tensor,
    offs: torch.Tensor,
    out_tokens: int,
    groups_pow2: hl.constexpr,
    alignment: hl.constexpr,
    gather: hl.constexpr,
) -> torch.Tensor:
    """``src (M, K)`` uint8 -> ``(K, out_tokens)`` uint8: each routed token's row as a column of the padded layout.

    With ``gather``, token ``i`` is row ``rows[i]`` of ``src`` (clamped into ``src``'s rows)
    and there are ``len(rows)`` tokens.
    """
    num_src, k = src.shape
    m = rows.size(0) if gather else num_src
    out = torch.empty([k, out_tokens], dtype=torch.uint8, device=src.device)
    for tile_d, tile_k in hl.tile([out_tokens, k]):
        _, routed, tokens, has_token, _, _ = token_tile_source(offs, tile_d, m, groups_pow2, alignment)
        valid = has_token & routed
        if gather:
            sources = torch.clamp(hl.load(rows, [tokens], extra_mask=valid), 0, num_src - 1)
        else:
            sources = tokens
        # Padding and unrouted tokens load as 0.
        values = hl.load(src, [sources, tile_k], extra_mask=valid[:, None])
        out[tile_k, tile_d] = values.permute(1, 0)
    return out


def transpose_to_token_groups(
    t: torch.Tensor,
    offs: torch.Tensor,
    group_alignment: int = WGRAD_GROUP_ALIGNMENT,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The rows of an FP8 matrix as the columns of the padded token layout (the wgrad GEMM's operand layout).

    Args:
        t: ``(M, K)`` float8_e4m3fn / float8_e4m3fnuz, contiguous (tokens along rows).
        offs: ``(G,)`` int32 cumulative group ends (as ``torch._grouped_mm``), on t's device.
        group_alignment: ``A``, the alignment of each group's first column (>= 1; the recipes use 128).
        rows: optional ``(M',)`` int32/int64: token ``i`` is row ``rows[i]`` of ``t`` (a routed
            batch's pairs read from each token's one quantized row; indices are clamped into
            ``t``'s rows); ``M'`` tokens then replace ``M`` below.

    Returns:
        ``(K, padded_token_count(M, G, A))`` contiguous, of ``t``'s dtype: group ``g``'s
        token ``t`` (source row) sits at column ``sum(round_up(size[h], A) for h < g) + t - start[g]``,
        bitwise; every other column is 0. Group bounds as in ``quantize_rowwise_cols_grouped``.
    """
    check_tensor("t", t, ndim=2, dtypes=FP8_DTYPES)
    check_offsets(offs, t.device)
    alignment = check_group_alignment(group_alignment)
    if rows is not None:
        check_tensor("rows", rows, ndim=1, dtypes=(torch.int32, torch.int64))
        check_same_device("rows", rows, t.device)
    require_interpreter_on_cpu(t)
    m, k = t.shape if rows is None else (rows.shape[0], t.shape[1])
    num_groups = offs.size(0)
    out_tokens = padded_token_count(m, num_groups, alignment)
    if m == 0 or k == 0 or t.shape[0] == 0:
        return torch.zeros((k, out_tokens), dtype=t.dtype, device=t.device)
    config = select_config("transpose_to_token_groups", {"M": m, "K": k, "G": num_groups}, DEFAULT_CONFIG)
    token_tile, column_tile = config.config["block_sizes"]
    if alignment % token_tile:
        # A token tile must stay inside one group's padded span.
        config = config_with(config, block_sizes=[math.gcd(token_tile, alignment), column_tile])
    gather = rows is not None
    args = (t.view(torch.uint8), rows if gather else offs, offs, out_tokens, group_lanes(num_groups), alignment, gather)
    return launch(transpose_to_token_groups_kernel, args, config).view(t.dtype)


# Tuning: on the rowwise FP8 input (the folded wgrad's ``x^T``).
def _tuning_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
    t = random_bf16(shape["M"], shape["K"], device=device).to(torch.float8_e4m3fn)
    offs = routed_offsets(shape["M"] - 7, shape["G"], device)
    return lambda: transpose_to_token_groups(t, offs)


def _tuning_space(arch: str) -> list[helion.Config]:
    # [token tile (a divisor of the recipes' alignment, 128), column tile]
    blocks = [[64, 128], [128, 128], [64, 256], [128, 256], [32, 256], [128, 64]]
    return vary(DEFAULT_CONFIG, block_sizes=blocks, num_warps=warps_for(arch))


register_tuning(
    "transpose_to_token_groups", DEFAULT_CONFIG, _tuning_space, ACTIVATION_SHAPES, _tuning_call, {"M": 70, "K": 48, "G": 3}
)
