"""Benchmark the dense blockwise FP8 GEMMs against cuBLAS's blockwise scaled_mm and bf16 torch.mm.

Roles of a linear layer ``y = x @ W.T`` with M tokens, ``W (N, K)``:
    forward  y  (M, N) = x (M, K) @ W.T      1x128 x 128x128   gemm_blockwise_forward
    dgrad    dx (M, K) = dy (M, N) @ W       1x128 x 128x128   gemm_blockwise_dgrad (W.T stored (K, N))
    wgrad    dW (N, K) = dy.T @ x            128x1 x 128x1     gemm_blockwise_wgrad (dy.T, x.T token-contiguous)
Layers: Llama-3-8B and Qwen3-32B dense layers at 8192 tokens, plus 8192^3.
Peers, same process, same FP8 operands and scales: ``torch.nn.functional.scaled_mm``
with ``ScalingType.BlockWise1x128`` / ``BlockWise128x128`` (cuBLAS; the same scale
tensors, viewed in its layouts) or, on a torch without it, ``torch._scaled_mm``
with the same blockwise scales; and bf16 ``torch.mm``. Times are medians of
``triton.testing.do_bench``; TFLOP/s count ``2*M*N*K``. A second table times the
whole ``Float8BlockwiseLinear`` (quantization included), forward + backward,
against bf16 ``nn.Linear``.

    python -m benchmarks.gemm_blockwise [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch

import ops
from benchmarks.common import bench_us, environment_header, markdown_table
from kernels_helion import (
    gemm_blockwise_dgrad,
    gemm_blockwise_forward,
    gemm_blockwise_wgrad,
    quantize_blockwise_rows,
    quantize_blockwise_cols,
    quantize_blockwise_weights_both_layouts,
)

TOKENS = 8192
# (name, N, K) of each dense layer's weight.
LAYERS = [
    ("Llama3-8B qkv", 6144, 4096),
    ("Llama3-8B o", 4096, 4096),
    ("Llama3-8B up", 14336, 4096),
    ("Llama3-8B down", 4096, 14336),
    ("Qwen3-32B qkv", 10240, 5120),
    ("Qwen3-32B o", 5120, 8192),
    ("Qwen3-32B up", 25600, 5120),
    ("Qwen3-32B down", 5120, 25600),
    ("square", 8192, 8192),
]
ROLES = ("forward", "dgrad", "wgrad")
# The torch API that ran cuBLAS's blockwise GEMM, per role (filled as roles are prepared).
CUBLAS_API: dict[str, str] = {}


def _cublas_blockwise_calls() -> list[tuple[str, Callable[..., torch.Tensor]]]:
    """cuBLAS's blockwise GEMM, ``fn(a, b, scale_a, scale_b, b_is_128x128)``, by each API torch may offer."""
    calls = []
    try:
        from torch.nn.functional import ScalingType, scaled_mm
    except ImportError:
        pass
    else:

        def call_scaled_mm(a, b, scale_a, scale_b, b_is_128x128):
            recipe_b = ScalingType.BlockWise128x128 if b_is_128x128 else ScalingType.BlockWise1x128
            return scaled_mm(a, b, scale_a, ScalingType.BlockWise1x128, scale_b, recipe_b, output_dtype=torch.bfloat16)

        calls.append(("F.scaled_mm", call_scaled_mm))

    def call_scaled_mm_v1(a, b, scale_a, scale_b, b_is_128x128):
        # The scale shapes tell torch._scaled_mm the blockwise recipe.
        return torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.bfloat16)

    calls.append(("torch._scaled_mm", call_scaled_mm_v1))
    return calls


def _cublas_block_scales(scales: torch.Tensor) -> torch.Tensor:
    """128x128 scales ``(out blocks, contraction blocks)`` row-major, as cuBLAS reads them for a column-major B.

    A transposed view of a buffer whose rows are padded to a multiple of 4 blocks
    (16 bytes): shape ``(round_up(contraction blocks, 4), out blocks)``.
    """
    out_blocks, blocks = scales.shape
    padded = scales.new_zeros(out_blocks, -(-blocks // 4) * 4)
    padded[:, :blocks] = scales
    return padded.t()


def _bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def prepare_role(role: str, m: int, n: int, k: int) -> dict[str, Callable[[], torch.Tensor]]:
    """Callables for one GEMM of the layer ``(M tokens, W (N, K))``: ``ours``, ``cublas`` (if it runs), ``bf16``.

    Operands are quantized once, outside the timed calls; cuBLAS gets the same
    FP8 data and scales, in the layouts its blockwise GEMM reads (B column-major).
    """
    x, w, grad_out = _bf16(m, k), _bf16(n, k) * 0.02, _bf16(m, n)
    if role == "forward":
        a, a_scales = quantize_blockwise_rows(x)
        b, b_scales, _, _ = quantize_blockwise_weights_both_layouts(w)
        fns = {"ours": lambda: gemm_blockwise_forward(a, a_scales, b, b_scales)}
        cublas_args = (a, b.t(), a_scales, _cublas_block_scales(b_scales), True)
        fns["bf16"] = lambda: torch.mm(x, w.t())
    elif role == "dgrad":
        a, a_scales = quantize_blockwise_rows(grad_out)
        _, _, b, b_scales = quantize_blockwise_weights_both_layouts(w)
        fns = {"ours": lambda: gemm_blockwise_dgrad(a, a_scales, b, b_scales)}
        cublas_args = (a, b.t(), a_scales, _cublas_block_scales(b_scales), True)
        fns["bf16"] = lambda: torch.mm(grad_out, w)
    else:
        a, a_scales = quantize_blockwise_cols(grad_out)
        b, b_scales = quantize_blockwise_cols(x)
        fns = {"ours": lambda: gemm_blockwise_wgrad(a, a_scales, b, b_scales)}
        cublas_args = (a, b.t(), a_scales.t(), b_scales.t(), False)
        fns["bf16"] = lambda: torch.mm(grad_out.t(), x)
    for api, call in _cublas_blockwise_calls():
        try:
            call(*cublas_args)
        except Exception as e:  # noqa: BLE001  (an API or recipe this torch lacks: try the next)
            reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
            print(f"  {api} blockwise {role} ({m}, {n}, {k}) failed: {type(e).__name__}: {reason}", flush=True)
            continue
        fns["cublas"] = lambda call=call: call(*cublas_args)
        CUBLAS_API[role] = api
        break
    return {name: fns[name] for name in ("ours", "cublas", "bf16") if name in fns}


def _sqnr_db(actual: torch.Tensor, reference: torch.Tensor) -> float:
    noise = (actual.float() - reference.float()).norm()
    return math.inf if noise == 0 else float(20 * torch.log10(reference.float().norm() / noise))


def _gemm_dims(role: str, m: int, n: int, k: int) -> tuple[int, int, int]:
    """``(rows, cols, contraction)`` of the role's output and contraction."""
    return {"forward": (m, n, k), "dgrad": (m, k, n), "wgrad": (n, k, m)}[role]


def bench_gemms(layers: list[tuple[str, int, int]], roles: tuple[str, ...]) -> tuple[list[list[object]], list[float]]:
    rows, ratios = [], []
    for name, n, k in layers:
        for role in roles:
            fns = prepare_role(role, TOKENS, n, k)
            flop = 2 * TOKENS * n * k
            times = {peer: bench_us(fn) for peer, fn in fns.items()}
            tflops = {peer: flop / (us * 1e-6) / 1e12 for peer, us in times.items()}
            agree = _sqnr_db(fns["ours"](), fns["cublas"]()) if "cublas" in fns else math.nan
            vs_cublas = times["cublas"] / times["ours"] if "cublas" in times else math.nan
            if "cublas" in times:
                ratios.append(vs_cublas)
            rows.append([
                name, role, "x".join(map(str, _gemm_dims(role, TOKENS, n, k))),
                tflops["ours"], tflops.get("cublas", math.nan), tflops["bf16"],
                vs_cublas, times["bf16"] / times["ours"], agree,
            ])
            print(" | ".join(str(v) if not isinstance(v, float) else f"{v:.3f}" for v in rows[-1]), flush=True)
            del fns
            torch.cuda.empty_cache()
    return rows, ratios


def bench_linear(layers: list[tuple[str, int, int]]) -> list[list[object]]:
    """Whole layer, forward + backward (dx and dW), quantization included, vs bf16 ``nn.Linear``."""
    rows = []
    for name, n, k in layers:
        reference = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        fp8 = ops.Float8BlockwiseLinear.from_linear(reference)
        x = _bf16(TOKENS, k).requires_grad_()
        grad_out = _bf16(TOKENS, n)

        def step(module: torch.nn.Module) -> Callable[[], None]:
            def run() -> None:
                module(x).backward(grad_out)
                x.grad = module.weight.grad = None

            return run

        times = {label: bench_us(step(module)) for label, module in (("fp8", fp8), ("bf16", reference))}
        tflops = {label: 3 * 2 * TOKENS * n * k / (us * 1e-6) / 1e12 for label, us in times.items()}
        rows.append([name, f"{TOKENS}x{n}x{k}", times["fp8"] / 1e3, times["bf16"] / 1e3,
                     tflops["fp8"], tflops["bf16"], times["bf16"] / times["fp8"]])
        print(" | ".join(str(v) for v in rows[-1]), flush=True)
        torch.cuda.empty_cache()
    return rows


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="Llama-3-8B o and the square shape only")
    parser.add_argument("--out", help="also write the markdown tables to this file")
    args = parser.parse_args()
    layers = [layer for layer in LAYERS if layer[0] in ("Llama3-8B o", "square")] if args.quick else LAYERS
    gemm_rows, ratios = bench_gemms(layers, ROLES)
    linear_rows = bench_linear([layer for layer in layers if layer[0].startswith("Llama3") or layer[0] == "square"])
    text = "\n".join([
        environment_header("Dense blockwise FP8 GEMMs (1x128 / 128x1 / 128x128 scales)"),
        f"Ours (Helion) vs cuBLAS's blockwise GEMM through {CUBLAS_API or 'no torch API (unavailable)'} "
        "(forward/dgrad BlockWise1x128 x BlockWise128x128, wgrad BlockWise1x128 x BlockWise1x128, "
        f"same FP8 data and scales) and bf16 torch.mm; {TOKENS} tokens. TFLOP/s = 2*M*N*K / median time. "
        "`ours/cuBLAS` > 1: ours faster. `agree`: SQNR (dB) of ours against cuBLAS's output.",
        "",
        markdown_table(
            ["layer", "role", "out x contraction", "ours TFLOP/s", "cuBLAS TFLOP/s", "bf16 TFLOP/s",
             "ours/cuBLAS", "ours/bf16", "agree dB"],
            gemm_rows,
        ),
        f"Geomean ours/cuBLAS: {geomean(ratios):.3f} (min {min(ratios, default=math.nan):.3f}, "
        f"{len(ratios)} GEMMs)",
        "",
        "## Float8BlockwiseLinear, forward + backward (quantization included) vs bf16 nn.Linear",
        "",
        markdown_table(
            ["layer", "MxNxK", "fp8 ms", "bf16 ms", "fp8 TFLOP/s", "bf16 TFLOP/s", "speedup"],
            linear_rows,
        ),
    ])
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
