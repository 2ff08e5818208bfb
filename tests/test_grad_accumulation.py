"""``RowwiseOptions.wgrad_accumulation``: the wgrad GEMM adds into ``.grad`` / ``main_grad`` (``ops.grad_accumulation``).

The layer is ``ops.MoE`` with FP8 experts: ``w1``/``w3`` through the fused up-projection
(``ops.moe_fused``), ``w2`` through the rowwise grouped linear, so both autograd Functions
are covered. Three micro-batches accumulate; the reference is the same layer with the
option off (autograd's add).
"""

from __future__ import annotations

import copy

import pytest
import torch

import ops
from ops import grad_accumulation
from tests.support import DEVICE, gloo_cpu_only, run_distributed

MICRO_BATCHES = 3
EXPERT_WEIGHTS = ("w1", "w2", "w3")


def recipe(target: str) -> ops.Fp8Recipe:
    # The FP8 wgrad for every target ("auto" takes bf16 for "off" on a GPU, whose adds are autograd's).
    return ops.Fp8Recipe(wgrad_precision="fp8", options=ops.RowwiseOptions(wgrad_accumulation=target))


def make_layers(dtype: torch.dtype, target: str, seed: int = 0) -> tuple[ops.MoE, ops.MoE]:
    torch.manual_seed(seed)
    reference = ops.MoE(64, 48, 4, 2, dtype=dtype, device=DEVICE)
    fused = copy.deepcopy(reference)
    ops.convert_to_fp8(reference.experts, recipe("off"))
    ops.convert_to_fp8(fused.experts, recipe(target))
    return reference, fused


def batches(dtype: torch.dtype, tokens=(37, 1, 20)) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    return [
        (torch.randn(t, 64, device=DEVICE, generator=gen).to(dtype), torch.randn(t, 64, device=DEVICE, generator=gen).to(dtype))
        for t in tokens[:MICRO_BATCHES]
    ]


def accumulate(layer: ops.MoE, data) -> None:
    for x, grad in data:
        layer(x).backward(grad)


def expert_weights(layer: ops.MoE) -> list[torch.Tensor]:
    return [getattr(layer.experts, name) for name in EXPERT_WEIGHTS]


def test_grad_target_in_fp32_is_bitwise_autograds_sum_and_stays_in_place():
    # fp32 weights: the epilogue's fp32 add is autograd's add, in the same order.
    reference, fused = make_layers(torch.float32, "grad")
    data = batches(torch.float32)
    accumulate(reference, data[:1])
    accumulate(fused, data[:1])
    grads = [w.grad for w in expert_weights(fused)]
    assert all(g is not None for g in grads)  # the first micro-batch: autograd stores the gradient
    accumulate(reference, data[1:])
    accumulate(fused, data[1:])
    for name, w_ref, w, g in zip(EXPERT_WEIGHTS, expert_weights(reference), expert_weights(fused), grads):
        assert w.grad is g, f"{name}: later micro-batches add into the same .grad"
        assert torch.equal(w.grad, w_ref.grad), name
    assert torch.equal(fused.router.weight.grad, reference.router.weight.grad)


def test_main_grad_target_is_bitwise_autograds_fp32_sum_and_leaves_grad_alone():
    reference, fused = make_layers(torch.float32, "main_grad")
    data = batches(torch.float32)
    accumulate(reference, data)
    accumulate(fused, data)
    for name, w_ref, w in zip(EXPERT_WEIGHTS, expert_weights(reference), expert_weights(fused)):
        assert w.grad is None, name
        assert w.main_grad.dtype == torch.float32
        assert torch.equal(w.main_grad, w_ref.grad), name
    ops.zero_main_grads(fused, set_to_none=False)
    assert all((w.main_grad == 0).all() for w in expert_weights(fused))
    accumulate(fused, data)  # onto zeros: 0 + x == x, bitwise the same sum
    assert all(torch.equal(w.main_grad, w_ref.grad) for w, w_ref in zip(expert_weights(fused), expert_weights(reference)))
    ops.zero_main_grads(fused)
    assert all(w.main_grad is None for w in expert_weights(fused))


def test_zero_grad_keeps_its_meaning():
    # set_to_none=True: the next micro-batch stores a fresh .grad; False: it adds into zeros.
    reference, fused = make_layers(torch.float32, "grad")
    data = batches(torch.float32)
    for layer in (reference, fused):
        accumulate(layer, data)
        layer.zero_grad(set_to_none=True)
        accumulate(layer, data[:1])
        layer.zero_grad(set_to_none=False)
        accumulate(layer, data[1:])
    for name, w_ref, w in zip(EXPERT_WEIGHTS, expert_weights(reference), expert_weights(fused)):
        assert torch.equal(w.grad, w_ref.grad), name


@pytest.mark.parametrize("target", ["grad", "main_grad"])
def test_only_a_backward_that_accumulates_into_the_weight_adds_in_place(target):
    """``.backward(inputs=[x])`` leaves the weights' gradients alone, and ``torch.autograd.grad`` returns the
    weight gradient it is asked for (the layer's with the option off) without adding it anywhere; a plain
    ``.backward()`` after them still adds in place."""
    reference, fused = make_layers(torch.float32, target)
    data = batches(torch.float32)
    for layer in (reference, fused):
        accumulate(layer, data[:1])
    held = lambda layer: [w.grad if target == "grad" or layer is reference else w.main_grad for w in expert_weights(layer)]  # noqa: E731
    before = [g.clone() for g in held(fused)]
    x, grad = data[1]
    x = x.clone().requires_grad_()
    fused(x).backward(grad, inputs=[x])
    assert all(torch.equal(g, b) for g, b in zip(held(fused), before))
    x_ref = x.detach().clone().requires_grad_()
    reference(x_ref).backward(grad, inputs=[x_ref])
    assert torch.equal(x.grad, x_ref.grad)
    asked = lambda layer: torch.autograd.grad((layer(x) * grad).sum(), expert_weights(layer))  # noqa: E731
    for name, got, want in zip(EXPERT_WEIGHTS, asked(fused), asked(reference)):
        assert torch.equal(got, want), name
    assert all(torch.equal(g, b) for g, b in zip(held(fused), before))
    accumulate(reference, data[1:])
    accumulate(fused, data[1:])
    for name, got, want in zip(EXPERT_WEIGHTS, held(fused), held(reference)):
        assert torch.equal(got, want), name


def test_weights_with_gradient_hooks_take_autograds_add():
    """A hook on a weight sees every micro-batch's gradient with ``"grad"`` (the add falls back to
    autograd's, bitwise the layer with the option off); ``"main_grad"``, which passes no gradient
    through autograd, refuses such a weight before any kernel runs."""
    reference, fused = make_layers(torch.float32, "grad")
    seen = {id(reference): [], id(fused): []}
    for layer in (reference, fused):
        for w in expert_weights(layer):
            w.register_hook(lambda g, _seen=seen[id(layer)]: _seen.append(g.clone()) or g * 0.5)
        accumulate(layer, batches(torch.float32))
    assert len(seen[id(fused)]) == len(EXPERT_WEIGHTS) * MICRO_BATCHES
    for got, want in zip(seen[id(fused)], seen[id(reference)]):
        assert torch.equal(got, want)
    for name, w_ref, w in zip(EXPERT_WEIGHTS, expert_weights(reference), expert_weights(fused)):
        assert torch.equal(w.grad, w_ref.grad), name
    _, main = make_layers(torch.float32, "main_grad")
    main.experts.w2.register_post_accumulate_grad_hook(lambda p: None)
    x, grad = batches(torch.float32)[0]
    with pytest.raises(ValueError, match="hooks registered on the weight"):
        main(x)


def test_bf16_weights_accumulate_as_accurately_as_autograd():
    """bf16 ``.grad``: the fp32 sum of the old gradient and the GEMM's fp32 result rounded once per
    micro-batch, where autograd rounds the result to bf16 first, then the sum: not bitwise, within
    one or two bf16 roundings of autograd's, and no farther from the fp32 sum. ``main_grad``: the
    fp32 sum itself, which autograd's bf16 ``.grad`` approximates to bf16 rounding."""
    reference, into_grad = make_layers(torch.bfloat16, "grad")
    _, exact = make_layers(torch.bfloat16, "main_grad")  # fp32 sum of the same GEMM results
    data = batches(torch.bfloat16)
    for layer in (reference, into_grad, exact):
        accumulate(layer, data)
    for name, w_ref, w, w_exact in zip(EXPERT_WEIGHTS, expert_weights(reference), expert_weights(into_grad), expert_weights(exact)):
        truth = w_exact.main_grad
        scale = float(truth.abs().amax())
        for target, got in (("grad", w.grad), ("main_grad", truth)):
            torch.testing.assert_close(got.float(), w_ref.grad.float(), rtol=2**-6, atol=2**-7 * scale, msg=f"{name} {target}")
        if DEVICE.type != "cpu":  # Triton's CPU interpreter truncates fp32 to bf16 (the GPU rounds to nearest)
            ours = float((w.grad.float() - truth).abs().sum())
            autograds = float((w_ref.grad.float() - truth).abs().sum())
            assert ours <= autograds * 1.01 + 1e-12, (name, ours, autograds)


def test_main_grad_refuses_a_weight_that_is_not_a_parameter():
    w = (torch.randn(4, 32, 32, device=DEVICE) * 0.1).requires_grad_()
    x = torch.randn(10, 32, device=DEVICE).bfloat16()
    offs = torch.tensor([3, 3, 8, 10], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="needs each expert weight to be a plain leaf parameter"):
        ops.fp8_grouped_linear(x, w.bfloat16(), offs, recipe("main_grad"))
    bf16_leaf = w.detach().bfloat16().requires_grad_()
    bf16_leaf.main_grad = torch.zeros(4, 32, 32, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="main_grad must be a contiguous float32 tensor"):
        ops.fp8_grouped_linear(x, bf16_leaf, offs, recipe("main_grad"))
    # A view that covers the weight exactly counts as the weight (torchtitan's B_t seam).
    leaf = (torch.randn(4, 32, 32, device=DEVICE) * 0.1).bfloat16().requires_grad_()
    ops.fp8_grouped_mm(x, leaf.transpose(-2, -1), offs=offs, recipe=recipe("main_grad")).float().sum().backward()
    assert leaf.grad is None and leaf.main_grad.shape == leaf.shape


def test_options_are_checked():
    with pytest.raises(ValueError, match="wgrad_accumulation must be one of"):
        ops.RowwiseOptions(wgrad_accumulation="fp32")
    assert ops.Fp8Recipe(name="blockwise").wgrad_accumulation == "off"
    assert recipe("grad").wgrad_accumulation == "grad"


def test_compiled_models_are_refused(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    w = torch.randn(2, 4, 4, device=DEVICE)
    with pytest.raises(NotImplementedError, match="torch.compile cannot trace"):
        grad_accumulation.check_accumulation_weight(w, "grad")
    grad_accumulation.check_accumulation_weight(w, "off")


def _ddp_micro_batches(rank: int, world: int) -> None:
    from torch.nn.parallel import DistributedDataParallel

    grads = {}
    for target in ("off", "grad"):
        for bucket_view in (False, True):
            _, layer = make_layers(torch.float32, target)
            ddp = DistributedDataParallel(layer, gradient_as_bucket_view=bucket_view)
            data = batches(torch.float32, tokens=(37 + rank, 1, 20 - rank))
            with ddp.no_sync():
                accumulate(ddp, data[:-1])
            accumulate(ddp, data[-1:])
            grads[target, bucket_view] = [w.grad.clone() for w in expert_weights(layer)]
    for bucket_view in (False, True):
        for name, off, fused in zip(EXPERT_WEIGHTS, grads["off", bucket_view], grads["grad", bucket_view]):
            assert torch.equal(off, fused), (name, bucket_view)


@gloo_cpu_only
def test_grad_target_under_ddp_equals_autograds_add():
    """DDP (2 ranks, micro-batches under ``no_sync`` then a synced one): with ``"grad"`` the micro-batches'
    sum is added in place and DDP still reduces it (its reducer's hook runs on the weight's gradient
    accumulation node, which autograd runs even for a gradient added in place): bitwise ``"off"``'s (fp32)."""
    run_distributed(_ddp_micro_batches, 2, timeout_s=600)
