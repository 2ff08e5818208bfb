"""Main job: train one MoE block in bf16 and in FP8 from the same seed and compare the loss curves.

    python -m benchmarks.moe_training_demo [--steps N] [--plot PNG] [--out MD]

The block: a top-k router, token permutation into expert groups (stable argsort
by expert; offsets from per-expert counts, with no host sync), and SwiGLU experts
(``ops.GroupedExperts``: three grouped GEMMs). The FP8 run is the same model after
``ops.convert_to_fp8``. Data is synthetic: random inputs and the outputs of a fixed
random *teacher* MoE (another seed), fit by MSE. The input gets a gradient, as a
block inside a network does, so each step runs all nine GEMMs (forward, dgrad, wgrad).

With a GPU the shapes are real (dim 4096, 16 experts, 16k tokens) and step times
are compared; without one the kernels run in Triton's CPU interpreter, so shapes
are tiny.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import ops

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class DemoShape:
    tokens: int
    dim: int
    hidden: int
    experts: int
    top_k: int
    steps: int
    lr: float


GPU_SHAPE = DemoShape(tokens=16384, dim=4096, hidden=2048, experts=16, top_k=4, steps=200, lr=3e-4)
CPU_SHAPE = DemoShape(tokens=64, dim=32, hidden=32, experts=4, top_k=2, steps=12, lr=1e-2)


class MoE(nn.Module):
    """Top-k routed SwiGLU experts: ``(T, dim) -> (T, dim)``."""

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int, device: torch.device) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, experts, bias=False, dtype=torch.bfloat16, device=device)
        self.experts = ops.GroupedExperts(dim, hidden, experts, device=device)

    def forward(self, x: Tensor) -> Tensor:
        num_experts = self.experts.num_experts
        probs = F.softmax(self.router(x).float(), dim=-1)
        top_probs, top_experts = probs.topk(self.top_k, dim=-1)
        top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
        # Permute the (token, choice) pairs so that each expert's tokens are contiguous.
        expert_of_pair = top_experts.flatten()
        order = torch.argsort(expert_of_pair, stable=True)
        token_of_pair = order // self.top_k
        # Counts per expert (torch.bincount would sync with the host on CUDA).
        counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, expert_of_pair, torch.ones_like(expert_of_pair, dtype=torch.int32))
        y = self.experts(x[token_of_pair], counts)
        y = y * top_probs.flatten()[order, None].to(y.dtype)
        return torch.zeros_like(x).index_add_(0, token_of_pair, y)


def make_model(shape: DemoShape, seed: int, device: torch.device) -> MoE:
    torch.manual_seed(seed)
    return MoE(shape.dim, shape.hidden, shape.experts, shape.top_k, device)


def batch(shape: DemoShape, step: int, teacher: MoE, device: torch.device) -> tuple[Tensor, Tensor]:
    gen = torch.Generator(device=device).manual_seed(10_000 + step)
    x = torch.randn(shape.tokens, shape.dim, device=device, generator=gen, dtype=torch.bfloat16)
    with torch.no_grad():
        return x, teacher(x)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def progress(label: str, step: int, total: int, loss: float, step_ms: float) -> None:
    width = 30
    done = width * step // total
    bar = "#" * done + "." * (width - done)
    end = "\n" if step == total else ""
    print(f"\r{label:>4} [{bar}] {step}/{total} loss {loss:.5f} step {step_ms:8.2f} ms", end=end, flush=True)


def train(
    label: str, model: MoE, teacher: MoE, shape: DemoShape, steps: int, device: torch.device
) -> tuple[list[float], list[float]]:
    """Losses and step times (ms) of ``steps`` AdamW steps on the teacher's outputs."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=shape.lr, weight_decay=0.0)
    losses: list[float] = []
    times: list[float] = []
    for step in range(steps):
        x, target = batch(shape, step, teacher, device)
        # As inside a network, the block's input gets a gradient (the experts' dgrads run).
        x.requires_grad_()
        synchronize(device)
        start = time.perf_counter()
        loss = F.mse_loss(model(x).float(), target.float())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
        losses.append(loss.item())
        progress(label, step + 1, steps, losses[-1], times[-1])
    return losses, times


def plot(losses: dict[str, list[float]], path: Path, title: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install -e '.[demo]')"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, curve in losses.items():
        ax.plot(range(1, len(curve) + 1), curve, label=label)
    ax.set(xlabel="step", ylabel="MSE loss", title=title, yscale="log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot written to {path}"


def run(steps: int | None = None, plot_path: Path | None = None, out_path: Path | None = None) -> dict[str, object]:
    """Train bf16 and FP8 from one seed; print and return the comparison."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = GPU_SHAPE if device.type == "cuda" else CPU_SHAPE
    steps = steps or shape.steps
    teacher = make_model(shape, seed=1, device=device)
    print(f"MoE block {asdict(shape)} on {device}; {steps} steps each")

    bf16_losses, bf16_times = train("bf16", make_model(shape, 0, device), teacher, shape, steps, device)
    fp8_model = ops.convert_to_fp8(make_model(shape, 0, device), ops.Fp8Recipe())
    fp8_losses, fp8_times = train("fp8", fp8_model, teacher, shape, steps, device)

    gaps = [abs(a - b) / b for a, b in zip(fp8_losses, bf16_losses)]
    worst = max(range(steps), key=gaps.__getitem__)
    # Steady-state step time: skip the first steps (compilation, allocator warm-up).
    skip = min(steps - 1, max(1, steps // 5))
    bf16_ms, fp8_ms = statistics.median(bf16_times[skip:]), statistics.median(fp8_times[skip:])
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)",
        "shape": asdict(shape),
        "steps": steps,
        "bf16_loss": bf16_losses,
        "fp8_loss": fp8_losses,
        "max_rel_gap": gaps[worst],
        "max_rel_gap_step": worst + 1,
        "bf16_step_ms": bf16_ms,
        "fp8_step_ms": fp8_ms,
    }
    summary = [
        "| | bf16 | fp8 |",
        "| --- | --- | --- |",
        f"| first loss | {bf16_losses[0]:.5f} | {fp8_losses[0]:.5f} |",
        f"| final loss | {bf16_losses[-1]:.5f} | {fp8_losses[-1]:.5f} |",
        f"| median step (ms) | {bf16_ms:.2f} | {fp8_ms:.2f} |",
        "",
        f"largest relative loss gap |fp8 - bf16| / bf16: {100 * gaps[worst]:.2f}% at step {worst + 1}",
        f"step-time ratio bf16 / fp8: {bf16_ms / fp8_ms:.2f}x"
        + ("" if device.type == "cuda" else " (CPU interpreter: not a performance number)"),
    ]
    note = plot(
        {"bf16": bf16_losses, "fp8 (rowwise)": fp8_losses},
        plot_path or RESULTS / "moe_training_demo.png",
        f"MoE block, {shape.experts} experts, top-{shape.top_k}, dim {shape.dim}",
    )
    summary.append(note)
    print("\n".join(summary))
    if out_path is not None:
        header = [
            "# MoE training demo: bf16 vs FP8 (rowwise)",
            "",
            f"{datetime.date.today()}, {result['device']}, torch {torch.__version__}",
            f"shape {asdict(shape)}, {steps} steps",
            "",
        ]
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text("\n".join(header + summary) + "\n")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default: per device)")
    parser.add_argument("--plot", type=Path, default=None, help="PNG of both loss curves")
    parser.add_argument("--out", type=Path, default=None, help="markdown summary")
    args = parser.parse_args(argv)
    # Triton's CPU interpreter computes masked-off lanes too (numpy warns about them).
    warnings.filterwarnings("ignore", module="triton.runtime.interpreter")
    run(args.steps, args.plot, args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
