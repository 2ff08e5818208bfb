"""The ops layer: custom ops (opcheck), the rowwise autograd function, the functional API, input checks."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

import kernels_helion
import ops
from benchmarks.common import capture_step
from tests.reference_grouped_linear import emulated_fp8_grouped_linear, ref_grouped_linear
from tests.support import (
    DEVICE,
    custom_ops_defined_in,
    fwd_bwd,
    grouped_linear_problem,
    offsets_from_sizes,
    opcheck_fp8,
    sqnr_db,
)

E4M3, E4M3FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz

# Small problem with every awkward case: an empty group, a group of 1, sizes not
# multiples of 16, and 12 tokens past offs[-1].
SIZES = [0, 1, 37, 30]
M, K, N = 80, 64, 48


def make_problem(sizes=SIZES, m=M, k=K, n=N, **kwargs):
    return grouped_linear_problem(sizes, m, k, n, **kwargs)


# --- public API ---------------------------------------------------------------


def test_dir_shows_exactly_the_public_api():
    assert len(set(ops.__all__)) == len(ops.__all__)
    assert dir(ops) == sorted(ops.__all__)
    missing = [name for name in ops.__all__ if not hasattr(ops, name)]
    assert not missing, f"ops.__all__ names attributes that ops lacks: {missing}"
    # What dir() leaves out stays importable: submodules and their attributes.
    assert "custom_ops" not in dir(ops) and "op_registry" not in dir(ops)
    from ops.op_registry import kernel_ops

    assert ops.op_registry.kernel_ops is kernel_ops
    assert callable(ops.custom_ops.quantize_rowwise_rows)


# --- custom ops ---------------------------------------------------------------


def _opcheck_cases():
    x, w, offs, go = make_problem(sizes=[0, 5, 11], m=20, k=32, n=16)
    q = (E4M3, False)
    fp8 = torch.ops.fp8moe
    x_fp8, x_s = fp8.quantize_rowwise_rows(x, *q)
    w_fp8, w_s, wt_fp8, wt_s = fp8.quantize_rowwise_expert_weights_both_layouts(w, *q)
    go_fp8, go_s = fp8.quantize_rowwise_rows(go, *q)
    # The wgrad operands in the padded token layout the recipe uses (fakes compute its width).
    xt, xt_s = fp8.quantize_rowwise_cols_grouped(x, offs, *q, 16)
    got, got_s = fp8.quantize_rowwise_cols_grouped(go, offs, *q, 16)
    dw_acc = torch.randn(w.shape, device=DEVICE)
    row_multipliers = torch.rand(offs.shape[0], x.shape[1], device=DEVICE) + 0.5
    token_multipliers = torch.rand(x.shape[0], device=DEVICE) + 0.5
    return {
        "quantize_rowwise_rows": (x, *q),
        "quantize_rowwise_expert_weights": (w, *q),
        "quantize_rowwise_expert_weights_transposed": (w, E4M3FNUZ, True),
        "quantize_rowwise_expert_weights_both_layouts": (w, *q),
        "quantize_rowwise_expert_weights_and_transpose": (w, *q),
        "quantize_rowwise_cols_grouped": (x, offs, *q),
        "quantize_rowwise_cols_grouped(token_multipliers)": (x, offs, *q, 128, token_multipliers),
        "quantize_rowwise_rows_and_cols_grouped": (x, offs, *q, 128, row_multipliers),
        "quantize_rowwise_rows_and_cols_grouped(token_multipliers)": (x, offs, *q, 128, None, token_multipliers),
        "quantize_rowwise_rows_and_transpose": (x, offs, *q, 128),
        "transpose_to_token_groups": (x_fp8, offs, 128),
        "transpose_to_token_groups(rows)": (x_fp8, offs, 128, torch.randint(0, x.shape[0], (33,), device=DEVICE)),
        "grouped_mm_2d3d": (x_fp8, x_s, w_fp8, w_s, offs, torch.bfloat16),
        "grouped_mm_2d3d_split": (
            x_fp8, x_s, w_fp8[:, :, :16].contiguous(), w_fp8[:, :, 16:].contiguous(), w_s, offs, torch.bfloat16
        ),
        "transpose_fp8": (w_fp8,),
        "grouped_mm_wgrad": (got, got_s, xt, xt_s, offs, torch.float32, 16),
        "grouped_mm_wgrad_accumulate": (got, got_s, xt, xt_s, offs, dw_acc, 16),
        "grouped_mm_wgrad_bf16_accumulate": (go.bfloat16(), x.bfloat16(), offs, None, dw_acc.clone()),
        "grouped_mm_wgrad_bf16_accumulate(index)": (
            go.bfloat16(), x.bfloat16()[:7], offs, torch.randint(0, 7, (x.shape[0],), device=DEVICE), dw_acc.clone()
        ),
    }


def test_opcheck_every_op():
    """Schema, fake (meta) implementations and aot_dispatch of every op of ``ops.custom_ops``."""
    cases = _opcheck_cases()
    # Other recipes' ops (ops.custom_ops_<recipe>) are checked by their own tests.
    defined = custom_ops_defined_in(ops.custom_ops)
    names = {case.split("(")[0] for case in cases}
    assert defined == names, defined ^ names
    for case, args in cases.items():
        name = case.split("(")[0]
        opcheck_fp8(getattr(torch.ops.fp8moe, name), args, mutable={"out"} if name.endswith("_accumulate") else ())


def test_two_kernel_op_checks_offsets_before_any_launch(monkeypatch):
    """``quantize_rowwise_rows_and_transpose`` runs two kernels: bad offsets raise before the first."""
    # The package's ``quantize_rowwise_rows`` attribute is the function, which shadows its module.
    module = sys.modules["kernels_helion.quantize_rowwise"]
    monkeypatch.setattr(module, "launch", lambda *a: pytest.fail("launched"))
    x = torch.randn(8, 16, device=DEVICE)
    with pytest.raises(TypeError, match="offs must have dtype"):
        torch.ops.fp8moe.quantize_rowwise_rows_and_transpose(x, torch.tensor([4, 8], device=DEVICE))
    with pytest.raises(ValueError, match="group_alignment must be an int >= 1"):
        torch.ops.fp8moe.quantize_rowwise_rows_and_transpose(x, torch.tensor([4, 8], dtype=torch.int32, device=DEVICE), E4M3, False, 0)


# --- the autograd function -------------------------------------------------------


@pytest.mark.parametrize(
    "recipe",
    [
        ops.Fp8Recipe(),
        ops.Fp8Recipe(save_fp8_input=False, save_fp8_weight=False),
        ops.Fp8Recipe(round_scales_to_power_of_2=True),
        ops.Fp8Recipe(options=ops.RowwiseOptions(fold_dgrad_weight_scales=False, fold_wgrad_input_scales=False)),
        ops.Fp8Recipe(
            save_fp8_weight=False, round_scales_to_power_of_2=True,
            options=ops.RowwiseOptions(fold_dgrad_weight_scales=False, fold_wgrad_input_scales=False),
        ),
        ops.Fp8Recipe(save_fp8_input=False, options=ops.RowwiseOptions(fold_wgrad_input_scales=False)),
    ],
    ids=["default-folded", "save-bf16", "pow2", "unfolded", "unfolded-save-bf16-w-pow2", "wgrad-unfolded-save-bf16-x"],
)
def test_matches_fp32_emulation(recipe):
    """Same quantization done in PyTorch, GEMMs in fp32: only accumulation order and the bf16 output differ."""
    x, w, offs, grad_out = make_problem()
    # Rows of w and of x of different magnitudes: the folds' grad_out multipliers differ.
    w = w * torch.linspace(0.25, 4.0, w.shape[1], device=DEVICE)[:, None].to(w.dtype)
    x = x * torch.linspace(0.25, 4.0, x.shape[0], device=DEVICE)[:, None].to(x.dtype)
    out, dx, dw = fwd_bwd(lambda a, b, o: ops.fp8_grouped_linear(a, b, o, recipe), x, w, offs, grad_out)
    e_out, e_dx, e_dw = emulated_fp8_grouped_linear(
        x, w, offs, grad_out, recipe.float8_dtype, recipe.round_scales_to_power_of_2, recipe.fold_dgrad_weight_scales,
        recipe.fold_wgrad_input_scales,
    )
    assert out.dtype == dx.dtype == dw.dtype == torch.bfloat16
    for actual, expected in ((out, e_out), (dx, e_dx), (dw, e_dw)):
        torch.testing.assert_close(actual.float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())
    # Tokens past offs[-1] get nothing, in forward and in dx.
    assert (out[sum(SIZES):] == 0).all() and (dx[sum(SIZES):] == 0).all()
    # An empty group's weight gradient is 0.
    assert (dw[0] == 0).all()


@pytest.mark.parametrize("fold", [False, True], ids=["unfolded", "folded"])
def test_fidelity_vs_fp32_autograd(fold):
    x, w, offs, grad_out = make_problem(sizes=[40, 0, 100, 60], m=200, k=128, n=64)
    recipe = ops.Fp8Recipe(options=ops.RowwiseOptions(fold_dgrad_weight_scales=fold, fold_wgrad_input_scales=fold))
    out, dx, dw = fwd_bwd(lambda a, b, o: ops.fp8_grouped_linear(a, b, o, recipe), x, w, offs, grad_out)
    r_out, r_dx, r_dw = fwd_bwd(ref_grouped_linear, x, w, offs, grad_out)
    assert sqnr_db(out, r_out) >= 28
    assert sqnr_db(dx, r_dx) >= 25
    assert sqnr_db(dw, r_dw) >= 24


def test_grad_dtypes_follow_inputs():
    x, w, offs, grad_out = make_problem(dtype=torch.float32)
    out, dx, dw = fwd_bwd(
        lambda a, b, o: ops.fp8_grouped_linear(a, b, o, out_dtype=torch.float32), x, w, offs, grad_out
    )
    assert out.dtype == dx.dtype == dw.dtype == torch.float32


def test_grouped_mm_matches_torch_call_convention_and_no_grad_path():
    x, w, offs, grad_out = make_problem()
    out, dx, dw = fwd_bwd(ops.fp8_grouped_linear, x, w, offs, grad_out)
    out_mm, dx_mm, dw_mm = fwd_bwd(
        lambda a, b, o: ops.fp8_grouped_mm(a, b.transpose(-2, -1), offs=o), x, w, offs, grad_out
    )
    for a, b in ((out, out_mm), (dx, dx_mm), (dw, dw_mm)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(ops.fp8_grouped_linear(x, w, offs), out, rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"wgrad_precision": "bf16"}, {"wgrad_precision": "fp8"},
     {"options": ops.RowwiseOptions(fold_dgrad_weight_scales=False, fold_wgrad_input_scales=False)}],
    ids=["auto", "bf16-wgrad", "fp8-wgrad", "unfolded"],
)
def test_grouped_mm_weight_stored_transposed(kwargs):
    """``mat_b (E, K, N)`` contiguous (gpt-oss's layout): bitwise the results of its ``(E, N, K)`` copy,
    the gradient in the parameter's own layout (made there by the wgrad GEMM, not copied into it)."""
    x, w, offs, grad_out = make_problem()
    recipe = ops.Fp8Recipe(**kwargs)
    out, dx, dw = fwd_bwd(lambda a, b, o: ops.fp8_grouped_linear(a, b, o, recipe), x, w, offs, grad_out)
    stored = w.detach().transpose(-2, -1).contiguous().requires_grad_()
    xs = x.detach().requires_grad_()
    out_t = ops.fp8_grouped_mm(xs, stored, offs=offs, recipe=recipe)
    out_t.backward(grad_out)
    assert torch.equal(out_t, out) and torch.equal(xs.grad, dx)
    assert torch.equal(stored.grad, dw.transpose(-2, -1))
    assert stored.grad.stride() == stored.stride()
    # fp8_grouped_linear takes the view itself, with and without gradients.
    torch.testing.assert_close(ops.fp8_grouped_linear(x, stored.transpose(-2, -1), offs, recipe), out, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(ops.fp8_grouped_mm(x, stored, offs=offs, recipe=recipe), out, rtol=0, atol=0)


def test_grouped_mm_weight_stored_transposed_compiles():
    """``torch.compile(fullgraph=True)`` of ``fp8_grouped_mm`` on a weight stored ``(E, K, N)``: bitwise eager's."""
    x, w, offs, grad_out = make_problem()
    stored = w.detach().transpose(-2, -1).contiguous()
    results = []
    for fn in (ops.fp8_grouped_mm, torch.compile(ops.fp8_grouped_mm, fullgraph=True)):
        xs, ws = x.detach().requires_grad_(), stored.clone().requires_grad_()
        out = fn(xs, ws, offs=offs)
        out.backward(grad_out)
        results.append((out, xs.grad, ws.grad))
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)
    assert results[1][2].stride() == stored.stride()


def test_weight_stored_transposed_refused_with_accumulation_or_other_recipes():
    x, w, offs, _ = make_problem()
    view = w.detach().transpose(-2, -1).contiguous().transpose(-2, -1)
    for recipe in (ops.Fp8Recipe(options=ops.RowwiseOptions(wgrad_accumulation="grad")), ops.Fp8Recipe("blockwise")):
        assert not recipe.takes_transposed_weights
        with pytest.raises(ValueError, match="w must be contiguous"):
            ops.fp8_grouped_linear(x, view, offs, recipe)
    with pytest.raises(ValueError, match=r"contiguous, or the transpose\(-2, -1\) view"):
        ops.fp8_grouped_linear(x, w.detach()[:, :, ::2].transpose(-2, -1).transpose(-2, -1), offs)


@pytest.mark.parametrize("fold", [False, True], ids=["dgrad-transposed-w", "dgrad-folded"])
def test_only_needed_gradients(fold):
    x, w, offs, grad_out = make_problem()
    recipe = ops.Fp8Recipe(options=ops.RowwiseOptions(fold_dgrad_weight_scales=fold))
    wp = w.detach().requires_grad_()
    ops.fp8_grouped_linear(x, wp, offs, recipe).backward(grad_out)
    assert wp.grad is not None
    xp = x.detach().requires_grad_()
    ops.fp8_grouped_linear(xp, w, offs, recipe).backward(grad_out)
    assert xp.grad is not None
    # With dx alone (grad_out quantized rowwise only), dgrad is the one computed beside dW.
    xb, wb = x.detach().requires_grad_(), w.detach().requires_grad_()
    ops.fp8_grouped_linear(xb, wb, offs, recipe).backward(grad_out)
    assert torch.equal(xp.grad, xb.grad)


def test_folded_same_bits_whatever_is_saved():
    """The folds from the FP8 W^T and x^T saved in forward, or from w and x quantized again in backward: same bits."""
    x, w, offs, grad_out = make_problem()
    grads = [
        fwd_bwd(
            lambda a, b, o: ops.fp8_grouped_linear(
                a, b, o,
                ops.Fp8Recipe(
                    save_fp8_weight=save_w, save_fp8_input=save_x,
                    options=ops.RowwiseOptions(fold_dgrad_weight_scales=True),
                ),
            ),
            x, w, offs, grad_out,
        )
        for save_w, save_x in ((True, True), (False, True), (False, False))
    ]
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            assert torch.equal(a, b)
    # Folding w's scales changes dx's rounding only, folding x's dw's only.
    unfolded_dgrad = ops.Fp8Recipe(options=ops.RowwiseOptions(fold_dgrad_weight_scales=False))
    out, dx, dw = fwd_bwd(lambda a, b, o: ops.fp8_grouped_linear(a, b, o, unfolded_dgrad), x, w, offs, grad_out)
    assert torch.equal(out, grads[0][0]) and torch.equal(dw, grads[0][2]) and not torch.equal(dx, grads[0][1])
    unfolded_wgrad = ops.Fp8Recipe(options=ops.RowwiseOptions(fold_wgrad_input_scales=False))
    out, dx, dw = fwd_bwd(lambda a, b, o: ops.fp8_grouped_linear(a, b, o, unfolded_wgrad), x, w, offs, grad_out)
    assert torch.equal(out, grads[0][0]) and torch.equal(dx, grads[0][1]) and not torch.equal(dw, grads[0][2])

# --- several weights on one input (SwiGLU's w1 and w3) -------------------------------

_RECIPES_FOR_SHARED = {
    "rowwise": ops.Fp8Recipe(),
    "rowwise-lean": ops.Fp8Recipe(save_fp8_input=False, save_fp8_weight=False),
    "rowwise-unfolded": ops.Fp8Recipe(
        options=ops.RowwiseOptions(fold_dgrad_weight_scales=False, fold_wgrad_input_scales=False)
    ),
    "blockwise": ops.Fp8Recipe(name="blockwise"),
    "blockwise-lean": ops.Fp8Recipe(name="blockwise", save_fp8_input=False, save_fp8_weight=False),
    "mxfp8": ops.Fp8Recipe(name="mxfp8"),
}


# Every recipe and every set of wanted gradients at least once (not all 18 pairs: the
# interpreter takes up to ~30 s a pair, and the CPU suite has a time limit).
_SHARED_CASES = [
    ("rowwise", "all"), ("rowwise", "no-dx"), ("rowwise-lean", "all"), ("rowwise-unfolded", "frozen-w3"),
    ("blockwise", "all"), ("blockwise", "frozen-w3"), ("blockwise-lean", "no-dx"),
    ("mxfp8", "all"),
]


@pytest.mark.parametrize(("recipe_name", "grads"), _SHARED_CASES, ids=[f"{g}-{r}" for r, g in _SHARED_CASES])
def test_grouped_linears_equal_separate_calls(recipe_name, grads):
    """Sharing x's quantization changes no bit of the outputs or the gradients."""
    recipe = _RECIPES_FOR_SHARED[recipe_name]
    k = 128 if recipe.name == "blockwise" else K
    n1 = 64 if recipe.name == "mxfp8" else N  # MXFP8 needs N % 32 == 0
    x, w1, offs, go1 = make_problem(k=k, n=n1)
    _, w3, _, _ = make_problem(k=k, n=32, seed=1)
    go3 = torch.randn(M, 32, device=DEVICE).to(torch.bfloat16)

    def run(shared: bool):
        xp = x.detach().requires_grad_(grads != "no-dx")
        w1p = w1.detach().requires_grad_()
        w3p = w3.detach().requires_grad_(grads != "frozen-w3")
        if shared:
            gate, up = ops.fp8_grouped_linears(xp, [w1p, w3p], offs, recipe)
        else:
            gate, up = (ops.fp8_grouped_linear(xp, w, offs, recipe) for w in (w1p, w3p))
        torch.autograd.backward([gate, up], [go1, go3])
        return gate.detach(), up.detach(), xp.grad, w1p.grad, w3p.grad

    for name, a, b in zip(["gate", "up", "dx", "dw1", "dw3"], run(True), run(False)):
        if b is None:
            assert a is None, name
        else:
            assert torch.equal(a, b), name
    with torch.no_grad():
        gate, up = ops.fp8_grouped_linears(x, (w1, w3), offs, recipe)
        assert torch.equal(gate, ops.fp8_grouped_linear(x, w1, offs, recipe))
        assert torch.equal(up, ops.fp8_grouped_linear(x, w3, offs, recipe))


def test_grouped_linears_quantize_x_once(monkeypatch):
    from ops import op_registry

    calls = {name: 0 for name in ("quantize_rowwise_rows_and_transpose", "quantize_rowwise_rows")}
    for name in calls:
        function = op_registry._functions[name]

        def counted(*args, _name=name, _function=function, **kwargs):
            calls[_name] += 1
            return _function(*args, **kwargs)

        monkeypatch.setitem(op_registry._functions, name, counted)
    x, w1, offs, _ = make_problem()
    xp = x.detach().requires_grad_()
    weights = [w1.detach().requires_grad_(), w1.detach().mul(2).requires_grad_()]
    ops.fp8_grouped_linears(xp, weights, offs)
    assert calls == {"quantize_rowwise_rows_and_transpose": 1, "quantize_rowwise_rows": 0}
    with torch.no_grad():
        ops.fp8_grouped_linears(x, weights, offs)
    assert calls["quantize_rowwise_rows"] == 1


_ONE_WEIGHT_CALLS: list[int] = []


@ops.register_recipe("test-one-weight-only")
def _one_weight_only(x, w, offs, recipe, out_dtype):
    """A user recipe with no shared-input implementation (rowwise underneath)."""
    _ONE_WEIGHT_CALLS.append(w.shape[1])
    return ops.fp8_grouped_linear(x, w, offs, ops.Fp8Recipe(), out_dtype)


def test_grouped_linears_fall_back_to_one_call_per_weight():
    x, w1, offs, _ = make_problem()
    w3 = w1[:, :32].contiguous()
    _ONE_WEIGHT_CALLS.clear()
    gate, up = ops.fp8_grouped_linears(x, (w1, w3), offs, ops.Fp8Recipe(name="test-one-weight-only"))
    assert _ONE_WEIGHT_CALLS == [N, 32]
    assert torch.equal(gate, ops.fp8_grouped_linear(x, w1, offs)) and torch.equal(up, ops.fp8_grouped_linear(x, w3, offs))


def test_grouped_linears_bad_input():
    x, w, offs, _ = make_problem()
    with pytest.raises(TypeError, match="non-empty sequence"):
        ops.fp8_grouped_linears(x, w, offs)
    with pytest.raises(TypeError, match="non-empty sequence"):
        ops.fp8_grouped_linears(x, [], offs)
    with pytest.raises(ValueError, match=r"x.shape\[1\]"):
        ops.fp8_grouped_linears(x, [w, torch.randn(4, N, K + 16, device=DEVICE)], offs)


@pytest.mark.cuda
def test_training_step_captures_in_a_cuda_graph():
    """Forward and backward capture in one CUDA graph (nothing syncs with the host) and replay on new data.

    New inputs, including new group sizes, are copied into the captured tensors; the
    replay must equal an eager run on them bit for bit.
    """
    m, k, n = 600, 256, 128
    x, w, offs, grad_out = make_problem(sizes=[0, 1, 300, 211], m=m, k=k, n=n)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    offs_s, grad_s = offs.clone(), grad_out.clone()

    def step():
        xs.grad = ws.grad = None
        out = ops.fp8_grouped_linear(xs, ws, offs_s)
        out.backward(grad_s)
        return out

    graph, out = capture_step(step)
    x2, w2, offs2, grad2 = make_problem(sizes=[5, 0, 400, 107], m=m, k=k, n=n, seed=3)
    with torch.no_grad():
        for static, new in ((xs, x2), (ws, w2), (offs_s, offs2), (grad_s, grad2)):
            static.copy_(new)
    graph.replay()
    expected = fwd_bwd(ops.fp8_grouped_linear, x2, w2, offs2, grad2)
    for name, got, want in zip(["out", "dx", "dw"], (out, xs.grad, ws.grad), expected):
        assert torch.equal(got, want), name


# --- input checks ------------------------------------------------------------------


def _bad(**overrides):
    x, w, offs, _ = make_problem()
    args = {"x": x, "w": w, "offs": offs}
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    "args, error, match",
    [
        (lambda: _bad(x=torch.randn(M, K, dtype=torch.float64, device=DEVICE)), TypeError, "x must have dtype"),
        (lambda: _bad(x=torch.randn(M, K, 1, device=DEVICE)), ValueError, "x must be 2-D"),
        (lambda: _bad(x=torch.randn(K, M, device=DEVICE).t()), ValueError, "x must be contiguous"),
        (lambda: _bad(w=torch.randn(N, 4, K, device=DEVICE).transpose(0, 1)), ValueError, "w must be contiguous"),
        (lambda: _bad(w=torch.randn(N, K, device=DEVICE)), ValueError, "w must be 3-D"),
        (lambda: _bad(offs=offsets_from_sizes(SIZES).long()), TypeError, "offs must have dtype"),
        (lambda: _bad(offs=offsets_from_sizes(SIZES[:3])), ValueError, "one group end per expert"),
        (lambda: _bad(x=torch.randn(M, K + 16, device=DEVICE)), ValueError, r"x.shape\[1\]"),
        (lambda: _bad(x=torch.randn(M, 40, device=DEVICE), w=torch.randn(4, N, 40, device=DEVICE)), ValueError,
         "K=40 must be a positive multiple of 16"),
        (lambda: _bad(w=torch.randn(4, 40, K, device=DEVICE)), ValueError, "N=40 must be a positive multiple of 16"),
        (lambda: _bad(recipe="rowwise"), TypeError, "recipe must be an ops.Fp8Recipe"),
        (lambda: _bad(out_dtype=torch.int32), TypeError, "out_dtype must be one of"),
        (lambda: _bad(recipe=ops.Fp8Recipe(float8_dtype=E4M3FNUZ)), TypeError, "needs a ROCm build"),
        (lambda: _bad(w=torch.randn(4, N, K, device="meta")), ValueError, "w is a meta tensor"),
        (lambda: _bad(x=torch.randn(M, K, device="meta")), ValueError, "x is a meta tensor"),
        (lambda: _bad(w=_OtherSubclass(torch.randn(4, N, K, device=DEVICE))), TypeError,
         "w must be a plain torch.Tensor, got the tensor subclass"),
        (lambda: _bad(x=_OtherSubclass(torch.randn(M, K, device=DEVICE))), TypeError,
         "x must be a plain torch.Tensor, got the tensor subclass"),
        (lambda: _bad(w=_fp8_all_gather_weight(torch.randn(4, N, K, device=DEVICE))), TypeError,
         "w must be a plain torch.Tensor.*must be run under fully_shard"),
        (lambda: _bad(w=_fp8_weight_tensor(torch.randn(4, N, K, device=DEVICE), True)), ValueError,
         "round_scales_to_power_of_2"),
    ],
)
def test_bad_input(args, error, match):
    with pytest.raises(error, match=match):
        ops.fp8_grouped_linear(**args())


class _OtherSubclass(torch.Tensor):
    """A tensor subclass the kernels do not know (a ``__torch_function__`` subclass, as user code makes)."""


def _fp8_all_gather_weight(w: torch.Tensor) -> torch.Tensor:
    from ops.fsdp import Fp8AllGatherWeight

    return Fp8AllGatherWeight(w, (torch.float8_e4m3fn, False))


def _fp8_weight_tensor(w: torch.Tensor, round_scales_to_power_of_2: bool) -> torch.Tensor:
    quant = (torch.float8_e4m3fn, round_scales_to_power_of_2)
    q, scales = kernels_helion.quantize_rowwise_expert_weights(w, *quant)
    return ops.Fp8WeightTensor(q, scales, w.dtype, quant)


def test_bad_input_dtensor():
    """A sharded DTensor weight (FSDP2's parameter outside its forward) is refused by name, before any launch."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    x, w, offs, _ = make_problem()
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh(DEVICE.type, (1,))
        dw = distribute_tensor(w, mesh, [Shard(0)])
        with pytest.raises(TypeError, match=r"w is a DTensor \(placements \(Shard\(dim=0\),\)\).*to_local"):
            ops.fp8_grouped_linear(x, dw, offs)
        with pytest.raises(TypeError, match="w is a DTensor"):
            ops.fp8_grouped_linears(x, (w, dw), offs)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"offs": None}, ValueError, "offs is required"),
        ({"bias": torch.zeros(N)}, ValueError, "bias is not supported"),
    ],
)
def test_grouped_mm_bad_input(kwargs, error, match):
    x, w, offs, _ = make_problem()
    with pytest.raises(error, match=match):
        ops.fp8_grouped_mm(x, w.transpose(-2, -1), **{"offs": offs, **kwargs})


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"name": "tensorwise"}, ValueError, "recipe name must be one of"),
        ({"float8_dtype": torch.float8_e5m2}, TypeError, "float8_dtype must be one of"),
        ({"out_dtype": torch.int8}, TypeError, "out_dtype must be one of"),
        ({"save_fp8_input": 1}, TypeError, "save_fp8_input must be a bool"),
        # A recipe's own option is set through options= only.
        ({"fold_dgrad_weight_scales": False}, TypeError, r"options=ops.RowwiseOptions\(fold_dgrad_weight_scales=\.\.\.\)"),
        ({"fold_wgrad_input_scales": False}, TypeError, r"options=ops.RowwiseOptions\(fold_wgrad_input_scales=\.\.\.\)"),
        ({"wgrad_accumulation": "grad"}, TypeError, r"options=ops.RowwiseOptions\(wgrad_accumulation=\.\.\.\)"),
        ({"name": "mxfp8", "mx_rounding": "floor"}, TypeError, r"options=ops.MxOptions\(rounding=\.\.\.\)"),
        ({"fold_weights": True}, TypeError, "unexpected keyword argument 'fold_weights'"),
        ({"options": ops.MxOptions()}, TypeError, "options must be RowwiseOptions"),
        ({"name": "blockwise", "options": ops.RowwiseOptions()}, TypeError, "options must be None"),
    ],
)
def test_bad_recipe(kwargs, error, match):
    with pytest.raises(error, match=match):
        ops.Fp8Recipe(**kwargs)


def test_fold_default_resolves_per_recipe():
    # Folding is the rowwise recipe's default and does not apply to the others.
    assert ops.Fp8Recipe().fold_dgrad_weight_scales is True
    assert ops.Fp8Recipe(name="blockwise").fold_dgrad_weight_scales is False
    assert ops.Fp8Recipe(name="mxfp8").fold_dgrad_weight_scales is False
    assert ops.Fp8Recipe(options=ops.RowwiseOptions(fold_dgrad_weight_scales=False)).fold_dgrad_weight_scales is False
    assert ops.Fp8Recipe().fold_wgrad_input_scales is True
    assert ops.Fp8Recipe(name="blockwise").fold_wgrad_input_scales is False
    assert ops.Fp8Recipe(options=ops.RowwiseOptions(fold_wgrad_input_scales=False)).fold_wgrad_input_scales is False


def test_recipe_capabilities():
    # Pre-quantized weights (FSDP2's FP8 all-gather) and rows (FP8 dispatch): the rowwise recipe; rows also
    # need wgrad's x^T built from them (the folded wgrad on the saved FP8 x).
    rowwise, others = ops.Fp8Recipe(), (ops.Fp8Recipe(name="blockwise"), ops.Fp8Recipe(name="mxfp8"))
    assert rowwise.takes_prequantized_weights and rowwise.takes_prequantized_rows
    assert not any(r.takes_prequantized_weights or r.takes_prequantized_rows for r in others)
    unsaved = ops.Fp8Recipe(save_fp8_input=False)
    assert unsaved.takes_prequantized_weights and not unsaved.takes_prequantized_rows
    assert not ops.Fp8Recipe(options=ops.RowwiseOptions(fold_wgrad_input_scales=False)).takes_prequantized_rows


def test_recipe_options_are_typed_per_recipe():
    assert ops.Fp8Recipe().options == ops.RowwiseOptions()
    assert ops.Fp8Recipe(name="blockwise").options is None
    assert ops.Fp8Recipe(name="mxfp8").options == ops.MxOptions()
    # The read-only attributes read the options.
    assert ops.Fp8Recipe(name="mxfp8", options=ops.MxOptions("floor")).mx_rounding == "floor"
    # dataclasses.replace keeps the options; a recipe's own option changes through them.
    both = ops.Fp8Recipe(options=ops.RowwiseOptions(fold_dgrad_weight_scales=False, fold_wgrad_input_scales=False))
    assert dataclasses.replace(both, save_fp8_weight=False).options == both.options
    with pytest.raises(TypeError, match=r"options=ops.RowwiseOptions\(fold_dgrad_weight_scales=\.\.\.\)"):
        dataclasses.replace(ops.Fp8Recipe(), fold_dgrad_weight_scales=False)
    assert hash(ops.Fp8Recipe()) == hash(ops.Fp8Recipe(options=ops.RowwiseOptions()))
    with pytest.raises(AttributeError, match="mxfp8-recipe option"):
        ops.Fp8Recipe().mx_rounding
    with pytest.raises(TypeError, match="fold_wgrad_input_scales must be a bool"):
        ops.RowwiseOptions(fold_wgrad_input_scales=None)
    with pytest.raises(ValueError, match="rounding must be one of"):
        ops.MxOptions("even")


def test_recipe_registry():
    assert "rowwise" in ops.registered_recipes()
    with pytest.raises(ValueError, match="already registered"):
        ops.register_recipe("rowwise")(lambda *a: None)


# --- GPU: benchmark-size fidelity -----------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["uniform", "skewed"])
@pytest.mark.parametrize("fold", [False, True], ids=["unfolded", "folded"])
def test_benchmark_shape_fidelity(kind, fold):
    from tests.support import group_sizes

    sizes = group_sizes(16384, 8, kind, align=16)
    x, w, offs, grad_out = make_problem(sizes=sizes, m=16384, k=2048, n=1536)
    recipe = ops.Fp8Recipe(options=ops.RowwiseOptions(fold_dgrad_weight_scales=fold, fold_wgrad_input_scales=fold))
    out, dx, dw = fwd_bwd(lambda a, b, o: ops.fp8_grouped_linear(a, b, o, recipe), x, w, offs, grad_out)
    r_out, r_dx, r_dw = fwd_bwd(ref_grouped_linear, x, w, offs, grad_out)
    assert sqnr_db(out, r_out) >= 28
    assert sqnr_db(dx, r_dx) >= 25
    assert sqnr_db(dw, r_dw) >= 24
