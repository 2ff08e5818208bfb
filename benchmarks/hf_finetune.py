"""Fine-tune a Hugging Face transformers MoE model in bf16 and in FP8 (``ops.convert_to_fp8``) and compare them.

    python -m benchmarks.hf_finetune                          # CPU: tiny widths, 10 steps
    python -m benchmarks.hf_finetune --variants bf16 --steps 200   # CPU: the bf16 baseline alone, longer
    python -m benchmarks.hf_finetune --variants bf16 ops_bf16 fp8 --out benchmarks/results/hf/hf_finetune_qwen3_lr1e-3_h200.md
    python -m benchmarks.hf_finetune --time --variants bf16 ops_bf16 fp8 --out benchmarks/results/hf/hf_finetune_time_qwen3_h200.md
    python -m benchmarks.hf_finetune --model gpt_oss [--time [--profile FILE]]  # gpt-oss-like experts instead of Qwen3-MoE

The model is a transformers ``Qwen3MoeForCausalLM`` (or ``GptOssForCausalLM`` with
``--model gpt_oss``) built from a small config with random weights (nothing is
downloaded). Its experts run transformers' own ``experts_implementation="grouped_mm"``
path: that bf16 model is the baseline. The FP8 model is a deep copy of it (same
initial weights) after ``ops.convert_to_fp8``; the script stops with an error when
that conversion converts no module.

Variants (``--variants``; the first is the baseline): ``bf16``, transformers' own model;
``fp8``, the converted copy; ``ops_bf16``, a copy whose experts compute as ``ops.MoE``'s
bf16 layer does (our routing and combine around ``torch._grouped_mm``), which separates
what the FP8 GEMMs gain from what our routing gains.

Widths: ``--size real`` (the default on a GPU) has Qwen3-30B-A3B's layer (hidden 2048,
128 experts, top-8, expert width 768, 32 query / 4 key-value heads of 128) or
gpt-oss's (hidden 2880, 32 experts, top-4, expert width 2880), ``--layers`` of them
(2), a 4096-token vocabulary so that the LM head does not dominate, and ``--tokens``
tokens per step (8192: 4 sequences of 2048). ``--size tiny`` (the default on the CPU,
where the FP8 kernels run in Triton's interpreter) has every width a small multiple of 16.
Attention (``--attention``): ``sdpa`` for Qwen3-MoE; gpt-oss (no sdpa path: attention sinks)
``flex_attention`` on a GPU and ``eager`` on the CPU.

Training mode (the default): every variant trains with AdamW on the same stream of
sequences from a fixed random Markov chain (each token is followed by one of
``BRANCHING`` tokens, uniformly), so the loss falls from about ln(vocab) towards
ln(BRANCHING). Per-step losses, the final losses and the relative gap to the bf16
model's are reported. At the real widths the loss stays near ln(vocab) for about 100 steps
and then falls steeply; where it falls moves by tens of steps between any two
implementations (two bf16 ones too), so gaps in the middle of the fall say nothing of
FP8: compare the final losses. ``--time`` (for a GPU) times instead a whole training step
(forward, backward, AdamW step) of each variant in one process, in rotating order
(``benchmarks.common.bench_peers_us``), and reports ms/step, tokens/s and the speedup
over the transformers bf16 step. ``--out PATH.md`` writes the report and a JSON
beside it (same stem); ``--plot PATH`` the loss curves (matplotlib).
"""

from __future__ import annotations

import argparse
import copy
import math
import shlex
import statistics
import sys
import time
import types
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

import ops
from benchmarks.common import (
    bench_peers_us,
    emit_report,
    environment_header,
    kernel_table,
    markdown_table,
    plot_loss_curves,
)
from ops.transformers_experts import experts_on_pairs, is_transformers_experts

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Each token of the synthetic task is followed by one of this many tokens: the loss's floor is ln(BRANCHING).
BRANCHING = 4
MODELS = ("qwen3_moe", "gpt_oss")
SIZES = ("tiny", "real")


@dataclass(frozen=True)
class Widths:
    """The config's widths of one model at one size."""

    hidden: int
    experts: int
    top_k: int
    expert_hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int


WIDTHS: dict[tuple[str, str], Widths] = {
    ("qwen3_moe", "real"): Widths(2048, 128, 8, 768, 32, 4, 128, 4096),
    ("qwen3_moe", "tiny"): Widths(64, 4, 2, 32, 4, 2, 16, 256),
    ("gpt_oss", "real"): Widths(2880, 32, 4, 2880, 64, 8, 64, 4096),
    ("gpt_oss", "tiny"): Widths(64, 4, 2, 64, 4, 2, 16, 256),
}


@dataclass(frozen=True)
class RunSettings:
    """What one run does: model, widths, batch shape and optimizer settings."""

    model: str
    size: str
    layers: int
    tokens: int
    seq_len: int
    steps: int
    lr: float
    seed: int
    attention: str

    @property
    def batch(self) -> int:
        return self.tokens // self.seq_len


ATTENTIONS = ("sdpa", "eager", "flex_attention")

# Per size: (tokens per step, sequence length, training steps, learning rate).
DEFAULTS = {"real": (8192, 2048, 300, 1e-3), "tiny": (256, 64, 10, 1e-2)}


def build_config(model: str, size: str, layers: int, seq_len: int) -> PretrainedConfig:
    """The transformers config of ``model`` (``qwen3_moe`` or ``gpt_oss``) at ``size``, with ``layers`` MoE layers."""
    w = WIDTHS[(model, size)]
    common = dict(
        vocab_size=w.vocab,
        hidden_size=w.hidden,
        num_hidden_layers=layers,
        num_attention_heads=w.heads,
        num_key_value_heads=w.kv_heads,
        head_dim=w.head_dim,
        num_experts_per_tok=w.top_k,
        max_position_embeddings=max(seq_len, 512),
        tie_word_embeddings=False,
    )
    if model == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            **common, num_experts=w.experts, moe_intermediate_size=w.expert_hidden, intermediate_size=3 * w.hidden
        )
    if model == "gpt_oss":
        from transformers import GptOssConfig

        return GptOssConfig(
            **common,
            num_local_experts=w.experts,
            intermediate_size=w.expert_hidden,
            sliding_window=min(128, seq_len // 2),
            rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        )
    raise ValueError(f"model must be one of {MODELS}, got {model!r}")


def default_attention(model: str, device: torch.device) -> str:
    """transformers' attention implementation for ``model`` on ``device`` when ``--attention`` is not given.

    Qwen3-MoE: ``sdpa``. gpt-oss has no sdpa path (its attention sinks): on a GPU ``flex_attention``
    (transformers' compiled FlexAttention, which takes the sinks), since ``eager`` materializes every
    ``seq x seq`` score matrix and takes most of a step at the real widths; ``eager`` on the CPU.
    """
    if model == "qwen3_moe":
        return "sdpa"
    return "flex_attention" if device.type == "cuda" else "eager"


def build_model(settings: RunSettings, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The randomly initialized (seeded) transformers model on ``device``: grouped_mm experts, ``settings.attention``."""
    from transformers import GptOssForCausalLM, Qwen3MoeForCausalLM

    config = build_config(settings.model, settings.size, settings.layers, settings.seq_len)
    cls = Qwen3MoeForCausalLM if settings.model == "qwen3_moe" else GptOssForCausalLM
    torch.manual_seed(settings.seed)
    # Initialized in place, in its dtype: the real widths' 1-2 B parameters are not made on the host first.
    with torch.device(device):
        model = cls._from_config(
            config, experts_implementation="grouped_mm", attn_implementation=settings.attention, dtype=dtype
        )
    return model.train()


class NothingConverted(RuntimeError):
    """``ops.convert_to_fp8`` found no module of the model to convert."""


def count_fp8_modules(model: nn.Module) -> int:
    """How many of ``model``'s modules are FP8 modules (class name starting with ``Fp8``)."""
    return sum(type(m).__name__.startswith("Fp8") for m in model.modules())


def build_fp8(base: nn.Module, recipe: ops.Fp8Recipe) -> nn.Module:
    """A deep copy of ``base`` converted by ``ops.convert_to_fp8``; raises ``NothingConverted`` if nothing was."""
    model = ops.convert_to_fp8(copy.deepcopy(base), recipe)
    converted = count_fp8_modules(model)
    if converted == 0:
        experts = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Experts")})
        raise NothingConverted(
            f"ops.convert_to_fp8 converted no module of {type(base).__name__} (its experts: {experts}); "
            "it holds no experts module that ops converts"
        )
    print(f"ops.convert_to_fp8: {converted} FP8 modules in {type(base).__name__}", flush=True)
    return model


def build_bf16(base: nn.Module, recipe: ops.Fp8Recipe) -> nn.Module:
    """A deep copy of ``base``: transformers' own bf16 model (its grouped_mm experts)."""
    return copy.deepcopy(base)


def ops_bf16_experts_forward(experts: nn.Module, x: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """A transformers experts module computed as ``ops.MoE``'s bf16 layer computes: ``ops.sort_by_expert``,
    ``experts_on_pairs`` with ``torch._grouped_mm`` for both projections, ``ops.combine_pairs``."""
    order = ops.sort_by_expert(top_k_index, experts.down_proj.shape[0])
    offs = torch.cumsum(order.num_tokens_per_expert, 0, dtype=torch.int32)

    def project(rows: Tensor, weight: Tensor, offs: Tensor) -> Tensor:
        return torch._grouped_mm(rows, weight if experts.is_transposed else weight.transpose(-2, -1), offs=offs)

    y = experts_on_pairs(experts, x, top_k_index, order, offs, project)
    return ops.combine_pairs(y, order, top_k_weights).to(x.dtype)


def build_ops_bf16(base: nn.Module, recipe: ops.Fp8Recipe) -> nn.Module:
    """A deep copy of ``base`` whose experts run ``ops_bf16_experts_forward`` (our bf16 layer, for reference)."""
    model = copy.deepcopy(base)
    for module in model.modules():
        if is_transformers_experts(module):
            module.forward = types.MethodType(ops_bf16_experts_forward, module)
    return model


@dataclass(frozen=True)
class Variant:
    """One model to compare: its label in reports and how it is made from the bf16 base model."""

    label: str
    build: Callable[[nn.Module, ops.Fp8Recipe], nn.Module]


# The variants by key; the first is the baseline the others are compared with.
VARIANTS: dict[str, Variant] = {
    "bf16": Variant("transformers bf16 (grouped_mm)", build_bf16),
    "fp8": Variant("fp8 (ops.convert_to_fp8)", build_fp8),
    "ops_bf16": Variant("ops bf16 layer (torch._grouped_mm)", build_ops_bf16),
}


class MarkovTask:
    """Sequences from a fixed random Markov chain: each token is followed by one of ``branching`` tokens, uniformly."""

    def __init__(self, vocab: int, branching: int = BRANCHING, seed: int = 1234) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.vocab, self.branching, self.seed = vocab, branching, seed
        self.successors = torch.rand(vocab, vocab, generator=gen).topk(branching, dim=1).indices

    @property
    def floor(self) -> float:
        """The loss a perfect model reaches: the chain's entropy per token."""
        return math.log(self.branching)

    def batch(self, step: int, batch: int, seq_len: int) -> Tensor:
        """Step ``step``'s ``(batch, seq_len)`` token ids (on the CPU), the same for every variant."""
        gen = torch.Generator().manual_seed(self.seed + 1 + step)
        choices = torch.randint(self.branching, (batch, seq_len), generator=gen)
        tokens = torch.empty(batch, seq_len, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab, (batch,), generator=gen)
        for t in range(1, seq_len):
            tokens[:, t] = self.successors[tokens[:, t - 1], choices[:, t]]
        return tokens


def training_step(model: nn.Module, optimizer: torch.optim.Optimizer, ids: Tensor) -> Tensor:
    """One forward, backward and AdamW step on next-token prediction; the (detached) loss."""
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW without weight decay."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)


def train(
    models: dict[str, nn.Module], task: MarkovTask, settings: RunSettings, device: torch.device
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Train every model on the same batches, step by step; per-variant losses and step times (ms)."""
    optimizers = {key: make_optimizer(model, settings.lr) for key, model in models.items()}
    losses: dict[str, list[float]] = {key: [] for key in models}
    times: dict[str, list[float]] = {key: [] for key in models}
    # Every step's losses on short runs, every tenth step's on long ones (the JSON keeps them all).
    every = 1 if settings.steps <= 50 else settings.steps // 10
    for step in range(settings.steps):
        ids = task.batch(step, settings.batch, settings.seq_len).to(device)
        for key, model in models.items():
            synchronize(device)
            start = time.perf_counter()
            loss = training_step(model, optimizers[key], ids)
            synchronize(device)
            times[key].append((time.perf_counter() - start) * 1e3)
            losses[key].append(loss.item())
        if (step + 1) % every == 0 or step + 1 == settings.steps:
            line = "  ".join(f"{key} {losses[key][-1]:.4f} ({times[key][-1]:.0f} ms)" for key in models)
            print(f"step {step + 1}/{settings.steps}: {line}", flush=True)
    return losses, times


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tail_mean(curve: list[float], fraction: float = 0.1) -> float:
    """The mean of the last ``fraction`` of ``curve`` (at least one point)."""
    n = max(1, int(len(curve) * fraction))
    return statistics.fmean(curve[-n:])


def loss_report(losses: dict[str, list[float]], times: dict[str, list[float]], task: MarkovTask) -> tuple[str, dict]:
    """Markdown of the loss comparison (final losses, gaps to the baseline, sampled curves) and its data."""
    base = next(iter(losses))
    rows, summary = [], {}
    for key, curve in losses.items():
        gaps = [abs(a - b) / b for a, b in zip(curve, losses[base])]
        skip = min(len(times[key]) - 1, max(1, len(times[key]) // 5))
        summary[key] = {
            "label": VARIANTS[key].label,
            "first_loss": curve[0],
            "final_loss": curve[-1],
            "final_loss_tail_mean": tail_mean(curve),
            "final_rel_gap": abs(curve[-1] - losses[base][-1]) / losses[base][-1],
            "tail_mean_rel_gap": abs(tail_mean(curve) - tail_mean(losses[base])) / tail_mean(losses[base]),
            "max_rel_gap": max(gaps),
            "median_step_ms": statistics.median(times[key][skip:]),
        }
        s = summary[key]
        rows.append(
            [s["label"], f"{s['first_loss']:.4f}", f"{s['final_loss']:.4f}", f"{s['final_loss_tail_mean']:.4f}",
             f"{100 * s['final_rel_gap']:.2f}%", f"{100 * s['tail_mean_rel_gap']:.2f}%", f"{100 * s['max_rel_gap']:.2f}%",
             f"{s['median_step_ms']:.1f}"]
        )
    headers = ["variant", "first loss", "final loss", "mean of last 10%", "final gap", "last-10% gap", "max gap",
               "median step (ms)"]
    text = markdown_table(headers, rows)
    text += f"\nGaps are |loss - bf16 loss| / bf16 loss; the task's loss floor is ln({task.branching}) = {task.floor:.4f}.\n"
    steps = len(losses[base])
    sampled = sorted({0, *range(max(1, steps // 10) - 1, steps, max(1, steps // 10)), steps - 1})
    curve_rows = [[i + 1, *(f"{losses[key][i]:.4f}" for key in losses)] for i in sampled]
    text += "\nLoss by step:\n\n" + markdown_table(["step", *(VARIANTS[k].label for k in losses)], curve_rows)
    return text, {"summary": summary, "losses": losses, "step_ms": times}


def time_variants(
    models: dict[str, nn.Module],
    task: MarkovTask,
    settings: RunSettings,
    device: torch.device,
    rounds: int,
    profile: Path | None = None,
) -> tuple[str, dict]:
    """Median training-step time of each model on one batch, in rotating order; markdown and data.
    With ``profile``, each model's kernel table over 3 steps is written there (``benchmarks.common.kernel_table``)."""
    ids = task.batch(0, settings.batch, settings.seq_len).to(device)
    optimizers = {key: make_optimizer(model, settings.lr) for key, model in models.items()}
    steps = {key: (lambda m=model, o=optimizers[key]: training_step(m, o, ids)) for key, model in models.items()}
    rounds = max(len(models), rounds // len(models) * len(models))
    us = bench_peers_us(steps, rounds=rounds)
    if profile is not None:
        profile.parent.mkdir(parents=True, exist_ok=True)
        tables = [f"## {VARIANTS[key].label} (3 training steps)\n\n{kernel_table(step, 3)}\n" for key, step in steps.items()]
        profile.write_text("\n".join(tables))
    base = next(iter(models))
    rows, data = [], {}
    for key, t in us.items():
        data[key] = {"label": VARIANTS[key].label, "step_ms": t / 1e3, "tokens_per_s": settings.tokens / (t / 1e6),
                     "speedup": us[base] / t}
        rows.append([VARIANTS[key].label, f"{t / 1e3:.2f}", f"{data[key]['tokens_per_s']:,.0f}", f"{us[base] / t:.2f}x"])
    text = markdown_table(["variant", "ms/step", "tokens/s", f"speedup vs {VARIANTS[base].label}"], rows)
    text += (
        f"\nA step is forward, backward and the AdamW step on {settings.tokens} tokens; median of {rounds} rounds "
        "in rotating order (`benchmarks.common.bench_peers_us`).\n"
    )
    return text, {"timing": data}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=MODELS, default="qwen3_moe")
    parser.add_argument("--size", choices=SIZES, default=None, help="widths (default: real on a GPU, tiny on the CPU)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers, each with an MoE")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per step, batch x seq (default per size)")
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length (default per size)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: 300 real, 10 tiny)")
    parser.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default per size)")
    parser.add_argument("--seed", type=int, default=0, help="the models' initialization seed")
    parser.add_argument("--attention", choices=ATTENTIONS, default=None,
                        help="transformers' attn_implementation (default: sdpa for Qwen3-MoE; gpt-oss: "
                        "flex_attention on a GPU, eager on the CPU)")
    parser.add_argument("--recipe", choices=ops.recipes.registered_recipes(), default="rowwise")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["bf16", "fp8"],
                        help="which variants run; the first is the baseline")
    parser.add_argument("--time", action="store_true", help="time training steps instead of training (GPU)")
    parser.add_argument("--rounds", type=int, default=8, help="--time: rotating rounds of timings per variant")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--plot", type=Path, default=None, help="PNG of the loss curves")
    parser.add_argument("--profile", type=Path, default=None, help="--time: kernel tables per variant, to this file")
    parser.add_argument("--out", type=Path, default=None, help="markdown report; a JSON goes beside it")
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace, device: torch.device) -> RunSettings:
    """The run's settings: the arguments given, the size's defaults for the rest."""
    size = args.size or ("real" if device.type == "cuda" else "tiny")
    tokens, seq_len, steps, lr = DEFAULTS[size]
    seq_len = args.seq_len or seq_len
    tokens = args.tokens or tokens
    if tokens % seq_len:
        raise SystemExit(f"--tokens ({tokens}) must be a multiple of the sequence length ({seq_len})")
    attention = args.attention or default_attention(args.model, device)
    if args.model == "gpt_oss" and attention == "sdpa":
        raise SystemExit("--attention sdpa: transformers' gpt-oss has no sdpa path (its attention sinks)")
    return RunSettings(
        args.model, size, args.layers, tokens, seq_len, args.steps or steps, args.lr or lr, args.seed, attention
    )


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Run the comparison (training, or ``--time``) and return its data; raises ``NothingConverted`` as FP8 needs."""
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    settings = settings_from(args, device)
    if args.time and device.type != "cuda":
        raise SystemExit("--time needs a CUDA device (it times with CUDA events)")
    # Triton's CPU interpreter computes masked-off lanes too (numpy warns about them).
    warnings.filterwarnings("ignore", module="triton.runtime.interpreter")
    recipe = ops.Fp8Recipe(args.recipe)
    base = build_model(settings, device, torch.bfloat16)
    models = {key: VARIANTS[key].build(base, recipe) for key in args.variants}
    del base
    task = MarkovTask(WIDTHS[(settings.model, settings.size)].vocab)
    command = "python -m benchmarks.hf_finetune " + shlex.join(sys.argv[1:] if argv is None else argv)
    print(f"{settings.model} ({settings.size}) {asdict(settings)} on {device}, recipe {args.recipe}", flush=True)
    if args.time:
        text, data = time_variants(models, task, settings, device, args.rounds, args.profile)
    else:
        losses, times = train(models, task, settings, device)
        text, data = loss_report(losses, times, task)
        if args.plot is not None:
            curves = {VARIANTS[key].label: curve for key, curve in losses.items()}
            plot_title = f"{settings.model} ({settings.size}), {settings.layers} layers"
            floor = (task.floor, f"floor ln({BRANCHING})")
            text += "\n" + plot_loss_curves(curves, args.plot, plot_title, "cross-entropy loss", floor=floor) + "\n"
    title = f"Hugging Face {settings.model} fine-tuning: transformers bf16 vs FP8 ({'step time' if args.time else 'loss'})"
    widths = asdict(WIDTHS[(settings.model, settings.size)])
    header = environment_header(title) + (
        f"- transformers {_transformers_version()}, recipe {args.recipe}, device {device}\n"
        f"- settings: {asdict(settings)}\n- widths: {widths}\n- command: `{command}`\n\n"
    )
    data = {"command": command, "settings": asdict(settings), "widths": widths, "recipe": args.recipe,
            "device": str(device), **data}
    emit_report(header + text, args.out, data)
    return data


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    try:
        main()
    except NothingConverted as error:
        raise SystemExit(f"error: {error}") from None
