"""FP8 grouped GEMM with rowwise scales, 2D x 3D: ``out[rows of g] = a[rows of g] @ b[g]^T``.

The MoE forward (``x`` times each expert's weight) and dgrad (``grad_out`` times
each expert's transposed weight). Tokens are sorted by expert; ``offs`` holds the
cumulative group ends as in ``torch._grouped_mm``. Any group sizes work (0, 1, not
multiples of 16), without a device-to-host sync.

Scheduling: one program per (row tile, column tile) of the output, with row
tiles aligned to the tensor (not to groups), so the operands load through TMA
descriptors. A program loops over the groups that meet its rows (found on the
device with a vector reduction over ``offs``; usually one, two at a group
boundary), skipping empty ones, and keeps each row's result from its own group.
Rows past ``offs[-1]`` belong to no group and are written as 0. No program is
launched per empty group, and the grid does not depend on the group sizes.

Operands are K-major, as Hopper's FP8 tensor cores need: ``a`` tiles are
``(BLOCK_M, BLOCK_K)`` and ``b`` tiles ``(BLOCK_N, BLOCK_K)``, transposed for the
dot. With rowwise scales the K loop accumulates in the tensor cores and the
scales are applied once, in the epilogue.

The same kernel serves the blockwise and MXFP8 formats (``scaling``, a
compile-time argument; their launchers are ``kernels_helion.grouped_gemm_blockwise``
and ``kernels_helion.grouped_gemm_mx``): their scales vary along K, so each K
step of one scale block (128 or 32) is a separate product, scaled and added to
the fp32 accumulator.
"""

from __future__ import annotations

import helion
import helion.language as hl
import torch
import triton

from autotune_cache import select_config
from kernels_helion._launch import launch, on_cpu, require_interpreter_on_cpu
from kernels_helion.fp8_format import BLOCKWISE_SCALE_BLOCK, check_fp8_dtype
from kernels_helion.mx_format import MX_BLOCK_SIZE, e8m0_to_scale
from kernels_helion.validation import check_offsets, check_same_device, check_scales, check_tensor

OUT_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)

# block_sizes = [BLOCK_M, BLOCK_N, BLOCK_K]. Best measured on H200 for the MoE
# shapes: TMA loads, 128x256 tiles, L2-grouped tile order, persistent programs
# interleaved over the tiles (one tile's epilogue overlaps the next tile's loads);
# shape-keyed overrides live in autotune_cache/sm90/grouped_mm_2d3d.json.
DEFAULT_CONFIG = helion.Config(
    block_sizes=[128, 256, 128],
    num_warps=8,
    num_stages=3,
    l2_groupings=[8],
    indexing="tensor_descriptor",
    pid_type="persistent_interleaved",
)
CPU_CONFIG = helion.Config(block_sizes=[16, 16, 32], num_warps=4, num_stages=1)

# How the operands are scaled (``grouped_mm_2d3d_kernel``'s ``scaling``; a string
# literal, because Helion folds a constexpr's comparison only with a literal):
# - "rowwise": a_scales (M,), b_scales (E, N); the K tile is tuned.
# - "blockwise": a_scales (ceil(K/128), M) (1x128 blocks, K-block-major), b_scales
#   (E, ceil(N/128), ceil(K/128)) (128x128 blocks); K steps of 128, BLOCK_N divides 128.
# - "mx": a_scales (M, K/32), b_scales (E, N, K/32), uint8 e8m0; K steps of 32.


def tile_dot(acc: torch.Tensor, a_tile: torch.Tensor, b_tile: torch.Tensor, upcast: bool) -> torch.Tensor:
    """``acc + a_tile @ b_tile.T`` (fp32 operands on CPU, where the interpreter's fp8 dot is wrong)."""
    if upcast:
        return hl.dot(a_tile.to(torch.float32), b_tile.to(torch.float32).T, acc=acc)
    return hl.dot(a_tile, b_tile.T, acc=acc)


def groups_meeting_rows(
    offs: torch.Tensor, rows: hl.Tile, m: int, groups_pow2: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device-side group lookup for a tile of rows: ``(group_idx, ends, first, stop)``.

    ``ends`` are the group ends clamped into ``[0, M]`` (so bad offsets never index
    out of bounds); the groups meeting rows ``[r0, r1)`` are ``first <= g < stop``:
    those with ``end > r0`` and ``start < r1`` (start = previous end).
    """
    num_groups = offs.size(0)
    group_idx = hl.arange(groups_pow2)
    is_group = group_idx < num_groups
    ends = hl.load(offs, [group_idx], extra_mask=is_group)
    ends = torch.where(ends < 0, 0, torch.where(ends > m, m, ends))
    first = torch.sum((is_group & (ends <= rows.begin)).to(torch.int32), dim=0)
    stop = torch.sum((is_group & (ends < rows.end)).to(torch.int32), dim=0) + 1
    return group_idx, ends, first, torch.where(stop < num_groups, stop, num_groups)


def group_bounds(group_idx: torch.Tensor, ends: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(start, end)`` rows of group ``g`` from ``groups_meeting_rows``' clamped ends."""
    start = torch.amax(torch.where(group_idx == g - 1, ends, 0), dim=0)
    end = torch.amax(torch.where(group_idx == g, ends, 0), dim=0)
    return start, end


@helion.kernel(static_shapes=False)
def grouped_mm_2d3d_kernel(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: hl.constexpr,
    groups_pow2: hl.constexpr,
    upcast_operands: hl.constexpr,
    scaling: hl.constexpr,
) -> torch.Tensor:
    m, k = a.shape
    _, n, _ = b.shape
    num_groups = offs.size(0)
    out = torch.empty([m, n], dtype=out_dtype, device=a.device)
    # The K step of the block-scaled formats: one scale block.
    k_step = BLOCKWISE_SCALE_BLOCK if scaling == "blockwise" else MX_BLOCK_SIZE
    for tile_m, tile_n in hl.tile([m, n]):
        group_idx, ends, first_group, end_group = groups_meeting_rows(offs, tile_m, m, groups_pow2)
        for g in hl.grid(first_group, end_group):
            start, end = group_bounds(group_idx, ends, g)
            if end > start:
                acc = hl.zeros([tile_m, tile_n], dtype=torch.float32)
                if scaling == "rowwise":
                    for tile_k in hl.tile(k):
                        acc = tile_dot(acc, a[tile_m, tile_k], b[g, tile_n, tile_k], upcast_operands)
                    acc = acc * (a_scales[tile_m][:, None] * b_scales[g, tile_n][None, :])
                else:
                    # Scales vary along K: each K step of one scale block is its own product.
                    for tile_k in hl.tile(k, block_size=k_step):
                        product = tile_dot(
                            hl.zeros([tile_m, tile_n], dtype=torch.float32),
                            a[tile_m, tile_k],
                            b[g, tile_n, tile_k],
                            upcast_operands,
                        )
                        if scaling == "blockwise":
                            # One weight scale per tile: BLOCK_N divides the scale block.
                            n_block = tile_n.begin // BLOCKWISE_SCALE_BLOCK
                            weight_scale = hl.load(b_scales, [g, n_block, tile_k.id])
                            step_scales = (a_scales[tile_k.id, tile_m] * weight_scale)[:, None]
                        else:
                            scale_a = e8m0_to_scale(a_scales[tile_m, tile_k.id].to(torch.int32))
                            scale_b = e8m0_to_scale(b_scales[g, tile_n, tile_k.id].to(torch.int32))
                            step_scales = scale_a[:, None] * scale_b[None, :]
                        acc = acc + product * step_scales
                # Each group stores only its own rows (disjoint, so the result does
                # not depend on the order): no second accumulator tile is kept live.
                rows_in_group = (tile_m.index >= start) & (tile_m.index < end)
                hl.store(out, [tile_m, tile_n], acc.to(out_dtype), extra_mask=rows_in_group[:, None])
        # Rows past the last group end belong to no group.
        routed = torch.amax(torch.where(group_idx == num_groups - 1, ends, 0), dim=0)
        if routed < tile_m.end:
            unrouted = tile_m.index >= routed
            hl.store(out, [tile_m, tile_n], hl.zeros([tile_m, tile_n], dtype=out_dtype), extra_mask=unrouted[:, None])
    return out


def check_fp8_operand(name: str, t: object, ndim: int) -> torch.Tensor:
    """Check an FP8 GEMM operand: a tensor of rank ``ndim``, e4m3fn (or e4m3fnuz on ROCm), contiguous."""
    if isinstance(t, torch.Tensor):
        check_fp8_dtype(t.dtype, name)
        if t.dtype == torch.float8_e4m3fnuz and torch.version.hip is None:
            raise TypeError(f"{name}: float8_e4m3fnuz GEMMs need a ROCm build of PyTorch; use float8_e4m3fn")
    return check_tensor(name, t, ndim=ndim, dtypes=(t.dtype,) if isinstance(t, torch.Tensor) else ())


def check_out_dtype(out_dtype: object) -> None:
    """Raise ``TypeError`` unless ``out_dtype`` is a supported output dtype."""
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {[str(d) for d in OUT_DTYPES]}, got {out_dtype}")


def check_2d3d_operands(a: object, b: object, offs: object, out_dtype: object) -> tuple[int, int, int, int]:
    """Checks shared by the 2D x 3D grouped GEMMs (all but the scales); returns ``(M, K, E, N)``.

    ``a`` (M, K) and ``b`` (E, N, K) are FP8 of one dtype on one device with E, N, K >= 1;
    ``offs`` has one group end per expert; ``out_dtype`` is supported.
    """
    check_fp8_operand("a", a, 2)
    check_fp8_operand("b", b, 3)
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    if b.dtype != a.dtype:
        raise TypeError(f"b must have the dtype of a ({a.dtype}), got {b.dtype}")
    check_same_device("b", b, a.device)
    m, k = a.shape
    num_experts, n, k_b = b.shape
    if k_b != k:
        raise ValueError(f"b must be (E, N, K) with K = a.shape[1] = {k}, got shape {tuple(b.shape)}")
    if k == 0 or n == 0 or num_experts == 0:
        raise ValueError(f"a and b need K, N, E >= 1, got a {tuple(a.shape)}, b {tuple(b.shape)}")
    check_offsets(offs, a.device)
    assert isinstance(offs, torch.Tensor)
    if offs.shape[0] != num_experts:
        raise ValueError(f"offs must have one group end per expert ({num_experts}), got shape {tuple(offs.shape)}")
    check_out_dtype(out_dtype)
    require_interpreter_on_cpu(a)
    return m, k, num_experts, n


def grouped_mm_2d3d(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Grouped FP8 GEMM with rowwise scales: each token group times its expert's matrix.

    ``out[i] = (a[i] @ b[g].T) * a_scales[i] * b_scales[g]`` for the rows ``i`` of
    group ``g`` (``offs[g-1] <= i < offs[g]``, ``offs[-1] = 0``). Rows past
    ``offs[-1]`` are written as 0. Offsets are clamped into ``[0, M]`` on the
    device, so bad offsets give wrong groups but never out-of-bounds accesses.

    Forward: ``a = x`` (M, K), ``b = W`` (E, N, K). Dgrad: ``a = grad_out`` (M, N),
    ``b = W^T`` quantized along N, stored (E, K, N) contiguous.

    Args:
        a: ``(M, K)`` float8_e4m3fn, contiguous (row-major).
        a_scales: ``(M,)`` float32 dequantization scales of ``a``'s rows.
        b: ``(E, N, K)`` float8 (same dtype as ``a``), contiguous (K-major).
        b_scales: ``(E, N)`` float32 dequantization scales of ``b``'s rows.
        offs: ``(E,)`` int32 cumulative group ends.
        out_dtype: bfloat16 (default), float16 or float32.

    Returns:
        ``(M, N)`` tensor of ``out_dtype``.
    """
    m, k, num_experts, n = check_2d3d_operands(a, b, offs, out_dtype)
    check_scales("a_scales", a_scales, (m,), a.device)
    check_scales("b_scales", b_scales, (num_experts, n), a.device)
    if m == 0:
        return torch.empty((0, n), dtype=out_dtype, device=a.device)
    cpu = on_cpu(a)
    key = {"M": m, "N": n, "K": k, "G": num_experts}
    config = select_config("grouped_mm_2d3d", key, CPU_CONFIG if cpu else DEFAULT_CONFIG)
    args = (a, a_scales, b, b_scales, offs, out_dtype, triton.next_power_of_2(num_experts), cpu, "rowwise")
    return launch(grouped_mm_2d3d_kernel, args, config)
