"""Plain-PyTorch references for the quantization kernels, written independently of them."""

from __future__ import annotations

import torch

AMAX_EPS = 1e-12


def ref_scale(amax: torch.Tensor, float8_dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    """Dequantization scale from fp32 amax: max(amax, eps) / FP8_MAX, optionally 2**ceil(log2)."""
    fp8_max = torch.finfo(float8_dtype).max
    scale = amax.float().clamp(min=AMAX_EPS) * (1.0 / fp8_max)
    if pow2:
        finite = torch.isfinite(scale)
        mantissa, exponent = torch.frexp(torch.where(finite, scale, 1.0))
        # frexp: scale = m * 2**e with m in [0.5, 1); a power of two has m == 0.5.
        rounded = torch.where(mantissa == 0.5, scale, torch.ldexp(torch.ones_like(scale), exponent))
        scale = torch.where(finite, rounded, scale)
    return scale


def ref_amax(x: torch.Tensor, dim: int | tuple[int, ...]) -> torch.Tensor:
    """amax of |x| in fp32 with NaN counted as +Inf."""
    a = x.float().abs()
    return torch.where(a.isnan(), torch.inf, a).amax(dim=dim)


def ref_cast(x: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype) -> torch.Tensor:
    """fp8 of x * (1 / scale), saturated (``scale`` broadcasts against ``x``)."""
    fp8_max = torch.finfo(float8_dtype).max
    return (x.float() * (1.0 / scale)).clamp(-fp8_max, fp8_max).to(float8_dtype)


def ref_quantize_rowwise(
    x: torch.Tensor, float8_dtype: torch.dtype, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    scale = ref_scale(ref_amax(x, 1), float8_dtype, pow2)
    return ref_cast(x, scale[:, None], float8_dtype), scale
