"""The blockwise recipe (DeepSeek-V3 scales) in the ops layer: custom ops, autograd, functional and module paths."""

from __future__ import annotations

import pytest
import torch

import ops
import ops.custom_ops_blockwise
from tests.reference import ref_amax, ref_cast, ref_scale
from tests.reference_grouped_linear import group_bounds, ref_grouped_linear
from tests.support import (
    DEVICE,
    custom_ops_defined_in,
    fwd_bwd,
    group_sizes,
    grouped_linear_problem,
    offsets_from_sizes,
    opcheck_fp8,
    sqnr_db,
)

E4M3, E4M3FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
BLOCK = 128
BLOCKWISE = ops.Fp8Recipe(name="blockwise")

# Groups longer than a 128-token block (several wgrad scale blocks, partial last ones),
# an empty group, a group of 1, sizes not multiples of 16 and 11 tokens past offs[-1];
# K and N span two 128-blocks, the second partial.
SIZES = [150, 0, 1, 133]
M, K, N = 295, 160, 144


def make_problem(sizes=SIZES, m=M, k=K, n=N, **kwargs):
    return grouped_linear_problem(sizes, m, k, n, **kwargs)


def blockwise_linear(recipe=BLOCKWISE, **kwargs):
    return lambda x, w, offs: ops.fp8_grouped_linear(x, w, offs, recipe, **kwargs)


# --- fp32 emulation of the recipe, plain PyTorch ------------------------------------------


def block_dequant(t: torch.Tensor, rows: int, cols: int, float8_dtype, pow2: bool) -> torch.Tensor:
    """fp32 ``t (R, C)`` quantized with one scale per ``rows x cols`` block (partial blocks at the ends), dequantized."""
    r, c = t.shape
    rb, cb = -(-r // rows), -(-c // cols)
    padded = torch.zeros(rb * rows, cb * cols, device=t.device)
    padded[:r, :c] = t.float()  # zeros leave every block's amax as it is
    blocks = padded.view(rb, rows, cb, cols)
    scale = ref_scale(ref_amax(blocks, (1, 3)), float8_dtype, pow2)[:, None, :, None]
    return (ref_cast(blocks, scale, float8_dtype).float() * scale).view(rb * rows, cb * cols)[:r, :c]


def emulated_blockwise(x, w, offs, grad_out, float8_dtype=E4M3, pow2=False):
    """``(out, dx, dw)`` with the recipe's quantization emulated and fp32 GEMMs.

    out and dx: x / grad_out per 1x128 block, w per 128x128 block (``W^T`` has the
    same blocks); dw: grad_out and x per 128x1 block, blocks starting at each group's start.
    """
    q = dict(float8_dtype=float8_dtype, pow2=pow2)
    xq, goq = block_dequant(x, 1, BLOCK, **q), block_dequant(grad_out, 1, BLOCK, **q)
    out = torch.zeros(x.shape[0], w.shape[1], device=x.device)
    dx = torch.zeros(x.shape, device=x.device)
    dw = torch.zeros(w.shape, device=x.device)
    for g, (s, e) in enumerate(group_bounds(offs)):
        wq = block_dequant(w[g], BLOCK, BLOCK, **q)
        out[s:e] = xq[s:e] @ wq.T
        dx[s:e] = goq[s:e] @ wq
        if e > s:
            dw[g] = block_dequant(grad_out[s:e], BLOCK, 1, **q).T @ block_dequant(x[s:e], BLOCK, 1, **q)
    return out, dx, dw


def assert_matches_emulation(actual, expected) -> None:
    # Same quantization (scales and FP8 values bitwise); only the fp32 accumulation
    # order and the bf16 rounding of the result (2**-9 relative) differ.
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.float(), e, rtol=8e-3, atol=2e-3 * e.abs().max().item())


# --- custom ops ------------------------------------------------------------------------------


def _opcheck_cases():
    x, w, offs, go = make_problem(sizes=[0, 5, 11], m=20, k=32, n=16)
    q = (E4M3, False)
    fp8 = torch.ops.fp8moe
    x_fp8, x_s = fp8.quantize_blockwise_rows(x, *q)
    w_fp8, w_s, wt_fp8, wt_s = fp8.quantize_blockwise_weights_both_layouts(w, *q)
    _, _, got, got_s, starts = fp8.quantize_blockwise_rows_and_cols_grouped(go, offs, *q)
    xt, xt_s, _ = fp8.quantize_blockwise_cols_grouped(x, offs, *q)
    return {
        "quantize_blockwise_rows": (x, *q),
        "quantize_blockwise_cols_grouped": (x, offs, E4M3FNUZ, True),
        "quantize_blockwise_rows_and_cols_grouped": (go, offs, *q),
        "quantize_blockwise_weights": (w, E4M3FNUZ, False),
        "quantize_blockwise_weights_transposed": (w, E4M3, True),
        "quantize_blockwise_weights_both_layouts": (w, *q),
        "grouped_mm_2d3d_blockwise": (x_fp8, x_s, w_fp8, w_s, offs, torch.bfloat16),
        "grouped_mm_wgrad_blockwise": (got, got_s, xt, xt_s, offs, starts, torch.float32),
    }


def test_opcheck_every_op():
    """Schema, fake implementations (including the K-block-major scale strides) and aot_dispatch."""
    cases = _opcheck_cases()
    assert custom_ops_defined_in(ops.custom_ops_blockwise) == set(cases)
    for name, args in cases.items():
        opcheck_fp8(getattr(torch.ops.fp8moe, name), args)


def test_fake_shapes_follow_groups_and_blocks():
    """Grouped 128x1 scales have R = ceil(M/128) + G rows (x^T: R * 128 columns): known from shapes."""
    x = torch.randn(300, 48, device=DEVICE)
    offs = offsets_from_sizes([100, 0, 150, 1, 40])
    with torch._subclasses.FakeTensorMode() as mode:
        fake = torch.ops.fp8moe.quantize_blockwise_rows_and_cols_grouped(mode.from_tensor(x), mode.from_tensor(offs))
    real = torch.ops.fp8moe.quantize_blockwise_rows_and_cols_grouped(x, offs)
    assert real[3].shape == (3 + 5, 48) and real[2].shape == (48, (3 + 5) * 128)
    for f, r in zip(fake, real):
        assert (f.shape, f.stride(), f.dtype) == (r.shape, r.stride(), r.dtype)


# --- the autograd function -----------------------------------------------------------------


@pytest.mark.parametrize(
    "recipe",
    [
        BLOCKWISE,
        ops.Fp8Recipe(name="blockwise", round_scales_to_power_of_2=True, save_fp8_input=False, save_fp8_weight=False),
    ],
    ids=["default", "pow2-nosave"],
)
def test_matches_fp32_emulation(recipe):
    x, w, offs, grad_out = make_problem()
    actual = fwd_bwd(blockwise_linear(recipe), x, w, offs, grad_out)
    assert all(t.dtype == torch.bfloat16 for t in actual)
    assert_matches_emulation(actual, emulated_blockwise(x, w, offs, grad_out, E4M3, recipe.round_scales_to_power_of_2))
    out, dx, dw = actual
    # Tokens past offs[-1] get nothing, in forward and in dx; an empty group's weight gradient is 0.
    assert (out[sum(SIZES):] == 0).all() and (dx[sum(SIZES):] == 0).all()
    assert (dw[1] == 0).all()


@pytest.mark.parametrize("kind", ["uniform", "skewed", "empty", "one", "unaligned"])
def test_group_size_kinds(kind):
    sizes = group_sizes(M - 20, 4, kind)
    x, w, offs, grad_out = make_problem(sizes=sizes)
    actual = fwd_bwd(blockwise_linear(), x, w, offs, grad_out)
    assert_matches_emulation(actual, emulated_blockwise(x, w, offs, grad_out))


@pytest.mark.whole_suite_only
def test_fidelity_vs_bf16_reference():
    """The issue's bar: out >= 25 dB; gradients >= 30 dB is out of e4m3's reach, see below.

    One e4m3 cast of Gaussian data has an SQNR of ~31.5 dB (3 mantissa bits),
    whatever the scaling granularity; a GEMM of two such operands adds their
    noises: ~28.5 dB (measured here: out 28.6, dx 28.6, dW 28.9 dB; the rowwise
    recipe: 28.6 / 28.6 / 28.7). So the gradients are held to >= 28 dB and to
    the fp32 emulation of the same quantization (the kernels lose < 0.1 dB).
    """
    x, w, offs, grad_out = make_problem(sizes=[200, 0, 1, 300, 150], m=662, k=256, n=256)
    ours = fwd_bwd(blockwise_linear(), x, w, offs, grad_out)
    reference = fwd_bwd(ref_grouped_linear, x, w, offs, grad_out)
    emulated = emulated_blockwise(x, w, offs, grad_out)
    out_db, dx_db, dw_db = (sqnr_db(a, r) for a, r in zip(ours, reference))
    assert out_db >= 25, out_db
    assert dx_db >= 28 and dw_db >= 28, (dx_db, dw_db)
    for a, e, r in zip(ours, emulated, reference):
        assert sqnr_db(a, r) >= sqnr_db(e, r) - 0.1


@pytest.mark.whole_suite_only
def test_save_flags_and_needed_gradients_give_identical_results():
    """What is saved (FP8 copies or the inputs) and which gradients are needed change no bit."""
    x, w, offs, grad_out = make_problem(sizes=[130, 0, 1, 20], m=160, k=144, n=32)
    out, dx, dw = fwd_bwd(blockwise_linear(), x, w, offs, grad_out)
    for save_input in (False, True):
        for save_weight in (False, True):
            recipe = ops.Fp8Recipe(name="blockwise", save_fp8_input=save_input, save_fp8_weight=save_weight)
            for a, b in zip(fwd_bwd(blockwise_linear(recipe), x, w, offs, grad_out), (out, dx, dw)):
                assert torch.equal(a, b), (save_input, save_weight)
    assert torch.equal(fwd_bwd(blockwise_linear(), x, w, offs, grad_out, needs=(True, False))[1], dx)
    assert torch.equal(fwd_bwd(blockwise_linear(), x, w, offs, grad_out, needs=(False, True))[2], dw)
    with torch.no_grad():
        assert torch.equal(ops.fp8_grouped_linear(x, w, offs, BLOCKWISE), out)


def test_fp32_inputs_and_grouped_mm_call():
    x, w, offs, grad_out = make_problem(sizes=[20, 33], m=60, k=32, n=16, dtype=torch.float32)
    out, dx, dw = fwd_bwd(blockwise_linear(out_dtype=torch.float32), x, w, offs, grad_out)
    assert out.dtype == dx.dtype == dw.dtype == torch.float32
    # float32 weights once gave NaN in dx on the H200 (the quantizer's transposed float32 store).
    assert all(torch.isfinite(t).all() for t in (out, dx, dw))
    mm = fwd_bwd(
        lambda a, b, o: ops.fp8_grouped_mm(a, b.transpose(-2, -1), offs=o, out_dtype=torch.float32, recipe=BLOCKWISE),
        x, w, offs, grad_out,
    )
    for a, b in zip((out, dx, dw), mm):
        assert torch.equal(a, b)


def test_no_tokens():
    x, w, offs, grad_out = make_problem(sizes=[0, 0], m=0, k=32, n=16)
    out, dx, dw = fwd_bwd(blockwise_linear(), x, w, offs, grad_out)
    assert out.shape == (0, 16) and dx.shape == (0, 32) and (dw == 0).all()


# --- float8_e4m3fnuz and input checks ---------------------------------------------------------


@pytest.mark.skipif(torch.version.hip is None, reason="e4m3fnuz GEMMs need ROCm")
def test_fnuz_matches_fp32_emulation():
    x, w, offs, grad_out = make_problem()
    recipe = ops.Fp8Recipe(name="blockwise", float8_dtype=E4M3FNUZ)
    actual = fwd_bwd(blockwise_linear(recipe), x, w, offs, grad_out)
    assert_matches_emulation(actual, emulated_blockwise(x, w, offs, grad_out, E4M3FNUZ))


def test_fnuz_quantization_matches_emulation():
    """On every backend the recipe's quantizers give e4m3fnuz (FP8_MAX 240) as the emulation does."""
    x, w, offs, _ = make_problem()
    fp8 = torch.ops.fp8moe
    x_fp8, x_scales = fp8.quantize_blockwise_rows(x, E4M3FNUZ, False)
    scales = x_scales.repeat_interleave(BLOCK, 1)[:, :K]
    torch.testing.assert_close(x_fp8.float() * scales, block_dequant(x, 1, BLOCK, E4M3FNUZ, False), rtol=0, atol=0)
    w_fp8, w_scales = fp8.quantize_blockwise_weights(w, E4M3FNUZ, False)
    full = w_scales.repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)[:, :N, :K]
    for g in range(len(SIZES)):
        expected = block_dequant(w[g], BLOCK, BLOCK, E4M3FNUZ, False)
        torch.testing.assert_close(w_fp8[g].float() * full[g], expected, rtol=0, atol=0)


def test_recipe_registered_and_fnuz_needs_rocm():
    assert "blockwise" in ops.registered_recipes()
    assert issubclass(ops.BlockwiseFp8GroupedLinear, torch.autograd.Function)
    if torch.version.hip is None:
        x, w, offs, _ = make_problem()
        with pytest.raises(TypeError, match="needs a ROCm build"):
            ops.fp8_grouped_linear(x, w, offs, ops.Fp8Recipe(name="blockwise", float8_dtype=E4M3FNUZ))


@pytest.mark.parametrize(
    "shapes, match",
    [(((M, 40), (4, N, 40)), "K=40 must be a positive multiple of 16"), (((M, K), (4, 40, K)), "N=40 must be")],
)
def test_bad_shapes_fail_before_launch(shapes, match):
    (x_shape, w_shape) = shapes
    with pytest.raises(ValueError, match=match):
        x, w = torch.randn(x_shape, device=DEVICE), torch.randn(w_shape, device=DEVICE)
        ops.fp8_grouped_linear(x, w, offsets_from_sizes(SIZES), BLOCKWISE)


# --- GPU: benchmark-size fidelity ---------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["skewed", "unaligned"])
def test_benchmark_shape_fidelity(kind):
    sizes = group_sizes(8192 - 64, 8, kind)
    x, w, offs, grad_out = make_problem(sizes=sizes, m=8192, k=2048, n=2048)
    ours = fwd_bwd(blockwise_linear(), x, w, offs, grad_out)
    assert all(torch.equal(a, b) for a, b in zip(ours, fwd_bwd(blockwise_linear(), x, w, offs, grad_out))), (
        "not bitwise deterministic"
    )
    lean = ops.Fp8Recipe(name="blockwise", save_fp8_input=False, save_fp8_weight=False)
    assert all(torch.equal(a, b) for a, b in zip(ours, fwd_bwd(blockwise_linear(lean), x, w, offs, grad_out)))
    reference = fwd_bwd(ref_grouped_linear, x, w, offs, grad_out)
    out_db, dx_db, dw_db = (sqnr_db(a, r) for a, r in zip(ours, reference))
    assert out_db >= 25 and dx_db >= 28 and dw_db >= 28, (out_db, dx_db, dw_db)
    assert_matches_emulation(ours, emulated_blockwise(x, w, offs, grad_out))
    assert (ours[0][sum(sizes):] == 0).all() and (ours[1][sum(sizes):] == 0).all()


@pytest.mark.cuda
def test_no_host_sync():
    x, w, offs, grad_out = make_problem(sizes=group_sizes(4000, 8, "unaligned"), m=4096, k=512, n=512)
    for save in (True, False):
        recipe = ops.Fp8Recipe(name="blockwise", save_fp8_input=save, save_fp8_weight=save)
        fwd_bwd(blockwise_linear(recipe), x, w, offs, grad_out)  # compiles the kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fwd_bwd(blockwise_linear(recipe), x, w, offs, grad_out)
        finally:
            torch.cuda.set_sync_debug_mode("default")
