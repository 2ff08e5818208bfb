"""Main job: train a stack of MoE layers in bf16 and in FP8 from the same seed and compare the loss curves.

    python -m benchmarks.moe_training_demo [--shape coarse|fine] [--steps N] [--plot PNG] [--out MD]
    torchrun --nproc_per_node N -m benchmarks.moe_training_demo [...]   # expert parallelism over N ranks

The model: ``layers`` residual blocks ``x + MoE(rms_norm(x))``, each an ``ops.MoE``
(top-k router, token permutation into expert groups with no host sync, SwiGLU
experts ``ops.GroupedExperts``: three grouped GEMMs). The FP8 run is the same model
after ``ops.convert_to_fp8`` (its experts fused: ``ops.moe_fused``). Data is synthetic:
random inputs and the outputs of a fixed random *teacher* model (another seed), fit by
MSE. The input gets a gradient, as a block inside a network does, so each step runs
every layer's forward, dgrad and wgrad GEMMs.

Under ``torchrun`` (NCCL on GPUs, gloo on the CPU) the experts are spread over the
ranks with ``ops.apply_expert_parallel`` (the FP8 model with FP8 token dispatch),
each rank trains on its own tokens, the loss is the mean over all ranks' tokens,
and the replicated parameters' gradients (router) are summed over the ranks. The
expert count must divide by the number of ranks.

With a GPU the shapes are real and step times are compared: ``--shape coarse`` (default:
dim 4096, 16 experts of hidden 2048, top-4) or ``fine`` (Qwen3-30B-A3B's layer: dim 2048,
128 experts of hidden 768, top-8), 16k tokens per GPU; without one the kernels run in Triton's CPU interpreter, so
shapes are tiny. The largest relative gap between the two loss curves is reported
against 1% (``MAX_REL_GAP``, compared at the printed precision); on a GPU over the
full 200 steps a gap above it makes the exit code 1. The plot goes to ``--plot``
(default: the temporary directory); progress is a redrawn bar on a terminal and a
line every tenth of the run elsewhere.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

import ops
from benchmarks.common import plot_loss_curves

MAX_REL_GAP = 0.01
# What the gap line measures, on a GPU over the full 200 steps (the README's promise, and the exit
# code's) and anywhere shorter (a report only).
GAP_MEANING = {
    True: "the bar: FP8's loss within 1% of bf16's at every one of the 200 steps (exit code 1 if not)",
    False: (
        "a report, not the bar: the 1% bar holds for 200 steps at the GPU shapes; at tiny CPU shapes or few "
        "steps the two runs' losses are noisier and their gap can pass 1% (the exit code does not depend on it)"
    ),
}
# Without --plot, the plot goes to the temporary directory, outside the source tree.
DEFAULT_PLOT = Path(tempfile.gettempdir()) / "moe_training_demo.png"


@dataclass(frozen=True)
class DemoShape:
    tokens: int
    dim: int
    hidden: int
    experts: int
    top_k: int
    steps: int
    lr: float
    layers: int


# The GPU runs' length: the 1% bar holds over these steps.
GPU_STEPS = 200
GPU_SHAPES = {
    "coarse": DemoShape(tokens=16384, dim=4096, hidden=2048, experts=16, top_k=4, steps=GPU_STEPS, lr=3e-4, layers=4),
    "fine": DemoShape(tokens=16384, dim=2048, hidden=768, experts=128, top_k=8, steps=GPU_STEPS, lr=3e-4, layers=4),
}
CPU_SHAPE = DemoShape(tokens=64, dim=32, hidden=32, experts=4, top_k=2, steps=12, lr=1e-2, layers=2)


class MoEStack(nn.Module):
    """``layers`` residual MoE blocks, ``x + MoE(rms_norm(x))``: ``(T, dim) -> (T, dim)``."""

    def __init__(self, shape: DemoShape, device: torch.device) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            ops.MoE(shape.dim, shape.hidden, shape.experts, shape.top_k, device=device) for _ in range(shape.layers)
        )

    def forward(self, x: Tensor) -> Tensor:
        for moe in self.blocks:
            x = x + moe(F.rms_norm(x, (x.shape[-1],)))
        return x


def make_model(shape: DemoShape, seed: int, device: torch.device) -> MoEStack:
    torch.manual_seed(seed)
    return MoEStack(shape, device)


def batch(shape: DemoShape, step: int, teacher: MoEStack, device: torch.device, rank: int = 0) -> tuple[Tensor, Tensor]:
    """This rank's tokens of step ``step`` and the teacher's outputs for them."""
    gen = torch.Generator(device=device).manual_seed(10_000 + 1000 * step + rank)
    x = torch.randn(shape.tokens, shape.dim, device=device, generator=gen, dtype=torch.bfloat16)
    with torch.no_grad():
        return x, teacher(x)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def progress(label: str, step: int, total: int, loss: float, step_ms: float) -> None:
    """A progress bar redrawn in place on a terminal; elsewhere (a log file) a line every tenth of the run."""
    width = 30
    done = width * step // total
    bar = "#" * done + "." * (width - done)
    line = f"{label:>4} [{bar}] {step}/{total} loss {loss:.5f} step {step_ms:8.2f} ms"
    if sys.stdout.isatty():
        print("\r" + line, end="\n" if step == total else "", flush=True)
    elif step == total or step % max(1, total // 10) == 0:
        print(line, flush=True)


def reduce_replicated_grads(model: nn.Module) -> None:
    """Sum over the ranks the gradients of the parameters every rank holds whole (not the sharded experts)."""
    for p in model.parameters():
        if p.grad is not None and not isinstance(p, DTensor):
            dist.all_reduce(p.grad)


def train(
    label: str, model: MoEStack, teacher: MoEStack, shape: DemoShape, steps: int, device: torch.device
) -> tuple[list[float], list[float]]:
    """Losses (over all ranks' tokens) and step times (ms) of ``steps`` AdamW steps on the teacher's outputs."""
    distributed = dist.is_initialized()
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    # foreach AdamW does not take sharded (DTensor) and plain parameters in one list.
    optimizer = torch.optim.AdamW(model.parameters(), lr=shape.lr, weight_decay=0.0, foreach=not distributed)
    losses: list[float] = []
    times: list[float] = []
    for step in range(steps):
        x, target = batch(shape, step, teacher, device, rank)
        # As inside a network, the block's input gets a gradient (the experts' dgrads run).
        x.requires_grad_()
        synchronize(device)
        start = time.perf_counter()
        # The mean squared error over every rank's tokens: this rank's share of it.
        loss = F.mse_loss(model(x).float(), target.float(), reduction="sum") / (world * target.numel())
        loss.backward()
        if distributed:
            reduce_replicated_grads(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
        total = loss.detach()
        if distributed:
            dist.all_reduce(total)
        losses.append(total.item())
        if rank == 0:
            progress(label, step + 1, steps, losses[-1], times[-1])
    return losses, times


def init_distributed(timeout_s: float = 600) -> tuple[torch.device, int]:
    """``(device, world size)``: under torchrun, this rank's device in a process group (NCCL, or gloo on the CPU)."""
    if "WORLD_SIZE" not in os.environ:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu"), 1
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=timeout_s), device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return device, dist.get_world_size()


def prepare(model: MoEStack, fp8: bool, world: int) -> MoEStack:
    """The FP8 conversion, then (several ranks) expert parallelism: FP8 models dispatch FP8 tokens."""
    if fp8:
        ops.convert_to_fp8(model, ops.Fp8Recipe())
    if world > 1:
        ops.apply_expert_parallel(model, dist.group.WORLD, fp8_dispatch=fp8)
    return model


def run(
    steps: int | None = None,
    plot_path: Path | None = None,
    out_path: Path | None = None,
    timeout_s: float = 600,
    gpu_shape: str = "coarse",
) -> dict[str, object]:
    """Train bf16 and FP8 from one seed (under torchrun: with expert parallelism); print and return the comparison.

    ``gpu_shape``: the key of ``GPU_SHAPES`` trained on a GPU (the CPU trains ``CPU_SHAPE``).
    """
    device, world = init_distributed(timeout_s)
    rank = dist.get_rank() if world > 1 else 0
    shape = GPU_SHAPES[gpu_shape] if device.type == "cuda" else CPU_SHAPE
    shape = replace(shape, steps=steps or shape.steps)
    steps = shape.steps
    teacher = make_model(shape, seed=1, device=device)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"MoE stack {asdict(shape)} on {device}, EP over {world} rank(s), {shape.tokens} tokens per rank; {steps} steps each")

    bf16_model = prepare(make_model(shape, 0, device), fp8=False, world=world)
    bf16_losses, bf16_times = train("bf16", bf16_model, teacher, shape, steps, device)
    fp8_model = prepare(make_model(shape, 0, device), fp8=True, world=world)
    fp8_losses, fp8_times = train("fp8", fp8_model, teacher, shape, steps, device)

    gaps = [abs(a - b) / b for a, b in zip(fp8_losses, bf16_losses)]
    worst = max(range(steps), key=gaps.__getitem__)
    # Compared as printed (two decimals of a percent): a gap printed as 1.00% is within 1%.
    within = round(100 * gaps[worst], 2) <= 100 * MAX_REL_GAP
    # Steady-state step time: skip the first steps (compilation, allocator warm-up).
    skip = min(steps - 1, max(1, steps // 5))
    bf16_ms, fp8_ms = statistics.median(bf16_times[skip:]), statistics.median(fp8_times[skip:])
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)",
        "world_size": world,
        "shape": asdict(shape),
        "steps": steps,
        "bf16_loss": bf16_losses,
        "fp8_loss": fp8_losses,
        "max_rel_gap": gaps[worst],
        "gap_within_bar": within,
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
        f"largest relative loss gap |fp8 - bf16| / bf16: {100 * gaps[worst]:.2f}% at step {worst + 1} "
        f"({'within' if within else 'ABOVE'} {100 * MAX_REL_GAP:.0f}%)",
        GAP_MEANING[device.type == "cuda" and steps >= GPU_STEPS],
        f"step-time ratio bf16 / fp8: {bf16_ms / fp8_ms:.2f}x"
        + ("" if device.type == "cuda" else " (CPU interpreter: not a performance number)"),
    ]
    if world > 1:
        dist.destroy_process_group()
    if rank != 0:
        return result
    note = plot_loss_curves(
        {"bf16": bf16_losses, "fp8 (rowwise)": fp8_losses},
        plot_path or DEFAULT_PLOT,
        f"{shape.layers} MoE layers, {shape.experts} experts, top-{shape.top_k}, dim {shape.dim}, EP {world}",
        "MSE loss",
        log_scale=True,
    )
    summary.append(note)
    print("\n".join(summary))
    if out_path is not None:
        header = [
            "# MoE training demo: bf16 vs FP8 (rowwise)",
            "",
            f"{datetime.date.today()}, {result['device']}, torch {torch.__version__}, EP over {world} rank(s)"
            + (" (FP8 token dispatch)" if world > 1 else ""),
            f"shape {asdict(shape)} (tokens per rank), {steps} steps",
            f"command: `{_command(world)}`",
            "",
        ]
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text("\n".join(header + summary) + "\n")
    return result


def _command(world: int) -> str:
    """The command line that ran this demo."""
    launcher = f"torchrun --nproc_per_node {world}" if "WORLD_SIZE" in os.environ else "python"
    return " ".join([launcher, "-m benchmarks.moe_training_demo", *sys.argv[1:]])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default: per device)")
    parser.add_argument("--plot", type=Path, default=None, help=f"PNG of both loss curves (default: {DEFAULT_PLOT})")
    parser.add_argument("--out", type=Path, default=None, help="markdown summary")
    parser.add_argument("--timeout-s", type=float, default=600, help="collective timeout under torchrun")
    parser.add_argument("--shape", choices=list(GPU_SHAPES), default="coarse", help="the GPU shape (see GPU_SHAPES)")
    args = parser.parse_args(argv)
    # Triton's CPU interpreter computes masked-off lanes too (numpy warns about them).
    warnings.filterwarnings("ignore", module="triton.runtime.interpreter")
    result = run(args.steps, args.plot, args.out, args.timeout_s, args.shape)
    if result["device"] != "cpu (Triton interpreter)" and result["steps"] >= GPU_STEPS and not result["gap_within_bar"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
