"""The spawned-world harness of the distributed tests: a rank's failure ends the run promptly."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing import ProcessRaisedException

from tests.support import run_distributed


def _one_rank_fails_while_the_other_waits(rank: int, world: int, failing: int) -> None:
    if rank == failing:
        raise ValueError(f"rank {rank} fails")
    barrier = torch.ones(1, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(barrier)  # never completes: the failing rank is gone


@pytest.mark.parametrize("failing", [0, 1])
@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.cuda)])
def test_failed_rank_ends_the_run_before_the_collective_timeout(backend, failing):
    """The run ends promptly and reports the failing rank's error, not the error its waiting peer
    raises when the connection closes (whichever process the spawner happens to see first)."""
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    start = time.monotonic()
    expected = rf"(?s)rank {failing} failed first:.*ValueError: rank {failing} fails"
    with pytest.raises(ProcessRaisedException, match=expected) as info:
        run_distributed(_one_rank_fails_while_the_other_waits, 2, failing, backend=backend, timeout_s=120)
    assert info.value.error_index == failing
    assert time.monotonic() - start < 60


def _rank_sleeps(rank: int, world: int, seconds: float) -> None:
    time.sleep(seconds)


def test_ranks_past_the_join_timeout_are_killed():
    """With ``join_timeout_s``, ranks still running then are killed and the call raises ``TimeoutError``."""
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish in 2 s"):
        run_distributed(_rank_sleeps, 2, 300.0, join_timeout_s=2)
    assert time.monotonic() - start < 60
