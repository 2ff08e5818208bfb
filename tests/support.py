"""Helpers shared by the tests: device, references' building blocks, comparisons, offsets."""

from __future__ import annotations

import math

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"

# Quantities that are NaN-poisoned before a kernel writes them.
POISON_FLOAT = float("nan")


def poison_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor shaped like ``t`` filled with NaN (floats) or 0xFF bits (fp8/ints)."""
    if t.dtype.is_floating_point and t.element_size() > 1:
        return torch.full_like(t, POISON_FLOAT)
    return torch.full(t.shape, 0xFF, dtype=torch.uint8, device=t.device).view(t.dtype)


def sqnr_db(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB of ``actual`` against ``reference``."""
    ref = reference.double()
    noise = (actual.double() - ref).norm()
    if noise == 0:
        return math.inf
    return float(20 * torch.log10(ref.norm() / noise))


def assert_fp8_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """FP8 tensors equal bit for bit (any NaN matches any NaN).

    Our kernels round in fp32 before an exact cast, so they agree with PyTorch's
    cast bitwise on GPUs and on Triton's CPU interpreter alike.
    """
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a, e = actual.float(), expected.float()
    both_nan = a.isnan() & e.isnan()
    same = (actual.view(torch.uint8) == expected.view(torch.uint8)) | both_nan
    if not bool(same.all()):
        idx = (~same).nonzero()[:5].tolist()
        raise AssertionError(
            f"{int((~same).sum())} of {same.numel()} fp8 elements differ; first at {idx}: "
            f"actual {[a[tuple(i)].item() for i in idx]} expected {[e[tuple(i)].item() for i in idx]}"
        )


def offsets_from_sizes(sizes: list[int], device: torch.device = DEVICE) -> torch.Tensor:
    """int32 cumulative group ends, as ``torch._grouped_mm`` takes them."""
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def group_sizes(total: int, groups: int, kind: str = "uniform", align: int = 1, seed: int = 0) -> list[int]:
    """Token counts per group summing to at most ``total``.

    kind: ``uniform`` (equal split), ``skewed`` (Dirichlet(1) routing), ``empty``
    (some groups empty), ``one`` (a one-token group), ``unaligned`` (sizes that
    are not multiples of 16). With ``align > 1`` every size is a multiple of it
    (the remainder is left as tokens past the last group end).
    """
    gen = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        sizes = [total // groups] * groups
    elif kind == "skewed":
        weights = torch.distributions.Dirichlet(torch.ones(groups)).sample()
        sizes = [int(w) for w in (weights * total).floor()]
    elif kind == "empty":
        sizes = [0 if g % 3 == 1 else total // groups for g in range(groups)]
    elif kind == "one":
        sizes = [1] + [(total - 1) // max(groups - 1, 1)] * (groups - 1)
    elif kind == "unaligned":
        base = torch.randint(1, max(2, 2 * total // groups), (groups,), generator=gen)
        sizes = [int(s) | 1 for s in base]
    else:
        raise ValueError(f"unknown kind {kind!r}")
    sizes = [s // align * align for s in sizes]
    while sum(sizes) > total:
        g = max(range(groups), key=lambda i: sizes[i])
        sizes[g] -= min(sizes[g], max(align, sum(sizes) - total) // align * align or align)
    return sizes
