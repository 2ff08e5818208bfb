"""``RowwiseOptions.down_dgrad_token_rows``: which form ``w2``'s dgrad takes, and ``"auto"``'s rule
(``ops.down_dgrad_token_rows``). The two forms themselves are checked in ``tests/test_moe_fused.py``
(``test_down_dgrad_on_token_rows``)."""

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
from tests.support import DEVICE

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
    """With ``wgrad_accumulation``, two micro-batches on token rows add ``w2``'s gradient into its target
    bitwise as the folded form does (the same wgrad operands); ``w1``'s and ``w3``'s differ by the dgrad's
    rounding only (``test_down_dgrad_on_token_rows``)."""
    from tests.support import sqnr_db

    torch.manual_seed(0)
    bf16 = ops.MoE(64, 32, 4, 2, device=DEVICE)
    xs = [torch.randn(40, 64, device=DEVICE).bfloat16() for _ in range(2)]
    grads = [torch.randn(40, 64, device=DEVICE).bfloat16() for _ in range(2)]
    got = {}
    for token_rows in (False, True):
        layer = copy.deepcopy(bf16)
        options = ops.RowwiseOptions(down_dgrad_token_rows=token_rows, wgrad_accumulation=target)
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
