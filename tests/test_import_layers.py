"""The packages import in one direction: ``ops`` -> ``kernels_helion`` -> ``autotune_cache``, never back."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Each package and the project packages it must never import (at any depth, lazily included).
FORBIDDEN = {
    "autotune_cache": ("kernels_helion", "ops", "benchmarks"),
    "kernels_helion": ("ops", "benchmarks"),
}


def _imported_modules(path: Path) -> set[str]:
    """Every module an ``import`` or ``from ... import`` anywhere in ``path`` names (absolute imports)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_source_imports_only_downward(package):
    offending = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted((ROOT / package).glob("*.py"))
        for name in _imported_modules(path)
        if name.split(".")[0] in FORBIDDEN[package]
    }
    assert not offending, f"{package} imports a package above it: {sorted(offending)}"


def test_importing_autotune_cache_loads_no_kernel():
    """``autotune_cache``, its registry, tuner and timing load no kernel and no op."""
    code = (
        "import sys\n"
        "import autotune_cache, autotune_cache.registry, autotune_cache.tune, autotune_cache.timing\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('kernels_helion', 'ops'))\n"
        "assert not loaded, loaded\n"
        "assert not autotune_cache.registry.tunable_kernels()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_kernel_modules_register_their_tuning():
    """Importing ``kernels_helion`` registers every kernel that ships a config, under its cache key."""
    from autotune_cache import CACHE_DIR
    from autotune_cache.registry import tunable_kernels

    shipped = {path.stem for path in CACHE_DIR.glob("*/*.json")}
    assert shipped <= set(tunable_kernels()), sorted(shipped - set(tunable_kernels()))
