"""Per-group columnwise FP8 quantization, written transposed: for wgrad's operands.

wgrad computes, per group ``g``, ``grad_w[g] = grad_out[g].T @ x[g]``: the
contraction runs over the group's tokens, so both operands are stored with
tokens contiguous (``(K, M)`` and ``(N, M)``) and scaled per ``(group, column)``.

One kernel serves every layout. It sees its input as a logical ``(B, C, T)``
view (batch, column, token; any strides) and quantizes each column over the
token range of each group into a ``(B, C, T)`` token-contiguous output:

- token groups of a jagged ``(M, K)`` tensor (``B = 1``, groups from ``offs``);
- an already transposed ``(K, M)`` tensor (same, other strides);
- expert weights ``(E, N, K)`` scaled per ``(e, k)`` over ``N`` (``batched``:
  group ``e`` is batch ``e`` with all ``N`` tokens), see ``quantize_expert_weights``.

A program owns one ``(group, column strip)``: a first pass over the group's
tokens reduces the amax, a second pass scales and stores. The first pass loads
with ``evict_last`` and the second with ``evict_first`` so that the strip's
second read comes from L2 when the strips of the programs in flight fit there
(small and medium groups); for large groups the input is read twice from DRAM.

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

import helion
import helion.language as hl
import torch
import triton

from autotune_cache import select_config
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
from kernels_helion.token_groups import check_group_alignment, group_token_span, padded_token_count
from kernels_helion.validation import (
    FLOAT_INPUT_DTYPES,
    check_offsets,
    check_same_device,
    check_tensor,
)

# block_sizes = [tokens per step, columns per program of src_a, of src_b];
# loop_orders put the column strip fastest in the program id, so programs in
# flight share token rows; the token loops are software-pipelined (3 stages).
# Chosen by a manual sweep on the H200 (benchmarks/results/quant_h200.md).
DEFAULT_CONFIG = helion.Config(
    block_sizes=[256, 16, 16],
    num_warps=4,
    num_stages=3,
    loop_orders=[[1, 0], [1, 0]],
    range_num_stages=[0, 3, 3],
)


def _group_span(
    group_ends: torch.Tensor,
    g: int,
    groups: int,
    tokens: int,
    batched: bool,
    groups_pow2: int,
    alignment: int,
    out_tokens: int,
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(batch, src_start, src_end, dst_start, dst_end)`` of program row ``g`` (``g == groups``: the tail).

    Group ``g`` reads tokens ``[src_start, src_end)`` and writes output columns
    ``[dst_start, dst_end)``: its quantized tokens, then zeros (the padding of
    ``kernels_helion.token_groups``). The tail program reads nothing and zero-fills
    the columns past the last group.
    """
    if batched:
        is_tail = hl.full([], g, dtype=torch.int32) >= groups
        end = torch.where(is_tail, 0, tokens)
        return g, hl.full([], 0, dtype=torch.int32), end, hl.full([], 0, dtype=torch.int32), end
    start, end, dst_start, dst_end = group_token_span(group_ends, g, groups_pow2, tokens, alignment, out_tokens)
    return 0, start, end, dst_start, torch.where(hl.full([], g, dtype=torch.int32) >= groups, out_tokens, dst_end)


@helion.kernel(static_shapes=False)
def quantize_groups_transposed_kernel(
    src_a: torch.Tensor,
    src_b: torch.Tensor,
    group_ends: torch.Tensor,
    out_tokens: int,
    max_fp8: hl.constexpr,
    fnuz: hl.constexpr,
    round_scales_to_power_of_2: hl.constexpr,
    batched: hl.constexpr,
    groups_pow2: hl.constexpr,
    alignment: hl.constexpr,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``src_a`` and ``src_b`` (logical ``(B, C, T)`` views) per (group, column).

    ``src_b`` may have 0 columns (one operand). Returns token-contiguous fp8
    bits ``(B, C, out_tokens)`` in the token layout of ``alignment`` and
    ``(G, C)`` scales for each operand.
    """
    batches, cols_a, tokens = src_a.shape
    cols_b = src_b.size(1)
    groups = group_ends.size(0)
    out_a = torch.empty([batches, cols_a, out_tokens], dtype=torch.uint8, device=src_a.device)
    out_b = torch.empty([batches, cols_b, out_tokens], dtype=torch.uint8, device=src_a.device)
    scales_a = torch.empty([groups, cols_a], dtype=torch.float32, device=src_a.device)
    scales_b = torch.empty([groups, cols_b], dtype=torch.float32, device=src_a.device)
    block_t = hl.register_block_size(16, 512)
    # The two operands' loops are identical; Helion allows no loop in a helper
    # function nor a constexpr-guarded top-level loop, so a single operand is
    # passed with an empty src_b (its loop then launches no program).
    for tile_g, tile_c in hl.tile([groups + 1, cols_a], block_size=[1, None]):
        g = tile_g.begin
        batch, src_start, src_end, dst_start, dst_end = _group_span(
            group_ends, g, groups, tokens, batched, groups_pow2, alignment, out_tokens
        )
        amax = hl.zeros([tile_c], dtype=torch.float32)
        for tile_t in hl.tile(src_start, src_end, block_size=block_t):
            v = hl.load(src_a, [batch, tile_c, tile_t], eviction_policy="evict_last")
            amax = torch.maximum(amax, torch.amax(abs_nan_as_inf(v.to(torch.float32)), dim=1))
        scale = amax_to_scale(amax, max_fp8, round_scales_to_power_of_2)
        hl.store(scales_a, [g, tile_c], scale, extra_mask=g < groups)
        inv_scale = scale_reciprocal(scale)[:, None]
        for tile_t in hl.tile(dst_start, dst_end, block_size=block_t):
            src_t = tile_t.index + (src_start - dst_start)
            in_group = (src_t < src_end)[None, :]
            v = hl.load(src_a, [batch, tile_c, src_t], extra_mask=in_group, eviction_policy="evict_first")
            bits = to_fp8_bits(v.to(torch.float32) * inv_scale, max_fp8, fnuz)
            # Padding and the tail are 0 whatever the scale (even a NaN one).
            out_a[batch, tile_c, tile_t] = torch.where(in_group, bits, 0)
    for tile_g_b, tile_c_b in hl.tile([groups + 1, cols_b], block_size=[1, None]):
        g_b = tile_g_b.begin
        batch_b, src_start_b, src_end_b, dst_start_b, dst_end_b = _group_span(
            group_ends, g_b, groups, tokens, batched, groups_pow2, alignment, out_tokens
        )
        amax_b = hl.zeros([tile_c_b], dtype=torch.float32)
        for tile_t_b in hl.tile(src_start_b, src_end_b, block_size=block_t):
            v_b = hl.load(src_b, [batch_b, tile_c_b, tile_t_b], eviction_policy="evict_last")
            amax_b = torch.maximum(amax_b, torch.amax(abs_nan_as_inf(v_b.to(torch.float32)), dim=1))
        scale_b = amax_to_scale(amax_b, max_fp8, round_scales_to_power_of_2)
        hl.store(scales_b, [g_b, tile_c_b], scale_b, extra_mask=g_b < groups)
        inv_scale_b = scale_reciprocal(scale_b)[:, None]
        for tile_t_b in hl.tile(dst_start_b, dst_end_b, block_size=block_t):
            src_t_b = tile_t_b.index + (src_start_b - dst_start_b)
            in_group_b = (src_t_b < src_end_b)[None, :]
            v_b = hl.load(src_b, [batch_b, tile_c_b, src_t_b], extra_mask=in_group_b, eviction_policy="evict_first")
            bits_b = to_fp8_bits(v_b.to(torch.float32) * inv_scale_b, max_fp8, fnuz)
            # Padding and the tail are 0 whatever the scale (even a NaN one).
            out_b[batch_b, tile_c_b, tile_t_b] = torch.where(in_group_b, bits_b, 0)
    return out_a, scales_a, out_b, scales_b


def quantize_groups_transposed(
    src_a: torch.Tensor,
    src_b: torch.Tensor,
    group_ends: torch.Tensor,
    float8_dtype: torch.dtype,
    round_scales_to_power_of_2: bool,
    batched: bool,
    group_alignment: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run ``quantize_groups_transposed_kernel`` on ``(B, C, T)`` views; view bits as fp8.

    The outputs have ``padded_token_count(T, G, group_alignment)`` tokens (``T``
    when batched, where ``group_alignment`` must be 1).
    """
    require_interpreter_on_cpu(src_a)
    num_groups = group_ends.numel()
    out_tokens = padded_token_count(src_a.size(2), num_groups, group_alignment)
    key = {"C": src_a.size(1) + src_b.size(1), "T": src_a.size(2), "G": num_groups}
    # Tokens already contiguous (quantize_jagged_rowwise) want other tiles than a transposing read.
    family = "quantize_groups_contiguous" if src_a.stride(2) == 1 else "quantize_groups_transposed"
    config = select_config(family, key, DEFAULT_CONFIG)
    args = (
        src_a,
        src_b,
        group_ends,
        out_tokens,
        fp8_max(float8_dtype),
        is_fnuz(float8_dtype),
        round_scales_to_power_of_2,
        batched,
        1 if batched else triton.next_power_of_2(num_groups),
        group_alignment,
    )
    out_a, scales_a, out_b, scales_b = launch(quantize_groups_transposed_kernel, args, config)
    return out_a.view(float8_dtype), scales_a, out_b.view(float8_dtype), scales_b


def _check_2d(name: str, t: object, feature_dim: int) -> torch.Tensor:
    t = check_tensor(name, t, ndim=2, dtypes=FLOAT_INPUT_DTYPES)
    if t.size(feature_dim) == 0:
        raise ValueError(f"{name} must have at least one feature column, got shape {tuple(t.shape)}")
    return t


def quantize_jagged_colwise(
    x: torch.Tensor,
    offs: torch.Tensor,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    round_scales_to_power_of_2: bool = False,
    group_alignment: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each column of each token group of ``x``, written transposed.

    Args:
        x: ``(M, K)`` bf16/fp16/fp32, contiguous (tokens along rows).
        offs: ``(G,)`` int32 cumulative group ends (as ``torch._grouped_mm``), on x's device.
        float8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e4m3fnuz``.
        round_scales_to_power_of_2: round each scale up to a power of two.
        group_alignment: 1 (tokens keep their columns) or the alignment ``A`` of
            each group's first column (padded layout, see below).

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
    _check_2d("x", x, 1)
    check_fp8_dtype(float8_dtype)
    check_offsets(offs, x.device)
    alignment = check_group_alignment(group_alignment)
    src = x.t().unsqueeze(0)
    xt, scales, _, _ = quantize_groups_transposed(
        src, src[:, :0], offs, float8_dtype, round_scales_to_power_of_2, batched=False, group_alignment=alignment
    )
    return xt[0], scales


def quantize_jagged_rowwise(
    xt: torch.Tensor,
    offs: torch.Tensor,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    round_scales_to_power_of_2: bool = False,
    group_alignment: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_jagged_colwise`` for an input already transposed: ``xt`` is ``(K, M)``.

    Args:
        xt: ``(K, M)`` bf16/fp16/fp32, contiguous (tokens contiguous; groups run along columns).
        offs, float8_dtype, round_scales_to_power_of_2, group_alignment: as in ``quantize_jagged_colwise``.

    Returns:
        ``(xt_fp8, scales)``: ``(K, columns)`` fp8 and ``(G, K)`` float32, the same
        contract as ``quantize_jagged_colwise(xt.t())``.
    """
    _check_2d("xt", xt, 0)
    check_fp8_dtype(float8_dtype)
    check_offsets(offs, xt.device)
    alignment = check_group_alignment(group_alignment)
    src = xt.unsqueeze(0)
    q, scales, _, _ = quantize_groups_transposed(
        src, src[:, :0], offs, float8_dtype, round_scales_to_power_of_2, batched=False, group_alignment=alignment
    )
    return q[0], scales


def quantize_jagged_colwise_dual(
    x: torch.Tensor,
    grad_out: torch.Tensor,
    offs: torch.Tensor,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    round_scales_to_power_of_2: bool = False,
    group_alignment: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both wgrad operands in one launch: ``quantize_jagged_colwise`` of ``x`` and of ``grad_out``.

    Args:
        x: ``(M, K)``, grad_out: ``(M, N)``; bf16/fp16/fp32, contiguous, same device.
        offs, float8_dtype, round_scales_to_power_of_2, group_alignment: as in ``quantize_jagged_colwise``.

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
    alignment = check_group_alignment(group_alignment)
    xt, x_scales, got, go_scales = quantize_groups_transposed(
        x.t().unsqueeze(0),
        grad_out.t().unsqueeze(0),
        offs,
        float8_dtype,
        round_scales_to_power_of_2,
        batched=False,
        group_alignment=alignment,
    )
    return xt[0], x_scales, got[0], go_scales

