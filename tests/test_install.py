"""Installing the project keeps the torch and triton already installed (pip resolves, installs nothing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# pip's messages when it cannot reach the package index: the test is skipped then, not failed.
OFFLINE_MARKERS = (
    "NewConnectionError",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "ProxyError",
    "Max retries exceeded",
    "No matching distribution found for setuptools",
)


def test_installing_the_project_keeps_torch_and_triton(tmp_path):
    report_path = tmp_path / "report.json"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report_path), str(REPO)],
            capture_output=True, text=True, timeout=600,
        )
    except (FileNotFoundError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"pip did not run: {e!r}")
    output = proc.stdout + proc.stderr
    if "No module named pip" in output:
        pytest.skip("this environment has no pip")
    if proc.returncode != 0 and any(marker in output for marker in OFFLINE_MARKERS):
        pytest.skip("the package index is unreachable")
    assert proc.returncode == 0, output
    report = json.loads(report_path.read_text())
    would_install = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in report["install"]}
    assert "fp8-moe-helion" in would_install, would_install  # the report lists what pip would install
    changed = {name: version for name, version in would_install.items() if name in ("torch", "triton")}
    assert not changed, f"installing the project would replace {changed}"
