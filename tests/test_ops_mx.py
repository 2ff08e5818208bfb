"""The MXFP8 recipe in the ops layer: custom ops, autograd, dispatch guard, functional and module paths."""

from __future__ import annotations

import types

import pytest
import torch

import ops
import ops.autograd_mx
import ops.custom_ops_mx
from tests.reference_grouped_linear import ref_grouped_linear
from tests.reference_mx import emulated_mx_grouped_linear
from tests.support import (
    DEVICE,
    custom_ops_defined_in,
    fwd_bwd,
    group_sizes,
    grouped_linear_problem,
    opcheck_fp8,
    sqnr_db,
)

MXFP8 = ops.Fp8Recipe(name="mxfp8")

# Groups spanning several 32-token cells with partial first and last cells, an empty
# group, a group of 1, sizes not multiples of 16, and 11 tokens past offs[-1].
SIZES = [40, 0, 1, 45]
M, K, N = 97, 64, 64


def make_problem(sizes=SIZES, m=M, k=K, n=N, **kwargs):
    return grouped_linear_problem(sizes, m, k, n, **kwargs)


def mx_linear(recipe=MXFP8, **kwargs):
    return lambda x, w, offs: ops.fp8_grouped_linear(x, w, offs, recipe, **kwargs)


# --- custom ops -------------------------------------------------------------------------------


def _opcheck_cases():
    x, w, offs, go = make_problem(sizes=[0, 5, 40], m=50, k=32, n=64)
    fp8 = torch.ops.fp8moe
    x_fp8, x_s, xt, xt_s, block_offs = fp8.quantize_mx_rows_and_cols_grouped(x, offs, "rceil")
    got, got_s, _ = fp8.quantize_mx_cols_grouped(go, offs, "rceil")
    w_fp8, w_s = fp8.quantize_mx_expert_weights(w, "rceil", False)
    return {
        "quantize_mx_rows": (x, "floor"),
        "quantize_mx_cols_grouped": (go, offs, "rceil"),
        "quantize_mx_rows_and_cols_grouped": (x, offs, "floor"),
        "quantize_mx_expert_weights": (w, "rceil", True),
        "to_blocked_scales_grouped": (x_s, offs),
        "to_blocked_scales_per_expert": (w_s,),
        "to_blocked_scales_k_groups": (xt_s.t(), block_offs),
        "grouped_mm_2d3d_mx": (x_fp8, x_s, w_fp8, w_s, offs, torch.bfloat16),
        "grouped_mm_wgrad_mx": (got, got_s, xt, xt_s, offs, block_offs, torch.float32),
    }


def test_opcheck_every_op():
    """Schema, fake (meta) implementations and aot_dispatch of every op of ``ops.custom_ops_mx``."""
    cases = _opcheck_cases()
    assert custom_ops_defined_in(ops.custom_ops_mx) == set(cases)
    for name, args in cases.items():
        opcheck_fp8(getattr(torch.ops.fp8moe, name), args)


# --- the recipe ---------------------------------------------------------------------------------


def assert_matches_emulation(actual, expected) -> None:
    # Same quantization (scales and FP8 values bitwise); only the fp32 accumulation
    # order and the bf16 rounding of the result (2**-9 relative) differ.
    for name, a, e in zip(("out", "dx", "dw"), actual, expected):
        torch.testing.assert_close(a.double(), e, rtol=1e-2, atol=1e-2 * e.abs().max().item(), msg=name)


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_matches_exact_gemm_emulation(rounding):
    """The recipe's quantization done in plain PyTorch, GEMMs in float64."""
    x, w, offs, grad_out = make_problem()
    recipe = ops.Fp8Recipe(name="mxfp8", options=ops.MxOptions(rounding=rounding))
    out, dx, dw = fwd_bwd(mx_linear(recipe), x, w, offs, grad_out)
    assert out.dtype == dx.dtype == dw.dtype == torch.bfloat16
    assert_matches_emulation((out, dx, dw), emulated_mx_grouped_linear(x, w, offs, grad_out, rounding))
    # Tokens past offs[-1] get nothing, in forward and in dx; an empty group's dW is 0.
    assert (out[sum(SIZES):] == 0).all() and (dx[sum(SIZES):] == 0).all()
    assert (dw[1] == 0).all()


def test_fidelity_vs_exact_autograd():
    x, w, offs, grad_out = make_problem(sizes=[40, 0, 100, 60], m=200, k=128, n=64)
    out, dx, dw = fwd_bwd(mx_linear(), x, w, offs, grad_out)
    r_out, r_dx, r_dw = fwd_bwd(ref_grouped_linear, x, w, offs, grad_out)
    assert sqnr_db(out, r_out) >= 27
    assert sqnr_db(dx, r_dx) >= 25
    assert sqnr_db(dw, r_dw) >= 24


def test_saving_choices_and_grad_subsets_agree_bitwise():
    x, w, offs, grad_out = make_problem(sizes=[20, 0, 1, 40], m=70, k=32, n=32)
    full = fwd_bwd(mx_linear(), x, w, offs, grad_out)
    lean = ops.Fp8Recipe(name="mxfp8", save_fp8_input=False, save_fp8_weight=False)
    for a, b in zip(fwd_bwd(mx_linear(lean), x, w, offs, grad_out), full):
        assert torch.equal(a, b)
    out, dx, dw = fwd_bwd(mx_linear(), x, w, offs, grad_out, needs=(True, False))
    assert dw is None and torch.equal(dx, full[1])
    out, dx, dw = fwd_bwd(mx_linear(), x, w, offs, grad_out, needs=(False, True))
    assert dx is None and torch.equal(dw, full[2])
    with torch.no_grad():
        assert torch.equal(mx_linear()(x, w, offs), full[0])


def test_fp32_inputs_and_outputs():
    x, w, offs, grad_out = make_problem(sizes=[20, 0, 1, 40], m=70, k=32, n=32, dtype=torch.float32)
    out, dx, dw = fwd_bwd(mx_linear(out_dtype=torch.float32), x, w, offs, grad_out)
    assert out.dtype == dx.dtype == dw.dtype == torch.float32
    assert_matches_emulation((out, dx, dw), emulated_mx_grouped_linear(x, w, offs, grad_out))


# --- the Blackwell dispatch guard -------------------------------------------------------------


@pytest.mark.parametrize("capability, expected", [((9, 0), False), ((8, 9), False), ((12, 0), False), ((10, 0), True),
                                                  ((10, 3), True)])
def test_native_mx_gemm_only_on_capability_10(monkeypatch, capability, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", None)
    cuda_tensor = types.SimpleNamespace(device=torch.device("cuda", 0))
    assert ops.autograd_mx.native_mx_grouped_mm_available(cuda_tensor) is expected


def test_native_mx_gemm_never_called_off_sm100(monkeypatch):
    """On CPU and on sm90 the recipe must not touch torch's MX grouped GEMM (on sm90 it poisons the CUDA context)."""
    x, w, offs, grad_out = make_problem(sizes=[20, 0, 30], m=50, k=32, n=32)
    if ops.autograd_mx.native_mx_grouped_mm_available(x):
        pytest.skip("sm100: the native path is the one used")

    def forbidden(*args, **kwargs):
        raise AssertionError("torch._scaled_grouped_mm called outside sm100")

    monkeypatch.setattr(torch, "_scaled_grouped_mm", forbidden)
    fwd_bwd(mx_linear(), x, w, offs, grad_out)


def _unblock(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of the blocked layout (128x4 tiles of 512 bytes, rows of tiles first): ``(rows, cols)``."""
    r = torch.arange(rows)[:, None]
    c = torch.arange(cols)[None, :]
    byte = ((r // 128) * -(-cols // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    return flat.cpu()[byte].to(flat.device)


def _deq(q: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """float64 of e4m3 ``q (R, C)`` with e8m0 ``e (R, C/32)`` along C."""
    return q.double() * torch.exp2(e.view(torch.uint8).double() - 127).repeat_interleave(32, dim=1)


def fake_native_mx_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs=None, out_dtype=None, **kwargs):
    """PyTorch's MXFP8 grouped mm contract (blocked e8m0 scales), computed in float64 from the documented layouts."""
    assert scale_a.dtype == scale_b.dtype == torch.float8_e8m0fnu and out_dtype == torch.bfloat16
    scale_a, scale_b = scale_a.view(torch.uint8).flatten(), scale_b.view(torch.uint8)
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if mat_b.dim() == 3:  # 2D x 3D: A's scales blocked per group of rows from multiples of 128, B's per expert.
        (m, k), (_, _, n) = mat_a.shape, mat_b.shape
        out = torch.zeros(m, n, dtype=torch.float64, device=mat_a.device)
        row = 0
        for g, (s, e) in enumerate(zip(starts, ends)):
            a_scales = _unblock(scale_a[row * (-(-k // 32 // 4) * 4):], e - s, k // 32)
            b_scales = _unblock(scale_b[g], n, k // 32)
            out[s:e] = _deq(mat_a[s:e], a_scales) @ _deq(mat_b[g].t(), b_scales).T
            row += -(-(e - s) // 128) * 128
        return out.to(out_dtype)
    # 2D x 2D: each group's scales blocked on their own, from column (start rounded to 4) * padded rows.
    (n, _), (_, k) = mat_a.shape, mat_b.shape
    out = torch.zeros(len(ends), n, k, dtype=torch.float64, device=mat_a.device)
    col = 0
    for g, (s, e) in enumerate(zip(starts, ends)):
        blocks = (e - s) // 32
        a_scales = _unblock(scale_a[col * -(-n // 128) * 128:], n, blocks)
        b_scales = _unblock(scale_b.flatten()[col * -(-k // 128) * 128:], k, blocks)
        out[g] = _deq(mat_a[:, s:e], a_scales) @ _deq(mat_b.t()[:, s:e], b_scales).T
        col += -(-blocks // 4) * 4
    return out.to(out_dtype)


def test_native_dispatch_passes_pytorchs_layouts(monkeypatch):
    """The sm100 path's operands and blocked scales, checked against a float64 model of PyTorch's MX grouped mm.

    Only the plumbing is tested (PyTorch's kernel cannot run here): with group sizes that are
    multiples of 32 (the native wgrad's precondition) it must agree with the emulated kernels.
    """
    x, w, offs, grad_out = make_problem(sizes=[64, 0, 32, 160], m=270, k=64, n=160)
    emulated = fwd_bwd(mx_linear(), x, w, offs, grad_out)
    monkeypatch.setattr(ops.autograd_mx, "native_mx_grouped_mm_available", lambda t: True)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", fake_native_mx_grouped_mm)
    native = fwd_bwd(mx_linear(), x, w, offs, grad_out)
    for name, a, e in zip(("out", "dx", "dw"), native, emulated):
        torch.testing.assert_close(a.float(), e.float(), rtol=1e-2, atol=1e-2 * e.abs().max().item(), msg=name)
    assert (native[0][256:] == 0).all() and (native[1][256:] == 0).all()


# --- input checks ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"float8_dtype": torch.float8_e4m3fnuz}, TypeError, "mxfp8 recipe's elements are float8_e4m3fn"),
        ({"mx_rounding": "floor"}, TypeError, r"set through options=ops.MxOptions\(rounding=\.\.\.\)"),
        ({"options": ops.RowwiseOptions()}, TypeError, "options must be MxOptions"),
    ],
)
def test_bad_recipe(kwargs, error, match):
    with pytest.raises(error, match=match):
        ops.Fp8Recipe(name="mxfp8", **kwargs)


@pytest.mark.parametrize("k, n, name", [(48, 64, "K"), (64, 48, "N")])
def test_dims_must_be_multiples_of_32(k, n, name):
    x, w, offs, _ = make_problem(k=k, n=n)
    with pytest.raises(ValueError, match=f"needs {name} to be a multiple of the MX block size 32"):
        mx_linear()(x, w, offs)


# --- GPU: benchmark-size fidelity -------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["uniform", "skewed", "unaligned"])
def test_benchmark_shape_fidelity(kind, monkeypatch):
    if not ops.autograd_mx.native_mx_grouped_mm_available(torch.empty(0, device=DEVICE)):
        monkeypatch.setattr(torch, "_scaled_grouped_mm", None)  # the emulated path must not need it
    sizes = group_sizes(16384 - 50, 8, kind, align=32 if kind != "unaligned" else 1)
    x, w, offs, grad_out = make_problem(sizes=sizes, m=16384, k=2048, n=1536)
    out, dx, dw = fwd_bwd(mx_linear(), x, w, offs, grad_out)
    r_out, r_dx, r_dw = fwd_bwd(ref_grouped_linear, x, w, offs, grad_out)
    assert sqnr_db(out, r_out) >= 27
    assert sqnr_db(dx, r_dx) >= 25
    assert sqnr_db(dw, r_dw) >= 24
    again = fwd_bwd(mx_linear(), x, w, offs, grad_out)
    assert all(torch.equal(a, b) for a, b in zip((out, dx, dw), again)), "not bitwise deterministic"
