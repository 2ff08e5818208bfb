"""``Fp8Recipe.wgrad_precision``: the weight gradient in FP8 or in bf16 (``ops.wgrad_precision``).

Both autograd Functions are covered: the rowwise grouped linear (``ops.fp8_grouped_linears``;
``w2`` of the MoE layer) and the fused up-projection (``w1``/``w3``). A bf16 wgrad changes
only ``dW``: the forward output is bitwise the FP8 one, ``dx`` bitwise that of the same
(folded) dgrad, whose ``grad_out`` is then quantized rowwise alone, in one read, and ``dW``
is ``torch._grouped_mm`` on the unquantized operands, checked against float32.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ops
from ops.wgrad_precision import (
    ACCUMULATING_FP8_WGRAD_MIN_RATIO,
    BF16_WGRAD_MAX_ROWS_PER_GROUP,
    auto_takes_bf16,
    resolve_wgrad_precision,
)
from tests.support import DEVICE, group_sizes, offsets_from_sizes, sqnr_db

pytestmark = pytest.mark.auto_choices

BF16_WGRAD = ops.Fp8Recipe(wgrad_precision="bf16")
FP8_WGRAD = ops.Fp8Recipe(wgrad_precision="fp8")


def reference_wgrad(grad_out: torch.Tensor, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``grad_out[g]^T @ x[g]`` per group in float32 (rows past ``offs[-1]`` ignored)."""
    out, start = [], 0
    for end in offs.tolist():
        out.append(grad_out[start:end].float().T @ x[start:end].float())
        start = end
    return torch.stack(out)


def run_linears(recipe, x, weights, offs, grads):
    x = x.clone().requires_grad_()
    ws = [w.clone().requires_grad_() for w in weights]
    outs = ops.fp8_grouped_linears(x, ws, offs, recipe)
    torch.autograd.backward(outs, grads)
    return outs, x.grad, [w.grad for w in ws]


@pytest.mark.parametrize("kind", ["uniform", "empty", "one", "unaligned"])
def test_grouped_linear_bf16_wgrad(kind):
    m, k, n, e = 53, 64, 48, 4
    sizes = group_sizes(m - 6, e, kind)  # rows past offs[-1] are in no group
    offs = offsets_from_sizes(sizes)
    torch.manual_seed(0)
    x = torch.randn(m, k, device=DEVICE).bfloat16()
    weights = [torch.randn(e, n, k, device=DEVICE).bfloat16() * 0.1 for _ in range(2)]
    grads = [torch.randn(m, n, device=DEVICE).bfloat16() for _ in range(2)]
    outs, dx, dws = run_linears(BF16_WGRAD, x, weights, offs, grads)
    # The same folded dgrad as the FP8 wgrad's (grad_out's rows alone, bitwise those of its two forms).
    fp8_outs, fp8_dx, fp8_dws = run_linears(FP8_WGRAD, x, weights, offs, grads)
    for out, fp8_out in zip(outs, fp8_outs):
        assert torch.equal(out, fp8_out)
    assert torch.equal(dx, fp8_dx)
    for dw, fp8_dw, grad, w in zip(dws, fp8_dws, grads, weights):
        ref = reference_wgrad(grad, x, offs)
        assert dw.dtype == w.dtype and dw.shape == w.shape
        torch.testing.assert_close(dw.float(), ref, rtol=1.6e-2, atol=1e-2 * float(ref.abs().amax()) + 1e-6)
        assert sqnr_db(dw, ref) > sqnr_db(fp8_dw, ref) + 5  # bf16 is more accurate than FP8
        for g, size in enumerate(sizes):
            if size == 0:
                assert (dw[g] == 0).all()


def test_grouped_linear_bf16_wgrad_propagates_nan_to_its_group_only():
    m, k, n, e = 32, 64, 32, 4
    offs = offsets_from_sizes([8, 8, 8, 8])
    x = torch.randn(m, k, device=DEVICE).bfloat16()
    x[10, 5] = float("nan")  # group 1
    w = torch.randn(e, n, k, device=DEVICE).bfloat16()
    _, _, (dw,) = run_linears(BF16_WGRAD, x, [w], offs, [torch.randn(m, n, device=DEVICE).bfloat16()])
    assert dw[1, :, 5].isnan().all()
    assert not dw[[0, 2, 3]].isnan().any()


def test_bf16_wgrad_saves_x_instead_of_its_fp8_form():
    m, k, n, e = 64, 64, 32, 4
    offs = offsets_from_sizes([16] * 4)
    x = torch.randn(m, k, device=DEVICE).bfloat16().requires_grad_()
    w = torch.randn(e, n, k, device=DEVICE).bfloat16().requires_grad_()
    saved = {
        name: ops.saved_tensor_bytes(lambda r=recipe: ops.fp8_grouped_linear(x, w, offs, r), exclude=[x, w])
        for name, recipe in (("bf16", BF16_WGRAD), ("fp8", FP8_WGRAD))
    }
    # x itself is excluded (saved by reference); the FP8 wgrad keeps x^T in FP8 on top.
    assert saved["bf16"] < saved["fp8"]


def launched_kernels(monkeypatch) -> list[str]:
    """The names of the Helion kernels launched from now on (appended as they run)."""
    import sys

    import kernels_helion._launch as launch_module

    names, real = [], launch_module.launch

    def counting(kernel, args, config):
        names.append(kernel.fn.__name__)
        return real(kernel, args, config)

    for name, module in list(sys.modules.items()):
        if name.startswith("kernels_helion.") and getattr(module, "launch", None) is real:
            monkeypatch.setattr(module, "launch", counting)
    return names


@pytest.mark.parametrize("layer", ["grouped_linear", "moe"])
def test_bf16_wgrad_reads_grad_out_once_and_folds_the_weights(layer, monkeypatch):
    """With a bf16 wgrad, backward quantizes each grad_out rowwise only (no two-pass, no wgrad form) and the
    weights take the folded forms (quantized once, FP8 bytes transposed), never the two-layout quantizer.
    The MoE layer runs SwiGLU's backward in the down-projection's backward and its up-projection quantizes
    grad_gate_up rowwise only, right before its dgrad."""
    torch.manual_seed(0)
    m, k, n, e = 40, 64, 48, 4
    offs = offsets_from_sizes([10, 0, 17, 9])
    x = torch.randn(m, k, device=DEVICE).bfloat16()
    if layer == "grouped_linear":
        weights = [torch.randn(e, n, k, device=DEVICE).bfloat16() * 0.1]
        names = launched_kernels(monkeypatch)
        run_linears(BF16_WGRAD, x, weights, offs, [torch.randn(m, n, device=DEVICE).bfloat16()])
    else:
        fp8, _ = moe_layers("bf16")
        probs = torch.rand(m, 3, device=DEVICE).softmax(-1)
        experts = torch.randint(0, 4, (m, 3), device=DEVICE)
        names = launched_kernels(monkeypatch)
        layer_grads(fp8, x, probs, experts, torch.randn(m, 64, device=DEVICE).bfloat16())
    assert names, "no kernel launch was seen"
    assert not [name for name in names if "cols_grouped" in name or "both_layouts" in name or "wgrad" in name], names
    if layer == "moe":
        # SwiGLU's backward (weighted, in w2's backward), then grad_gate_up's folded rows, then the dgrad (after
        # the launch that lists its row items, grouped_gemm.work_item_table).
        assert "swiglu_backward_quantized_kernel" not in names and names.count("swiglu_backward_kernel") == 1, names
        after = [n for n in names[names.index("swiglu_backward_kernel") + 1 :] if n != "work_item_table_kernel"][:2]
        assert after == ["quantize_rowwise_rows_kernel", "grouped_mm_2d3d_kernel"], names


def moe_layers(precision: str, accumulation: str = "off"):
    torch.manual_seed(0)
    bf16 = ops.MoE(64, 48, 4, 3, device=DEVICE)
    fp8 = copy.deepcopy(bf16)
    ops.convert_to_fp8(
        fp8.experts, ops.Fp8Recipe(wgrad_precision=precision, options=ops.RowwiseOptions(wgrad_accumulation=accumulation))
    )
    return fp8, bf16


def layer_grads(layer, x, probs, experts, grad):
    x = x.clone().requires_grad_()
    out = layer.apply_experts(x, probs, experts)
    out.backward(grad)
    e = layer.experts
    return {"out": out, "dx": x.grad, "dw1": e.w1.grad, "dw2": e.w2.grad, "dw3": e.w3.grad}


@pytest.mark.parametrize("tokens", [37, 1])
def test_moe_layer_bf16_wgrad(tokens):
    """The fused layer with a bf16 wgrad: out bitwise the FP8-wgrad layer's; every dW at least as near
    bf16's as the FP8 wgrad's; an expert with no pairs gets 0."""
    layers = {p: moe_layers(p) for p in ("bf16", "fp8")}
    x = torch.randn(tokens, 64, device=DEVICE).bfloat16()
    experts = torch.randint(1, 3, (tokens, 3), device=DEVICE)  # experts 0 and 3 get none ...
    experts[0] = torch.tensor([2, 2, 3])  # ... but expert 3 one pair, expert 2 a token twice
    probs = torch.rand(tokens, 3, device=DEVICE).softmax(-1)
    grad = torch.randn(tokens, 64, device=DEVICE).bfloat16()
    got = {p: layer_grads(layers[p][0], x, probs, experts, grad) for p in layers}
    ref = layer_grads(layers["fp8"][1], x, probs, experts, grad)
    assert torch.equal(got["bf16"]["out"], got["fp8"]["out"])
    # The same folded dgrads: grad_gate_up's rows from SwiGLU's backward kernel, bitwise the two-form quantizer's.
    assert torch.equal(got["bf16"]["dx"], got["fp8"]["dx"])
    for key in ("dw1", "dw2", "dw3"):
        assert (got["bf16"][key][0] == 0).all()
        # Both dW carry the FP8 forward's and dgrad's noise (h, grad_h); the bf16 wgrad adds none of its own.
        bf16_db, fp8_db = sqnr_db(got["bf16"][key], ref[key]), sqnr_db(got["fp8"][key], ref[key])
        assert bf16_db > 20 and bf16_db > fp8_db - 0.5, (key, bf16_db, fp8_db)
    assert sqnr_db(got["bf16"]["dx"], ref["dx"]) > 20


@pytest.mark.parametrize("layer", ["grouped_linear", "moe"])
def test_bf16_wgrad_accumulates_in_its_epilogue(layer, monkeypatch):
    """With wgrad_accumulation on, every micro-batch after the first adds each bf16 dW into the gradient
    inside the bf16 wgrad kernel (no torch add, no FP8 wgrad), and the sums match autograd's adds."""
    torch.manual_seed(0)
    sizes = ([10, 0, 17, 9], [3, 8, 0, 1])
    x = [torch.randn(sum(s) + 2, 64, device=DEVICE).bfloat16() for s in sizes]
    grads = [torch.randn(sum(s) + 2, 48, device=DEVICE).bfloat16() for s in sizes]
    moe_x = [torch.randn(t, 64, device=DEVICE).bfloat16() for t in (20, 9)]
    moe_grads = [torch.randn(t, 64, device=DEVICE).bfloat16() for t in (20, 9)]
    w = torch.randn(4, 48, 64, device=DEVICE).bfloat16() * 0.1
    results = {}
    for target in ("off", "grad", "main_grad"):
        recipe = ops.Fp8Recipe(wgrad_precision="bf16", options=ops.RowwiseOptions(wgrad_accumulation=target))
        if layer == "grouped_linear":
            params = [torch.nn.Parameter(w.clone())]
            steps = [
                (lambda xi=xi, gi=gi, s=s: ops.fp8_grouped_linears(xi, params, offsets_from_sizes(s), recipe)[0]
                 .backward(gi))
                for xi, gi, s in zip(x, grads, sizes)
            ]
        else:
            module = moe_layers("bf16", target)[0]
            params = [module.experts.w1, module.experts.w2, module.experts.w3]
            steps = [(lambda xi=xi, gi=gi: module(xi).backward(gi)) for xi, gi in zip(moe_x, moe_grads)]
        steps[0]()
        names = launched_kernels(monkeypatch)
        steps[1]()
        monkeypatch.undo()
        wgrads = [n for n in names if "wgrad" in n]
        if target == "off":
            assert not wgrads, names
        else:
            assert wgrads == ["grouped_mm_wgrad_bf16_kernel"] * len(params), names
        results[target] = [p.main_grad if target == "main_grad" else p.grad.float() for p in params]
        if target == "main_grad":
            assert all(p.grad is None for p in params)
    for off, grad, main in zip(results["off"], results["grad"], results["main_grad"]):
        # "off" rounds each micro-batch's dW to bf16 before autograd's bf16 add; "grad" rounds the fp32
        # sum once; "main_grad" keeps it in fp32: all within bf16 rounding of each other.
        scale = float(off.abs().amax())
        torch.testing.assert_close(grad, off, rtol=1e-2, atol=1e-2 * scale)
        torch.testing.assert_close(main, off, rtol=1e-2, atol=1e-2 * scale)


@pytest.mark.whole_suite_only
def test_bf16_wgrad_is_deterministic():
    layer, _ = moe_layers("bf16")
    x = torch.randn(40, 64, device=DEVICE).bfloat16()
    probs, experts = (t.detach() for t in layer.route(x))
    grad = torch.randn(40, 64, device=DEVICE).bfloat16()
    first = layer_grads(layer, x, probs, experts, grad)
    layer.zero_grad(set_to_none=True)
    second = layer_grads(layer, x, probs, experts, grad)
    for key in first:
        assert torch.equal(first[key], second[key]), key


def test_recipe_rejects_unknown_precision():
    with pytest.raises(ValueError, match=r"wgrad_precision must be one of \['auto', 'fp8', 'bf16'\]"):
        ops.Fp8Recipe(wgrad_precision="fp16")
    assert ops.Fp8Recipe().wgrad_precision == "auto"


def test_explicit_bf16_where_it_cannot_run_raises_before_any_kernel():
    x = torch.randn(16, 60, device=DEVICE).bfloat16()
    with pytest.raises(ValueError, match="multiple of 8"):
        resolve_wgrad_precision(BF16_WGRAD, x, 16, 2, 32, True)
    with pytest.raises(ValueError, match="needs x's values"):
        resolve_wgrad_precision(BF16_WGRAD, x[:, :56], 16, 2, 32, False)
    # Through the op: FP8 rows made elsewhere (expert parallelism's FP8 dispatch).
    offs = offsets_from_sizes([8, 8])
    x = torch.randn(16, 64, device=DEVICE).bfloat16()
    data, scales = torch.ops.fp8moe.quantize_rowwise_rows(x, torch.float8_e4m3fn, False)
    w = torch.randn(2, 32, 64, device=DEVICE).bfloat16().requires_grad_()
    assert not BF16_WGRAD.takes_prequantized_rows and ops.Fp8Recipe().takes_prequantized_rows
    with pytest.raises(ValueError, match="wgrad_precision other than 'bf16'"):
        ops.fp8_grouped_linears(x, [w], offs, BF16_WGRAD, x_fp8=(data, scales))
    # auto takes FP8 there, and FP8 everywhere on the CPU.
    auto = ops.Fp8Recipe()
    assert not resolve_wgrad_precision(auto, x, 16, 2, 32, False)
    assert not resolve_wgrad_precision(auto, torch.empty(16, 64, dtype=torch.bfloat16), 16, 2, 32, True)
    assert not resolve_wgrad_precision(FP8_WGRAD, x, 16, 2, 32, True)


def test_auto_rule():
    bf16 = torch.bfloat16
    small = BF16_WGRAD_MAX_ROWS_PER_GROUP * 128 - 1  # groups averaging just under the bound
    assert auto_takes_bf16(True, bf16, small, 128, 768, 2048, True)
    assert not auto_takes_bf16(True, bf16, small + 1, 128, 768, 2048, True)  # large groups: FP8
    assert not auto_takes_bf16(False, bf16, small, 128, 768, 2048, True)  # not Hopper
    assert not auto_takes_bf16(True, torch.float16, small, 128, 768, 2048, True)
    assert not auto_takes_bf16(True, bf16, small, 128, 770, 2048, True)  # unaligned N
    assert not auto_takes_bf16(True, bf16, small, 128, 768, 2048, False)  # FP8 rows only


def test_auto_rule_adding_into_grad():
    # Adding into a 16-bit .grad, FP8 where each group's dW is large against its rows
    # (N * K / (rows * (N + K)) >= ACCUMULATING_FP8_WGRAD_MIN_RATIO), both projections alike.
    bf16 = torch.bfloat16
    for n, k in ((2048, 7168), (7168, 2048)):  # DeepSeek-V3-like, 256 rows an expert: ratio 6.2
        assert auto_takes_bf16(True, bf16, 65536, 256, n, k, True, "off")
        assert auto_takes_bf16(True, bf16, 65536, 256, n, k, True, "main_grad")
        assert not auto_takes_bf16(True, bf16, 65536, 256, n, k, True, "grad")
    for n, k in ((768, 2048), (2048, 768)):  # Qwen3-30B-like, 512 rows an expert: ratio 1.09
        assert auto_takes_bf16(True, bf16, 65536, 128, n, k, True, "grad")
    # At the bound: rows * (N + K) * ratio == N * K takes FP8, one row more bf16.
    n = k = 6 * 64
    rows = int(n * k / (ACCUMULATING_FP8_WGRAD_MIN_RATIO * (n + k)))
    assert rows * (n + k) * ACCUMULATING_FP8_WGRAD_MIN_RATIO == n * k
    assert not auto_takes_bf16(True, bf16, rows * 4, 4, n, k, True, "grad")
    assert auto_takes_bf16(True, bf16, rows * 4 + 1, 4, n, k, True, "grad")


@pytest.mark.cuda
@pytest.mark.parametrize("tokens, dim, hidden, experts", [(8192, 2048, 768, 128), (2048, 7168, 2048, 64)])
def test_moe_layer_bf16_wgrad_at_real_shapes(tokens, dim, hidden, experts):
    torch.manual_seed(0)
    bf16 = ops.MoE(dim, hidden, experts, 8, device=DEVICE)
    fp8 = copy.deepcopy(bf16)
    ops.convert_to_fp8(fp8.experts, BF16_WGRAD)
    x = torch.randn(tokens, dim, device=DEVICE).bfloat16()
    probs, top = (t.detach() for t in bf16.route(x))
    grad = torch.randn(tokens, dim, device=DEVICE).bfloat16()
    got, ref = layer_grads(fp8, x, probs, top, grad), layer_grads(bf16, x, probs, top, grad)
    for key in ("dw1", "dw2", "dw3"):
        assert sqnr_db(got[key], ref[key]) > 20, key
    assert sqnr_db(got["dx"], ref["dx"]) > 23


def test_auto_on_hopper_takes_bf16_for_the_rowwise_recipe_only(monkeypatch):
    from ops import wgrad_precision

    monkeypatch.setattr(wgrad_precision, "on_hopper", lambda x: True)
    x = torch.randn(16, 64, device=DEVICE).bfloat16()
    assert resolve_wgrad_precision(ops.Fp8Recipe(), x, 16, 2, 32, True)
    assert not resolve_wgrad_precision(ops.Fp8Recipe(name="blockwise"), x, 16, 2, 32, True)
    assert not resolve_wgrad_precision(ops.Fp8Recipe(name="mxfp8"), x, 16, 2, 32, True)
    # Gradient accumulation too: the bf16 wgrad kernel adds into the gradient in its epilogue.
    accumulate = ops.Fp8Recipe(options=ops.RowwiseOptions(wgrad_accumulation="grad"))
    assert resolve_wgrad_precision(accumulate, x, 16, 2, 32, True)


def test_bf16_wgrad_compiles_to_the_same_gradients():
    m, k, n, e = 40, 64, 32, 4
    offs = offsets_from_sizes([10, 0, 17, 13])
    x = torch.randn(m, k, device=DEVICE).bfloat16()
    w = torch.randn(e, n, k, device=DEVICE).bfloat16()
    grad = torch.randn(m, n, device=DEVICE).bfloat16()

    def step(fn):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        fn(xi, wi).backward(grad)
        return xi.grad, wi.grad

    def linear(xi, wi):
        return ops.fp8_grouped_linear(xi, wi, offs, BF16_WGRAD)

    eager = step(linear)
    compiled = step(torch.compile(linear, fullgraph=True))
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_bf16_wgrad_bounds_bad_offsets():
    """Group ends past the rows or decreasing (bad input, unchecked on the device) reach CUTLASS bounded
    and non-decreasing: the groups of the clamped ends, never a read past the rows."""
    from ops.wgrad_precision import grouped_mm_wgrad_bf16

    gen = torch.Generator(device=DEVICE).manual_seed(4)
    grad_out = torch.randn(20, 16, device=DEVICE, generator=gen).bfloat16()
    x = torch.randn(20, 32, device=DEVICE, generator=gen).bfloat16()
    bad = torch.tensor([3, 1, 100], dtype=torch.int32, device=DEVICE)
    bounded = torch.tensor([3, 3, 20], dtype=torch.int32, device=DEVICE)
    got = grouped_mm_wgrad_bf16(grad_out, x, bad, torch.float32)
    assert torch.equal(got, grouped_mm_wgrad_bf16(grad_out, x, bounded, torch.float32))
    assert not got[1].any()
