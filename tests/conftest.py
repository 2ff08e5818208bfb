"""Test harness: pick the device once, mark GPU-only tests, seed every test."""

from __future__ import annotations

import pytest
import torch

# Before any test module imports helion or triton: with no GPU, Triton's interpreter; the names older
# torch lacks (kernels_helion.helion_setup).
import kernels_helion  # noqa: F401
from tests.support import pin_auto_choices_off_hopper


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--each-test-once",
        action="store_true",
        help="run each test function with its first runnable parameter set only: every kernel and op "
        "still builds and runs once (CI's legs for other torch/triton versions)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped on the CPU interpreter)")
    config.addinivalue_line(
        "markers",
        "whole_suite_only: slow under the interpreter and exercises nothing that differs between torch/triton "
        "versions (its kernels and ops run in other tests): left out by --each-test-once",
    )
    config.addinivalue_line(
        "markers",
        "each_parameter: --each-test-once keeps every parameter set of this test (each is a path that can "
        "differ between torch/triton versions, e.g. one recipe's compiled graph)",
    )
    config.addinivalue_line(
        "markers",
        "auto_choices: the recipe's 'auto' choices (wgrad_precision, down_dgrad_token_rows) resolve as on the "
        "device (elsewhere as on the CPU: the FP8 wgrad, the folded dgrad)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)
    if config.getoption("--each-test-once"):
        _keep_first_parameter_set(config, items)


def _keep_first_parameter_set(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep, per test function, the first item that is not skipped (every item of an
    ``each_parameter`` test); deselect the rest and the ``whole_suite_only`` tests."""
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    seen: set[tuple[str, str]] = set()
    for item in items:
        key = (item.nodeid.split("::")[0], getattr(item, "originalname", item.name))
        if item.get_closest_marker("each_parameter") is not None:
            key = (item.nodeid, "")
        if key in seen or _skipped(item) or item.get_closest_marker("whole_suite_only") is not None:
            dropped.append(item)
            continue
        seen.add(key)
        kept.append(item)
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept


def _skipped(item: pytest.Item) -> bool:
    """Whether ``item`` carries a ``skip`` mark or a ``skipif`` mark whose condition is true."""
    if item.get_closest_marker("skip") is not None:
        return True
    return any(bool(mark.args[0]) for mark in item.iter_markers("skipif") if mark.args and not isinstance(mark.args[0], str))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _auto_choices_as_on_cpu_unless_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests check the FP8 wgrad's and the folded dgrad's data flow bit for bit (against emulations,
    across paths that must agree): there the recipe's ``"auto"`` choices resolve on every device as they
    do on the CPU. Tests marked ``auto_choices`` (``tests/test_wgrad_precision.py``,
    ``tests/test_down_dgrad_token_rows.py``) see the device's own choice."""
    if request.node.get_closest_marker("auto_choices") is None:
        pin_auto_choices_off_hopper(monkeypatch.setattr)

