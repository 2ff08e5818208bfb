"""16-bit grouped GEMM for MoE weight gradients over rows as stored: gathered by index, added into the gradient.

``out[g] (+)= a[rows of g]^T @ b[rows of g]`` for ``a (P, N)`` (``grad_out``) and
``b (P, K)`` (the GEMM's input), or ``b (T, K)`` tokens read at ``index[p]``.

The FP8 wgrad (``grouped_gemm_wgrad``) needs both operands transposed, with the tokens
contiguous (Hopper's FP8 tensor cores take only K-major operands). Its 16-bit form does
not: Hopper's bf16/fp16 wgmma reads MN-major tiles, so this kernel reads the row-major
activations in place. That lets it

- **gather** ``b``'s rows by index inside its loads (the fused up-projection's wgrad
  reads each token where it is stored, no ``(P, K)`` copy of ``x``), and
- **accumulate**: with ``out`` given, the result is added to it in the epilogue
  (fp32 sum, rounded once to ``out``'s dtype), so a micro-batch's gradient needs no
  separate add pass over every expert weight (``ops.grad_accumulation``).

One program per (group, N tile, K tile) loops over its group's rows in a fixed order:
any group size (0, 1, unaligned), bitwise deterministic, no atomics. Rows of ``a``
and ``b`` outside the group are zeroed before the dot, so a NaN or Inf reaches only its
own group's ``dW``.
"""

from __future__ import annotations

from collections.abc import Callable

import helion
import helion.language as hl
import torch

from autotune_cache import select_config
from autotune_cache.registry import register_tuning
from kernels_helion._launch import launch, on_cpu, require_interpreter_on_cpu
from kernels_helion.group_offsets import group_lanes
from kernels_helion.grouped_gemm_wgrad import tma_config, wgrad_output
from kernels_helion.token_groups import group_token_span, load_group_token_span, span_table_args
from kernels_helion.tuning import FINE_GRAINED_GEMM_SHAPES, gemm_space, is_amd, random_bf16, routed_offsets, vary
from kernels_helion.validation import check_offsets, check_same_device, check_tensor

# block_sizes = [BLOCK_K, BLOCK_N, BLOCK_P (rows per step)].
DEFAULT_CONFIG = helion.Config(
    block_sizes=[128, 256, 64],
    num_warps=8,
    num_stages=3,
    l2_groupings=[8],
    pid_type="persistent_interleaved",
)
CPU_CONFIG = helion.Config(block_sizes=[32, 32, 16], num_warps=4, num_stages=1)

WGRAD_BF16_DTYPES = (torch.bfloat16, torch.float16)


@helion.kernel(static_shapes=False)
def grouped_mm_wgrad_bf16_kernel(
    a: torch.Tensor,
    b: torch.Tensor,
    index: torch.Tensor,
    offs: torch.Tensor,
    out: torch.Tensor,
    accumulate: hl.constexpr,
    gather: hl.constexpr,
    groups_pow2: hl.constexpr,
    upcast_operands: hl.constexpr,
    spans: torch.Tensor,
    span_table: hl.constexpr,
) -> torch.Tensor:
    p, n = a.shape
    sources, k = b.shape
    num_groups = offs.size(0)
    # K tiles vary fastest, groups slowest: neighbouring programs share a's tiles.
    for tile_k, tile_n, tile_g in hl.tile([k, n, num_groups], block_size=[None, None, 1]):
        if span_table:  # two values of the table made before the launch
            start, end, _, _ = load_group_token_span(spans, tile_g.begin)
        else:
            start, end, _, _ = group_token_span(offs, tile_g.begin, groups_pow2, p, 1, p)
        acc = hl.zeros([tile_n, tile_k], dtype=torch.float32)
        for tile_p in hl.tile(start, end):
            # Loads are masked to the tile's rows in [start, end): rows outside read as 0.
            a_tile = a[tile_p, tile_n]
            if gather:
                b_tile = b[torch.clamp(index[tile_p], 0, sources - 1), tile_k]
            else:
                b_tile = b[tile_p, tile_k]
            if upcast_operands:  # the CPU interpreter's 16-bit dot is wrong: fp32 operands there
                acc = hl.dot(a_tile.T.to(torch.float32), b_tile.to(torch.float32), acc=acc)
            else:
                acc = hl.dot(a_tile.T, b_tile, acc=acc)
        if accumulate:
            # The sum in fp32, rounded once to out's dtype (a 16-bit .grad or an fp32 main_grad).
            out[tile_g.begin, tile_n, tile_k] = (out[tile_g.begin, tile_n, tile_k].to(torch.float32) + acc).to(
                out.dtype
            )
        else:
            out[tile_g.begin, tile_n, tile_k] = acc.to(out.dtype)
    return out


def _check_rows_operand(name: str, t: object) -> torch.Tensor:
    """A 2-D bf16/fp16 tensor whose rows are contiguous (a column slice of a wider tensor will do)."""
    t = check_tensor(name, t, ndim=2, dtypes=WGRAD_BF16_DTYPES, contiguous=False)
    if t.stride(1) != 1 and t.shape[1] > 1:
        raise ValueError(f"{name} must have contiguous rows (stride 1 along dim 1), got strides {t.stride()}")
    return t


def grouped_mm_wgrad_bf16(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor,
    index: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Per-group 16-bit GEMM contracting over each group's rows (MoE weight gradient).

    ``out[g] = a[s:e]^T @ b[s:e]`` (``b[index[s:e]]`` with ``index``), summed in fp32,
    with ``s = offs[g-1]`` (0 for the first group) and ``e = offs[g]``. Rows past
    ``offs[-1]`` are not read; an empty group gives 0. Offsets are clamped into ``[0, P]``
    and indices into ``[0, T)`` on the device (bad values: wrong rows, never out of bounds).

    Args:
        a: ``(P, N)`` bf16/fp16 with contiguous rows, e.g. ``grad_out`` (a column slice of
            a wider tensor will do).
        b: ``(P, K)`` of ``a``'s dtype with contiguous rows, or ``(T, K)`` rows read at ``index``.
        offs: ``(G,)`` int32 cumulative group ends over the ``P`` rows.
        index: optional ``(P,)`` int32/int64: row ``p`` of the contraction reads ``b[index[p]]``.
        out: optional ``(G, N, K)`` float32/bfloat16/float16 contiguous gradient: the result
            is added to it in place (summed in fp32, rounded once) and it is returned.
        out_dtype: dtype of a new output (bfloat16, float16, float32) when ``out`` is None.

    Returns:
        ``(G, N, K)``: ``out`` when given, else a new tensor of ``out_dtype``.
    """
    a = _check_rows_operand("a", a)
    b = _check_rows_operand("b", b)
    if b.dtype != a.dtype:
        raise TypeError(f"b must have the dtype of a ({a.dtype}), got {b.dtype}")
    check_same_device("b", b, a.device)
    check_offsets(offs, a.device)
    p, n = a.shape
    k = b.shape[1]
    gather = index is not None
    if not gather and b.shape[0] != p:
        raise ValueError(f"b must have P = a.shape[0] = {p} rows without index, got shape {tuple(b.shape)}")
    if gather:
        check_tensor("index", index, ndim=1, dtypes=(torch.int32, torch.int64))
        check_same_device("index", index, a.device)
        if index.shape[0] != p:
            raise ValueError(f"index must have P = a.shape[0] = {p} entries, got {index.shape[0]}")
        if b.shape[0] == 0 and p > 0:
            raise ValueError("b must have at least one row to read at index")
    if n == 0 or k == 0:
        raise ValueError(f"a and b need N, K >= 1 columns, got a {tuple(a.shape)}, b {tuple(b.shape)}")
    num_groups = offs.shape[0]
    out, accumulate = wgrad_output(
        out, out_dtype, (num_groups, n, k), a.device, (torch.float32, torch.bfloat16, torch.float16)
    )
    require_interpreter_on_cpu(a)
    cpu = on_cpu(a)
    config = select_config(
        "grouped_mm_wgrad_bf16", {"M": max(p, 1), "N": n, "K": k, "G": num_groups}, CPU_CONFIG if cpu else DEFAULT_CONFIG
    )
    # Without gather the kernel never reads index: any int tensor on the device stands in.
    args = (
        a, b, index if gather else offs, offs, out, accumulate, gather, group_lanes(num_groups), cpu,
        *span_table_args(offs, p, 1, p),
    )
    launch(grouped_mm_wgrad_bf16_kernel, args, tma_config(grouped_mm_wgrad_bf16_kernel, args, config, out, accumulate))
    return out


# Tuning: the fine-grained MoE shapes (M pairs, N, K, G), and two of the MoE layer benchmark's per-weight
# wgrads at 8192 tokens (Qwen3-30B-like w1 / w3, DeepSeek-V3-like 256 experts' w2), where gradient
# accumulation runs this kernel at a few hundred rows a group. DeepSeek-V3-like w1 / w3 (65536, 2048,
# 7168, 256) is left to its nearest entry: the config the tuner chose there, 1-5% faster into a bf16
# ``.grad``, ran 10% slower into an fp32 ``main_grad`` (docs/experiments.md).
ACCUMULATION_SHAPES = ((65536, 768, 2048, 128), (65536, 7168, 2048, 256))


def _tuning_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
    # As the library runs it: dW added into a bf16 gradient (a new dW is CUTLASS's, ``ops.wgrad_precision``).
    # The call clears the gradient first, so that every call gives one result; the clearing is in every
    # config's time alike.
    a = random_bf16(shape["M"], shape["N"], device=device)
    b = random_bf16(shape["M"], shape["K"], device=device)
    offs = routed_offsets(shape["M"], shape["G"], device)
    grad = torch.empty(shape["G"], shape["N"], shape["K"], device=device, dtype=torch.bfloat16)

    def call() -> torch.Tensor:
        grad.zero_()
        return grouped_mm_wgrad_bf16(a, b, offs, out=grad)

    return call


def _tuning_space(arch: str) -> list[helion.Config]:
    # Short contractions (a few hundred rows a group) leave each tile's epilogue exposed:
    # besides one persistent program per SM, flat grids and two 4-warp programs per SM,
    # where one program's epilogue overlaps another's loads. Flat grids of 4-warp 128x128
    # programs (two resident an SM, held there by their ~250 registers) come first: adding
    # into the gradient, they ran 1.00-1.09x the two persistent programs in eager timing
    # at the fine-grained shapes, 1.09-1.15x into an fp32 ``main_grad``; the tuner's
    # cold-L2 timing kept them at the layer's Qwen3-30B-like w1 shape (docs/experiments.md).
    one = gemm_space(
        DEFAULT_CONFIG,
        [[128, 256, 64], [128, 128, 64], [256, 128, 64], [128, 256, 32], [64, 256, 64]],
        stages=(3, 4),
        pid_types=("persistent_interleaved", "flat"),
    )(arch)
    if is_amd(arch):
        return one
    flat = vary(DEFAULT_CONFIG, block_sizes=[[128, 128, 64]], num_warps=[4], num_stages=[3, 2], pid_type=["flat"])[1:]
    two = vary(DEFAULT_CONFIG, block_sizes=[[128, 128, 64], [64, 256, 64], [128, 128, 32]], num_warps=[4],
               num_stages=[3, 4], num_sm_multiplier=[2])[1:]
    return [one[0], *flat, *one[1:], *two]


register_tuning(
    "grouped_mm_wgrad_bf16",
    DEFAULT_CONFIG,
    _tuning_space,
    [{"M": m, "N": n, "K": k, "G": g} for m, n, k, g in (*FINE_GRAINED_GEMM_SHAPES, *ACCUMULATION_SHAPES)],
    _tuning_call,
    {"M": 70, "N": 32, "K": 48, "G": 3},
    exact=False,
)
