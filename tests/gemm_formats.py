"""The grouped GEMMs of the three formats (rowwise, blockwise, mxfp8) in both layouts, for the tests.

Per format and layout: how its operands are made (random data, quantized as the recipe
quantizes them), its plain-PyTorch reference, and a ``Gemm`` adapter that
``tests/test_grouped_gemm_shared.py`` runs the behaviour all GEMMs share on.

Layouts: ``2d3d`` (``out (M, N)``, row ``i`` of group ``g`` times expert ``g``'s weight;
rows past the last group end are 0) and ``wgrad`` (``out (G, N, K)``, a contraction over
each group's tokens; an empty group gives 0).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kernels_helion import (
    grouped_mm_2d3d,
    grouped_mm_2d3d_blockwise,
    grouped_mm_2d3d_mx,
    grouped_mm_wgrad,
    grouped_mm_wgrad_blockwise,
    grouped_mm_wgrad_mx,
    quantize_blockwise_cols_grouped,
    quantize_blockwise_rows,
    quantize_blockwise_weights,
    quantize_mx_expert_weights,
    quantize_mx_rows,
)
from tests.reference_mx import ref_block_offs, ref_group_ends, ref_grouped_mm_wgrad_mx
from tests.support import DEVICE, offsets_from_sizes

FP8 = torch.float8_e4m3fn
BLOCK = 128  # the blockwise scale block
BENCH_SHAPES = [  # (M tokens, N, K, G) of the GPU runs: Llama4, DeepSeek-V3 up/down, Qwen3, large-G
    (32768, 8192, 5120, 4),
    (32768, 2048, 7168, 8),
    (32768, 7168, 2048, 8),
    (32768, 1536, 2048, 16),
    (65536, 2048, 7168, 32),
]


def assert_close_out(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """A GEMM output against its float64 reference.

    atol: the output dtype's rounding of the largest outputs (bf16: 2**-9 relative) plus the
    GPU's fp8 tensor-core accumulation error over long contractions.
    """
    atol = 4e-3 * float(expected.abs().amax()) + 1e-6
    torch.testing.assert_close(actual.double(), expected.double(), rtol=1.6e-2, atol=atol)


# Rowwise 2D x 3D.


def ref_grouped_mm_2d3d(a, a_scales, b, b_scales, offs) -> torch.Tensor:  # noqa: ANN001
    """Dequantize to fp32 and multiply each group by its expert; rows past offs[-1] are 0."""
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        rows = slice(start, end)
        out[rows] = (a[rows].float() * a_scales[rows, None]) @ (b[g].float() * b_scales[g][:, None]).T
        start = end
    return out


def make_rowwise_2d3d(m: int, n: int, k: int, e: int, device: torch.device = DEVICE) -> tuple[torch.Tensor, ...]:
    """Random FP8 ``a (m, k)``, ``b (e, n, k)`` and their row / column scales."""
    a = (torch.randn(m, k, device=device) * 200).clamp(-448, 448).to(FP8)
    b = (torch.randn(e, n, k, device=device) * 200).clamp(-448, 448).to(FP8)
    a_scales = torch.rand(m, device=device) * 1e-2 + 1e-3
    b_scales = torch.rand(e, n, device=device) * 1e-2 + 1e-3
    return a, a_scales, b, b_scales


# Blockwise 2D x 3D.


def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """``q * scales`` with each scale broadcast over its ``block_rows x block_cols`` block (fp64)."""
    rows, cols = q.shape
    full = scales.double().repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]
    return q.double() * full


def ref_grouped_mm_2d3d_blockwise(a, a_scales, b, b_scales, offs) -> torch.Tensor:  # noqa: ANN001
    """Dequantize with the block scales and multiply each group by its expert; rows past offs[-1] are 0."""
    a_deq = dequantize_blocks(a, a_scales, 1, BLOCK)
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64, device=a.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = a_deq[start:end] @ dequantize_blocks(b[g], b_scales[g], BLOCK, BLOCK).T
        start = end
    return out


def make_blockwise_2d3d(m: int, n: int, k: int, e: int, device: torch.device = DEVICE) -> tuple[torch.Tensor, ...]:
    """``(x, w, a, a_scales, b, b_scales)``: bf16 data with a spread of magnitudes (so the block scales differ)
    and its quantizations."""
    x = (torch.randn(m, k, device=device) * torch.rand(m, 1, device=device).add(0.1) * 4).to(torch.bfloat16)
    w = (torch.randn(e, n, k, device=device) * torch.rand(e, n, 1, device=device).add(0.1) * 1e-2).to(torch.bfloat16)
    a, a_scales = quantize_blockwise_rows(x)
    b, b_scales = quantize_blockwise_weights(w)
    return x, w, a, a_scales, b, b_scales


# MXFP8 2D x 3D.


def ref_dequantize_mx(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 ``q * 2**(e - 127)`` with one e8m0 exponent per 32 along the last dim; ``e == 255`` is NaN."""
    e = scales.to(torch.float64)
    block_scale = torch.where(e == 255, float("nan"), torch.exp2(e - 127))
    return q.double() * block_scale.repeat_interleave(32, dim=-1)


def ref_grouped_mm_mx(a, a_scales, b, b_scales, offs) -> torch.Tensor:  # noqa: ANN001
    """Dequantize and multiply each group by its expert (float64); rows past offs[-1] are 0."""
    a_deq = ref_dequantize_mx(a, a_scales)
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64, device=a.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = a_deq[start:end] @ ref_dequantize_mx(b[g], b_scales[g]).T
        start = end
    return out


def make_mx_2d3d(m: int, n: int, k: int, e: int, device: torch.device = DEVICE) -> tuple[torch.Tensor, ...]:
    """Unquantized ``(x, w)`` with varied magnitudes per block, and their MXFP8 quantizations."""
    block_magnitudes = torch.exp2(torch.randint(-6, 7, (m, k // 32), device=device).float())
    x = torch.randn(m, k, device=device) * block_magnitudes.repeat_interleave(32, dim=1)
    w = torch.randn(e, n, k, device=device) * 0.05
    a, sa = quantize_mx_rows(x)
    b, sb = quantize_mx_expert_weights(w)
    return x, w, a, sa, b, sb


# Rowwise wgrad.


def ref_grouped_mm_wgrad(a_t, a_scales, b_t, b_scales, offs) -> torch.Tensor:  # noqa: ANN001
    """Dequantize to fp32 and contract each group's tokens; empty groups give 0."""
    out = torch.zeros(offs.shape[0], a_t.shape[0], b_t.shape[0], dtype=torch.float32, device=a_t.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        tokens = slice(start, end)
        out[g] = (a_t[:, tokens].float() * a_scales[g][:, None]) @ (b_t[:, tokens].float() * b_scales[g][:, None]).T
        start = end
    return out


def make_rowwise_wgrad(m: int, n: int, k: int, g: int, device: torch.device = DEVICE) -> tuple[torch.Tensor, ...]:
    """Random FP8 ``a_t (n, m)``, ``b_t (k, m)`` and their per-(group, row) scales."""
    a_t = (torch.randn(n, m, device=device) * 200).clamp(-448, 448).to(FP8)
    b_t = (torch.randn(k, m, device=device) * 200).clamp(-448, 448).to(FP8)
    a_scales = torch.rand(g, n, device=device) * 1e-2 + 1e-3
    b_scales = torch.rand(g, k, device=device) * 1e-2 + 1e-3
    return a_t, a_scales, b_t, b_scales


# Blockwise wgrad.


def dequantize_cols_grouped(qt: torch.Tensor, scales: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """fp64 ``(rows, sum(sizes))`` in token order from the block-space ``qt (rows, R * 128)``.

    The block map is rebuilt from the sizes: block ``j`` of a group is block row
    ``row``, columns ``[row * 128, row * 128 + 128)`` of ``qt``.
    """
    out = torch.zeros(qt.shape[0], sum(sizes), dtype=torch.float64, device=qt.device)
    start, row = 0, 0
    for size in sizes:
        for j in range(0, size, BLOCK):
            count = min(BLOCK, size - j)
            block = qt[:, row * BLOCK : row * BLOCK + count].double()
            out[:, start + j : start + j + count] = block * scales[row].double()[:, None]
            row += 1
        start += size
    return out


def ref_wgrad(a_t: torch.Tensor, b_t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """``out[g] = a_t[:, tokens of g] @ b_t[:, tokens of g].T`` in fp64."""
    out = torch.zeros(len(sizes), a_t.shape[0], b_t.shape[0], dtype=torch.float64, device=a_t.device)
    start = 0
    for g, size in enumerate(sizes):
        out[g] = a_t[:, start : start + size].double() @ b_t[:, start : start + size].double().T
        start += size
    return out


def ref_wgrad_blockwise(a_t, a_scales, b_t, b_scales, sizes: list[int]) -> torch.Tensor:  # noqa: ANN001
    """The blockwise wgrad of block-space operands whose groups have ``sizes`` tokens (fp64)."""
    a = dequantize_cols_grouped(a_t, a_scales, sizes)
    b = dequantize_cols_grouped(b_t, b_scales, sizes)
    return ref_wgrad(a, b, sizes)


def make_blockwise_wgrad(m: int, n: int, k: int, sizes: list[int], device: torch.device = DEVICE) -> tuple:
    """``(grad_out, x, offs, a_t, a_scales, b_t, b_scales, group_block_starts)``: bf16 ``grad_out (M, N)`` and
    ``x (M, K)`` with varied token magnitudes, and their quantized transposes."""
    offs = offsets_from_sizes(sizes, device)
    grad_out = (torch.randn(m, n, device=device) * torch.rand(m, 1, device=device).add(0.1)).to(torch.bfloat16)
    x = (torch.randn(m, k, device=device) * torch.rand(1, k, device=device).add(0.1) * 8).to(torch.bfloat16)
    a_t, a_scales, starts = quantize_blockwise_cols_grouped(grad_out, offs)
    b_t, b_scales, _ = quantize_blockwise_cols_grouped(x, offs)
    return grad_out, x, offs, a_t, a_scales, b_t, b_scales, starts


# MXFP8 wgrad.


def make_mx_wgrad(m: int, n: int, k: int, offs: torch.Tensor, device: torch.device = DEVICE) -> tuple[torch.Tensor, ...]:
    """Random FP8 operands and e8m0 scales (2**-10 .. 2**6 per block) for the block map of ``offs``."""
    a_t = (torch.randn(n, m, device=device) * 100).clamp(-448, 448).to(FP8)
    b_t = (torch.randn(k, m, device=device) * 100).clamp(-448, 448).to(FP8)
    rows = -(-m // 32) + offs.numel()
    a_scales = torch.randint(117, 134, (rows, n), dtype=torch.uint8, device=device)
    b_scales = torch.randint(117, 134, (rows, k), dtype=torch.uint8, device=device)
    return a_t, a_scales, b_t, b_scales, ref_block_offs(offs, m)


# The adapters.


def group_sizes_of(offs: torch.Tensor, tokens: int) -> list[int]:
    """Token counts of the groups ``offs`` makes over ``tokens`` tokens, ends clamped into ``[0, tokens]`` and
    made non-decreasing."""
    ends = ref_group_ends(offs, tokens)
    return [end - start for start, end in zip([0, *ends[:-1]], ends)]


@dataclass(frozen=True)
class Gemm:
    """One grouped GEMM as the shared tests see it.

    ``make(sizes, tokens, n, k)`` gives the launcher's keyword arguments for groups of
    ``sizes`` tokens out of ``tokens`` (the rest past the last group end), an output of
    ``(tokens, n)`` (2d3d) or ``(G, n, k)`` (wgrad); ``reference(args)`` is the float64
    result of those arguments.
    """

    name: str
    layout: str
    launch: Callable[..., torch.Tensor]
    make: Callable[[list[int], int, int, int], dict[str, Any]]
    reference: Callable[[dict[str, Any]], torch.Tensor]

    def __call__(self, args: dict[str, Any], **overrides: Any) -> torch.Tensor:
        return self.launch(**{**args, **overrides})

    def __repr__(self) -> str:
        return self.name


def _rowwise_2d3d(sizes: list[int], m: int, n: int, k: int) -> dict[str, Any]:
    a, sa, b, sb = make_rowwise_2d3d(m, n, k, len(sizes))
    return dict(a=a, a_scales=sa, b=b, b_scales=sb, offs=offsets_from_sizes(sizes))


def _blockwise_2d3d(sizes: list[int], m: int, n: int, k: int) -> dict[str, Any]:
    _, _, a, sa, b, sb = make_blockwise_2d3d(m, n, k, len(sizes))
    return dict(a=a, a_scales=sa, b=b, b_scales=sb, offs=offsets_from_sizes(sizes))


def _mx_2d3d(sizes: list[int], m: int, n: int, k: int) -> dict[str, Any]:
    _, _, a, sa, b, sb = make_mx_2d3d(m, n, k, len(sizes))
    return dict(a=a, a_scales=sa, b=b, b_scales=sb, offs=offsets_from_sizes(sizes))


def _rowwise_wgrad(sizes: list[int], m: int, n: int, k: int) -> dict[str, Any]:
    a_t, sa, b_t, sb = make_rowwise_wgrad(m, n, k, len(sizes))
    return dict(a_t=a_t, a_scales=sa, b_t=b_t, b_scales=sb, offs=offsets_from_sizes(sizes))


def _blockwise_wgrad(sizes: list[int], m: int, n: int, k: int) -> dict[str, Any]:
    _, _, offs, a_t, sa, b_t, sb, starts = make_blockwise_wgrad(m, n, k, sizes)
    return dict(a_t=a_t, a_scales=sa, b_t=b_t, b_scales=sb, offs=offs, group_block_starts=starts)


def _mx_wgrad(sizes: list[int], m: int, n: int, k: int) -> dict[str, Any]:
    offs = offsets_from_sizes(sizes)
    a_t, sa, b_t, sb, block_offs = make_mx_wgrad(m, n, k, offs)
    # Scales 2**-18 .. 2**-2: products of 40 tokens stay within float16.
    sa, sb = sa - 8, sb - 8
    return dict(a_t=a_t, a_scales=sa, b_t=b_t, b_scales=sb, offs=offs, block_offs=block_offs)


def _valid_sizes(offs: torch.Tensor) -> list[int]:
    """Group sizes of valid offsets (non-negative, non-decreasing)."""
    ends = offs.tolist()
    assert ends == sorted(ends) and min(ends) >= 0, ends
    return [end - start for start, end in zip([0, *ends[:-1]], ends)]


def _operands(args: dict[str, Any], names: str) -> list[torch.Tensor]:
    return [args[name] for name in names.split()]


GEMMS = [
    Gemm("rowwise-2d3d", "2d3d", grouped_mm_2d3d, _rowwise_2d3d,
         lambda d: ref_grouped_mm_2d3d(*_operands(d, "a a_scales b b_scales offs")).double()),
    Gemm("blockwise-2d3d", "2d3d", grouped_mm_2d3d_blockwise, _blockwise_2d3d,
         lambda d: ref_grouped_mm_2d3d_blockwise(*_operands(d, "a a_scales b b_scales offs"))),
    Gemm("mxfp8-2d3d", "2d3d", grouped_mm_2d3d_mx, _mx_2d3d,
         lambda d: ref_grouped_mm_mx(*_operands(d, "a a_scales b b_scales offs"))),
    Gemm("rowwise-wgrad", "wgrad", grouped_mm_wgrad, _rowwise_wgrad,
         lambda d: ref_grouped_mm_wgrad(*_operands(d, "a_t a_scales b_t b_scales offs")).double()),
    Gemm("blockwise-wgrad", "wgrad", grouped_mm_wgrad_blockwise, _blockwise_wgrad,
         lambda d: ref_wgrad_blockwise(*_operands(d, "a_t a_scales b_t b_scales"), _valid_sizes(d["offs"]))),
    Gemm("mxfp8-wgrad", "wgrad", grouped_mm_wgrad_mx, _mx_wgrad,
         lambda d: ref_grouped_mm_wgrad_mx(*_operands(d, "a_t a_scales b_t b_scales offs"))),
]
