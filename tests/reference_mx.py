"""Plain-PyTorch references for the MXFP8 recipe: per-group 32x1 quantization, its wgrad GEMM, the whole recipe.

The block rule, written independently of the kernels: group ``g`` (tokens
``[s, e)``, ``offs`` clamped into ``[0, M]`` and made non-decreasing) owns one
block per 32-token cell ``c`` it touches, tokens ``[max(s, 32c), min(e, 32c+32))``;
its blocks are consecutive scale rows in group order.
"""

from __future__ import annotations

import torch

from tests.reference import ref_quantize_mx
from tests.reference_grouped_linear import group_bounds

MX = 32


def ref_group_ends(offs: torch.Tensor, m: int) -> list[int]:
    """``offs`` clamped into ``[0, m]``, running max."""
    ends, end = [], 0
    for o in offs.tolist():
        end = max(end, min(max(o, 0), m))
        ends.append(end)
    return ends


def ref_token_blocks(offs: torch.Tensor, m: int) -> list[list[tuple[int, int, int]]]:
    """Per group, its blocks ``(scale_row, t0, t1)`` in order."""
    blocks, row, start = [], 0, 0
    for end in ref_group_ends(offs, m):
        group = []
        for cell in range(start // MX, (end - 1) // MX + 1) if end > start else ():
            group.append((row, max(start, MX * cell), min(end, MX * cell + MX)))
            row += 1
        blocks.append(group)
        start = end
    return blocks


def ref_block_offs(offs: torch.Tensor, m: int) -> torch.Tensor:
    """int32 cumulative block counts per group."""
    counts = [len(group) for group in ref_token_blocks(offs, m)]
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(offs.device)


def ref_cell_rows(offs: torch.Tensor, m: int) -> torch.Tensor:
    """int32 per 32-token cell: the scale row of the one block covering all its tokens, else -1
    (a group boundary inside it), or -2 when it starts past the last group's end."""
    last_end = ref_group_ends(offs, m)[-1]
    cells = []
    for cell in range(-(-m // MX)):
        tokens = (MX * cell, min(MX * cell + MX, m))
        blocks = [(row, t0, t1) for group in ref_token_blocks(offs, m) for row, t0, t1 in group if t0 // MX == cell]
        if tokens[0] >= last_end:
            cells.append(-2)
        elif len(blocks) == 1 and blocks[0][1:] == tokens:
            cells.append(blocks[0][0])
        else:
            cells.append(-1)
    return torch.tensor(cells, dtype=torch.int32, device=offs.device)


def ref_quantize_mx_cols_grouped(
    x: torch.Tensor, offs: torch.Tensor, rounding: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(xt (C, M) e4m3fn, scales (ceil(M/32) + G, C) uint8, block_offs (G,))``; tail columns and unused rows 0."""
    m, c = x.shape
    xt = torch.zeros(c, m, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.zeros(-(-m // MX) + offs.numel(), c, dtype=torch.uint8, device=x.device)
    for group in ref_token_blocks(offs, m):
        for row, t0, t1 in group:
            # Zero padding to a whole block leaves its amax (NaN counted as Inf) unchanged.
            padded = torch.zeros(c, MX, dtype=x.dtype, device=x.device)
            padded[:, : t1 - t0] = x[t0:t1].t()
            q, e = ref_quantize_mx(padded, rounding)
            xt[:, t0:t1] = q[:, : t1 - t0]
            scales[row] = e[:, 0]
    return xt, scales, ref_block_offs(offs, m)


def ref_exp2(e: torch.Tensor) -> torch.Tensor:
    """float64 ``2**(e - 127)`` of uint8 e8m0 exponents; 255 is NaN."""
    e = e.to(torch.float64)
    return torch.where(e == 255, float("nan"), torch.exp2(e - 127))


def ref_grouped_mm_wgrad_mx(
    a_t: torch.Tensor, a_scales: torch.Tensor, b_t: torch.Tensor, b_scales: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    """float64 ``out[g] = sum over g's blocks of dequantized a_t[:, T] @ dequantized b_t[:, T].T``; empty groups 0."""
    m = a_t.shape[1]
    blocks = ref_token_blocks(offs, m)
    out = torch.zeros(len(blocks), a_t.shape[0], b_t.shape[0], dtype=torch.float64, device=a_t.device)
    for g, group in enumerate(blocks):
        for row, t0, t1 in group:
            a = a_t[:, t0:t1].double() * ref_exp2(a_scales[row])[:, None]
            b = b_t[:, t0:t1].double() * ref_exp2(b_scales[row])[:, None]
            out[g] += a @ b.T
    return out


def _mx_dequant(t: torch.Tensor, rounding: str) -> torch.Tensor:
    """float64 of ``t`` quantized to MXFP8 along its last dim (a multiple of 32), dequantized."""
    q, e = ref_quantize_mx(t, rounding)
    return q.double() * ref_exp2(e).repeat_interleave(MX, dim=-1)


def emulated_mx_grouped_linear(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, grad_out: torch.Tensor, rounding: str = "rceil"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 ``(out, dx, dw)`` of the MXFP8 recipe with the quantization emulated and exact GEMMs.

    out: x and w 1x32 along K; dx: grad_out 1x32 along N, w 32x1 along N; dw:
    grad_out and x 32x1 along each group's tokens. Rows past ``offs[-1]`` give 0.
    """
    xq, goq = _mx_dequant(x, rounding), _mx_dequant(grad_out, rounding)
    wq = _mx_dequant(w, rounding)
    wtq = _mx_dequant(w.transpose(1, 2), rounding)  # (E, K, N)
    xt, xs, _ = ref_quantize_mx_cols_grouped(x, offs, rounding)
    got, gos, _ = ref_quantize_mx_cols_grouped(grad_out, offs, rounding)
    dw = ref_grouped_mm_wgrad_mx(got, gos, xt, xs, offs)
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64, device=x.device)
    dx = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for g, (s, e) in enumerate(group_bounds(offs)):
        out[s:e] = xq[s:e] @ wq[g].T
        dx[s:e] = goq[s:e] @ wtq[g].T
    return out, dx, dw
