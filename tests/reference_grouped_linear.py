"""Plain-PyTorch references for the grouped linear: exact fp32 autograd, and an fp32 emulation of the FP8 recipe."""

from __future__ import annotations

import torch

from tests.reference import ref_amax, ref_cast, ref_scale


def group_bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of each group (host-side: references may sync)."""
    ends = offs.tolist()
    return list(zip([0] + ends[:-1], ends))


def ref_grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """fp32 ``out[rows of g] = x[rows of g] @ w[g]^T``, differentiable; rows past ``offs[-1]`` are 0."""
    pieces = [x[s:e].float() @ w[g].float().T for g, (s, e) in enumerate(group_bounds(offs))]
    tail = x.new_zeros(x.shape[0] - int(offs[-1]), w.shape[1], dtype=torch.float32)
    return torch.cat(pieces + [tail])


def _dequant(t: torch.Tensor, dim: int, float8_dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    """Quantize ``t`` with one scale per slice along ``dim`` (reduced over ``dim``), then dequantize, in fp32."""
    scale = ref_scale(ref_amax(t, dim), float8_dtype, pow2).unsqueeze(dim)
    return ref_cast(t, scale, float8_dtype).float() * scale


def emulated_fp8_grouped_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    grad_out: torch.Tensor,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    pow2: bool = False,
    fold_dgrad: bool = False,
    fold_wgrad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, dx, dw)`` of the rowwise recipe with FP8 quantization emulated and fp32 GEMMs.

    out: x per row, w per (expert, row); dx: grad_out per row, w per (expert,
    column), or with ``fold_dgrad``: ``grad_out * s_w[g]`` per row (``s_w`` the
    forward weight scales) times the forward FP8 values of w; dw: grad_out and x
    per (group, column), or with ``fold_wgrad``: ``grad_out * s_x`` per (group,
    column) (``s_x`` the forward row scales of x) times the forward FP8 values of x.
    """
    q = dict(float8_dtype=float8_dtype, pow2=pow2)
    xq, goq = _dequant(x, 1, **q), _dequant(grad_out, 1, **q)
    wq, wtq = _dequant(w, 2, **q), _dequant(w, 1, **q)
    w_scales = ref_scale(ref_amax(w, 2), float8_dtype, pow2)
    w_fp8_values = ref_cast(w, w_scales.unsqueeze(2), float8_dtype).float()
    x_scales = ref_scale(ref_amax(x, 1), float8_dtype, pow2)
    x_fp8_values = ref_cast(x, x_scales.unsqueeze(1), float8_dtype).float()
    out = torch.zeros(x.shape[0], w.shape[1], device=x.device)
    dx = torch.zeros(x.shape, device=x.device)
    dw = torch.zeros(w.shape, device=x.device)
    for g, (s, e) in enumerate(group_bounds(offs)):
        out[s:e] = xq[s:e] @ wq[g].T
        if fold_dgrad:
            dx[s:e] = _dequant(grad_out[s:e].float() * w_scales[g], 1, **q) @ w_fp8_values[g]
        else:
            dx[s:e] = goq[s:e] @ wtq[g]
        if e > s and fold_wgrad:
            dw[g] = _dequant(grad_out[s:e].float() * x_scales[s:e, None], 0, **q).T @ x_fp8_values[s:e]
        elif e > s:
            dw[g] = _dequant(grad_out[s:e], 0, **q).T @ _dequant(x[s:e], 0, **q)
    return out, dx, dw
