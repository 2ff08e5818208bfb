"""Results as data: ``benchmarks.common.emit_report``'s JSON copy and ``benchmarks.readme_table``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import readme_table
from benchmarks.common import emit_report, environment_facts

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
EP_JSON = RESULTS / "moe_parallel_ep4_h200.json"
FSDP_JSON = RESULTS / "moe_fsdp_4_h200.json"
FSDP_EP_JSON = RESULTS / "moe_fsdp_4_ep2_h200.json"


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


def test_moe_parallel_results_file() -> None:
    data = json.loads(EP_JSON.read_text())
    lines, environment, command, world = readme_table.read_results(EP_JSON)
    names = list(dict.fromkeys(r["config"]["name"] for r in data["results"]))
    assert [line.what.split(", ")[2].split(" layer")[0] for line in lines] == names
    step = {(r["config"]["name"], r["routing"], r["peer"]): r["step_ms"] for r in data["results"]}
    for name, line in zip(names, lines):
        speeds = [step[name, r, "bf16 EP"] / step[name, r, "fp8 EP, fp8 dispatch"] for r in ("uniform", "skewed")]
        assert f"runs {speeds[0]:.2f}x / {speeds[1]:.2f}x bf16 EP" in line.result
        assert "moves 0.50x bf16's bytes" in line.result
    # The file has no environment entry: the markdown table beside it supplies it.
    assert environment["gpu"] == "NVIDIA H200" and environment["helion"] == "1.5.1"
    assert command == data["command"] and world == 4


@pytest.mark.parametrize("path", [FSDP_JSON, FSDP_EP_JSON], ids=["fsdp", "fsdp-ep"])
def test_moe_fsdp_results_file(path: Path) -> None:
    data = json.loads(path.read_text())
    lines, environment, command, world = readme_table.read_results(path)
    assert world == 4 and command.startswith("torchrun --nproc_per_node 4 -m benchmarks.moe_fsdp")
    step = {(r["config"], r["mode"]): r["step_ms"] for r in data["rows"]}
    for config, line in zip(data["configs"], lines, strict=True):
        name = config["name"]
        assert name in line.what
        assert ("FSDP2 over 2 x EP=2" in line.what) == (path == FSDP_EP_JSON)
        fp8_all_gather = step[name, "bf16"] / step[name, "fp8-all-gather"]
        fp8 = step[name, "bf16"] / step[name, "fp8"]
        assert f"step {fp8_all_gather:.2f}x bf16 ({fp8:.2f}x with bf16 all-gather)" in line.result
    table = readme_table.readme_table([EP_JSON, path])
    assert table.count("| 4x NVIDIA H200 |") == 4


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


def test_unknown_results_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"something": []}))
    with pytest.raises(ValueError, match="other.json: not a results file"):
        readme_table.read_results(path)


def test_moe_parallel_scaling_table() -> None:
    from benchmarks.moe_parallel_scaling import scaling_table

    paths = [RESULTS / f"moe_parallel_ep{n}_h200.json" for n in (1, 2, 4)]
    table = scaling_table(paths)
    step = {}
    for path in paths:
        for r in json.loads(path.read_text())["results"]:
            step[r["world"], r["config"]["name"], r["routing"], r["peer"]] = (r["step_ms"], r["tokens_per_gpu"])
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| DeepSeek-V3-like | uniform |")]
    assert len(rows) == 3
    for row in rows:
        peer = row[2]
        rate = {n: step[n, "DeepSeek-V3-like", "uniform", peer][1] / step[n, "DeepSeek-V3-like", "uniform", peer][0] * 1e3
                for n in (1, 2, 4)}
        assert row[3:6] == [f"{rate[n]:.0f}" for n in (1, 2, 4)]
        assert row[6:8] == [f"{rate[n] / rate[1]:.2f}" for n in (2, 4)]
        bf16 = {n: step[n, "DeepSeek-V3-like", "uniform", "bf16 EP"][0] for n in (1, 2, 4)}
        speedups = [f"{bf16[n] / step[n, 'DeepSeek-V3-like', 'uniform', peer][0]:.2f}" for n in (1, 2, 4)]
        assert [c.strip(" |") for c in row[8:11]] == speedups
    with pytest.raises(ValueError, match="a second file for EP=2"):
        scaling_table([paths[1], paths[1]])
