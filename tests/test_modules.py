"""Modules, ``convert_to_fp8``, ``torch.compile`` of an MoE layer, and a smoke run of the training demo."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import ops
from benchmarks import moe_training_demo
from tests.support import DEVICE, sqnr_db

DIM, HIDDEN, EXPERTS = 32, 48, 4


class TorchtitanStyleExperts(nn.Module):
    """Stands in for torchtitan's GroupedExperts: only the parameter layout and the call matter."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM, dtype=torch.bfloat16, device=DEVICE) * 0.2)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN, dtype=torch.bfloat16, device=DEVICE) * 0.2)
        self.w3 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM, dtype=torch.bfloat16, device=DEVICE) * 0.2)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        h = torch.nn.functional.silu(torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(x, self.w3.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = ops.GroupedLinear(EXPERTS, DIM, DIM, device=DEVICE)
        self.moe = nn.ModuleDict({"experts": TorchtitanStyleExperts(), "shared": nn.Linear(DIM, DIM)})
        self.ours = ops.GroupedExperts(DIM, HIDDEN, EXPERTS, device=DEVICE)


def test_convert_with_filter_shares_parameters():
    model = Block()
    params_before = {name: p for name, p in model.named_parameters()}
    ops.convert_to_fp8(model, ops.Fp8Recipe(), filter_fn=lambda module, fqn: fqn != "ours")
    assert type(model.proj) is ops.Fp8GroupedLinear
    assert type(model.moe["experts"]) is ops.Fp8GroupedExperts
    assert type(model.ours) is ops.GroupedExperts  # filtered out
    assert type(model.moe["shared"]) is nn.Linear  # not a grouped GEMM
    assert {name: p for name, p in model.named_parameters()} == params_before
    # Converting again is a no-op.
    experts = model.moe["experts"]
    ops.convert_to_fp8(model)
    assert model.moe["experts"] is experts and type(model.ours) is ops.Fp8GroupedExperts


def test_convert_a_module_itself_and_bad_arguments():
    converted = ops.convert_to_fp8(ops.GroupedLinear(EXPERTS, DIM, DIM, device=DEVICE))
    assert isinstance(converted, ops.Fp8GroupedLinear)
    with pytest.raises(TypeError, match="recipe must be an ops.Fp8Recipe"):
        ops.convert_to_fp8(Block(), "rowwise")
    with pytest.raises(TypeError, match="filter_fn must be callable"):
        ops.convert_to_fp8(Block(), filter_fn="experts")


def test_converted_torchtitan_experts_track_bf16():
    experts = TorchtitanStyleExperts()
    counts = torch.tensor([30, 0, 1, 33], dtype=torch.int32, device=DEVICE)
    x = torch.randn(int(counts.sum()), DIM, dtype=torch.bfloat16, device=DEVICE)
    grad = torch.randn_like(x)

    def fwd_bwd(module):
        xr = x.clone().requires_grad_()
        out = module(xr, counts)
        out.backward(grad)
        grads = [xr.grad] + [p.grad.clone() for p in (module.w1, module.w2, module.w3)]
        module.zero_grad(set_to_none=True)
        return [out] + grads

    reference = fwd_bwd(experts)
    fp8 = fwd_bwd(ops.convert_to_fp8(experts))
    for name, a, r in zip(["out", "dx", "dw1", "dw2", "dw3"], fp8, reference):
        assert sqnr_db(a, r) >= 20, name  # three chained FP8 GEMMs


@pytest.mark.parametrize(
    "options",
    [{}, {"fused_swiglu_backward": True}, {"down_dgrad_token_rows": True}],
    ids=["default", "fused_swiglu_backward", "down_dgrad_token_rows"],
)
def test_compile_fullgraph_moe_forward_backward(options):
    """No graph break through routing, permutation, and FP8 experts, forward and backward (SwiGLU's
    backward apart, and in the down-projection's dgrad: ``RowwiseOptions.fused_swiglu_backward``;
    that dgrad on token rows: ``RowwiseOptions.down_dgrad_token_rows``).

    Inductor compiles the PyTorch ops around the custom ops (C++ on CPU, Triton on
    CUDA); the custom ops run as they are.
    """
    torch._dynamo.reset()
    shape = dataclasses.replace(moe_training_demo.CPU_SHAPE, layers=1)
    recipe = ops.Fp8Recipe(options=ops.RowwiseOptions(**options))
    model = ops.convert_to_fp8(moe_training_demo.make_model(shape, 0, DEVICE), recipe)
    x = torch.randn(shape.tokens, shape.dim, dtype=torch.bfloat16, device=DEVICE)
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    out.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    eager = model(x)
    eager.float().square().mean().backward()
    # Inductor may fuse the router's softmax differently: equal up to rounding.
    assert sqnr_db(out, eager) >= 30
    for n, p in model.named_parameters():
        assert sqnr_db(grads[n], p.grad) >= 25, n


@pytest.mark.whole_suite_only
def test_training_demo_smoke(tmp_path, capsys):
    result = moe_training_demo.run(steps=2, plot_path=tmp_path / "curve.png", out_path=tmp_path / "demo.md")
    assert len(result["fp8_loss"]) == 2 and all(map(torch.isfinite, torch.tensor(result["fp8_loss"])))
    assert result["max_rel_gap"] < 0.5
    assert result["gap_within_bar"] == (round(100 * result["max_rel_gap"], 2) <= 1.0)
    summary = (tmp_path / "demo.md").read_text()
    assert "largest relative loss gap" in summary and "a report, not the bar" in summary
    assert "2 steps" in summary
    # The plot needs the [demo] extra (matplotlib); without it the summary says it was skipped.
    assert (tmp_path / "curve.png").exists() or "plot skipped" in summary
    out = capsys.readouterr().out
    # The header tells the steps run; progress to a pipe is whole lines (no carriage returns).
    assert "'steps': 2" in out and "\r" not in out and "bf16 [" in out
    assert moe_training_demo.DEFAULT_PLOT.parent.resolve() != moe_training_demo.Path(moe_training_demo.__file__).parent
