"""``convert_to_fp8`` on torchtitan's own expert modules, against torchtitan's bf16 results.

Torchtitan's experts run every GEMM through ``self._grouped_mm(*, A, B_t, offs)``;
the converted module keeps torchtitan's forward and its parameters, and that seam
runs ``ops.fp8_grouped_mm``. Needs the ``torchtitan`` package (skipped without it).
"""

from __future__ import annotations

import copy

import pytest
import torch

import ops
from tests.support import DEVICE, sqnr_db

pytest.importorskip("torchtitan")
from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.models.common.moe import (  # noqa: E402
    GroupedExperts,
    MoE,
    RoutedExperts,
    TokenChoiceTopKRouter,
)
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher  # noqa: E402
from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts  # noqa: E402

DIM, HIDDEN, EXPERTS, TOP_K = 32, 48, 4, 2
# Three chained FP8 GEMMs (as tests/test_modules.py).
MIN_SQNR_DB = 20


def _randomized(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with every parameter drawn from N(0, 0.2^2) (torchtitan builds them empty)."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.2)
    return module


def _moe_layer() -> MoE:
    """A torchtitan MoE layer (router, local token dispatcher, GroupedExperts) in bf16."""
    config = MoE.Config(
        num_experts=EXPERTS,
        load_balance_coeff=None,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=DIM, hidden_dim=HIDDEN, num_experts=EXPERTS),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=EXPERTS, top_k=TOP_K),
        ),
        router=TokenChoiceTopKRouter.Config(
            num_experts=EXPERTS,
            gate=Linear.Config(in_features=DIM, out_features=EXPERTS),
            top_k=TOP_K,
            score_func="softmax",
        ),
    )
    # bf16 parameters, as FSDP's mixed precision gives them (CPU autocast has no float32 mode for the router).
    return _randomized(config.build().to(device=DEVICE, dtype=torch.bfloat16))


@pytest.fixture
def grouped_mm_calls(monkeypatch) -> list[int]:
    """Counts calls of ``torch._grouped_mm`` (torchtitan's bf16 seam calls it; the FP8 one must not)."""
    calls: list[int] = []
    bf16_grouped_mm = torch._grouped_mm

    def counting(*args, **kwargs):
        calls.append(1)
        return bf16_grouped_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counting)
    return calls


def _forward_backward(module: torch.nn.Module, inputs: tuple, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    """Output, input gradient and every parameter's gradient of ``module(x, *rest)``."""
    x = inputs[0].clone().requires_grad_()
    out = module(x, *inputs[1:])
    out.backward(grad)
    results = {"out": out.detach(), "dx": x.grad}
    results.update({f"d{name}": p.grad.clone() for name, p in module.named_parameters()})
    module.zero_grad(set_to_none=True)
    return results


def _assert_tracks_bf16(fp8: dict[str, torch.Tensor], bf16: dict[str, torch.Tensor]) -> None:
    assert fp8.keys() == bf16.keys()
    for name, reference in bf16.items():
        assert fp8[name].dtype == reference.dtype and fp8[name].shape == reference.shape, name
        assert sqnr_db(fp8[name], reference) >= MIN_SQNR_DB, name
    assert not torch.equal(fp8["out"], bf16["out"])  # FP8 rounding shows: not the bf16 GEMMs


@pytest.mark.filterwarnings("ignore:In CPU autocast")  # the router's float32 autocast, a no-op on CPU
def test_moe_layer_converts_in_place_and_tracks_bf16(grouped_mm_calls):
    model = _moe_layer()
    reference = copy.deepcopy(model)
    experts = model.routed_experts.inner_experts
    params = dict(model.named_parameters())
    state_dict = {name: t.clone() for name, t in model.state_dict().items()}

    assert ops.convert_to_fp8(model) is model
    converted = model.routed_experts.inner_experts
    assert converted is experts and isinstance(converted, GroupedExperts)
    assert isinstance(converted, ops.Fp8GroupedMMSeam) and converted.recipe == ops.Fp8Recipe()
    assert type(converted).__name__ == "Fp8GroupedExperts" and "recipe=rowwise" in repr(converted)
    assert type(model.router.gate) is Linear
    # Parameters shared, state-dict keys unchanged: a torchtitan checkpoint loads as it is.
    assert all(p is params[name] for name, p in model.named_parameters()) and len(params) == 4
    assert list(model.state_dict()) == list(state_dict)
    model.load_state_dict(state_dict, strict=True)
    # Converting again changes nothing.
    ops.convert_to_fp8(model, ops.Fp8Recipe(name="blockwise"))
    assert type(model.routed_experts.inner_experts) is type(converted) and converted.recipe.name == "rowwise"

    x = torch.randn(2, 17, DIM, dtype=torch.bfloat16, device=DEVICE)
    grad = torch.randn_like(x)
    bf16 = _forward_backward(reference, (x,), grad)
    assert len(grouped_mm_calls) == 3  # the spy sees torchtitan's bf16 GEMMs
    fp8 = _forward_backward(model, (x,), grad)
    assert len(grouped_mm_calls) == 3  # and none of the converted layer's
    _assert_tracks_bf16(fp8, bf16)


@pytest.mark.parametrize(
    "experts_config",
    [
        GroupedExperts.Config(dim=DIM, hidden_dim=HIDDEN, num_experts=EXPERTS),
        GptOssGroupedExperts.Config(dim=DIM, hidden_dim=HIDDEN, num_experts=EXPERTS),
    ],
    ids=["GroupedExperts", "GptOssGroupedExperts"],
)
def test_experts_with_float32_weights_track_bf16(experts_config, grouped_mm_calls):
    """Torchtitan's default float32 parameters (cast to bf16 by its forward); an empty group, a group of 1."""
    module = _randomized(experts_config.build().to(DEVICE))
    reference = copy.deepcopy(module)
    counts = torch.tensor([30, 0, 1, 33], dtype=torch.int32, device=DEVICE)
    x = torch.randn(int(counts.sum()), DIM, dtype=torch.bfloat16, device=DEVICE)
    grad = torch.randn_like(x)

    bf16 = _forward_backward(reference, (x, counts), grad)
    calls = len(grouped_mm_calls)
    assert calls > 0
    converted = ops.convert_to_fp8(module)
    assert converted is module and isinstance(module, type(reference))
    fp8 = _forward_backward(module, (x, counts), grad)
    assert len(grouped_mm_calls) == calls
    _assert_tracks_bf16(fp8, bf16)
