"""16-bit wgrad over rows as stored (``grouped_mm_wgrad_bf16``): gathered by index, added into the gradient."""

from __future__ import annotations

import pytest
import torch

from kernels_helion import grouped_mm_wgrad_bf16
from tests.support import DEVICE, group_sizes, offsets_from_sizes, opcheck_fp8, poison_torch_empty


def reference(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
    """``a[g]^T @ b[g]`` per group in float32 (``b[index]`` with ``index``; rows past ``offs[-1]`` ignored)."""
    if index is not None:
        b = b[index.long()]
    out, start = [], 0
    for end in offs.tolist():
        out.append(a[start:end].float().T @ b[start:end].float())
        start = max(start, end)
    return torch.stack(out)


def assert_close_fp32(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # bf16 products are exact in fp32; on the GPU the tensor cores' fp32 sums run in another order.
    scale = float(expected.abs().amax()) + 1e-6
    torch.testing.assert_close(actual.float(), expected, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("kind", ["uniform", "skewed", "empty", "one", "unaligned"])
@pytest.mark.parametrize("gather", [False, True])
def test_matches_reference(kind, gather):
    torch.manual_seed(0)
    p, n, k, g, tokens = 90, 40, 24, 4, 23
    offs = offsets_from_sizes(group_sizes(p - 7, g, kind))  # rows past offs[-1] are not read
    a = torch.randn(p, n, device=DEVICE).bfloat16()
    b = torch.randn(tokens if gather else p, k, device=DEVICE).bfloat16()
    index = torch.randint(0, tokens, (p,), device=DEVICE, dtype=torch.int32) if gather else None
    if gather:
        index[:3] = 5  # one token read by several rows (an expert chosen twice, other experts)
    out = grouped_mm_wgrad_bf16(a, b, offs, index=index, out_dtype=torch.float32)
    assert out.shape == (g, n, k) and out.dtype == torch.float32
    assert_close_fp32(out, reference(a, b, offs, index))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_output_dtypes_and_a_column_slice(out_dtype):
    """``a`` may be a column slice of a wider tensor (w1's half of ``[grad_gate | grad_up]``)."""
    torch.manual_seed(1)
    p, n, k = 50, 32, 40
    wide = torch.randn(p, 2 * n, device=DEVICE).bfloat16()
    b = torch.randn(p, k, device=DEVICE).bfloat16()
    offs = offsets_from_sizes([20, 1, 29])
    for a in (wide[:, :n], wide[:, n:]):
        out = grouped_mm_wgrad_bf16(a, b, offs, out_dtype=out_dtype)
        assert out.dtype == out_dtype
        torch.testing.assert_close(out, reference(a, b, offs).to(out_dtype), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("target", [torch.bfloat16, torch.float32])
def test_accumulates_into_out_in_fp32_rounded_once(target):
    torch.manual_seed(2)
    p, n, k, tokens = 60, 24, 32, 17
    a = torch.randn(p, n, device=DEVICE).bfloat16()
    b = torch.randn(tokens, k, device=DEVICE).bfloat16()
    index = torch.randint(0, tokens, (p,), device=DEVICE)
    offs = offsets_from_sizes([25, 0, 30])
    old = torch.randn(3, n, k, device=DEVICE).to(target)
    out = old.clone()
    returned = grouped_mm_wgrad_bf16(a, b, offs, index=index, out=out)
    assert returned is out
    expected = (old.float() + reference(a, b, offs, index)).to(target)
    if target == torch.float32:
        assert_close_fp32(out, expected)
    else:  # one rounding of the fp32 sum: within half a bf16 ulp of it, up to the sum order
        torch.testing.assert_close(out, expected, rtol=8e-3, atol=1e-5)
    assert torch.equal(out[1], old[1])  # an empty group adds exactly 0


def test_writes_every_output_element(monkeypatch):
    """A new output is fully written: torch.empty returns NaN here, and none survives."""
    poison_torch_empty(monkeypatch)
    torch.manual_seed(3)
    a = torch.randn(30, 16, device=DEVICE).bfloat16()
    b = torch.randn(30, 24, device=DEVICE).bfloat16()
    offs = offsets_from_sizes([0, 30, 0])
    out = grouped_mm_wgrad_bf16(a, b, offs, out_dtype=torch.float32)
    assert not out.isnan().any()
    assert (out[0] == 0).all() and (out[2] == 0).all()


@pytest.mark.parametrize("gather", [False, True])
def test_nan_reaches_its_own_group_only(gather):
    torch.manual_seed(4)
    p, n, k = 40, 16, 16
    a = torch.randn(p, n, device=DEVICE).bfloat16()
    b = torch.randn(p, k, device=DEVICE).bfloat16()
    offs = offsets_from_sizes([10, 15, 15])
    index = torch.arange(p, device=DEVICE) if gather else None
    b[12, 3] = float("nan")  # row 12: group 1 (rows 10..24)
    a[39, 0] = float("inf")  # past a group? no: row 39 is in group 2; its column 0 of dW gets Inf / NaN
    out = grouped_mm_wgrad_bf16(a, b, offs, index=index, out_dtype=torch.float32)
    assert out[0].isfinite().all()
    assert out[1, :, 3].isnan().all() and out[1, :, [0, 1, 2]].isfinite().all()
    assert not out[2, 0].isfinite().all() and out[2, 1:].isfinite().all()


def test_rows_past_the_last_group_and_unread_tokens_are_ignored():
    torch.manual_seed(5)
    a = torch.randn(20, 8, device=DEVICE).bfloat16()
    b = torch.randn(6, 8, device=DEVICE).bfloat16()
    index = torch.randint(0, 5, (20,), device=DEVICE)
    index[15:] = 5
    b[5] = float("nan")  # read only by rows 15.., past offs[-1] = 15
    offs = offsets_from_sizes([7, 8])
    out = grouped_mm_wgrad_bf16(a, b, offs, index=index, out_dtype=torch.float32)
    assert out.isfinite().all()
    assert_close_fp32(out, reference(a[:15], b, offs, index[:15]))


def test_is_deterministic():
    torch.manual_seed(6)
    a = torch.randn(70, 32, device=DEVICE).bfloat16()
    b = torch.randn(70, 48, device=DEVICE).bfloat16()
    offs = offsets_from_sizes([33, 37])
    first = grouped_mm_wgrad_bf16(a, b, offs)
    assert torch.equal(first, grouped_mm_wgrad_bf16(a, b, offs))


def test_bad_inputs_raise_before_launch():
    a = torch.randn(10, 8, device=DEVICE).bfloat16()
    b = torch.randn(10, 8, device=DEVICE).bfloat16()
    offs = offsets_from_sizes([10])
    with pytest.raises(TypeError, match="b must have the dtype of a"):
        grouped_mm_wgrad_bf16(a, b.half(), offs)
    with pytest.raises(TypeError, match="a must have dtype"):
        grouped_mm_wgrad_bf16(a.float(), b, offs)
    with pytest.raises(ValueError, match="b must have P"):
        grouped_mm_wgrad_bf16(a, b[:9], offs)
    with pytest.raises(ValueError, match="index must have P"):
        grouped_mm_wgrad_bf16(a, b, offs, index=torch.zeros(9, dtype=torch.int64, device=DEVICE))
    with pytest.raises(TypeError, match="index must have dtype"):
        grouped_mm_wgrad_bf16(a, b, offs, index=torch.zeros(10, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous rows"):
        grouped_mm_wgrad_bf16(a.t(), b, offs)
    with pytest.raises(ValueError, match="out must have shape"):
        grouped_mm_wgrad_bf16(a, b, offs, out=torch.zeros(1, 8, 7, device=DEVICE))
    with pytest.raises(TypeError, match="offs"):
        grouped_mm_wgrad_bf16(a, b, offs.long())


def test_custom_op_mutates_only_out():
    import ops  # noqa: F401  (defines the fp8moe ops)

    a = torch.randn(12, 8, device=DEVICE).bfloat16()
    b = torch.randn(5, 16, device=DEVICE).bfloat16()
    index = torch.randint(0, 5, (12,), device=DEVICE)
    offs = offsets_from_sizes([4, 8])
    out = torch.randn(2, 8, 16, device=DEVICE)
    opcheck_fp8(torch.ops.fp8moe.grouped_mm_wgrad_bf16_accumulate, (a, b, offs, index, out), mutable=("out",))
    rows = torch.randn(12, 16, device=DEVICE).bfloat16()
    opcheck_fp8(torch.ops.fp8moe.grouped_mm_wgrad_bf16_accumulate, (a, rows, offs, None, out), mutable=("out",))


@pytest.mark.cuda
@pytest.mark.parametrize("p, tokens, n, k, g", [(65536, 8192, 768, 2048, 128), (65536, 8192, 2048, 7168, 256)])
def test_matches_torch_grouped_mm_at_real_shapes(p, tokens, n, k, g):
    torch.manual_seed(0)
    a = torch.randn(p, 2 * n, device=DEVICE).bfloat16()[:, :n]
    b = torch.randn(tokens, k, device=DEVICE).bfloat16()
    index = torch.randint(0, tokens, (p,), device=DEVICE, dtype=torch.int32)
    offs = offsets_from_sizes(group_sizes(p, g, "skewed"))
    expected = reference(a, b, offs, index)  # fp32 matmuls per group (TF32 off)
    out = torch.zeros(g, n, k, device=DEVICE)
    grouped_mm_wgrad_bf16(a, b, offs, index=index, out=out)
    # Compared 16 groups at a time: at DeepSeek-V3's shape each fp32 tensor takes 14 GiB, and
    # assert_close's temporaries over whole tensors do not fit an 80 GB H100 beside them.
    scale = float(expected.abs().amax()) + 1e-6
    for chunk in range(0, g, 16):
        torch.testing.assert_close(out[chunk : chunk + 16], expected[chunk : chunk + 16], rtol=1e-4, atol=1e-5 * scale)
    del out, expected
    # A new bf16 dW: CUTLASS's (torch._grouped_mm), both the fp32 sum rounded once.
    ours = grouped_mm_wgrad_bf16(a, b, offs, index=index)
    theirs = torch._grouped_mm(a.t(), b.index_select(0, index), offs=offs)
    scale = float(theirs.abs().amax())
    for chunk in range(0, g, 16):
        torch.testing.assert_close(ours[chunk : chunk + 16], theirs[chunk : chunk + 16], rtol=1e-2, atol=1e-2 * scale)


@pytest.mark.parametrize(
    "offs", [[0, 1, 45, 45, 83], [-5, 1000, 10, 70], [10, 40, 1000, 2000]], ids=["empty-and-one", "overlapping", "past-the-end"]
)
def test_span_table_gives_the_bits_of_spans_from_offs(offs, monkeypatch):
    # Each group's rows from a group_token_spans table or found from offs in every program: the same bits,
    # into a new dW and added into a gradient, bad offsets included.
    from kernels_helion import token_groups

    torch.manual_seed(0)
    p, n, k = 90, 40, 24
    offs = torch.tensor(offs, dtype=torch.int32, device=DEVICE)
    a = torch.randn(p, n, device=DEVICE).bfloat16()
    b = torch.randn(p, k, device=DEVICE).bfloat16()
    before = torch.randn(offs.numel(), n, k, device=DEVICE).bfloat16()
    results = {}
    for table in (True, False):
        monkeypatch.setattr(token_groups, "SPAN_TABLE", table)
        results[table] = (grouped_mm_wgrad_bf16(a, b, offs), grouped_mm_wgrad_bf16(a, b, offs, out=before.clone()))
    assert all(torch.equal(x, y) for x, y in zip(results[True], results[False]))
