"""Rowwise wgrad grouped GEMM (``grouped_mm_wgrad``): what is particular to it.

The behaviour every grouped GEMM shares (determinism, output dtypes, empty groups, bad offsets,
the common input checks) is tested once for all formats in ``test_grouped_gemm_shared.py``.
"""

from __future__ import annotations

import pytest
import torch

from kernels_helion import grouped_mm_wgrad, quantize_rowwise_cols_grouped
from tests.gemm_formats import BENCH_SHAPES, assert_close_out, group_sizes_of, make_rowwise_wgrad, ref_grouped_mm_wgrad
from tests.reference import ref_pad_token_columns
from tests.support import DEVICE, group_sizes, offsets_from_sizes

FP8 = torch.float8_e4m3fn
make_inputs = make_rowwise_wgrad


def assert_close_fp32(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # fp32 outputs: on the CPU the interpreter's dot is exact fp32 math; Hopper's FP8
    # tensor cores accumulate with ~14 bits of mantissa (DeepSeek-V3 report, sec. 3.3),
    # so on the GPU allow that relative to the largest output.
    scale = float(expected.abs().amax()) + 1e-6
    if expected.is_cuda:
        torch.testing.assert_close(actual, expected, rtol=2e-3, atol=1e-3 * scale)
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=2e-5 * scale)


@pytest.mark.parametrize("kind", ["uniform", "skewed", "empty", "one", "unaligned"])
@pytest.mark.parametrize("m, n, k, g", [(150, 48, 64, 4), (97, 40, 24, 3)])
def test_matches_reference(kind, m, n, k, g):
    offs = offsets_from_sizes(group_sizes(m - 7, g, kind))  # tokens past offs[-1] are ignored
    a_t, sa, b_t, sb = make_inputs(m, n, k, g)
    out = grouped_mm_wgrad(a_t, sa, b_t, sb, offs)
    assert out.dtype == torch.bfloat16 and out.shape == (g, n, k)
    assert_close_out(out, ref_grouped_mm_wgrad(a_t, sa, b_t, sb, offs))


@pytest.mark.parametrize("alignment", [16, 32, 128])
def test_padded_token_layout(alignment):
    # Operands in the padded layout: 32 and 128 are multiples of the CPU token tile
    # (the unmasked whole-tile loop), 16 is not (the masked loop at padded columns).
    sizes = [0, 1, 45, alignment, 70, 0]
    m = sum(sizes) + 9
    offs = offsets_from_sizes(sizes)
    a_t, sa, b_t, sb = make_inputs(m, 48, 40, len(sizes))
    a_pad, b_pad = ref_pad_token_columns(a_t, offs, alignment), ref_pad_token_columns(b_t, offs, alignment)
    out = grouped_mm_wgrad(a_pad, sa, b_pad, sb, offs, group_alignment=alignment)
    assert_close_out(out, ref_grouped_mm_wgrad(a_t, sa, b_t, sb, offs))
    assert (out[[0, 5]] == 0).all()


def test_padded_layout_from_the_quantizer_accumulates():
    # The recipe's path: both operands quantized into the padded layout, fp32 accumulation.
    sizes = [30, 0, 129, 1]
    m, n, k = sum(sizes), 24, 40
    offs = offsets_from_sizes(sizes)
    grad_out, x = torch.randn(m, n, device=DEVICE), torch.randn(m, k, device=DEVICE)
    got, gs = quantize_rowwise_cols_grouped(grad_out, offs, group_alignment=128)
    xt, xs = quantize_rowwise_cols_grouped(x, offs, group_alignment=128)
    plain_got, _ = quantize_rowwise_cols_grouped(grad_out, offs)
    plain_xt, _ = quantize_rowwise_cols_grouped(x, offs)
    out = torch.randn(len(sizes), n, k, device=DEVICE)
    expected = out + ref_grouped_mm_wgrad(plain_got, gs, plain_xt, xs, offs)
    grouped_mm_wgrad(got, gs, xt, xs, offs, out=out, group_alignment=128)
    assert_close_fp32(out, expected)


def test_empty_group_is_exactly_zero_even_with_inf_scales():
    offs = offsets_from_sizes([20, 0, 30])
    a_t, sa, b_t, sb = make_inputs(60, 32, 16, 3)
    sa[1] = float("inf")
    out = grouped_mm_wgrad(a_t, sa, b_t, sb, offs, out_dtype=torch.float32)
    assert (out[1] == 0).all()
    assert_close_fp32(out[[0, 2]], ref_grouped_mm_wgrad(a_t, sa, b_t, sb, offs)[[0, 2]])


def test_accumulates_into_fp32_out():
    offs = offsets_from_sizes([40, 0, 1, 50])
    a_t, sa, b_t, sb = make_inputs(100, 32, 48, 4)
    out = torch.randn(4, 32, 48, device=DEVICE) * 100
    before = out.clone()
    result = grouped_mm_wgrad(a_t, sa, b_t, sb, offs, out=out)
    assert result is out
    expected = before + ref_grouped_mm_wgrad(a_t, sa, b_t, sb, offs)
    assert_close_fp32(out, expected)
    assert torch.equal(out[1], before[1]), "an empty group leaves the accumulator unchanged"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_accumulates_into_16_bit_out_rounding_once(dtype):
    # A weight's .grad in its own dtype: the fp32 sum of the old gradient and the fp32
    # result, rounded once (bitwise), where autograd's add would round twice.
    offs = offsets_from_sizes([40, 0, 1, 50])
    a_t, sa, b_t, sb = make_inputs(100, 32, 48, 4)
    out = (torch.randn(4, 32, 48, device=DEVICE) * 10).to(dtype)
    before = out.clone()
    fresh = grouped_mm_wgrad(a_t, sa, b_t, sb, offs, out_dtype=torch.float32)
    result = grouped_mm_wgrad(a_t, sa, b_t, sb, offs, out=out)
    assert result is out and out.dtype == dtype
    total = before.float() + fresh
    if DEVICE.type == "cpu" and dtype == torch.bfloat16:
        # Triton's CPU interpreter casts fp32 to bf16 by truncation (the GPU rounds to nearest).
        expected = (total.view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)
    else:
        expected = total.to(dtype)
    assert torch.equal(out, expected)
    assert torch.equal(out[1], before[1])


@pytest.mark.parametrize("alignment", [16, 32])
@pytest.mark.parametrize("bad", [[-5, 30, 50, 20], [10, 40, 1000, 2000]], ids=["negative-and-decreasing", "past-the-end"])
def test_bad_offsets_in_the_padded_layout(alignment, bad):
    """Bad offsets with padded-layout operands give the groups of their clamped, non-decreasing ends, as in the
    plain layout (test_grouped_gemm_shared.py), every access inside the padded width."""
    tokens = 72
    bad = torch.tensor(bad, dtype=torch.int32, device=DEVICE)
    offs = offsets_from_sizes(group_sizes_of(bad, tokens))
    a_t, sa, b_t, sb = make_inputs(tokens, 16, 24, 4)
    a_pad, b_pad = ref_pad_token_columns(a_t, offs, alignment), ref_pad_token_columns(b_t, offs, alignment)
    out = grouped_mm_wgrad(a_pad, sa, b_pad, sb, bad, out_dtype=torch.float32, group_alignment=alignment)
    # Up to fp32 rounding: a group that ends past the tokens reads its span's zero padding in other tiles.
    assert_close_fp32(out, ref_grouped_mm_wgrad(a_t, sa, b_t, sb, offs))


def test_overlapping_groups():
    """Offsets that fall and rise again: each group contracts its own clamped tokens, ``[-5, 1000, 10, 70]`` over
    64 tokens the groups ``[0, 0)``, ``[0, 64)``, ``[64, 64)`` and ``[10, 64)``."""
    a_t, sa, b_t, sb = make_inputs(64, 16, 24, 4)
    out = grouped_mm_wgrad(a_t, sa, b_t, sb, torch.tensor([-5, 1000, 10, 70], dtype=torch.int32, device=DEVICE),
                           out_dtype=torch.float32)
    spans = [(0, 0), (0, 64), (64, 64), (10, 64)]
    for g, (start, end) in enumerate(spans):
        # Group g alone over [start, end): the groups before it end at start, those after it at end.
        offs = torch.tensor([start] * g + [end] * (4 - g), dtype=torch.int32, device=DEVICE)
        assert_close_fp32(out[g], ref_grouped_mm_wgrad(a_t, sa, b_t, sb, offs)[g])


def _bad(**overrides):
    a_t, sa, b_t, sb = make_inputs(32, 16, 16, 2)
    args = dict(a_t=a_t, a_scales=sa, b_t=b_t, b_scales=sb, offs=offsets_from_sizes([16, 32]))
    args.update({k: v(args) for k, v in overrides.items()})
    return args


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        ({"a_scales": lambda d: d["a_scales"][0]}, ValueError, "a_scales must be 2-D"),
        ({"b_scales": lambda d: d["b_scales"][:, :-1].contiguous()}, ValueError, r"b_scales must have shape \(2, 16\)"),
        ({"out": lambda d: torch.zeros(2, 16, 16, device=DEVICE).transpose(1, 2)}, ValueError, "out must be contiguous"),
        ({"group_alignment": lambda d: 0}, ValueError, "group_alignment must be an int >= 1"),
        ({"group_alignment": lambda d: 64}, ValueError, r"token columns \(32\) must be a multiple"),
    ],
)
def test_bad_input(overrides, error, match):
    with pytest.raises(error, match=match):
        grouped_mm_wgrad(**_bad(**overrides))


@pytest.mark.cuda
@pytest.mark.parametrize("m, n, k, g", BENCH_SHAPES)
@pytest.mark.parametrize("kind", ["skewed", "unaligned"])
@pytest.mark.parametrize("alignment", [1, 128])
def test_benchmark_shapes(m, n, k, g, kind, alignment):
    offs = offsets_from_sizes(group_sizes(m - 100, g, kind))
    a_t, sa, b_t, sb = make_inputs(m, n, k, g)
    if alignment > 1:
        a_in, b_in = ref_pad_token_columns(a_t, offs, alignment), ref_pad_token_columns(b_t, offs, alignment)
    else:
        a_in, b_in = a_t, b_t
    out = grouped_mm_wgrad(a_in, sa, b_in, sb, offs, group_alignment=alignment)
    assert torch.equal(out, grouped_mm_wgrad(a_in, sa, b_in, sb, offs, group_alignment=alignment)), (
        "not bitwise deterministic"
    )
    start = 0
    for i, end in enumerate(offs.tolist()):
        tokens = slice(start, end)
        rows = slice(0, 256)  # a block of (N, K) per group keeps the reference small
        ref = (a_t[rows, tokens].float() * sa[i, rows, None]) @ (b_t[rows, tokens].float() * sb[i, rows, None]).T
        assert_close_out(out[i, rows, rows], ref)
        start = end


@pytest.mark.parametrize("whole_tiles", [True, False])
def test_tma_store_config_marks_only_the_output_store(whole_tiles):
    # The TMA-store epilogue's indexing list: one slot per load/store of this specialization,
    # the store to ``out`` through a descriptor, every load through pointers.
    import helion

    from kernels_helion._launch import with_tma
    from kernels_helion.grouped_gemm_wgrad import grouped_mm_wgrad_kernel

    m, n, k, block_t = 256, 32, 48, 32
    a_t = torch.zeros(n, m, dtype=FP8)
    b_t = torch.zeros(k, m, dtype=FP8)
    args = (
        a_t, a_t.as_strided((n, m // block_t, block_t), (m, block_t, 1)), torch.ones(3, n),
        b_t, b_t.as_strided((k, m // block_t, block_t), (m, block_t, 1)), torch.ones(3, k),
        offsets_from_sizes([64, 64, 64], device="cpu"), torch.zeros(3, n, k, dtype=torch.bfloat16),
        False, block_t, 4, block_t if whole_tiles else 1, whole_tiles, True, 0, a_t, False,
    )
    config = helion.Config(block_sizes=[16, 16], num_warps=4, num_stages=1)
    tma = with_tma(grouped_mm_wgrad_kernel, args, config, stores=("out",))
    indexing = tma.config["indexing"]
    assert indexing.count("tensor_descriptor") == 1 and indexing[-1] == "tensor_descriptor"
    assert len(indexing) == (7 if whole_tiles else 10)  # the plain layout also loads the group's edge tiles
    assert with_tma(grouped_mm_wgrad_kernel, args, config, stores=("out",)) is tma  # made once
    assert with_tma(grouped_mm_wgrad_kernel, args, tma, stores=("out",)) is tma  # a chosen indexing is kept


def test_an_accumulated_gradient_is_prefetched_into_l2():
    # prefetch_out (the gradient's element size; 0 for none) adds one L2 prefetch per 128-byte line of
    # the gradient's tile before the contraction, and only when the kernel adds into a gradient on a GPU.
    import helion

    from kernels_helion.grouped_gemm_wgrad import grouped_mm_wgrad_kernel
    from kernels_helion.l2_prefetch import gradient_prefetch

    m, n, k, block_t = 256, 32, 48, 32
    a_t = torch.zeros(n, m, dtype=FP8)
    b_t = torch.zeros(k, m, dtype=FP8)
    out = torch.zeros(3, n, k, dtype=torch.bfloat16)
    config = helion.Config(block_sizes=[16, 16], num_warps=4, num_stages=1)

    def code(prefetch_out: int) -> str:
        args = (
            a_t, a_t.as_strided((n, m // block_t, block_t), (m, block_t, 1)), torch.ones(3, n),
            b_t, b_t.as_strided((k, m // block_t, block_t), (m, block_t, 1)), torch.ones(3, k),
            offsets_from_sizes([64, 64, 64], device="cpu"), out, True, block_t, 4, block_t, True, True, prefetch_out,
            a_t, False,
        )
        return grouped_mm_wgrad_kernel.bind(args).to_triton_code(config)

    assert "prefetch.global.L2" in code(2) and "prefetch.global.L2" not in code(0)
    assert "// 64) * 64" in code(2) and "// 32) * 32" in code(4)  # one address per line of 128 bytes
    assert gradient_prefetch(out, True, cpu=False) == 2
    assert gradient_prefetch(out.half(), True, cpu=False) == 2
    assert gradient_prefetch(out.float(), True, cpu=False) == 0  # an fp32 main_grad gained nothing
    assert gradient_prefetch(out, False, cpu=False) == 0 and gradient_prefetch(out, True, cpu=True) == 0


def test_a_rocm_build_issues_no_ptx_prefetch(monkeypatch):
    from kernels_helion.l2_prefetch import gradient_prefetch

    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert gradient_prefetch(torch.zeros(1, dtype=torch.bfloat16), True, cpu=False) == 0


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefetched_gradient_is_bitwise_the_unprefetched_one(dtype, monkeypatch):
    # Tail tiles on both N and K (prefetch addresses clamped into the gradient), empty and one-token groups.
    from kernels_helion import l2_prefetch

    offs = offsets_from_sizes([300, 0, 1, 700, 23], device=DEVICE)
    a_t, sa, b_t, sb = make_inputs(1100, 200, 300, 5)
    before = (torch.randn(5, 200, 300, device=DEVICE) * 10).to(dtype)
    grads = {}
    for on in (True, False):
        monkeypatch.setattr(l2_prefetch, "PREFETCH_GRADIENT", on)
        grads[on] = grouped_mm_wgrad(a_t, sa, b_t, sb, offs, out=before.clone())
    assert torch.equal(grads[True], grads[False])
    assert torch.equal(grads[True][1], before[1])
    assert not torch.equal(grads[True][0], before[0])


def test_adding_into_a_16_bit_gradient_takes_its_own_tuned_entries(monkeypatch):
    # Entries keyed ACC: 1 were tuned adding into a bf16 gradient; without them the new-dW entries serve.
    import helion

    import autotune_cache
    from kernels_helion.grouped_gemm_wgrad import _select_config

    fresh = helion.Config(block_sizes=[256, 128], num_warps=8)
    adding = helion.Config(block_sizes=[128, 128], num_warps=4)
    key = {"M": 1024, "N": 64, "K": 64, "G": 2}
    entries = [(key, fresh, "test")]
    monkeypatch.setattr(autotune_cache, "current_arch", lambda: "sm90")
    monkeypatch.setattr(autotune_cache, "load_entries", lambda arch, name: tuple(entries))
    grad, main_grad = torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1)
    assert _select_config(key, grad, True, False) == fresh
    entries.append(({**key, "ACC": 1}, adding, "test"))
    assert _select_config(key, grad, True, False) == adding
    assert _select_config(key, grad.half(), True, False) == adding
    assert _select_config(key, grad, False, False) == fresh  # a new dW
    assert _select_config(key, main_grad, True, False) == fresh  # an fp32 main_grad: the new-dW entries


def ref_group_token_spans(offs: list[int], tokens: int, alignment: int, padded_tokens: int) -> list[list[int]]:
    """``group_token_span``'s documented values per group, in Python: ``[starts, ends, padded starts, padded ends]``."""
    rows: list[list[int]] = [[], [], [], []]
    padded = 0
    for g, raw in enumerate(offs):
        start = min(max(offs[g - 1], 0), tokens) if g else 0
        end = max(min(max(raw, 0), tokens), start)
        size = -(-(end - start) // alignment) * alignment
        padded_start = min(padded, padded_tokens) if alignment > 1 else start
        padded_end = min(padded_start + size, padded_tokens) if alignment > 1 else end
        padded += size
        for row, value in zip(rows, (start, end, padded_start, padded_end)):
            row.append(value)
    return rows


@pytest.mark.parametrize("alignment", [1, 32, 128])
@pytest.mark.parametrize(
    "offs",
    [[0, 1, 45, 45, 300, 301], [-5, 1000, 10, 70], [10, 40, 1000, 2000], [-5, 30, 50, 20], [7]],
    ids=["empty-and-one", "overlapping", "past-the-end", "negative-and-decreasing", "one-group"],
)
def test_group_token_spans_table(offs, alignment):
    # The table the wgrad reads instead of finding each group's span from offs in every program:
    # group_token_span's values for every group, bad offsets included, in one launch.
    from kernels_helion.token_groups import group_token_spans, padded_token_count

    tokens = 320
    padded_tokens = padded_token_count(tokens, len(offs), alignment)
    spans = group_token_spans(torch.tensor(offs, dtype=torch.int32, device=DEVICE), tokens, alignment, padded_tokens)
    assert spans.dtype == torch.int32 and spans.shape == (4, len(offs))
    assert spans.cpu().tolist() == ref_group_token_spans(offs, tokens, alignment, padded_tokens)


@pytest.mark.parametrize(
    "offs", [[0, 1, 45, 45, 170], [-5, 1000, 10, 70], [10, 40, 1000, 2000]], ids=["empty-and-one", "overlapping", "past-the-end"]
)
def test_span_table_gives_the_bits_of_spans_from_offs(offs, monkeypatch):
    # The padded layout's whole-tile path (alignment a multiple of the token tile), with and without the
    # table, into a fresh dW and added into a gradient: the same bits, bad offsets included.
    from kernels_helion import token_groups

    alignment, tokens = 32, 170
    offs = torch.tensor(offs, dtype=torch.int32, device=DEVICE)
    plain = offsets_from_sizes(group_sizes_of(offs, tokens))
    a_t, sa, b_t, sb = make_inputs(tokens, 24, 40, offs.numel())
    a_pad, b_pad = ref_pad_token_columns(a_t, plain, alignment), ref_pad_token_columns(b_t, plain, alignment)
    before = torch.randn(offs.numel(), 24, 40, device=DEVICE).to(torch.bfloat16)
    results = {}
    for table in (True, False):
        monkeypatch.setattr(token_groups, "SPAN_TABLE", table)
        fresh = grouped_mm_wgrad(a_pad, sa, b_pad, sb, offs, group_alignment=alignment)
        added = grouped_mm_wgrad(a_pad, sa, b_pad, sb, offs, out=before.clone(), group_alignment=alignment)
        results[table] = (fresh, added)
    assert all(torch.equal(x, y) for x, y in zip(results[True], results[False]))
    assert_close_out(results[True][0], ref_grouped_mm_wgrad(a_t, sa, b_t, sb, plain))
