"""Per-group token padding: every token group starts at a multiple of ``alignment`` rows.

MX grouped GEMMs need each group's rows (and its scale rows) to start at an
aligned row (16, 32 or 128). ``pad_token_groups`` copies each group of ``x``
to its aligned start, zero-filling the rows between groups; ``unpad_token_groups``
is its exact inverse.

Sizes are data-dependent, so nothing is read back to the host: the output has
``M + G * alignment`` rows, an upper bound; the rows past the last padded group
(and past the tail, below) are zero. The padded group ends (``padded_offs``)
are computed on the device.

Group ``g`` spans ``[ends[g-1], ends[g])`` of ``x`` where ``ends`` is ``offs``
clamped into ``[0, M]`` and made non-decreasing (running max), so bad offsets
give wrong groups, never out-of-bounds accesses. Its padded size is its size
rounded up to ``alignment``; ``padded_offs`` is their cumulative sum, so the
padded tensor with ``padded_offs`` is a valid grouped input whose group sizes are
multiples of ``alignment`` (the pad rows of a group are zero).

Tokens past ``offs[-1]`` (the tail) are kept: they follow the last padded group,
from row ``padded_offs[-1]`` on, so the round trip is exact for all ``M`` rows.
"""

from __future__ import annotations

from collections.abc import Callable

import helion
import helion.language as hl
import torch

from autotune_cache import select_config
from autotune_cache.registry import register_tuning
from kernels_helion._launch import launch, require_interpreter_on_cpu
from kernels_helion.group_offsets import aligned_group_ends, owning_group
from kernels_helion.validation import check_offsets, check_tensor
from kernels_helion.tuning import random_bf16, routed_offsets, vary, warps_for

# block_sizes = [rows, columns] per program; tuned configs in autotune_cache.
DEFAULT_CONFIG = helion.Config(block_sizes=[16, 256], num_warps=4, num_stages=1)

PAD_DTYPES: tuple[torch.dtype, ...] = (
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.uint8,
)


@helion.kernel(static_shapes=False)
def pad_token_groups_kernel(
    src: torch.Tensor,
    src_ends: torch.Tensor,
    dst_ends: torch.Tensor,
    dst_rows: int,
) -> torch.Tensor:
    """Copy group ``g`` of ``src`` (rows ``[src_ends[g-1], src_ends[g])``) to row ``dst_ends[g-1]``.

    Destination row ``r`` gets the source row ``r - dst_ends[g-1] + src_ends[g-1]``
    of its group ``g`` (``owning_group``; the tail holds ``src`` rows from
    ``src_ends[-1]`` on) when that is inside the group, else 0. One program per
    output tile, each row looking up its own group: the grid covers the output
    evenly, whatever the group sizes.
    """
    src_rows, cols = src.shape
    out = torch.empty([dst_rows, cols], dtype=src.dtype, device=src.device)
    for tile_r, tile_c in hl.tile([dst_rows, cols]):
        src_start, src_end, dst_start, _ = owning_group(src_ends, dst_ends, tile_r.index, src_rows, dst_rows)
        rows = tile_r.index - dst_start + src_start
        # The bounds check guards against inconsistent ends (never true for padded_ends from offs).
        valid = (rows < src_end) & (rows >= 0) & (rows < src_rows)
        out[tile_r, tile_c] = hl.load(src, [rows, tile_c], extra_mask=valid[:, None])
    return out


def _copy_groups(
    src: torch.Tensor, src_ends: torch.Tensor, dst_ends: torch.Tensor, dst_rows: int
) -> torch.Tensor:
    require_interpreter_on_cpu(src)
    if src.numel() == 0 or dst_rows == 0:
        return torch.zeros((dst_rows, src.size(1)), dtype=src.dtype, device=src.device)
    config = select_config("pad_token_groups", {"K": src.size(1)}, DEFAULT_CONFIG)
    # uint8 bits: fp8 moves as bytes (the copy never does arithmetic on it).
    bits = src.view(torch.uint8) if src.element_size() == 1 else src
    out = launch(pad_token_groups_kernel, (bits, src_ends, dst_ends, dst_rows), config)
    return out.view(src.dtype)


def _check_alignment(alignment: object) -> int:
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"alignment must be a positive int (typically 16, 32 or 128), got {alignment!r}")
    return alignment


def pad_token_groups(
    x: torch.Tensor, offs: torch.Tensor, alignment: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy each token group of ``x`` to a row that is a multiple of ``alignment``.

    Args:
        x: ``(M, K)`` bf16/fp16/fp32/float8_e4m3fn/uint8, contiguous (tokens along rows).
        offs: ``(G,)`` int32 cumulative group ends (as ``torch._grouped_mm``), on x's device.
        alignment: rows each group start is aligned to (typically 16, 32 or 128).

    Returns:
        ``(x_padded, padded_offs)``: ``x_padded`` ``(M + G * alignment, K)`` with
        group ``g`` at rows ``[padded_offs[g-1], padded_offs[g-1] + size_g)``, zeros
        up to ``padded_offs[g]``, the tail tokens from ``padded_offs[-1]`` and zeros
        after; ``padded_offs`` ``(G,)`` int32 cumulative padded group ends.
    """
    check_tensor("x", x, ndim=2, dtypes=PAD_DTYPES)
    check_offsets(offs, x.device)
    _check_alignment(alignment)
    m = x.size(0)
    ends, padded_ends, _ = aligned_group_ends(offs, m, alignment)
    return _copy_groups(x, ends, padded_ends, m + offs.numel() * alignment), padded_ends


def unpad_token_groups(
    x_padded: torch.Tensor, offs: torch.Tensor, padded_offs: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """Inverse of ``pad_token_groups``: gather each group (and the tail) back to ``(M, K)``.

    Args:
        x_padded: ``(P, K)`` as returned by ``pad_token_groups`` (``P >= num_tokens``), contiguous.
        offs: the ``(G,)`` int32 group ends given to ``pad_token_groups``.
        padded_offs: the ``(G,)`` int32 padded group ends it returned.
        num_tokens: ``M``, the row count of the unpadded tensor.

    Returns:
        ``(M, K)``: ``unpad_token_groups(*pad_token_groups(x, offs, a), ...)`` equals
        ``x`` bit for bit. Rows ``padded_offs`` points outside ``x_padded`` read as 0.
    """
    check_tensor("x_padded", x_padded, ndim=2, dtypes=PAD_DTYPES)
    check_offsets(offs, x_padded.device)
    check_offsets(padded_offs, x_padded.device, name="padded_offs")
    if padded_offs.shape != offs.shape:
        raise ValueError(
            f"padded_offs must have the shape of offs {tuple(offs.shape)}, got {tuple(padded_offs.shape)}"
        )
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
    if num_tokens > x_padded.size(0):
        raise ValueError(
            f"num_tokens ({num_tokens}) must not exceed x_padded's rows ({x_padded.size(0)})"
        )
    ends, _, _ = aligned_group_ends(offs, num_tokens, 1)
    # The same copy, the other way: padded groups (and tail) back to their unpadded rows.
    return _copy_groups(x_padded, padded_offs, ends, num_tokens)


# Tuning: 16 token groups padded to the recipes' alignment, 128.
def _tuning_call(shape: dict[str, int], device: torch.device) -> Callable[[], object]:
    x = random_bf16(shape["M"], shape["K"], device=device)
    offs = routed_offsets(shape["M"] - 7 * shape["G"], shape["G"], device)
    return lambda: pad_token_groups(x, offs, 128)


def _tuning_space(arch: str) -> list[helion.Config]:
    # [rows, columns] per program: wide rows for long contiguous accesses.
    blocks = [[16, 256], [8, 256], [32, 256], [16, 512], [8, 512], [32, 128], [64, 128], [4, 1024],
              [8, 1024], [32, 512]]
    return vary(DEFAULT_CONFIG, block_sizes=blocks, num_warps=warps_for(arch))


register_tuning("pad_token_groups", DEFAULT_CONFIG, _tuning_space, [{"M": 32768, "K": k, "G": 16} for k in (2048, 5120, 7168)],
                _tuning_call, {"M": 70, "K": 48, "G": 3})
