from __future__ import annotations

import pytest
import torch

from kernels_helion.group_offsets import group_lanes, group_offsets
from tests.support import DEVICE


def ref_group_offsets(offs: list[int], num_tokens: int, unit: int):
    """Plain-Python reference: running-max ends, sizes rounded up to ``unit``, their exclusive/inclusive sums."""
    ends, layout_ends, end, total = [], [], 0, 0
    for o in offs:
        start = end
        end = max(end, min(max(o, 0), num_tokens))
        total += -(-(end - start) // unit) * unit
        ends.append(end)
        layout_ends.append(total)
    starts = [0] + layout_ends[:-1]
    return [torch.tensor(v, dtype=torch.int32) for v in (ends, layout_ends, starts)]


def _offsets(num_groups: int, num_tokens: int, seed: int) -> list[int]:
    # Sorted random ends reaching past both bounds, with a decreasing run and repeats (empty groups).
    gen = torch.Generator().manual_seed(seed)
    offs = torch.randint(-50, num_tokens + 50, (num_groups,), generator=gen, dtype=torch.int32).sort().values
    offs[num_groups // 3 : num_groups // 3 + 10] = offs[num_groups // 3 : num_groups // 3 + 10].flip(0)
    return offs.tolist()


@pytest.mark.parametrize("unit", [1, 4, 32, 128])
@pytest.mark.parametrize("num_groups", [1, 16, 257])
def test_matches_reference(num_groups, unit):
    num_tokens = 3001
    offs = _offsets(num_groups, num_tokens, seed=num_groups * 1000 + unit)
    got = group_offsets(torch.tensor(offs, dtype=torch.int32, device=DEVICE), num_tokens, unit)
    for name, g, want in zip(("ends", "layout_ends", "layout_starts"), got, ref_group_offsets(offs, num_tokens, unit)):
        assert g.dtype == torch.int32 and g.device.type == DEVICE.type, name
        assert torch.equal(g.cpu(), want), name


def test_hand_checked():
    # Groups [0, 3), [3, 3) (empty), [3, 40), [40, 64) (offs clamped to 64 tokens).
    offs = torch.tensor([3, 3, 40, 100], dtype=torch.int32, device=DEVICE)
    ends, padded_ends, padded_starts = group_offsets(offs, 64, 16)
    assert ends.tolist() == [3, 3, 40, 64]
    assert padded_ends.tolist() == [16, 16, 64, 96] and padded_starts.tolist() == [0, 16, 16, 64]


def test_group_lanes():
    # The smallest power of two holding the groups: checked against the definition, not Triton.
    for groups in range(1, 1100):
        lanes = group_lanes(groups)
        assert lanes >= groups and lanes & (lanes - 1) == 0 and (lanes == 1 or lanes // 2 < groups), groups
