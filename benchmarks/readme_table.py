"""The README's results table, drawn from the benchmarks' JSON results.

    python -m benchmarks.readme_table benchmarks/results/*.json

Each benchmark's ``--out FILE.md`` writes ``FILE.json`` beside its markdown table
(``benchmarks.common.emit_report``). This reads such files and prints one markdown
table, a line per layer or model configuration (what, result, GPU, the command that
wrote the file), then each file's date, GPU and versions. Read: ``benchmarks.grouped_linear``
(``rows``, one per shape and routing, keyed by its table's headers),
``benchmarks.moe_layer`` (``rows``, one per configuration, routing and peer),
``benchmarks.moe_parallel`` (``results``, one per configuration, routing and peer)
and ``benchmarks.moe_fsdp`` (``rows``, one per configuration and mode). A file without
the ``environment`` entry (date, GPU, versions) or the command takes them from the
markdown header beside it, which the same command wrote.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from benchmarks.moe_fsdp import MODES
from benchmarks.moe_parallel import PEERS


class Line(NamedTuple):
    """One line of the README's table."""

    what: str
    result: str


def markdown_header_facts(md: Path) -> dict[str, str]:
    """Date, GPU, versions and command from the header ``benchmarks.common.environment_header`` writes."""
    facts: dict[str, str] = {}
    if not md.exists():
        return facts
    for line in md.read_text().splitlines():
        if line.startswith("- date: "):
            facts["date"] = line.removeprefix("- date: ").strip()
        elif line.startswith("- GPU: "):
            facts["gpu"] = line.removeprefix("- GPU: ").strip()
        elif line.startswith("- command: "):
            facts["command"] = line.removeprefix("- command: ").strip().strip("`")
        elif line.startswith("- torch "):
            for part in line.removeprefix("- ").split(","):
                name, _, version = part.strip().partition(" ")
                facts[name] = version
    return facts


def ratios(values: Sequence[float]) -> str:
    """``1.70x / 1.73x``; one value when they all print the same."""
    printed = [f"{v:.2f}x" for v in values]
    return printed[0] if len(set(printed)) == 1 else " / ".join(printed)


def by_key(records: Sequence[dict], key: Callable[[dict], object]) -> dict[object, list[dict]]:
    """``records`` grouped by ``key``, in order of first appearance."""
    groups: dict[object, list[dict]] = {}
    for record in records:
        groups.setdefault(key(record), []).append(record)
    return groups


def grouped_linear_lines(data: dict) -> list[Line]:
    """Per shape: ours vs bf16 for each routing (and with reused weights, when measured)."""
    options = data["options"]
    shape_column = data["headers"][0]
    setting = "".join([
        ", CUDA graph" if options["cuda_graph"] else "",
        ", single-thread autograd" if options["single_thread_autograd"] else "",
    ])
    lines = []
    for shape, rows in by_key(data["rows"], lambda r: r[shape_column]).items():
        routings = " / ".join(r["routing"] for r in rows)
        result = f"{ratios([r['ours vs bf16'] for r in rows])} bf16 ({routings})"
        if options["micro_batches"]:
            reused = ratios([r["reused vs bf16"] for r in rows])
            result += f"; weights reused over {options['micro_batches']} micro-batches {reused}"
        lines.append(Line(f"{options['recipe']}, {shape}{setting}", result))
    return lines


def moe_parallel_lines(data: dict) -> list[Line]:
    """Per configuration: FP8 dispatch bytes vs bf16, and the FP8-dispatch layer's speed vs bf16 EP per routing."""
    bf16, fp8_dispatch = PEERS[0], PEERS[2]
    lines = []
    for name, records in by_key(data["results"], lambda r: r["config"]["name"]).items():
        config, first = records[0]["config"], records[0]
        per_routing = {k: {r["peer"]: r for r in rs} for k, rs in by_key(records, lambda r: r["routing"]).items()}
        # Routings where both peers ran (a peer out of memory has no record).
        routings = {k: p for k, p in per_routing.items() if bf16 in p and fp8_dispatch in p}
        if not routings:
            continue
        peers = list(routings.values())
        speed = ratios([p[bf16]["step_ms"] / p[fp8_dispatch]["step_ms"] for p in peers])
        sent = ratios([p[fp8_dispatch]["dispatch_bytes"] / p[bf16]["dispatch_bytes"] for p in peers])
        lines.append(Line(
            f"expert parallelism, EP={first['world']}, {name} layer ({first['tokens_per_gpu']} tokens/GPU, "
            f"{config['experts']} experts, top-{config['top_k']})",
            f"FP8 dispatch moves {sent} bf16's bytes; the FP8 EP layer runs {speed} bf16 EP "
            f"({' / '.join(routings)})",
        ))
    return lines


def moe_fsdp_lines(data: dict, world: int) -> list[Line]:
    """Per configuration: FP8 all-gather bytes vs bf16, and the FP8 steps' speed vs bf16."""
    bf16, fp8, fp8_all_gather = MODES
    configs = {c["name"]: c for c in data["configs"]}
    lines = []
    for name, rows in by_key(data["rows"], lambda r: r["config"]).items():
        mode = {r["mode"]: r for r in rows}
        config = configs[name]
        sent = mode[fp8_all_gather]["all_gather_mb_per_step"] / mode[bf16]["all_gather_mb_per_step"]
        speed = {m: mode[bf16]["step_ms"] / mode[m]["step_ms"] for m in (fp8, fp8_all_gather)}
        ep = data.get("ep", 1)
        sharding = f"FSDP2 over {world // ep} x EP={ep}" if ep > 1 else "FSDP2"
        lines.append(Line(
            f"{sharding}, {world} ranks, {config['layers']} {name} blocks ({config['experts']} experts, "
            f"{config['tokens']} tokens/rank)",
            f"FP8 all-gather moves {sent:.2f}x bf16's bytes; step {speed[fp8_all_gather]:.2f}x bf16 "
            f"({speed[fp8]:.2f}x with bf16 all-gather)",
        ))
    return lines


def moe_layer_lines(data: dict) -> list[Line]:
    """Per configuration: the fused FP8 layer vs our bf16 layer per routing (and per micro-batch, when measured)."""
    measured = [r for r in data["rows"] if "ms" in r]
    lines = []
    for config, rows in by_key(measured, lambda r: r["config"]).items():
        per_routing = {k: {r["peer"]: r for r in rs} for k, rs in by_key(rows, lambda r: r["routing"]).items()}
        routings = {k: p for k, p in per_routing.items() if "bf16" in p and "fp8 fused" in p}
        if not routings:
            continue
        peers = list(routings.values())
        result = f"fused FP8 {ratios([p['bf16']['ms'] / p['fp8 fused']['ms'] for p in peers])} bf16 ({' / '.join(routings)})"
        if all("ms_per_micro_batch" in p["fp8 fused"] for p in peers):
            per_micro_batch = ratios([p["bf16"]["ms_per_micro_batch"] / p["fp8 fused"]["ms_per_micro_batch"] for p in peers])
            result += f"; accumulating micro-batches {per_micro_batch}"
        setting = ", single-thread autograd" if data.get("single_thread_autograd") else ""
        lines.append(Line(f"MoE layer fwd + bwd, {config}{setting}", result))
    return lines


def world_size(command: str) -> int:
    """The ``--nproc_per_node`` of a torchrun command; 1 without it."""
    match = re.search(r"--nproc_per_node[ =](\d+)", command)
    return int(match.group(1)) if match else 1


def read_results(path: Path) -> tuple[list[Line], dict[str, str], str, int]:
    """``(lines, environment, command, world size)`` of one results JSON."""
    data = json.loads(path.read_text())
    header = markdown_header_facts(path.with_suffix(".md"))
    environment = data.get("environment") or {k: v for k, v in header.items() if k != "command"}
    command = data.get("command") or header.get("command", "")
    if "results" in data:
        lines = moe_parallel_lines(data)
        world = data["results"][0]["world"] if data["results"] else 1
    elif "rows" in data and "options" in data:
        lines, world = grouped_linear_lines(data), 1
    elif "rows" in data and all("peer" in r and "config" in r for r in data["rows"]):
        lines, world = moe_layer_lines(data), 1
    elif "rows" in data and "configs" in data:
        world = data.get("world") or world_size(command)
        lines = moe_fsdp_lines(data, world)
    else:
        raise ValueError(
            f"{path}: not a results file of benchmarks.grouped_linear, moe_layer, moe_parallel or moe_fsdp "
            f"(top-level keys {sorted(data)})"
        )
    return lines, environment, command, world


def readme_table(paths: Sequence[Path]) -> str:
    """The markdown table of ``paths``' results, then each file's date, GPU and versions."""
    table = ["| what | result | GPU | command |", "| --- | --- | --- | --- |"]
    sources = []
    for path in paths:
        lines, environment, command, world = read_results(path)
        gpu = environment.get("gpu", "GPU not recorded")
        gpus = f"{world}x {gpu}" if world > 1 else gpu
        table += [f"| {line.what} | {line.result} | {gpus} | `{command}` |" for line in lines]
        facts = ", ".join(f"{k} {v}" for k, v in environment.items() if k not in ("date", "gpu"))
        sources.append(f"- `{path}`: {environment.get('date', 'date not recorded')}, {gpu}, {facts}")
    return "\n".join(table + [""] + sources) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", type=Path, nargs="+", help="results JSON files (benchmarks/results/*.json)")
    args = parser.parse_args(argv)
    print(readme_table(args.results), end="")


if __name__ == "__main__":
    main()
