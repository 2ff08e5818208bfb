"""``benchmarks.moe_layer``: every peer is built, and ``--cpu-smoke`` runs the peers whose numbers it checks
(fidelity against bf16, bytes saved for backward, kept FP8 weights) into its table and JSON."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support import ON_GPU


# The peers whose numbers the smoke run checks; the other FP8 peers are recipes whose layers
# their own tests run (tests/test_grad_accumulation.py, tests/test_wgrad_precision.py, ...).
SMOKE_PEERS = ("fp8 unfused", "fp8 fused", "fp8 fused, weights each pass", "torchtitan-style bf16")


def test_every_peer_is_built_over_the_same_router_and_weights():
    from benchmarks import moe_layer

    c = moe_layer.CPU_SMOKE.layer
    peers = moe_layer.build_peers(c, torch.device("cpu"), "uniform")
    assert set(peers) == set(moe_layer.PEERS) - {"sonicmoe bf16"}
    bf16 = peers["bf16"]
    for name, layer in peers.items():
        if name in moe_layer.FP8_PEERS or name in moe_layer.EXPERT_VARIANTS:
            assert layer.router is bf16.router, name
            assert torch.equal(layer.experts.w1, bf16.experts.w1), name


@pytest.mark.parametrize("flags", [["--cpu-smoke"], ["--host-time"]])
def test_cuda_graph_refuses_what_it_cannot_time(flags, capsys):
    """``--cuda-graph`` times replays on a GPU: with the CPU smoke run or host times it stops before any work."""
    from benchmarks import moe_layer

    with pytest.raises(SystemExit):
        moe_layer.main(["--cuda-graph", *flags])
    assert "--cuda-graph times replays on a GPU" in capsys.readouterr().err


@pytest.mark.whole_suite_only
@pytest.mark.skipif(ON_GPU, reason="the CPU smoke run; the GPU runs the benchmark itself")
def test_moe_layer_benchmark_cpu_smoke(tmp_path):
    from benchmarks import moe_layer

    out = tmp_path / "moe_layer.md"
    moe_layer.main(
        ["--cpu-smoke", "--routing", "uniform", "--micro-batches", "1", "--peers", *SMOKE_PEERS, "--out", str(out)]
    )
    data = json.loads(out.with_suffix(".json").read_text())
    rows = {r["peer"]: r for r in data["rows"]}
    assert set(rows) == {"bf16", "sonicmoe bf16", *SMOKE_PEERS}
    assert "not run" in rows["sonicmoe bf16"]["note"]
    # Against the bf16 peer on the same input: FP8 within its usual ~24 dB, torchtitan's bf16 flow far closer.
    for peer, floor in (("fp8 unfused", 20), ("fp8 fused", 20), ("torchtitan-style bf16", 35)):
        for key in ("out", "dx", "dw"):
            assert rows[peer][f"sqnr_{key}_db"] > floor, (peer, key)
    assert rows["fp8 fused"]["saved_gib"] < rows["fp8 unfused"]["saved_gib"]
    # Kept between optimizer steps, apart from what autograd saves: each expert weight's two FP8
    # layouts (one byte per element each) and their float32 scales; nothing without kept forms.
    c = moe_layer.CPU_SMOKE.layer
    elements = 3 * c.experts * c.dim * c.hidden
    kept = rows["fp8 fused"]["kept_fp8_weights_gib"] * 2**30
    assert 2 * elements < kept < 2 * elements + 4 * 4 * c.experts * (2 * c.hidden + c.dim)
    for peer in ("bf16", "fp8 fused, weights each pass", "torchtitan-style bf16"):
        assert rows[peer]["kept_fp8_weights_gib"] == 0, peer
    # Quantized at every pass, the dgrad layout is saved for backward instead of kept.
    assert rows["fp8 fused, weights each pass"]["saved_gib"] > rows["fp8 fused"]["saved_gib"]
    table = out.read_text()
    assert "| cpu-smoke | uniform | fp8 fused |" in table and "(reference)" in table


def test_host_time_column_follows_the_rows():
    from benchmarks import moe_layer

    base = {"config": "c", "routing": "uniform", "peak_gib": 1.0, "saved_gib": 0.5, "tflops": 1.0}
    rows = [{**base, "peer": "bf16", "ms": 2.0, "host_ms": 1.5}, {**base, "peer": "fp8 fused", "ms": 1.0, "host_ms": 3.25}]
    table = moe_layer.report(rows, 1, "cmd")
    assert "| host ms |" in table
    assert "| 3.25 |" in table and "| 1.50 |" in table
    for row in rows:
        del row["host_ms"]
    assert "host ms" not in moe_layer.report(rows, 1, "cmd")


def test_split_wgrad_peers_take_each_projections_wgrad_from_its_own_precision():
    # "w2 bf16 wgrad": w2's gradient as the all-bf16-wgrad peer makes it, w1's and w3's as the
    # all-FP8 one does; "w13 bf16 wgrad" the other way round. The two precisions differ, so a
    # peer that ignored its split would match the wrong reference.
    from benchmarks import moe_layer

    c = moe_layer.CPU_SMOKE.layer
    names = ("fp8 fused, fp8 wgrad", "fp8 fused, bf16 wgrad", "fp8 fused, w2 bf16 wgrad", "fp8 fused, w13 bf16 wgrad")
    peers = moe_layer.build_peers(c, torch.device("cpu"), "uniform", names)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(moe_layer.CPU_SMOKE.tokens, c.dim, generator=gen, dtype=torch.bfloat16).requires_grad_()
    grad_out = torch.randn(moe_layer.CPU_SMOKE.tokens, c.dim, generator=gen, dtype=torch.bfloat16)
    dw = {n: moe_layer.gradients(peers[n], peers[n].experts, x, grad_out)["dw"] for n in names}
    fp8, bf16 = dw["fp8 fused, fp8 wgrad"], dw["fp8 fused, bf16 wgrad"]
    assert not torch.equal(fp8[1], bf16[1]) and not torch.equal(fp8[0], bf16[0])
    w1, w2, w3 = dw["fp8 fused, w2 bf16 wgrad"]
    assert torch.equal(w2, bf16[1]) and torch.equal(w1, fp8[0]) and torch.equal(w3, fp8[2])
    w1, w2, w3 = dw["fp8 fused, w13 bf16 wgrad"]
    assert torch.equal(w2, fp8[1]) and torch.equal(w1, bf16[0]) and torch.equal(w3, bf16[2])


def test_micro_batches_accumulate_parameter_gradients_not_the_inputs():
    # A step of N micro-batches: the parameters' gradients are N times one micro-batch's (the same
    # input each time, bf16 sums of equal terms: exact for N = 2), x's is one micro-batch's, as a
    # micro-batch's own input would hold.
    from benchmarks import moe_layer

    c = moe_layer.CPU_SMOKE.layer
    layer = moe_layer.build_peers(c, torch.device("cpu"), "uniform", ("bf16",))["bf16"]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(moe_layer.CPU_SMOKE.tokens, c.dim, generator=gen, dtype=torch.bfloat16).requires_grad_()
    grad_out = torch.randn(moe_layer.CPU_SMOKE.tokens, c.dim, generator=gen, dtype=torch.bfloat16)
    moe_layer.step_fn(layer, x, grad_out, 1)()
    one = {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in layer.named_parameters()}}
    moe_layer.step_fn(layer, x, grad_out, 2)()
    assert torch.equal(x.grad, one["x"])
    for n, p in layer.named_parameters():
        assert torch.equal(p.grad, 2 * one[n]), n
