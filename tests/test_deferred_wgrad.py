"""The up-projection weights' wgrad deferred to one run over every micro-batch (``ops.deferred_wgrad``).

The run's gradient is bitwise the immediate wgrad of one batch holding every micro-batch's tokens
(each expert's pairs in micro-batch order: the batch ``merge_micro_batches`` builds), for each
gradient target; nothing reaches the gradient before the run; ``optimizer.step()`` refuses
deferred wgrads not yet run; the paths that cannot defer take the immediate wgrad.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ops
from ops.deferred_wgrad import UpProjectionWgradInputs, merge_micro_batches
from ops.moe_fused import swiglu_up_projection
from ops.modules import recipe_for_module
from tests.support import DEVICE, record_kernel_calls, sqnr_db

DIM, HIDDEN, EXPERTS, TOP_K = 64, 48, 4, 2
FP8_WGRAD = {"wgrad_precision": "fp8"}


def recipe(deferred: bool, **options: object) -> ops.Fp8Recipe:
    return ops.Fp8Recipe(**FP8_WGRAD, options=ops.RowwiseOptions(deferred_wgrad=deferred, **options))


def make_weights(packed: bool, seed: int = 0) -> tuple[torch.nn.Parameter, ...]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(EXPERTS, 2 * HIDDEN, DIM)] if packed else [(EXPERTS, HIDDEN, DIM)] * 2
    return tuple(
        torch.nn.Parameter((torch.randn(*s, generator=gen) * 0.1).to(DEVICE, torch.bfloat16)) for s in shapes
    )


def micro_batch(tokens: int, seed: int, empty_expert: int | None = None) -> dict[str, torch.Tensor]:
    """One routed micro-batch: ``x``, each token's experts, and a gradient for ``h`` per token choice."""
    gen = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    if empty_expert is not None:
        experts[experts == empty_expert] = (empty_expert + 1) % EXPERTS
        experts[:, 1] = torch.where(experts[:, 1] == experts[:, 0], (experts[:, 0] + 2) % EXPERTS, experts[:, 1])
    return {
        "x": torch.randn(tokens, DIM, generator=gen).to(DEVICE, torch.bfloat16),
        "experts": experts.to(DEVICE),
        "grad": torch.randn(tokens, TOP_K, HIDDEN, generator=gen).to(DEVICE, torch.bfloat16),
    }


def backward(batch: dict[str, torch.Tensor], weights: tuple[torch.Tensor, ...], fp8: ops.Fp8Recipe) -> None:
    """``swiglu_up_projection`` on the batch's pairs sorted by expert, then backward of ``<h, grad>``."""
    order = ops.sort_by_expert(batch["experts"], EXPERTS)
    offs = order.num_tokens_per_expert.cumsum(0).to(torch.int32)
    rows = (order.order // TOP_K).to(torch.int32)
    inverse = order.inverse.view(-1, TOP_K)
    x = batch["x"].clone().requires_grad_()
    w = weights[0] if len(weights) == 1 else weights
    h = swiglu_up_projection(x, w, offs, fp8, rows=rows, inverse=inverse)
    grad_h = batch["grad"].reshape(-1, HIDDEN)[order.order]
    (h.float() * grad_h.float()).sum().backward()


def union(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.cat([b[key] for b in batches]) for key in batches[0]}


def grads(weights: tuple[torch.Tensor, ...], attribute: str = "grad") -> list[torch.Tensor]:
    return [getattr(w, attribute).clone() for w in weights]


@pytest.mark.parametrize("packed", [False, True], ids=["w1-w3", "w13"])
def test_run_is_bitwise_the_wgrad_of_one_batch_of_all_micro_batches(packed):
    batches = [micro_batch(13, 1), micro_batch(21, 2, empty_expert=2), micro_batch(1, 3)]
    weights = make_weights(packed)
    for batch in batches:
        backward(batch, weights, recipe(True))
    assert all(w.grad is None for w in weights)  # nothing before the run
    assert ops.has_deferred_wgrads(weights)
    ops.run_deferred_wgrads(weights)
    assert not ops.has_deferred_wgrads(weights)
    deferred = grads(weights)
    for w in weights:
        w.grad = None
    backward(union(batches), weights, recipe(False))
    for got, expected in zip(deferred, grads(weights)):
        assert torch.equal(got, expected)
    ops.run_deferred_wgrads(weights)  # nothing deferred: nothing changes
    assert all(torch.equal(w.grad, e) for w, e in zip(weights, deferred))


def test_one_micro_batch_is_bitwise_the_immediate_wgrad():
    batch = micro_batch(17, 4)
    weights = make_weights(False)
    backward(batch, weights, recipe(True))
    ops.run_deferred_wgrads(torch.nn.ParameterList(weights))
    deferred = grads(weights)
    for w in weights:
        w.grad = None
    backward(batch, weights, recipe(False))
    assert all(torch.equal(a, b) for a, b in zip(deferred, grads(weights)))


@pytest.mark.parametrize("target", ["grad", "main_grad"])
def test_run_adds_into_the_gradient_of_the_target(target):
    # The run adds its wgrad into what is there (.grad from an earlier step's immediate wgrad, or main_grad):
    # bitwise the in-GEMM addition of the one-batch wgrad.
    batches = [micro_batch(9, 5), micro_batch(12, 6)]
    weights = make_weights(False)
    backward(batches[0], weights, recipe(False, wgrad_accumulation=target))
    before = grads(weights, target)
    for batch in batches:
        backward(batch, weights, recipe(True, wgrad_accumulation=target))
    assert all(torch.equal(a, b) for a, b in zip(before, grads(weights, target)))
    ops.run_deferred_wgrads(weights)
    deferred = grads(weights, target)
    for w, b in zip(weights, before):
        setattr(w, target, b.clone())
    backward(union(batches), weights, recipe(False, wgrad_accumulation=target))
    assert all(torch.equal(a, b) for a, b in zip(deferred, grads(weights, target)))
    if target == "main_grad":
        assert all(w.grad is None for w in weights)


def test_dx_is_not_deferred():
    batch = micro_batch(11, 7)
    weights = make_weights(False)
    dx = {}
    for deferred in (True, False):
        x = batch["x"].clone().requires_grad_()
        order = ops.sort_by_expert(batch["experts"], EXPERTS)
        offs = order.num_tokens_per_expert.cumsum(0).to(torch.int32)
        h = swiglu_up_projection(
            x, weights, offs, recipe(deferred), rows=(order.order // TOP_K).int(), inverse=order.inverse.view(-1, TOP_K)
        )
        (h.float() * batch["grad"].reshape(-1, HIDDEN)[order.order].float()).sum().backward()
        dx[deferred] = x.grad
    assert torch.equal(dx[True], dx[False])
    ops.drop_deferred_wgrads(weights)


def test_optimizer_step_refuses_deferred_wgrads_not_yet_run():
    weights = make_weights(False)
    other = torch.nn.Parameter(torch.zeros(3, device=DEVICE))
    opt = torch.optim.SGD(list(weights), lr=0.1)
    other_opt = torch.optim.SGD([other], lr=0.1)
    backward(micro_batch(8, 8), weights, recipe(True))
    other.grad = torch.ones_like(other)
    other_opt.step()  # another optimizer's parameters: not concerned
    with pytest.raises(RuntimeError, match="ops.run_deferred_wgrads"):
        opt.step()
    ops.run_deferred_wgrads(weights)
    opt.step()
    backward(micro_batch(8, 9), weights, recipe(True))
    ops.drop_deferred_wgrads(weights)  # a skipped step: forgotten, not run
    grads_before = grads(weights)
    ops.run_deferred_wgrads(weights)
    assert all(torch.equal(a, b) for a, b in zip(grads_before, grads(weights)))
    opt.step()


def test_autograd_grad_and_hooked_weights_take_the_immediate_wgrad(monkeypatch):
    batch = micro_batch(10, 10)
    weights = make_weights(False)
    order = ops.sort_by_expert(batch["experts"], EXPERTS)
    offs = order.num_tokens_per_expert.cumsum(0).to(torch.int32)
    rows, inverse = (order.order // TOP_K).int(), order.inverse.view(-1, TOP_K)
    h = swiglu_up_projection(batch["x"], weights, offs, recipe(True), rows=rows, inverse=inverse)
    got = torch.autograd.grad(h.float().sum(), weights)
    assert not ops.has_deferred_wgrads(weights)
    h = swiglu_up_projection(batch["x"], weights, offs, recipe(False), rows=rows, inverse=inverse)
    assert all(torch.equal(a, b) for a, b in zip(got, torch.autograd.grad(h.float().sum(), weights)))
    seen = []
    weights[0].register_hook(lambda g: seen.append(g))
    backward(batch, weights, recipe(True))
    assert len(seen) == 1 and not ops.has_deferred_wgrads(weights)


def test_compiled_models_are_refused_before_any_kernel(monkeypatch):
    # The kept inputs live on the weights, outside any graph torch.compile could trace: a clear error instead.
    batch = micro_batch(6, 11)
    weights = make_weights(False)
    calls = record_kernel_calls(monkeypatch, ["quantize_rowwise_rows", "grouped_mm_swiglu"])
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(NotImplementedError, match="deferred_wgrad=False in compiled models"):
        backward(batch, weights, recipe(True))
    assert not any(calls.values()), calls


def test_the_run_launches_one_wgrad_per_weight(monkeypatch):
    weights = make_weights(False)
    for seed in range(3):
        backward(micro_batch(9, seed), weights, recipe(True))
    calls = record_kernel_calls(monkeypatch, ["grouped_mm_wgrad", "transpose_to_token_groups"])
    ops.run_deferred_wgrads(weights)
    assert {name: len(args) for name, args in calls.items()} == {"grouped_mm_wgrad": 2, "transpose_to_token_groups": 1}


def test_merge_puts_each_experts_pairs_in_micro_batch_order_and_unrouted_pairs_last():
    # Two micro-batches, 3 groups; pairs past offs[-1] (unrouted) go past every group, in micro-batch order.
    def inputs(sizes: list[int], unrouted: int, tokens: int, first: float) -> UpProjectionWgradInputs:
        pairs = sum(sizes) + unrouted
        grad = (first + torch.arange(pairs, dtype=torch.float32)).unsqueeze(1).repeat(1, 2).to(DEVICE)
        return UpProjectionWgradInputs(
            grad, torch.zeros(tokens, 4, device=DEVICE).to(torch.float8_e4m3fn), torch.ones(tokens, device=DEVICE),
            torch.arange(pairs, dtype=torch.int32, device=DEVICE) % tokens,
            torch.tensor(sizes, device=DEVICE).cumsum(0).to(torch.int32),
        )

    a, b = inputs([2, 0, 3], 1, 4, 0.0), inputs([1, 2, 0], 2, 5, 100.0)
    merged = merge_micro_batches([a, b])
    assert merged.offs.tolist() == [3, 5, 8]
    assert merged.grad_gate_up[:, 0].tolist() == [0, 1, 100, 101, 102, 2, 3, 4, 5, 103, 104]
    assert merged.rows.tolist() == [0, 1, 4, 5, 6, 2, 3, 0, 1, 7, 8]
    assert merged.x_data.shape == (9, 4)


def test_deferred_wgrad_option_is_checked():
    with pytest.raises(TypeError, match="deferred_wgrad must be a bool"):
        ops.RowwiseOptions(deferred_wgrad="yes")
    assert not ops.Fp8Recipe("blockwise").deferred_wgrad


def layer_micro_batch(tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, DIM, generator=gen).to(DEVICE, torch.bfloat16)
    experts = torch.randint(0, EXPERTS - 1, (tokens, TOP_K), generator=gen).to(DEVICE)  # the last expert: none
    probs = torch.rand(tokens, TOP_K, generator=gen).softmax(-1).to(DEVICE)
    grad = torch.randn(tokens, DIM, generator=gen).to(DEVICE, torch.bfloat16)
    return x, probs, experts, grad


def layer_backward(layer: ops.MoE, x: torch.Tensor, probs: torch.Tensor, experts: torch.Tensor, grad: torch.Tensor):
    layer.apply_experts(x.clone().requires_grad_(), probs.clone().requires_grad_(), experts).backward(grad)


@pytest.mark.parametrize("down_dgrad_token_rows", [True, False], ids=["token-rows-dgrad", "folded-dgrad"])
def test_layer_run_is_the_wgrad_of_one_batch_of_all_micro_batches(down_dgrad_token_rows):
    # ops.MoE's experts: w1 and w3 (the up-projection) and w2 (the combine's down-projection) all deferred. w2's
    # run reads the gradient's token rows, h's FP8 rows and the pairs' weights: bitwise the one batch's wgrad on
    # token rows whichever dgrad the micro-batches ran; w1's and w3's follow the dgrad's arithmetic.
    torch.manual_seed(0)
    base = ops.MoE(DIM, HIDDEN, EXPERTS, TOP_K, device=DEVICE)
    deferred_layer, union_layer = copy.deepcopy(base), copy.deepcopy(base)
    ops.convert_to_fp8(deferred_layer.experts, recipe(True, down_dgrad_token_rows=down_dgrad_token_rows))
    ops.convert_to_fp8(union_layer.experts, recipe(False, down_dgrad_token_rows=True))
    batches = [layer_micro_batch(13, 1), layer_micro_batch(20, 2), layer_micro_batch(1, 3)]
    for batch in batches:
        layer_backward(deferred_layer, *batch)
    experts = deferred_layer.experts
    assert all(w.grad is None for w in (experts.w1, experts.w2, experts.w3))
    ops.run_deferred_wgrads(deferred_layer)
    layer_backward(union_layer, *(torch.cat(parts) for parts in zip(*batches)))
    for name in ("w1", "w2", "w3"):
        got, expected = getattr(experts, name).grad, getattr(union_layer.experts, name).grad
        assert got[EXPERTS - 1].abs().max() == 0, "an expert with no pairs gets a zero gradient"
        if down_dgrad_token_rows or name == "w2":
            assert torch.equal(got, expected), name
        else:
            assert sqnr_db(got, expected) > 25, name


def test_fsdp2_refuses_the_deferred_wgrad():
    module = torch.nn.Linear(2, 2)
    module._is_fsdp_managed_module = True
    with pytest.raises(ValueError, match="deferred_wgrad does not work under FSDP2"):
        recipe_for_module(module, recipe(True))


@pytest.mark.cuda
@pytest.mark.parametrize("tokens, dim, hidden, experts, top_k", [(4096, 2048, 768, 128, 8), (2048, 7168, 2048, 32, 8)])
def test_layer_run_at_real_shapes(tokens, dim, hidden, experts, top_k):
    # Two micro-batches of a Qwen3-30B-like / DeepSeek-V3-like (32 experts) layer on the GPU: the run is bitwise the one batch's
    # wgrads (the dgrad on token rows in both, so that w1's and w3's inputs are the same too).
    torch.manual_seed(0)
    base = ops.MoE(dim, hidden, experts, top_k, device=DEVICE).bfloat16()
    deferred_layer, union_layer = copy.deepcopy(base), copy.deepcopy(base)
    ops.convert_to_fp8(deferred_layer.experts, recipe(True, down_dgrad_token_rows=True, wgrad_accumulation="grad"))
    ops.convert_to_fp8(union_layer.experts, recipe(False, down_dgrad_token_rows=True))
    batches = []
    for seed in (1, 2):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        x = torch.randn(tokens, dim, device=DEVICE, generator=gen).bfloat16()
        experts_of = torch.randn(tokens, experts, device=DEVICE, generator=gen).topk(top_k, dim=-1).indices
        probs = torch.rand(tokens, top_k, device=DEVICE, generator=gen).softmax(-1)
        batches.append((x, probs, experts_of, torch.randn(tokens, dim, device=DEVICE, generator=gen).bfloat16()))
    for batch in batches:
        layer_backward(deferred_layer, *batch)
    ops.run_deferred_wgrads(deferred_layer)
    layer_backward(union_layer, *(torch.cat(parts) for parts in zip(*batches)))
    for name in ("w1", "w2", "w3"):
        got = getattr(deferred_layer.experts, name).grad
        assert torch.equal(got, getattr(union_layer.experts, name).grad), name
        assert got.isfinite().all() and got.abs().amax() > 0, name
