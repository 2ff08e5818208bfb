"""``ops.sort_by_expert``: the pairs sorted stably by expert, the inverse permutation and each expert's count,
against a plain reference (a stable argsort of int64 bins and ``torch.bincount``)."""

from __future__ import annotations

import pytest
import torch

import ops
from tests.support import DEVICE


@pytest.mark.parametrize(
    "tokens, top_k, num_experts",
    [(37, 3, 5), (64, 8, 128), (1, 1, 1), (0, 2, 4), (50, 2, 40000)],  # E past int16 keys
)
def test_sort_by_expert_is_a_stable_sort_with_counts(tokens, top_k, num_experts):
    gen = torch.Generator(device=DEVICE).manual_seed(tokens + num_experts)
    top = torch.randint(0, num_experts, (tokens, top_k), device=DEVICE, generator=gen)
    if tokens >= 3:
        top[0] = 0  # an expert chosen k times by one token
        top[1, 0], top[2, -1] = -1, num_experts + 3  # out of range: sorted last, counted nowhere
    order = ops.sort_by_expert(top, num_experts)

    flat = top.flatten()
    bins = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    expected = torch.argsort(bins.cpu(), stable=True).to(DEVICE)
    assert order.order.dtype == order.inverse.dtype == order.num_tokens_per_expert.dtype == torch.int64
    assert torch.equal(order.order, expected)
    assert torch.equal(order.inverse[order.order], torch.arange(tokens * top_k, device=DEVICE))
    counts = torch.bincount(bins.cpu(), minlength=num_experts + 1)[:num_experts].to(DEVICE)
    assert torch.equal(order.num_tokens_per_expert, counts)
