"""One MoE layer's forward + backward under expert parallelism: bf16 EP; FP8 EP with bf16 and FP8 dispatch; FP8 EP without host syncs, eager and as one CUDA graph.

    torchrun --nproc_per_node N -m benchmarks.moe_parallel [--quick] [--configs dsv3 qwen3]
        [--routing uniform skewed] [--tokens 8192] [--out FILE]
    python -m benchmarks.moe_parallel ...            # world size 1, no torchrun
    torchrun --nproc_per_node 2 -m benchmarks.moe_parallel --cpu-smoke   # gloo, tiny shapes, CPU
    ... --profile FILE     # also torch.profiler tables of 3 steps per peer (rank 0's ops)

A step: router (``nn.Linear``), softmax top-k, ``ops.MoE.apply_experts`` (sort by
expert, dispatch, SwiGLU experts, return, top-k weighted sum), backward of the
output and of the layer's input (as inside a network). Configurations: DeepSeek-V3-like
(dim 7168, expert hidden 2048, 256 experts, top-8) and Qwen3-30B-like (dim 2048,
hidden 768, 128 experts, top-8), one layer. Routing: ``uniform`` (router scores of
random weights: each expert gets about ``tokens * k / E`` rows) or ``skewed``
(a fixed bias, the log of Dirichlet(1) expert weights, added to the scores: a few
experts and ranks get most rows).

The FP8 experts run the default rowwise recipe (the fused layer: one GEMM for
``w1``/``w3`` with SwiGLU in its epilogue, dispatched FP8 rows read as they are).
The no-sync peers use ``capacity``: every rank sends ``C`` rows to every rank, ``C``
the most rows one rank has for one rank over the benchmark's batches (routed once
before timing; the same on every rank), rounded up to a multiple of 128, so nothing is
dropped; the wire then carries ``ep * C`` rows per rank. The CUDA-graph peer captures
a whole step (router to backward) once and replays it on each batch copied into its
input (on a GPU; its all-to-all time is not recorded).

Peers share the weights (one set of sharded parameters; the FP8 experts are
``ops.Fp8GroupedExperts`` over the same DTensors) and are timed in rounds that
rotate their order, every rank running the same steps (collectives must match). Steps take
``--batches`` input batches in turn, so the routing and the token counts change from step to
step as in training (each new count is a new launch signature for the kernels).
Reported per peer: the step time (median over rounds of the slowest rank's mean),
tokens/s per GPU, bytes each rank sends per step in the dispatch and the return
all-to-alls (forward; backward sends the same counts of bf16 rows the other way),
and the time inside the four row all-to-alls (CUDA events around them; it includes
waiting for slower ranks). Rank 0 writes a markdown table and its JSON.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

import ops
from benchmarks.common import emit_report, environment_header, markdown_table
from ops.op_helpers import round_up

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class LayerConfig:
    name: str
    dim: int
    hidden: int
    experts: int
    top_k: int


CONFIGS = {
    "dsv3": LayerConfig("DeepSeek-V3-like", 7168, 2048, 256, 8),
    "qwen3": LayerConfig("Qwen3-30B-like", 2048, 768, 128, 8),
}
PEERS = (
    "bf16 EP",
    "fp8 EP, bf16 dispatch",
    "fp8 EP, fp8 dispatch",
    "fp8 EP, fp8 dispatch, no sync",
    "fp8 EP, fp8 dispatch, no sync, CUDA graph",
)
CAPACITY_ALIGN = 128


def init_distributed(backend: str, timeout_s: float) -> tuple[int, int]:
    """``(rank, world)``: torchrun's process group, or a one-process group without torchrun."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        from tests.support import free_port

        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=timeout
        )
    return dist.get_rank(), dist.get_world_size()


class Peers:
    """The peers over one set of weights, sharded over the EP group; the no-sync peers' capacity fits ``xs``."""

    def __init__(self, config: LayerConfig, device: torch.device, xs: list[Tensor], bias: Tensor) -> None:
        group = dist.group.WORLD
        torch.manual_seed(0)
        self.bf16 = ops.MoE(config.dim, config.hidden, config.experts, config.top_k, device=device)
        ops.apply_expert_parallel(self.bf16, group)
        self.capacity = capacity = capacity_for(config, xs, bias, self.bf16.router, dist.get_world_size(group))
        recipe = ops.Fp8Recipe()
        self.layers = {PEERS[0]: self.bf16}
        graphs = device.type == "cuda"
        fp8_peers = ((PEERS[1], False, None), (PEERS[2], True, None), (PEERS[3], True, capacity))
        fp8_peers += ((PEERS[4], True, capacity),) if graphs else ()
        for name, fp8_dispatch, peer_capacity in fp8_peers:
            # Built on the meta device (no memory), then given the bf16 peer's router and weights.
            layer = ops.MoE(config.dim, config.hidden, config.experts, config.top_k, device="meta")
            layer.router = self.bf16.router
            layer.experts = ops.Fp8GroupedExperts.from_module(self.bf16.experts, recipe)
            ops.ExpertParallel(group, config.experts, fp8_dispatch, recipe, capacity=peer_capacity).attach(layer.experts)
            self.layers[name] = layer
        self.records: dict[str, list[tuple[str, int, object, object]]] = defaultdict(list)
        for name, layer in self.layers.items():
            if name != PEERS[4]:  # timing events cannot be recorded inside a graph capture
                layer.experts.expert_parallel.recorder = lambda *r, name=name: self.records[name].append(r)
        self.graphed: GraphedStep | None = None

    def parameters(self) -> list[Tensor]:
        return list(self.bf16.parameters())

    def runner(self, name: str, xs: list[Tensor], bias: Tensor, grad_out: Tensor) -> Callable[[int], None]:
        """``run(steps)``: ``steps`` steps of peer ``name``, step ``i`` on batch ``xs[i % len(xs)]``."""
        layer, params = self.layers[name], self.parameters()
        if name != PEERS[4]:
            return lambda steps: run_steps(layer, xs, bias, grad_out, steps, params)
        if self.graphed is None:
            self.graphed = GraphedStep(layer, xs[0], bias, grad_out, params)
        graphed = self.graphed
        return lambda steps: [graphed(xs[i % len(xs)]) for i in range(steps)]


class GraphedStep:
    """One step captured in a CUDA graph (after warm-up steps on a side stream); ``self(x)`` replays it on ``x``."""

    def __init__(self, layer: ops.MoE, x: Tensor, bias: Tensor, grad_out: Tensor, params: list[Tensor]) -> None:
        self.x = x.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run_steps(layer, [self.x], bias, grad_out, 3, params)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            step(layer, self.x, bias, grad_out)
        for p in params:
            p.grad = None  # the graph keeps writing its own gradient tensors

    def __call__(self, x: Tensor) -> None:
        self.x.copy_(x)
        self.graph.replay()


def capacity_for(config: LayerConfig, xs: list[Tensor], bias: Tensor, router: torch.nn.Module, world: int) -> int:
    """The most rows one rank has for one rank over the batches ``xs`` (every rank's, all-reduced), aligned up."""
    most = 0
    with torch.no_grad():
        for x in xs:
            experts = route(router, x, bias, config.top_k)[1]
            per_rank = torch.bincount(experts.flatten() // (config.experts // world), minlength=world)
            most = max(most, int(per_rank.max()))
    most_all = torch.tensor([most], device=xs[0].device)
    dist.all_reduce(most_all, op=dist.ReduceOp.MAX)
    return round_up(int(most_all), CAPACITY_ALIGN)


def routing_bias(config: LayerConfig, routing: str, device: torch.device) -> Tensor:
    if routing == "uniform":
        return torch.zeros(config.experts, device=device)
    if routing == "skewed":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            weights = torch.distributions.Dirichlet(torch.ones(config.experts)).sample()
        return weights.clamp_min(1e-6).log().to(device) * 4.0
    raise ValueError(f"routing must be 'uniform' or 'skewed', got {routing!r}")


def step(layer: ops.MoE, x: Tensor, bias: Tensor, grad_out: Tensor) -> None:
    """Router, top-k (with the routing bias), dispatch, experts, return, weighted sum; backward into x and the weights."""
    x = x.detach().requires_grad_()
    out = layer.apply_experts(x, *route(layer.router, x, bias, layer.top_k))
    out.backward(grad_out)


def route(router: torch.nn.Module, x: Tensor, bias: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """``(top_probs, top_experts)``: softmax of the router's scores plus the routing bias, top-k, renormalized."""
    scores = F.softmax(router(x).float() + bias, dim=-1)
    top_probs, top_experts = scores.topk(top_k, dim=-1)
    return top_probs / top_probs.sum(-1, keepdim=True), top_experts


def run_steps(
    layer: ops.MoE, xs: list[Tensor], bias: Tensor, grad_out: Tensor, steps: int, params: list[Tensor]
) -> None:
    """``steps`` steps, step ``i`` on batch ``xs[i % len(xs)]``, the gradients cleared after each."""
    for i in range(steps):
        step(layer, xs[i % len(xs)], bias, grad_out)
        for p in params:
            p.grad = None


def format_bytes(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def elapsed_ms(start: object, end: object) -> float:
    if isinstance(start, float):
        return (end - start) * 1e3
    return start.elapsed_time(end)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_peers(
    peers: Peers, xs: list[Tensor], bias: Tensor, grad_out: Tensor, warmup: int, iters: int, rounds: int
) -> dict[str, dict[str, float]]:
    """Each peer's step time, all-to-all time and bytes; step ``i`` of a timing takes batch ``xs[i % len(xs)]``."""
    device = xs[0].device
    names = list(peers.layers)
    runners = {name: peers.runner(name, xs, bias, grad_out) for name in names}
    step_ms: dict[str, list[float]] = defaultdict(list)
    comm_ms: dict[str, list[float]] = defaultdict(list)
    sent: dict[str, dict[str, int]] = {}
    for name in names:
        runners[name](warmup)
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            peers.records[name].clear()
            synchronize(device)
            dist.barrier()
            start = time.perf_counter()
            runners[name](iters)
            synchronize(device)
            mean_ms = (time.perf_counter() - start) * 1e3 / iters
            slowest = torch.tensor([mean_ms], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            step_ms[name].append(float(slowest))
            records = peers.records[name]
            comm_ms[name].append(sum(elapsed_ms(s, e) for _, _, s, e in records) / iters)
            per_kind: dict[str, int] = defaultdict(int)
            for kind, nbytes, _, _ in records:
                per_kind[kind] += nbytes
            sent[name] = {kind: total // iters for kind, total in per_kind.items()}
    results = {}
    for name in names:
        # Bytes: the mean over ranks of what each sends.
        kinds = ("dispatch", "return", "dispatch_grad", "return_grad")
        totals = torch.tensor([float(sent[name].get(k, 0)) for k in kinds], dtype=torch.float64, device=device)
        dist.all_reduce(totals)
        comm = torch.tensor([statistics.median(comm_ms[name])], dtype=torch.float64, device=device)
        dist.all_reduce(comm, op=dist.ReduceOp.MAX)
        results[name] = {
            "step_ms": statistics.median(step_ms[name]),
            "all_to_all_ms": float(comm),
            **{f"{k}_bytes": float(v) / dist.get_world_size() for k, v in zip(kinds, totals.tolist())},
        }
    return results


def profile_peers(peers: Peers, xs: list[Tensor], bias: Tensor, grad_out: Tensor, steps: int) -> str:
    """``torch.profiler`` over ``steps`` steps of each peer (every rank runs them): rank 0's top ops, as text.

    Ops sorted by their own device time on a GPU (CPU time on the CPU); times are totals over
    the steps. The all-to-all kernels' device time includes waiting for the other ranks.
    """
    device = xs[0].device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort_by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    parts = []
    for name in peers.layers:
        run = peers.runner(name, xs, bias, grad_out)
        synchronize(device)
        dist.barrier()
        with profile(activities=activities) as prof:
            run(steps)
            synchronize(device)
        table = prof.key_averages().table(sort_by=sort_by, row_limit=25, max_name_column_width=70)
        parts.append(f"### {name}: {steps} steps\n\n{table}\n")
    return "\n".join(parts)


def run(args: argparse.Namespace) -> None:
    backend = "gloo" if args.cpu_smoke else "nccl"
    rank, world = init_distributed(backend, args.timeout_s)
    torch.autograd.set_multithreading_enabled(not args.single_thread_autograd)
    if args.cpu_smoke:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        warnings.filterwarnings("ignore", module="triton.runtime.interpreter")
        configs = {"tiny": LayerConfig("tiny", 32, 32, 2 * world, 2)}
        tokens, warmup, iters, rounds = 16, 1, 1, 1
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        configs = {name: CONFIGS[name] for name in args.configs}
        tokens = args.tokens
        warmup, iters, rounds = (2, 3, 3) if args.quick else (3, 5, 6)
    rows = []
    records = []
    profiles: list[str] = []
    for config_key, config in configs.items():
        for routing in args.routing:
            if config.experts % world:
                continue
            try:
                gen = torch.Generator(device=device).manual_seed(1000 + rank)
                # Batches of their own each step: the routing, and with it every token count, changes
                # from step to step as in training.
                xs = [torch.randn(tokens, config.dim, generator=gen, device=device).to(torch.bfloat16)
                      for _ in range(args.batches)]
                grad_out = torch.randn(tokens, config.dim, generator=gen, device=device).to(torch.bfloat16)
                bias = routing_bias(config, routing, device)
                peers = Peers(config, device, xs, bias)
                results = time_peers(peers, xs, bias, grad_out, warmup, iters, rounds)
                if args.profile:
                    profiles.append(f"## {config.name}, {routing}, EP={world}\n\n"
                                    + profile_peers(peers, xs, bias, grad_out, steps=3))
            except torch.OutOfMemoryError:
                if rank == 0:
                    print(f"{config.name} {routing}: out of memory at EP={world}", flush=True)
                rows.append([config.name, routing, world, tokens, "out of memory", "", "", "", "", "", "", ""])
                peers = None
                torch.cuda.empty_cache()
                continue
            for name in PEERS[3:]:
                if name in results:
                    results[name]["capacity"] = peers.capacity
            bf16_ms = results[PEERS[0]]["step_ms"]
            bf16_dispatch = results[PEERS[0]]["dispatch_bytes"]
            for name, r in results.items():
                rows.append([
                    config.name, routing, world, tokens, name, r["step_ms"], tokens / r["step_ms"] * 1e3,
                    bf16_ms / r["step_ms"],
                    f"{format_bytes(r['dispatch_bytes'])} ({r['dispatch_bytes'] / max(bf16_dispatch, 1):.3f}x)",
                    format_bytes(r["return_bytes"]), r["all_to_all_ms"], r.get("capacity", ""),
                ])
                records.append({"config": asdict(config), "routing": routing, "world": world, "tokens_per_gpu": tokens,
                                "peer": name, **r})
            if rank == 0:
                print(f"{config.name} {routing} EP={world}: " + ", ".join(
                    f"{n} {r['step_ms']:.2f} ms" for n, r in results.items()), flush=True)
            del peers
    if rank == 0:
        headers = ["config", "routing", "EP", "tokens/GPU", "peer", "step ms", "tokens/s/GPU", "speedup vs bf16 EP",
                   "dispatch sent/rank (vs bf16)", "return sent/rank", "all-to-all ms/step", "capacity (rows/pair)"]
        command = "torchrun --nproc_per_node {} -m benchmarks.moe_parallel {}".format(world, " ".join(sys.argv[1:]))
        report = (environment_header(f"MoE layer under expert parallelism, EP={world}")
                  + f"- command: `{command}`\n- backend: {backend}, world size {world}\n"
                  + f"- autograd backward: {'calling thread' if args.single_thread_autograd else 'device thread'}\n\n"
                  + markdown_table(headers, rows))
        out = args.out or RESULTS / f"moe_parallel_{'cpu_smoke' if args.cpu_smoke else 'gpu'}_ep{world}.md"
        emit_report(report, out, {"command": command, "results": records})
        if args.profile:
            Path(args.profile).parent.mkdir(parents=True, exist_ok=True)
            Path(args.profile).write_text(f"# Profiles (rank 0)\n\n- command: `{command}`\n\n" + "\n".join(profiles))
    dist.barrier()  # the other ranks leave after rank 0 has written its files
    dist.destroy_process_group()
    torch.autograd.set_multithreading_enabled(True)  # the process default again, before the interpreter exits


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=["dsv3", "qwen3"])
    parser.add_argument("--routing", nargs="+", choices=["uniform", "skewed"], default=["uniform", "skewed"])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per GPU (8192-16384)")
    parser.add_argument("--batches", type=int, default=4, help="input batches taken in turn, step by step")
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds (a check that it runs)")
    parser.add_argument("--cpu-smoke", action="store_true", help="gloo on the CPU, tiny shapes (Triton's interpreter)")
    parser.add_argument("--timeout-s", type=float, default=600, help="collective timeout of the process group")
    parser.add_argument(
        "--single-thread-autograd",
        action="store_true",
        help="torch.autograd.set_multithreading_enabled(False): backward on the calling thread (less host time)",
    )
    parser.add_argument("--profile", metavar="FILE", help="also profile 3 steps of each peer; rank 0 writes the tables here")
    parser.add_argument("--out", type=Path, default=None, help="markdown table (JSON beside it)")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
