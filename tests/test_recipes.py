"""What every recipe does the same way in the ops layer, one test per property, parametrized over the recipes.

Each recipe's own arithmetic (its emulation, its custom ops, its input rules) is tested in
``test_ops.py`` (rowwise), ``test_ops_blockwise.py`` and ``test_ops_mx.py``.
"""

from __future__ import annotations

import pytest
import torch

import ops
from kernels_helion.token_groups import WGRAD_GROUP_ALIGNMENT, padded_token_count
from tests.support import DEVICE, fwd_bwd, grouped_linear_problem

RECIPES = {
    "rowwise": ops.Fp8Recipe(),
    "blockwise": ops.Fp8Recipe(name="blockwise"),
    "mxfp8": ops.Fp8Recipe(name="mxfp8"),
}
# An empty group, a group of 1 and 9 tokens past offs[-1]; K and N multiples of 32 (MXFP8's block).
SIZES, M, K, N = [20, 0, 1, 40], 70, 32, 32


def _linear(recipe: ops.Fp8Recipe):
    return lambda x, w, offs: ops.fp8_grouped_linear(x, w, offs, recipe)


# The rowwise recipe's compiled path runs in test_modules.py (a whole MoE block, fullgraph).
@pytest.mark.each_parameter
@pytest.mark.parametrize("name", ["blockwise", "mxfp8"])
def test_compile_fullgraph_forward_backward(name):
    """``torch.compile(fullgraph=True)`` traces the recipe (the kernels are custom ops): same bits as eager."""
    torch._dynamo.reset()
    x, w, offs, grad_out = grouped_linear_problem([40, 0, 45], 90, 32, 32)
    compiled = torch.compile(_linear(RECIPES[name]), fullgraph=True)
    for a, b in zip(fwd_bwd(compiled, x, w, offs, grad_out), fwd_bwd(_linear(RECIPES[name]), x, w, offs, grad_out)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", list(RECIPES))
def test_module_and_conversion_match_the_functional_call(name):
    recipe = RECIPES[name]
    x, w, offs, grad_out = grouped_linear_problem(SIZES, M, K, N)
    module = ops.Fp8GroupedLinear(len(SIZES), K, N, recipe=recipe, device=DEVICE)
    assert f"recipe={name}" in repr(module)
    with torch.no_grad():
        module.weight.copy_(w)
    xr = x.clone().requires_grad_()
    out = module(xr, offs)
    out.backward(grad_out)
    for a, b in zip((out.detach(), xr.grad, module.weight.grad), fwd_bwd(_linear(recipe), x, w, offs, grad_out)):
        assert torch.equal(a, b)
    experts = ops.GroupedExperts(K, 2 * N, len(SIZES), device=DEVICE)
    converted = ops.convert_to_fp8(torch.nn.Sequential(experts), recipe)[0]
    assert type(converted) is ops.Fp8GroupedExperts and converted.recipe is recipe
    assert converted.w1 is experts.w1


def _token_layout_columns(name: str, m: int, groups: int) -> int:
    """Token columns of the layout in which a recipe keeps FP8 ``x^T`` for wgrad."""
    if name == "rowwise":  # each group from a multiple of 128 columns
        return padded_token_count(m, groups, WGRAD_GROUP_ALIGNMENT)
    if name == "blockwise":  # block space: ceil(m / 128) + G rows of 128 tokens
        return (-(-m // 128) + groups) * 128
    return m  # mxfp8: the tokens as they are


@pytest.mark.parametrize("name", list(RECIPES))
def test_saved_bytes_against_bf16(name):
    sizes, m, k, n = [100, 0, 120, 36], 256, 128, 64
    x, w, offs, _ = grouped_linear_problem(sizes, m, k, n)
    xp, wp = x.detach().requires_grad_(), torch.nn.Parameter(w.detach())

    def saved(fn, exclude=()):
        return ops.saved_tensor_bytes(fn, xp, wp, offs, exclude=exclude)

    x_bytes, w_bytes, offs_bytes = x.numel() * 2, w.numel() * 2, offs.numel() * 4
    assert saved(lambda a, b, o: torch._grouped_mm(a, b.transpose(-2, -1), offs=o)) == x_bytes + w_bytes + offs_bytes
    # FP8 x (about half of bf16 x, with its scales) in the recipe's token layout.
    fp8_x = 0.55 * x_bytes + k * (_token_layout_columns(name, m, len(sizes)) - m)
    # save_fp8_weight=False keeps only x in FP8 beyond the parameter; the default adds the FP8
    # weight with its scales, about half of bf16 w.
    assert saved(_linear(ops.Fp8Recipe(name=name, save_fp8_weight=False)), (wp,)) < fp8_x + 4096
    assert saved(_linear(RECIPES[name])) < fp8_x + 0.55 * w_bytes + 4096
