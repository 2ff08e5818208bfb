"""The math of the MXFP8 format (OCP Microscaling): e4m3fn elements, one e8m0 scale per 32.

A block of ``MX_BLOCK_SIZE`` (32) consecutive elements along one dimension shares
a scale ``2**(e - 127)`` stored as its biased exponent ``e`` (uint8, "e8m0";
``e == 255`` is NaN). Elements are ``q = saturate(x / 2**(e - 127))`` in
float8_e4m3fn (round to nearest even, saturated to +-448), so
``x ~= q * 2**(e - 127)``.

Scale exponent from the block's amax, two rounding modes:

- RCEIL (NVIDIA cuBLAS, torchao ``rceil``): the smallest power of two ``>= amax / 448``,
  so no element saturates. Computed exactly from the bits of ``amax``; it agrees
  with the fp32 division ``amax / 448`` rounded up except for ``amax < 2**-118``,
  where that division rounds into fp32 subnormals.
- FLOOR (OCP MX spec v1.0): ``floor(log2(amax)) - 8`` (8 = e4m3's largest exponent);
  elements up to ``1.75x`` above 448 saturate.

Both are clamped to ``[-127, 127]`` (biased ``[0, 254]``). An all-zero block gets
the smallest scale, ``2**-127`` (``e == 0``), and zero elements. A block holding
NaN or Inf (amax counts NaN as +Inf) gets ``e == 255`` (NaN, as the MX spec says)
and NaN elements, so the block decodes to NaN whichever way it is read.

Everything is exact integer arithmetic on float bits (no ``log2``), so GPUs and
Triton's CPU interpreter agree bit for bit.
"""

from __future__ import annotations

import torch

from kernels_helion.fp8_format import to_fp8_bits

MX_BLOCK_SIZE = 32
E8M0_BIAS = 127
E8M0_NAN = 255
MX_ROUNDING_MODES: tuple[str, ...] = ("rceil", "floor")
# Largest finite value of the element format, float8_e4m3fn, and its exponent.
MX_ELEMENT_MAX = 448.0
_E4M3_EMAX = 8
# Mantissa of 1.75 (448 = 1.75 * 2**8): amax's mantissa above it needs one more exponent.
_E4M3_MAX_MANTISSA = 0x600000
_F32_MANTISSA_MASK = 0x007FFFFF
_F32_BITS_2_POW_MINUS_127 = 0x00400000
_F32_BITS_INF = 0x7F800000


def check_rounding(rounding: object, arg_name: str = "rounding") -> None:
    """Raise ``ValueError`` unless ``rounding`` is ``'rceil'`` or ``'floor'``."""
    if rounding not in MX_ROUNDING_MODES:
        raise ValueError(f"{arg_name} must be one of {list(MX_ROUNDING_MODES)}, got {rounding!r}")


# ---------------------------------------------------------------------------
# Device helpers: called from inside Helion kernels (Helion traces them inline).
# ---------------------------------------------------------------------------


def amax_to_e8m0(amax: torch.Tensor, round_up: bool) -> torch.Tensor:
    """Biased e8m0 exponent (int32 in ``[0, 255]``) of a block's fp32 ``amax >= 0`` (or +Inf, +NaN).

    ``round_up``: RCEIL, else FLOOR (see the module docstring). Five integer
    operations: kernels compute it for every block, in every thread that holds the
    block's amax.
    """
    bits = amax.view(torch.int32)
    # amax >= 0, so the top bits are the biased exponent: floor(log2(amax)) + 127 for normals.
    # RCEIL: adding this carries into the exponent exactly when the mantissa is above 1.75's.
    carry = _F32_MANTISSA_MASK - _E4M3_MAX_MANTISSA if round_up else 0
    # No upper clamp: a finite amax gives at most 254 - 8 + 1 = 247.
    exponent = torch.clamp(((bits + carry) >> 23) - _E4M3_EMAX, min=0)
    return torch.where(bits >= _F32_BITS_INF, E8M0_NAN, exponent)


def e8m0_inverse_scale(exponent: torch.Tensor) -> torch.Tensor:
    """fp32 ``2**(127 - e)`` (exact) for a biased exponent ``e`` from ``amax_to_e8m0``; NaN for 255.

    Valid for ``e <= 253``, which covers every finite fp32 amax (they give ``e <= 247``).
    """
    inverse = ((2 * E8M0_BIAS - exponent) << 23).view(torch.float32)
    return torch.where(exponent == E8M0_NAN, float("nan"), inverse)


def e8m0_to_scale(exponent: torch.Tensor) -> torch.Tensor:
    """fp32 ``2**(e - 127)`` (exact) of int32 biased exponents ``e`` in ``[0, 255]``; NaN for 255.

    ``e = 0`` (2**-127) is an fp32 subnormal, which the exponent field cannot hold:
    its bits are written directly.
    """
    bits = torch.where(exponent == 0, _F32_BITS_2_POW_MINUS_127, exponent << 23)
    return torch.where(exponent == E8M0_NAN, float("nan"), bits.view(torch.float32))


def to_mx_element_bits(v: torch.Tensor, inverse_scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn bits (uint8) of ``v * inverse_scale``, saturated to +-448."""
    return to_fp8_bits(v * inverse_scale, MX_ELEMENT_MAX, False)
