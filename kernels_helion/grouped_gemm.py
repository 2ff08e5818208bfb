"""FP8 grouped GEMM with rowwise scales, 2D x 3D: ``out[rows of g] = a[rows of g] @ b[g]^T``.

The MoE forward (``x`` times each expert's weight) and dgrad (``grad_out`` times
each expert's transposed weight). Tokens are sorted by expert; ``offs`` holds the
cumulative group ends as in ``torch._grouped_mm``. Any group sizes work (0, 1, not
multiples of 16), without a device-to-host sync.

Scheduling: the output is cut into work items, one per (row tile, column tile),
with row tiles cut from each group's own start (the last one partial), as
CUTLASS's grouped GEMMs do, so every item is one K loop against one expert.
Rows past ``offs[-1]`` form one more pseudo-group whose items write 0. The
items are found on the device from ``offs`` (a prefix sum of the groups' tile
counts), so the grid is an upper bound that does not depend on the group sizes:
``floor((M + (G + 1) * (BLOCK_M - 1)) / BLOCK_M)`` row items per column tile,
the few past the real count doing nothing. Tiles aligned to the tensor instead
would make a tile that holds a group boundary run two K loops; the persistent
programs that draw such tiles finish last, which cost 8-16% with skewed
routing on the H200 (``docs/experiments.md``).

A row tile may start at any row: ``a`` still loads through a TMA descriptor
(which reads whole tiles, zero-filled past the tensor's end). An item that
fills its whole row tile stores it through a TMA descriptor too (from shared
memory, asynchronously: +1-2% on the H200); a partial one stores only its rows,
through masked pointer stores. On the H200 the scheme runs routings with group
boundaries every 16 rows off the tile grid at 0.99-1.00x the aligned rate (the
tensor-aligned tiles it replaced: 0.83-0.92x).

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

from collections.abc import Callable

import helion
import helion.language as hl
import torch

from autotune_cache import select_config
from autotune_cache.registry import register_tuning
from kernels_helion._launch import config_with, launch, on_cpu, require_interpreter_on_cpu, split_leading_block, with_tma
from kernels_helion.fp8_format import BLOCKWISE_SCALE_BLOCK, check_fp8_dtype
from kernels_helion.group_offsets import group_lanes
from kernels_helion.mx_format import MX_BLOCK_SIZE, e8m0_to_scale
from kernels_helion.token_groups import group_span_lanes
from kernels_helion.validation import (
    check_matrices_row_major,
    check_offsets,
    check_out_dtype,
    check_same_device,
    check_scales,
    check_tensor,
)
from kernels_helion.tuning import (
    FINE_GRAINED_GEMM_SHAPES,
    GEMM_TEST_SHAPE,
    MOE_GEMM_SHAPES,
    MOE_LAYER_GEMM_SHAPES,
    fp8_operands,
    gemm_space,
    routed_offsets,
)


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
# Under the CPU interpreter a program costs about the same whatever its tile, so the
# CPU tests run wide tiles; BLOCK_M stays small so that row tiles fall inside groups.
CPU_CONFIG = helion.Config(block_sizes=[16, 32, 64], num_warps=4, num_stages=1)

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


def work_item_rows(
    offs: torch.Tensor, item: int, m: int, block_m: int, groups_pow2: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device side: ``(group, row_begin, row_end)`` of row work item ``item``.

    Group ``g`` spans rows ``[start, end)`` with ``start = offs[g-1]`` and ``end =
    max(offs[g], start)``, both clamped into ``[0, M]`` (``group_span_lanes``), so bad
    offsets give wrong groups but never out-of-bounds rows; the pseudo-group ``G`` spans
    the rows past every group's end, ``[max end, M)`` (``[offs[-1], M)`` for valid
    offsets). Each (pseudo-)group is cut into ``ceil(size / block_m)`` row tiles from its
    start, numbered in group order. An item past the last tile gets an empty row range.
    The pseudo-group needs no lane of its own: ``groups_pow2 >= G`` lanes (one
    more lane doubles them at G = 32 and cost 1.7% at K = 2048 on the H200).
    """
    num_groups = offs.size(0)
    slot, is_group, starts, ends, padded_sizes, padded_ends = group_span_lanes(offs, m, block_m, groups_pow2)
    group = torch.sum(((padded_ends <= item * block_m) & is_group).to(torch.int32), dim=0)
    return item_rows_of_group(slot, starts, ends, padded_sizes, padded_ends, group, item, m, block_m, num_groups)


def first_item_row(
    is_item_group: torch.Tensor, unrouted: torch.Tensor, padded_sizes: torch.Tensor, padded_ends: torch.Tensor
) -> torch.Tensor:
    """Device side: where a (pseudo-)group's first item starts in the items' padded row numbering (``block_m``
    times its index), from ``group_span_lanes``' lanes; ``is_item_group`` marks the group's lane, ``unrouted``
    says it is the pseudo-group."""
    return torch.where(
        unrouted,
        torch.sum(padded_sizes, dim=0),
        torch.sum(torch.where(is_item_group, padded_ends - padded_sizes, 0), dim=0),
    )


def item_rows_of_group(
    slot: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    padded_sizes: torch.Tensor,
    padded_ends: torch.Tensor,
    group: torch.Tensor,
    item: object,
    m: int,
    block_m: int,
    num_groups: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device side: ``(group, row_begin, row_end)`` of the row item(s) ``item`` of (pseudo-)group ``group``,
    from ``group_span_lanes``' lanes (aligned to ``block_m``): ``work_item_rows``' formulas."""
    is_item_group = slot == group
    unrouted = group == num_groups
    first_row = first_item_row(is_item_group, unrouted, padded_sizes, padded_ends)
    start = torch.where(unrouted, torch.amax(ends, dim=0), torch.sum(torch.where(is_item_group, starts, 0), dim=0))
    end = torch.where(unrouted, m, torch.sum(torch.where(is_item_group, ends, 0), dim=0))
    row_begin = start + (item * block_m - first_row)
    return group, row_begin, torch.minimum(row_begin + block_m, end)


@helion.kernel(static_shapes=False)
def work_item_table_kernel(
    offs: torch.Tensor, m: int, row_items: int, block_m: hl.constexpr, groups_pow2: hl.constexpr
) -> torch.Tensor:
    """``work_item_rows`` of every row item: an int32 ``(3, row_items)`` table (see ``work_item_table``).

    One program per (pseudo-)group writes its own items, so each program holds ``G`` lanes, not
    ``G`` lanes per item.
    """
    num_groups = offs.size(0)
    table = torch.empty([3, row_items], dtype=torch.int32, device=offs.device)
    for program in hl.grid(num_groups + 1):
        group = hl.full([], program, dtype=torch.int32)
        slot, is_group, starts, ends, padded_sizes, padded_ends = group_span_lanes(offs, m, block_m, groups_pow2)
        is_item_group = slot == group
        first_row = first_item_row(is_item_group, group == num_groups, padded_sizes, padded_ends)
        # The pseudo-group's items run to the table's end (those past its rows are empty); overlapping bad
        # offsets can give the groups more tiles than the table holds: the items past its end are not written.
        last_row = torch.where(
            group == num_groups, row_items * block_m, torch.sum(torch.where(is_item_group, padded_ends, 0), dim=0)
        )
        for tile_i in hl.tile(first_row // block_m, torch.clamp(last_row // block_m, max=row_items)):
            item_group, row_begin, row_end = item_rows_of_group(
                slot, starts, ends, padded_sizes, padded_ends, group, tile_i.index, m, block_m, num_groups
            )
            table[0, tile_i] = item_group + 0 * tile_i.index
            table[1, tile_i] = row_begin
            table[2, tile_i] = row_end
    return table


# A group's items in tiles of 128: nothing to tune.
WORK_ITEM_TABLE_CONFIG = helion.Config(block_sizes=[128], num_warps=4, num_stages=1)
# Whether the 2D x 3D GEMMs read their row items from a table (benchmarks turn it off to compare).
WORK_ITEM_TABLE = True


def work_item_table(offs: torch.Tensor, m: int, block_m: int) -> torch.Tensor:
    """Every row item's ``work_item_rows`` as an int32 ``(3, items)`` table: group, first row, end row.

    One launch before a GEMM whose programs would otherwise each find their item from ``G``
    lanes of ``offs`` (``item_rows``); the same values, bad offsets included.
    """
    row_items = (m + (offs.numel() + 1) * (block_m - 1)) // block_m
    return launch(work_item_table_kernel, (offs, m, row_items, block_m, group_lanes(offs.numel())), WORK_ITEM_TABLE_CONFIG)


def work_item_args(offs: torch.Tensor, m: int, block_m: int) -> tuple[torch.Tensor, bool]:
    """A kernel's ``(items, item_table)`` arguments: the table and ``True``, or ``offs`` (unread) and ``False``."""
    if WORK_ITEM_TABLE:
        return work_item_table(offs, m, block_m), True
    return offs, False


def item_rows(
    offs: torch.Tensor, items: torch.Tensor, item_table: bool, item: int, m: int, block_m: int, groups_pow2: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device side: ``work_item_rows`` of ``item``, from the table when ``item_table``."""
    if item_table:
        return hl.load(items, [0, item]), hl.load(items, [1, item]), hl.load(items, [2, item])
    return work_item_rows(offs, item, m, block_m, groups_pow2)


def _a_tile(a: torch.Tensor, tile_m: hl.Tile, source: torch.Tensor, tile_k: hl.Tile, gathered: bool) -> torch.Tensor:
    """Device side: ``a``'s tile, its rows ``source`` read by index if ``gathered`` (pointer loads), else ``tile_m``."""
    if gathered:
        return hl.load(a, [source, tile_k])
    return a[tile_m, tile_k]


@helion.kernel(static_shapes=False)
def grouped_mm_2d3d_kernel(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    offs: torch.Tensor,
    out: torch.Tensor,
    a_hi: torch.Tensor,
    b_hi: torch.Tensor,
    rows: torch.Tensor,
    groups_pow2: hl.constexpr,
    block_m: hl.constexpr,
    upcast_operands: hl.constexpr,
    scaling: hl.constexpr,
    split_k: hl.constexpr,
    gathered: hl.constexpr,
    items: torch.Tensor,
    item_table: hl.constexpr,
) -> None:
    tokens, k = a.shape
    # Gathered (rowwise only): output row i is a's row rows[i], read by index.
    m = rows.size(0) if gathered else tokens
    k_hi = a_hi.size(1)
    _, n, _ = b.shape
    num_groups = offs.size(0)
    # Upper bound on the row items: each of the G + 1 (pseudo-)groups adds at most one partial tile.
    row_items = (m + (num_groups + 1) * (block_m - 1)) // block_m
    # The K step of the block-scaled formats: one scale block.
    k_step = BLOCKWISE_SCALE_BLOCK if scaling == "blockwise" else MX_BLOCK_SIZE
    for item, tile_n in hl.tile([row_items, n], block_size=[1, None]):
        group, row_begin, row_end = item_rows(offs, items, item_table, item.begin, m, block_m, groups_pow2)
        # One iteration (none past the last item): a tile of rows starting anywhere.
        for tile_m in hl.tile(row_begin, row_end, block_size=block_m):
            # A partial tile stores only its rows: the tile's other rows belong to other items.
            in_item = (tile_m.index < row_end)[:, None]
            if group < num_groups:
                for g in hl.grid(group, group + 1):
                    acc = hl.zeros([tile_m, tile_n], dtype=torch.float32)
                    if scaling == "rowwise":
                        # Scales read before the K loop, the weight's through pointers (the launcher's
                        # config), so that their latency hides under the loop; read after it, or the
                        # weight's through a TMA descriptor, each tile would wait for them before its epilogue.
                        if gathered:
                            # Indices outside [0, T) are clamped into it (never an out-of-bounds load).
                            source = torch.clamp(rows[tile_m], 0, tokens - 1)
                            row_scales = hl.load(a_scales, [source])
                        else:
                            source = tile_m.index
                            row_scales = a_scales[tile_m]
                        col_scales = b_scales[g, tile_n]
                        for tile_k in hl.tile(k):
                            a_tile = _a_tile(a, tile_m, source, tile_k, gathered)
                            acc = tile_dot(acc, a_tile, b[g, tile_n, tile_k], upcast_operands)
                        if split_k:
                            # The contraction's second part: a's columns past K against the weight's
                            # other tensor (rowwise only: both parts share the row and column scales).
                            for tile_k_hi in hl.tile(k_hi):
                                acc = tile_dot(acc, a_hi[tile_m, tile_k_hi], b_hi[g, tile_n, tile_k_hi], upcast_operands)
                        acc = acc * (row_scales[:, None] * col_scales[None, :])
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
                    if row_end - row_begin == block_m:
                        # The whole tile is this item's: one TMA store from shared memory.
                        out[tile_m, tile_n] = acc.to(out.dtype)
                    else:
                        hl.store(out, [tile_m, tile_n], acc.to(out.dtype), extra_mask=in_item)
            if group == num_groups:
                hl.store(out, [tile_m, tile_n], hl.zeros([tile_m, tile_n], dtype=out.dtype), extra_mask=in_item)


def check_fp8_operand(name: str, t: object, ndim: int, contiguous: bool = True) -> torch.Tensor:
    """Check an FP8 GEMM operand: a tensor of rank ``ndim``, e4m3fn (or e4m3fnuz on ROCm), contiguous
    (``contiguous=False``: each matrix row-major, the batch stride free)."""
    if isinstance(t, torch.Tensor):
        check_fp8_dtype(t.dtype, name)
        if t.dtype == torch.float8_e4m3fnuz and torch.version.hip is None:
            raise TypeError(f"{name}: float8_e4m3fnuz GEMMs need a ROCm build of PyTorch; use float8_e4m3fn")
    checked = check_tensor(
        name, t, ndim=ndim, dtypes=(t.dtype,) if isinstance(t, torch.Tensor) else (), contiguous=contiguous
    )
    if not contiguous:
        check_matrices_row_major(name, checked)
    return checked


def check_2d3d_operands(
    a: object, b: object, offs: object, out_dtype: object, b_name: str = "b", b_contiguous: bool = True
) -> tuple[int, int, int, int]:
    """Checks shared by the 2D x 3D grouped GEMMs (all but the scales); returns ``(M, K, E, N)``.

    ``a`` (M, K) and ``b`` (E, N, K) are FP8 of one dtype on one device with E, N, K >= 1;
    ``offs`` has one group end per expert; ``out_dtype`` is supported. ``b_contiguous=False``:
    ``b``'s experts need only be row-major matrices (a half of a packed weight).
    """
    check_fp8_operand("a", a, 2)
    check_fp8_operand(b_name, b, 3, contiguous=b_contiguous)
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    if b.dtype != a.dtype:
        raise TypeError(f"{b_name} must have the dtype of a ({a.dtype}), got {b.dtype}")
    check_same_device(b_name, b, a.device)
    m, k = a.shape
    num_experts, n, k_b = b.shape
    if k_b != k:
        raise ValueError(f"{b_name} must be (E, N, K) with K = a.shape[1] = {k}, got shape {tuple(b.shape)}")
    if k == 0 or n == 0 or num_experts == 0:
        raise ValueError(f"a and b need K, N, E >= 1, got a {tuple(a.shape)}, b {tuple(b.shape)}")
    check_offsets(offs, a.device)
    assert isinstance(offs, torch.Tensor)
    if offs.shape[0] != num_experts:
        raise ValueError(f"offs must have one group end per expert ({num_experts}), got shape {tuple(offs.shape)}")
    check_out_dtype(out_dtype)
    require_interpreter_on_cpu(a)
    return m, k, num_experts, n


def launch_grouped_mm_2d3d(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    scaling: str,
    config: helion.Config,
    split: tuple[torch.Tensor, torch.Tensor] | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run ``grouped_mm_2d3d_kernel`` on checked operands with a config of ``block_sizes = [BLOCK_M, BLOCK_N, ...]``.

    Configs (defaults, the autotune cache, the tuner) name the row tile first, as
    for any GEMM; the kernel takes it as the compile-time ``block_m`` because its
    row tiles start at device-computed rows (``work_item_rows``). ``split = (a_hi,
    b_hi)`` (rowwise only) continues the contraction over ``a_hi``'s columns
    against ``b_hi`` (``grouped_mm_2d3d_split``). ``rows`` (rowwise only, not with ``split``):
    output row ``i`` is ``a``'s row ``rows[i]``, read by index.
    """
    block_m, kernel_config = split_leading_block(config)
    groups_pow2 = group_lanes(offs.size(0))
    gathered = rows is not None
    # Allocated here, not in the kernel: Helion stores through a TMA descriptor only into arguments.
    out = torch.empty((rows.shape[0] if gathered else a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    split_k = split is not None
    a_hi, b_hi = split if split_k else (a, b)
    if split_k:
        # The second K loop is tiled as the first.
        block_sizes = kernel_config.config["block_sizes"]
        kernel_config = config_with(kernel_config, block_sizes=[*block_sizes, block_sizes[-1]])
    args = (
        a, a_scales, b, b_scales, offs, out, a_hi, b_hi, rows if gathered else offs, groups_pow2, block_m, on_cpu(a),
        scaling, split_k, gathered, *work_item_args(offs, rows.shape[0] if gathered else a.shape[0], block_m),
    )
    # An item's three table values go through pointers (loaded before the K loop, used late).
    pointer_loads: tuple[str, ...] = ("items",)
    if scaling == "rowwise":
        # The weight's scales are read before the K loop (see the kernel); rows read by index
        # (and their scales) go through pointers: TMA cannot gather rows on Hopper.
        pointer_loads = ("b_scales", "a", "a_scales", "rows", "items") if gathered else ("b_scales", "items")
    kernel_config = with_tma(grouped_mm_2d3d_kernel, args, kernel_config, pointer_loads=pointer_loads)
    launch(grouped_mm_2d3d_kernel, args, kernel_config)
    return out


def grouped_mm_2d3d(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped FP8 GEMM with rowwise scales: each token group times its expert's matrix.

    ``out[i] = (a[i] @ b[g].T) * a_scales[i] * b_scales[g]`` for the rows ``i`` of
    group ``g`` (``offs[g-1] <= i < offs[g]``, ``offs[-1] = 0``). Rows past
    ``offs[-1]`` are written as 0. Offsets are clamped into ``[0, M]`` on the
    device, so bad offsets give wrong groups but never out-of-bounds accesses.

    With ``rows``, output row ``i`` reads ``a``'s row ``rows[i]`` (and its scale) by index
    inside the GEMM's loads: ``out[i] = (a[rows[i]] @ b[g].T) * a_scales[rows[i]] * b_scales[g]``,
    bitwise the result on ``a[rows]``, ``a_scales[rows]`` gathered first. ``a`` then holds each
    token's row once (a rowwise scale belongs to its token), as the MoE down-projection's dgrad
    reads the output gradient (``RowwiseOptions.down_dgrad_token_rows``). Indices outside
    ``[0, T)`` are clamped into it.

    Forward: ``a = x`` (M, K), ``b = W`` (E, N, K). Dgrad: ``a = grad_out`` (M, N),
    ``b = W^T`` quantized along N, stored (E, K, N) contiguous.

    Args:
        a: ``(M, K)`` float8_e4m3fn, contiguous (row-major); with ``rows``, ``(T, K)``.
        a_scales: ``(M,)`` (with ``rows``, ``(T,)``) float32 dequantization scales of ``a``'s rows.
        b: ``(E, N, K)`` float8 (same dtype as ``a``), contiguous (K-major).
        b_scales: ``(E, N)`` float32 dequantization scales of ``b``'s rows.
        offs: ``(E,)`` int32 cumulative group ends over the output's rows.
        out_dtype: bfloat16 (default), float16 or float32.
        rows: optional ``(M,)`` int32/int64: the row of ``a`` each output row reads.

    Returns:
        ``(M, N)`` tensor of ``out_dtype``.
    """
    tokens, k, num_experts, n = check_2d3d_operands(a, b, offs, out_dtype)
    check_scales("a_scales", a_scales, (tokens,), a.device)
    check_scales("b_scales", b_scales, (num_experts, n), a.device)
    m = tokens
    if rows is not None:
        check_tensor("rows", rows, ndim=1, dtypes=(torch.int32, torch.int64))
        check_same_device("rows", rows, a.device)
        m = rows.shape[0]
        if m and tokens == 0:
            raise ValueError(f"rows index {m} rows but a holds none")
    if m == 0:
        return torch.empty((0, n), dtype=out_dtype, device=a.device)
    # Gathered rows take the configs of the same GEMM on rows stored in order.
    key = {"M": m, "N": n, "K": k, "G": num_experts}
    config = select_config("grouped_mm_2d3d", key, CPU_CONFIG if on_cpu(a) else DEFAULT_CONFIG)
    return launch_grouped_mm_2d3d(a, a_scales, b, b_scales, offs, out_dtype, "rowwise", config, rows=rows)


def grouped_mm_2d3d_split(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b_lo: torch.Tensor,
    b_hi: torch.Tensor,
    b_scales: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``grouped_mm_2d3d`` whose weight is stored as two tensors along the contraction: ``a @ [b_lo | b_hi][g]^T``.

    The MoE up-projection's dgrad: ``dx = grad_gate @ w1[g] + grad_up @ w3[g]`` is one
    contraction over ``a = [grad_gate | grad_up]`` (one row scale for both halves)
    against ``w1^T`` and ``w3^T`` side by side, accumulated in one tile (no second
    output and no pass adding two). ``a``'s first ``K_lo`` columns meet ``b_lo``, the
    rest ``b_hi``.

    Args:
        a: ``(M, K_lo + K_hi)`` float8, contiguous.
        a_scales: ``(M,)`` float32 row scales of ``a``.
        b_lo, b_hi: ``(E, N, K_lo)`` and ``(E, N, K_hi)`` float8 (``a``'s dtype), contiguous.
        b_scales: ``(E, N)`` float32, the row scales of both (ones when folded into ``a``).
        offs, out_dtype: as in ``grouped_mm_2d3d``.

    Returns:
        ``(M, N)`` tensor of ``out_dtype``.
    """
    check_fp8_operand("a", a, 2)
    for name, b in (("b_lo", b_lo), ("b_hi", b_hi)):
        check_fp8_operand(name, b, 3)
        if b.dtype != a.dtype:
            raise TypeError(f"{name} must have the dtype of a ({a.dtype}), got {b.dtype}")
        check_same_device(name, b, a.device)
    m, k = a.shape
    num_experts, n, k_lo = b_lo.shape
    if not 1 <= k_lo < k or tuple(b_hi.shape) != (num_experts, n, k - k_lo) or n == 0 or num_experts == 0:
        raise ValueError(
            f"b_lo (E, N, K_lo) and b_hi (E, N, K_hi) must split a's {k} columns into two non-empty parts "
            f"(N, E >= 1), got b_lo {tuple(b_lo.shape)}, b_hi {tuple(b_hi.shape)}"
        )
    check_offsets(offs, a.device)
    if offs.shape[0] != num_experts:
        raise ValueError(f"offs must have one group end per expert ({num_experts}), got shape {tuple(offs.shape)}")
    check_out_dtype(out_dtype)
    require_interpreter_on_cpu(a)
    check_scales("a_scales", a_scales, (m,), a.device)
    check_scales("b_scales", b_scales, (num_experts, n), a.device)
    a_lo, a_hi = a[:, :k_lo], a[:, k_lo:]
    if m == 0:
        return torch.empty((0, n), dtype=out_dtype, device=a.device)
    key = {"M": m, "N": n, "K": k, "G": num_experts}
    config = select_config("grouped_mm_2d3d", key, CPU_CONFIG if on_cpu(a) else DEFAULT_CONFIG)
    return launch_grouped_mm_2d3d(a_lo, a_scales, b_lo, b_scales, offs, out_dtype, "rowwise", config, (a_hi, b_hi))


# Tuning: the forward (N, K) and dgrad (K, N) of each MoE shape.
def _tuning_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
    a, a_scales = fp8_operands(shape["M"], shape["K"], device=device)
    b, b_scales = fp8_operands(shape["G"], shape["N"], shape["K"], device=device)
    offs = routed_offsets(shape["M"], shape["G"], device)
    return lambda: grouped_mm_2d3d(a, a_scales, b, b_scales, offs)


TUNING_SHAPES = [
    {"M": m, "N": n, "K": k, "G": g}
    for m, n, k, g in dict.fromkeys(
        (m, n, k, g)
        for m, a, b, g in MOE_GEMM_SHAPES + FINE_GRAINED_GEMM_SHAPES + MOE_LAYER_GEMM_SHAPES
        for n, k in ((a, b), (b, a))
    )
]
register_tuning(
    "grouped_mm_2d3d",
    DEFAULT_CONFIG,
    gemm_space(DEFAULT_CONFIG, [[128, 256, 128], [128, 128, 128], [256, 128, 128], [64, 256, 128]]),
    TUNING_SHAPES,
    _tuning_call,
    GEMM_TEST_SHAPE,
    exact=False,
)
