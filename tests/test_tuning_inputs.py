"""``kernels_helion.tuning.routed_offsets`` and ``routed_pairs``: the group sizes and pair orders kernels are tuned on."""

from __future__ import annotations

import torch

from kernels_helion.tuning import routed_offsets, routed_pairs


def _sizes(offs: torch.Tensor) -> torch.Tensor:
    return torch.diff(offs, prepend=offs.new_zeros(1))


def test_routed_offsets_cover_the_rows_and_scatter_like_a_router():
    offs = routed_offsets(65536, 128, torch.device("cpu"))
    assert offs.dtype == torch.int32 and offs.shape == (128,)
    sizes = _sizes(offs)
    assert int(offs[-1]) == 65536 and bool((sizes >= 0).all())
    # A balanced router's spread about 512 rows (binomial: standard deviation ~22), not equal groups.
    assert 10 < float(sizes.float().std()) < 40
    # Most groups end in a partial 128-row tile, as a layer's do.
    assert int((sizes % 128 != 0).sum()) > 100


def test_routed_offsets_are_the_same_every_call():
    assert torch.equal(routed_offsets(1000, 7, torch.device("cpu")), routed_offsets(1000, 7, torch.device("cpu")))


def test_routed_offsets_edge_cases():
    assert routed_offsets(10, 0, torch.device("cpu")).shape == (0,)
    assert torch.equal(routed_offsets(-5, 3, torch.device("cpu")), torch.zeros(3, dtype=torch.int32))
    assert int(routed_offsets(1, 4, torch.device("cpu"))[-1]) == 1


def test_routed_pairs_are_a_routers_pairs_in_expert_order():
    tokens, top_k, groups = 500, 4, 16
    pair_tokens, offs = routed_pairs(tokens, top_k, groups, torch.device("cpu"))
    assert pair_tokens.dtype == torch.int32 and pair_tokens.shape == (tokens * top_k,)
    assert offs.dtype == torch.int32 and offs.shape == (groups,) and int(offs[-1]) == tokens * top_k
    # Every token k times, never twice in one group; each group's tokens ascending.
    assert torch.equal(torch.bincount(pair_tokens.long(), minlength=tokens), torch.full((tokens,), top_k))
    start = 0
    for end in offs.tolist():
        group = pair_tokens[start:end]
        assert bool((group[1:] > group[:-1]).all())
        start = end
    again = routed_pairs(tokens, top_k, groups, torch.device("cpu"))
    assert torch.equal(again[0], pair_tokens) and torch.equal(again[1], offs)
