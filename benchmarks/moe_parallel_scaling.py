"""Scaling of the expert-parallel MoE layer from 1 to 2 to 4 GPUs, from ``benchmarks.moe_parallel``'s JSON results.

    python -m benchmarks.moe_parallel_scaling benchmarks/results/moe_parallel_ep{1,2,4}_h200.json \
        --out benchmarks/results/moe_parallel_scaling_h200.md

Each input is one ``torchrun --nproc_per_node N -m benchmarks.moe_parallel --out ...``
run (N GPUs, the same tokens per GPU: weak scaling, each GPU holding ``E / N``
experts). For every configuration, routing and peer the table gives tokens/s per
GPU at each EP size, its ratio to EP=1 (per-GPU throughput kept), and the peer's
speedup over bf16 EP at the same size.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import markdown_table
from benchmarks.readme_table import markdown_header_facts


def scaling_table(paths: list[Path]) -> str:
    """The markdown report for the ``moe_parallel`` JSON files ``paths`` (one per EP size)."""
    runs: dict[int, dict[tuple[str, str, str], dict]] = {}
    commands = []
    for path in paths:
        data = json.loads(path.read_text())
        if "results" not in data:
            raise ValueError(f"{path}: not a benchmarks.moe_parallel results file")
        results = data["results"]
        world = results[0]["world"]
        if world in runs:
            raise ValueError(f"{path}: a second file for EP={world}")
        runs[world] = {(r["config"]["name"], r["routing"], r["peer"]): r for r in results}
        commands.append(data.get("command") or markdown_header_facts(path.with_suffix(".md")).get("command", "?"))
    sizes = sorted(runs)
    keys = [key for key in runs[sizes[0]] if all(key in runs[n] for n in sizes)]
    headers = ["config", "routing", "peer"]
    headers += [f"tokens/s/GPU EP={n}" for n in sizes] + [f"vs EP={sizes[0]}, EP={n}" for n in sizes[1:]]
    headers += [f"vs bf16 EP, EP={n}" for n in sizes]
    rows = []
    for config, routing, peer in keys:
        rate = {n: runs[n][config, routing, peer]["tokens_per_gpu"] / runs[n][config, routing, peer]["step_ms"] * 1e3
                for n in sizes}
        speedup = {n: runs[n][config, routing, "bf16 EP"]["step_ms"] / runs[n][config, routing, peer]["step_ms"]
                   for n in sizes}
        rows.append([config, routing, peer, *(f"{rate[n]:.0f}" for n in sizes),
                     *(f"{rate[n] / rate[sizes[0]]:.2f}" for n in sizes[1:]), *(f"{speedup[n]:.2f}" for n in sizes)])
    facts = markdown_header_facts(paths[0].with_suffix(".md"))
    header = (
        f"# MoE layer under expert parallelism: EP={', '.join(map(str, sizes))}\n\n"
        f"- date: {facts.get('date', '?')}\n- GPU: {facts.get('gpu', '?')}\n"
        f"- torch {facts.get('torch', '?')}, triton {facts.get('triton', '?')}, helion {facts.get('helion', '?')}\n"
        + "".join(f"- command: `{c}`\n" for c in commands)
        + "- summary: `python -m benchmarks.moe_parallel_scaling " + " ".join(str(p) for p in paths) + "`\n\n"
    )
    return header + markdown_table(headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path, help="moe_parallel JSON files, one per EP size")
    parser.add_argument("--out", type=Path, default=None, help="markdown path")
    args = parser.parse_args()
    report = scaling_table(args.results)
    print(report)
    if args.out is not None:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
