"""MoE training under FSDP2: bf16 vs FP8 (bf16 all-gather) vs FP8 with FP8 all-gather of the expert weights.

    torchrun --nproc_per_node 4 -m benchmarks.moe_fsdp            # both configs, all three modes
    torchrun --nproc_per_node 2 -m benchmarks.moe_fsdp --quick    # fewer steps and tokens
    torchrun --nproc_per_node 2 -m benchmarks.moe_fsdp --cpu-smoke  # gloo on CPU, tiny shapes (interpreter)
    torchrun --nproc_per_node 4 -m benchmarks.moe_fsdp --ep 2     # with expert parallelism: mesh (dp=2, ep=2)

A model of residual MoE blocks (router, top-k, ``ops.GroupedExperts``, weighted
combine: ``ops.MoE``, single-GPU expert dispatch by
sorting), each block and the root ``fully_shard``-ed, SGD. Per mode: median step
time, tokens/s per GPU, all-gather bytes per step (counted at FSDP2's
all-gather calls) and all-gather time per step (the profiler's
all-gather kernels), peak memory. Rank 0 writes markdown and JSON under
``benchmarks/results/``.

``--ep N``: each block's experts sharded over ``N`` ranks by ``ops.apply_expert_parallel``
(FP8 dispatch in the FP8 modes, bf16 in bf16's) and each rank's experts over the other
``world / N`` by FSDP2 (see ``build``); the all-gather columns then count the experts'
gathers over ``dp`` and the rest's over all ranks. A fourth mode, ``fp8-all-gather, no
sync``, runs the EP capacity mode (no host sync) with ``capacity = --capacity-factor``
times the mean rows per pair of ranks (``on_overflow="drop"``; the rows it dropped per
step are reported).

Configs: DeepSeek-V3-like (dim 7168, hidden 2048, 256 experts, top-8) and
Qwen3-30B-like (dim 2048, hidden 768, 128 experts, top-8). The DeepSeek-V3-like
blocks hold 11.3 G expert parameters each at 256 experts, more than FSDP2's
gathered block, its prefetched neighbour and their gradients fit in 80 GB:
``--dsv3-experts`` (64 by default) sets how many it keeps.
"""

from __future__ import annotations

import argparse
import itertools
import math
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

import ops
from benchmarks.common import emit_report, environment_header, markdown_table
from ops.op_helpers import round_up
from ops import MoE

RESULTS = Path(__file__).resolve().parent / "results"
PROCESS_GROUP_TIMEOUT = timedelta(seconds=600)
MODES = ("bf16", "fp8", "fp8-all-gather")
# With --ep: FP8 all-gather and the EP capacity mode (no host sync), capacity from --capacity-factor.
NO_SYNC_MODE = "fp8-all-gather, no sync"
CAPACITY_ALIGN = 128


def ep_capacity(config: Config, ep: int, factor: float) -> int:
    """``factor`` times the mean rows one rank has for one rank (``tokens * top_k / ep``), rounded up to 128."""
    return round_up(math.ceil(factor * config.tokens * config.top_k / ep), CAPACITY_ALIGN)


@dataclass(frozen=True)
class Config:
    name: str
    dim: int
    hidden: int
    experts: int
    top_k: int
    layers: int
    tokens: int  # per rank and step


DSV3 = Config("deepseek-v3-like", dim=7168, hidden=2048, experts=64, top_k=8, layers=2, tokens=8192)
QWEN3 = Config("qwen3-30b-like", dim=2048, hidden=768, experts=128, top_k=8, layers=4, tokens=16384)
CPU_SMOKE = Config("cpu-smoke", dim=32, hidden=32, experts=4, top_k=2, layers=2, tokens=32)


class Model(nn.Module):
    """``layers`` residual MoE blocks."""

    def __init__(self, config: Config, device: torch.device) -> None:
        super().__init__()
        dims = (config.dim, config.hidden, config.experts, config.top_k)
        self.layers = nn.ModuleList(MoE(*dims, device=device) for _ in range(config.layers))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def build(
    config: Config, mode: str, device: torch.device, compile_blocks: bool, ep: int, capacity_factor: float = 2.0
) -> Model:
    """The model in ``mode``, converted, then sharded with FSDP2 block by block.

    With ``ep > 1``: mesh ``(dp, ep)``; each block's experts sharded over ``ep`` (expert
    parallelism, FP8 dispatch in the FP8 modes), each rank's experts over ``dp``
    (``ops.fully_shard_expert_parallel``), the rest of the block over all ranks.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    torch.manual_seed(0)
    model = Model(config, device)
    if mode != "bf16":
        ops.convert_to_fp8(model)
    if ep > 1:
        ep_mesh = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("dp", "ep"))
        no_sync = {"capacity": ep_capacity(config, ep, capacity_factor), "on_overflow": "drop"}
        ops.apply_expert_parallel(
            model, ep_mesh, mesh_dim="ep", fp8_dispatch=mode != "bf16", **(no_sync if mode == NO_SYNC_MODE else {})
        )
    if mode in ("fp8-all-gather", NO_SYNC_MODE):
        ops.enable_fp8_all_gather(model)
    if ep > 1:
        ops.fully_shard_expert_parallel(model, ep_mesh["dp"])
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
        if compile_blocks:
            layer.compile()
    fully_shard(model, mesh=mesh)
    return model


class AllGatherBytes:
    """Counts the bytes FSDP2's all-gathers gather (their output sizes) while active.

    FSDP2 calls ``dist.all_gather_single`` (torch 2.13) or ``dist.all_gather_into_tensor``
    (torch 2.11); both are wrapped, and a call made inside another is not counted again.
    """

    NAMES = ("all_gather_single", "all_gather_into_tensor")

    def __init__(self) -> None:
        self.bytes = 0
        self._originals = {name: getattr(dist, name) for name in self.NAMES if hasattr(dist, name)}
        self._depth = 0

    def __enter__(self) -> AllGatherBytes:
        for name, original in self._originals.items():
            setattr(dist, name, self._counting(original))
        return self

    def _counting(self, original):
        def counting(output: Tensor, input: Tensor, *args, **kwargs):
            if self._depth == 0:
                self.bytes += output.numel() * output.element_size()
            self._depth += 1
            try:
                return original(output, input, *args, **kwargs)
            finally:
                self._depth -= 1

        return counting

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    config: Config,
    mode: str,
    device: torch.device,
    steps: int,
    warmup: int,
    compile_blocks: bool,
    ep: int,
    profile_dir: Path | None = None,
    capacity_factor: float = 2.0,
) -> dict:
    model = build(config, mode, device, compile_blocks, ep, capacity_factor)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    gen = torch.Generator(device=device).manual_seed(dist.get_rank())
    # Batches of their own, taken in turn: the routing, and every token count, changes step by step.
    xs = [torch.randn(config.tokens, config.dim, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(4)]
    batches = itertools.cycle(xs)

    def step() -> None:
        model(next(batches)).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    with AllGatherBytes() as counter:
        for _ in range(steps):
            start = time.perf_counter()
            step()
            synchronize(device)
            times.append(time.perf_counter() - start)
    table = None
    if profile_dir is not None and dist.get_rank() == 0:
        table = profile_dir / f"{config.name}_{mode}_ep{ep}.txt"
    all_gather_ms = profile_all_gather_ms(step, device, table)
    step_s = statistics.median(times)
    result = {
        "config": config.name,
        "mode": mode,
        "ep": ep,
        "step_ms": step_s * 1e3,
        "tokens_per_s_per_gpu": config.tokens / step_s,
        "all_gather_mb_per_step": counter.bytes / steps / 2**20,
        "all_gather_ms_per_step": all_gather_ms,
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan"),
    }
    if mode == NO_SYNC_MODE:
        dispatchers = [m.expert_parallel for m in model.modules() if getattr(m, "expert_parallel", None) is not None]
        result["capacity"] = dispatchers[0].capacity
        measured_steps = warmup + steps + (device.type == "cuda")  # the profiled step too
        result["dropped_rows_per_step"] = sum(sum(d.overflow().dropped) for d in dispatchers) / measured_steps
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def profile_all_gather_ms(step, device: torch.device, table: Path | None = None) -> float:
    """Device time of the all-gather kernels in one step (NaN on CPU); the step's kernel table to ``table``."""
    if device.type != "cuda":
        return float("nan")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        synchronize(device)
    averages = prof.key_averages()
    if table is not None:
        table.parent.mkdir(parents=True, exist_ok=True)
        table.write_text(averages.table(sort_by="device_time_total", row_limit=30, max_name_column_width=90))
    total_us = sum(e.device_time_total for e in averages if "allgather" in e.key.lower().replace("_", ""))
    return total_us / 1e3


def report(rows: list[dict], world: int, device: torch.device, command: str) -> str:
    ep = rows[0]["ep"]
    title = f"MoE training under FSDP2, {world} ranks" + (
        f", experts sharded over EP={ep} (FSDP2 over {world // ep}) with FP8 dispatch in the FP8 modes" if ep > 1 else ""
    )
    header = environment_header(title) + f"- command: `{command}`\n\n"
    table_rows = []
    for r in rows:
        same = [b for b in rows if b["config"] == r["config"]]
        bf16 = next(b for b in same if b["mode"] == "bf16")
        fp8 = next(b for b in same if b["mode"] == "fp8")
        table_rows.append([
            r["config"], r["mode"], r["step_ms"], r["tokens_per_s_per_gpu"], bf16["step_ms"] / r["step_ms"],
            r["all_gather_mb_per_step"], r["all_gather_mb_per_step"] / fp8["all_gather_mb_per_step"],
            r["all_gather_ms_per_step"], r["peak_memory_gb"],
            "" if "capacity" not in r else f"{r['capacity']} ({r['dropped_rows_per_step']:.1f} dropped/step)",
        ])
    headers = ["config", "mode", "step ms", "tokens/s/GPU", "speedup vs bf16", "all-gather MiB/step",
               "bytes vs bf16 all-gather", "all-gather ms/step", "peak GiB", "EP capacity (rows/pair)"]
    return header + markdown_table(headers, table_rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, a quarter of the tokens")
    parser.add_argument("--cpu-smoke", action="store_true", help="gloo on CPU, tiny shapes, one measured step")
    parser.add_argument("--config", choices=["dsv3", "qwen3", "both"], default="both")
    parser.add_argument("--dsv3-experts", type=int, default=DSV3.experts)
    parser.add_argument("--layers", type=int, default=None, help="MoE blocks (default: the config's)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per rank and step")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="torch.compile each block")
    parser.add_argument("--profile-dir", type=Path, default=None, help="rank 0's kernel table of one step per mode")
    parser.add_argument("--ep", type=int, default=1, help="expert parallelism over this many ranks (FSDP2 over the rest)")
    parser.add_argument("--capacity-factor", type=float, default=2.0,
                        help="with --ep: the no-sync mode's capacity over the mean rows per pair of ranks")
    parser.add_argument("--out", type=Path, default=None, help="markdown path (JSON beside it)")
    args = parser.parse_args(argv)

    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        dist.init_process_group("gloo", timeout=PROCESS_GROUP_TIMEOUT)
        device = torch.device("cpu")
        configs, args.steps, args.warmup = [CPU_SMOKE], 1, 1
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=PROCESS_GROUP_TIMEOUT, device_id=device)
        configs = {"dsv3": [replace(DSV3, experts=args.dsv3_experts)], "qwen3": [QWEN3]}.get(
            args.config, [replace(DSV3, experts=args.dsv3_experts), QWEN3]
        )
        if args.quick:
            configs = [replace(c, tokens=c.tokens // 4) for c in configs]
            args.steps, args.warmup = 4, 2
    configs = [
        replace(c, layers=args.layers or c.layers, tokens=args.tokens or c.tokens) for c in configs
    ]
    world = dist.get_world_size()
    if args.ep < 1 or world % args.ep or any(c.experts % args.ep for c in configs) or (args.ep > 1 and args.ep == world):
        raise SystemExit(
            f"--ep {args.ep} must divide the world size ({world}) and every config's expert count, and leave FSDP2 "
            "two or more ranks (EP alone: benchmarks.moe_parallel)"
        )
    try:
        rows = []
        for config in configs:
            for mode in MODES + ((NO_SYNC_MODE,) if args.ep > 1 else ()):
                rows.append(measure(
                    config, mode, device, args.steps, args.warmup, args.compile, args.ep, args.profile_dir,
                    args.capacity_factor,
                ))
                if dist.get_rank() == 0:
                    print(json.dumps(rows[-1]), flush=True)
        if dist.get_rank() == 0:
            command = "torchrun --nproc_per_node {} -m benchmarks.moe_fsdp {}".format(world, " ".join(sys.argv[1:]))
            text = report(rows, world, device, command)
            text += "\nconfigs: " + "; ".join(json.dumps(asdict(c)) for c in configs) + "\n"
            out = args.out
            if out is None:
                gpu = torch.cuda.get_device_name(device).split()[-1].lower() if device.type == "cuda" else "cpu"
                suffix = "_quick" if args.quick else "_smoke" if args.cpu_smoke else ""
                out = RESULTS / f"moe_fsdp_{world}x{gpu}{'_ep' + str(args.ep) if args.ep > 1 else ''}{suffix}.md"
            data = {"command": command, "world": world, "ep": args.ep, "configs": [asdict(c) for c in configs], "rows": rows}
            emit_report(text, out, data)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
