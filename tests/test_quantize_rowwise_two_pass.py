from __future__ import annotations

import contextlib
from collections.abc import Iterator

import helion
import pytest
import torch

import ops
from autotune_cache import forced_config
from kernels_helion import (
    FP8_DTYPES,
    moe_combine_grad_rows,
    quantize_rowwise_cols_grouped,
    quantize_rowwise_rows_and_cols_grouped,
)
from tests.reference import ref_pad_token_columns, ref_quantize_rowwise_cols_grouped, ref_quantize_rowwise
from tests.reference_grouped_linear import group_bounds
from tests.support import DEVICE, assert_fp8_equal, group_sizes, offsets_from_sizes, poison_torch_empty

# Token tiles of 16 for both passes, so that alignments of 16 and 32 run too; the amax pass's
# programs walk spans of two column tiles (and a partial last span where K is not a multiple).
SMALL_TILES = helion.Config(block_sizes=[16, 16], num_warps=4, num_stages=1)
SMALL_AMAX_TILES = helion.Config(block_sizes=[16, 32, 16], num_warps=4, num_stages=1)


def _tokens(m: int, k: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    # Per-token and per-column magnitudes differ, so every scale is distinct.
    mag = torch.rand(m, 1, device=DEVICE) * torch.rand(1, k, device=DEVICE) * 30
    return (torch.randn(m, k, device=DEVICE) * mag).to(dtype)


def _run(
    x, offs, float8_dtype=torch.float8_e4m3fn, pow2=False, alignment=128, small_tiles=False, row_multipliers=None,
    token_multipliers=None, pair_tokens=None, pair_weights=None,
):
    args = (x, offs, float8_dtype, pow2, alignment, row_multipliers, token_multipliers, pair_tokens, pair_weights)
    with _tiles(small_tiles or alignment % 128 != 0):
        return quantize_rowwise_rows_and_cols_grouped(*args)


@contextlib.contextmanager
def _tiles(small: bool) -> Iterator[None]:
    """Both passes on ``SMALL_AMAX_TILES`` / ``SMALL_TILES`` if ``small``, else on their selected configs."""
    if not small:
        yield
        return
    with forced_config("quantize_rowwise_rows_and_cols_grouped_amax", SMALL_AMAX_TILES), forced_config("quantize_rowwise_rows_and_cols_grouped_cast", SMALL_TILES):
        yield


def _per_token(row_multipliers: torch.Tensor, offs: torch.Tensor, m: int) -> torch.Tensor:
    """``(M, K)``: each token's group's row of ``row_multipliers``; 1 past ``offs[-1]`` (host-side reference)."""
    per_token = torch.ones(m, row_multipliers.shape[1], device=row_multipliers.device)
    for g, (start, end) in enumerate(group_bounds(offs)):
        per_token[start:end] = row_multipliers[g]
    return per_token


def _check(
    x, offs, float8_dtype=torch.float8_e4m3fn, pow2=False, alignment=128, small_tiles=False, row_multipliers=None,
    token_multipliers=None,
) -> None:
    """Both outputs match the references bitwise (rowwise, of ``x`` times its group's multipliers
    if given; per-group columnwise in the padded layout, of ``x`` times each token's multiplier if given)."""
    q, row_scales, qt, col_scales = _run(
        x, offs, float8_dtype, pow2, alignment, small_tiles, row_multipliers, token_multipliers
    )
    rows = x if row_multipliers is None else x.float() * _per_token(row_multipliers, offs, x.shape[0])
    cols = x if token_multipliers is None else x.float() * token_multipliers[:, None]
    eq, es = ref_quantize_rowwise(rows, float8_dtype, pow2)
    eqt, ecs = ref_quantize_rowwise_cols_grouped(cols, offs, float8_dtype, pow2)
    torch.testing.assert_close(row_scales, es, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(col_scales, ecs, rtol=0, atol=0, equal_nan=True)
    assert_fp8_equal(q, eq)
    assert_fp8_equal(qt, ref_pad_token_columns(eqt, offs, alignment))
    assert q.is_contiguous() and qt.is_contiguous()


@pytest.mark.parametrize("float8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("pow2", [False, True])
def test_matches_reference(float8_dtype, pow2):
    # Empty groups, a one-token group, unaligned sizes, tokens past offs[-1].
    _check(_tokens(200, 45), offsets_from_sizes([0, 1, 37, 0, 150]), float8_dtype, pow2)


@pytest.mark.parametrize("kind", ["uniform", "skewed", "empty", "one", "unaligned"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_group_size_kinds_and_input_dtypes(kind, dtype):
    m = 300
    _check(_tokens(m, 24, dtype), offsets_from_sizes(group_sizes(m - 5, 6, kind)))


@pytest.mark.parametrize("alignment", [16, 32])
def test_smaller_alignments(alignment):
    sizes = [0, 1, 37, alignment, 0, 90]
    _check(_tokens(sum(sizes) + 11, 40), offsets_from_sizes(sizes), alignment=alignment)


# 128 groups runs on the GPU only: under the interpreter it is the suite's slowest kernel test.
@pytest.mark.whole_suite_only
@pytest.mark.parametrize("groups", [63, pytest.param(128, marks=pytest.mark.cuda)])
def test_many_groups(groups):
    # Group counts whose power of two equals a tile size: a tile sized by it once made
    # Helion mask the offsets' loads with the column tile's mask (wrong groups, silently).
    sizes = group_sizes(5 * groups, groups, "skewed")
    _check(_tokens(sum(sizes) + 3, 40), offsets_from_sizes(sizes))


def test_single_group_and_single_token():
    _check(_tokens(1, 3), offsets_from_sizes([1]))
    _check(_tokens(130, 33, torch.float16), offsets_from_sizes([130]))


def test_out_of_range_offsets_are_clamped():
    offs = torch.tensor([-5, 50, 90, 400], dtype=torch.int32, device=DEVICE)
    _check(_tokens(120, 16), offs)


def test_bad_offsets_stay_in_bounds():
    # Decreasing ends overlap groups: the outputs are unspecified but sized as usual.
    x = _tokens(100, 24)
    offs = torch.tensor([100, 0, 100, 0, 100], dtype=torch.int32, device=DEVICE)
    q, row_scales, qt, col_scales = _run(x, offs, alignment=16)
    assert q.shape == (100, 24) and qt.shape == (24, (-(-100 // 16) + 5) * 16) and col_scales.shape == (5, 24)


def test_every_output_element_is_written(monkeypatch):
    # Poisoned outputs: padding, empty groups, a one-token group, unrouted tokens,
    # a column count not a multiple of the tile.
    poison_torch_empty(monkeypatch)
    _check(_tokens(75, 20), offsets_from_sizes([0, 9, 1, 40]), alignment=16)
    _check(_tokens(75, 20), offsets_from_sizes([0, 9, 1, 40]))


def test_zero_rows_and_groups():
    x = _tokens(64, 32)
    x[10:30] = 0
    q, row_scales, qt, col_scales = _run(x, offsets_from_sizes([10, 20, 34]))
    assert torch.isfinite(row_scales).all() and torch.isfinite(col_scales).all()
    assert (q[10:30].float() == 0).all() and (qt[:, 128:148].float() == 0).all()


def test_nan_and_inf_propagate():
    x = _tokens(64, 32)
    x[3, 5] = float("nan")
    x[40, 2] = float("inf")
    offs = offsets_from_sizes([20, 44])
    q, row_scales, qt, col_scales = _run(x, offs)
    assert torch.isinf(row_scales[3]) and torch.isinf(row_scales[40])
    assert torch.isinf(col_scales[0, 5]) and torch.isinf(col_scales[1, 2])
    assert torch.isnan(q[3, 5].float()) and torch.isnan(qt[5, 3].float())
    assert torch.isfinite(col_scales[1, 5]) and torch.isfinite(row_scales[4])
    _check(x, offs, torch.float8_e4m3fnuz, True)


@pytest.mark.parametrize("small_tiles", [False, True], ids=["default", "small-tiles"])
def test_row_multipliers(small_tiles):
    """The folded dgrad's form: rows scaled by their group's multipliers, columns untouched; unrouted tokens by 1."""
    x = _tokens(200, 45)
    offs = offsets_from_sizes([0, 1, 37, 0, 150])  # 12 tokens past offs[-1]
    multipliers = torch.rand(5, 45, device=DEVICE) * 8 + 1e-3
    multipliers[3] = float("inf")  # an empty group's multipliers are never read
    _check(x, offs, small_tiles=small_tiles, row_multipliers=multipliers)
    _check(x, offs, torch.float8_e4m3fnuz, True, small_tiles=small_tiles, row_multipliers=multipliers)


def test_nan_row_multiplier_stays_in_its_group():
    # A NaN multiplier (a NaN in a weight row) reaches its group's rows alone: the padding
    # after the one-token group 1 stays 0, whichever rows its amax atomics land on.
    x = _tokens(200, 45)
    offs = offsets_from_sizes([0, 1, 37, 0, 150])
    multipliers = torch.rand(5, 45, device=DEVICE) * 8 + 1e-3
    multipliers[1, 3] = float("nan")
    _check(x, offs, row_multipliers=multipliers)


@pytest.mark.parametrize("small_tiles", [False, True], ids=["default", "small-tiles"])
def test_token_multipliers(small_tiles):
    """The folded wgrad's form: columns of each token scaled by its multiplier, rows untouched; with row multipliers too."""
    x = _tokens(200, 45)
    offs = offsets_from_sizes([0, 1, 37, 0, 150])  # 12 tokens past offs[-1]
    per_token = torch.rand(200, device=DEVICE) * 8 + 1e-3
    per_token[190:] = float("inf")  # unrouted tokens' multipliers reach no group
    _check(x, offs, small_tiles=small_tiles, token_multipliers=per_token)
    row_multipliers = torch.rand(5, 45, device=DEVICE) * 8 + 1e-3
    _check(x, offs, torch.float8_e4m3fnuz, True, small_tiles=small_tiles, row_multipliers=row_multipliers, token_multipliers=per_token)


def test_nan_token_multiplier_stays_in_its_group():
    # A NaN multiplier (a token whose input row held a NaN) makes its group's column amaxes NaN, hence
    # its scales inf (as for a NaN input), and no other group's.
    x = _tokens(200, 45)
    offs = offsets_from_sizes([0, 1, 37, 0, 150])
    per_token = torch.rand(200, device=DEVICE) + 0.5
    per_token[20] = float("nan")
    _, _, _, col_scales = _run(x, offs, token_multipliers=per_token)
    assert torch.isinf(col_scales[2]).all() and torch.isfinite(col_scales[[0, 1, 3, 4]]).all()
    _check(x, offs, token_multipliers=per_token)


def test_no_tokens():
    q, row_scales, qt, col_scales = _run(_tokens(0, 8), offsets_from_sizes([0, 0]))
    assert q.shape == (0, 8) and row_scales.shape == (0,) and qt.shape == (8, 256)
    assert (qt.float() == 0).all() and torch.isfinite(col_scales).all()


_OFFS = torch.tensor([4, 8], dtype=torch.int32)


@pytest.mark.parametrize(
    "x, offs, kwargs, error, match",
    [
        (torch.randn(8, 4, dtype=torch.float64), _OFFS, {}, TypeError, "x must have dtype"),
        (torch.randn(2, 8, 4), _OFFS, {}, ValueError, "x must be 2-D"),
        (torch.randn(4, 8).t(), _OFFS, {}, ValueError, "x must be contiguous"),
        (torch.randn(8, 0), _OFFS, {}, ValueError, "at least one column"),
        (torch.randn(8, 4), torch.tensor([4, 8]), {}, TypeError, "offs must have dtype"),
        (torch.randn(8, 4), _OFFS[None], {}, ValueError, "offs must be 1-D"),
        (torch.randn(8, 4), _OFFS, {"group_alignment": 8}, ValueError, "multiple of 16"),
        (torch.randn(8, 4), _OFFS, {"group_alignment": 0}, ValueError, "group_alignment must be an int >= 1"),
        (torch.randn(8, 4), _OFFS, {"group_alignment": 48}, ValueError, "the selected config's token tile"),
        (torch.randn(8, 4), _OFFS, {"float8_dtype": torch.float8_e5m2}, TypeError, "float8_dtype must be one of"),
        (torch.randn(8, 4), _OFFS, {"row_multipliers": torch.ones(2, 3)}, ValueError, r"row_multipliers must have shape \(2, 4\)"),
        (torch.randn(8, 4), _OFFS, {"row_multipliers": torch.ones(2, 4).double()}, TypeError, "row_multipliers must have dtype"),
        (torch.randn(8, 4), _OFFS, {"row_multipliers": torch.ones(4, 2).t()}, ValueError, "row_multipliers must be contiguous"),
        (torch.randn(8, 4), _OFFS, {"token_multipliers": torch.ones(7)}, ValueError, r"token_multipliers must have shape \(8,\)"),
        (torch.randn(8, 4), _OFFS, {"token_multipliers": torch.ones(8).half()}, TypeError, "token_multipliers must have dtype"),
    ],
)
def test_bad_input(x, offs, kwargs, error, match):
    kwargs = {key: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for key, v in kwargs.items()}
    with pytest.raises(error, match=match):
        quantize_rowwise_rows_and_cols_grouped(x.to(DEVICE), offs.to(DEVICE), **kwargs)


@pytest.mark.cuda
def test_offsets_on_wrong_device():
    with pytest.raises(ValueError, match="offs must be on"):
        quantize_rowwise_rows_and_cols_grouped(_tokens(8, 4), torch.tensor([8], dtype=torch.int32))


@pytest.mark.cuda
@pytest.mark.parametrize(
    "m, k, groups, kind",
    [(32768, 7168, 8, "skewed"), (32768, 2048, 16, "uniform"), (65536, 7168, 32, "uniform"), (32768, 5120, 1, "uniform")],
)
def test_benchmark_shapes_bitwise(m, k, groups, kind):
    _check(_tokens(m, k), offsets_from_sizes(group_sizes(m, groups, kind)))


# --- gathered rows: the MoE combine's gradient rows read by index (pair_tokens, pair_weights) ---------------


def _pair_routing(tokens: int, top_k: int, experts: int, index_dtype: torch.dtype):
    """``(order, offs, probs, pair_tokens, pair_weights)`` of a routing with expert 0 empty, the last
    expert given one pair, a token choosing an expert twice and one pair past ``offs[-1]`` (an expert
    out of range: counted nowhere, sorted last)."""
    top = torch.randint(1, experts - 1, (tokens, top_k))
    top[0] = torch.tensor([2, 2, experts - 1])  # expert 2 twice; the last expert's one pair
    top[1, 1] = experts  # out of range: the pair sits past offs[-1]
    order = ops.sort_by_expert(top.to(DEVICE), experts)
    offs = torch.cumsum(order.num_tokens_per_expert, 0, dtype=torch.int32)
    probs = torch.rand(tokens, top_k, device=DEVICE).softmax(-1)
    return order.order, offs, probs, (order.order // top_k).to(index_dtype), probs.view(-1)[order.order]


def _combine_grad_rows(grad: torch.Tensor, order: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """The MoE combine's gradient rows ``(T * k, K)`` written out by ``moe_combine_grad_rows`` (the path the
    gathered rows replace; its own rounding, toward zero under Triton's interpreter, is what they must match)."""
    return moe_combine_grad_rows(grad, order, probs)


def _assert_same_outputs(got, expected) -> None:
    """The four outputs bitwise (fp8 as bytes, any NaN matching any NaN; the scales with NaN equal)."""
    for a, e in zip(got, expected, strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, e.shape, a.dtype, e.dtype)
        if a.dtype in FP8_DTYPES:
            assert_fp8_equal(a, e)
        else:
            torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize(
    "float8_dtype, pow2, folds, index_dtype, small_tiles",
    [
        (torch.float8_e4m3fn, False, "none", torch.int64, False),
        (torch.float8_e4m3fnuz, True, "rows", torch.int32, False),
        (torch.float8_e4m3fn, True, "tokens", torch.int64, True),
        (torch.float8_e4m3fn, False, "both", torch.int32, True),
        (torch.float8_e4m3fnuz, False, "both", torch.int64, False),
    ],
    ids=["plain-int64", "rows-int32-pow2", "tokens-int64-small-tiles", "both-int32-small-tiles", "both-int64"],
)
def test_gathered_rows_are_the_written_rows(float8_dtype, pow2, folds, index_dtype, small_tiles):
    """Bitwise ``moe_combine_grad_rows`` then the quantizer on its rows: rows ``grad[pair_tokens[t]] * pair_weights[t]``
    read by index. Unaligned sizes (37 tokens, 3 choices, K = 48), an empty expert, a one-pair expert, a
    token choosing an expert twice, a pair past ``offs[-1]``, with and without the folds' multipliers."""
    tokens, top_k, k, experts = 37, 3, 48, 5
    order, offs, probs, pair_tokens, pair_weights = _pair_routing(tokens, top_k, experts, index_dtype)
    assert offs[0] == 0 and offs[-1] - offs[-2] == 1 and offs[-1] == tokens * top_k - 1
    grad = _tokens(tokens, k)
    folded = {}
    if folds in ("rows", "both"):
        folded["row_multipliers"] = torch.rand(experts, k, device=DEVICE) * 8 + 1e-3
        folded["row_multipliers"][0] = float("inf")  # the empty expert's multipliers are never read
    if folds in ("tokens", "both"):
        folded["token_multipliers"] = torch.rand(tokens * top_k, device=DEVICE) * 8 + 1e-3
        folded["token_multipliers"][-1] = float("inf")  # the pair past offs[-1] reaches no group
    alignment = 16 if small_tiles else 128
    options = dict(float8_dtype=float8_dtype, pow2=pow2, alignment=alignment, small_tiles=small_tiles, **folded)
    got = _run(grad, offs, pair_tokens=pair_tokens, pair_weights=pair_weights, **options)
    expected = _run(_combine_grad_rows(grad, order, probs), offs, **options)
    _assert_same_outputs(got, expected)
    assert got[0].shape == (tokens * top_k, k) and got[3].shape == (experts, k)


def test_gathered_nan_reaches_its_token_pairs_alone():
    """A NaN in one token's gradient row: that token's pairs' rows (scales non-finite) and, in its column,
    the column scales of those pairs' experts; everything else as without it."""
    tokens, top_k, k, experts = 37, 3, 48, 5
    order, offs, probs, pair_tokens, pair_weights = _pair_routing(tokens, top_k, experts, torch.int64)
    grad = _tokens(tokens, k)
    grad[5, 7] = float("nan")
    folded = {"token_multipliers": torch.rand(tokens * top_k, device=DEVICE) + 0.5}
    got = _run(grad, offs, pair_tokens=pair_tokens, pair_weights=pair_weights, **folded)
    _assert_same_outputs(got, _run(_combine_grad_rows(grad, order, probs), offs, **folded))
    bad = pair_tokens == 5
    row_scales, col_scales = got[1], got[3]
    assert not torch.isfinite(row_scales[bad]).any() and torch.isfinite(row_scales[~bad]).all()
    groups = torch.searchsorted(offs, bad.nonzero().flatten().to(torch.int32), right=True)
    expected_bad = torch.zeros(experts, k, dtype=torch.bool, device=DEVICE)
    expected_bad[groups[groups < experts], 7] = True
    assert torch.equal(~torch.isfinite(col_scales), expected_bad)


def test_gathered_out_of_range_tokens_read_zero_rows():
    """``pair_tokens`` of -1 and T read as zero rows (never out of bounds), whatever their weights (inf, NaN),
    with both folds' multipliers."""
    tokens, top_k, k, experts = 37, 3, 48, 5
    order, offs, probs, pair_tokens, pair_weights = _pair_routing(tokens, top_k, experts, torch.int32)
    grad = _tokens(tokens, k)
    out_of_range = torch.tensor([3, 50, 100], device=DEVICE)
    pair_tokens[out_of_range] = torch.tensor([-1, tokens, -1], dtype=torch.int32, device=DEVICE)
    pair_weights[out_of_range[:2]] = torch.tensor([float("inf"), float("nan")], device=DEVICE)
    folded = {
        "row_multipliers": torch.rand(experts, k, device=DEVICE) * 8 + 1e-3,
        "token_multipliers": torch.rand(tokens * top_k, device=DEVICE) * 8 + 1e-3,
    }
    got = _run(grad, offs, pair_tokens=pair_tokens, pair_weights=pair_weights, **folded)
    rows = _combine_grad_rows(grad, order, probs)
    rows[out_of_range] = 0
    _assert_same_outputs(got, _run(rows, offs, **folded))
    assert (got[0][out_of_range].float() == 0).all()


_PAIRS = torch.tensor([0, 7, 3, 3, 5, 1])
_WEIGHTS = torch.rand(6)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"pair_tokens": _PAIRS}, ValueError, "pair_tokens and pair_weights go together"),
        ({"pair_weights": _WEIGHTS}, ValueError, "pair_tokens and pair_weights go together"),
        ({"pair_tokens": _PAIRS, "pair_weights": _WEIGHTS[:5]}, ValueError, r"pair_weights must have shape \(6,\)"),
        ({"pair_tokens": _PAIRS, "pair_weights": _WEIGHTS.double()}, TypeError, "pair_weights must have dtype"),
        ({"pair_tokens": _PAIRS[None], "pair_weights": _WEIGHTS}, ValueError, "pair_tokens must be 1-D"),
        ({"pair_tokens": _PAIRS.float(), "pair_weights": _WEIGHTS}, TypeError, "pair_tokens must have dtype"),
        # M is the pairs' count, not x's rows.
        (
            {"pair_tokens": _PAIRS, "pair_weights": _WEIGHTS, "token_multipliers": torch.ones(8)},
            ValueError,
            r"token_multipliers must have shape \(6,\)",
        ),
    ],
    ids=["tokens-only", "weights-only", "weights-length", "weights-float64", "tokens-2d", "tokens-float", "token-multipliers-length"],
)
def test_gathered_bad_input(kwargs, error, match):
    kwargs = {key: v.to(DEVICE) for key, v in kwargs.items()}
    with pytest.raises(error, match=match):
        quantize_rowwise_rows_and_cols_grouped(torch.randn(8, 4, device=DEVICE), _OFFS.to(DEVICE), **kwargs)


@pytest.mark.parametrize("small_tiles", [False, True])
def test_gathered_columns_alone_are_the_rows_and_columns_columns(small_tiles):
    """``quantize_rowwise_cols_grouped`` of gathered rows: bitwise the column form of
    ``quantize_rowwise_rows_and_cols_grouped`` on the same pairs (the two passes without their rowwise
    part), with a token's NaN and an out-of-range pair; a layout the two-pass kernels cannot write
    is refused, never quantized from other rows."""
    tokens, top_k, k, experts = 37, 3, 48, 5
    order, offs, probs, pair_tokens, pair_weights = _pair_routing(tokens, top_k, experts, torch.int32)
    grad = _tokens(tokens, k)
    grad[5, 7] = float("nan")
    pair_tokens[50] = tokens
    token_multipliers = torch.rand(tokens * top_k, device=DEVICE) + 0.5
    alignment = 16 if small_tiles else 128
    pairs = dict(pair_tokens=pair_tokens, pair_weights=pair_weights)
    folded = dict(token_multipliers=token_multipliers, **pairs)
    expected = _run(grad, offs, alignment=alignment, small_tiles=small_tiles, **folded)
    with _tiles(small_tiles):
        got = quantize_rowwise_cols_grouped(grad, offs, group_alignment=alignment, **folded)
    _assert_same_outputs(got, expected[2:])
    assert not torch.isfinite(got[1]).all()
    with pytest.raises(ValueError, match="group_alignment a multiple of 16"):
        quantize_rowwise_cols_grouped(grad, offs, group_alignment=1, **pairs)


@pytest.mark.parametrize("float8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("small_tiles", [False, True])
def test_fp8_rows_requantized_per_group_column(float8_dtype, small_tiles):
    """FP8 rows as the input (``RowwiseOptions.down_wgrad_token_rows``: ``h``'s rows times each pair's
    multiplier): bitwise the plain-PyTorch quantization of their float32 values times the multipliers,
    with empty groups, a group of one, tokens past ``offs[-1]``, a NaN byte (its group's scales alone go
    inf, as for a NaN in bf16 rows) and NaN / inf multipliers."""
    m, k = 200, 45
    q = _tokens(m, k, torch.float32).clamp(-200, 200).to(float8_dtype)
    q.view(torch.uint8)[20, 3] = 0x80 if float8_dtype == torch.float8_e4m3fnuz else 0x7F  # NaN
    offs = offsets_from_sizes([0, 1, 37, 0, 150])  # 12 tokens past offs[-1]
    per_token = torch.rand(m, device=DEVICE) * 8 + 1e-3
    per_token[60] = float("nan")
    per_token[190:] = float("inf")  # unrouted tokens' multipliers reach no group
    alignment = 16 if small_tiles else 128
    with _tiles(small_tiles):
        qt, scales = quantize_rowwise_cols_grouped(
            q, offs, float8_dtype, group_alignment=alignment, token_multipliers=per_token
        )
    eqt, ecs = ref_quantize_rowwise_cols_grouped(q.float() * per_token[:, None], offs, float8_dtype, False)
    torch.testing.assert_close(scales, ecs, rtol=0, atol=0, equal_nan=True)
    assert_fp8_equal(qt, ref_pad_token_columns(eqt, offs, alignment))
    # The NaN byte (row 20, group 2) reaches its column's scale, the NaN multiplier (row 60) its group's.
    assert torch.isinf(scales[2, 3]) and torch.isinf(scales[4]).all()
    assert torch.isfinite(scales[[0, 1, 3]]).all() and torch.isfinite(scales[2, :3]).all()


def test_fp8_rows_bad_input():
    q = torch.randn(8, 4, device=DEVICE).to(torch.float8_e4m3fn)
    offs = _OFFS.to(DEVICE)
    with pytest.raises(ValueError, match=r"x in FP8 must be of float8_dtype \(torch.float8_e4m3fnuz\)"):
        quantize_rowwise_cols_grouped(q, offs, torch.float8_e4m3fnuz, group_alignment=128)
    pairs = dict(pair_tokens=torch.zeros(8, dtype=torch.int32, device=DEVICE), pair_weights=torch.ones(8, device=DEVICE))
    with pytest.raises(ValueError, match="takes no pair_tokens"):
        quantize_rowwise_cols_grouped(q, offs, group_alignment=128, **pairs)
    with pytest.raises(ValueError, match="FP8 rows are quantized by the two-pass kernels"):
        quantize_rowwise_cols_grouped(q, offs, group_alignment=1)
    with pytest.raises(TypeError, match="x must have dtype"):
        quantize_rowwise_cols_grouped(q.to(torch.float8_e5m2), offs, group_alignment=128)
