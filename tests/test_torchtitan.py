"""``convert_to_fp8`` on torchtitan's own expert modules, against torchtitan's bf16 results; ``ops.torchtitan``'s
converter and override, which switch it on from torchtitan's config.

Torchtitan's experts run every GEMM through ``self._grouped_mm(*, A, B_t, offs)``;
the converted module keeps torchtitan's forward and its parameters, and that seam
runs ``ops.fp8_grouped_mm``. Needs the ``torchtitan`` package (skipped without it).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ops
from tests.support import DEVICE, run_distributed, sqnr_db

pytest.importorskip("torchtitan")
import tyro  # noqa: E402
from torchtitan.config.manager import ConfigManager, custom_registry  # noqa: E402
from torchtitan.config.override import OverrideConfig, apply_overrides  # noqa: E402
from torchtitan.models import qwen3  # noqa: E402
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention  # noqa: E402
from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.models.common.moe import (  # noqa: E402
    GroupedExperts,
    MoE,
    RoutedExperts,
    TokenChoiceTopKRouter,
)
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher  # noqa: E402
from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts  # noqa: E402

import ops.torchtitan as fp8_titan  # noqa: E402

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


# --- ops.torchtitan: the converter and the override, through torchtitan's model registry ---------

TINY_FLAVOR = "fp8moe_tiny"
MODEL_DIM, MODEL_HIDDEN, MODEL_LAYERS, VOCAB = 32, 32, 2, 64
OVERRIDE = "ops.torchtitan.fp8_grouped_experts"


@dataclasses.dataclass
class _OverrideOnly:
    """``Trainer.Config``'s ``override`` section alone (the trainer's module needs datasets, tensorboard, ...)."""

    override: OverrideConfig = dataclasses.field(default_factory=OverrideConfig)


def _tiny_qwen3_moe(attn_backend: str = "flex", moe_comm_backend: str = "standard") -> qwen3.Qwen3Model.Config:
    """Torchtitan's ``debugmodel_moe`` flavor shrunk for the CPU interpreter; SDPA attention (flex attention
    compiles, which the CPU test run does without)."""
    head_dim = 16
    config = qwen3.Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=MODEL_DIM,
        norm=qwen3._qwen3_norm(MODEL_DIM),
        tok_embeddings=qwen3.Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=MODEL_DIM, param_init=qwen3._EMBEDDING_INIT
        ),
        lm_head=Linear.Config(in_features=MODEL_DIM, out_features=VOCAB, param_init=qwen3._LINEAR_INIT),
        layers=qwen3._build_qwen3_moe_layers(
            n_layers=MODEL_LAYERS,
            dim=MODEL_DIM,
            n_heads=2,
            n_kv_heads=1,
            head_dim=head_dim,
            moe_hidden_dim=MODEL_HIDDEN,
            num_experts=EXPERTS,
            top_k=TOP_K,
            attn_backend=attn_backend,
            moe_comm_backend=moe_comm_backend,
            rope=qwen3.CosSinRoPE.Config(dim=head_dim, max_seq_len=64, theta=1000000.0),
        ),
    )
    for _fqn, _attention, parent, attr in list(config.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    return config


@pytest.fixture
def tiny_flavor(monkeypatch) -> str:
    """``TINY_FLAVOR``, a Qwen3 MoE flavor in torchtitan's registry for the test's duration."""
    monkeypatch.setitem(qwen3.qwen3_configs, TINY_FLAVOR, _tiny_qwen3_moe)
    return TINY_FLAVOR


def _build(model_config) -> torch.nn.Module:
    """The model of ``model_config``, its states initialized as the trainer does (on the CPU here)."""
    model = model_config.build()
    model.verify_module_protocol()
    model.init_states()
    return model.to(DEVICE)


def _experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


@pytest.mark.filterwarnings("ignore:In CPU autocast")
def test_converter_trains_torchtitans_qwen3_moe_in_fp8(tiny_flavor):
    """The converter in ``model_registry(converters=...)``, as a config_registry function lists it: experts FP8,
    parameters and state-dict keys torchtitan's, logits close to the bf16 model's, a few AdamW steps."""
    spec = qwen3.model_registry(tiny_flavor, converters=[fp8_titan.Fp8GroupedExpertsConverter.Config()])
    reference_spec = qwen3.model_registry(tiny_flavor)
    experts_configs = [c for _, c, _, _ in spec.model.traverse(GroupedExperts.Config)]
    assert len(experts_configs) == MODEL_LAYERS
    assert all(isinstance(c, fp8_titan.Fp8ExpertsConfig) and c.recipe == "rowwise" for c in experts_configs)

    model = _build(spec.model)
    reference = _build(reference_spec.model)
    reference.load_state_dict(model.state_dict(), strict=True)
    experts = _experts(model)
    assert len(experts) == MODEL_LAYERS
    assert all(type(m).__name__ == "Fp8GroupedExperts" and m.recipe == ops.Fp8Recipe() for m in experts)
    assert all(type(m) is GroupedExperts for m in _experts(reference))
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    assert list(model.state_dict()) == list(reference.state_dict())

    tokens = torch.randint(0, VOCAB, (2, 16), device=DEVICE)
    targets = torch.randint(0, VOCAB, (2, 16), device=DEVICE)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference)]
    for step in range(3):
        losses, logits = [], []
        for m, optimizer in zip((model, reference), optimizers):
            out = m(tokens)
            loss = torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), targets.flatten())
            loss.backward()
            assert all(p.grad is not None and p.grad.isfinite().all() for p in m.parameters() if p.requires_grad)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            logits.append(out.detach())
        assert all(torch.isfinite(torch.tensor(losses))), (step, losses)
        assert sqnr_db(logits[0], logits[1]) >= MIN_SQNR_DB, step
        assert abs(losses[0] - losses[1]) <= 0.02 * abs(losses[1]), (step, losses)
    assert not torch.equal(logits[0], logits[1])


def test_override_from_the_command_line_converts_every_experts_config(tiny_flavor):
    """``--override.imports`` with a recipe, parsed by torchtitan's command-line rules and applied to the model
    spec as the trainer applies it (to ``Trainer.Config``, whose traversal reaches the model spec's)."""
    spec = qwen3.model_registry(tiny_flavor)
    ConfigManager()  # registers its command-line rules
    parsed = tyro.cli(
        _OverrideOnly, args=["--override.imports", f'{OVERRIDE}={{"recipe": "blockwise"}}'], registry=custom_registry
    )
    assert parsed.override.imports == [(OVERRIDE, {"recipe": "blockwise"})]
    replaced = apply_overrides(parsed.override, spec)
    assert len(replaced) == MODEL_LAYERS
    experts_configs = [c for _, c, _, _ in spec.model.traverse(GroupedExperts.Config)]
    assert all(type(c).__qualname__ == "Fp8GroupedExperts.Config" and c.recipe == "blockwise" for c in experts_configs)
    assert spec.model.to_dict()["layers"][0]["moe"]["routed_experts"]["inner_experts"]["recipe"] == "blockwise"

    experts = _experts(_build(spec.model))
    assert len(experts) == MODEL_LAYERS and all(m.recipe.name == "blockwise" for m in experts)
    # Converting again changes nothing (as ops.convert_to_fp8).
    assert fp8_titan.fp8_experts_configs(spec.model, "mxfp8") is spec.model
    assert all(c.recipe == "blockwise" for _, c, _, _ in spec.model.traverse(GroupedExperts.Config))


def test_converter_converts_gpt_oss_experts_and_selects_by_fqn():
    experts = GptOssGroupedExperts.Config(dim=DIM, hidden_dim=HIDDEN, num_experts=EXPERTS)
    converted = fp8_titan.Fp8GroupedExpertsConverter.Config(recipe="mxfp8").build().convert(experts)
    assert isinstance(converted, GptOssGroupedExperts.Config) and converted.swiglu_limit == experts.swiglu_limit
    module = converted.build()
    assert type(module).__name__ == "Fp8GptOssGroupedExperts" and module.recipe.name == "mxfp8"

    model_config = _tiny_qwen3_moe()
    converter = fp8_titan.Fp8GroupedExpertsConverter.Config(fqns=["layers.1."]).build()
    model_config = converter.convert(model_config)
    selected = {
        fqn: isinstance(c, fp8_titan.Fp8ExpertsConfig) for fqn, c, _, _ in model_config.traverse(GroupedExperts.Config)
    }
    assert list(selected.values()) == [False, True], selected


def test_bad_options_raise_naming_the_option(tiny_flavor):
    with pytest.raises(ValueError, match=r"Fp8GroupedExpertsConverter\.Config\.recipe must be one of .*'fp4'"):
        fp8_titan.Fp8GroupedExpertsConverter.Config(recipe="fp4")
    with pytest.raises(ValueError, match=r"fp8_grouped_experts's recipe must be one of .*'fp4'"):
        apply_overrides(OverrideConfig(imports=[(OVERRIDE, {"recipe": "fp4"})]), qwen3.model_registry(tiny_flavor))
    with pytest.raises(TypeError, match="recipie"):
        apply_overrides(OverrideConfig(imports=[(OVERRIDE, {"recipie": "rowwise"})]), qwen3.model_registry(tiny_flavor))
    with pytest.raises(ValueError, match=r"has no MoE experts config \(GroupedExperts.Config\)"):
        qwen3.model_registry("debugmodel", converters=[fp8_titan.Fp8GroupedExpertsConverter.Config()])
    with pytest.raises(ValueError, match=r"fqns=\['decoder'\]"):
        qwen3.model_registry(tiny_flavor, converters=[fp8_titan.Fp8GroupedExpertsConverter.Config(fqns=["decoder"])])
    experts = fp8_titan.fp8_experts_config(GroupedExperts.Config(dim=DIM, hidden_dim=HIDDEN, num_experts=EXPERTS))
    with pytest.raises(ValueError, match=r"Fp8GroupedExperts\.Config\.recipe must be one of"):
        type(experts)(dim=DIM, hidden_dim=HIDDEN, num_experts=EXPERTS, recipe="rowwise ")
    with pytest.raises(ValueError, match=r"Config\.fp8_all_gather: .* recipe 'blockwise' does not take"):
        fp8_titan.Fp8GroupedExpertsConverter.Config(recipe="blockwise", fp8_all_gather=True)
    with pytest.raises(ValueError, match=r"fp8_grouped_experts's fp8_all_gather must be a bool"):
        apply_overrides(
            OverrideConfig(imports=[(OVERRIDE, {"fp8_all_gather": "yes"})]), qwen3.model_registry(tiny_flavor)
        )
    gpt_oss = fp8_titan.fp8_experts_config(
        GptOssGroupedExperts.Config(dim=DIM, hidden_dim=HIDDEN, num_experts=EXPERTS), fp8_all_gather=True
    )
    with pytest.raises(TypeError, match=r"fp8_all_gather: Fp8GptOssGroupedExperts has its own forward"):
        gpt_oss.build()


# --- FP8 all-gather of torchtitan's experts under FSDP2 (gloo, 2 ranks) ----------------------------


def _fp8_all_gather_worker(rank: int, world: int) -> None:
    """Torchtitan's experts built as torchtitan builds them (meta device, ``fully_shard``, ``to_empty``, init) with
    ``fp8_all_gather``: the seam gets the gathered FP8 weight, and output, dx and the reduce-scattered weight
    gradients are bitwise those of the same FP8 experts without FSDP2 (weights gathered in full)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    config = GroupedExperts.Config(dim=DIM, hidden_dim=HIDDEN, num_experts=EXPERTS)
    with torch.device("meta"):
        module = fp8_titan.fp8_experts_config(config, fp8_all_gather=True).build()
    fully_shard(module, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    module.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    full = {}
    with torch.no_grad():
        for name, p in module.named_parameters():
            # float32 values that bf16 holds exactly: the reference's w.bfloat16() then changes nothing.
            value = (torch.randn(p.shape, generator=gen) * 0.2).bfloat16().float()
            p.to_local().copy_(value.chunk(world)[rank])
            full[name] = value
    reference = fp8_titan.fp8_experts_config(config).build()
    reference.load_state_dict(full)
    counts = torch.tensor([30, 0, 1, 33], dtype=torch.int32)
    x = torch.randn(int(counts.sum()), DIM, generator=gen).to(torch.bfloat16)
    grad = torch.randn(x.shape, generator=gen).to(torch.bfloat16)

    seam_weights: list[type] = []
    seam = module._grouped_mm

    def recording(*, A, B_t, offs):
        seam_weights.append(type(B_t))
        return seam(A=A, B_t=B_t, offs=offs)

    module._grouped_mm = recording
    got = _forward_backward(module, (x, counts), grad)
    want = _forward_backward(reference, (x, counts), grad)
    assert seam_weights == [ops.Fp8WeightTensor] * 3, seam_weights
    for name, value in want.items():
        actual = got[name].full_tensor() if hasattr(got[name], "full_tensor") else got[name]
        assert actual.dtype == value.dtype and torch.equal(actual, value), name
    # The checkpoint holds plain tensors.
    assert all(type(v.to_local()) is torch.Tensor for v in module.state_dict().values())


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fp8_all_gather_under_fsdp2_matches_unsharded():
    run_distributed(_fp8_all_gather_worker, 2, timeout_s=240, join_timeout_s=600)


def test_import_ops_does_not_import_torchtitan():
    code = "import sys, ops; assert 'torchtitan' not in sys.modules and 'ops.torchtitan' not in sys.modules"
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


# --- FP8 dispatch in torchtitan's expert parallelism (gloo, 2 ranks) --------------------------------


def _dispatch_both(dispatcher, x: torch.Tensor, scores: torch.Tensor, ids: torch.Tensor):
    """``dispatcher``'s routed rows and counts for ``x``, then ``combine`` of the rows times 3 ("experts")."""
    x = x.detach().requires_grad_()
    counts = torch.bincount(ids.flatten(), minlength=EXPERTS)
    routed, local_counts, metadata = dispatcher.dispatch(x, scores, ids, counts)
    out = dispatcher.combine(routed * 3, metadata, x)
    return x, routed, local_counts, out


def _fp8_dispatch_worker(rank: int, world: int, backend: str) -> None:
    """Torchtitan's standard dispatcher against ``Fp8AllToAllTokenDispatcher`` over the same EP mesh, under one of
    torchtitan's SPMD backends (its exchanges differ): the FP8 one's received rows are the standard one's quantized
    rowwise and dequantized (bitwise), its counts the same, and the gradient reaching the tokens (sent back in
    bf16) bitwise the standard one's."""
    from torch.distributed.device_mesh import init_device_mesh

    from kernels_helion import quantize_rowwise_rows
    from ops.torchtitan_dispatch import Fp8AllToAllTokenDispatcher
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    set_spmd_backend(backend)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    gen = torch.Generator().manual_seed(rank)
    tokens = 11 + 6 * rank  # ranks with different token counts
    x = (torch.randn(tokens, DIM, generator=gen) * torch.rand(tokens, 1, generator=gen) * 8).to(torch.bfloat16)
    x[0, 1] = float("nan")  # NaN reaches the rows of token 0 only
    # Expert 3 chosen by no token of rank 0; expert 0 by rank 1's token 2 twice over (top-2 with a repeat).
    ids = torch.randint(0, EXPERTS - (1 if rank == 0 else 0), (tokens, 2), generator=gen)
    if rank == 1:
        ids[2] = 0
    scores = torch.rand(tokens, 2, generator=gen)
    grad = torch.randn(tokens, DIM, generator=gen).to(torch.bfloat16)
    sent = []
    exchange = AllToAllTokenDispatcher._dispatch_token_exchange

    def recording(self, t, *args):
        sent.append((t.dtype, t.shape[1]))
        return exchange(self, t, *args)

    AllToAllTokenDispatcher._dispatch_token_exchange = recording
    results = []
    for config_cls in (AllToAllTokenDispatcher.Config, Fp8AllToAllTokenDispatcher.Config):
        dispatcher = config_cls(num_experts=EXPERTS, top_k=2).build()
        dispatcher.wire_meshes(ep_mesh=mesh)
        x_in, routed, local_counts, out = _dispatch_both(dispatcher, x, scores, ids)
        out.backward(grad)
        results.append((routed.detach(), local_counts, x_in.grad))
    (ref_rows, ref_counts, ref_dx), (rows, counts, dx) = results
    # bf16 rows, then FP8 rows with their float32 scales: DIM + 4 bytes a row.
    assert sent == [(torch.bfloat16, DIM), (torch.uint8, DIM + 4)], sent
    assert torch.equal(counts, ref_counts) and rows.dtype == torch.bfloat16 and rows.shape == ref_rows.shape
    data, row_scales = quantize_rowwise_rows(ref_rows)
    expected = (data.float() * row_scales[:, None]).bfloat16()
    torch.testing.assert_close(rows, expected, rtol=0, atol=0, equal_nan=True)
    assert rows.isnan().any(dim=1).sum() == ref_rows.isnan().any(dim=1).sum()
    # FP8 experts quantizing the received rows get bitwise the FP8 rows and scales that were sent. (A row with a
    # NaN is sent with scale inf and comes back all NaN, as the experts' GEMM output of that row is either way.)
    again, again_scales = quantize_rowwise_rows(rows)
    finite = ref_rows.isfinite().all(dim=1)
    assert torch.equal(again.view(torch.uint8)[finite], data.view(torch.uint8)[finite])
    assert torch.equal(again_scales[finite], row_scales[finite])
    assert rows[~finite].isnan().all()
    assert torch.equal(dx, ref_dx)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fp8_dispatch_matches_torchtitans_dispatcher_quantized():
    # The "partial_dtensor" backend's exchange (functional collectives). Under "spmd_types" torchtitan's own
    # exchange (spmd_types.all_to_all, a list all-to-all of unequal parts) fails on gloo for its bf16 dispatcher too.
    run_distributed(_fp8_dispatch_worker, 2, "partial_dtensor", timeout_s=240, join_timeout_s=600)


def test_fp8_dispatch_from_the_converter_and_the_override(tiny_flavor):
    from ops.torchtitan_dispatch import DISPATCH_OVERRIDE, Fp8AllToAllTokenDispatcher

    converter = fp8_titan.Fp8GroupedExpertsConverter.Config(fp8_dispatch=True, fqns=["layers.1."]).build()
    model_config = converter.convert(_tiny_qwen3_moe())
    dispatchers = [c.token_dispatcher for _, c, _, _ in model_config.traverse(RoutedExperts.Config)]
    assert len(dispatchers) == MODEL_LAYERS
    assert all(type(c) is Fp8AllToAllTokenDispatcher.Config and c.recipe == "rowwise" for c in dispatchers)
    assert all(type(m.token_dispatcher) is Fp8AllToAllTokenDispatcher for m in _build(model_config).modules()
               if isinstance(m, RoutedExperts))

    spec = qwen3.model_registry(tiny_flavor)
    apply_overrides(OverrideConfig(imports=[DISPATCH_OVERRIDE]), spec)
    dispatchers = [c.token_dispatcher for _, c, _, _ in spec.model.traverse(RoutedExperts.Config)]
    assert all(type(c) is Fp8AllToAllTokenDispatcher.Config for c in dispatchers) and len(dispatchers) == MODEL_LAYERS

    with pytest.raises(ValueError, match=r"fp8_dispatch: FP8 dispatch sends rows quantized rowwise .* not 'mxfp8'"):
        fp8_titan.Fp8GroupedExpertsConverter.Config(recipe="mxfp8", fp8_dispatch=True)
    with pytest.raises(ValueError, match="fp8_dispatch must be a bool"):
        fp8_titan.Fp8GroupedExpertsConverter.Config(fp8_dispatch="yes")
    deepep = fp8_titan.Fp8GroupedExpertsConverter.Config(fp8_dispatch=True).build()
    with pytest.raises(ValueError, match=r"layers\.0\..*standard all-to-all token dispatcher.*DeepEPTokenDispatcher"):
        deepep.convert(_tiny_qwen3_moe(moe_comm_backend="deepep"))
