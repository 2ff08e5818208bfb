"""FP8 grouped GEMM for MoE weight gradients: a jagged contraction over each group's tokens.

``out[g] = (a_t[:, tokens of g] @ b_t[:, tokens of g].T) * a_scales[g][:, None] * b_scales[g][None, :]``

``a_t`` (N, M) is ``grad_out^T`` and ``b_t`` (K, M) is ``x^T``, both with the
token dimension contiguous (K-major for Hopper's FP8 tensor cores), quantized per
(group, row) so that each group's scales factor out of its contraction.

One program per (group, N tile, K tile): it loops over its group's tokens, so a
group of any size (0, 1, not a multiple of 16) works, the result does not depend
on the grid order (bitwise deterministic, no atomics), and with ``out`` given the
result is added to it in the epilogue (fused gradient accumulation: fp32 sum,
rounded once to ``out``'s dtype).
"""

from __future__ import annotations

from collections.abc import Callable

import helion
import helion.language as hl
import torch

from autotune_cache import select_config
from autotune_cache.registry import register_tuning
from kernels_helion._launch import launch, on_cpu, require_interpreter_on_cpu, with_tma
from kernels_helion.group_offsets import group_lanes
from kernels_helion.grouped_gemm import check_fp8_operand, tile_dot
from kernels_helion.l2_prefetch import gradient_prefetch, prefetch_tile_l2
from kernels_helion.token_groups import (
    WGRAD_GROUP_ALIGNMENT,
    check_group_alignment,
    group_token_span,
    load_group_token_span,
    padded_token_count,
    span_table_args,
)
from kernels_helion.validation import check_offsets, check_out_dtype, check_same_device, check_scales, check_tensor
from kernels_helion.tuning import (
    FINE_GRAINED_GEMM_SHAPES,
    MOE_GEMM_SHAPES,
    MOE_LAYER_GEMM_SHAPES,
    fp8_operands,
    gemm_space,
    is_amd,
    routed_offsets,
    vary,
)

# ``block_t`` (tokens per step, a constexpr since tiles are aligned to it) is an
# extra key; block_sizes = [BLOCK_K, BLOCK_N]. Best measured on H200 for the
# benchmark shapes: 256 (K) x 128 (N) output tiles, persistent programs
# interleaved over the tiles (one tile's epilogue overlaps the next tile's loads),
# pointer loads (TMA loads of the token tiles miscompute: see ``tma_config``).
DEFAULT_CONFIG = helion.Config(
    block_t=128,
    block_sizes=[256, 128],
    num_warps=8,
    num_stages=3,
    l2_groupings=[8],
    pid_type="persistent_interleaved",
)
# Under the CPU interpreter a program costs about the same whatever its tile: 32x32 output tiles.
CPU_CONFIG = helion.Config(block_t=32, block_sizes=[32, 32], num_warps=4, num_stages=1)


def edge_dot(acc, a_t, b_t, tile_n, tile_k, tile_t, start, end, upcast: bool) -> torch.Tensor:  # noqa: ANN001
    """``tile_dot`` over a token tile whose tokens outside ``[start, end)`` are zeroed."""
    in_group = (tile_t.index >= start) & (tile_t.index < end)
    a_tile = torch.where(in_group.unsqueeze(0), a_t[tile_n, tile_t], 0)
    b_tile = torch.where(in_group.unsqueeze(0), b_t[tile_k, tile_t], 0)
    return tile_dot(acc, a_tile, b_tile, upcast)


@helion.kernel(static_shapes=False)
def grouped_mm_wgrad_kernel(
    a_t: torch.Tensor,
    a_token_tiles: torch.Tensor,
    a_scales: torch.Tensor,
    b_t: torch.Tensor,
    b_token_tiles: torch.Tensor,
    b_scales: torch.Tensor,
    offs: torch.Tensor,
    out: torch.Tensor,
    accumulate: hl.constexpr,
    block_t: hl.constexpr,
    groups_pow2: hl.constexpr,
    alignment: hl.constexpr,
    whole_tiles: hl.constexpr,
    upcast_operands: hl.constexpr,
    prefetch_out: hl.constexpr,
    spans: torch.Tensor,
    span_table: hl.constexpr,
) -> torch.Tensor:
    n, m = a_t.shape
    k = b_t.size(0)
    num_groups = offs.size(0)
    # K tiles vary fastest, groups slowest: neighbouring programs share a_t's tile.
    for tile_k, tile_n, tile_g in hl.tile([k, n, num_groups], block_size=[None, None, 1]):
        g = tile_g.begin
        # The group's tokens are columns [lo, hi) of the operands (its padded span
        # starts at lo; with alignment 1, lo = start).
        if span_table:
            # Four values of the table made before the launch, instead of G lanes of offs and
            # their reductions in every program (a few hundred programs a group).
            start, end, lo, padded_end = load_group_token_span(spans, g)
        else:
            start, end, lo, padded_end = group_token_span(offs, g, groups_pow2, m, alignment, m)
        hi = torch.clamp(lo + (end - start), max=m)
        if prefetch_out:
            prefetch_tile_l2(out, g, tile_n, tile_k, n, k, prefetch_out)
        acc = hl.zeros([tile_n, tile_k], dtype=torch.float32)
        if whole_tiles:
            # Padded layout aligned to block_t: whole tiles, zeros past the group's
            # tokens, so no load is masked and the one loop is software-pipelined.
            for tile_p in hl.tile(lo // block_t, padded_end // block_t, block_size=1):
                a_tile = a_token_tiles[tile_n, tile_p.begin, :]
                b_tile = b_token_tiles[tile_k, tile_p.begin, :]
                acc = tile_dot(acc, a_tile, b_tile, upcast_operands)
        else:
            # Token tiles are aligned to block_t: the group's first and last tiles are
            # loaded whole and masked to [lo, hi) in registers; the tiles between
            # them are whole tiles of the token dimension, read through its
            # (rows, M // block_t, block_t) view so that the loads need no token mask
            # (loop bounds that come from offs would mask every load of a_t itself).
            first = lo // block_t
            last = (hi - 1) // block_t
            if hi > lo:
                first_token = first * block_t
                for tile_first in hl.tile(
                    first_token, torch.where(first_token + block_t < m, first_token + block_t, m), block_size=block_t
                ):
                    acc = edge_dot(acc, a_t, b_t, tile_n, tile_k, tile_first, lo, hi, upcast_operands)
                for tile_j in hl.tile(first + 1, last, block_size=1):
                    a_tile = a_token_tiles[tile_n, tile_j.begin, :]
                    b_tile = b_token_tiles[tile_k, tile_j.begin, :]
                    acc = tile_dot(acc, a_tile, b_tile, upcast_operands)
                if last > first:
                    last_token = last * block_t
                    for tile_last in hl.tile(
                        last_token, torch.where(last_token + block_t < m, last_token + block_t, m), block_size=block_t
                    ):
                        acc = edge_dot(acc, a_t, b_t, tile_n, tile_k, tile_last, lo, hi, upcast_operands)
        scales = a_scales[tile_g.begin, tile_n][:, None] * b_scales[tile_g.begin, tile_k][None, :]
        # An empty group contributes exactly zero, whatever its scales hold.
        result = torch.where(end > start, acc * scales, 0.0)
        if accumulate:
            # The sum in fp32, rounded once to out's dtype (a bf16 .grad or an fp32 main_grad).
            total = out[tile_g.begin, tile_n, tile_k].to(torch.float32) + result
            out[tile_g.begin, tile_n, tile_k] = total.to(out.dtype)
        else:
            out[tile_g.begin, tile_n, tile_k] = result.to(out.dtype)
    return out


def check_wgrad_operands(a_t: object, b_t: object) -> tuple[int, int, int]:
    """Checks shared by the wgrad GEMMs' token-contiguous operands; returns ``(N, M, K)``.

    ``a_t`` (N, M) and ``b_t`` (K, M) are FP8 of one dtype on one device, N, K >= 1.
    """
    check_fp8_operand("a_t", a_t, 2)
    check_fp8_operand("b_t", b_t, 2)
    assert isinstance(a_t, torch.Tensor) and isinstance(b_t, torch.Tensor)
    if b_t.dtype != a_t.dtype:
        raise TypeError(f"b_t must have the dtype of a_t ({a_t.dtype}), got {b_t.dtype}")
    check_same_device("b_t", b_t, a_t.device)
    n, m = a_t.shape
    k, m_b = b_t.shape
    if m_b != m:
        raise ValueError(f"b_t must be (K, M) with M = a_t.shape[1] = {m} tokens, got shape {tuple(b_t.shape)}")
    if n == 0 or k == 0:
        raise ValueError(f"a_t and b_t need N, K >= 1 rows, got a_t {tuple(a_t.shape)}, b_t {tuple(b_t.shape)}")
    return n, m, k


def wgrad_output(
    out: torch.Tensor | None,
    out_dtype: torch.dtype,
    shape: tuple[int, int, int],
    device: torch.device,
    accumulate_dtypes: tuple[torch.dtype, ...] = (torch.float32,),
) -> tuple[torch.Tensor, bool]:
    """``(out, accumulate)``: a new ``out_dtype`` tensor, or the checked gradient (of ``accumulate_dtypes``) to add into."""
    if out is None:
        check_out_dtype(out_dtype)
        return torch.empty(shape, dtype=out_dtype, device=device), False
    check_tensor("out", out, ndim=3, dtypes=accumulate_dtypes)
    if tuple(out.shape) != shape:
        raise ValueError(f"out must have shape {shape}, got {tuple(out.shape)}")
    check_same_device("out", out, device)
    return out, True


# id(config) -> (config, the config without block_t): made once per selected config, so that
# repeated calls hand ``launch`` the same object (its fast path is keyed on identity).
_kernel_configs: dict[int, tuple[helion.Config, helion.Config]] = {}


def _without_token_block(config: helion.Config) -> helion.Config:
    """``config`` without ``block_t``: the token tile is a launcher option, not a Helion one."""
    entry = _kernel_configs.get(id(config))
    if entry is None or entry[0] is not config:
        options = {name: value for name, value in config.config.items() if name != "block_t"}
        entry = _kernel_configs[id(config)] = (config, helion.Config(**options))
    return entry[1]


def tma_config(
    kernel: helion.Kernel,
    args: tuple[object, ...],
    config: helion.Config,
    out: torch.Tensor,
    accumulate: bool,
    loads: tuple[str, ...] = (),
) -> helion.Config:
    """``config`` with TMA where it helps on a GPU: the output tiles' stores when ``out`` is a new 16-bit tensor, and the loads from the arguments named in ``loads``.

    Stores, measured on the H200 (Triton 3.6): 1.5-3% faster wgrad GEMMs on
    average (-2.5% to +5.8% per MoE shape), bitwise the same result. An fp32 tile
    (accumulation, fp32 output) does not fit in shared memory next to the
    pipeline's buffers. TMA *loads* of the whole token tiles (``a_token_tiles``,
    ``b_token_tiles``) miscompute with the shipped 256x128 tiles: NaNs and
    run-to-run different outputs on the H200, where pointer loads are
    deterministic (``docs/experiments.md``); ``grouped_mm_wgrad`` does not ask
    for them.
    """
    if on_cpu(out):
        return config
    stores = () if accumulate or out.element_size() != 2 else ("out",)
    return with_tma(kernel, args, config, stores=stores, loads=loads)


def grouped_mm_wgrad(
    a_t: torch.Tensor,
    a_scales: torch.Tensor,
    b_t: torch.Tensor,
    b_scales: torch.Tensor,
    offs: torch.Tensor,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    group_alignment: int = 1,
) -> torch.Tensor:
    """Per-group FP8 GEMM contracting over each group's tokens (MoE weight gradient).

    ``out[g] = (a_t[:, s:e] @ b_t[:, s:e].T) * a_scales[g][:, None] * b_scales[g][None, :]``
    with ``s = offs[g-1]`` (0 for the first group) and ``e = offs[g]``. Tokens past
    ``offs[-1]`` are ignored; a group with no tokens gives 0. Offsets are clamped
    into ``[0, M]`` on the device (bad offsets: wrong groups, never out of bounds).

    With ``group_alignment = A > 1`` the operands' columns are in the padded token
    layout that ``quantize_rowwise_cols_grouped(..., group_alignment=A)`` writes (group
    ``g`` from column ``sum(round_up(size[h], A) for h < g)``, zeros up to its next
    multiple of ``A``; ``offs`` are still the unpadded group ends): when ``A`` is a
    multiple of the token tile (128 in the recipes), every load is a whole,
    unmasked tile, the fastest way to run this GEMM.

    Args:
        a_t: ``(N, M)`` float8_e4m3fn, contiguous (tokens contiguous), e.g. ``grad_out^T``.
        a_scales: ``(G, N)`` float32 dequantization scales per (group, row of ``a_t``).
        b_t: ``(K, M)`` float8 (same dtype), contiguous, e.g. ``x^T``.
        b_scales: ``(G, K)`` float32 dequantization scales per (group, row of ``b_t``).
        offs: ``(G,)`` int32 cumulative group ends.
        out: optional ``(G, N, K)`` float32/bfloat16/float16 contiguous gradient: the
            result is added to it in place (``out += ...``, summed in fp32 and rounded
            once) and it is returned.
        out_dtype: dtype of a new output (bfloat16, float16, float32) when ``out`` is None.
        group_alignment: 1 (token ``t`` in column ``t``) or the padded layout's ``A``;
            ``M`` must then be a multiple of ``A``.

    Returns:
        ``(G, N, K)``: ``out`` when given, else a new tensor of ``out_dtype``.
    """
    n, m, k = check_wgrad_operands(a_t, b_t)
    check_offsets(offs, a_t.device)
    num_groups = offs.shape[0]
    check_scales("a_scales", a_scales, (num_groups, n), a_t.device)
    check_scales("b_scales", b_scales, (num_groups, k), a_t.device)
    if check_group_alignment(group_alignment) > 1 and m % group_alignment:
        raise ValueError(
            f"with group_alignment={group_alignment} the operands' token columns ({m}) must be a multiple of it "
            "(the padded layout of quantize_rowwise_cols_grouped)"
        )
    out, accumulate = wgrad_output(
        out, out_dtype, (num_groups, n, k), a_t.device, (torch.float32, torch.bfloat16, torch.float16)
    )
    require_interpreter_on_cpu(a_t)
    cpu = on_cpu(a_t)
    config = _select_config({"M": max(m, 1), "N": n, "K": k, "G": num_groups}, out, accumulate, cpu)
    block_t = int(config.config["block_t"])
    num_token_tiles = m // block_t
    a_token_tiles = a_t.as_strided((n, num_token_tiles, block_t), (m, block_t, 1))
    b_token_tiles = b_t.as_strided((k, num_token_tiles, block_t), (m, block_t, 1))
    args = (
        a_t,
        a_token_tiles,
        a_scales,
        b_t,
        b_token_tiles,
        b_scales,
        offs,
        out,
        accumulate,
        block_t,
        group_lanes(num_groups),
        group_alignment,
        group_alignment % block_t == 0,
        cpu,
        gradient_prefetch(out, accumulate, cpu),
        *span_table_args(offs, m, group_alignment, m, wanted=group_alignment % block_t == 0),
    )
    kernel_config = tma_config(grouped_mm_wgrad_kernel, args, _without_token_block(config), out, accumulate)
    launch(grouped_mm_wgrad_kernel, args, kernel_config)
    return out


def _select_config(key: dict[str, int], out: torch.Tensor, accumulate: bool, cpu: bool) -> helion.Config:
    """The config for ``key``; adding into a 16-bit gradient, the entries tuned that way (key
    ``ACC: 1``: the read-modify-write epilogue and the gradient's L2 prefetch move the best
    tile) where the cache has them, else the new-``dW`` entries'."""
    config = select_config("grouped_mm_wgrad", key, CPU_CONFIG if cpu else DEFAULT_CONFIG)
    if accumulate and out.element_size() == 2:
        config = select_config("grouped_mm_wgrad", {**key, "ACC": 1}, config)
    return config


# Tuning: the recipe's operands, in the padded token layout (each group from a multiple of 128 columns);
# keys with ``ACC: 1`` add into a bf16 gradient, as wgrad_accumulation="grad" runs it (the call clears the
# gradient first, so that every call gives one result; the clearing is in every config's time alike).
def _tuning_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
    columns = padded_token_count(shape["M"], shape["G"], WGRAD_GROUP_ALIGNMENT)
    a_t, _ = fp8_operands(shape["N"], columns, device=device)
    b_t, _ = fp8_operands(shape["K"], columns, device=device)
    a_scales = torch.rand(shape["G"], shape["N"], device=device) + 0.5
    b_scales = torch.rand(shape["G"], shape["K"], device=device) + 0.5
    offs = routed_offsets(shape["M"], shape["G"], device)
    if "ACC" not in shape:
        return lambda: grouped_mm_wgrad(a_t, a_scales, b_t, b_scales, offs, group_alignment=WGRAD_GROUP_ALIGNMENT)
    grad = torch.empty(shape["G"], shape["N"], shape["K"], device=device, dtype=torch.bfloat16)

    def call() -> torch.Tensor:
        grad.zero_()
        return grouped_mm_wgrad(a_t, a_scales, b_t, b_scales, offs, out=grad, group_alignment=WGRAD_GROUP_ALIGNMENT)

    return call


def _tuning_space(arch: str) -> list[helion.Config]:
    # Besides one persistent 8-warp program per SM: flat grids and two persistent 4-warp programs
    # per SM, where one program's epilogue overlaps another's loads (the short contractions of an
    # accumulating wgrad at a few hundred rows a group; the bf16 wgrad's tuning chose such programs).
    one = gemm_space(DEFAULT_CONFIG, [[256, 128], [128, 128], [128, 256]], stages=(3, 4, 5))(arch)
    if is_amd(arch):
        return one
    flat = vary(DEFAULT_CONFIG, block_sizes=[[128, 128]], num_warps=[4, 8], pid_type=["flat"])
    two = vary(DEFAULT_CONFIG, block_sizes=[[128, 128]], num_warps=[4], num_stages=[3, 4], num_sm_multiplier=[2])
    return [*one, *flat[1:], *vary(DEFAULT_CONFIG, pid_type=["flat"])[1:], *two[1:]]


# The layer's FP8 wgrads adding into .grad (gradient accumulation) where "auto" takes them: DeepSeek-V3-like
# 256 experts (256 rows a group) and Qwen3-30B-like 32768 tokens (2048), w1 and w3 as one and w2.
ACCUMULATION_SHAPES = (
    (65536, 4096, 7168, 256), (65536, 7168, 2048, 256), (262144, 1536, 2048, 128), (262144, 2048, 768, 128)
)
_TEST_SHAPE = {"M": 70, "N": 32, "K": 48, "G": 3}

register_tuning(
    "grouped_mm_wgrad",
    DEFAULT_CONFIG,
    _tuning_space,
    [{"M": m, "N": n, "K": k, "G": g}
     for m, n, k, g in MOE_GEMM_SHAPES + FINE_GRAINED_GEMM_SHAPES + MOE_LAYER_GEMM_SHAPES]
    + [{"M": m, "N": n, "K": k, "G": g, "ACC": 1} for m, n, k, g in ACCUMULATION_SHAPES],
    _tuning_call,
    _TEST_SHAPE,
    exact=False,
    other_test_shapes=[{**_TEST_SHAPE, "ACC": 1}],
)
