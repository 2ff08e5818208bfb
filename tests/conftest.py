"""Test harness: pick the device once, mark GPU-only tests, seed every test."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Kernels run on CPU tensors through Triton's interpreter; set before Triton compiles anything.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Before any test module imports helion: supplies what older torch lacks (autotune_cache.torch_compat).
import autotune_cache  # noqa: E402, F401


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped on the CPU interpreter)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
