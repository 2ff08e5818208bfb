"""Blockwise wgrad grouped GEMM (``grouped_mm_wgrad_blockwise``): what is particular to it.

The behaviour every grouped GEMM shares (determinism, output dtypes, empty groups, bad offsets,
the common input checks) is tested once for all formats in ``test_grouped_gemm_shared.py``.
"""

from __future__ import annotations

import pytest
import torch

from kernels_helion import grouped_mm_wgrad_blockwise
from tests.gemm_formats import BLOCK, make_blockwise_wgrad, ref_wgrad, ref_wgrad_blockwise
from tests.support import DEVICE, group_sizes, misaligned_copy, offsets_from_sizes, sqnr_db

make_inputs = make_blockwise_wgrad


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 4e-3) -> None:
    # atol: rounding of the largest outputs (bf16: 2**-9 relative) plus fp32 accumulation error.
    atol = rel * float(expected.abs().amax()) + 1e-6
    torch.testing.assert_close(actual.double(), expected, rtol=1.6e-2, atol=atol)


@pytest.mark.parametrize("kind", ["uniform", "skewed", "empty", "one", "unaligned"])
@pytest.mark.parametrize("m, n, k, groups", [(400, 48, 40, 3), (197, 24, 72, 4)])
def test_matches_reference(kind, m, n, k, groups):
    sizes = group_sizes(m - 9, groups, kind)  # the last 9+ tokens are past offs[-1]
    grad_out, x, offs, a_t, sa, b_t, sb, starts = make_inputs(m, n, k, sizes)
    out = grouped_mm_wgrad_blockwise(a_t, sa, b_t, sb, offs, starts)
    assert out.dtype == torch.bfloat16 and out.shape == (groups, n, k)
    assert_close(out, ref_wgrad_blockwise(a_t, sa, b_t, sb, sizes))
    for g, size in enumerate(sizes):
        if size == 0:
            assert (out[g] == 0).all(), "an empty group's gradient must be 0"
    assert sqnr_db(out, ref_wgrad(grad_out.T, x.T, sizes)) >= 28


def test_accumulates_into_fp32_out():
    sizes = [130, 0, 1, 150]
    _, _, offs, a_t, sa, b_t, sb, starts = make_inputs(290, 32, 24, sizes)
    initial = torch.randn(4, 32, 24, device=DEVICE)
    out = initial.clone()
    assert grouped_mm_wgrad_blockwise(a_t, sa, b_t, sb, offs, starts, out=out) is out
    # Hopper's FP8 MMA accumulates with less than fp32 precision within a block (measured
    # 4e-5 of the largest output on the H200); the interpreter's upcast dot is fp32-exact.
    rel = 1e-5 if DEVICE.type == "cpu" else 2e-4
    assert_close(out, initial.double() + ref_wgrad_blockwise(a_t, sa, b_t, sb, sizes), rel=rel)


@pytest.mark.parametrize("n, k", [(32, 48), (30, 45)])
def test_scales_tma_rules(n, k):
    # TMA reads 16-byte aligned data and rows (n, k multiples of 4 floats): other scales load
    # through pointers, with the same result.
    sizes = group_sizes(280, 3, "unaligned")
    _, _, offs, a_t, sa, b_t, sb, starts = make_inputs(300, n, k, sizes)
    aligned = grouped_mm_wgrad_blockwise(a_t, sa, b_t, sb, offs, starts)
    misaligned = grouped_mm_wgrad_blockwise(a_t, misaligned_copy(sa), b_t, misaligned_copy(sb), offs, starts)
    assert torch.equal(aligned, misaligned)
    assert_close(aligned, ref_wgrad_blockwise(a_t, sa, b_t, sb, sizes))


@pytest.mark.parametrize("with_store", [True, False])
def test_tma_config_marks_the_operand_loads(with_store):
    # One indexing slot per load/store; the two operand loads (and the bf16 output's store) through descriptors.
    import helion

    from kernels_helion._launch import with_tma
    from kernels_helion.grouped_gemm_wgrad_blockwise import grouped_mm_wgrad_blockwise_kernel

    n, k, rows = 32, 48, 4
    a_t = torch.zeros(n, rows * BLOCK, dtype=torch.float8_e4m3fn)
    b_t = torch.zeros(k, rows * BLOCK, dtype=torch.float8_e4m3fn)
    args = (
        a_t.view(n, rows, BLOCK), torch.ones(rows, n), b_t.view(k, rows, BLOCK), torch.ones(rows, k),
        offsets_from_sizes([200, 100], device="cpu"), torch.tensor([0, 2], dtype=torch.int32),
        torch.zeros(2, n, k, dtype=torch.bfloat16), False, 2, True,
    )
    config = helion.Config(block_sizes=[16, 16], num_warps=4, num_stages=1)
    stores = ("out",) if with_store else ()
    tma = with_tma(grouped_mm_wgrad_blockwise_kernel, args, config, stores=stores, loads=("a_blocks", "b_blocks"))
    # Slots in the generated code's order: offs, block starts, the operands, the two scales; the output store.
    expected = ["pointer"] * 2 + ["tensor_descriptor"] * 2 + ["pointer"] * 2
    assert tma.config["indexing"] == expected + ["tensor_descriptor" if with_store else "pointer"]


def test_bad_block_map_reads_clamped_block_rows():
    """Block rows are clamped into ``[0, R]``: a first block below 0 reads from row 0, one past ``R`` reads none."""
    sizes = [30, 34]
    _, _, offs, a_t, sa, b_t, sb, _ = make_inputs(64, 16, 16, sizes)
    bad_starts = torch.tensor([-7, 10**6], dtype=torch.int32, device=DEVICE)
    out = grouped_mm_wgrad_blockwise(a_t, sa, b_t, sb, offs, bad_starts, out_dtype=torch.float32)
    assert_close(out[0], ref_wgrad_blockwise(a_t, sa, b_t, sb, sizes)[0], rel=1e-5 if DEVICE.type == "cpu" else 2e-4)
    assert (out[1] == 0).all()


def _bad(**overrides):
    _, _, offs, a_t, sa, b_t, sb, starts = make_inputs(64, 16, 24, [30, 34])
    args = dict(a_t=a_t, a_scales=sa, b_t=b_t, b_scales=sb, offs=offs, group_block_starts=starts)
    args.update({k: v(args) for k, v in overrides.items()})
    return args


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        (
            {"a_t": lambda d: d["a_t"][:, :-1].contiguous(), "b_t": lambda d: d["b_t"][:, :-1].contiguous()},
            ValueError,
            "128 block-space columns per scale row",
        ),
        ({"a_scales": lambda d: d["a_scales"][:, :8].contiguous()}, ValueError, r"a_scales must have shape"),
        ({"a_scales": lambda d: d["a_scales"][:0]}, ValueError, "a_scales must have at least one row"),
        ({"b_scales": lambda d: d["b_scales"][:-1]}, ValueError, r"b_scales must have shape"),
        ({"b_scales": lambda d: d["b_scales"].double()}, TypeError, "b_scales must have dtype"),
        ({"group_block_starts": lambda d: d["group_block_starts"].long()}, TypeError, "group_block_starts must"),
        ({"group_block_starts": lambda d: d["group_block_starts"][:1]}, ValueError, "one entry per group"),
        ({"out": lambda d: torch.zeros(2, 16, 24, dtype=torch.bfloat16)}, TypeError, "out must have dtype"),
    ],
)
def test_bad_input(overrides, error, match):
    with pytest.raises(error, match=match):
        grouped_mm_wgrad_blockwise(**_bad(**overrides))


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["skewed", "unaligned"])
def test_benchmark_shape(kind):
    m, n, k, groups = 32768, 2048, 7168, 8  # grad_W of the (32768, 2048, 7168, 8) forward
    sizes = group_sizes(m - 100, groups, kind)
    grad_out, x, offs, a_t, sa, b_t, sb, starts = make_inputs(m, n, k, sizes)
    out = grouped_mm_wgrad_blockwise(a_t, sa, b_t, sb, offs, starts)
    assert torch.equal(out, grouped_mm_wgrad_blockwise(a_t, sa, b_t, sb, offs, starts)), "not bitwise deterministic"
    # The first and last 256 rows and columns of each group's gradient (partial tiles at both ends).
    idx_n = torch.cat([torch.arange(256), torch.arange(n - 256, n)]).to(DEVICE)
    idx_k = torch.cat([torch.arange(256), torch.arange(k - 256, k)]).to(DEVICE)
    ref = ref_wgrad_blockwise(a_t[idx_n], sa[:, idx_n], b_t[idx_k], sb[:, idx_k], sizes)
    assert_close(out[:, idx_n][:, :, idx_k], ref)
    assert sqnr_db(out[:, idx_n][:, :, idx_k], ref_wgrad(grad_out.T[idx_n], x.T[idx_k], sizes)) >= 28
