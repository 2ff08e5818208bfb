"""Token groups laid out along a token-contiguous dimension, optionally each from an aligned start.

The wgrad operands (``x^T``, ``grad_out^T``: tokens contiguous) can be written
in a *padded* token layout: group ``g`` starts at column
``padded_start[g] = sum(round_up(size[h], A) for h < g)`` and is followed by zeros
up to its next multiple of ``A``. A GEMM contracting over a group's tokens then
reads whole, aligned ``A``-token tiles with no masks (the zeros add nothing),
which is what keeps its loads vectorized and its loop software-pipelined.

Group sizes come from ``offs`` (int32 cumulative ends, as ``torch._grouped_mm``)
clamped into ``[0, tokens]``: ``start = offs[g-1]``, ``end = max(offs[g], start)``.
With ``A == 1`` the layout is the plain one (``padded_start == start``). Nothing
is read back to the host: the padded width is the upper bound
``padded_token_count``, and every padded position is clamped into it, so bad
offsets give wrong groups, never out-of-bounds accesses. Both the quantizer that
writes the layout and the GEMM that reads it compute it here, from ``offs``.
"""

from __future__ import annotations

import helion
import helion.language as hl
import torch

from kernels_helion._launch import launch, require_interpreter_on_cpu
from kernels_helion.device_mask import scalar_mask
from kernels_helion.group_offsets import group_lanes

# Alignment of the padded layout used by the training recipes: a multiple of
# every token tile the wgrad GEMM is tuned with.
WGRAD_GROUP_ALIGNMENT = 128


def check_group_alignment(group_alignment: object) -> int:
    """Return ``group_alignment`` if it is an int >= 1, else raise ``ValueError`` naming it."""
    if not isinstance(group_alignment, int) or isinstance(group_alignment, bool) or group_alignment < 1:
        raise ValueError(f"group_alignment must be an int >= 1, got {group_alignment!r}")
    return group_alignment


def padded_token_count(tokens: int, groups: int, alignment: int) -> int:
    """Columns of the padded layout: ``tokens`` itself when ``alignment == 1``, else an upper bound.

    ``ceil(tokens / alignment) * alignment + groups * alignment``: a multiple of
    ``alignment`` at least the sum of the groups' rounded-up sizes.
    """
    if check_group_alignment(alignment) == 1:
        return tokens
    return (-(-tokens // alignment) + groups) * alignment


def group_token_span(
    offs: torch.Tensor, g: int, groups_pow2: int, tokens: int, alignment: int, padded_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device side: ``(start, end, padded_start, padded_end)`` of group ``g`` (``g == G``: past the last group).

    ``[start, end)`` are the group's tokens in the source (clamped into
    ``[0, tokens]``); ``[padded_start, padded_end)`` its columns in the padded
    layout (``end - start`` tokens, then zeros), within ``[0, padded_tokens]``.
    For ``g == G`` the source span is empty and the padded start is the end of
    the last group. With ``alignment == 1`` the padded span is the source span.
    """
    num_groups = offs.size(0)
    group_idx = hl.arange(groups_pow2)
    is_group = group_idx < num_groups
    ends = torch.clamp(hl.load(offs, [group_idx], extra_mask=is_group), 0, tokens)
    start = torch.amax(torch.where(group_idx == g - 1, ends, 0), dim=0)
    end = torch.maximum(torch.amax(torch.where(group_idx == g, ends, 0), dim=0), start)
    if alignment == 1:
        return start, end, start, end
    starts = torch.clamp(hl.load(offs, [group_idx - 1], extra_mask=is_group & (group_idx > 0)), 0, tokens)
    padded_sizes = (torch.clamp(ends - starts, min=0) + (alignment - 1)) // alignment * alignment
    padded_start = torch.clamp(torch.sum(torch.where(group_idx < g, padded_sizes, 0), dim=0), max=padded_tokens)
    padded_end = torch.clamp(padded_start + (end - start + (alignment - 1)) // alignment * alignment, max=padded_tokens)
    return start, end, padded_start, padded_end


def group_span_lanes(
    offs: torch.Tensor, tokens: int, alignment: int, groups_pow2: int
) -> tuple[torch.Tensor, ...]:
    """Device side, one lane per group: ``(group_idx, is_group, starts, ends, padded_sizes, padded_ends)``.

    ``[starts, ends)`` are the groups' tokens as ``group_token_span`` bounds them; ``padded_sizes``
    rounds each size up to ``alignment`` and ``padded_ends`` is their running sum (not clamped).
    Lanes past ``G`` hold empty groups.
    """
    num_groups = offs.size(0)
    group_idx = hl.arange(groups_pow2)
    is_group = group_idx < num_groups
    starts = torch.clamp(hl.load(offs, [group_idx - 1], extra_mask=is_group & (group_idx > 0)), 0, tokens)
    ends = torch.maximum(torch.clamp(hl.load(offs, [group_idx], extra_mask=is_group), 0, tokens), starts)
    padded_sizes = (ends - starts + (alignment - 1)) // alignment * alignment
    return group_idx, is_group, starts, ends, padded_sizes, hl.cumsum(padded_sizes, 0)


@helion.kernel(static_shapes=False)
def group_token_spans_kernel(
    offs: torch.Tensor, tokens: int, padded_tokens: int, alignment: hl.constexpr, groups_pow2: hl.constexpr
) -> torch.Tensor:
    """``group_token_span`` of every group at once, one program of ``groups_pow2`` lanes (see ``group_token_spans``)."""
    num_groups = offs.size(0)
    spans = torch.empty([4, num_groups], dtype=torch.int32, device=offs.device)
    for _ in hl.grid(1):
        group_idx, is_group, starts, ends, padded_sizes, padded_ends = group_span_lanes(
            offs, tokens, alignment, groups_pow2
        )
        if alignment == 1:
            padded_starts, padded_ends = starts, ends
        else:
            padded_starts = torch.clamp(padded_ends - padded_sizes, max=padded_tokens)
            padded_ends = torch.clamp(padded_starts + padded_sizes, max=padded_tokens)
        hl.store(spans, [0, group_idx], starts, extra_mask=is_group)
        hl.store(spans, [1, group_idx], ends, extra_mask=is_group)
        hl.store(spans, [2, group_idx], padded_starts, extra_mask=is_group)
        hl.store(spans, [3, group_idx], padded_ends, extra_mask=is_group)
    return spans


# One program of G lanes: nothing to tune.
GROUP_TOKEN_SPANS_CONFIG = helion.Config(num_warps=4, num_stages=1)


def group_token_spans(offs: torch.Tensor, tokens: int, alignment: int, padded_tokens: int) -> torch.Tensor:
    """Every group's ``group_token_span`` as an int32 ``(4, G)`` table on ``offs``' device, from one launch.

    Rows: ``start``, ``end``, ``padded_start``, ``padded_end``, the same values a kernel's
    ``group_token_span(offs, g, ..., tokens, alignment, padded_tokens)`` finds for group ``g``
    (bad offsets included). A GEMM with many programs a group reads its group's four values
    (``load_group_token_span``) instead of finding them from ``G`` lanes of ``offs`` in every
    program. ``offs`` is a checked non-empty int32 tensor.
    """
    require_interpreter_on_cpu(offs)
    args = (offs, tokens, padded_tokens, alignment, group_lanes(offs.numel()))
    return launch(group_token_spans_kernel, args, GROUP_TOKEN_SPANS_CONFIG)


# Whether the wgrad GEMMs read their groups' spans from a ``group_token_spans`` table (benchmarks turn
# it off to compare with ``group_token_span`` in every program).
SPAN_TABLE = True


def span_table_args(
    offs: torch.Tensor, tokens: int, alignment: int, padded_tokens: int, wanted: bool = True
) -> tuple[torch.Tensor, bool]:
    """A kernel's ``(spans, span_table)`` arguments: the table and ``True``, or ``offs`` (unread) and ``False``."""
    if SPAN_TABLE and wanted:
        return group_token_spans(offs, tokens, alignment, padded_tokens), True
    return offs, False


def load_group_token_span(
    spans: torch.Tensor, g: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device side: group ``g``'s ``(start, end, padded_start, padded_end)`` from a ``group_token_spans`` table."""
    return tuple(hl.load(spans, [row, g]) for row in range(4))  # type: ignore[return-value]


def token_tile_source(
    offs: torch.Tensor, tile_d: hl.Tile, tokens: int, groups_pow2: int, alignment: int
) -> tuple[torch.Tensor, ...]:
    """Device side: the tokens of a tile of padded-layout columns (a tile inside one group's span).

    Returns ``(group, routed, token, has_token, first_here, stop_here)``: column
    ``tile_d.index[i]`` holds token ``token[i]`` where ``has_token[i]`` (else
    padding, 0); ``routed`` is false past the last group (the unrouted tokens
    ``[end of last group, M)``; ``group`` is then clamped to 0). The groups whose
    padded spans start at ``tile_d.begin`` are ``first_here <= h < stop_here``:
    each group once, empty groups included (they start where the next span does).
    Group bounds follow ``group_token_span``.
    """
    num_groups = offs.size(0)
    group_idx, is_group, starts, ends, padded_sizes, padded_ends = group_span_lanes(offs, tokens, alignment, groups_pow2)
    padded_starts = padded_ends - padded_sizes
    group = torch.sum((padded_ends <= tile_d.begin).to(torch.int32), dim=0)
    routed = scalar_mask(group < num_groups)
    this = group_idx == group
    last = group_idx == num_groups - 1
    src_start = torch.where(routed, torch.sum(torch.where(this, starts, 0), dim=0), torch.sum(torch.where(last, ends, 0), dim=0))
    src_end = torch.where(routed, torch.sum(torch.where(this, ends, 0), dim=0), tokens)
    dst_start = torch.where(routed, torch.sum(torch.where(this, padded_starts, 0), dim=0), torch.sum(padded_sizes, dim=0))
    token = tile_d.index + (src_start - dst_start)
    first_here = torch.sum((is_group & (padded_starts < tile_d.begin)).to(torch.int32), dim=0)
    stop_here = torch.sum((is_group & (padded_starts <= tile_d.begin)).to(torch.int32), dim=0)
    return torch.where(routed, group, 0), routed, token, token < src_end, first_here, stop_here


def groups_meeting_rows(
    offs: torch.Tensor, begin: torch.Tensor | int, end: torch.Tensor | int, m: int, groups_pow2: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device-side group lookup for rows ``[begin, end)``: ``(group_idx, ends, first, stop)``.

    ``ends`` are the group ends clamped into ``[0, M]`` (so bad offsets never index
    out of bounds); the groups meeting the rows are ``first <= g < stop``: those
    with ``end_g > begin`` and ``start_g < end`` (start = previous end).
    """
    num_groups = offs.size(0)
    group_idx = hl.arange(groups_pow2)
    is_group = group_idx < num_groups
    ends = hl.load(offs, [group_idx], extra_mask=is_group)
    ends = torch.where(ends < 0, 0, torch.where(ends > m, m, ends))
    first = torch.sum((is_group & (ends <= begin)).to(torch.int32), dim=0)
    stop = torch.sum((is_group & (ends < end)).to(torch.int32), dim=0) + 1
    return group_idx, ends, first, torch.where(stop < num_groups, stop, num_groups)


def group_bounds(group_idx: torch.Tensor, ends: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(start, end)`` rows of group ``g`` from ``groups_meeting_rows``' clamped ends."""
    start = torch.amax(torch.where(group_idx == g - 1, ends, 0), dim=0)
    end = torch.amax(torch.where(group_idx == g, ends, 0), dim=0)
    return start, end
