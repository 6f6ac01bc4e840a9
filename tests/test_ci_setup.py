"""The CI script and the test selection: a failed install fails the run at that step, and what cannot
run on a CPU machine is deselected by marker rather than skipped, so a new skip stands out."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CI_SCRIPT = (REPO_ROOT / ".ci" / "run").read_text()


def test_a_failing_pip_install_fails_the_ci_script_at_that_step(tmp_path):
    """The script's own install helper, run with a pip that prints the harmless warning the helper
    filters out and then fails: the script must stop there with pip's exit status."""
    helper = next(line for line in CI_SCRIPT.splitlines() if line.startswith("quiet_pip()"))
    assert "|| true" not in CI_SCRIPT and "set -euo pipefail" in CI_SCRIPT
    pip = tmp_path / ".venv" / "bin" / "pip"
    pip.parent.mkdir(parents=True)
    pip.write_text("#!/bin/sh\necho \"WARNING: Location 'x' is ignored: it is neither a file nor a directory.\" >&2\n"
                   "echo 'ERROR: No matching distribution found for nothing-here' >&2\nexit 3\n")
    pip.chmod(0o755)
    script = f"set -euo pipefail\n{helper}\nquiet_pip nothing-here\necho REACHED-THE-NEXT-STEP\n"
    result = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 3, result
    assert "REACHED-THE-NEXT-STEP" not in result.stdout
    assert "No matching distribution" in result.stdout and "is ignored" not in result.stdout


def test_gpu_only_and_slow_tests_are_deselected_not_skipped_on_a_cpu():
    """A plain run on a CPU deselects the GPU-only test (exit 5: nothing selected), it does not skip it."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "tests/test_pallas_engine.py", "-k", "on_gpu"],
                            cwd=REPO_ROOT, capture_output=True, text=True, env=env)
    assert result.returncode == 5, result.stdout[-2000:]
    assert "deselected" in result.stdout and "skipped" not in result.stdout


def test_the_ci_script_runs_ruff_check_before_pytest():
    """`ruff check .` is a command of its own (so set -e fails the run on a finding) before the first pytest."""
    lines = [line.strip() for line in CI_SCRIPT.splitlines()]
    assert ".venv/bin/ruff check ." in lines, "the CI script no longer runs ruff"
    ruff = lines.index(".venv/bin/ruff check .")
    first_pytest = next(i for i, line in enumerate(lines) if "-m pytest" in line and not line.startswith("#"))
    assert ruff < first_pytest, "the CI script runs ruff after pytest"
