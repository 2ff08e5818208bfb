"""What bounds the fused FP8 MoE layer's step: its expert GEMMs, and its memory passes at copy bandwidth.

    python -m benchmarks.layer_floors [--profiles CONFIG=FILE ...] [--results FILE.json ...] [--out FILE]

For each config of ``benchmarks.moe_layer`` (one micro-batch, the default rowwise recipe, uniform
routing), this counts the bytes each memory pass of the step moves (``memory_passes``) and the
expert GEMMs' FLOPs. Their time at the GPU's copy bandwidth is the floor of that pass: what the
pass would take if it ran as fast as a device-to-device copy. With a kernel table of the step
(``benchmarks.moe_layer --profile-dir``: the ``fp8 fused`` section), it splits the measured kernel
time into the expert GEMMs and the rest (and gives the profiled steps' wall time where the table
has it: the GPU is idle for the difference); with benchmark results (``--results``: the JSON that
``benchmarks.moe_layer`` writes) it reads the step times of the FP8 layer and of its peers, and
from them the step a target ratio asks for (``TARGETS``, the MoE layer issue's). The last column
is the expert GEMMs' throughput that target needs with every other pass at its floor (and no host
time): where it is above what the GEMMs reach, no work on the memory passes can meet the target.

No GPU is needed: the numbers come from the files given and from ``COPY_BANDWIDTH``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from benchmarks.common import emit_report, markdown_table
from benchmarks.moe_layer import CONFIGS, LayerShape
from ops.wgrad_precision import BF16_WGRAD_MAX_ROWS_PER_GROUP

# A 2 GiB device-to-device copy on the H200, bytes a second (docs/performance.md, "How it is measured").
COPY_BANDWIDTH = 4.25e12
# The MoE layer issue's targets: (peer, the FP8 step's speed-up over it), one micro-batch.
TARGETS = {
    "qwen3-8k": (("sonicmoe bf16", 1.15), ("bf16", 1.2)),
    "qwen3-32k": (("sonicmoe bf16", 1.3), ("bf16", 1.6)),
    "dsv3-256": (("bf16", 1.3),),
    "dsv3-32": (("bf16", 1.6),),
}
# Kernel names of the expert GEMMs in a kernel table: ours, torch._grouped_mm's (CUTLASS), SonicMoE's (quack).
_EXPERT_GEMM = re.compile(r"grouped_mm|cutlass|quackgemm")
_TIME = re.compile(r"^([\d.]+)(s|ms|us)$")


def fp8_wgrad(shape: LayerShape) -> bool:
    """Whether the default recipe's ``"auto"`` wgrad is FP8 at this shape (bf16 below 1024 rows an expert)."""
    layer = shape.layer
    return shape.tokens * layer.top_k >= BF16_WGRAD_MAX_ROWS_PER_GROUP * layer.experts


def memory_passes(shape: LayerShape) -> dict[str, int]:
    """Bytes each memory pass of one fused FP8 step moves at the least (reads + writes), by pass.

    ``T`` tokens of ``D``, ``P = T * k`` pairs, ``H`` the expert hidden size, FP8 one byte, bf16
    two; scales, offsets and the router's ``(T, E)`` tensors are left out (under 1%). A pass that
    reads rows by index (each token's row once per pair) counts the rows it reads once: the
    repeats can come from L2 (they do where the tokens fit in it, at 8192 tokens of 2048). The
    passes are those of ``ops.moe_fused`` with the default recipe: the weights quantized once a
    step (forward form, then its bytes copied transposed for dgrad: 2 + 1 + 1 + 1 bytes a
    parameter); ``x``'s rows quantized once; ``h`` quantized rowwise (and, with an FP8 wgrad,
    copied into the token-group layout); the combine reading the pairs' rows; in backward, ``w2``'s
    gradient rows read by index (both FP8 forms in two reads with an FP8 wgrad; else the rowwise
    form and the weighted bf16 rows the bf16 wgrad reads), SwiGLU's backward (``u`` and
    ``gate_up`` read, ``grad_gate_up`` written), the up-projection's gradient quantized the same
    way, ``x`` for its wgrad (its FP8 rows copied into the token-group layout, or ``x`` gathered in
    bf16), the pairs' ``dx`` summed to the tokens, and autograd adding the router's ``dx`` to the
    experts'. The GEMMs' own operand reads and output writes are not passes: they are in the GEMM
    time.
    """
    layer = shape.layer
    t, d, h = shape.tokens, layer.dim, layer.hidden
    p = t * layer.top_k
    passes = {
        "weights, quantized and copied transposed": 5 * 3 * layer.experts * h * d,
        "x's rows": 3 * t * d,
        "h's rows": 3 * p * h,
        "combine": 2 * p * d + 2 * t * d,
        "SwiGLU's backward": 2 * p * h + 4 * p * h + 4 * p * h,
        "dx of the pairs summed": 2 * p * d + 2 * t * d,
        "x's gradient, router's added": 6 * t * d,
    }
    # w2's gradient rows are the output gradient's (T, D) rows read by index.
    if fp8_wgrad(shape):
        passes["h's token-group copy"] = 2 * p * h
        passes["w2's gradient, two forms"] = 2 * (2 * t * d) + 2 * p * d
        passes["up-projection's gradient, two forms"] = 2 * (2 * p * 2 * h) + 2 * p * 2 * h
        passes["x's token-group copy"] = t * d + p * d
    else:
        passes["w2's gradient, rows and bf16 rows"] = (2 * t * d + p * d) + (2 * t * d + 2 * p * d)
        passes["up-projection's gradient rows"] = 2 * p * 2 * h + p * 2 * h
        passes["x gathered in bf16"] = 2 * t * d + 2 * p * d
    return passes


def expert_gemm_flops(shape: LayerShape) -> float:
    """FLOPs of the expert GEMMs in one step: forward, dgrad and wgrad, each ``6 * P * D * H``."""
    layer = shape.layer
    return 18.0 * shape.tokens * layer.top_k * layer.dim * layer.hidden


def _ms(text: str) -> float:
    found = _TIME.match(text)
    if found is None:
        raise ValueError(f"not a time: {text!r}")
    return float(found.group(1)) * {"s": 1e3, "ms": 1.0, "us": 1e-3}[found.group(2)]


def _section(table: str, section: str) -> tuple[int, list[str]]:
    """``(steps, lines)`` of the section ``## {section} (N steps of 1 micro-batch)`` of a kernel table."""
    heading = re.compile(rf"^## {re.escape(section)} \((\d+) steps? of 1 micro-batch\)$")
    steps, lines = None, []
    for line in table.splitlines():
        if line.startswith("## "):
            found = heading.match(line)
            if steps is not None and found is None:
                break
            steps = int(found.group(1)) if found else None
        elif steps is not None:
            lines.append(line)
    if steps is None:
        raise ValueError(f"no section {section!r} of one micro-batch in the kernel table")
    return steps, lines


def kernel_times(table: str, section: str = "fp8 fused") -> dict[str, float]:
    """Milliseconds a step of each kernel listed in ``section`` of a ``benchmarks.moe_layer`` kernel table
    (the section ``## {section} (N steps of 1 micro-batch)``: its CUDA totals divided by ``N``)."""
    steps, lines = _section(table, section)
    times: dict[str, float] = {}
    for line in lines:
        cells = re.split(r"\s{2,}", line.strip())
        # Name, self CPU %, self CPU, CPU total %, CPU total, CPU avg, self CUDA, self CUDA %, ...
        if len(cells) < 10 or not _TIME.match(cells[6]):
            continue
        times[cells[0]] = times.get(cells[0], 0.0) + _ms(cells[6]) / steps
    return times


def step_totals(table: str, section: str = "fp8 fused") -> tuple[float | None, float | None]:
    """``(kernel ms, wall ms)`` a step of ``section``: its "Self CUDA time total" (every kernel, listed or
    not) and the wall time of its profiled steps (``benchmarks.common.kernel_table``), ``None`` where
    the table has no such line."""
    steps, lines = _section(table, section)
    kernels = wall = None
    for line in lines:
        if line.startswith("Self CUDA time total:"):
            kernels = _ms(line.split(":", 1)[1].strip()) / steps
        elif line.startswith("Wall time of the"):
            wall = _ms(line.split(":", 1)[1].split()[0]) / steps
    return kernels, wall


def step_times(results: list[dict]) -> dict[tuple[str, str], float]:
    """``(config, peer) -> ms`` of uniform-routing rows in ``benchmarks.moe_layer`` JSON results (later files win)."""
    times = {}
    for data in results:
        for row in data["rows"]:
            if row.get("routing") == "uniform" and "ms" in row:
                times[(row["config"], row["peer"])] = row["ms"]
    return times


def floor_rows(profiles: dict[str, str], times: dict[tuple[str, str], float]) -> list[dict[str, object]]:
    """One row per config and target: the floors, the measured split where given, the GEMM rate the target needs."""
    rows = []
    for key, shape in CONFIGS.items():
        passes = memory_passes(shape)
        floor_ms = sum(passes.values()) / COPY_BANDWIDTH * 1e3
        flops = expert_gemm_flops(shape)
        row: dict[str, object] = {
            "config": key, "fp8_wgrad": fp8_wgrad(shape), "floor_ms": floor_ms,
            "passes_ms": {name: nbytes / COPY_BANDWIDTH * 1e3 for name, nbytes in passes.items()},
            "expert_gemm_tflop": flops / 1e12, "fp8_ms": times.get((key, "fp8 fused")),
        }
        if key in profiles:
            kernels = kernel_times(profiles[key])
            gemm_ms = sum(ms for name, ms in kernels.items() if _EXPERT_GEMM.search(name))
            kernels_ms, wall_ms = step_totals(profiles[key])
            kernels_ms = sum(kernels.values()) if kernels_ms is None else kernels_ms
            row.update(gemm_ms=gemm_ms, gemm_tflops=flops / gemm_ms / 1e9, other_ms=kernels_ms - gemm_ms,
                       profiled_wall_ms=wall_ms)
        for peer, ratio in TARGETS.get(key, ()):
            peer_ms = times.get((key, peer))
            if peer_ms is None:
                continue
            target_ms = peer_ms / ratio
            needed = flops / (target_ms - floor_ms) / 1e9 if target_ms > floor_ms else float("inf")
            rows.append({**row, "target": f"{ratio}x {peer}", "target_ms": target_ms, "needed_gemm_tflops": needed})
        if not any(r["config"] == key for r in rows):
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profiles", nargs="*", default=[], metavar="CONFIG=FILE",
                        help="kernel tables of benchmarks.moe_layer --profile-dir, per config")
    parser.add_argument("--results", nargs="*", type=Path, default=[], help="benchmarks.moe_layer JSON results")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    profiles = {}
    for item in args.profiles:
        key, _, path = item.partition("=")
        if key not in CONFIGS or not path:
            raise SystemExit(f"--profiles takes CONFIG=FILE with CONFIG one of {list(CONFIGS)}, got {item!r}")
        profiles[key] = Path(path).read_text()
    times = step_times([json.loads(path.read_text()) for path in args.results])
    rows = floor_rows(profiles, times)

    def cell(row: dict[str, object], name: str, fmt: str = "{:.2f}") -> str:
        value = row.get(name)
        return "-" if value is None else fmt.format(value)

    def gemms(row: dict[str, object]) -> str:
        return "-" if "gemm_ms" not in row else f"{row['gemm_ms']:.2f} ({row['gemm_tflops']:.0f})"

    table = markdown_table(
        ["config", "wgrad", "FP8 step ms", "target", "target ms", "expert GEMMs ms (TFLOP/s)", "other kernels ms",
         "profiled step ms", "other passes' floor ms", "GEMM TFLOP/s the target needs"],
        [[r["config"], "FP8" if r["fp8_wgrad"] else "bf16", cell(r, "fp8_ms"), r.get("target", "-"),
          cell(r, "target_ms"), gemms(r), cell(r, "other_ms"), cell(r, "profiled_wall_ms"), cell(r, "floor_ms"),
          cell(r, "needed_gemm_tflops", "{:.0f}")] for r in rows],
    )
    detail = "\n".join(
        f"- {r['config']}: " + "; ".join(f"{name} {ms:.2f}" for name, ms in r["passes_ms"].items())
        for r in {r["config"]: r for r in rows}.values()
    )
    command = "python -m benchmarks.layer_floors " + " ".join(sys.argv[1:] if argv is None else argv)
    report = (
        "# What bounds the fused FP8 MoE layer's step\n\n"
        f"- command: `{command.strip()}`\n"
        f"- copy bandwidth: {COPY_BANDWIDTH / 1e12:.2f} TB/s; one micro-batch, uniform routing\n\n"
        f"{table}\n\n"
        "Floors of the memory passes, ms (bytes at copy bandwidth):\n\n"
        f"{detail}\n"
    )
    emit_report(report, args.out, {"command": command.strip(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
