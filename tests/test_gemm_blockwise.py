"""Dense blockwise FP8 GEMMs (forward NT, dgrad NN, wgrad TN) against dequantize-then-matmul references."""

from __future__ import annotations

import helion
import pytest
import torch

from autotune_cache import forced_config
from kernels_helion import (
    gemm_blockwise_dgrad,
    gemm_blockwise_forward,
    gemm_blockwise_wgrad,
    quantize_blockwise_rows,
    quantize_blockwise_rows_and_cols,
    quantize_blockwise_weights_both_layouts,
)
from kernels_helion.gemm_blockwise import BLOCK_SCALES, ROW_SCALES, _launch_gemm
from tests.support import DEVICE, poison_like, sqnr_db

BLOCK = 128
E4M3, E4M3FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz


def dequantize(q: torch.Tensor, scales: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """``q * scales`` in fp64, each scale broadcast over its ``block_rows x block_cols`` block."""
    rows, cols = q.shape
    full = scales.double().repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]
    return q.double() * full


def make_layer(m: int, n: int, k: int, device=DEVICE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 ``x (M, K)``, ``w (N, K)``, ``grad_out (M, N)`` with a spread of row magnitudes (scales differ)."""
    x = (torch.randn(m, k, device=device) * torch.rand(m, 1, device=device).add(0.1) * 4).to(torch.bfloat16)
    w = (torch.randn(n, k, device=device) * torch.rand(n, 1, device=device).add(0.1) * 1e-2).to(torch.bfloat16)
    grad_out = (torch.randn(m, n, device=device) * torch.rand(1, n, device=device).add(0.1)).to(torch.bfloat16)
    return x, w, grad_out


def run_role(role: str, x, w, grad_out, float8_dtype=E4M3, **kwargs):
    """``(out, reference from the quantized operands, reference from the bf16 tensors)`` of one role."""
    if role == "forward":
        a, sa = quantize_blockwise_rows(x, float8_dtype)
        b, sb, _, _ = quantize_blockwise_weights_both_layouts(w, float8_dtype)
        out = gemm_blockwise_forward(a, sa, b, sb, **kwargs)
        ref = dequantize(a, sa, 1, BLOCK) @ dequantize(b, sb, BLOCK, BLOCK).T
        return out, ref, x.double() @ w.double().T
    if role == "dgrad":
        a, sa = quantize_blockwise_rows(grad_out, float8_dtype)
        _, _, b, sb = quantize_blockwise_weights_both_layouts(w, float8_dtype)
        out = gemm_blockwise_dgrad(a, sa, b, sb, **kwargs)
        ref = dequantize(a, sa, 1, BLOCK) @ dequantize(b, sb, BLOCK, BLOCK).T
        return out, ref, grad_out.double() @ w.double()
    _, _, a, sa = quantize_blockwise_rows_and_cols(grad_out, float8_dtype)
    _, _, b, sb = quantize_blockwise_rows_and_cols(x, float8_dtype)
    out = gemm_blockwise_wgrad(a, sa, b, sb, **kwargs)
    ref = dequantize(a, sa.T, 1, BLOCK) @ dequantize(b, sb.T, 1, BLOCK).T
    return out, ref, grad_out.double().T @ x.double()


def assert_close_bf16(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # atol: rounding of the largest outputs to bf16 (2**-8 relative on CPU, whose cast truncates) plus
    # fp32 accumulation error.
    atol = 8e-3 * float(expected.abs().amax()) + 1e-6
    torch.testing.assert_close(actual.double(), expected, rtol=1.6e-2, atol=atol)


# (M, N, K) of the layer. The contraction is K (forward), N (dgrad), M (wgrad): each role
# sees one contraction that is a multiple of 128 (the no-tail fast path) and one that is not.
SHAPES = [(200, 136, 300), (130, 256, 256), (256, 72, 130)]


@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("role", ["forward", "dgrad", "wgrad"])
def test_matches_reference(role, m, n, k):
    x, w, grad_out = make_layer(m, n, k)
    out, ref, unquantized = run_role(role, x, w, grad_out)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape and out.is_contiguous()
    assert_close_bf16(out, ref)
    assert sqnr_db(out, unquantized) >= 28


@pytest.mark.parametrize("role", ["forward", "wgrad"])
def test_e4m3fnuz(role):
    if DEVICE.type == "cuda" and torch.version.hip is None:
        pytest.skip("e4m3fnuz GEMMs need ROCm on a GPU")
    x, w, grad_out = make_layer(140, 72, 200)
    out, ref, unquantized = run_role(role, x, w, grad_out, E4M3FNUZ, out_dtype=torch.float32)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().amax()))
    assert sqnr_db(out, unquantized) >= 28


@pytest.mark.parametrize("float8_dtype", [E4M3, E4M3FNUZ])
def test_every_fp8_value_decodes(float8_dtype):
    """``a @ I`` with unit scales gives back every finite value of the format, exactly; NaN propagates."""
    if float8_dtype == E4M3FNUZ and DEVICE.type == "cuda" and torch.version.hip is None:
        pytest.skip("e4m3fnuz GEMMs need ROCm on a GPU")
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    is_nan = bits.view(float8_dtype).float().isnan()
    a_bits = torch.zeros(3, BLOCK, dtype=torch.uint8)
    a_bits[:2].view(-1)[: int((~is_nan).sum())] = bits[~is_nan]
    a_bits[2, 5] = bits[is_nan][0]
    a = a_bits.view(float8_dtype).to(DEVICE)
    b = torch.eye(BLOCK, device=DEVICE).to(float8_dtype)
    ones = torch.ones(3, 1, device=DEVICE)
    out = gemm_blockwise_forward(a, ones, b, ones[:1], out_dtype=torch.float32)
    assert torch.equal(out[:2], a[:2].float())
    assert out[2].isnan().all()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_out_dtypes(out_dtype):
    x, w, grad_out = make_layer(70, 48, 160)
    out, ref, _ = run_role("dgrad", x, w, grad_out, out_dtype=out_dtype)
    assert out.dtype == out_dtype
    assert_close_bf16(out, ref)


def test_wgrad_accumulates_into_fp32_out():
    x, w, grad_out = make_layer(150, 40, 56)
    start = torch.randn(40, 56, device=DEVICE)
    out = start.clone()
    result, ref, _ = run_role("wgrad", x, w, grad_out, out=out)
    assert result is out
    plain, _, _ = run_role("wgrad", x, w, grad_out, out_dtype=torch.float32)
    # The kernel's own product is what is added (on a GPU, FP8 tensor cores do not sum a 128-wide
    # K block exactly in fp32: the product meets the fp64 reference within ~1e-3 of its largest value).
    torch.testing.assert_close(out, start + plain, rtol=1e-6, atol=1e-5 * float(plain.abs().amax()))
    atol = (2e-3 if DEVICE.type == "cuda" else 1e-5) * float(ref.abs().amax())
    torch.testing.assert_close(out.double(), start.double() + ref, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("b_scale_rows", [BLOCK_SCALES, ROW_SCALES])
def test_every_output_element_is_written(b_scale_rows):
    """The kernel fills a NaN-poisoned output completely (partial tiles in both dimensions)."""
    m, n, k = 70, 136, 200
    x, w, grad_out = make_layer(m, n, k)
    a, sa, _, _ = quantize_blockwise_rows_and_cols(x)
    if b_scale_rows == BLOCK_SCALES:
        b, sb, _, _ = quantize_blockwise_weights_both_layouts(w)
        ref = dequantize(a, sa, 1, BLOCK) @ dequantize(b, sb, BLOCK, BLOCK).T
    else:
        b, sb = quantize_blockwise_rows(w)
        sb = sb.T.contiguous()  # (ceil(K/128), N): one scale per row of b and K block
        ref = dequantize(a, sa, 1, BLOCK) @ dequantize(b, sb.T, 1, BLOCK).T
    out = poison_like(torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE))
    _launch_gemm(a, sa.T, b, sb, out, b_scale_rows, False, "gemm_blockwise_forward")
    assert not out.isnan().any()
    assert_close_bf16(out, ref)


def test_empty_rows_and_tokens():
    x, w, grad_out = make_layer(0, 32, 48)
    out, _, _ = run_role("forward", x, w, grad_out)
    assert out.shape == (0, 32)
    dw, _, _ = run_role("wgrad", x, w, grad_out)
    assert dw.shape == (32, 48) and (dw == 0).all()
    acc = torch.randn(32, 48, device=DEVICE)
    before = acc.clone()
    run_role("wgrad", x, w, grad_out, out=acc)
    assert torch.equal(acc, before)


def test_deterministic():
    x, w, grad_out = make_layer(130, 72, 260)
    assert torch.equal(run_role("wgrad", x, w, grad_out)[0], run_role("wgrad", x, w, grad_out)[0])


def test_block_scaled_roles_need_n_tiles_within_a_scale_block():
    x, w, grad_out = make_layer(16, 256, 128)
    with forced_config("gemm_blockwise_forward", helion.Config(block_sizes=[64, 256], num_warps=4, num_stages=1)):
        with pytest.raises(ValueError, match="BLOCK_N must divide 128"):
            run_role("forward", x, w, grad_out)


def _operands(role: str):
    x, w, grad_out = make_layer(32, 16, 200)
    if role == "forward":
        a, sa = quantize_blockwise_rows(x)
        b, sb, _, _ = quantize_blockwise_weights_both_layouts(w)
        return gemm_blockwise_forward, dict(x=a, x_scales=sa, w=b, w_scales=sb)
    if role == "dgrad":
        a, sa = quantize_blockwise_rows(grad_out)
        _, _, b, sb = quantize_blockwise_weights_both_layouts(w)
        return gemm_blockwise_dgrad, dict(grad_out=a, grad_out_scales=sa, w_t=b, w_t_scales=sb)
    _, _, a, sa = quantize_blockwise_rows_and_cols(grad_out)
    _, _, b, sb = quantize_blockwise_rows_and_cols(x)
    return gemm_blockwise_wgrad, dict(grad_out_t=a, grad_out_t_scales=sa, x_t=b, x_t_scales=sb)


@pytest.mark.parametrize(
    "role, overrides, error, match",
    [
        ("forward", {"x": lambda d: d["x"].float()}, TypeError, "x must be one of"),
        ("forward", {"w": lambda d: d["w"].to(torch.float8_e5m2)}, TypeError, "w must be one of"),
        ("forward", {"w": lambda d: d["w"][:, :160].contiguous()}, ValueError, "w must have 200 columns like x"),
        ("forward", {"x": lambda d: d["x"].t().contiguous().t()}, ValueError, "x must be contiguous"),
        ("forward", {"w": lambda d: d["w"][None]}, ValueError, "w must be 2-D"),
        ("forward", {"w": lambda d: d["w"][:0]}, ValueError, "w must have at least one row"),
        ("forward", {"x": lambda d: d["x"][:, :0], "w": lambda d: d["w"][:, :0]}, ValueError,
         "x must have at least one column"),
        ("forward", {"x_scales": lambda d: d["x_scales"][:-1]}, ValueError, r"x_scales must have shape \(32, 2\)"),
        ("forward", {"x_scales": lambda d: d["x_scales"].contiguous()}, ValueError, "x_scales must be K-block-major"),
        ("forward", {"x_scales": lambda d: d["x_scales"].double()}, TypeError, "x_scales must have dtype"),
        ("forward", {"w_scales": lambda d: d["w_scales"][:, :1].contiguous()}, ValueError, r"w_scales must have shape \(1, 2\)"),
        ("forward", {"w_scales": lambda d: d["w_scales"].tolist()}, TypeError, "w_scales must be a torch.Tensor"),
        ("forward", {"out_dtype": lambda d: torch.int32}, TypeError, "out_dtype must be one of"),
        ("dgrad", {"w_t": lambda d: d["w_t"].view(torch.uint8)}, TypeError, "w_t must be one of"),
        # On CUDA without ROCm, e4m3fnuz itself is refused first (also naming w_t).
        (
            "dgrad", {"w_t": lambda d: d["w_t"].to(torch.float8_e4m3fnuz)}, TypeError,
            "w_t must have the dtype of grad_out|w_t: float8_e4m3fnuz GEMMs need a ROCm build",
        ),
        ("dgrad", {"w_t_scales": lambda d: d["w_t_scales"].t()}, ValueError, "w_t_scales must"),
        ("dgrad", {"grad_out_scales": lambda d: d["grad_out_scales"][:-1]}, ValueError, "grad_out_scales must have shape"),
        ("wgrad", {"x_t": lambda d: d["x_t"][:, :16].contiguous()}, ValueError, "x_t must have 32 columns like grad_out_t"),
        ("wgrad", {"x_t_scales": lambda d: d["x_t_scales"][:, :100].contiguous()}, ValueError, r"x_t_scales must have shape \(1, 200\)"),
        ("wgrad", {"grad_out_t_scales": lambda d: d["grad_out_t_scales"].double()}, TypeError, "grad_out_t_scales must have dtype"),
        ("wgrad", {"out": lambda d: torch.zeros(16, 200, dtype=torch.bfloat16, device=DEVICE)}, TypeError, "out must have dtype"),
        ("wgrad", {"out": lambda d: torch.zeros(200, 16, device=DEVICE)}, ValueError, r"out must have shape \(16, 200\)"),
        ("wgrad", {"out": lambda d: torch.zeros(200, 16, device=DEVICE).t()}, ValueError, "out must be contiguous"),
    ],
)
def test_bad_input(role, overrides, error, match):
    launcher, args = _operands(role)
    args.update({name: make(args) for name, make in overrides.items()})
    with pytest.raises(error, match=match):
        launcher(**args)


# --- GPU: benchmark shapes -----------------------------------------------------------------


def _reference_rows(role: str, x, w, grad_out, rows: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A slice of rows of the output and both references, computed on the GPU in fp64."""
    if role == "forward":
        a, sa = quantize_blockwise_rows(x)
        b, sb, _, _ = quantize_blockwise_weights_both_layouts(w)
        out = gemm_blockwise_forward(a, sa, b, sb)
        ref = dequantize(a[rows], sa[rows], 1, BLOCK) @ dequantize(b, sb, BLOCK, BLOCK).T
        unquantized = x[rows].double() @ w.double().T
    elif role == "dgrad":
        a, sa = quantize_blockwise_rows(grad_out)
        _, _, b, sb = quantize_blockwise_weights_both_layouts(w)
        out = gemm_blockwise_dgrad(a, sa, b, sb)
        ref = dequantize(a[rows], sa[rows], 1, BLOCK) @ dequantize(b, sb, BLOCK, BLOCK).T
        unquantized = grad_out[rows].double() @ w.double()
    else:
        _, _, a, sa = quantize_blockwise_rows_and_cols(grad_out)
        _, _, b, sb = quantize_blockwise_rows_and_cols(x)
        out = gemm_blockwise_wgrad(a, sa, b, sb)
        ref = dequantize(a[rows], sa.T[rows], 1, BLOCK) @ dequantize(b, sb.T, 1, BLOCK).T
        unquantized = grad_out.double().T[rows] @ x.double()
    return out, ref, unquantized


@pytest.mark.cuda
@pytest.mark.parametrize("role", ["forward", "dgrad", "wgrad"])
@pytest.mark.parametrize("m, n, k", [(4096, 4096, 4096), (4000, 4104, 3984), (520, 264, 1000)])
def test_benchmark_shape(role, m, n, k):
    """Benchmark size (TMA, persistent tiles), tails in every dimension, and rows not 16-byte aligned."""
    x, w, grad_out = make_layer(m, n, k)
    rows = slice(0, 256)
    out, ref, unquantized = _reference_rows(role, x, w, grad_out, rows)
    again, _, _ = _reference_rows(role, x, w, grad_out, rows)
    assert torch.equal(out, again), "not bitwise deterministic"
    assert_close_bf16(out[rows], ref)
    assert sqnr_db(out[rows], unquantized) >= 28


@pytest.mark.cuda
@pytest.mark.parametrize("role", ["forward", "dgrad", "wgrad"])
@pytest.mark.parametrize("k", [1024, 1000])
def test_pointer_loads_match_tma(role, k):
    """Pointer loads (with the no-tail fast path when K is a multiple of 128) give TMA's results."""
    from kernels_helion.gemm_blockwise import DEFAULT_CONFIG

    x, w, grad_out = make_layer(1024, 768, k)
    expected, _, _ = run_role(role, x, w, grad_out, out_dtype=torch.float32)
    pointer = helion.Config(**{**DEFAULT_CONFIG.config, "indexing": "pointer", "pid_type": "flat"})
    with forced_config(f"gemm_blockwise_{role}", pointer):
        actual, _, _ = run_role(role, x, w, grad_out, out_dtype=torch.float32)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().amax()))


@pytest.mark.cuda
@pytest.mark.parametrize("role", ["forward", "dgrad", "wgrad"])
def test_matches_torch_scaled_mm_blockwise(role):
    """Same result as cuBLAS's blockwise scaled_mm (torch.nn.functional.scaled_mm) up to accumulation order."""
    from benchmarks.gemm_blockwise import prepare_role

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("cuBLAS blockwise scaling runs on sm90 only")
    fns = prepare_role(role, 2048, 1536, 1024)
    if "cublas" not in fns:
        pytest.skip("this torch has no cuBLAS blockwise scaled_mm")
    expected = fns["cublas"]().double()
    torch.testing.assert_close(fns["ours"]().double(), expected, rtol=1.6e-2, atol=8e-3 * float(expected.abs().amax()))
