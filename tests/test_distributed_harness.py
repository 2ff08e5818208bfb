"""The spawned-world harness of the distributed tests: a rank's failure ends the run promptly."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing import ProcessRaisedException

from tests.support import run_distributed


def _rank0_fails_while_rank1_waits(rank: int, world: int) -> None:
    if rank == 0:
        raise ValueError("rank 0 fails")
    barrier = torch.ones(1, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(barrier)  # never completes: rank 0 is gone


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.cuda)])
def test_failed_rank_ends_the_run_before_the_collective_timeout(backend):
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    start = time.monotonic()
    with pytest.raises(ProcessRaisedException, match="rank 0 fails"):
        run_distributed(_rank0_fails_while_rank1_waits, 2, backend=backend, timeout_s=120)
    assert time.monotonic() - start < 60
