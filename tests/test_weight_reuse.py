"""``ops.reuse_quantized_weights``: weights quantized once per block, same results, stale weights refused."""

from __future__ import annotations

import dataclasses
import gc
import threading
import weakref

import pytest
import torch

import ops
from ops import op_registry, weight_reuse
from tests.support import DEVICE, offsets_from_sizes

# An empty group, a group of 1, sizes not multiples of 16, 12 tokens past offs[-1];
# K and N multiples of 32 for the mxfp8 recipe.
SIZES = [0, 1, 21, 14]
M, K, N = 48, 32, 32


@pytest.fixture
def weight_quantizations(monkeypatch):
    """Counts of the calls of every weight-quantizing op, by op name."""
    calls: dict[str, int] = {}
    for name, function in list(op_registry._functions.items()):
        if "weight" not in name:
            continue

        def counted(*args, _name=name, _function=function, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _function(*args, **kwargs)

        monkeypatch.setitem(op_registry._functions, name, counted)
    return calls


def make_problem(seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(M, K, device=DEVICE, generator=gen).to(torch.bfloat16)
    w = (torch.randn(len(SIZES), N, K, device=DEVICE, generator=gen) * K**-0.5).to(torch.bfloat16)
    grad_out = torch.randn(M, N, device=DEVICE, generator=gen).to(torch.bfloat16)
    return x, w.requires_grad_(), offsets_from_sizes(SIZES), grad_out


def micro_batches(w, recipe, steps=2):
    """``steps`` forward+backward passes on different inputs with one weight: outputs, dx's, and the summed dW."""
    outs, dxs = [], []
    w.grad = None
    for step in range(steps):
        x, _, offs, grad_out = make_problem(seed=1 + step)
        x.requires_grad_()
        out = ops.fp8_grouped_linear(x, w, offs, recipe)
        out.backward(grad_out)
        outs.append(out.detach())
        dxs.append(x.grad)
    return outs, dxs, w.grad


RECIPES = [
    ops.Fp8Recipe(),
    ops.Fp8Recipe(options=ops.RowwiseOptions(fold_dgrad_weight_scales=False)),
    ops.Fp8Recipe(save_fp8_weight=False),
    ops.Fp8Recipe(name="blockwise"),
    ops.Fp8Recipe(name="mxfp8"),
]
RECIPE_IDS = ["rowwise", "rowwise-unfolded", "rowwise-weight-kept", "blockwise", "mxfp8"]


def unkept(recipe: ops.Fp8Recipe) -> ops.Fp8Recipe:
    return dataclasses.replace(recipe, keep_quantized_weights=False)


@pytest.fixture(autouse=True)
def no_kept_forms():
    weight_reuse.release_quantized_weights()
    yield
    weight_reuse.release_quantized_weights()


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("how", ["block", "kept"])
def test_micro_batches_quantize_each_weight_once_with_the_same_bits(recipe, how, weight_quantizations):
    _, w, _, _ = make_problem()
    plain = micro_batches(w, unkept(recipe))
    per_pass = dict(weight_quantizations)
    weight_quantizations.clear()
    if how == "block":
        with ops.reuse_quantized_weights():
            reused = micro_batches(w, unkept(recipe))
    else:
        reused = micro_batches(w, recipe)  # keep_quantized_weights: the default
    # Each form once instead of once per pass (the weight-kept path makes its forward and its
    # backward forms in separate calls, each once).
    assert per_pass and weight_quantizations == {name: count // 2 for name, count in per_pass.items()}
    for name, a, b in zip(("out", "dx"), plain[:2], reused[:2]):
        for step, (ta, tb) in enumerate(zip(a, b)):
            assert torch.equal(ta, tb), (name, step)
    assert torch.equal(plain[2], reused[2])
    assert weight_reuse._cache is None  # freed when the block ends


def test_weight_stored_transposed_quantized_once_per_block(weight_quantizations):
    # fp8_grouped_mm makes a new view of a weight stored (E, K, N) every call: its forms are kept
    # under the parameter, apart from those of the same tensor used as an (E, N, K) weight.
    x, w, offs, grad_out = make_problem()
    x.requires_grad_()  # dgrad forms made in the forward
    stored = w.detach().transpose(-2, -1).contiguous().requires_grad_()
    square = torch.randn(len(SIZES), K, K, device=DEVICE).to(torch.bfloat16).requires_grad_()
    xk = torch.randn(M, K, device=DEVICE).to(torch.bfloat16).requires_grad_()
    with ops.reuse_quantized_weights():
        outs = [ops.fp8_grouped_mm(x, stored, offs=offs) for _ in range(2)]
        sq = [ops.fp8_grouped_mm(xk, square, offs=offs), ops.fp8_grouped_linear(xk, square, offs)]
    assert weight_quantizations == {"quantize_rowwise_expert_weights_and_transpose": 3}
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], ops.fp8_grouped_linear(x, w, offs))
    assert torch.equal(sq[0], ops.fp8_grouped_linear(xk, square.detach().transpose(-2, -1).contiguous(), offs))
    assert torch.equal(sq[1], ops.fp8_grouped_linear(xk, square, offs))


def test_each_weight_and_recipe_has_its_own_entry(weight_quantizations):
    x, w1, offs, _ = make_problem()
    x.requires_grad_()  # dgrad forms made in the forward
    w3 = (w1.detach() * 2).requires_grad_()
    unfolded = ops.Fp8Recipe(options=ops.RowwiseOptions(fold_dgrad_weight_scales=False))
    with ops.reuse_quantized_weights():
        for _ in range(2):
            gate, up = ops.fp8_grouped_linears(x, (w1, w3), offs)
            other = ops.fp8_grouped_linear(x, w1, offs, unfolded)
    assert weight_quantizations == {"quantize_rowwise_expert_weights_and_transpose": 2, "quantize_rowwise_expert_weights_both_layouts": 1}
    assert torch.equal(gate, ops.fp8_grouped_linear(x, w1, offs))
    assert torch.equal(up, ops.fp8_grouped_linear(x, w3, offs))
    assert torch.equal(other, ops.fp8_grouped_linear(x, w1, offs, unfolded))


def test_inference_reuses_weights(weight_quantizations):
    x, w, offs, _ = make_problem()
    with torch.no_grad(), ops.reuse_quantized_weights():
        first = ops.fp8_grouped_linear(x, w, offs)
        second = ops.fp8_grouped_linear(x, w, offs)
    assert weight_quantizations == {"quantize_rowwise_expert_weights": 1}
    assert torch.equal(first, second)


def test_weight_modified_in_place_inside_the_block_raises():
    x, w, offs, grad_out = make_problem()
    with ops.reuse_quantized_weights():
        ops.fp8_grouped_linear(x, w, offs).backward(grad_out)
        with torch.no_grad():
            w.add_(w.grad, alpha=-0.1)  # an optimizer step
        with pytest.raises(RuntimeError, match="modified in place or given new storage inside ops.reuse"):
            ops.fp8_grouped_linear(x, w, offs)


def test_weight_given_new_storage_inside_the_block_raises():
    w = torch.randn(2, 4, 4, device=DEVICE)
    with ops.reuse_quantized_weights():
        weight_reuse.reuse_or_quantize(w, "form", lambda: 0)
        w.data = torch.randn(2, 4, 4, device=DEVICE)
        with pytest.raises(RuntimeError, match="given new storage"):
            weight_reuse.reuse_or_quantize(w, "form", lambda: 1)


def test_blocks_nest_and_end_with_the_outermost():
    w = torch.randn(2, 4, 4, device=DEVICE)
    calls = []

    def quantize():
        calls.append(1)
        return len(calls)

    with ops.reuse_quantized_weights():
        with ops.reuse_quantized_weights():
            assert weight_reuse.reuse_or_quantize(w, "form", quantize) == 1
        assert weight_reuse.reuse_or_quantize(w, "form", quantize) == 1
        assert weight_reuse.reuse_or_quantize(w, "other form", quantize) == 2
    assert weight_reuse._cache is None
    assert weight_reuse.reuse_or_quantize(w, "form", quantize) == 3


def test_block_is_seen_from_other_threads():
    """PyTorch runs CUDA backward passes on its own thread: the block must cover them."""
    w = torch.randn(2, 4, 4, device=DEVICE)
    results = []
    with ops.reuse_quantized_weights():
        first = weight_reuse.reuse_or_quantize(w, "form", lambda: object())
        thread = threading.Thread(
            target=lambda: results.append(weight_reuse.reuse_or_quantize(w, "form", lambda: object()))
        )
        thread.start()
        thread.join()
    assert results == [first]


def test_inference_tensors_are_quantized_every_time():
    with torch.inference_mode():
        w = torch.randn(2, 4, 4, device=DEVICE)
    counter = iter(range(10))
    with ops.reuse_quantized_weights():
        assert [weight_reuse.reuse_or_quantize(w, "form", lambda: next(counter)) for _ in range(2)] == [0, 1]


def test_compiled_code_quantizes_as_usual():
    """Under ``torch.compile(fullgraph=True)`` the block changes nothing: no graph break, nothing cached."""
    torch._dynamo.reset()
    x, w, offs, grad_out = make_problem()
    compiled = torch.compile(lambda x, w: ops.fp8_grouped_linear(x, w, offs), fullgraph=True, backend="aot_eager")
    with ops.reuse_quantized_weights():
        out = compiled(x, w)
        out.backward(grad_out)
        assert weight_reuse._cache == {}
    dw = w.grad
    w.grad = None
    eager = ops.fp8_grouped_linear(x, w, offs)
    eager.backward(grad_out)
    assert torch.equal(out, eager) and torch.equal(dw, w.grad)


def sgd_step(w, lr=0.1):
    with torch.no_grad():
        w.add_(w.grad, alpha=-lr)


@pytest.mark.parametrize(
    "change", ["optimizer", "fused_optimizer", "optimizer_without_update", "load_state_dict", "in_place", "new_storage"]
)
def test_kept_forms_are_made_again_when_the_weight_changes_and_never_in_between(change, weight_quantizations):
    x, w, offs, grad_out = make_problem()
    layer = ops.Fp8GroupedLinear(len(SIZES), K, N, dtype=torch.bfloat16, device=DEVICE)
    layer.weight = torch.nn.Parameter(w.detach().clone())
    # A fused optimizer writes the weights without bumping their version counter: its step counts.
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-2, fused=change == "fused_optimizer")
    for _ in range(3):  # micro-batches: one quantization
        layer(x, offs).backward(grad_out)
    assert sum(weight_quantizations.values()) == 1
    if change in ("optimizer", "fused_optimizer"):
        optimizer.step()
    elif change == "optimizer_without_update":
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]).step()  # any optimizer's step (no grads: no update)
    elif change == "load_state_dict":
        layer.load_state_dict({"weight": w.detach() * 2})
    elif change == "in_place":
        with torch.no_grad():
            layer.weight.mul_(0.5)
    else:
        layer.weight.data = w.detach() * 3
    out = layer(x, offs)
    assert sum(weight_quantizations.values()) == 2
    out.backward(grad_out)
    layer(x, offs)
    assert sum(weight_quantizations.values()) == 2
    # The new forms are those of the new values.
    fresh = ops.fp8_grouped_linear(x, layer.weight.detach().clone(), offs, unkept(ops.Fp8Recipe()))
    assert torch.equal(out, fresh)


def test_kept_forms_serve_inference_and_die_with_their_weight(weight_quantizations):
    x, w, offs, grad_out = make_problem()
    train = ops.fp8_grouped_linear(x.requires_grad_(), w, offs)
    train.backward(grad_out)
    with torch.no_grad():
        infer = ops.fp8_grouped_linear(x, w, offs)  # the training forms hold the forward form
    assert torch.equal(train, infer)
    assert weight_quantizations == {"quantize_rowwise_expert_weights_and_transpose": 1}
    assert weight_reuse.kept_forms(w)
    entry = weakref.ref(w.__dict__[weight_reuse._KEPT_ATTR])
    del w, train
    gc.collect()
    assert entry() is None


def test_kept_forms_know_a_view_by_its_parameter(weight_quantizations):
    # ops.fp8_grouped_mm (torchtitan's seam) sees w.transpose(-2, -1).transpose(-2, -1): a new view each pass.
    x, w, offs, grad_out = make_problem()
    for _ in range(2):
        ops.fp8_grouped_mm(x, w.transpose(-2, -1), offs=offs).backward(grad_out)
    assert sum(weight_quantizations.values()) == 1


def test_released_and_stale_forms_are_freed_at_once():
    """No reference cycle keeps dropped forms alive until a garbage collection (GPU memory)."""
    x, w, offs, _ = make_problem()
    gc.disable()
    try:
        with torch.no_grad():
            ops.fp8_grouped_linear(x, w, offs)
            form = weakref.ref(next(iter(weight_reuse.kept_forms(w).values())).data)
            assert form() is not None
            weight_reuse.release_quantized_weights()
            assert form() is None
            ops.fp8_grouped_linear(x, w, offs)
            form = weakref.ref(next(iter(weight_reuse.kept_forms(w).values())).data)
            entry = weakref.ref(w.__dict__[weight_reuse._KEPT_ATTR])
            del w
            assert form() is None and entry() is None
    finally:
        gc.enable()


def test_release_and_unkept_recipe(weight_quantizations):
    x, w, offs, _ = make_problem()
    with torch.no_grad():
        ops.fp8_grouped_linear(x, w, offs)
        weight_reuse.release_quantized_weights()
        ops.fp8_grouped_linear(x, w, offs)
        ops.fp8_grouped_linear(x, w, offs, unkept(ops.Fp8Recipe()))
    assert weight_quantizations == {"quantize_rowwise_expert_weights": 3}


def test_fsdp_managed_modules_do_not_keep_forms_and_refuse_main_grad():
    layer = ops.Fp8GroupedLinear(2, 32, 32, dtype=torch.bfloat16, device=DEVICE)
    assert ops.modules.recipe_for_module(layer, layer.recipe) is layer.recipe
    layer._is_fsdp_managed_module = True  # what fully_shard sets on the modules it manages
    recipe = ops.modules.recipe_for_module(layer, layer.recipe)
    assert recipe.keep_quantized_weights is False and recipe == unkept(layer.recipe)
    assert ops.modules.recipe_for_module(layer, layer.recipe) is recipe  # made once
    main = ops.Fp8Recipe(options=ops.RowwiseOptions(wgrad_accumulation="main_grad"))
    with pytest.raises(ValueError, match="main_grad' does not work under FSDP2"):
        ops.modules.recipe_for_module(layer, main)


def test_inference_takes_only_the_forms_of_its_own_recipe():
    # Forms kept by a training pass of one recipe do not serve another recipe's inference.
    x, w, offs, grad_out = make_problem()
    ops.fp8_grouped_linear(x.clone().requires_grad_(), w, offs, ops.Fp8Recipe()).backward(grad_out)
    for recipe in (ops.Fp8Recipe(round_scales_to_power_of_2=True), ops.Fp8Recipe(name="mxfp8")):
        with torch.no_grad():
            got = ops.fp8_grouped_linear(x, w, offs, recipe)
            want = ops.fp8_grouped_linear(x, w.detach().clone(), offs, unkept(recipe))
        assert torch.equal(got, want), recipe.name


def test_a_new_storage_at_the_old_address_is_a_new_weight():
    # w.data = a tensor over the same memory through another storage (DLPack makes one), then written
    # through that storage: no version bump and the same data pointer, but not the storage the forms
    # were made from.
    x, w, offs, _ = make_problem()
    ops.fp8_grouped_linear(x, w, offs)  # keeps w's forms
    alias = torch.from_dlpack(w.detach())
    assert alias.untyped_storage()._cdata != w.untyped_storage()._cdata
    w.data = alias
    assert w.data_ptr() == alias.data_ptr()
    alias.mul_(3)
    got = ops.fp8_grouped_linear(x, w, offs)
    want = ops.fp8_grouped_linear(x, w.detach().clone(), offs, unkept(ops.Fp8Recipe()))
    assert torch.equal(got, want)


def test_kept_forms_let_swap_tensors_through_and_follow_their_values():
    # torch.utils.swap_tensors (module.to() of DTensor parameters, ops.enable_fp8_all_gather) refuses a
    # tensor with weak references: the forms are held in the weight itself and move with its values.
    x, w, offs, grad_out = make_problem()
    w = torch.nn.Parameter(w.detach())
    old = ops.fp8_grouped_linear(x, w, offs)
    new = torch.nn.Parameter(w.detach() * 2)
    torch.utils.swap_tensors(w, new)  # w now holds the doubled values, `new` the old ones
    assert torch.equal(ops.fp8_grouped_linear(x, w, offs), ops.fp8_grouped_linear(x, w.detach().clone(), offs, unkept(ops.Fp8Recipe())))
    assert torch.equal(ops.fp8_grouped_linear(x, new, offs), old)


def test_copies_and_pickles_of_a_weight_take_no_forms():
    import copy
    import io

    x, w, offs, _ = make_problem()
    w = torch.nn.Parameter(w.detach())
    ops.fp8_grouped_linear(x, w, offs)
    assert weight_reuse.kept_forms(w)
    loaded = []
    for weights_only in (False, True):
        buffer = io.BytesIO()
        torch.save(w, buffer)
        buffer.seek(0)
        loaded.append(torch.load(buffer, weights_only=weights_only))
    for other in (copy.deepcopy(w), *loaded):
        assert torch.equal(other, w) and not weight_reuse.kept_forms(other)
        ops.fp8_grouped_linear(x, other, offs)
        assert weight_reuse.kept_forms(other)


def test_the_block_knows_a_view_by_its_parameter(weight_quantizations):
    # Inside reuse_quantized_weights(), ops.fp8_grouped_mm's new view of the weight each pass is the parameter.
    x, w, offs, grad_out = make_problem()
    with ops.reuse_quantized_weights():
        for _ in range(3):
            ops.fp8_grouped_mm(x, w.transpose(-2, -1), offs=offs, recipe=unkept(ops.Fp8Recipe())).backward(grad_out)
        assert len(weight_reuse._cache) == 1
    assert sum(weight_quantizations.values()) == 1
