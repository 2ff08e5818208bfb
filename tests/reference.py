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


def ref_quantize_expert_weights(
    w: torch.Tensor, float8_dtype: torch.dtype, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, N, K) -> fp8 (E, N, K) and scales (E, N): amax over K."""
    scale = ref_scale(ref_amax(w, 2), float8_dtype, pow2)
    return ref_cast(w, scale[:, :, None], float8_dtype), scale


def ref_quantize_expert_weights_transposed(
    w: torch.Tensor, float8_dtype: torch.dtype, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, N, K) -> fp8 (E, K, N) contiguous and scales (E, K): amax over N."""
    scale = ref_scale(ref_amax(w, 1), float8_dtype, pow2)
    return ref_cast(w.transpose(1, 2), scale[:, :, None], float8_dtype).contiguous(), scale


def ref_quantize_rowwise_cols_grouped(
    x: torch.Tensor, offs: torch.Tensor, float8_dtype: torch.dtype, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) + group ends -> fp8 (K, M) contiguous and scales (G, K): amax per group and column.

    Group g spans [clamp(offs[g-1]), max(clamp(offs[g]), start)) with clamp into
    [0, M]; tokens past the last group end give 0.
    """
    m, k = x.shape
    ends = offs.long().cpu().clamp(0, m).tolist()
    out = torch.zeros((k, m), dtype=float8_dtype, device=x.device)
    scales = []
    for g, end in enumerate(ends):
        start = ends[g - 1] if g > 0 else 0
        end = max(end, start)
        group = x[start:end]
        amax = ref_amax(group, 0) if end > start else torch.zeros(k, device=x.device)
        scale = ref_scale(amax, float8_dtype, pow2)
        out[:, start:end] = ref_cast(group.t(), scale[:, None], float8_dtype)
        scales.append(scale)
    return out, torch.stack(scales)


def ref_pad_token_columns(q: torch.Tensor, offs: torch.Tensor, alignment: int) -> torch.Tensor:
    """The padded token layout of ``kernels_helion.token_groups`` from a plain ``(C, M)`` one.

    Group ``g``'s columns move to ``sum(round_up(size[h], alignment) for h < g)``;
    the output has ``(ceil(M / A) + G) * A`` columns, zeros elsewhere.
    """
    cols, m = q.shape
    ends = offs.long().cpu().clamp(0, m).tolist()
    width = (-(-m // alignment) + len(ends)) * alignment
    out = torch.zeros((cols, width), dtype=q.dtype, device=q.device)
    start = dst = 0
    for end in ends:
        end = max(end, start)
        out[:, dst : dst + end - start] = q[:, start:end]
        dst += -(-(end - start) // alignment) * alignment
        start = end
    return out


def ref_e8m0(amax: torch.Tensor, rounding: str) -> torch.Tensor:
    """Biased e8m0 exponent (int64) of fp32 amax, in float64 math (``frexp``).

    rceil: ceil(log2(amax / 448)); floor: floor(log2(amax)) - 8; clamped to
    [-127, 127] then biased by 127; amax 0 -> 0; NaN/Inf amax -> 255.
    """
    a = amax.double()
    finite = torch.isfinite(a)
    target = a / 448.0 if rounding == "rceil" else a
    mantissa, exponent = torch.frexp(torch.where(finite & (a > 0), target, 1.0))
    # frexp: target = mantissa * 2**exponent with mantissa in [0.5, 1).
    if rounding == "rceil":
        unbiased = torch.where(mantissa == 0.5, exponent - 1, exponent)
    else:
        unbiased = exponent - 1 - 8
    unbiased = torch.where(a > 0, unbiased, -127).clamp(-127, 127)
    return torch.where(finite, unbiased + 127, 255).long()


def ref_quantize_mx(x: torch.Tensor, rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 along the last dim of ``x (..., C)``: e4m3fn ``(..., C)`` and uint8 scales ``(..., C // 32)``.

    Elements: x * 2**(127 - e) in float64 (exact), saturated to +-448, cast; NaN scale -> NaN elements.
    """
    blocks = x.double().unflatten(-1, (x.size(-1) // 32, 32))
    e = ref_e8m0(ref_amax(blocks, -1), rounding)
    scaled = blocks * torch.pow(2.0, (127 - e).double())[..., None]
    scaled = torch.where((e == 255)[..., None], torch.nan, scaled)
    q = scaled.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).flatten(-2)
    return q, e.to(torch.uint8)
