"""Rowwise 2D x 3D grouped GEMM (``grouped_mm_2d3d``): what is particular to it.

The behaviour every grouped GEMM shares (determinism, output dtypes, empty groups, bad offsets,
the common input checks) is tested once for all formats in ``test_grouped_gemm_shared.py``.
"""

from __future__ import annotations

import pytest
import torch

from kernels_helion import grouped_mm_2d3d
from tests.gemm_formats import BENCH_SHAPES, assert_close_out, make_rowwise_2d3d, ref_grouped_mm_2d3d
from tests.support import DEVICE, group_sizes, misaligned_copy, offsets_from_sizes, poison_torch_empty

FP8 = torch.float8_e4m3fn
make_inputs = make_rowwise_2d3d


@pytest.mark.parametrize("kind", ["uniform", "skewed", "empty", "one", "unaligned"])
@pytest.mark.parametrize("m, n, k, e", [(150, 48, 64, 4), (97, 40, 96, 3)])
def test_matches_reference(monkeypatch, kind, m, n, k, e):
    sizes = group_sizes(m - 7, e, kind)  # the last 7+ rows are past offs[-1]
    offs = offsets_from_sizes(sizes)
    a, sa, b, sb = make_inputs(m, n, k, e)
    poison_torch_empty(monkeypatch)  # a row no work item writes shows as NaN
    out = grouped_mm_2d3d(a, sa, b, sb, offs)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    ref = ref_grouped_mm_2d3d(a, sa, b, sb, offs)
    assert_close_out(out, ref)
    assert (out[sum(sizes):] == 0).all(), "rows past offs[-1] must be 0"


@pytest.mark.parametrize(
    "sizes, unrouted",
    [
        ([17] * 5, 1),  # every group one row past a tile: the item bound is reached exactly
        ([1, 1, 1, 15, 0, 33, 2, 16], 9),  # boundaries anywhere inside row tiles, an empty group
        ([0, 0, 40], 0),  # leading empty groups, every row routed
    ],
)
def test_work_items_cover_every_row(monkeypatch, sizes, unrouted):
    # Row tiles are cut from each group's start (work_item_rows): any row written
    # twice or never would differ from the reference or stay NaN.
    offs = offsets_from_sizes(sizes)
    m = sum(sizes) + unrouted
    a, sa, b, sb = make_inputs(m, 24, 64, len(sizes))
    poison_torch_empty(monkeypatch)
    out = grouped_mm_2d3d(a, sa, b, sb, offs)
    assert_close_out(out, ref_grouped_mm_2d3d(a, sa, b, sb, offs))
    assert (out[sum(sizes):] == 0).all()


def ref_work_items(offs: list[int], m: int, block_m: int) -> list[list[int]]:
    """``work_item_rows``' documented items in Python: ``[groups, first rows, end rows]`` of every row item."""
    spans, start = [], 0
    for raw in offs:
        end = max(min(max(raw, 0), m), start)
        spans.append((start, end))
        start = min(max(raw, 0), m)
    spans.append((max(end for _, end in spans), m))  # the rows past every group's end
    rows: list[list[int]] = [[], [], []]
    for g, (start, end) in enumerate(spans):
        for row in range(start, end, block_m):
            for out, value in zip(rows, (g, row, min(row + block_m, end))):
                out.append(value)
    items = (m + (len(offs) + 1) * (block_m - 1)) // block_m
    return [r + [None] * (items - len(r)) for r in rows]


@pytest.mark.parametrize(
    "offs", [[17, 34, 51], [0, 1, 2, 18, 18, 51, 53, 69], [0, 0, 40], [-5, 1000, 10, 70], [10, 200, 30]],
    ids=["one-past-a-tile", "anywhere", "leading-empty", "overlapping", "falling"],
)
def test_work_item_table(offs):
    # The table the 2D x 3D GEMMs read instead of finding each item from offs in every program: the items
    # work_item_rows finds (one per row tile cut from each group's start, then the rows past the groups),
    # and items past the last one empty.
    from kernels_helion.grouped_gemm import work_item_table

    m, block_m = 80, 16
    table = work_item_table(torch.tensor(offs, dtype=torch.int32, device=DEVICE), m, block_m).cpu().tolist()
    expected = ref_work_items(offs, m, block_m)
    used = sum(v is not None for v in expected[0])
    assert [r[:used] for r in table] == [r[:used] for r in expected]
    assert all(end <= begin for begin, end in zip(table[1][used:], table[2][used:]))  # empty items


@pytest.mark.parametrize("offs", [[17, 34, 51], [0, 1, 2, 18, 18, 51, 53, 69], [-5, 1000, 10, 70]])
@pytest.mark.parametrize("gathered", [False, True])
def test_work_item_table_gives_the_bits_of_items_from_offs(offs, gathered, monkeypatch):
    from kernels_helion import grouped_gemm

    m, n, k = 80, 24, 64
    offs = torch.tensor(offs, dtype=torch.int32, device=DEVICE)
    a, sa, b, sb = make_inputs(m, n, k, offs.numel())
    rows = torch.randint(0, m, (m,), dtype=torch.int32, device=DEVICE) if gathered else None
    results = {}
    for table in (True, False):
        monkeypatch.setattr(grouped_gemm, "WORK_ITEM_TABLE", table)
        results[table] = grouped_mm_2d3d(a, sa, b, sb, offs, rows=rows)
    assert torch.equal(results[True], results[False])


@pytest.mark.parametrize("kind", ["uniform", "empty", "one", "unaligned"])
def test_rows_read_by_index_match_the_gathered_operand(monkeypatch, kind):
    """``rows``: each output row reads its token's row of ``a`` (and scale) by index, bitwise the GEMM on
    ``a[rows]`` gathered first: tokens read by several rows, rows past ``offs[-1]``, indices out of range
    (clamped into ``[0, T)``), a token's NaN scale reaching only the rows that read it."""
    tokens, n, k, e = 37, 40, 96, 4
    pairs = 3 * tokens - 2
    sizes = group_sizes(pairs - 5, e, kind)
    offs = offsets_from_sizes(sizes)
    a, sa, b, sb = make_inputs(tokens, n, k, e)
    sa[5] = float("nan")  # (the interpreter reads FP8 NaN bytes as finite: the scale carries it)
    gen = torch.Generator().manual_seed(1)
    rows = torch.randint(0, tokens, (pairs,), generator=gen, dtype=torch.int32).to(a.device)
    rows[0], rows[1] = -3, tokens + 4  # clamped: token 0 and token T - 1
    rows[sum(sizes) // 2] = 5
    poison_torch_empty(monkeypatch)
    out = grouped_mm_2d3d(a, sa, b, sb, offs, rows=rows)
    clamped = rows.long().clamp(0, tokens - 1)
    ref = grouped_mm_2d3d(a[clamped].contiguous(), sa[clamped].contiguous(), b, sb, offs)
    assert out.shape == (pairs, n)
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.nan_to_num(), ref.nan_to_num())
    nan_rows = out.isnan().any(dim=1)
    assert torch.equal(nan_rows, (clamped == 5) & (torch.arange(pairs, device=a.device) < sum(sizes)))
    finite = ~nan_rows
    assert_close_out(out[finite], ref_grouped_mm_2d3d(a[clamped], sa[clamped], b, sb, offs)[finite])
    assert (out[sum(sizes):] == 0).all()


def test_rows_read_by_index_bad_input():
    a, sa, b, sb = make_inputs(8, 16, 32, 2)
    offs = offsets_from_sizes([6, 6])
    with pytest.raises(TypeError, match="rows must have dtype"):
        grouped_mm_2d3d(a, sa, b, sb, offs, rows=torch.zeros(12, device=a.device))
    with pytest.raises(ValueError, match="rows must be 1-D"):
        grouped_mm_2d3d(a, sa, b, sb, offs, rows=torch.zeros(12, 1, dtype=torch.int32, device=a.device))
    with pytest.raises(ValueError, match="a holds none"):
        grouped_mm_2d3d(a[:0], sa[:0], b, sb, offs, rows=torch.zeros(12, dtype=torch.int32, device=a.device))
    rows = torch.zeros(0, dtype=torch.int32, device=a.device)
    assert grouped_mm_2d3d(a, sa, b, sb, offs, rows=rows).shape == (0, 16)


def test_misaligned_operands():
    # Data off a 16-byte boundary cannot go through TMA descriptors (on the GPU a descriptor
    # over it faults and poisons the CUDA context): such operands take pointer loads.
    offs = offsets_from_sizes(group_sizes(120, 3, "unaligned"))
    a, sa, b, sb = make_inputs(130, 48, 96, 3)
    aligned = grouped_mm_2d3d(a, sa, b, sb, offs)
    misaligned = grouped_mm_2d3d(misaligned_copy(a), misaligned_copy(sa), b, misaligned_copy(sb), offs)
    assert torch.equal(aligned, misaligned)
    assert_close_out(misaligned, ref_grouped_mm_2d3d(a, sa, b, sb, offs))


def test_unaddressable_tensors_take_pointer_indexing():
    import helion

    from kernels_helion._launch import _tma_addressable_config

    n, k, rows = 32, 48, 4
    a_blocks = torch.zeros(n, rows, 128, dtype=FP8)
    a_scales, b_scales = torch.ones(rows, n), torch.ones(rows, k)
    config = helion.Config(block_sizes=[16, 16], num_warps=4, indexing="tensor_descriptor")
    assert _tma_addressable_config(config, (a_blocks, a_scales, b_scales, 2, True)) is config
    # A misaligned tensor, or one with a 200-byte row stride: every load and store through pointers
    # (Helion's list of memory ops does not follow the order its code takes indexing slots in).
    for bad in (misaligned_copy(a_scales), torch.ones(rows, 50)[:, :k]):
        safe = _tma_addressable_config(config, (a_blocks, a_scales, bad, 2, True))
        assert safe.config["indexing"] == "pointer"
        assert {key: v for key, v in safe.config.items() if key != "indexing"} == {
            key: v for key, v in config.config.items() if key != "indexing"
        }
    pointer_config = helion.Config(block_sizes=[16, 16], num_warps=4, indexing="pointer")
    assert _tma_addressable_config(pointer_config, (misaligned_copy(a_scales),)) is pointer_config


def _tma_codegen_kernel(fn, monkeypatch):
    """A fresh Helion kernel of ``fn`` whose generated code uses TMA descriptors where asked, on the CPU.

    The code generator emits descriptors only where the GPU has them; a fresh kernel object keeps
    its bound kernels away from the cached ones the CPU tests run.
    """
    import helion
    import helion._compat

    monkeypatch.setattr(helion._compat, "_supports_tensor_descriptor", lambda: True)
    return helion.kernel(static_shapes=False)(fn)


def _descriptors(code: str) -> set[str]:
    """Names of the tensors that generated Triton code reads or writes through TMA descriptors."""
    import re

    return {name for name, _ in re.findall(r"(\w+)_desc\.(load|store)", code)}


def _rowwise_2d3d_args() -> tuple[object, ...]:
    fp8 = torch.float8_e4m3fn
    return (torch.zeros(256, 128, dtype=fp8), torch.ones(256), torch.zeros(2, 256, 128, dtype=fp8),
            torch.ones(2, 256), torch.tensor([100, 256], dtype=torch.int32),
            torch.empty(256, 256, dtype=torch.bfloat16), torch.zeros(256, 128, dtype=fp8),
            torch.zeros(2, 256, 128, dtype=fp8), torch.tensor([100, 256], dtype=torch.int32), 2, 64, False,
            "rowwise", False, False, torch.tensor([100, 256], dtype=torch.int32), False)


@pytest.mark.parametrize("which", ["grouped_mm_2d3d", "grouped_mm_wgrad_blockwise"])
def test_indexing_slots_follow_the_generated_code(which, monkeypatch):
    """Setting one ``indexing`` slot to TMA gives a descriptor for that slot's tensor, in the code Helion generates.

    Helion's own list (``memory_op_facts``) puts these kernels' K-loop loads first; the
    generated code takes slots in emission order, which ``indexing_slots`` follows.
    """
    import helion

    from kernels_helion import grouped_gemm, grouped_gemm_wgrad_blockwise
    from kernels_helion._launch import indexing_slots

    if which == "grouped_mm_2d3d":
        fn, args = grouped_gemm.grouped_mm_2d3d_kernel.fn, _rowwise_2d3d_args()
    else:
        fp8 = torch.float8_e4m3fn
        fn = grouped_gemm_wgrad_blockwise.grouped_mm_wgrad_blockwise_kernel.fn
        args = (torch.zeros(64, 4, 128, dtype=fp8), torch.ones(4, 64), torch.zeros(64, 4, 128, dtype=fp8),
                torch.ones(4, 64), torch.tensor([256, 512], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32),
                torch.zeros(2, 64, 64, dtype=torch.bfloat16), False, 2, False)
    bound = _tma_codegen_kernel(fn, monkeypatch).bind(args)
    slots = indexing_slots(bound)
    assert slots is not None and len(slots) == len(bound.config_spec.memory_op_facts)
    described = set()
    for i, op in enumerate(slots):
        indexing = ["pointer"] * len(slots)
        indexing[i] = "tensor_descriptor"
        code = bound.to_triton_code(helion.Config(block_sizes=[64, 64], num_warps=4, num_stages=1, indexing=indexing))
        descriptors = _descriptors(code)
        assert descriptors <= {op.tensor_name}, (i, op.tensor_name, descriptors)
        described |= descriptors
    # Each access that can go through TMA was found at its slot. Helion 1.5 gives the 2D x 3D GEMM's
    # token-tile accesses (a, out) no descriptor: their tile loop ends short of the tensor's
    # dimension (the group's rows), so only the weight and its scales take TMA there.
    if which == "grouped_mm_2d3d":
        assert described == {"b", "b_scales"}
    else:
        assert {"out"} < described


def test_rowwise_weight_scales_load_through_pointers(monkeypatch):
    """The launcher's config reads the weight's scales through pointers and keeps TMA for the rest."""
    import helion

    from kernels_helion import grouped_gemm
    from kernels_helion._launch import with_tma

    kernel = _tma_codegen_kernel(grouped_gemm.grouped_mm_2d3d_kernel.fn, monkeypatch)
    args = _rowwise_2d3d_args()
    config = helion.Config(block_sizes=[64, 64], num_warps=4, num_stages=1, indexing="tensor_descriptor")
    mixed = with_tma(kernel, args, config, pointer_loads=("b_scales",))
    assert with_tma(kernel, args, config, pointer_loads=("b_scales",)) is mixed
    assert mixed.config["indexing"].count("pointer") == 1
    code = kernel.bind(args).to_triton_code(mixed)
    assert _descriptors(code) == {"b"}  # a and out: pointers (see test_indexing_slots_follow_the_generated_code)
    # The scales are read before the K loop.
    assert code.index("b_scales +") < code.index("b_desc.load")


def _bad(**overrides):
    a, sa, b, sb = make_inputs(32, 16, 32, 2)
    args = dict(a=a, a_scales=sa, b=b, b_scales=sb, offs=offsets_from_sizes([16, 32]))
    args.update({k: v(args) for k, v in overrides.items()})
    return args


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        ({"a": lambda d: d["a"][:, :16].contiguous()}, ValueError, "K = a.shape"),
        ({"b": lambda d: d["b"].transpose(1, 2)}, ValueError, "b must be contiguous"),
        ({"a_scales": lambda d: d["a_scales"][:-1]}, ValueError, r"a_scales must have shape \(32,\)"),
        ({"a_scales": lambda d: d["a_scales"].double()}, TypeError, "a_scales must have dtype"),
        ({"b_scales": lambda d: d["b_scales"][0]}, ValueError, "b_scales must be 2-D"),
    ],
)
def test_bad_input(overrides, error, match):
    with pytest.raises(error, match=match):
        grouped_mm_2d3d(**_bad(**overrides))


def test_fnuz_needs_rocm():
    if torch.version.hip is not None:
        pytest.skip("ROCm supports e4m3fnuz")
    args = _bad(a=lambda d: d["a"].float().to(torch.float8_e4m3fnuz), b=lambda d: d["b"].float().to(torch.float8_e4m3fnuz))
    with pytest.raises(TypeError, match="ROCm"):
        grouped_mm_2d3d(**args)


@pytest.mark.cuda
@pytest.mark.parametrize("m, n, k, e", BENCH_SHAPES)
@pytest.mark.parametrize("kind", ["skewed", "unaligned"])
def test_benchmark_shapes(m, n, k, e, kind):
    sizes = group_sizes(m - 100, e, kind)
    offs = offsets_from_sizes(sizes)
    a, sa, b, sb = make_inputs(m, n, k, e)
    out = grouped_mm_2d3d(a, sa, b, sb, offs)
    assert torch.equal(out, grouped_mm_2d3d(a, sa, b, sb, offs)), "not bitwise deterministic"
    start = 0
    for g, end in enumerate(offs.tolist()):
        # First and last 200 rows of each group (covers partial tiles at both ends).
        for rows in () if end == start else (slice(start, min(start + 200, end)), slice(max(end - 200, start), end)):
            ref = (a[rows].float() * sa[rows, None]) @ (b[g].float() * sb[g][:, None]).T
            assert_close_out(out[rows], ref)
        start = end
    assert (out[start:] == 0).all()
