"""``convert_to_fp8`` on Hugging Face transformers 5 MoE models, against the same models in bf16.

Five families from tiny random-init configs (no downloads): Qwen3-MoE, Qwen2-MoE, Mixtral,
DeepSeek-V3 (the fused SwiGLU up-projection over the packed ``gate_up_proj``) and gpt-oss
(interleaved, transposed, biased and clamped SwiGLU: the generic path with the model's own
activation). Needs the ``transformers`` package (skipped without it).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ops
from ops.transformers_experts import Fp8TransformersExperts
from tests.reference import ref_quantize_rowwise
from tests.support import DEVICE, sqnr_db

transformers = pytest.importorskip("transformers")

VOCAB, TOKENS = 96, 24
# The whole model's logits and the experts' weight gradients after FP8 GEMMs (three chained
# in the experts), against bf16: FP8 e4m3 gives about 25-30 dB per GEMM; a weight gradient
# here sums a handful of rows per expert (24 tokens), so its noise averages out little
# (12-25 dB measured on CPU and an H200).
MIN_LOGITS_SQNR_DB = 20
MIN_GRAD_SQNR_DB = 10
# Against the same experts with their GEMMs' operands quantized and dequantized in plain PyTorch
# (the activation and biases the model's own): the first GEMM agrees to bf16 rounding (summation
# order), which flips the FP8 rounding of a few activations before the second GEMM; a wrong
# activation, clamp, bias or routing costs far more (bf16 against FP8 is about 25 dB).
MIN_EMULATED_SQNR_DB = 28

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _config(family: str, **overrides) -> transformers.PretrainedConfig:
    """A tiny config of ``family`` (all expert dims multiples of 16)."""
    if family == "qwen3_moe":
        kwargs = dict(_COMMON, head_dim=16, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                      num_experts_per_tok=2, norm_topk_prob=True)
        cls = transformers.Qwen3MoeConfig
    elif family == "qwen2_moe":
        kwargs = dict(_COMMON, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                      num_experts=4, num_experts_per_tok=2)
        cls = transformers.Qwen2MoeConfig
    elif family == "mixtral":
        kwargs = dict(_COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
        cls = transformers.MixtralConfig
    elif family == "deepseek_v3":
        kwargs = dict(_COMMON, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                      num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=32,
                      q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                      num_key_value_heads=4)
        cls = transformers.DeepseekV3Config
    elif family == "gpt_oss":
        kwargs = dict(_COMMON, head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                      sliding_window=8, layer_types=["sliding_attention", "full_attention"])
        cls = transformers.GptOssConfig
    else:
        raise ValueError(family)
    kwargs.update(overrides)
    return cls(**kwargs)


FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "gpt_oss")


def _model(family: str, **overrides) -> nn.Module:
    """A bf16 causal LM of ``family``, every parameter drawn at random from a fixed seed."""
    torch.manual_seed(0)
    config = _config(family, **overrides)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(DEVICE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.1 if "bias" in name else 0.2 / p.shape[-1] ** 0.5 * 4)
    return model.eval()


def _experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if n.endswith("mlp.experts")]


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, TOKENS // 2), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("family", FAMILIES)
def test_converts_in_place_and_matches_bf16(family: str) -> None:
    model = _model(family)
    fp8 = copy.deepcopy(model)
    params_before = dict(fp8.named_parameters())
    keys_before = list(fp8.state_dict())
    assert ops.convert_to_fp8(fp8) is fp8
    experts = _experts(fp8)
    assert experts, "the model has MoE experts"
    for _, module in experts:
        assert isinstance(module, Fp8TransformersExperts)
        assert type(module).__name__ == f"Fp8{type(module).__mro__[2].__name__}"
    # The same Parameter objects under the same names, the same state-dict keys.
    assert all(p is params_before[n] for n, p in fp8.named_parameters())
    assert list(fp8.state_dict()) == keys_before
    # Converting again changes nothing.
    ops.convert_to_fp8(fp8)
    assert [type(m) for _, m in _experts(fp8)] == [type(m) for _, m in experts]

    ids = _tokens()
    out_bf16 = model(ids, labels=ids)
    out_fp8 = fp8(ids, labels=ids)
    assert sqnr_db(out_fp8.logits.float(), out_bf16.logits.float()) > MIN_LOGITS_SQNR_DB
    out_bf16.loss.backward()
    out_fp8.loss.backward()
    grads = dict(model.named_parameters())
    for name, p in fp8.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        if ".experts." in name and "bias" not in name:
            assert sqnr_db(p.grad.float(), grads[name].grad.float()) > MIN_GRAD_SQNR_DB, name


# Power-of-2 scales: the dequantized operands are exact in bf16, so transformers' bf16 GEMMs on
# them differ from the FP8 GEMMs only in float32 summation order.
POW2 = ops.Fp8Recipe(round_scales_to_power_of_2=True)


def _emulated_fp8(module: nn.Module, recipe: ops.Fp8Recipe) -> nn.Module:
    """``module`` (unconverted) computing as our FP8 GEMMs do: each GEMM's operands quantized rowwise
    (the tokens per row, the weights per output row) and dequantized, in plain PyTorch."""

    def fake_quant(t: torch.Tensor) -> torch.Tensor:
        rows = t.reshape(-1, t.shape[-1])
        q, scales = ref_quantize_rowwise(rows, recipe.float8_dtype, recipe.round_scales_to_power_of_2)
        return (q.float() * scales[:, None]).to(t.dtype).reshape(t.shape)

    emulated = copy.deepcopy(module)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(emulated, name)
            # Each output row quantized over the inputs: the last dim of (E, out, in), dim 1 of (E, in, out).
            w.copy_(fake_quant(w.transpose(-2, -1)).transpose(-2, -1) if emulated.is_transposed else fake_quant(w))
    gate = emulated._apply_gate
    emulated._apply_gate = lambda gate_up: fake_quant(gate(gate_up))
    original_forward = emulated.forward
    emulated.forward = lambda x, *args: original_forward(fake_quant(x), *args)
    return emulated


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_experts_match_emulated_fp8(family: str) -> None:
    """The experts alone against transformers' own eager experts with FP8-emulated GEMM operands: the
    model's activation (gpt-oss: clamped, interleaved, with biases) and routing are reproduced exactly."""
    _, experts = _experts(_model(family))[0]
    experts.config._experts_implementation = "eager"
    tokens, dim = 40, experts.down_proj.shape[1 if not experts.is_transposed else 2]
    gen = torch.Generator().manual_seed(3)
    # Large enough that gpt-oss's clamp (|gate|, |up| <= limit) cuts some of the projections.
    x = (4 * torch.randn(tokens, dim, generator=gen)).to(DEVICE, torch.bfloat16)
    num_experts = experts.down_proj.shape[0]
    top_k_index = torch.stack([torch.randperm(num_experts, generator=gen)[:2] for _ in range(tokens)]).to(DEVICE)
    top_k_weights = torch.rand(tokens, 2, generator=gen).softmax(-1).to(DEVICE, torch.bfloat16)
    emulated = _emulated_fp8(experts, POW2)
    reference = emulated(x, top_k_index, top_k_weights)
    if family == "gpt_oss":
        gate_up = torch.einsum("td,edn->ten", x.float(), emulated.gate_up_proj.detach().float())
        assert (gate_up.abs() > experts.limit).any(), "the clamp is exercised"
    fp8 = ops.convert_to_fp8(copy.deepcopy(experts), POW2)
    out = fp8(x, top_k_index, top_k_weights)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert sqnr_db(out.float(), reference.float()) > MIN_EMULATED_SQNR_DB


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_optimizer_steps(family: str) -> None:
    model = _model(family).train()
    ops.convert_to_fp8(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = _tokens(seed=5)
    experts_before = [m.down_proj.detach().clone() for _, m in _experts(model)]
    losses = []
    for _ in range(4):
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]  # one batch, repeated: the loss falls
    assert all(not torch.equal(before, m.down_proj) for before, (_, m) in zip(experts_before, _experts(model)))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_save_pretrained_round_trip(family: str, tmp_path) -> None:
    """A converted model saves as the unconverted one does and reloads into an unconverted model
    whose bf16 forward equals the original's."""
    model = _model(family)
    fp8 = ops.convert_to_fp8(copy.deepcopy(model))
    fp8.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, attn_implementation="eager")
    reloaded = reloaded.to(DEVICE).eval()
    assert not any(isinstance(m, Fp8TransformersExperts) for m in reloaded.modules())
    ids = _tokens()
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_unsupported_layout_is_refused_by_name() -> None:
    # An expert intermediate size that FP8 rows cannot hold (not a multiple of 16).
    model = _model("qwen3_moe", moe_intermediate_size=24)
    with pytest.raises(ValueError, match=r"Qwen3MoeExperts at 'model\.layers\.0\.mlp\.experts'.*gate_up_proj \(4, 48, 64\)"):
        ops.convert_to_fp8(model)
    # filter_fn leaves it out.
    ops.convert_to_fp8(model, filter_fn=lambda module, fqn: "experts" not in fqn)

    class CustomExperts(nn.Module):  # 3-D weights, but not transformers' experts contract
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.zeros(4, 64, 32))
            self.down_proj = nn.Parameter(torch.zeros(4, 32, 32))

    with pytest.raises(ValueError, match=r"CustomExperts at 'experts'.*down_proj \(4, 32, 32\).*use_experts_implementation"):
        ops.convert_to_fp8(nn.ModuleDict({"experts": CustomExperts()}))


def test_gradient_checkpointing_gives_the_same_gradients() -> None:
    """``gradient_checkpointing_enable()`` (Trainer's option) recomputes the converted experts in backward:
    the same loss and gradients, bit for bit."""
    model = ops.convert_to_fp8(_model("qwen3_moe").train())
    checkpointed = copy.deepcopy(model)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = _tokens(seed=7)
    losses = []
    for m in (model, checkpointed):
        loss = m(ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    grads = dict(checkpointed.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, grads[name].grad), name


def _dequantized(t: torch.Tensor, recipe: ops.Fp8Recipe) -> torch.Tensor:
    """``t``'s rows quantized rowwise by ``recipe`` and dequantized, in float32 (exact with power-of-2 scales)."""
    rows = t.reshape(-1, t.shape[-1])
    q, scales = ref_quantize_rowwise(rows, recipe.float8_dtype, recipe.round_scales_to_power_of_2)
    return (q.float() * scales[:, None]).reshape(t.shape)


def test_gpt_oss_activation_and_biases_are_the_models_own() -> None:
    """Between the FP8 GEMMs, gpt-oss's experts run its own clamped, interleaved SwiGLU on each pair's
    projection plus its expert's bias, in bf16: checked stage by stage against plain PyTorch (the
    GEMMs on dequantized operands), so no FP8 rounding flip blurs the comparison."""
    _, experts = _experts(_model("gpt_oss"))[0]
    fp8 = ops.convert_to_fp8(copy.deepcopy(experts), POW2)
    seen = {}

    def recording_gate(gate_up: torch.Tensor) -> torch.Tensor:
        seen["in"], seen["out"] = gate_up.detach().clone(), type(experts)._apply_gate(fp8, gate_up)
        return seen["out"]

    fp8._apply_gate = recording_gate
    tokens, dim, top_k = 40, experts.down_proj.shape[2], 2
    num_experts = experts.down_proj.shape[0]
    gen = torch.Generator().manual_seed(4)
    x = (4 * torch.randn(tokens, dim, generator=gen)).to(DEVICE, torch.bfloat16)
    top_k_index = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)]).to(DEVICE)
    top_k_weights = torch.rand(tokens, top_k, generator=gen).softmax(-1).to(DEVICE, torch.bfloat16)
    out = fp8(x, top_k_index, top_k_weights)

    order = ops.sort_by_expert(top_k_index, num_experts)
    token_of_pair = order.order // top_k
    expert_of_pair = top_k_index.flatten()[order.order]
    with torch.no_grad():
        # gpt-oss stores (E, in, out): each output column is quantized over the inputs.
        w_up = _dequantized(experts.gate_up_proj.transpose(1, 2), POW2)[expert_of_pair]  # (P, 2I, D)
        w_down = _dequantized(experts.down_proj.transpose(1, 2), POW2)[expert_of_pair]  # (P, D, I)
        x_pairs = _dequantized(x, POW2)[token_of_pair]
        gate_up = torch.einsum("pd,pnd->pn", x_pairs, w_up).bfloat16() + experts.gate_up_proj_bias[expert_of_pair]
        assert sqnr_db(seen["in"].float(), gate_up.float()) > 45
        assert (seen["in"].abs() > experts.limit).any(), "the clamp is exercised"
        h = _dequantized(seen["out"], POW2)
        y = torch.einsum("pi,pdi->pd", h, w_down).bfloat16() + experts.down_proj_bias[expert_of_pair]
        weights = top_k_weights.flatten()[order.order].float()
        reference = torch.zeros(tokens, dim, device=DEVICE).index_add_(0, token_of_pair, y.float() * weights[:, None])
    # bf16 roundings (the down GEMM's output, its bias add, the result) against float32 sums: about 45 dB.
    assert sqnr_db(out.float(), reference) > 40
