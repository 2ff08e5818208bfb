"""MXFP8 grouped GEMM, 2D x 3D, emulated: ``out[rows of g] = a[rows of g] @ b[g]^T`` with e8m0 block scales.

For GPUs without MX tensor cores (Hopper): both operands are float8_e4m3fn with
one e8m0 scale per 32 elements along ``K`` (``quantize_mx_rows`` for ``a``,
``quantize_mx_expert_weights(transposed=False)`` for ``b``). Each 32-wide chunk
of ``K`` is one FP8 tensor-core dot, scaled and added into an fp32 accumulator::

    acc += dot(a[:, chunk], b[g][:, chunk]^T) * 2**(ea - 127) * 2**(eb - 127)

The scales differ per (row, chunk) on both sides, so they cannot move out of a
longer dot: the K loop steps by exactly 32 (one ``wgmma`` K step for FP8), and
software pipelining (``num_stages``) overlaps the loads of later chunks. A K
tile of 128 split into four sub-dots would issue the same dots and scalings with
fewer, larger loads; it is left as a tuning option (it needs sub-tile slicing).

Scale factors are built exactly from the e8m0 bits (the exponent placed into an
fp32, ``2**-127`` as a subnormal); their product is exact unless it leaves fp32's
range (below ``2**-149`` it flushes to 0). ``e = 255`` gives NaN, which propagates
to every output its block touches.

Group scheduling and guarantees are those of ``kernels_helion.grouped_gemm``:
any group sizes (0, 1, unaligned), rows past ``offs[-1]`` written as 0, group
ends clamped into ``[0, M]`` on the device, no host sync, deterministic. The
kernel is ``kernels_helion.grouped_gemm.grouped_mm_2d3d_kernel`` with
``scaling="mx"``; this module holds its launcher and the checks of the e8m0 scales.
"""

from __future__ import annotations

from collections.abc import Callable

import helion
import torch

from autotune_cache import select_config
from autotune_cache.registry import register_tuning
from kernels_helion._launch import on_cpu
from kernels_helion.grouped_gemm import check_2d3d_operands, launch_grouped_mm_2d3d
from kernels_helion.mx_format import MX_BLOCK_SIZE
from kernels_helion.validation import check_same_device, check_tensor
from kernels_helion.tuning import GEMM_SHAPES, GEMM_TEST_SHAPE, gemm_space, random_bf16, routed_offsets

# e8m0 scale tensors: uint8 biased exponents (as quantize_mx_* return them) or
# PyTorch's float8_e8m0fnu, which has the same bits.
E8M0_SCALE_DTYPES: tuple[torch.dtype, ...] = (torch.uint8, torch.float8_e8m0fnu)

# block_sizes = [BLOCK_M, BLOCK_N]; the K step is fixed at 32 (one scale block).
# The tuned entries' settings: 64x128 tiles, 4 warps, L2-grouped tile order, and a
# flat (non-persistent) grid, which on the H200 ran 1.24-1.33x the persistent one
# with the work-item scheduling (the rowwise and blockwise formats prefer persistent).
DEFAULT_CONFIG = helion.Config(
    block_sizes=[64, 128],
    num_warps=4,
    num_stages=3,
    l2_groupings=[8],
    indexing="tensor_descriptor",
    pid_type="flat",
)
CPU_CONFIG = helion.Config(block_sizes=[16, 16], num_warps=4, num_stages=1)


def check_e8m0_scales(name: str, t: object, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Check a contiguous e8m0 scale tensor (uint8 or float8_e8m0fnu) of ``shape`` on ``device``; as uint8."""
    check_tensor(name, t, ndim=len(shape), dtypes=E8M0_SCALE_DTYPES)
    assert isinstance(t, torch.Tensor)
    if tuple(t.shape) != shape:
        raise ValueError(
            f"{name} must have shape {shape} (one e8m0 scale per {MX_BLOCK_SIZE} along K), got {tuple(t.shape)}"
        )
    check_same_device(name, t, device)
    return t.view(torch.uint8)


def grouped_mm_2d3d_mx(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Grouped MXFP8 GEMM (emulated with FP8 dots per 32-wide K block): each token group times its expert.

    ``out[i, j] = sum_c dot(a[i, c], b[g, j, c]) * 2**(a_scales[i, c] - 127) * 2**(b_scales[g, j, c] - 127)``
    over the 32-wide K chunks ``c``, for the rows ``i`` of group ``g``
    (``offs[g-1] <= i < offs[g]``, ``offs[-1] = 0``). Rows past ``offs[-1]`` are
    written as 0; offsets are clamped into ``[0, M]`` on the device. An e8m0
    scale of 255 (NaN) makes the outputs its block touches NaN.

    This is the MXFP8 recipe's path for GPUs without MX tensor cores (sm90) and
    for the CPU interpreter. On sm100 (Blackwell) the recipe dispatches to
    PyTorch's native MXFP8 grouped mm instead (scales in the blocked layout of
    ``kernels_helion.mx_blocked_layout``; ``ops.autograd_mx``, behind a capability
    check, never run on such a GPU here). Never call the native MX grouped mm on
    sm90: it fails there and leaves the CUDA context unusable.

    Args:
        a: ``(M, K)`` float8_e4m3fn, contiguous; ``K`` a multiple of 32.
        a_scales: ``(M, K // 32)`` uint8 e8m0 exponents (``quantize_mx_rows``),
            or float8_e8m0fnu.
        b: ``(E, N, K)`` float8_e4m3fn, contiguous (K-major).
        b_scales: ``(E, N, K // 32)`` uint8 e8m0 exponents
            (``quantize_mx_expert_weights(transposed=False)``), or float8_e8m0fnu.
        offs: ``(E,)`` int32 cumulative group ends.
        out_dtype: bfloat16 (default), float16 or float32.

    Returns:
        ``(M, N)`` tensor of ``out_dtype``.
    """
    m, k, num_experts, n = check_2d3d_operands(a, b, offs, out_dtype)
    if a.dtype != torch.float8_e4m3fn:
        raise TypeError(f"a and b must be float8_e4m3fn (the MXFP8 element type), got {a.dtype}")
    if k % MX_BLOCK_SIZE != 0:
        raise ValueError(f"K (a.shape[1]) must be a multiple of the MX block size {MX_BLOCK_SIZE}, got {k}")
    a_scales = check_e8m0_scales("a_scales", a_scales, (m, k // MX_BLOCK_SIZE), a.device)
    b_scales = check_e8m0_scales("b_scales", b_scales, (num_experts, n, k // MX_BLOCK_SIZE), a.device)
    if m == 0:
        return torch.empty((0, n), dtype=out_dtype, device=a.device)
    key = {"M": m, "N": n, "K": k, "G": num_experts}
    config = select_config("grouped_mm_2d3d_mx", key, CPU_CONFIG if on_cpu(a) else DEFAULT_CONFIG)
    return launch_grouped_mm_2d3d(a, a_scales, b, b_scales, offs, out_dtype, "mx", config)


# Tuning: the MX emulation rescales its accumulator every 32-wide K step: one warp group
# on a 64-row tile (4 warps) measured 1.3-1.7x 128x128 with 8 warps, and a flat
# grid 1.24-1.33x the persistent one: both grids are tried.
# 2 stages won at one shape (+5.7% against 3).
def _tuning_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
    from kernels_helion.quantize_mx import quantize_mx_expert_weights, quantize_mx_rows

    a, a_scales = quantize_mx_rows(random_bf16(shape["M"], shape["K"], device=device))
    b, b_scales = quantize_mx_expert_weights(random_bf16(shape["G"], shape["N"], shape["K"], device=device))
    offs = routed_offsets(shape["M"], shape["G"], device)
    return lambda: grouped_mm_2d3d_mx(a, a_scales, b, b_scales, offs)


register_tuning(
    "grouped_mm_2d3d_mx",
    DEFAULT_CONFIG,
    gemm_space(DEFAULT_CONFIG, [[64, 128], [128, 128], [128, 256]], stages=(2, 3, 4), nvidia_warps=(4, 8),
               pid_types=("flat", "persistent_interleaved")),
    GEMM_SHAPES,
    _tuning_call,
    GEMM_TEST_SHAPE,
    exact=False,
)
