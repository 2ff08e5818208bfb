"""Results as data: ``benchmarks.common.emit_report``'s JSON copy and the tables drawn from it.

Rendering is checked on synthetic results with known ratios; the committed results are checked to
render (every file read, one row per line, each ratio recomputed from the file's own numbers) and
the committed scaling report to be what ``scaling_table`` draws from the committed JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import readme_table
from benchmarks.common import emit_report, environment_facts
from benchmarks.moe_fsdp import MODES
from benchmarks.moe_parallel import PEERS
from benchmarks.moe_parallel_scaling import scaling_table

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
COMMITTED_JSON = sorted(RESULTS.glob("*.json"))
ENVIRONMENT = {"date": "2030-01-02", "gpu": "Test GPU", "torch": "9.9", "triton": "8.8", "helion": "7.7"}


def _parallel_results(world: int, step_ms: dict[tuple[str, str], float], tokens: int = 1024) -> list[dict]:
    """``benchmarks.moe_parallel`` records of one configuration; FP8 dispatch sends ``K + 4`` bytes per 2K."""
    config = {"name": "tiny", "dim": 64, "hidden": 32, "experts": 8, "top_k": 2}
    return [
        {"config": config, "routing": routing, "world": world, "tokens_per_gpu": tokens, "peer": peer, "step_ms": ms,
         "dispatch_bytes": 1000.0 if peer != PEERS[2] else 516.0}
        for (routing, peer), ms in step_ms.items()
    ]


def _write(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_emit_report_writes_json_beside_markdown(tmp_path: Path) -> None:
    out = tmp_path / "sub" / "table.md"
    emit_report("# title\n", out, {"command": "python -m x", "rows": [{"a": 1.5}]})
    assert out.read_text() == "# title\n"
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["environment"].keys() == environment_facts().keys()
    assert {"date", "gpu", "torch", "triton", "helion"} <= data["environment"].keys()
    assert data["command"] == "python -m x" and data["rows"] == [{"a": 1.5}]


def test_emit_report_without_data_writes_no_json(tmp_path: Path) -> None:
    out = tmp_path / "table.md"
    emit_report("text\n", out)
    assert out.exists() and not out.with_suffix(".json").exists()


def test_grouped_linear_rows(tmp_path: Path) -> None:
    headers = ["M x N x K, groups", "routing", "ours vs bf16", "reused vs bf16"]
    rows = [
        {"M": 64, "N": 32, "K": 16, "G": 2, headers[0]: "64x32x16, G=2", "routing": routing,
         "ours vs bf16": ours, "reused vs bf16": reused}
        for routing, ours, reused in [("uniform", 1.704, 1.75), ("skewed", 1.726, 1.77)]
    ]
    options = {"recipe": "rowwise", "cuda_graph": True, "single_thread_autograd": False, "micro_batches": 4}
    out = tmp_path / "grouped_linear.md"
    emit_report("- GPU: ignored, the JSON has it\n", out, {"command": "python -m benchmarks.grouped_linear",
                                                          "options": options, "headers": headers, "rows": rows})
    lines, environment, command, world = readme_table.read_results(out.with_suffix(".json"))
    assert lines == [readme_table.Line(
        "rowwise, 64x32x16, G=2, CUDA graph",
        "1.70x / 1.73x bf16 (uniform / skewed); weights reused over 4 micro-batches 1.75x / 1.77x",
    )]
    assert environment == environment_facts() and command == "python -m benchmarks.grouped_linear" and world == 1


def test_moe_parallel_rows(tmp_path: Path) -> None:
    """A ``benchmarks.moe_parallel`` file: bytes and speed of the FP8-dispatch peer against bf16 EP, per routing."""
    step_ms = {("uniform", PEERS[0]): 10.0, ("uniform", PEERS[2]): 8.0,
               ("skewed", PEERS[0]): 12.0, ("skewed", PEERS[2]): 7.5}
    command = "torchrun --nproc_per_node 2 -m benchmarks.moe_parallel"
    path = _write(tmp_path / "ep.json", {"environment": ENVIRONMENT, "command": command,
                                         "results": _parallel_results(2, step_ms)})
    lines, environment, got_command, world = readme_table.read_results(path)
    assert lines == [readme_table.Line(
        "expert parallelism, EP=2, tiny layer (1024 tokens/GPU, 8 experts, top-2)",
        "FP8 dispatch moves 0.52x bf16's bytes; the FP8 EP layer runs 1.25x / 1.60x bf16 EP (uniform / skewed)",
    )]
    assert environment == ENVIRONMENT and got_command == command and world == 2
    table = readme_table.readme_table([path])
    assert f"| {lines[0].what} | {lines[0].result} | 2x Test GPU | `{command}` |" in table.splitlines()
    assert f"- `{path}`: 2030-01-02, Test GPU, torch 9.9, triton 8.8, helion 7.7" in table.splitlines()


@pytest.mark.parametrize("ep", [1, 2])
def test_moe_fsdp_rows(tmp_path: Path, ep: int) -> None:
    """A ``benchmarks.moe_fsdp`` file: all-gather bytes and both FP8 modes' step speed against bf16; the world from
    the command, with or without expert parallelism."""
    bf16, fp8, fp8_all_gather = MODES
    config = {"name": "tiny", "experts": 8, "layers": 2, "tokens": 512}
    rows = [{"config": "tiny", "mode": mode, "step_ms": ms, "all_gather_mb_per_step": mb}
            for mode, ms, mb in ((bf16, 9.0, 100.0), (fp8, 10.0, 100.0), (fp8_all_gather, 6.0, 50.5))]
    command = "torchrun --nproc_per_node 4 -m benchmarks.moe_fsdp"
    path = _write(tmp_path / "fsdp.json", {"environment": ENVIRONMENT, "command": command, "ep": ep,
                                           "configs": [config], "rows": rows})
    lines, _, _, world = readme_table.read_results(path)
    sharding = "FSDP2" if ep == 1 else "FSDP2 over 2 x EP=2"
    assert lines == [readme_table.Line(
        f"{sharding}, 4 ranks, 2 tiny blocks (8 experts, 512 tokens/rank)",
        "FP8 all-gather moves 0.51x bf16's bytes; step 1.50x bf16 (0.90x with bf16 all-gather)",
    )]
    assert world == 4


def test_moe_layer_rows(tmp_path: Path) -> None:
    """A ``benchmarks.moe_layer`` file: one line per configuration, the fused peer's ratios to bf16 as printed."""
    rows = [
        {"config": "qwen3-8k", "routing": routing, "peer": peer, "ms": ms, "ms_per_micro_batch": ms / 2}
        for routing, scale in (("uniform", 1.0), ("skewed", 1.5))
        for peer, ms in (("bf16", 6.0 * scale), ("fp8 fused", 4.0 * scale), ("fp8 unfused", 5.0))
    ]
    rows.append({"config": "qwen3-8k", "routing": "uniform", "peer": "sonicmoe bf16", "note": "not importable"})
    path = tmp_path / "layer.json"
    path.write_text(json.dumps({"command": "python -m benchmarks.moe_layer", "single_thread_autograd": True, "rows": rows}))
    table = readme_table.readme_table([path])
    assert (
        "| MoE layer fwd + bwd, qwen3-8k, single-thread autograd | fused FP8 1.50x bf16 (uniform / skewed); "
        "accumulating micro-batches 1.50x |"
    ) in table


def test_environment_and_command_from_the_markdown_beside(tmp_path: Path) -> None:
    """A file without ``environment`` and ``command`` takes them from the markdown header its command wrote."""
    step_ms = {("uniform", PEERS[0]): 10.0, ("uniform", PEERS[2]): 5.0}
    path = _write(tmp_path / "ep.json", {"results": _parallel_results(1, step_ms)})
    path.with_suffix(".md").write_text(
        "# title\n\n- date: 2030-01-02\n- GPU: Test GPU\n- torch 9.9, triton 8.8, helion 7.7\n- command: `python -m x`\n"
    )
    _, environment, command, _ = readme_table.read_results(path)
    assert environment == ENVIRONMENT and command == "python -m x"


def test_unknown_results_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"something": []}))
    with pytest.raises(ValueError, match="other.json: not a results file"):
        readme_table.read_results(path)


@pytest.mark.parametrize("path", COMMITTED_JSON, ids=[p.stem for p in COMMITTED_JSON])
def test_committed_results_render(path: Path) -> None:
    """Each committed results file renders: one table row per line, under its GPU and command."""
    lines, environment, command, world = readme_table.read_results(path)
    assert lines and command
    gpu = environment["gpu"] if world == 1 else f"{world}x {environment['gpu']}"
    rows = readme_table.readme_table([path]).splitlines()
    assert rows[2 : 2 + len(lines)] == [f"| {line.what} | {line.result} | {gpu} | `{command}` |" for line in lines]


@pytest.mark.parametrize("path", sorted(RESULTS.glob("moe_parallel_ep*.json")), ids=lambda p: p.stem)
def test_committed_moe_parallel_ratios(path: Path) -> None:
    """The EP lines' ratios are those of the file's own step times and bytes, at the printed precision."""
    data = json.loads(path.read_text())
    lines, _, _, world = readme_table.read_results(path)
    names = list(dict.fromkeys(r["config"]["name"] for r in data["results"]))
    assert [line.what.split(", ")[2].split(" layer")[0] for line in lines] == names
    assert world == data["results"][0]["world"]
    record = {(r["config"]["name"], r["routing"], r["peer"]): r for r in data["results"]}
    bf16, fp8 = PEERS[0], PEERS[2]
    for name, line in zip(names, lines):
        routings = [r for r in ("uniform", "skewed") if (name, r, bf16) in record and (name, r, fp8) in record]
        speeds = readme_table.ratios([record[name, r, bf16]["step_ms"] / record[name, r, fp8]["step_ms"] for r in routings])
        sent = readme_table.ratios(
            [record[name, r, fp8]["dispatch_bytes"] / record[name, r, bf16]["dispatch_bytes"] for r in routings]
        )
        assert f"runs {speeds} bf16 EP" in line.result and f"moves {sent} bf16's bytes" in line.result


@pytest.mark.parametrize("path", sorted(RESULTS.glob("moe_fsdp_*.json")), ids=lambda p: p.stem)
def test_committed_moe_fsdp_ratios(path: Path) -> None:
    """The FSDP2 lines' ratios are those of the file's own step times and all-gather sizes."""
    data = json.loads(path.read_text())
    lines, _, command, world = readme_table.read_results(path)
    assert world == readme_table.world_size(command)
    row = {(r["config"], r["mode"]): r for r in data["rows"]}
    bf16, fp8, fp8_all_gather = MODES
    for config, line in zip(data["configs"], lines, strict=True):
        name = config["name"]
        assert name in line.what and ("EP=" in line.what) == (data.get("ep", 1) > 1)
        sent = row[name, fp8_all_gather]["all_gather_mb_per_step"] / row[name, bf16]["all_gather_mb_per_step"]
        speed = {m: row[name, bf16]["step_ms"] / row[name, m]["step_ms"] for m in (fp8, fp8_all_gather)}
        assert line.result == (
            f"FP8 all-gather moves {sent:.2f}x bf16's bytes; step {speed[fp8_all_gather]:.2f}x bf16 "
            f"({speed[fp8]:.2f}x with bf16 all-gather)"
        )


def test_scaling_table_rows(tmp_path: Path) -> None:
    """Tokens/s per GPU, its growth over the smallest EP size and the speed against bf16 EP, from synthetic runs."""
    paths = []
    for world, bf16_ms, fp8_ms in ((1, 10.0, 20.0), (2, 8.0, 4.0)):
        step_ms = {("uniform", PEERS[0]): bf16_ms, ("uniform", PEERS[2]): fp8_ms}
        paths.append(_write(tmp_path / f"ep{world}.json", {"command": f"ep{world}",
                                                           "results": _parallel_results(world, step_ms)}))
    table = scaling_table(paths)
    assert "| tiny | uniform | bf16 EP | 102400 | 128000 | 1.25 | 1.00 | 1.00 |" in table
    assert f"| tiny | uniform | {PEERS[2]} | 51200 | 256000 | 5.00 | 0.50 | 2.00 |" in table
    assert "- command: `ep1`\n- command: `ep2`\n" in table
    with pytest.raises(ValueError, match="a second file for EP=2"):
        scaling_table([paths[1], paths[1]])


def test_committed_scaling_report_is_rendered_from_the_committed_results() -> None:
    """``moe_parallel_scaling_h200.md`` is what ``scaling_table`` draws from the committed EP results."""
    report = RESULTS / "moe_parallel_scaling_h200.md"
    summary = next(line for line in report.read_text().splitlines() if line.startswith("- summary: "))
    paths = [Path(p) for p in summary.strip("`").split("moe_parallel_scaling ")[1].split()]
    assert len(paths) >= 2
    root = RESULTS.parent.parent
    assert scaling_table([root / p for p in paths]).replace(str(root) + "/", "") == report.read_text()
