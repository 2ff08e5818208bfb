"""Behaviour every grouped GEMM shares, run on each format (rowwise, blockwise, mxfp8) and layout (2d3d, wgrad).

Each GEMM comes with its operands and plain-PyTorch reference (``tests.gemm_formats``).
Checked here: bitwise determinism, output dtypes, empty groups and no tokens, bad
offsets (clamped on the device: results of the groups the clamped offsets cover, nothing
written outside the output) and the input checks the launchers share. What one format
alone does stays in its own test file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.gemm_formats import GEMMS, Gemm, assert_close_out, group_sizes_of
from tests.support import DEVICE, group_sizes, poison_torch_empty

N, K = 32, 64  # output columns (2d3d) / output shape (wgrad: (G, N, K)); K is also the 2d3d contraction

gemms = pytest.mark.parametrize("gemm", GEMMS, ids=[g.name for g in GEMMS])


def _output_shape(gemm: Gemm, tokens: int, groups: int) -> tuple[int, ...]:
    return (tokens, N) if gemm.layout == "2d3d" else (groups, N, K)


@gemms
def test_deterministic(gemm: Gemm) -> None:
    """Unaligned groups of up to 280 tokens (several 128-token blocks), a contraction of two 128-wide blocks."""
    args = gemm.make(group_sizes(280, 3, "unaligned"), 300, N, 160)
    assert torch.equal(gemm(args), gemm(args))


@gemms
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_out_dtypes(gemm: Gemm, out_dtype: torch.dtype) -> None:
    args = gemm.make([33, 0, 40], 80, N, K)
    out = gemm(args, out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == _output_shape(gemm, 80, 3)
    assert_close_out(out, gemm.reference(args))


@gemms
def test_one_token_and_all_groups_empty(gemm: Gemm, monkeypatch: pytest.MonkeyPatch) -> None:
    """A single token in the second group; then both groups empty: every output 0."""
    args = gemm.make([0, 1], 1, N, K)
    poison_torch_empty(monkeypatch)  # an output no program writes shows as NaN
    out = gemm(args)
    assert out.shape == _output_shape(gemm, 1, 2)
    assert_close_out(out, gemm.reference(args))
    args = gemm.make([0, 0], 1, N, K)
    assert (gemm(args) == 0).all()


@gemms
def test_no_tokens(gemm: Gemm) -> None:
    args = gemm.make([0, 0], 0, N, K)
    out = gemm(args)
    assert out.shape == _output_shape(gemm, 0, 2) and (out == 0).all()
    if gemm.layout == "wgrad":
        # Accumulating: no group has a token, so the gradient is left as it was.
        grad = torch.randn(2, N, K, device=DEVICE)
        before = grad.clone()
        assert gemm(args, out=grad) is grad
        assert torch.equal(grad, before)


# Bad offsets: ends are clamped into [0, tokens] on the device, and a group ending before it starts is empty.
BAD_OFFSETS = {
    "negative-and-decreasing": [-5, 30, 50, 20],  # the groups [0, 0), [0, 30), [30, 50), [50, 50)
    "past-the-end": [10, 40, 1000, 2000],  # the groups [0, 10), [10, 40), [40, 72), [72, 72)
}
TOKENS = 72


@gemms
@pytest.mark.parametrize("case", BAD_OFFSETS)
def test_bad_offsets_give_the_clamped_groups(gemm: Gemm, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad offsets give the groups of their clamped, non-decreasing ends, exactly as those offsets do; every
    output is written (2d3d, NaN-poisoned allocation) and nothing next to a given output (wgrad) is."""
    bad = torch.tensor(BAD_OFFSETS[case], dtype=torch.int32, device=DEVICE)
    sizes = group_sizes_of(bad, TOKENS)
    args = gemm.make(sizes, TOKENS, N, K)  # the operands (and block map) of the clamped groups
    expected = gemm.reference(args)
    if gemm.layout == "2d3d":
        poison_torch_empty(monkeypatch)
        out = gemm(args, offs=bad)
        assert out.shape == (TOKENS, N) and not out.isnan().any()
        assert_close_out(out, expected)
        assert (out[sum(sizes) :] == 0).all()
    else:
        # The output is the middle of a NaN-filled buffer: the guards on both sides must stay NaN.
        groups = len(sizes)
        buffer = torch.full((groups + 2, N, K), float("nan"), device=DEVICE)
        initial = torch.randn(groups, N, K, device=DEVICE)
        out = buffer[1:-1]
        out.copy_(initial)
        assert gemm(args, offs=bad, out=out) is out
        assert buffer[0].isnan().all() and buffer[-1].isnan().all()
        assert_close_out(out, initial.double() + expected)
    assert torch.equal(gemm(args, offs=bad), gemm(args))


def _close_rows(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Per row of a 2d3d output: whether it is within ``assert_close_out``'s tolerance of ``expected``."""
    atol = 4e-3 * float(expected.abs().amax()) + 1e-6
    return ((actual.double() - expected).abs() <= atol + 1.6e-2 * expected.abs()).all(dim=1)


@pytest.mark.parametrize("gemm", [g for g in GEMMS if g.layout == "2d3d"], ids=lambda g: g.name)
def test_overlapping_groups_each_write_their_rows(gemm: Gemm, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offsets that fall and rise again make groups overlap: [-5, 1000, 10, 70] over 64 rows gives the groups
    [0, 0), [0, 64), [64, 64) and [10, 64). Every row is written and holds its product with the weight of a
    group that covers it."""
    m, bad = 64, [-5, 1000, 10, 70]
    args = gemm.make([0, m, 0, 0], m, N, K)
    starts = [min(max(o, 0), m) for o in [0, *bad[:-1]]]
    ends = [max(min(max(o, 0), m), start) for o, start in zip(bad, starts)]
    # Group g's product for every row: the reference with all rows in group g.
    everyone_in = [
        gemm.reference({**args, "offs": torch.tensor([0] * g + [m] * (4 - g), dtype=torch.int32, device=DEVICE)})
        for g in range(4)
    ]
    poison_torch_empty(monkeypatch)
    out = gemm(args, offs=torch.tensor(bad, dtype=torch.int32, device=DEVICE))
    assert not out.isnan().any()
    matched = torch.zeros(m, dtype=torch.bool, device=DEVICE)
    for g, (start, end) in enumerate(zip(starts, ends)):
        matched[start:end] |= _close_rows(out, everyone_in[g])[start:end]
    assert matched.all(), (~matched).nonzero().flatten().tolist()


# Input checks. Each case: (overrides of the launcher's arguments, error, message); the operands of
# ``gemm.make([16, 16], 32, N, K)``.
Override = Callable[[dict[str, Any]], Any]
BAD_INPUT_2D3D: list[tuple[dict[str, Override], type[Exception], str]] = [
    ({"a": lambda d: d["a"].float()}, TypeError, "a must be one of"),
    ({"b": lambda d: d["b"].to(torch.float8_e5m2)}, TypeError, "b must be one of"),
    ({"a": lambda d: d["a"].t().contiguous().t()}, ValueError, "a must be contiguous"),
    ({"b": lambda d: d["b"][0]}, ValueError, "b must be 3-D"),
    ({"a": lambda d: d["a"].tolist()}, TypeError, "a must be a torch.Tensor"),
    ({"offs": lambda d: d["offs"].long()}, TypeError, "offs must have dtype"),
    ({"offs": lambda d: d["offs"][:1]}, ValueError, "one group end per expert"),
    ({"offs": lambda d: d["offs"][:0]}, ValueError, "at least one group end"),
    ({"out_dtype": lambda d: torch.int32}, TypeError, "out_dtype must be one of"),
]
BAD_INPUT_WGRAD: list[tuple[dict[str, Override], type[Exception], str]] = [
    ({"a_t": lambda d: d["a_t"].float()}, TypeError, "a_t must be one of"),
    ({"b_t": lambda d: d["b_t"].to(torch.float8_e5m2)}, TypeError, "b_t must be one of"),
    ({"b_t": lambda d: d["b_t"][:, : d["b_t"].shape[1] // 2].contiguous()}, ValueError, "M = a_t.shape"),
    ({"a_t": lambda d: d["a_t"].t().contiguous().t()}, ValueError, "a_t must be contiguous"),
    ({"a_t": lambda d: d["a_t"].tolist()}, TypeError, "a_t must be a torch.Tensor"),
    ({"offs": lambda d: d["offs"].long()}, TypeError, "offs must have dtype"),
    ({"out": lambda d: torch.zeros(2, N, K, dtype=torch.float64, device=DEVICE)}, TypeError, "out must have dtype"),
    ({"out": lambda d: torch.zeros(2, N, K // 2, device=DEVICE)}, ValueError, rf"out must have shape \(2, {N}, {K}\)"),
    ({"out_dtype": lambda d: torch.int8}, TypeError, "out_dtype must be one of"),
]
BAD_INPUT = [
    pytest.param(gemm, overrides, error, match, id=f"{gemm.name}-{i}")
    for gemm in GEMMS
    for i, (overrides, error, match) in enumerate(BAD_INPUT_2D3D if gemm.layout == "2d3d" else BAD_INPUT_WGRAD)
]


@pytest.mark.parametrize("gemm, overrides, error, match", BAD_INPUT)
def test_bad_input(gemm: Gemm, overrides: dict[str, Override], error: type[Exception], match: str) -> None:
    args = gemm.make([16, 16], 32, N, K)
    with pytest.raises(error, match=match):
        gemm(args, **{name: override(args) for name, override in overrides.items()})
