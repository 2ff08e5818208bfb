"""The math of the FP8 formats, written once and used by every kernel.

Scale convention (every kernel in this library):
    Each scale stored is a *dequantization* scale ``s`` (float32), one per block
    (a row, an ``(expert, row)``, a ``(group, column)``, ...):

        s = max(amax, AMAX_EPS) / FP8_MAX            (optionally rounded up to 2**n)
        q = saturate(x * (1 / s))                     (round to nearest even)
        x ~= q * s

    A GEMM multiplies its fp32 accumulator by ``s_a * s_b``. ``1 / s`` is a
    correctly rounded reciprocal (``div_rn``), so the GPU result is bitwise equal
    to the same arithmetic in PyTorch.

NaN and Inf: ``amax`` treats NaN as +Inf, so a block holding NaN or Inf gets the
scale +Inf; its non-finite elements become NaN and the GEMM output it touches
becomes NaN. Nothing is hidden.

FP8 dtypes: ``float8_e4m3fn`` (NVIDIA, max 448) and ``float8_e4m3fnuz`` (AMD
MI300, max 240). Kernels write fp8 *bits* into uint8 buffers that the launcher
views as the requested dtype; the bits come from the hardware cast where it is
exact, else from an fp32 emulation of it (see ``to_fp8_bits``), so both formats
work on every backend, including Triton's CPU interpreter, bit for bit alike.
"""

from __future__ import annotations

import os

import torch

import helion.language as hl

FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)

# Floor of amax: an all-zero block gets a tiny finite scale and a zero output.
AMAX_EPS = 1e-12

# The side of a blockwise (DeepSeek-V3) scale block: 1x128 for activations, 128x128 for weights.
BLOCKWISE_SCALE_BLOCK = 128

_F32_MANTISSA_MASK = 0x007FFFFF
_F32_EXPONENT_MASK = 0x7F800000


def check_fp8_dtype(float8_dtype: torch.dtype, arg_name: str = "float8_dtype") -> None:
    """Raise ``TypeError`` unless ``float8_dtype`` is a supported FP8 dtype."""
    if float8_dtype not in FP8_DTYPES:
        raise TypeError(
            f"{arg_name} must be one of {[str(d) for d in FP8_DTYPES]}, got {float8_dtype}"
        )


def fp8_max(float8_dtype: torch.dtype) -> float:
    """Largest finite value of ``float8_dtype`` (448 for e4m3fn, 240 for e4m3fnuz)."""
    check_fp8_dtype(float8_dtype)
    return float(torch.finfo(float8_dtype).max)


def is_fnuz(float8_dtype: torch.dtype) -> bool:
    """Whether ``float8_dtype`` is the AMD ``fnuz`` variant (bias 8, no -0, NaN = 0x80)."""
    check_fp8_dtype(float8_dtype)
    return float8_dtype == torch.float8_e4m3fnuz


# ---------------------------------------------------------------------------
# Device helpers: called from inside Helion kernels (Helion traces them inline).
# ---------------------------------------------------------------------------


def abs_nan_as_inf(v: torch.Tensor) -> torch.Tensor:
    """``|v|`` with NaN mapped to +Inf, so that max-reductions propagate NaN inputs."""
    return torch.where(v != v, float("inf"), torch.abs(v))


# +Inf's bits in the 16-bit float formats: every NaN's magnitude bits are above them.
_HALF_INF_BITS = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


def magnitude_bits(v: torch.Tensor) -> torch.Tensor:
    """``|v|`` of an fp32 (int32 bits) or bf16/fp16 (int16 bits) tile, as bits that order like the magnitudes (every NaN above +Inf).

    For max-reductions: an integer max of these bits is an amax that propagates
    NaN with no NaN test (``magnitude_bits_to_amax`` reads it back). A 16-bit tile
    is reduced as it is, so a kernel need not hold an fp32 copy of it (half the
    registers). Which of the two reductions is faster depends on the kernel's
    layout, so each kernel uses the one measured faster on the H200, each with
    configs tuned for it: these bits in the activation amax pass, the blockwise
    quantizers, the per-group quantizer on contiguous tokens, the per-group MX
    quantizer (1-22%; its cell programs take the fp32 bits of the fp32 copy their
    scaling needs, one input for both amaxes of a rows-and-cols quantizer) and the transposing
    MX quantizer (16-bit tiles); ``abs_nan_as_inf`` in whole-row and ungrouped MX
    reductions along the contiguous dimension, where the bits were up to 11% slower.
    """
    if v.dtype in _HALF_INF_BITS:
        return v.view(torch.int16) & 0x7FFF
    return v.view(torch.int32) & 0x7FFFFFFF


def magnitude_bits_to_amax(bits: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The fp32 amax from reduced ``magnitude_bits`` of a ``dtype`` tile, NaN as +Inf."""
    if dtype in _HALF_INF_BITS:
        return torch.clamp(bits, max=_HALF_INF_BITS[dtype]).view(dtype).to(torch.float32)
    return torch.clamp(bits, max=_F32_EXPONENT_MASK).view(torch.float32)


def abs_amax(v: torch.Tensor, dim: int) -> torch.Tensor:
    """fp32 ``max |v|`` along ``dim`` of an fp32, bf16 or fp16 tile, NaN as +Inf, through ``magnitude_bits``."""
    return magnitude_bits_to_amax(torch.amax(magnitude_bits(v), dim=dim), v.dtype)


def amax_to_scale(amax: torch.Tensor, fp8_max: float, round_to_pow2: bool) -> torch.Tensor:
    """Dequantization scale from a block's fp32 amax (see the module docstring)."""
    scale = torch.clamp(amax, min=AMAX_EPS) * (1.0 / fp8_max)
    if round_to_pow2:
        # Round up to a power of two by carrying any mantissa bit into the exponent;
        # +Inf stays +Inf (mantissa 0), so propagation is kept.
        bits = scale.view(torch.int32)
        bits = (bits + _F32_MANTISSA_MASK) & _F32_EXPONENT_MASK
        scale = bits.view(torch.float32)
    return scale


def scale_reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """Correctly rounded ``1 / scale`` (Triton's ``/`` is approximate on NVIDIA GPUs)."""
    return hl.inline_triton(
        "tl.math.div_rn(tl.full([], 1.0, tl.float32), {0})",
        args=(scale,),
        output_like=scale,
    )


def round_magnitude_to_e4m3_grid(a: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``a >= 0`` to the nearest (ties to even) value of the e4m3 grid, in fp32.

    The grid is e4m3fn's without its top limit (3 mantissa bits, subnormal step
    2**-9). Rounding here, not in the fp8 cast, makes the cast exact, so results
    agree bit for bit between GPUs and Triton's CPU interpreter (whose own fp8 cast
    drops the carry when the mantissa rounds up).
    """
    bits = a.view(torch.int32)
    # Normals: round the 23-bit mantissa to 3 bits; a carry moves into the exponent.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).view(torch.float32)
    # Subnormals (a < 2**-6): adding 2**14 rounds to a multiple of 2**-9 in fp32.
    subnormal = (a + 16384.0) - 16384.0
    return torch.where(a < 0.015625, subnormal, normal)


def emulates_fp8_cast(fnuz: bool) -> bool:
    """Whether kernels round to fp8 in fp32 arithmetic instead of the hardware cast.

    The hardware cast (one instruction per two elements on Hopper) rounds to nearest
    even like PyTorch's, so GPUs use it. The emulation (about 20 integer ops per
    element, which makes a bandwidth-bound kernel ALU-bound on a GPU) is for
    Triton's CPU interpreter, whose fp8 cast drops the carry when the mantissa
    rounds up, and for e4m3fnuz where Triton has no such type (everywhere but ROCm).
    """
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return interpreted or (fnuz and torch.version.hip is None)


def to_fp8_bits(v: torch.Tensor, fp8_max: float, fnuz: bool) -> torch.Tensor:
    """Saturate fp32 ``v`` to ``[-fp8_max, fp8_max]``, round to nearest even, return uint8 bits.

    Emulated (see ``emulates_fp8_cast``): the magnitude is rounded in fp32 and cast
    exactly; the sign bit is set from ``v``. e4m3fnuz has the e4m3fn bit layout
    with an exponent bias one larger, so its magnitude bits for ``v`` are the
    e4m3fn bits of ``2 |v|``, except that 240 maps to 0x7F (NaN in e4m3fn); it has
    no negative zero and its NaN is 0x80.
    """
    if not emulates_fp8_cast(fnuz) and not fnuz and torch.version.hip is None:
        # NVIDIA's cast (cvt.rn.satfinite.e4m3x2) saturates to +-448 itself and keeps NaN, so the
        # clamp, about 6 ALU ops per element (a third of a rows-and-cols quantizer's), is left out.
        return v.to(torch.float8_e4m3fn).view(torch.uint8)
    v = torch.clamp(v, -fp8_max, fp8_max)
    if not emulates_fp8_cast(fnuz):
        return v.to(torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn).view(torch.uint8)
    sign = torch.where(v.view(torch.int32) < 0, 0x80, 0)
    if fnuz:
        doubled = round_magnitude_to_e4m3_grid(torch.abs(v) * 2.0)
        top = doubled == 480.0
        magnitude = torch.where(top, 0.0, doubled).to(torch.float8_e4m3fn).view(torch.uint8)
        magnitude = torch.where(top, 0x7F, magnitude)
        bits = torch.where(magnitude == 0, 0, sign | magnitude)
        return torch.where(v != v, 0x80, bits).to(torch.uint8)
    magnitude = round_magnitude_to_e4m3_grid(torch.abs(v)).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(v != v, 0x7F, sign | magnitude).to(torch.uint8)


def fp8_bits_to_float(bits: torch.Tensor, fnuz: bool) -> torch.Tensor:
    """Decode uint8 e4m3fn (or e4m3fnuz) bits to fp32 with integer arithmetic, no fp8 type.

    For kernels on Triton's CPU interpreter, which has no e4m3fnuz type. The
    magnitude bits ``eeee mmm`` give ``2**(e - 7) * (1 + m/8)`` (``e > 0``) or
    ``2**-6 * m/8`` (``e = 0``) for e4m3fn, assembled here as fp32 bits; e4m3fnuz
    has an exponent bias one larger (half the value), no -0, and 0x80 as NaN,
    where e4m3fn has NaN at magnitude 0x7F.
    """
    b = bits.to(torch.int32)
    magnitude = b & 0x7F
    exponent = magnitude >> 3
    mantissa = magnitude & 7
    # Rebias the exponent to fp32's (127 - 7 = 120) and move the mantissa to its top 3 bits.
    normal = (((exponent + 120) << 23) | (mantissa << 20)).view(torch.float32)
    value = torch.where(exponent == 0, mantissa.to(torch.float32) * 0.001953125, normal)
    # The sign as a bit (a negation compiles to 0 - v in Triton, which turns -0 into +0).
    value = (value.view(torch.int32) | ((b & 0x80) << 24)).view(torch.float32)
    if fnuz:
        return torch.where(b == 0x80, float("nan"), value * 0.5)
    return torch.where(magnitude == 0x7F, float("nan"), value)
