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
as 0 (so the whole output is defined and a GEMM over them adds nothing).
Group ``g`` spans ``[clamp(offs[g-1]), max(clamp(offs[g]), start))``, clamped
into ``[0, M]``, so bad offsets never write out of bounds (decreasing offsets
give overlapping groups, whose outputs are then unspecified); an empty group gets
the scale of amax 0 (finite).
"""

from __future__ import annotations

import helion
import helion.language as hl
import torch

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
    group_ends: torch.Tensor, g: int, groups: int, tokens: int, batched: bool
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(batch, start, amax_end, end, is_tail)`` of program row ``g`` (``g == groups``: the tail).

    The tail program covers the tokens past the last group end: it reduces
    nothing (``amax_end == start``) and writes zeros.
    """
    is_tail = hl.full([], g, dtype=torch.int32) >= groups
    if batched:
        start = hl.full([], 0, dtype=torch.int32)
        end = torch.where(is_tail, 0, tokens)
    else:
        start = hl.load(group_ends, [g - 1], extra_mask=g > 0)
        end = hl.load(group_ends, [g], extra_mask=g < groups)
        end = torch.where(is_tail, tokens, end)
        start = torch.clamp(start, 0, tokens)
        end = torch.maximum(torch.clamp(end, 0, tokens), start)
    amax_end = torch.where(is_tail, start, end)
    return (g if batched else 0), start, amax_end, end, is_tail


@helion.kernel(static_shapes=False)
def quantize_groups_transposed_kernel(
    src_a: torch.Tensor,
    src_b: torch.Tensor,
    group_ends: torch.Tensor,
    max_fp8: hl.constexpr,
    fnuz: hl.constexpr,
    round_scales_to_power_of_2: hl.constexpr,
    batched: hl.constexpr,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``src_a`` and ``src_b`` (logical ``(B, C, T)`` views) per (group, column).

    ``src_b`` may have 0 columns (one operand). Returns token-contiguous fp8
    bits ``(B, C, T)`` and ``(G, C)`` scales for each operand.
    """
    batches, cols_a, tokens = src_a.shape
    cols_b = src_b.size(1)
    groups = group_ends.size(0)
    out_a = torch.empty([batches, cols_a, tokens], dtype=torch.uint8, device=src_a.device)
    out_b = torch.empty([batches, cols_b, tokens], dtype=torch.uint8, device=src_a.device)
    scales_a = torch.empty([groups, cols_a], dtype=torch.float32, device=src_a.device)
    scales_b = torch.empty([groups, cols_b], dtype=torch.float32, device=src_a.device)
    block_t = hl.register_block_size(16, 512)
    # The two operands' loops are identical; Helion allows no constexpr-guarded
    # top-level loop, so a single operand is passed with an empty src_b.
    for tile_g, tile_c in hl.tile([groups + 1, cols_a], block_size=[1, None]):
        g = tile_g.begin
        batch, start, amax_end, end, is_tail = _group_span(group_ends, g, groups, tokens, batched)
        amax = hl.zeros([tile_c], dtype=torch.float32)
        for tile_t in hl.tile(start, amax_end, block_size=block_t):
            v = hl.load(src_a, [batch, tile_c, tile_t], eviction_policy="evict_last")
            amax = torch.maximum(amax, torch.amax(abs_nan_as_inf(v.to(torch.float32)), dim=1))
        scale = amax_to_scale(amax, max_fp8, round_scales_to_power_of_2)
        hl.store(scales_a, [g, tile_c], scale, extra_mask=g < groups)
        inv_scale = scale_reciprocal(scale)[:, None]
        for tile_t in hl.tile(start, end, block_size=block_t):
            v = hl.load(src_a, [batch, tile_c, tile_t], eviction_policy="evict_first")
            bits = to_fp8_bits(v.to(torch.float32) * inv_scale, max_fp8, fnuz)
            out_a[batch, tile_c, tile_t] = torch.where(is_tail, 0, bits)
    for tile_g_b, tile_c_b in hl.tile([groups + 1, cols_b], block_size=[1, None]):
        g_b = tile_g_b.begin
        batch_b, start_b, amax_end_b, end_b, is_tail_b = _group_span(group_ends, g_b, groups, tokens, batched)
        amax_b = hl.zeros([tile_c_b], dtype=torch.float32)
        for tile_t_b in hl.tile(start_b, amax_end_b, block_size=block_t):
            v_b = hl.load(src_b, [batch_b, tile_c_b, tile_t_b], eviction_policy="evict_last")
            amax_b = torch.maximum(amax_b, torch.amax(abs_nan_as_inf(v_b.to(torch.float32)), dim=1))
        scale_b = amax_to_scale(amax_b, max_fp8, round_scales_to_power_of_2)
        hl.store(scales_b, [g_b, tile_c_b], scale_b, extra_mask=g_b < groups)
        inv_scale_b = scale_reciprocal(scale_b)[:, None]
        for tile_t_b in hl.tile(start_b, end_b, block_size=block_t):
            v_b = hl.load(src_b, [batch_b, tile_c_b, tile_t_b], eviction_policy="evict_first")
            bits_b = to_fp8_bits(v_b.to(torch.float32) * inv_scale_b, max_fp8, fnuz)
            out_b[batch_b, tile_c_b, tile_t_b] = torch.where(is_tail_b, 0, bits_b)
    return out_a, scales_a, out_b, scales_b


def quantize_groups_transposed(
    src_a: torch.Tensor,
    src_b: torch.Tensor,
    group_ends: torch.Tensor,
    float8_dtype: torch.dtype,
    round_scales_to_power_of_2: bool,
    batched: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run ``quantize_groups_transposed_kernel`` on ``(B, C, T)`` views; view bits as fp8."""
    require_interpreter_on_cpu(src_a)
    key = {"C": src_a.size(1) + src_b.size(1), "T": src_a.size(2), "G": group_ends.numel()}
    config = select_config("quantize_groups_transposed", key, DEFAULT_CONFIG)
    args = (
        src_a,
        src_b,
        group_ends,
        fp8_max(float8_dtype),
        is_fnuz(float8_dtype),
        round_scales_to_power_of_2,
        batched,
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each column of each token group of ``x``, written transposed.

    Args:
        x: ``(M, K)`` bf16/fp16/fp32, contiguous (tokens along rows).
        offs: ``(G,)`` int32 cumulative group ends (as ``torch._grouped_mm``), on x's device.
        float8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e4m3fnuz``.
        round_scales_to_power_of_2: round each scale up to a power of two.

    Returns:
        ``(xt_fp8, scales)``: ``xt_fp8`` is ``(K, M)`` contiguous (tokens
        contiguous), ``scales`` is ``(G, K)`` float32 with
        ``x[t, k] ~= xt_fp8[k, t] * scales[g, k]`` for token ``t`` of group ``g``.
        Columns of tokens past ``offs[-1]`` are 0.
    """
    _check_2d("x", x, 1)
    check_fp8_dtype(float8_dtype)
    check_offsets(offs, x.device)
    m, k = x.shape
    src = x.t().unsqueeze(0)
    xt, scales, _, _ = quantize_groups_transposed(
        src, src[:, :0], offs, float8_dtype, round_scales_to_power_of_2, batched=False
    )
    return xt.view(k, m), scales


def quantize_jagged_rowwise(
    xt: torch.Tensor,
    offs: torch.Tensor,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    round_scales_to_power_of_2: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_jagged_colwise`` for an input already transposed: ``xt`` is ``(K, M)``.

    Args:
        xt: ``(K, M)`` bf16/fp16/fp32, contiguous (tokens contiguous; groups run along columns).
        offs, float8_dtype, round_scales_to_power_of_2: as in ``quantize_jagged_colwise``.

    Returns:
        ``(xt_fp8, scales)``: ``(K, M)`` fp8 and ``(G, K)`` float32, the same
        contract as ``quantize_jagged_colwise(xt.t())``.
    """
    _check_2d("xt", xt, 0)
    check_fp8_dtype(float8_dtype)
    check_offsets(offs, xt.device)
    src = xt.unsqueeze(0)
    q, scales, _, _ = quantize_groups_transposed(
        src, src[:, :0], offs, float8_dtype, round_scales_to_power_of_2, batched=False
    )
    return q.view(xt.shape), scales


def quantize_jagged_colwise_dual(
    x: torch.Tensor,
    grad_out: torch.Tensor,
    offs: torch.Tensor,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    round_scales_to_power_of_2: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both wgrad operands in one launch: ``quantize_jagged_colwise`` of ``x`` and of ``grad_out``.

    Args:
        x: ``(M, K)``, grad_out: ``(M, N)``; bf16/fp16/fp32, contiguous, same device.
        offs, float8_dtype, round_scales_to_power_of_2: as in ``quantize_jagged_colwise``.

    Returns:
        ``(xt_fp8 (K, M), x_scales (G, K), got_fp8 (N, M), go_scales (G, N))``.
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
    (m, k), n = x.shape, grad_out.size(1)
    xt, x_scales, got, go_scales = quantize_groups_transposed(
        x.t().unsqueeze(0),
        grad_out.t().unsqueeze(0),
        offs,
        float8_dtype,
        round_scales_to_power_of_2,
        batched=False,
    )
    return xt.view(k, m), x_scales, got.view(n, m), go_scales
