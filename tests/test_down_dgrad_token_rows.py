"""``RowwiseOptions.down_dgrad_token_rows``: which form ``w2``'s dgrad takes, and ``"auto"``'s rule
(``ops.down_dgrad_token_rows``). The two forms themselves are checked in ``tests/test_moe_fused.py``
(``test_down_dgrad_on_token_rows``). ``RowwiseOptions.down_wgrad_token_rows``: ``w2``'s FP8 wgrad on the
token rows too (``RecipeKernels.token_rows_wgrad_operands``)."""

from __future__ import annotations

import copy

import pytest
import torch

import ops
from ops import down_dgrad_token_rows as token_rows_choice
from ops import wgrad_precision
from ops.down_dgrad_token_rows import (
    TOKEN_ROWS_MIN_ROWS_PER_GROUP,
    auto_takes_token_rows,
    resolve_down_dgrad_token_rows,
)
from tests.support import DEVICE, offsets_from_sizes, record_kernel_calls, sqnr_db

pytestmark = pytest.mark.auto_choices


@pytest.mark.parametrize("value", [1, 0, "yes", "Auto", None])
def test_bad_values_are_refused(value):
    with pytest.raises(TypeError, match=r"down_dgrad_token_rows must be True, False or 'auto'"):
        ops.RowwiseOptions(down_dgrad_token_rows=value)


def test_default_is_auto():
    assert ops.RowwiseOptions().down_dgrad_token_rows == "auto"
    assert ops.Fp8Recipe().down_dgrad_token_rows == "auto"
    assert ops.Fp8Recipe(name="blockwise").down_dgrad_token_rows is False
    assert ops.Fp8Recipe(name="mxfp8").down_dgrad_token_rows is False


def test_auto_rule():
    experts, enough = 128, TOKEN_ROWS_MIN_ROWS_PER_GROUP * 128
    assert auto_takes_token_rows(True, True, enough, experts)
    assert not auto_takes_token_rows(True, True, enough - 1, experts)  # small groups: folded
    assert not auto_takes_token_rows(False, True, enough, experts)  # not Hopper
    assert not auto_takes_token_rows(True, False, enough, experts)  # bf16 wgrad or none
    assert not auto_takes_token_rows(True, True, 0, 0)


def test_resolve(monkeypatch):
    x = torch.randn(4, 8, device=DEVICE).bfloat16()
    rows = TOKEN_ROWS_MIN_ROWS_PER_GROUP * 4
    for value in (True, False):
        recipe = ops.Fp8Recipe(options=ops.RowwiseOptions(down_dgrad_token_rows=value))
        assert resolve_down_dgrad_token_rows(recipe, x, 1, 4, fp8_wgrad=False) is value
    auto = ops.Fp8Recipe()
    monkeypatch.setattr(wgrad_precision, "on_hopper", lambda x: False)
    assert not resolve_down_dgrad_token_rows(auto, x, rows, 4, fp8_wgrad=True)
    monkeypatch.setattr(wgrad_precision, "on_hopper", lambda x: True)
    assert resolve_down_dgrad_token_rows(auto, x, rows, 4, fp8_wgrad=True)
    assert not resolve_down_dgrad_token_rows(auto, x, rows - 1, 4, fp8_wgrad=True)
    assert not resolve_down_dgrad_token_rows(ops.Fp8Recipe(name="blockwise"), x, rows, 4, fp8_wgrad=True)


@pytest.mark.parametrize("wgrad", ["fp8", "auto"])
@pytest.mark.parametrize("threshold", [1, 10**9])
def test_auto_runs_the_form_it_resolves_to(monkeypatch, wgrad, threshold):
    """On a Hopper (as the rule sees it), one ``ops.MoE`` step with ``"auto"`` equals bitwise the step with the
    form the rule picks: token rows with the FP8 wgrad from ``TOKEN_ROWS_MIN_ROWS_PER_GROUP`` rows per expert
    (lowered here to fit the CPU), else folded. ``wgrad_precision="auto"`` takes the bf16 wgrad at these small
    groups, and with it the folded form. The counted launches are the dgrads reading rows by index."""
    from ops import op_registry

    monkeypatch.setattr(wgrad_precision, "on_hopper", lambda x: True)
    monkeypatch.setattr(token_rows_choice, "TOKEN_ROWS_MIN_ROWS_PER_GROUP", threshold)
    expected_token_rows = wgrad == "fp8" and threshold == 1
    dgrads_on_token_rows = []
    real = op_registry._functions["grouped_mm_2d3d"]

    def recorded(*args, **kwargs):
        if len(args) > 6 and args[6] is not None:
            dgrads_on_token_rows.append(args)
        return real(*args, **kwargs)

    monkeypatch.setitem(op_registry._functions, "grouped_mm_2d3d", recorded)
    torch.manual_seed(0)
    bf16 = ops.MoE(64, 32, 4, 2, device=DEVICE)
    x = torch.randn(40, 64, device=DEVICE).bfloat16()
    grad = torch.randn(40, 64, device=DEVICE).bfloat16()
    got = {}
    for name, value in (("auto", "auto"), ("chosen", expected_token_rows)):
        layer = copy.deepcopy(bf16)
        recipe = ops.Fp8Recipe(wgrad_precision=wgrad, options=ops.RowwiseOptions(down_dgrad_token_rows=value))
        ops.convert_to_fp8(layer, recipe, filter_fn=lambda m, fqn: "experts" in fqn)
        dgrads_on_token_rows.clear()
        xx = x.clone().requires_grad_()
        out = layer(xx)
        out.backward(grad)
        assert len(dgrads_on_token_rows) == int(expected_token_rows), name
        got[name] = [out, xx.grad, *(p.grad for p in layer.parameters())]
    for a, b in zip(got["auto"], got["chosen"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("target", ["grad", "main_grad"])
def test_token_rows_accumulate_like_the_folded_form(target):
    """With ``wgrad_accumulation``, two micro-batches on token rows (the wgrad on the pair rows) add ``w2``'s
    gradient into its target bitwise as the folded form does (the same wgrad operands); ``w1``'s and ``w3``'s differ by the dgrad's
    rounding only (``test_down_dgrad_on_token_rows``)."""
    torch.manual_seed(0)
    bf16 = ops.MoE(64, 32, 4, 2, device=DEVICE)
    xs = [torch.randn(40, 64, device=DEVICE).bfloat16() for _ in range(2)]
    grads = [torch.randn(40, 64, device=DEVICE).bfloat16() for _ in range(2)]
    got = {}
    for token_rows in (False, True):
        layer = copy.deepcopy(bf16)
        options = ops.RowwiseOptions(
            down_dgrad_token_rows=token_rows, down_wgrad_token_rows=False, wgrad_accumulation=target
        )
        ops.convert_to_fp8(layer, ops.Fp8Recipe(wgrad_precision="fp8", options=options),
                           filter_fn=lambda m, fqn: "experts" in fqn)
        for x, grad in zip(xs, grads, strict=True):
            layer(x.clone().requires_grad_()).backward(grad)
        e = layer.experts
        got[token_rows] = {n: getattr(getattr(e, n), target) for n in ("w1", "w2", "w3")}
    for n in ("w1", "w2", "w3"):
        assert got[True][n] is not None and not got[True][n].isnan().any(), n
    assert torch.equal(got[True]["w2"], got[False]["w2"])
    for n in ("w1", "w3"):
        assert sqnr_db(got[True][n], got[False][n]) > 23, n


def test_wgrad_token_rows_option():
    assert ops.RowwiseOptions().down_wgrad_token_rows is True
    assert ops.Fp8Recipe(options=ops.RowwiseOptions(down_wgrad_token_rows=False)).down_wgrad_token_rows is False
    assert ops.Fp8Recipe(name="blockwise").down_wgrad_token_rows is False
    for value in ("auto", 1, None):
        with pytest.raises(TypeError, match="down_wgrad_token_rows must be a bool"):
            ops.RowwiseOptions(down_wgrad_token_rows=value)


def test_wgrad_token_rows_operands_against_plain_pytorch():
    """``token_rows_wgrad_operands``: the gradient's operand is its token rows' FP8 bytes gathered by pair into
    the padded token layout (scales 1), ``x``'s is its FP8 rows times ``weight * token scale * row scale``
    quantized per (group, column), both bitwise their plain-PyTorch construction (an empty group, a group of
    one, a token chosen twice, a pair whose token is out of range adding nothing); the wgrad GEMM on them
    is ``sum_i w_i grad[t_i]^T x_i`` to FP8 accuracy."""
    from ops.autograd import RowwiseFp8GroupedLinear
    from ops.grouped_linear_autograd import QuantizedActivation
    from tests.reference import ref_pad_token_columns, ref_quantize_rowwise, ref_quantize_rowwise_cols_grouped

    torch.manual_seed(0)
    kernels = RowwiseFp8GroupedLinear.kernels
    quant = kernels.quant_options(ops.Fp8Recipe())
    tokens, dim, hidden = 30, 48, 40
    offs = offsets_from_sizes([0, 1, 33, 26])
    pairs = int(offs[-1])
    pair_tokens = torch.randint(0, tokens, (pairs,), device=DEVICE, dtype=torch.int32)
    pair_tokens[2] = pair_tokens[3]  # a token in one group twice
    pair_tokens[40] = tokens  # out of range: a zero row
    pair_weights = torch.rand(pairs, device=DEVICE)
    grad = torch.randn(tokens, dim, device=DEVICE).bfloat16()
    h = torch.randn(pairs, hidden, device=DEVICE).bfloat16()
    grad_rows = QuantizedActivation(*ref_quantize_rowwise(grad, *quant), None, None, None)
    h_rows = QuantizedActivation(*ref_quantize_rowwise(h, *quant), None, None, None)
    got_grad, got_h = kernels.token_rows_wgrad_operands(grad_rows, (pair_tokens, pair_weights), h_rows, offs, quant)

    # A pair whose token is out of range reads a clamped row's bytes; its multiplier (below) is 0.
    valid = pair_tokens < tokens
    gathered = grad_rows.data.float()[pair_tokens.clamp(max=tokens - 1).long()]
    expected_grad_t = ref_pad_token_columns(gathered.to(quant[0]).t().contiguous(), offs, 128)
    assert torch.equal(got_grad.data_t.view(torch.uint8), expected_grad_t.view(torch.uint8))
    assert torch.equal(got_grad.scales_t, torch.ones(offs.numel(), dim, device=DEVICE))
    multipliers = torch.where(
        valid, pair_weights * grad_rows.scales[pair_tokens.clamp(max=tokens - 1).long()] * h_rows.scales, 0.0
    )
    eqt, ecs = ref_quantize_rowwise_cols_grouped(h_rows.data.float() * multipliers[:, None], offs, *quant)
    assert torch.equal(got_h.data_t.view(torch.uint8), ref_pad_token_columns(eqt, offs, 128).view(torch.uint8))
    assert torch.equal(got_h.scales_t, ecs)

    dw = kernels.grouped_mm_wgrad(got_grad, got_h, offs, torch.float32)
    exact = torch.zeros(offs.numel(), dim, hidden, device=DEVICE)
    start = 0
    for g, end in enumerate(offs.tolist()):
        for i in range(start, end):
            if valid[i]:
                exact[g] += pair_weights[i] * grad[pair_tokens[i]].float()[:, None] * h[i].float()[None, :]
        start = end
    assert torch.equal(dw[0], torch.zeros_like(dw[0]))  # the empty group
    assert sqnr_db(dw[1:], exact[1:]) > 22


@pytest.mark.parametrize("accumulation", ["off", "main_grad"])
def test_wgrad_on_token_rows(monkeypatch, accumulation):
    """One ``ops.MoE`` step with the dgrad on token rows, ``down_wgrad_token_rows`` on against off: the
    output and every gradient but ``w2``'s bitwise the same; ``w2``'s from the token rows' bytes and ``h``'s
    FP8 rows requantized (no gathered two passes over the gradient, no token-layout copy of ``h`` in
    forward), as close to the bf16 layer as the other form's within 1.5 dB (``h`` is rounded to FP8 twice).
    With ``main_grad``, two micro-batches add up as autograd's sum of their gradients does (fp32, to its
    rounding)."""
    torch.manual_seed(0)
    bf16 = ops.MoE(64, 32, 4, 2, device=DEVICE)
    xs = [torch.randn(40, 64, device=DEVICE).bfloat16() for _ in range(2)]
    grads = [torch.randn(40, 64, device=DEVICE).bfloat16() for _ in range(2)]
    calls = record_kernel_calls(monkeypatch, ("transpose_to_token_groups", "quantize_rowwise_cols_grouped",
                                              "quantize_rowwise_rows_and_transpose"))
    got, launches = {}, {}
    for on in (False, True, "bf16"):
        layer = copy.deepcopy(bf16)
        if on != "bf16":
            options = ops.RowwiseOptions(
                down_dgrad_token_rows=True, down_wgrad_token_rows=on, wgrad_accumulation=accumulation
            )
            ops.convert_to_fp8(layer, ops.Fp8Recipe(wgrad_precision="fp8", options=options),
                               filter_fn=lambda m, fqn: "experts" in fqn)
        else:
            layer = layer.bfloat16()
        for recorded_calls in calls.values():
            recorded_calls.clear()
        micro_batches = 2 if accumulation != "off" and on != "bf16" else 1
        for x, grad in zip(xs[:micro_batches], grads[:micro_batches], strict=True):
            xx = x.clone().requires_grad_()
            out = layer(xx)
            out.backward(grad)
        grads_of = {n: (p.main_grad if accumulation == "main_grad" and "experts" in n and on != "bf16" else p.grad)
                    for n, p in layer.named_parameters()}
        got[on] = {"out": out, "dx": xx.grad, **grads_of}
        launches[on] = (
            sum(1 for args in calls["transpose_to_token_groups"] if len(args) > 3 and args[3] is not None),
            sum(1 for args in calls["quantize_rowwise_cols_grouped"] if args[0].dtype == torch.float8_e4m3fn),
            sum(1 for args in calls["quantize_rowwise_cols_grouped"] if len(args) > 6),
            len(calls["quantize_rowwise_rows_and_transpose"]),
        )
    # (gathered token-row bytes, FP8 rows requantized, gathered gradient rows quantized, x's rows and
    # token layout in one pass): the up-projection's x is gathered into the token layout either way.
    micro_batches = 2 if accumulation != "off" else 1
    assert launches[True] == (2 * micro_batches, micro_batches, 0, 0)
    assert launches[False] == (micro_batches, 0, micro_batches, micro_batches)
    for key in got[True]:
        if key != "experts.w2":
            assert torch.equal(got[True][key], got[False][key]), key
    w2 = got[True]["experts.w2"]
    assert not w2.isnan().any() and not torch.equal(w2, got[False]["experts.w2"])
    if accumulation == "off":
        assert sqnr_db(w2, got[False]["experts.w2"]) > 20
        assert sqnr_db(w2, got["bf16"]["experts.w2"]) > sqnr_db(got[False]["experts.w2"], got["bf16"]["experts.w2"]) - 1.5
    else:
        # Each micro-batch alone, summed in fp32: the epilogue's additions in the same precision.
        singles = []
        for x, grad in zip(xs, grads, strict=True):
            layer = copy.deepcopy(bf16)
            options = ops.RowwiseOptions(down_dgrad_token_rows=True, down_wgrad_token_rows=True)
            ops.convert_to_fp8(layer, ops.Fp8Recipe(wgrad_precision="fp8", options=options),
                               filter_fn=lambda m, fqn: "experts" in fqn)
            layer(x.clone().requires_grad_()).backward(grad)
            singles.append(layer.experts.w2.grad.float())
        torch.testing.assert_close(w2, singles[0] + singles[1], rtol=1e-2, atol=1e-2)
