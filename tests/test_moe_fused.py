"""The fused SwiGLU up-projection (``ops.moe_fused``) and its kernels, against plain PyTorch and the unfused path.

Kernels: ``grouped_mm_swiglu`` (token rows gathered by index, gate and up in one GEMM,
SwiGLU in the epilogue), ``swiglu_backward`` (alone, weighted by the routing weights with their
gradient: ``swiglu_backward_weighted``, and with its result's folded rowwise quantization:
``swiglu_backward_quantized``), ``grouped_mm_2d3d_split`` (one contraction
over a weight stored as two tensors), ``transpose_to_token_groups(..., rows=)``. The layer:
``ops.MoE`` with the fused experts (the default rowwise recipe) against the same layer with
``RowwiseOptions(fused_experts=False)`` and against bf16.
"""

from __future__ import annotations

import copy

import helion
import pytest
import torch
import torch.nn.functional as F

import ops
from benchmarks.common import capture_step
from kernels_helion import (
    grouped_mm_2d3d,
    grouped_mm_2d3d_split,
    grouped_mm_swiglu,
    quantize_rowwise_rows,
    swiglu_backward,
    swiglu_backward_quantized,
    swiglu_backward_weighted,
    transpose_to_token_groups,
)
from tests.support import (
    DEVICE,
    group_sizes,
    offsets_from_sizes,
    opcheck_fp8,
    poison_torch_empty,
    record_kernel_calls,
    sqnr_db,
)

FP8 = torch.float8_e4m3fn
UNFUSED = ops.Fp8Recipe(options=ops.RowwiseOptions(fused_experts=False))


def fp8_operand(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = (torch.randn(*shape, device=DEVICE) * 100).clamp(-448, 448).to(FP8)
    return data, torch.rand(*shape[:-1], device=DEVICE) * 1e-2 + 1e-3


def ref_swiglu_gemm(a, sa, rows, bg, sg, bu, su, offs):
    """Dequantized gathered rows times each group's weights in float32; gate/up rounded to bf16, h from them."""
    x = a.float()[rows.long()] * sa[rows.long(), None]
    gate = torch.zeros(rows.shape[0], bg.shape[1], device=a.device)
    up = torch.zeros_like(gate)
    start = 0
    for g, end in enumerate(offs.tolist()):
        gate[start:end] = x[start:end] @ (bg[g].float() * sg[g][:, None]).T
        up[start:end] = x[start:end] @ (bu[g].float() * su[g][:, None]).T
        start = end
    gate, up = gate.bfloat16(), up.bfloat16()
    h = (F.silu(gate.float()) * up.float()).bfloat16()
    h[start:] = 0
    gate[start:] = 0
    up[start:] = 0
    return h, torch.cat([gate, up], dim=1)


def assert_close_bf16(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol = 4e-3 * float(expected.float().abs().amax()) + 1e-6
    torch.testing.assert_close(actual.float(), expected.float(), rtol=1.6e-2, atol=atol)


@pytest.mark.parametrize("kind", ["uniform", "skewed", "empty", "one", "unaligned"])
def test_swiglu_gemm_matches_reference(monkeypatch, kind):
    tokens, k, n, e, top_k = 29, 64, 48, 4, 3
    pairs = tokens * top_k
    sizes = group_sizes(pairs - 5, e, kind)  # the last 5+ pairs are past offs[-1]
    offs = offsets_from_sizes(sizes)
    a, sa = fp8_operand(tokens, k)
    bg, sg = fp8_operand(e, n, k)
    bu, su = fp8_operand(e, n, k)
    rows = torch.randint(0, tokens, (pairs,), dtype=torch.int32, device=DEVICE)
    rows[:4] = 7  # one token read by several pairs of one group
    poison_torch_empty(monkeypatch)  # a row no work item writes shows as NaN
    h, gate_up = grouped_mm_swiglu(a, sa, rows, bg, sg, bu, su, offs)
    assert h.shape == (pairs, n) and gate_up.shape == (pairs, 2 * n) and h.dtype == torch.bfloat16
    ref_h, ref_gate_up = ref_swiglu_gemm(a, sa, rows, bg, sg, bu, su, offs)
    assert_close_bf16(gate_up, ref_gate_up)
    assert_close_bf16(h, ref_h)
    assert (h[sum(sizes):] == 0).all() and (gate_up[sum(sizes):] == 0).all()


def test_swiglu_gemm_gathers_what_the_unfused_gemms_read():
    """Gate and up equal two ``grouped_mm_2d3d`` of the gathered rows (the unfused path), to one bf16 rounding."""
    tokens, k, n, e = 40, 96, 32, 3
    a, sa = fp8_operand(tokens, k)
    bg, sg = fp8_operand(e, n, k)
    bu, su = fp8_operand(e, n, k)
    rows = torch.randint(0, tokens, (90,), dtype=torch.int32, device=DEVICE)
    offs = offsets_from_sizes([30, 0, 60])
    _, gate_up = grouped_mm_swiglu(a, sa, rows, bg, sg, bu, su, offs)
    gathered, gathered_scales = a[rows.long()], sa[rows.long()]
    gate = grouped_mm_2d3d(gathered, gathered_scales, bg, sg, offs)
    up = grouped_mm_2d3d(gathered, gathered_scales, bu, su, offs)
    ulp = 2.0**-7 * torch.cat([gate, up], 1).float().abs()
    assert ((gate_up.float() - torch.cat([gate, up], 1).float()).abs() <= ulp).all()


def test_swiglu_gemm_nan_reaches_only_its_rows():
    tokens, k, n, e = 16, 64, 32, 2
    a, sa = fp8_operand(tokens, k)
    bg, sg = fp8_operand(e, n, k)
    bu, su = fp8_operand(e, n, k)
    sa[5] = float("nan")
    rows = torch.arange(tokens, device=DEVICE, dtype=torch.int32).repeat(2)
    offs = offsets_from_sizes([tokens, tokens])
    h, _ = grouped_mm_swiglu(a, sa, rows, bg, sg, bu, su, offs)
    bad = rows == 5
    assert h[bad].isnan().all() and not h[~bad].isnan().any()


def test_swiglu_backward_matches_autograd():
    m, n = 37, 48
    gate_up = torch.randn(m, 2 * n, device=DEVICE).bfloat16()
    grad_h = torch.randn(m, n, device=DEVICE).bfloat16()
    grad_h[3, 4] = float("nan")
    got = swiglu_backward(grad_h, gate_up)
    gate, up = gate_up.double().split(n, dim=1)
    gate.requires_grad_(), up.requires_grad_()
    (F.silu(gate) * up).backward(grad_h.double())
    ref = torch.cat([gate.grad, up.grad], 1)
    assert got[3, 4].isnan() and got[3, n + 4].isnan()
    ok = ~ref.isnan()
    torch.testing.assert_close(got.double()[ok], ref[ok], rtol=2**-7, atol=1e-3)


def weighted_problem(m: int = 70, n: int = 48, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_h, gate_up, pair_weights)``: random rows and routing weights in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    grad_h = torch.randn(m, n, generator=gen).bfloat16()
    gate_up = (torch.randn(m, 2 * n, generator=gen) * 3).bfloat16()
    return grad_h.to(DEVICE), gate_up.to(DEVICE), torch.rand(m, generator=gen).to(DEVICE)


def weight_grad_reference(grad_h: torch.Tensor, gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(<grad_h, h>, sum |grad_h * h|)`` per row in float64, ``h = silu(gate) * up`` rounded to bf16."""
    gate, up = gate_up.double().chunk(2, dim=1)
    h = (gate * torch.sigmoid(gate) * up).bfloat16().double()
    products = grad_h.double() * h
    return products.sum(dim=1), products.abs().sum(dim=1)


def assert_weight_grads_close(got: torch.Tensor, grad_h: torch.Tensor, gate_up: torch.Tensor) -> None:
    """Within a bf16 unit of ``h`` per element (Triton's CPU interpreter rounds toward zero where PyTorch
    rounds to nearest), bounded by the row's ``sum |grad_h * h|``, plus float32 summation."""
    expected, scale = weight_grad_reference(grad_h, gate_up)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert ((got.double() - expected).abs() <= 2**-7 * scale + 1e-5).all()
    assert expected.abs().amax() > 0


def test_swiglu_backward_weighted_with_unit_weights_is_swiglu_backward(monkeypatch):
    """Weights 1: ``grad_gate_up`` bitwise ``swiglu_backward`` (the product by 1 rounds to itself), the
    weights' gradient ``<grad_h, h>``; outputs poisoned (an element no program writes shows)."""
    grad_h, gate_up, _ = weighted_problem()
    expected = swiglu_backward(grad_h, gate_up)
    poison_torch_empty(monkeypatch)
    got, weight_grads = swiglu_backward_weighted(grad_h, gate_up, torch.ones(70, device=DEVICE))
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    assert_weight_grads_close(weight_grads, grad_h, gate_up)


def test_swiglu_backward_weighted_matches_plain_pytorch():
    """``grad_gate_up`` is SwiGLU's backward of ``grad_h * w`` (within two bf16 units: that product's rounding
    and the output's), and the weights' gradient that of the product before the weight: doubling a weight
    leaves it as it is, a zero weight zeroes its row of ``grad_gate_up``."""
    grad_h, gate_up, weights = weighted_problem()
    got, weight_grads = swiglu_backward_weighted(grad_h, gate_up, weights)
    expected = swiglu_backward((grad_h.float() * weights[:, None]).bfloat16(), gate_up)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-6, atol=1e-3 * float(expected.abs().amax()))
    assert_weight_grads_close(weight_grads, grad_h, gate_up)
    changed = weights.clone()
    changed[3], changed[5] = 0.0, changed[5] * 2
    got2, weight_grads2 = swiglu_backward_weighted(grad_h, gate_up, changed)
    assert torch.equal(weight_grads2, weight_grads)
    assert not got2[3].any() and got[3].any() and not torch.equal(got2[5], got[5])
    others = [i for i in range(70) if i not in (3, 5)]
    assert torch.equal(got2[others], got[others])


def test_swiglu_backward_weighted_sums_a_row_over_several_column_tiles():
    """Rows wider than a column tile (H = 600: 3 tiles of 256, one partial): each tile's part is summed."""
    from autotune_cache import forced_config
    from kernels_helion.swiglu import DEFAULT_CONFIG

    grad_h, gate_up, weights = weighted_problem(9, 600)
    config = helion.Config(**{**DEFAULT_CONFIG.config, "block_sizes": [4, 256]})
    with forced_config("swiglu_backward_weighted", config):
        got, weight_grads = swiglu_backward_weighted(grad_h, gate_up, weights)
    assert_weight_grads_close(weight_grads, grad_h, gate_up)
    expected = swiglu_backward((grad_h.float() * weights[:, None]).bfloat16(), gate_up)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-6, atol=1e-3 * float(expected.abs().amax()))


def test_swiglu_backward_weighted_nan_reaches_only_its_rows():
    """NaN in a row of ``grad_h`` and in a ``gate``: those rows and their weights' gradients; NaN in a weight:
    its row of ``grad_gate_up`` only (the weight's gradient does not read the weight)."""
    grad_h, gate_up, weights = weighted_problem(24, 32)
    grad_h[2, 7] = float("nan")
    gate_up[9, 40] = float("nan")
    weights[15] = float("nan")
    got, weight_grads = swiglu_backward_weighted(grad_h, gate_up, weights)
    assert got.isnan().any(dim=1).nonzero().flatten().tolist() == [2, 9, 15]
    assert weight_grads.isnan().nonzero().flatten().tolist() == [2, 9]


def test_swiglu_backward_weighted_empty_and_bad_input():
    grad_h, gate_up, weights = weighted_problem(12, 16)
    got, weight_grads = swiglu_backward_weighted(grad_h[:0], gate_up[:0], weights[:0])
    assert got.shape == (0, 32) and weight_grads.shape == (0,) and weight_grads.dtype == torch.float32
    with pytest.raises(ValueError, match=r"pair_weights must have shape \(12,\)"):
        swiglu_backward_weighted(grad_h, gate_up, weights[:5])
    with pytest.raises(TypeError, match="pair_weights must have dtype"):
        swiglu_backward_weighted(grad_h, gate_up, weights.bfloat16())
    with pytest.raises(ValueError, match=r"gate_up must be \(M, 2 \* H\)"):
        swiglu_backward_weighted(grad_h, gate_up[:, :16].contiguous(), weights)


def swiglu_quantized_problem(m: int, n: int, sizes: list[int], dtype: torch.dtype = torch.bfloat16):
    """``(grad_h, gate_up, offs, row_multipliers)``: random values, multipliers like weight scales (spread widely)."""
    grad_h = torch.randn(m, n, device=DEVICE).to(dtype)
    gate_up = (torch.randn(m, 2 * n, device=DEVICE) * 3).to(dtype)
    multipliers = torch.rand(len(sizes), 2 * n, device=DEVICE) ** 4 * 10 + 1e-4
    return grad_h, gate_up, offsets_from_sizes(sizes), multipliers


def assert_swiglu_quantized_is_the_two_kernels(got, grad_h, gate_up, offs, multipliers, float8_dtype, round_scales):
    grad_gate_up, data, scales = got
    ref = swiglu_backward(grad_h, gate_up)
    ref_data, ref_scales = quantize_rowwise_rows(
        ref, float8_dtype, round_scales, offs=offs, row_multipliers=multipliers
    )
    assert grad_gate_up.dtype == grad_h.dtype and data.dtype == float8_dtype and scales.dtype == torch.float32
    assert torch.equal(grad_gate_up.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))
    assert torch.equal(scales.view(torch.int32), ref_scales.view(torch.int32))


@pytest.mark.parametrize("float8_dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
@pytest.mark.parametrize("round_scales", [False, True])
@pytest.mark.parametrize("sizes", [[20, 0, 1, 40], [7, 33, 0]], ids=["empty-one-tail", "unaligned-tail"])
def test_swiglu_backward_quantized_is_the_two_kernels(monkeypatch, float8_dtype, round_scales, sizes):
    """Bitwise ``swiglu_backward`` + ``quantize_rowwise_rows(..., offs=, row_multipliers=)``: empty groups, a
    one-row group, rows past ``offs[-1]`` (multiplier 1), H not a multiple of the column tiles."""
    m, n = 70, 48
    problem = swiglu_quantized_problem(m, n, sizes)
    poison_torch_empty(monkeypatch)  # an element no program writes shows as NaN / 0xFF
    got = swiglu_backward_quantized(*problem, float8_dtype, round_scales)
    assert_swiglu_quantized_is_the_two_kernels(got, *problem, float8_dtype, round_scales)
    # The rows past offs[-1] are quantized as they are.
    tail = sum(sizes)
    tail_data, tail_scales = quantize_rowwise_rows(got[0][tail:].contiguous(), float8_dtype, round_scales)
    assert torch.equal(got[1][tail:].view(torch.uint8), tail_data.view(torch.uint8))
    assert torch.equal(got[2][tail:], tail_scales)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_swiglu_backward_quantized_other_dtypes(dtype):
    problem = swiglu_quantized_problem(37, 32, [10, 27], dtype)
    got = swiglu_backward_quantized(*problem)
    assert_swiglu_quantized_is_the_two_kernels(got, *problem, torch.float8_e4m3fn, False)


def test_swiglu_backward_quantized_tiles_a_row_over_several_column_tiles():
    """Rows wider than a column tile: the amax spans every tile of a row (H = 600: 3 tiles of 256, one partial)."""
    from autotune_cache import forced_config
    from kernels_helion.swiglu import QUANTIZED_CONFIG

    problem = swiglu_quantized_problem(9, 600, [4, 5])
    problem[1][2, 1000] = 5e3  # the row's amax in the up half's third tile
    config = helion.Config(**{**QUANTIZED_CONFIG.config, "block_sizes": [4, 256, 128]})
    with forced_config("swiglu_backward_quantized", config):
        got = swiglu_backward_quantized(*problem)
    assert_swiglu_quantized_is_the_two_kernels(got, *problem, torch.float8_e4m3fn, False)


def test_swiglu_backward_quantized_nan_reaches_only_its_row():
    problem = swiglu_quantized_problem(24, 32, [10, 14])
    problem[0][5, 7] = float("nan")
    grad_gate_up, data, scales = got = swiglu_backward_quantized(*problem)
    assert_swiglu_quantized_is_the_two_kernels(got, *problem, torch.float8_e4m3fn, False)
    nan_rows = grad_gate_up.isnan().any(dim=1) | data.float().isnan().any(dim=1)
    assert nan_rows.nonzero().flatten().tolist() == [5]
    assert grad_gate_up[5, 7].isnan() and grad_gate_up[5, 32 + 7].isnan()
    assert scales[5] == float("inf") and scales[torch.arange(24) != 5].isfinite().all()


def test_swiglu_backward_quantized_takes_no_rows():
    grad_h, gate_up, offs, multipliers = swiglu_quantized_problem(0, 48, [0, 0])
    grad_gate_up, data, scales = swiglu_backward_quantized(grad_h, gate_up, offs, multipliers, torch.float8_e4m3fnuz)
    assert grad_gate_up.shape == data.shape == (0, 96) and scales.shape == (0,)
    assert (grad_gate_up.dtype, data.dtype, scales.dtype) == (torch.bfloat16, torch.float8_e4m3fnuz, torch.float32)


def test_swiglu_backward_quantized_bad_input():
    grad_h, gate_up, offs, multipliers = swiglu_quantized_problem(12, 16, [5, 7])
    with pytest.raises(TypeError, match="grad_h must have dtype"):
        swiglu_backward_quantized(grad_h.to(torch.int32), gate_up, offs, multipliers)
    with pytest.raises(TypeError, match="gate_up must have dtype"):
        swiglu_backward_quantized(grad_h, gate_up.float(), offs, multipliers)
    with pytest.raises(ValueError, match=r"gate_up must be \(M, 2 \* H\)"):
        swiglu_backward_quantized(grad_h, gate_up[:, :16].contiguous(), offs, multipliers)
    with pytest.raises(ValueError, match="gate_up must be contiguous"):
        swiglu_backward_quantized(grad_h, gate_up.T.contiguous().T, offs, multipliers)
    with pytest.raises(ValueError, match="at least one column"):
        swiglu_backward_quantized(grad_h[:, :0], gate_up[:, :0], offs, multipliers[:, :0])
    with pytest.raises(TypeError, match="offs must have dtype"):
        swiglu_backward_quantized(grad_h, gate_up, offs.long(), multipliers)
    with pytest.raises(ValueError, match="offs must hold at least one group end"):
        swiglu_backward_quantized(grad_h, gate_up, offs[:0], multipliers)
    with pytest.raises(ValueError, match=r"row_multipliers must have shape \(2, 32\)"):
        swiglu_backward_quantized(grad_h, gate_up, offs, multipliers[:, :16].contiguous())
    with pytest.raises(TypeError, match="row_multipliers must have dtype"):
        swiglu_backward_quantized(grad_h, gate_up, offs, multipliers.bfloat16())
    with pytest.raises(TypeError, match="float8_dtype must be one of"):
        swiglu_backward_quantized(grad_h, gate_up, offs, multipliers, torch.bfloat16)


def test_split_dgrad_is_one_contraction():
    m, k_lo, k_hi, n, e = 70, 48, 32, 64, 3
    a, sa = fp8_operand(m, k_lo + k_hi)
    b_lo, sb = fp8_operand(e, n, k_lo)
    b_hi, _ = fp8_operand(e, n, k_hi)
    offs = offsets_from_sizes([20, 1, 43])
    got = grouped_mm_2d3d_split(a, sa, b_lo, b_hi, sb, offs)
    ref = grouped_mm_2d3d(a, sa, torch.cat([b_lo, b_hi], dim=2).contiguous(), sb, offs)
    assert_close_bf16(got, ref)
    assert (got[64:] == 0).all()
    with pytest.raises(ValueError, match="split a's 80 columns"):
        grouped_mm_2d3d_split(a, sa, b_lo, b_lo, sb, offs)


def test_token_groups_transpose_gathers_rows():
    t, _ = fp8_operand(23, 32)
    rows = torch.randint(0, 23, (50,), device=DEVICE)
    offs = offsets_from_sizes([17, 0, 30])
    got = transpose_to_token_groups(t, offs, 16, rows=rows)
    ref = transpose_to_token_groups(t[rows].contiguous(), offs, 16)
    assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))


def test_opcheck_fused_layer_ops():
    """Schema, fake implementations and aot_dispatch of the fused up-projection's own ops."""
    a, sa = fp8_operand(12, 32)
    bg, sg = fp8_operand(3, 16, 32)
    bu, su = fp8_operand(3, 16, 32)
    rows = torch.randint(0, 12, (30,), dtype=torch.int32, device=DEVICE)
    offs = offsets_from_sizes([10, 0, 17])
    opcheck_fp8(torch.ops.fp8moe.grouped_mm_swiglu, (a, sa, rows, bg, sg, bu, su, offs, torch.bfloat16))
    grad_h = torch.randn(30, 16, device=DEVICE).bfloat16()
    gate_up = torch.randn(30, 32, device=DEVICE).bfloat16()
    opcheck_fp8(torch.ops.fp8moe.swiglu_backward, (grad_h, gate_up))
    opcheck_fp8(torch.ops.fp8moe.swiglu_backward_weighted, (grad_h, gate_up, torch.rand(30, device=DEVICE)))
    multipliers = torch.rand(3, 32, device=DEVICE) + 0.5
    for float8_dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        args = (grad_h, gate_up, offs, multipliers, float8_dtype, True)
        opcheck_fp8(torch.ops.fp8moe.swiglu_backward_quantized, args)
    # The down-projection's dgrad on token rows: the GEMM reading a's rows by index, and the column
    # form of gathered rows alone.
    bt, st = fp8_operand(3, 16, 32)
    opcheck_fp8(torch.ops.fp8moe.grouped_mm_2d3d, (a, sa, bt, st, offs, torch.bfloat16, rows))
    grad = torch.randn(12, 16, device=DEVICE).bfloat16()
    weights = torch.rand(30, device=DEVICE)
    args = (grad, offs, torch.float8_e4m3fn, False, 128, torch.rand(30, device=DEVICE) + 0.5, rows, weights)
    opcheck_fp8(torch.ops.fp8moe.quantize_rowwise_cols_grouped, args)


# --- the layer -------------------------------------------------------------------------------


def moe_pair(dim=64, hidden=48, experts=4, top_k=3, seed=0):
    """``(fused, unfused, bf16)`` MoE layers with the same router and weights (separate copies)."""
    torch.manual_seed(seed)
    bf16 = ops.MoE(dim, hidden, experts, top_k, device=DEVICE)
    fused, unfused = copy.deepcopy(bf16), copy.deepcopy(bf16)
    ops.convert_to_fp8(fused.experts)
    ops.convert_to_fp8(unfused.experts, UNFUSED)
    return fused, unfused, bf16


@pytest.mark.cuda
@pytest.mark.parametrize("experts_kind", ["fp8 fused", "bf16"])
def test_moe_layer_step_captures_in_a_cuda_graph(experts_kind):
    """A whole ``ops.MoE`` step (router, top-k, sort, experts with their FP8 weights made in the step,
    combine; backward into x and every weight) captures in one CUDA graph: nothing syncs with the host.
    Replayed on a new input, whose routing gives other group sizes, it equals an eager step on that
    input bit for bit (``benchmarks.moe_layer --cuda-graph`` times such replays)."""
    torch.manual_seed(0)
    tokens, dim, hidden, experts, top_k = 512, 256, 128, 8, 2
    layer = ops.MoE(dim, hidden, experts, top_k, device=DEVICE)
    if experts_kind == "fp8 fused":
        ops.convert_to_fp8(layer.experts)
    else:
        layer = layer.bfloat16()
    eager = copy.deepcopy(layer)
    params = list(layer.parameters())
    x = torch.randn(tokens, dim, device=DEVICE).bfloat16().requires_grad_()
    grad = torch.randn(tokens, dim, device=DEVICE).bfloat16()

    def step() -> torch.Tensor:
        for p in params:
            p.grad = None
        x.grad = None
        ops.release_quantized_weights()  # the FP8 weights are made inside the step, as after an optimizer step
        out = layer(x)
        out.backward(grad)
        return out

    graph, out = capture_step(step)
    x_new = torch.randn(tokens, dim, device=DEVICE).bfloat16() * 3
    grad_new = torch.randn(tokens, dim, device=DEVICE).bfloat16()
    with torch.no_grad():
        x.copy_(x_new)
        grad.copy_(grad_new)
    graph.replay()
    xe = x_new.clone().requires_grad_()
    expected = eager(xe)
    expected.backward(grad_new)
    assert torch.equal(out, expected)
    assert torch.equal(x.grad, xe.grad)
    for (name, p), pe in zip(layer.named_parameters(), eager.parameters(), strict=True):
        assert torch.equal(p.grad, pe.grad), name


def layer_grads(layer, x, top_probs, top_experts, grad):
    x = x.clone().requires_grad_()
    probs = top_probs.clone().requires_grad_()
    out = layer.apply_experts(x, probs, top_experts)
    out.backward(grad)
    e = layer.experts
    return {"out": out, "dx": x.grad, "dprobs": probs.grad, "dw1": e.w1.grad, "dw2": e.w2.grad, "dw3": e.w3.grad}


@pytest.mark.parametrize("tokens", [37, 1])
def test_fused_layer_matches_unfused_and_bf16(tokens):
    """Every output and gradient of the fused layer is as close to bf16 as the unfused layer's, and near it.

    Not bitwise: the fused path rounds ``h`` once (the unfused eager SwiGLU rounds silu(gate) and the
    product), sums dgrad's two products in one accumulator (the unfused path adds two bf16 outputs) and
    reads the tokens' one quantization. Experts that get 0 and 1 pairs, and an expert chosen twice by a
    token, are in the routing.
    """
    fused, unfused, bf16 = moe_pair()
    x = torch.randn(tokens, 64, device=DEVICE).bfloat16()
    top_experts = torch.randint(1, 3, (tokens, 3), device=DEVICE)  # experts 1 and 2 only: 0 and 3 get none
    top_experts[0] = torch.tensor([2, 2, 3])  # expert 2 chosen twice; expert 3 gets one pair
    top_probs = torch.rand(tokens, 3, device=DEVICE).softmax(-1)
    grad = torch.randn(tokens, 64, device=DEVICE).bfloat16()
    got = {name: layer_grads(m, x, top_probs, top_experts, grad) for name, m in
           (("fused", fused), ("unfused", unfused), ("bf16", bf16))}
    for key in got["bf16"]:
        ref = got["bf16"][key]
        if key in ("dw1", "dw3"):
            assert got["fused"][key][0].abs().max() == 0, "an expert with no pairs gets a zero gradient"
        for name in ("fused", "unfused"):
            assert not got[name][key].isnan().any()
        fused_db, unfused_db = sqnr_db(got["fused"][key], ref), sqnr_db(got["unfused"][key], ref)
        # A few numbers (one token's three routing gradients, each a 64-term dot product with
        # cancellation) carry FP8's noise unaveraged: only the comparison with the unfused path holds.
        floor = 20 if ref.numel() >= 64 else 0
        assert fused_db > floor and fused_db > unfused_db - 2, (key, fused_db, unfused_db)
        assert sqnr_db(got["fused"][key], got["unfused"][key]) > floor + 5, key


def test_fused_layer_takes_no_tokens():
    fused, _, _ = moe_pair()
    x = torch.randn(0, 64, device=DEVICE).bfloat16().requires_grad_()
    out = fused(x)
    out.float().sum().backward()
    assert out.shape == (0, 64) and x.grad.shape == (0, 64)
    for w in (fused.experts.w1, fused.experts.w2, fused.experts.w3):
        assert w.grad is not None and (w.grad == 0).all()


def test_fused_layer_is_deterministic_and_keeps_fp8_rows_of_the_tokens():
    fused, unfused, _ = moe_pair()
    x = torch.randn(40, 64, device=DEVICE).bfloat16()
    probs, experts = (t.detach() for t in fused.route(x))
    grad = torch.randn(40, 64, device=DEVICE).bfloat16()
    first = layer_grads(fused, x, probs, experts, grad)
    fused.zero_grad(set_to_none=True)
    second = layer_grads(fused, x, probs, experts, grad)
    for key in first:
        assert torch.equal(first[key], second[key]), key
    saved = {name: ops.saved_tensor_bytes(m.apply_experts, x, probs, experts, exclude=list(m.parameters()))
             for name, m in (("fused", fused), ("unfused", unfused))}
    assert saved["fused"] < saved["unfused"]


@pytest.mark.whole_suite_only
def test_fused_layer_without_saved_fp8_weights_is_bitwise_the_same():
    fused, _, _ = moe_pair()
    lean = copy.deepcopy(fused)
    lean.experts.recipe = ops.Fp8Recipe(save_fp8_weight=False)
    x = torch.randn(30, 64, device=DEVICE).bfloat16()
    probs, experts = (t.detach() for t in fused.route(x))
    grad = torch.randn(30, 64, device=DEVICE).bfloat16()
    a, b = layer_grads(fused, x, probs, experts, grad), layer_grads(lean, x, probs, experts, grad)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_fused_layer_nan_in_a_token_reaches_its_rows_and_its_experts():
    fused, _, _ = moe_pair()
    x = torch.randn(24, 64, device=DEVICE).bfloat16()
    x[9, 3] = float("nan")
    probs, experts = (t.detach().clone() for t in fused.route(torch.randn(24, 64, device=DEVICE).bfloat16()))
    experts[9] = torch.tensor([0, 1, 1])
    experts[experts == 0] = 2
    experts[9, 0] = 0  # only token 9 goes to expert 0
    got = layer_grads(fused, x, probs, experts, torch.randn(24, 64, device=DEVICE).bfloat16())
    rows_nan = got["out"].isnan().any(dim=1)
    assert rows_nan[9] and not rows_nan[torch.arange(24, device=DEVICE) != 9].any()
    assert got["dw1"][0].isnan().any() and not got["dw1"][3].isnan().any()


def test_fused_weights_quantized_once_per_reuse_block(monkeypatch):
    """Inside ``ops.reuse_quantized_weights()`` the fused path quantizes each weight once for all micro-batches."""
    from ops import op_registry

    fused, _, _ = moe_pair()
    calls = []
    for name in ("quantize_rowwise_expert_weights", "quantize_rowwise_expert_weights_and_transpose"):
        real = op_registry._functions[name]
        monkeypatch.setitem(
            op_registry._functions, name, lambda *a, real=real, **kw: calls.append(a[0].shape) or real(*a, **kw)
        )
    x = torch.randn(16, 64, device=DEVICE).bfloat16().requires_grad_()
    with ops.reuse_quantized_weights():
        for _ in range(3):
            fused(x).float().sum().backward()
    assert len(calls) == 3  # w1, w3 (fused up-projection) and w2, each once (forward and dgrad forms)


def test_fused_bad_input():
    from ops.moe_fused import swiglu_up_projection

    fused, _, _ = moe_pair()
    e = fused.experts
    x = torch.randn(8, 64, device=DEVICE).bfloat16()
    offs = offsets_from_sizes([4, 4, 4, 4])
    rows = torch.arange(16, device=DEVICE, dtype=torch.int32) % 8
    inverse = torch.arange(16, device=DEVICE).view(8, 2)
    with pytest.raises(ValueError, match="rows and inverse go together"):
        swiglu_up_projection(x, (e.w1, e.w3), offs, e.recipe, rows=rows)
    with pytest.raises(ValueError, match="rows must be a 1-D int32"):
        swiglu_up_projection(x, (e.w1, e.w3), offs, e.recipe, rows=rows.long(), inverse=inverse)
    with pytest.raises(ValueError, match=r"inverse must be \(T, k\)"):
        swiglu_up_projection(x, (e.w1, e.w3), offs, e.recipe, rows=rows, inverse=inverse.view(4, 4))
    with pytest.raises(ValueError, match="fused_experts"):
        swiglu_up_projection(x, (e.w1, e.w3), offs, UNFUSED, rows=rows, inverse=inverse)
    with pytest.raises(ValueError, match="w3 must have w1's shape"):
        swiglu_up_projection(x, (e.w1, e.w1[:, :32].contiguous()), offs, e.recipe, rows=rows, inverse=inverse)
    with pytest.raises(ValueError, match="routing .* needs experts with takes_routed_tokens"):
        ops.GroupedExperts(64, 48, 4, device=DEVICE)(x, torch.full((4,), 4, device=DEVICE), routing=(rows, inverse))


class _CombineApart(ops.Fp8GroupedExperts):
    """The fused experts without the combine: ``ops.MoE`` runs ``ops.moe.combine_pairs`` after them."""

    takes_combine = False


class _GradientOfH(ops.Fp8GroupedExperts):
    """The fused experts with ``down_projection_combine`` given ``h`` alone: the gradient reaches ``h`` (weighted
    rows in the dgrad) and SwiGLU's backward runs in the up-projection's; the combine's rows are kept for the
    probabilities' gradient (``moe_combine_grad_probs``)."""

    def swiglu_down_projection_combine(self, x, offs, combine, x_fp8=None, routing=None):
        h = self.swiglu(x, offs, x_fp8=x_fp8, routing=routing)
        return ops.modules.down_projection_combine(h, self.w2, offs, self.recipe, *combine)


def _count_calls(monkeypatch, counts: dict[str, int], name: str, owner: object, attribute: str, registry: bool = False):
    """Count the calls of ``owner.attribute`` (``owner[attribute]`` if ``registry``) under ``counts[name]``."""
    real = owner[attribute] if registry else getattr(owner, attribute)

    def counted(*args, **kwargs):
        counts[name] += 1
        return real(*args, **kwargs)

    (monkeypatch.setitem if registry else monkeypatch.setattr)(owner, attribute, counted)


@pytest.mark.parametrize("wgrad_precision", ["fp8", "bf16"])
def test_down_projection_combine_is_the_combine_apart(monkeypatch, wgrad_precision):
    """``ops.MoE`` with the combine in the down-projection's op (``down_projection_combine`` given ``h`` alone:
    ``_GradientOfH``) against the same layer whose experts leave it to ``combine_pairs``: output, ``x.grad`` and every
    parameter's gradient (the router's: the probabilities' gradient) bitwise the same. With the FP8 wgrad the
    fused backward reads the combine's gradient rows by index (no ``moe_combine_grad_rows``); with the bf16
    wgrad it writes them out as the combine apart does."""
    from ops import op_registry

    torch.manual_seed(0)
    fused = ops.MoE(64, 32, 4, 2, device=DEVICE)
    recipe = ops.Fp8Recipe(wgrad_precision=wgrad_precision)
    ops.convert_to_fp8(fused, recipe, filter_fn=lambda m, fqn: "experts" in fqn)
    fused.experts.__class__ = _GradientOfH
    apart = copy.deepcopy(fused)
    apart.experts.__class__ = _CombineApart
    assert fused.experts.takes_combine and apart.experts.takes_routed_tokens and not apart.experts.takes_combine
    assert type(fused.router) is torch.nn.Linear
    counts = {"moe_combine_grad_rows": 0, "down_projection_combine": 0, "combine_pairs": 0}
    _count_calls(monkeypatch, counts, "moe_combine_grad_rows", op_registry._functions, "moe_combine_grad_rows", registry=True)
    _count_calls(monkeypatch, counts, "down_projection_combine", ops.modules, "down_projection_combine")
    _count_calls(monkeypatch, counts, "combine_pairs", ops.moe, "combine_pairs")
    x = torch.randn(40, 64, device=DEVICE).bfloat16()
    grad = torch.randn(40, 64, device=DEVICE).bfloat16()
    got, launches = {}, {}
    for name, layer in (("fused", fused), ("apart", apart)):
        counts.update(dict.fromkeys(counts, 0))
        xx = x.clone().requires_grad_()
        out = layer(xx)
        out.backward(grad)
        launches[name] = dict(counts)
        got[name] = {"out": out, "dx": xx.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    assert set(got["fused"]) == {"out", "dx", "router.weight", "experts.w1", "experts.w2", "experts.w3"}
    for key, value in got["fused"].items():
        assert value is not None and not value.isnan().any(), key
        assert torch.equal(value, got["apart"][key]), key
    assert got["fused"]["router.weight"].abs().amax() > 0
    # The paths: the combine in the down-projection's op, or apart after the experts.
    assert launches["fused"]["down_projection_combine"] == 1 and launches["fused"]["combine_pairs"] == 0
    assert launches["apart"]["down_projection_combine"] == 0 and launches["apart"]["combine_pairs"] == 1
    assert launches["apart"]["moe_combine_grad_rows"] >= 1
    if wgrad_precision == "fp8":
        assert launches["fused"]["moe_combine_grad_rows"] == 0  # the rows read by index
    else:
        assert launches["fused"]["moe_combine_grad_rows"] >= 1  # written out: the bf16 wgrad reads them
        return
    # Routing weights given in bf16 (apply_experts takes them as combine_pairs did): the same again.
    probs, experts = (t.detach() for t in fused.route(x))
    probs = probs.bfloat16().requires_grad_()
    results = []
    for layer in (fused, apart):
        xx, pp = x.clone().requires_grad_(), probs.detach().clone().requires_grad_()
        layer.apply_experts(xx, pp, experts).backward(grad)
        results.append((xx.grad, pp.grad))
    assert results[0][1].dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("wgrad_precision", ["fp8", "bf16"])
def test_swiglu_backward_in_the_down_projection_backward(monkeypatch, wgrad_precision):
    """The default fused experts hand ``down_projection_combine`` the up-projection's ``gate_up``: the dgrad reads
    each pair's gradient row before its routing weight and ``swiglu_backward_weighted`` applies the weight and
    makes the probabilities' gradient ``<u, h>``. Against ``RowwiseOptions.fused_swiglu_backward`` (the same in
    the dgrad's epilogue, ``grouped_mm_swiglu_backward``) and against ``h``'s gradient path (``_GradientOfH``:
    weighted dgrad rows, SwiGLU's backward in the up-projection, the combine's rows kept for
    ``moe_combine_grad_probs``).

    The output and ``w2``'s gradient are bitwise the same in all three (same forward, same wgrad operands).
    The kernel and the epilogue differ only in ``u``'s rounding to bf16 between the dgrad and SwiGLU's
    backward (which the FP8 roundings after it can enlarge to an FP8 unit): within 34 dB of each other
    (measured 37.6-46.9 dB on CPU). Against ``h``'s gradient path the
    other gradients differ by FP8 rounding (the weight multiplies after the quantization): within 28 dB
    (measured 31-37), and as close to the bf16 layer as it is (within 1.5 dB). Neither the kernel nor the
    epilogue keeps the combine's rows ``y (T * k, dim)``."""
    from ops import op_registry
    from ops.memory import saved_tensor_bytes

    torch.manual_seed(0)
    tokens, dim, top_k = 40, 64, 2
    bf16 = ops.MoE(dim, 32, 4, top_k, device=DEVICE)
    layers = {}
    for name, options in (("kernel", ops.RowwiseOptions()), ("epilogue", ops.RowwiseOptions(fused_swiglu_backward=True))):
        layers[name] = copy.deepcopy(bf16)
        recipe = ops.Fp8Recipe(wgrad_precision=wgrad_precision, options=options)
        ops.convert_to_fp8(layers[name], recipe, filter_fn=lambda m, fqn: "experts" in fqn)
    layers["h gradient"] = copy.deepcopy(layers["kernel"])
    layers["h gradient"].experts.__class__ = _GradientOfH
    layers["bf16"] = bf16.bfloat16()
    names = (
        "swiglu_backward", "swiglu_backward_quantized", "swiglu_backward_weighted", "moe_combine_grad_probs",
        "grouped_mm_swiglu_backward",
    )
    counts = dict.fromkeys(names, 0)
    for name in names:
        _count_calls(monkeypatch, counts, name, op_registry._functions, name, registry=True)
    x = torch.randn(tokens, dim, device=DEVICE).bfloat16()
    grad = torch.randn(tokens, dim, device=DEVICE).bfloat16()
    got, launches, saved = {}, {}, {}
    for name, layer in layers.items():
        counts.update(dict.fromkeys(counts, 0))
        xx = x.clone().requires_grad_()
        out = layer(xx)
        out.backward(grad)
        launches[name] = dict(counts)
        got[name] = {"out": out, "dx": xx.grad, **{n: p.grad for n, p in layer.named_parameters()}}
        saved[name] = saved_tensor_bytes(layer, x.clone().requires_grad_(), exclude=list(layer.parameters()))
    assert launches["kernel"] == {**dict.fromkeys(names, 0), "swiglu_backward_weighted": 1}
    assert launches["epilogue"] == {**dict.fromkeys(names, 0), "grouped_mm_swiglu_backward": 1}
    assert launches["h gradient"]["swiglu_backward_weighted"] == 0 and launches["h gradient"]["moe_combine_grad_probs"] == 1
    for other in ("epilogue", "h gradient"):
        assert torch.equal(got["kernel"]["out"], got[other]["out"])
        assert torch.equal(got["kernel"]["experts.w2"], got[other]["experts.w2"])
    for key in ("dx", "router.weight", "experts.w1", "experts.w3"):
        value = got["kernel"][key]
        assert not value.isnan().any() and not torch.equal(value, got["h gradient"][key]), key
        assert sqnr_db(value, got["epilogue"][key]) > 34, key
        assert sqnr_db(value, got["h gradient"][key]) > 28, key
        assert sqnr_db(value, got["bf16"][key]) > sqnr_db(got["h gradient"][key], got["bf16"][key]) - 1.5, key
    # y (T * k, dim) in bf16 is not kept.
    assert saved["kernel"] == saved["epilogue"]
    assert saved["h gradient"] - saved["kernel"] >= tokens * top_k * dim * 2


@pytest.mark.parametrize("wgrad_precision", ["fp8", "bf16"])
def test_down_dgrad_on_token_rows(monkeypatch, wgrad_precision):
    """``RowwiseOptions.down_dgrad_token_rows``: ``w2``'s dgrad reads the output gradient's token rows, each
    quantized rowwise once, by index (``grouped_mm_2d3d(..., rows=)``), against ``w2`` quantized along
    ``N``; the FP8 wgrad's column form of the pair rows comes from the two passes without their rowwise
    part (``quantize_rowwise_cols_grouped(..., pair_tokens=)``; ``down_wgrad_token_rows=False``, checked in
    ``tests/test_down_dgrad_token_rows.py``). Against the folded form: the output
    and ``w2``'s gradient bitwise the same (same forward form of ``w2``, same wgrad operands); the other
    gradients differ by the dgrad's FP8 rounding (unfolded against folded: measured 25-28 dB apart on
    CPU, each 23-26 dB from the bf16 layer's) and are as close to the bf16 layer (within 1.5 dB). With
    ``fused_swiglu_backward`` the option leaves the folded dgrad in place."""
    check_token_rows_against_folded(monkeypatch, 40, 64, 32, 4, 2, wgrad_precision)


@pytest.mark.cuda
@pytest.mark.parametrize("tokens, dim, hidden, experts", [(8192, 2048, 768, 128), (4096, 7168, 2048, 32)])
def test_down_dgrad_on_token_rows_at_real_shapes(monkeypatch, tokens, dim, hidden, experts):
    """``test_down_dgrad_on_token_rows`` at a Qwen3-30B-like and a DeepSeek-V3-like width, FP8 wgrad, top-8."""
    check_token_rows_against_folded(monkeypatch, tokens, dim, hidden, experts, 8, "fp8")


def check_token_rows_against_folded(monkeypatch, tokens, dim, hidden, experts, top_k, wgrad_precision) -> None:
    """One ``ops.MoE`` step with ``down_dgrad_token_rows`` (alone, and with ``fused_swiglu_backward``) against
    the folded form and bf16: which kernels ran, what is bitwise the same, how close the rest is."""
    torch.manual_seed(0)
    bf16 = ops.MoE(dim, hidden, experts, top_k, device=DEVICE)
    layers = {}
    for name, options in (
        ("folded", ops.RowwiseOptions(down_dgrad_token_rows=False)),
        ("token rows", ops.RowwiseOptions(down_dgrad_token_rows=True, down_wgrad_token_rows=False)),
        ("token rows, epilogue", ops.RowwiseOptions(down_dgrad_token_rows=True, fused_swiglu_backward=True)),
    ):
        layers[name] = copy.deepcopy(bf16)
        recipe = ops.Fp8Recipe(wgrad_precision=wgrad_precision, options=options)
        ops.convert_to_fp8(layers[name], recipe, filter_fn=lambda m, fqn: "experts" in fqn)
    layers["bf16"] = bf16.bfloat16()
    calls = record_kernel_calls(monkeypatch, ("grouped_mm_2d3d", "quantize_rowwise_cols_grouped",
                                              "quantize_rowwise_rows_and_cols_grouped", "grouped_mm_swiglu_backward"))
    x = torch.randn(tokens, dim, device=DEVICE).bfloat16()
    grad = torch.randn(tokens, dim, device=DEVICE).bfloat16()
    got, launches = {}, {}
    for name, layer in layers.items():
        for recorded_calls in calls.values():
            recorded_calls.clear()
        xx = x.clone().requires_grad_()
        out = layer(xx)
        out.backward(grad)
        got[name] = {"out": out, "dx": xx.grad, **{n: p.grad for n, p in layer.named_parameters()}}
        # (dgrads on token rows, gathered column forms alone, rows-and-cols quantizations, epilogue dgrads)
        launches[name] = (
            sum(1 for args in calls["grouped_mm_2d3d"] if len(args) > 6 and args[6] is not None),
            sum(1 for args in calls["quantize_rowwise_cols_grouped"] if len(args) > 6),
            len(calls["quantize_rowwise_rows_and_cols_grouped"]),
            len(calls["grouped_mm_swiglu_backward"]),
        )
    fp8_wgrad = int(wgrad_precision == "fp8")
    assert launches["token rows"] == (1, fp8_wgrad, fp8_wgrad, 0)
    assert launches["folded"] == (0, 0, 2 * fp8_wgrad, 0)
    assert launches["token rows, epilogue"] == (0, 0, 2 * fp8_wgrad, 1)
    for name in ("token rows", "token rows, epilogue"):
        assert torch.equal(got["folded"]["out"], got[name]["out"])
        assert torch.equal(got["folded"]["experts.w2"], got[name]["experts.w2"])
    for key in ("dx", "router.weight", "experts.w1", "experts.w3"):
        value = got["token rows"][key]
        assert not value.isnan().any() and not torch.equal(value, got["folded"][key]), key
        assert sqnr_db(value, got["folded"][key]) > 23, key
        assert sqnr_db(value, got["bf16"][key]) > sqnr_db(got["folded"][key], got["bf16"][key]) - 1.5, key


def test_down_projection_combine_bad_input(monkeypatch):
    """Bad probabilities and ``gate_up`` are refused before any kernel runs; bf16 experts refuse ``combine``."""
    from ops import op_registry
    from ops.grouped_linear_autograd import CombineRouting
    from ops.moe_fused import down_projection_combine

    fused, _, bf16 = moe_pair()
    e = fused.experts
    tokens, top_k = 8, 2
    order = ops.sort_by_expert(torch.arange(tokens * top_k, device=DEVICE).view(tokens, top_k) % 4, 4)
    offs = torch.cumsum(order.num_tokens_per_expert, 0, dtype=torch.int32)
    routing = CombineRouting(order.order, order.inverse.view(tokens, top_k), (order.order // top_k).to(torch.int32))
    probs = torch.rand(tokens, top_k, device=DEVICE)
    h = torch.randn(tokens * top_k, 48, device=DEVICE).bfloat16()

    def launched(*args, **kwargs):
        raise AssertionError("a kernel ran")

    for name in list(op_registry._functions):
        monkeypatch.setitem(op_registry._functions, name, launched)
    for bad in (probs[:, :1].contiguous(), probs.view(-1), probs.double(), probs.to(torch.int32)):
        with pytest.raises(ValueError, match=r"probs must be a float32 \(or bf16 / fp16\) tensor of the routing's \(T, k\) shape \(8, 2\)"):
            down_projection_combine(h, e.w2, offs, e.recipe, routing, bad)
    gate_up = torch.randn(tokens * top_k, 96, device=DEVICE).bfloat16()
    for bad in (gate_up[:, :48].contiguous(), gate_up.float(), gate_up[:-1], gate_up.t().contiguous().t()):
        with pytest.raises(ValueError, match=r"gate_up must be a contiguous torch.bfloat16 tensor \(T \* k, 2H\) = \(16, 96\)"):
            down_projection_combine(h, e.w2, offs, e.recipe, routing, probs, gate_up=bad)
    with pytest.raises(AssertionError, match="a kernel ran"):  # good inputs reach the kernels
        down_projection_combine(h, e.w2, offs, e.recipe, routing, probs)
    monkeypatch.undo()
    assert not bf16.experts.takes_combine
    x = torch.randn(tokens * top_k, 64, device=DEVICE).bfloat16()
    with pytest.raises(ValueError, match="needs experts with takes_combine; GroupedExperts has none"):
        bf16.experts(x, order.num_tokens_per_expert, combine=(routing, probs))


@pytest.mark.cuda
@pytest.mark.parametrize("tokens, dim, hidden, experts", [(8192, 2048, 768, 128), (2048, 7168, 2048, 64)])
def test_fused_layer_at_real_shapes(tokens, dim, hidden, experts):
    """Qwen3-30B-like and a DeepSeek-V3-like width on the GPU: fused against unfused and bf16 (SQNR), poison-free."""
    torch.manual_seed(0)
    bf16 = ops.MoE(dim, hidden, experts, 8, device=DEVICE)
    fused = ops.MoE(dim, hidden, experts, 8, device="meta")
    fused.router, fused.experts = bf16.router, ops.Fp8GroupedExperts.from_module(bf16.experts)
    unfused = ops.MoE(dim, hidden, experts, 8, device="meta")
    unfused.router, unfused.experts = bf16.router, ops.Fp8GroupedExperts.from_module(bf16.experts, UNFUSED)
    x = torch.randn(tokens, dim, device=DEVICE).bfloat16()
    probs, top = (t.detach() for t in bf16.route(x))
    grad = torch.randn(tokens, dim, device=DEVICE).bfloat16()
    got = {}
    for name, m in (("bf16", bf16), ("fused", fused), ("unfused", unfused)):
        bf16.zero_grad(set_to_none=True)
        got[name] = {k: v.clone() for k, v in layer_grads(m, x, probs, top, grad).items()}
    for key in got["bf16"]:
        assert not got["fused"][key].isnan().any(), key
        assert sqnr_db(got["fused"][key], got["bf16"][key]) > 22, key
        assert sqnr_db(got["fused"][key], got["unfused"][key]) > 25, key


@pytest.mark.cuda
@pytest.mark.parametrize("wgrad_precision", ["fp8", "bf16"])
def test_fused_layer_step_does_not_sync_with_the_host(wgrad_precision):
    """A whole ``ops.MoE`` training step (router, top-k, sort, fused FP8 experts, combine, backward)
    enqueues its work without waiting for the GPU (``torch.cuda.set_sync_debug_mode("error")``),
    the FP8 weights made in the step and kept from the step before."""
    torch.manual_seed(0)
    bf16 = ops.MoE(256, 128, 16, 4, device=DEVICE)
    layer = ops.MoE(256, 128, 16, 4, device="meta")
    recipe = ops.Fp8Recipe(wgrad_precision=wgrad_precision)
    layer.router, layer.experts = bf16.router, ops.Fp8GroupedExperts.from_module(bf16.experts, recipe)
    x = torch.randn(600, 256, device=DEVICE).bfloat16().requires_grad_()
    grad = torch.randn(600, 256, device=DEVICE).bfloat16()

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(grad)

    step()  # compiles the kernels
    for release in (True, False):
        if release:
            ops.release_quantized_weights()  # as after an optimizer step: the step quantizes the weights
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(x.grad.float()).all() and torch.isfinite(layer.experts.w1.grad.float()).all()


@pytest.mark.parametrize("wgrad_precision", ["fp8", "bf16"])
@pytest.mark.parametrize(
    "tokens, dim, hidden, experts, top_k",
    [(37, 64, 48, 4, 3), pytest.param(8192, 2048, 768, 128, 8, marks=pytest.mark.cuda, id="qwen3")],
)
def test_packed_w13_is_the_two_weights(tokens, dim, hidden, experts, top_k, wgrad_precision):
    """One packed ``w13 = [w1; w3]`` (transformers' ``gate_up_proj``) against ``w1`` and ``w3`` as two tensors.

    The forward is bitwise the same (a row's scale does not depend on its neighbours; the GEMM
    reads the packed weight's halves in place); dgrad is one contraction over ``2H`` instead of
    the split one, and the wgrad one GEMM over both halves: the same products, summed in
    another order.
    """
    from ops.moe_fused import swiglu_up_projection

    torch.manual_seed(0)
    w1, w3 = ((torch.randn(experts, hidden, dim, device=DEVICE) * dim**-0.5).bfloat16() for _ in range(2))
    w13 = torch.cat([w1, w3], dim=1).requires_grad_()
    w1.requires_grad_()
    w3.requires_grad_()
    x = torch.randn(tokens, dim, device=DEVICE).bfloat16()
    top = torch.stack([torch.randperm(experts, device=DEVICE)[:top_k] for _ in range(tokens)])
    top[:, 0] = top[:, 0].clamp(max=experts - 2)  # the last expert gets fewer pairs, maybe none
    order = ops.sort_by_expert(top, experts)
    offs = torch.cumsum(order.num_tokens_per_expert, 0, dtype=torch.int32)
    rows, inverse = (order.order // top_k).to(torch.int32), order.inverse.view(-1, top_k)
    recipe = ops.Fp8Recipe(wgrad_precision=wgrad_precision)
    grad = torch.randn(tokens * top_k, hidden, device=DEVICE).bfloat16()
    got = {}
    for name, weights in (("two", (w1, w3)), ("packed", w13)):
        xx = x.clone().requires_grad_()
        h = swiglu_up_projection(xx, weights, offs, recipe, rows=rows, inverse=inverse)
        h.backward(grad)
        got[name] = (h, xx.grad)
    assert torch.equal(got["two"][0], got["packed"][0])
    assert sqnr_db(got["packed"][1], got["two"][1]) > 40
    assert sqnr_db(w13.grad, torch.cat([w1.grad, w3.grad], dim=1)) > 40
    assert not w13.grad.isnan().any()


def test_frozen_experts_still_train_the_router():
    """Experts frozen and an input without gradient (router-only training): the fused layer still runs
    its autograd for the probabilities, and the router's gradient is the unfused layer's (both take the
    combine's gradient through the same FP8 experts) up to rounding, close to the bf16 layer's."""
    fused, unfused, bf16 = moe_pair()
    x = torch.randn(40, 64, device=DEVICE).bfloat16()
    grad = torch.randn(40, 64, device=DEVICE).bfloat16()
    grads = {}
    for name, layer in (("fused", fused), ("unfused", unfused), ("bf16", bf16)):
        layer.experts.requires_grad_(False)
        out = layer(x)
        assert out.requires_grad, name
        out.backward(grad)
        grads[name] = layer.router.weight.grad
        assert all(p.grad is None for p in layer.experts.parameters()), name
    assert grads["fused"].abs().sum() > 0
    assert sqnr_db(grads["fused"], grads["unfused"]) >= 25
    assert sqnr_db(grads["fused"], grads["bf16"]) >= 18


def test_a_strided_input_is_the_contiguous_one():
    fused, _, _ = moe_pair()
    x = torch.randn(24, 128, device=DEVICE).bfloat16()
    view = x[:, :64]
    assert not view.is_contiguous()
    out = fused(view)
    assert torch.equal(out, fused(view.contiguous()))


def test_sort_by_expert_bad_input():
    top = torch.tensor([[0, 2], [1, 3]], device=DEVICE)
    for bad in (top.float() + 0.5, top.bool(), [[0, 1]]):
        with pytest.raises(TypeError, match="top_experts must be a tensor of integer expert indices"):
            ops.sort_by_expert(bad, 4)
    for bad in (0, -1, 2.5, True, None):
        with pytest.raises(ValueError, match="num_experts must be a positive int"):
            ops.sort_by_expert(top, bad)


def test_moe_constructor_bad_input():
    for kwargs, match in (
        ({"top_k": 2.5}, "top_k must be a positive int"),
        ({"top_k": True}, "top_k must be a positive int"),
        ({"top_k": 5}, r"top_k must be in \[1, num_experts=4\]"),
        ({"dim": 0}, "dim must be a positive int"),
        ({"num_experts": 4.0}, "num_experts must be a positive int"),
        ({"hidden_dim": -16}, "hidden_dim must be a positive int"),
    ):
        args = {"dim": 32, "hidden_dim": 16, "num_experts": 4, "top_k": 2, **kwargs}
        with pytest.raises(ValueError, match=match):
            ops.MoE(**args)
