"""The expert-parallel index maps (``ops.ep_layout``) against plain loops over the rows, for random counts."""

from __future__ import annotations

import pytest
import torch

from ops.ep_layout import capacity_receive, capacity_send, exact_receive_order, inverse_permutation


def _random_counts(gen: torch.Generator, ep: int, local: int, high: int) -> torch.Tensor:
    counts = torch.randint(0, high, (ep, local), generator=gen)
    counts[0, 0] = 0  # an empty group
    return counts


def _received_rows(counts: torch.Tensor, capacity: int | None) -> list[tuple[int, int, int]]:
    """(source, local expert, index within the group) of each received slot, source-major (``None`` past the kept ones)."""
    slots = []
    for s, per_expert in enumerate(counts.tolist()):
        block = [(s, l, i) for l, n in enumerate(per_expert) for i in range(n)]
        if capacity is not None:
            block = block[:capacity] + [None] * (capacity - min(len(block), capacity))
        slots += block
    return slots


@pytest.mark.parametrize("ep, local", [(1, 3), (2, 2), (3, 4), (4, 1)])
@pytest.mark.parametrize("capacity", [None, 1, 5, 40])
def test_receive_order_is_expert_major(ep, local, capacity):
    gen = torch.Generator().manual_seed(ep * 100 + local)
    for _ in range(5):
        counts = _random_counts(gen, ep, local, 9)
        slots = _received_rows(counts, capacity)
        expected = sorted((t[1], t[0], t[2]) for t in slots if t is not None)  # by expert, then source, in order
        if capacity is None:
            order = exact_receive_order(counts, counts.sum().item())
            local_counts = counts.sum(0)
        else:
            receive = capacity_receive(counts, capacity)
            order, local_counts = receive.expert_major, receive.local_counts
            assert sorted(order.tolist()) == list(range(ep * capacity))  # a permutation of the slots
            assert torch.equal(receive.source_major, inverse_permutation(order))
            # Past the kept rows: the filler slots, in slot order.
            assert order[len(expected):].tolist() == [i for i, t in enumerate(slots) if t is None]
        got = [slots[i] for i in order[: len(expected)].tolist()]
        assert [(t[1], t[0], t[2]) for t in got] == expected
        assert local_counts.tolist() == [sum(1 for t in expected if t[0] == l) for l in range(local)]


@pytest.mark.parametrize("ep, local", [(1, 2), (2, 3), (3, 2)])
@pytest.mark.parametrize("capacity", [1, 4, 30])
@pytest.mark.parametrize("uncounted", [0, 2])
def test_capacity_send_packs_and_unpacks(ep, local, capacity, uncounted):
    gen = torch.Generator().manual_seed(ep * 10 + capacity + uncounted)
    for _ in range(5):
        counts = _random_counts(gen, ep, local, 7)
        rows = int(counts.sum()) + uncounted  # rows past the counted ones (misrouted)
        send = capacity_send(counts, rows, capacity)
        per_rank = counts.sum(1).tolist()
        start = 0
        expected_unpack = []
        for d, n in enumerate(per_rank):
            for j in range(capacity):
                if j < min(n, capacity):
                    assert send.pack[d * capacity + j] == start + j
                else:  # filler: any row in range
                    assert 0 <= send.pack[d * capacity + j] < max(rows, 1)
            expected_unpack += [d * capacity + j if j < capacity else ep * capacity for j in range(n)]
            start += n
        expected_unpack += [ep * capacity] * uncounted
        assert send.unpack.tolist() == expected_unpack
        assert send.dropped.item() == sum(max(n - capacity, 0) for n in per_rank)


def test_capacity_send_with_no_rows():
    send = capacity_send(torch.zeros(2, 3, dtype=torch.int64), 0, 4)
    assert send.unpack.numel() == 0 and send.dropped.item() == 0 and send.pack.shape == (8,)
