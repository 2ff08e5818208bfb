"""One MoE layer's forward + backward on one GPU: our bf16 layer, our FP8 variants, a torchtitan-style bf16 layer, SonicMoE.

    python -m benchmarks.moe_layer [--configs qwen3-8k qwen3-32k dsv3-256 dsv3-32] [--routing uniform skewed]
        [--micro-batches 4] [--sonic-configs qwen3-8k qwen3-32k] [--single-thread-autograd]
        [--host-time | --cuda-graph] [--out FILE] [--profile-dir DIR]
    python -m benchmarks.moe_layer --cpu-smoke     # tiny shapes on CPU: every peer runs once, no timing

A step is the whole layer, as inside a network: router (``nn.Linear``), softmax top-k,
the experts (SwiGLU), the weighted combine; backward of the output into the layer's
input and every weight; gradients cleared (``None``) before each step. Peers:

- ``bf16``: ``ops.MoE`` with ``ops.GroupedExperts`` (``torch._grouped_mm``, our sort,
  gathers and combine kernels);
- ``fp8 unfused``: ``ops.Fp8GroupedExperts`` with ``RowwiseOptions(fused_experts=False)``
  (three FP8 grouped linears, eager SwiGLU, the tokens gathered in bf16);
- ``fp8 fused``: the default rowwise recipe (``ops.moe_fused``; weights quantized once
  per optimizer step, ``Fp8Recipe.keep_quantized_weights``);
- ``fp8 fused, combine apart``: the same with the combine as an op of its own after the
  experts (its gradient rows ``(T * k, dim)`` written out in bf16, then quantized), the path
  ``ops.moe_fused.down_projection_combine`` replaces;
- ``fp8 fused, gradient of h``: the same with the down-projection given ``h`` alone (the path the
  default's ``gate_up`` replaces): its dgrad reads the combine's weighted gradient rows, SwiGLU's
  backward runs in the up-projection's, and the combine's rows ``(T * k, dim)`` are kept for the
  probabilities' gradient (``moe_combine_grad_probs``); the default's dgrad reads the rows before
  their weights and ``swiglu_backward_weighted`` applies them and makes that gradient;
- ``fp8 fused, SwiGLU backward in dgrad``: the same with ``RowwiseOptions.fused_swiglu_backward``
  (SwiGLU's backward and the probabilities' gradient in the down-projection's dgrad epilogue,
  ``grouped_mm_swiglu_backward``; ``h``'s gradient not written);
- ``fp8 fused, w2 dgrad on token rows`` / ``w2 dgrad folded``: the same with
  ``RowwiseOptions.down_dgrad_token_rows`` fixed to ``True`` (``w2``'s dgrad reads the output
  gradient's token rows, each quantized once, by index, against ``w2`` quantized along ``N``; the
  FP8 wgrad on them too, the default ``down_wgrad_token_rows``) or ``False`` (the pair rows quantized
  rowwise with ``w2``'s scales folded in); the default's ``"auto"`` picks one per layer;
- ``fp8 fused, w2 wgrad on token rows`` / ``on pair rows``: the dgrad on token rows with
  ``RowwiseOptions.down_wgrad_token_rows`` ``True`` (``w2``'s FP8 wgrad reads the token rows' FP8 bytes
  gathered into the token layout, ``h``'s FP8 rows quantized per (group, column) with the gradient's
  token scales folded in) or ``False`` (the pair rows' column form alone, from two passes over them);
- ``fp8 fused, weights each pass``: the same with ``keep_quantized_weights=False``;
- ``fp8 fused, dW into .grad`` / ``main_grad``: the same with
  ``RowwiseOptions.wgrad_accumulation`` (``ops.grad_accumulation``);
- ``fp8 fused, deferred wgrad, dW into .grad``: the same with ``RowwiseOptions.deferred_wgrad`` too: the
  experts' FP8 wgrads run once per step over every micro-batch (``ops.run_deferred_wgrads`` after the
  last backward, ``ops.deferred_wgrad``);
- ``fp8 fused, fp8 wgrad`` / ``bf16 wgrad``: the same with ``Fp8Recipe.wgrad_precision`` fixed
  (the default's ``"auto"`` picks one per layer); ``fp8 fused, w2 bf16 wgrad`` / ``w13 bf16 wgrad``:
  one projection's wgrad in bf16, the other's in FP8 (``SplitWgradExperts``);
- ``torchtitan-style bf16``: argsort, an index gather, three ``torch._grouped_mm``, eager
  SwiGLU, the weighted rows summed back with ``index_add_``;
- ``sonicmoe bf16`` (``sonicmoe.MoE``, its own router and weights), where it can be
  imported and the config is in ``--sonic-configs`` (its first call per shape compiles for
  minutes); skipped with a note otherwise.

Our peers share one router and one set of weights. They are timed in rounds that
rotate their order (``benchmarks.common.bench_peers_us``). Reported per peer: ms per step,
the experts' TFLOP/s (``18 * pairs * dim * hidden`` per step), peak memory over the
step (above what was allocated before it: the FP8 weight forms it makes count), the bytes autograd
saves for backward (``ops.saved_tensor_bytes``; parameters and kept FP8 weight forms
excluded), the bytes of the FP8 weight forms kept between optimizer steps
(``Fp8Recipe.keep_quantized_weights``: allocated from one step to the next, like the
parameters), the SQNR of ``out``, ``dx`` and ``dw`` (``w1``, ``w2``, ``w3`` together) against the
bf16 peer on the same input, and, with ``--micro-batches N``, ms per micro-batch when N
micro-batches accumulate the parameters' gradients (``x``'s is not accumulated: in training each
micro-batch has an input of its own; each step quantizes an FP8 peer's weights
afresh, as an optimizer step would make it, then keeps them for its micro-batches unless
the peer says "weights each pass"). With ``--host-time``, each peer's host time per step
while the GPU is kept busy (``benchmarks.common.host_ms``): a step whose host time is
above its kernels' runs at the host's speed. With ``--cuda-graph``, each of our peers' steps (gradients
cleared, kept FP8 weights dropped, the micro-batches) is captured in a CUDA graph and its replays are
timed (``benchmarks.common.captured``): no host time, as a training loop that captures the layer gets
(nothing in the layer syncs with the host). SonicMoE is not captured, so it does not run then.
The JSON rows also hold the SM clock read right after the one-micro-batch timing rounds
(``sm_clock_mhz``; ``benchmarks.common.sm_clock_mhz``), and ``--profile-dir``'s kernel tables the wall
time of the profiled steps and the clock after them: a profile and a timing run at different
clocks under sustained FP8 load.
Routing: ``uniform`` (a random router: about ``tokens * k / E`` rows per expert) or
``skewed`` (a fixed router bias, the log of Dirichlet(1) expert weights times 4).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import math
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import ops
from benchmarks.common import (
    bench_peers_us,
    captured,
    emit_report,
    environment_header,
    host_ms,
    kernel_table,
    markdown_table,
    sm_clock_mhz,
)
from benchmarks.moe_parallel import CONFIGS as PARALLEL_CONFIGS
from benchmarks.moe_parallel import LayerConfig
from ops.moe_fused import down_projection_combine, swiglu_up_projection
from ops.weight_reuse import kept_forms

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class LayerShape:
    """A benchmark configuration: the layer (``benchmarks.moe_parallel``'s) and the tokens of one step."""

    layer: LayerConfig
    tokens: int


CONFIGS = {
    "qwen3-8k": LayerShape(PARALLEL_CONFIGS["qwen3"], 8192),
    "qwen3-32k": LayerShape(PARALLEL_CONFIGS["qwen3"], 32768),
    "dsv3-256": LayerShape(PARALLEL_CONFIGS["dsv3"], 8192),
    # One rank's experts under EP=8: 32 of 256, each with 8x the tokens of the 256-expert layer.
    "dsv3-32": LayerShape(replace(PARALLEL_CONFIGS["dsv3"], name="DeepSeek-V3-like, 32 experts", experts=32), 32768),
}
CPU_SMOKE = LayerShape(LayerConfig("CPU smoke", 64, 32, 8, 2), 48)
# Our FP8 peers: today's default recipe ("fp8 fused"), the unfused path it replaces, the
# weight-side choices (weights quantized at every pass; dW added into .grad or main_grad by the GEMM),
# and the wgrad's precision and w2's dgrad form fixed (the default's "auto" picks them per layer).
FP8_PEERS = {
    "fp8 unfused": ops.Fp8Recipe(options=ops.RowwiseOptions(fused_experts=False)),
    "fp8 fused": ops.Fp8Recipe(),
    "fp8 fused, weights each pass": ops.Fp8Recipe(keep_quantized_weights=False),
    "fp8 fused, dW into .grad": ops.Fp8Recipe(options=ops.RowwiseOptions(wgrad_accumulation="grad")),
    "fp8 fused, dW into main_grad": ops.Fp8Recipe(options=ops.RowwiseOptions(wgrad_accumulation="main_grad")),
    "fp8 fused, deferred wgrad, dW into .grad": ops.Fp8Recipe(
        options=ops.RowwiseOptions(wgrad_accumulation="grad", deferred_wgrad=True)
    ),
    "fp8 fused, fp8 wgrad, dW into .grad": ops.Fp8Recipe(
        wgrad_precision="fp8", options=ops.RowwiseOptions(wgrad_accumulation="grad")
    ),
    "fp8 fused, fp8 wgrad": ops.Fp8Recipe(wgrad_precision="fp8"),
    "fp8 fused, bf16 wgrad": ops.Fp8Recipe(wgrad_precision="bf16"),
    "fp8 fused, SwiGLU backward in dgrad": ops.Fp8Recipe(options=ops.RowwiseOptions(fused_swiglu_backward=True)),
    "fp8 fused, w2 dgrad on token rows": ops.Fp8Recipe(options=ops.RowwiseOptions(down_dgrad_token_rows=True)),
    "fp8 fused, w2 dgrad folded": ops.Fp8Recipe(options=ops.RowwiseOptions(down_dgrad_token_rows=False)),
    "fp8 fused, w2 wgrad on token rows": ops.Fp8Recipe(
        options=ops.RowwiseOptions(down_dgrad_token_rows=True, down_wgrad_token_rows=True)
    ),
    "fp8 fused, w2 wgrad on pair rows": ops.Fp8Recipe(
        options=ops.RowwiseOptions(down_dgrad_token_rows=True, down_wgrad_token_rows=False)
    ),
}


class CombineApartExperts(ops.Fp8GroupedExperts):
    """``ops.Fp8GroupedExperts`` that return the pairs' rows: ``ops.MoE`` combines them in an op of its own."""

    takes_combine = False


class GradientOfHExperts(ops.Fp8GroupedExperts):
    """``ops.Fp8GroupedExperts`` whose down-projection gets ``h`` alone (not the up-projection's ``gate_up``):
    the dgrad reads the combine's weighted gradient rows, ``h``'s gradient goes to the up-projection's
    backward (``swiglu_backward``), and the combine's rows are kept for ``moe_combine_grad_probs``."""

    def swiglu_down_projection_combine(
        self,
        x: Tensor,
        offs: Tensor,
        combine: tuple,
        x_fp8: tuple[Tensor, Tensor] | None = None,
        routing: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        h = self.swiglu(x, offs, x_fp8=x_fp8, routing=routing)
        return down_projection_combine(h, self.w2, offs, self.recipe, *combine)


class SplitWgradExperts(ops.Fp8GroupedExperts):
    """``ops.Fp8GroupedExperts`` whose two projections take their wgrad in different precisions:
    the up-projection (``w1``/``w3``) with ``up_recipe``, the down-projection (``w2``) with ``self.recipe``."""

    up_recipe: ops.Fp8Recipe

    def swiglu_down_projection_combine(
        self,
        x: Tensor,
        offs: Tensor,
        combine: tuple,
        x_fp8: tuple[Tensor, Tensor] | None = None,
        routing: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        rows, inverse = (None, None) if routing is None else routing
        h, gate_up = swiglu_up_projection(
            x, (self.w1, self.w3), offs, self.up_recipe, rows=rows, inverse=inverse, x_fp8=x_fp8, with_gate_up=True
        )
        return down_projection_combine(h, self.w2, offs, self.recipe, *combine, gate_up=gate_up)


def split_wgrad(up: str, down: str) -> Callable[[nn.Module, ops.Fp8Recipe], nn.Module]:
    """``SplitWgradExperts.from_module`` with the up-projection's wgrad in ``up`` and ``w2``'s in ``down``."""

    def from_module(module: nn.Module, recipe: ops.Fp8Recipe) -> nn.Module:
        experts = SplitWgradExperts.from_module(module, replace(recipe, wgrad_precision=down))
        experts.up_recipe = replace(recipe, wgrad_precision=up)
        return experts

    return from_module


# Peers with the default recipe and experts of their own: a part of the fused path run apart (the path
# it replaces), or each projection's wgrad in its own precision.
EXPERT_VARIANTS = {
    "fp8 fused, combine apart": CombineApartExperts.from_module,
    "fp8 fused, gradient of h": GradientOfHExperts.from_module,
    "fp8 fused, w2 bf16 wgrad": split_wgrad("fp8", "bf16"),
    "fp8 fused, w13 bf16 wgrad": split_wgrad("bf16", "fp8"),
}
PEERS = ("bf16", *FP8_PEERS, *EXPERT_VARIANTS, "torchtitan-style bf16", "sonicmoe bf16")


class TorchtitanStyleMoE(nn.Module):
    """torchtitan's bf16 MoE data flow over ``moe``'s router and weights (shared, not copied).

    Argsort of the flat expert choices, ``x[token]`` gathered, three ``torch._grouped_mm``,
    eager SwiGLU, each row times its routing weight, ``index_add_`` back to the tokens.
    """

    def __init__(self, moe: ops.MoE) -> None:
        super().__init__()
        self.moe = moe

    def forward(self, x: Tensor) -> Tensor:
        moe, experts = self.moe, self.moe.experts
        top_probs, top_experts = moe.route(x)
        flat = top_experts.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(moe.num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        token = order // moe.top_k
        xs = x[token]
        gate = torch._grouped_mm(xs, experts.w1.transpose(-2, -1), offs=offs)
        up = torch._grouped_mm(xs, experts.w3.transpose(-2, -1), offs=offs)
        y = torch._grouped_mm(F.silu(gate) * up, experts.w2.transpose(-2, -1), offs=offs)
        y = (y.float() * top_probs.flatten()[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, y)


def build_peers(
    config: LayerConfig, device: torch.device, routing: str, names: tuple[str, ...] = PEERS
) -> dict[str, nn.Module]:
    """Our peers named in ``names`` (``bf16`` always: the reference) over one router and one set of weights."""
    torch.manual_seed(0)
    bf16 = ops.MoE(config.dim, config.hidden, config.experts, config.top_k, device=device)
    if routing == "skewed":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            weights = torch.distributions.Dirichlet(torch.ones(config.experts)).sample()
        router = nn.Linear(config.dim, config.experts, bias=True, dtype=torch.bfloat16, device=device)
        with torch.no_grad():
            router.weight.copy_(bf16.router.weight)
            router.bias.copy_(weights.clamp_min(1e-6).log() * 4.0)
        router.bias.requires_grad_(False)
        bf16.router = router
    elif routing != "uniform":
        raise ValueError(f"routing must be 'uniform' or 'skewed', got {routing!r}")
    peers: dict[str, nn.Module] = {"bf16": bf16}
    for name in (*FP8_PEERS, *EXPERT_VARIANTS):
        if name not in names:
            continue
        layer = ops.MoE(config.dim, config.hidden, config.experts, config.top_k, device="meta")
        layer.router = bf16.router
        from_module = EXPERT_VARIANTS.get(name, ops.Fp8GroupedExperts.from_module)
        layer.experts = from_module(bf16.experts, FP8_PEERS.get(name, ops.Fp8Recipe()))
        peers[name] = layer
    if "torchtitan-style bf16" in names:
        peers["torchtitan-style bf16"] = TorchtitanStyleMoE(bf16)
    return peers


def sonic_layer(config: LayerConfig, device: torch.device) -> tuple[nn.Module | None, str]:
    """SonicMoE's layer for ``config``, or ``None`` and why not."""
    try:
        import sonicmoe
        from sonicmoe.enums import ActivationType
    except ImportError as error:
        return None, f"sonicmoe not importable ({error.__class__.__name__}: {error})"
    torch.manual_seed(0)
    moe = sonicmoe.MoE(
        config.experts, config.top_k, config.dim, config.hidden, ActivationType.SWIGLU, add_bias=False, std=0.02
    )
    return moe.to(device, torch.bfloat16), ""


def layer_step(layer: nn.Module, x: Tensor, grad_out: Tensor, last: bool = True) -> Tensor:
    """Forward and backward of one micro-batch; returns the output. ``last``: the step's last micro-batch,
    after which the deferred wgrads run (``RowwiseOptions.deferred_wgrad``; nothing for the other peers)."""
    out = layer(x)
    if isinstance(out, tuple):  # SonicMoE returns (out, aux_loss)
        out = out[0]
    out.backward(grad_out)
    if last:
        ops.run_deferred_wgrads(layer)
    return out


def clear_grads(params: list[Tensor], x: Tensor) -> None:
    """``zero_grad(set_to_none=True)``, ``main_grad`` included, and no kept FP8 weights (those of
    the peer measured before would otherwise take memory beside the next one's)."""
    for p in params:
        p.grad = None
    ops.zero_main_grads(params)
    ops.release_quantized_weights()
    x.grad = None


def step_fn(layer: nn.Module, x: Tensor, grad_out: Tensor, micro_batches: int) -> Callable[[], None]:
    """One optimizer step's work: gradients cleared, then ``micro_batches`` micro-batches accumulating into the
    parameters' gradients (``x``'s is dropped before each micro-batch, as a micro-batch's own input's would be).

    The weights change at every optimizer step, so an FP8 peer's kept quantized weights
    are dropped first (``ops.release_quantized_weights``, as a changed weight would be):
    each step quantizes the weights once (or once per pass with
    ``keep_quantized_weights=False``), as in training.
    """
    params = [p for p in layer.parameters() if p.requires_grad]

    def run() -> None:
        clear_grads(params, x)  # drops the kept FP8 weights too
        for micro_batch in range(micro_batches):
            # In training each micro-batch's input is a tensor of its own, whose gradient is stored,
            # not added to the last one's: only the parameters' gradients accumulate.
            x.grad = None
            layer_step(layer, x, grad_out, last=micro_batch == micro_batches - 1)

    return run


def weight_gradient(w: Tensor) -> Tensor:
    """``w``'s accumulated gradient: ``main_grad`` where the GEMM put it there, else ``.grad``."""
    main = getattr(w, "main_grad", None)
    return w.grad if main is None else main


def sqnr_db(actual: list[Tensor], expected: list[Tensor], chunk: int = 1 << 26) -> float:
    """``10 log10(|expected|^2 / |actual - expected|^2)`` over the tensors of two lists, in float64
    chunks on ``actual``'s device (a DeepSeek-V3-like layer's weight gradients in float64 would not
    fit beside it); ``expected`` may live elsewhere (the host)."""
    signal = noise = 0.0
    for a, e in zip(actual, expected):
        for x, y in zip(a.reshape(-1).split(chunk), e.reshape(-1).split(chunk)):
            x, y = x.double(), y.to(x.device).double()
            signal += float(y.square().sum())
            noise += float((x - y).square().sum())
    return float("inf") if noise == 0 else 10 * math.log10(signal / noise)


def gradients(layer: nn.Module, experts: nn.Module, x: Tensor, grad_out: Tensor) -> dict[str, list[Tensor]]:
    """The output, ``dx`` and the experts' weight gradients of one micro-batch (copies, in bf16)."""
    params = [p for p in layer.parameters() if p.requires_grad]
    clear_grads(params, x)
    out = layer_step(layer, x, grad_out)
    got = {"out": [out.detach()], "dx": [x.grad], "dw": [weight_gradient(w) for w in (experts.w1, experts.w2, experts.w3)]}
    clear_grads(params, x)
    return got


def kept_weight_tensors(params: list[Tensor]) -> list[Tensor]:
    """The tensors of the FP8 weight forms kept with ``params`` now (``Fp8Recipe.keep_quantized_weights``)."""
    return [
        t for p in params for form in kept_forms(p).values() for t in form if isinstance(t, Tensor)
    ]


def storage_bytes(tensors: list[Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors``."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def memory(layer: nn.Module, x: Tensor, grad_out: Tensor, device: torch.device) -> tuple[float, float, float]:
    """``(peak GiB over one step above what was allocated before it, GiB autograd saves for backward,
    GiB of FP8 weight forms kept between steps)``.

    The kept forms live from one optimizer step to the next whatever autograd saves, like the
    parameters: they are made by a forward pass first and reported apart from the bytes saved
    for backward. The peak is that of a step which makes them.
    """
    params = [p for p in layer.parameters()]
    clear_grads(params, x)
    layer(x)  # makes the kept forms (its graph is dropped)
    kept = kept_weight_tensors(params)
    saved = ops.saved_tensor_bytes(lambda: layer(x), exclude=params + kept) / 2**30
    kept_gib = storage_bytes(kept) / 2**30
    del kept
    if device.type != "cuda":
        return float("nan"), saved, kept_gib
    clear_grads(params, x)  # the step below makes the kept forms again: the peak counts them
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    layer_step(layer, x, grad_out)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    clear_grads(params, x)
    return peak, saved, kept_gib


def timed_steps(
    peers: dict[str, nn.Module], x: Tensor, grad_out: Tensor, micro_batches: int, cuda_graph: bool
) -> dict[str, float]:
    """Microseconds of one optimizer step of ``micro_batches`` per peer (``bench_peers_us``), eager or,
    with ``cuda_graph``, replayed from a CUDA graph each (the graphs are dropped on return).

    A graph is captured on copies of the peer and of ``x``: the eager steps run before on the default
    stream left the originals' gradient-accumulation nodes alive (from the default stream), which
    would make the captured backward join that stream (``cudaErrorStreamCaptureImplicit``)."""
    if not cuda_graph:
        return bench_peers_us({name: step_fn(layer, x, grad_out, micro_batches) for name, layer in peers.items()})
    x = x.detach().clone().requires_grad_()
    copies = {name: copy.deepcopy(layer) for name, layer in peers.items()}
    steps = {name: captured(step_fn(layer, x, grad_out, micro_batches)) for name, layer in copies.items()}
    return bench_peers_us(steps)


def run_config(
    key: str, shape: LayerShape, routing: str, micro_batches: int, sonic: bool, device: torch.device,
    profile_dir: Path | None, names: tuple[str, ...] = PEERS, host_time: bool = False, cuda_graph: bool = False,
) -> list[dict[str, object]]:
    config, tokens = shape.layer, shape.tokens
    peers = build_peers(config, device, routing, names)
    notes = {}
    if sonic and cuda_graph:
        notes["sonicmoe bf16"] = "not run with --cuda-graph (its step is not captured)"
    elif sonic:
        layer, why = sonic_layer(config, device)
        if layer is not None:
            peers["sonicmoe bf16"] = layer
        else:
            notes["sonicmoe bf16"] = why
    else:
        notes["sonicmoe bf16"] = "not run for this config (--sonic-configs)"
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(tokens, config.dim, generator=gen, device=device, dtype=torch.bfloat16).requires_grad_()
    grad_out = torch.randn(tokens, config.dim, generator=gen, device=device, dtype=torch.bfloat16)
    pairs = tokens * config.top_k
    flops = 18 * pairs * config.dim * config.hidden
    experts = peers["bf16"].experts
    # The reference waits on the host: at the DeepSeek-V3-like 256-expert layer its weight gradients
    # (21 GiB) beside the parameters, a peer's gradients and its FP8 weights would not fit an 80 GB GPU.
    reference = {k: [t.cpu() for t in v] for k, v in gradients(peers["bf16"], experts, x, grad_out).items()}
    rows = []
    for name, layer in peers.items():
        fidelity = {}
        if name != "sonicmoe bf16":
            got = gradients(layer, experts, x, grad_out)
            fidelity = {f"sqnr_{k}_db": sqnr_db(got[k], reference[k]) for k in reference}
            del got  # a DeepSeek-V3-like layer's weight gradients take 22 GiB
        peak, saved, kept = memory(layer, x, grad_out, device)
        rows.append({
            "config": key, "routing": routing, "peer": name, "peak_gib": peak, "saved_gib": saved, "kept_fp8_weights_gib": kept,
            **fidelity,
        })
    if device.type != "cuda":
        for name, layer in peers.items():
            step_fn(layer, x, grad_out, 1)()
        return rows + [{"config": key, "routing": routing, "peer": n, "note": why} for n, why in notes.items()]
    single = timed_steps(peers, x, grad_out, 1, cuda_graph)
    clock = sm_clock_mhz()
    multi = timed_steps(peers, x, grad_out, micro_batches, cuda_graph) if micro_batches > 1 else {}
    hosts = {n: host_ms(step_fn(l, x, grad_out, 1)) for n, l in peers.items()} if host_time else {}
    for row in rows:
        name = row["peer"]
        row["ms"] = single[name] / 1e3
        if hosts:
            row["host_ms"] = hosts[name]
        row["tflops"] = flops / single[name] / 1e6
        row["sm_clock_mhz"] = clock
        if multi:
            row["ms_per_micro_batch"] = multi[name] / micro_batches / 1e3
    if profile_dir is not None:
        profile(peers, x, grad_out, profile_dir / f"profile_moe_layer_{key}_{routing}.txt", micro_batches)
    return rows + [{"config": key, "routing": routing, "peer": n, "note": why} for n, why in notes.items()]


def profile(peers: dict[str, nn.Module], x: Tensor, grad_out: Tensor, path: Path, micro_batches: int) -> None:
    """torch.profiler kernel tables per peer, written to ``path``: 3 steps of one micro-batch, and one
    optimizer step of ``micro_batches`` (its weight-side kernels: quantization and gradient adds)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    parts = []
    runs = [(1, 3)] + ([(micro_batches, 1)] if micro_batches > 1 else [])
    for name, layer in peers.items():
        for mbs, steps in runs:
            table = kernel_table(step_fn(layer, x, grad_out, mbs), steps)
            parts.append(f"## {name} ({steps} step{'s' if steps > 1 else ''} of {mbs} micro-batch{'es' if mbs > 1 else ''})\n\n{table}\n")
    path.write_text("\n".join(parts))


def report(rows: list[dict[str, object]], micro_batches: int, command: str) -> str:
    measured = [r for r in rows if "note" not in r]
    base = {(r["config"], r["routing"]): r for r in measured if r["peer"] == "bf16"}
    sonic = {(r["config"], r["routing"]): r for r in measured if r["peer"] == "sonicmoe bf16"}
    headers = ["config", "routing", "peer", "ms", "TFLOP/s", "vs bf16", "vs SonicMoE"]
    if micro_batches > 1:
        headers += [f"ms / micro-batch ({micro_batches})", f"vs bf16 ({micro_batches})"]
    host = any("host_ms" in r for r in measured)
    if host:
        headers.append("host ms")
    headers += ["peak GiB", "saved GiB", "kept FP8 weights GiB", "SQNR out / dx / dw dB"]
    table = []
    for r in measured:
        key = (r["config"], r["routing"])
        ms = r.get("ms")
        line = [r["config"], r["routing"], r["peer"]]
        if ms is None:
            line += ["-", "-", "-", "-"]
        else:
            line += [ms, r["tflops"], f"{base[key]['ms'] / ms:.2f}x"]
            line.append(f"{sonic[key]['ms'] / ms:.2f}x" if key in sonic else "-")
        if micro_batches > 1:
            mb = r.get("ms_per_micro_batch")
            line += ["-", "-"] if mb is None else [mb, f"{base[key]['ms_per_micro_batch'] / mb:.2f}x"]
        if host:
            line.append(r.get("host_ms", "-"))
        sq = [r.get(f"sqnr_{k}_db") for k in ("out", "dx", "dw")]
        line += [r["peak_gib"], r["saved_gib"], r.get("kept_fp8_weights_gib", 0.0), " / ".join("-" if v is None else f"{v:.1f}" for v in sq)]
        if r["peer"] == "bf16":
            line[-1] = "(reference)"
        table.append(line)
    notes = "".join(f"- {r['config']} ({r['routing']}), {r['peer']}: {r['note']}\n" for r in rows if "note" in r)
    return (
        environment_header("One MoE layer, forward + backward, one GPU")
        + f"- command: `{command}`\n\n"
        + markdown_table(headers, table)
        + ("\n" + notes if notes else "")
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--routing", nargs="+", default=["uniform", "skewed"], choices=["uniform", "skewed"])
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--sonic-configs", nargs="*", default=["qwen3-8k", "qwen3-32k"], choices=list(CONFIGS))
    parser.add_argument(
        "--peers", nargs="+", default=list(PEERS), choices=list(PEERS),
        help="peers to run (bf16, the reference, always runs); default: all",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profile-dir", type=Path, default=None)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU: every peer once, no timing")
    parser.add_argument(
        "--host-time", action="store_true",
        help="a 'host ms' column: each peer's host time per step with the GPU kept busy (benchmarks.common.host_ms)",
    )
    parser.add_argument(
        "--single-thread-autograd", action="store_true",
        help="run backward on the calling thread (torch.autograd.set_multithreading_enabled(False))",
    )
    parser.add_argument(
        "--cuda-graph", action="store_true",
        help="time our peers' steps replayed from CUDA graphs (no host time); SonicMoE does not run",
    )
    args = parser.parse_args(argv)
    if args.cuda_graph and (args.host_time or args.cpu_smoke):
        parser.error("--cuda-graph times replays on a GPU: it takes neither --host-time nor --cpu-smoke")
    torch.autograd.set_multithreading_enabled(not args.single_thread_autograd)
    command = "python -m benchmarks.moe_layer " + shlex.join(sys.argv[1:] if argv is None else argv)
    if args.cpu_smoke:
        device = torch.device("cpu")
        configs = {"cpu-smoke": CPU_SMOKE}
        sonic_configs: list[str] = []
    else:
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks.moe_layer times a GPU; use --cpu-smoke on CPU")
        device = torch.device("cuda")
        configs = {key: CONFIGS[key] for key in args.configs}
        sonic_configs = args.sonic_configs
    rows: list[dict[str, object]] = []
    for key, config in configs.items():
        for routing in args.routing:
            sonic = key in sonic_configs and routing == "uniform" and "sonicmoe bf16" in args.peers
            rows += run_config(
                key, config, routing, args.micro_batches, sonic, device, args.profile_dir, tuple(args.peers),
                args.host_time, args.cuda_graph,
            )
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if args.out is not None:  # after each config, so that a run cut short keeps what it measured
                write_report(rows, args, command, quiet=True)
    write_report(rows, args, command)


def write_report(rows: list[dict[str, object]], args: argparse.Namespace, command: str, quiet: bool = False) -> None:
    """The markdown table (printed unless ``quiet``, and to ``args.out``) and its JSON copy."""
    thread = "the calling thread" if args.single_thread_autograd else "its device thread (default)"
    text = report(rows, args.micro_batches, command) + f"\nAutograd backward on {thread}.\n"
    if args.cuda_graph:
        text += "Steps timed as CUDA graph replays (`--cuda-graph`): no host time.\n"
    data = {
        "command": command, "single_thread_autograd": args.single_thread_autograd, "cuda_graph": args.cuda_graph,
        "rows": rows,
    }
    if quiet:
        with contextlib.redirect_stdout(io.StringIO()):
            emit_report(text, args.out, data)
    else:
        emit_report(text, args.out, data)


if __name__ == "__main__":
    main()
