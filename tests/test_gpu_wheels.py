"""benchmarks/gpu_wheels.py's resolution, on made-up package metadata: nothing is downloaded.

Guards the wheelhouse the GPU machine installs offline with `--no-deps`: a dependency missed by the
closure is an ImportError there, a second version of one package is an arbitrary pick, and a package the
image already has must not be shadowed by one from here.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gpu_wheels", REPO_ROOT / "benchmarks" / "gpu_wheels.py")
gpu_wheels = importlib.util.module_from_spec(_spec)
sys.modules["gpu_wheels"] = gpu_wheels  # its dataclasses look their module up there
_spec.loader.exec_module(gpu_wheels)
Dist = gpu_wheels.Dist

FAKE_DISTS = {
    "web": Dist("2.0", ("Schema_Lib>=1.5", "shared", "async-io>=4", 'web-extra; extra == "full"')),
    "schema-lib": Dist("1.7", ("schema-core==3.1", "shared>=1.1",
                               'backport; python_version < "3.11"', 'py312-only; python_version >= "3.12"')),
    "schema-core": Dist("3.1", ()),
    "shared": Dist("1.2", ()),
    "py312-only": Dist("0.3", ()),
    "backport": Dist("9.9", ()),
    "web-extra": Dist("1.0", ()),
    "async-io": Dist("4.2", ("not-installed-here",)),  # present on the image: never followed
    "gui": Dist("1.0", ('qt; sys_platform == "win32"',)),
}
PRESENT = frozenset({"async-io", "numeric"})


def _resolve(roots: list[str], dists: dict = FAKE_DISTS):
    return gpu_wheels.resolve(roots, dists.get, PRESENT)


def test_closure_follows_requirements_for_python_312_linux_and_pins_installed_versions():
    """Markers are evaluated for the GPU's CPython 3.12 on Linux, not the interpreter running the script;
    names are canonicalized so `Schema_Lib` and `schema-lib` are one package with one pinned version."""
    wheelset = _resolve(["web>=1", "numeric>=2.0", "gui"])
    assert wheelset.pins == {"gui": "1.0", "py312-only": "0.3", "schema-core": "3.1", "schema-lib": "1.7",
                             "shared": "1.2", "web": "2.0"}


def test_present_packages_are_subtracted_and_their_requirements_reported():
    """A package the image has is neither downloaded nor followed; what is asked of it is listed."""
    wheelset = _resolve(["web", "numeric>=2.0"])
    assert "async-io" not in wheelset.pins and "not-installed-here" not in wheelset.pins
    assert wheelset.image_requirements == {"async-io": ">=4", "numeric": ">=2.0"}


def test_extras_pull_their_requirements():
    assert "web-extra" in _resolve(["web[full]"]).pins
    assert "web-extra" not in _resolve(["web"]).pins


def test_missing_package_and_unmet_pin_fail_loudly():
    with pytest.raises(SystemExit, match="not-here is needed on the GPU but not installed here"):
        _resolve(["not-here"])
    with pytest.raises(SystemExit, match=r"shared==1.2 installed here misses the requirement"):
        _resolve(["web", "shared>=2"])


def test_real_runtime_dependencies_resolve_to_the_lacking_packages_only():
    """pyproject's runtime dependencies against this venv: the HTTP layer, llguidance and gguf are
    gathered, and nothing the GPU image has (jax, numpy, transformers, ...) is."""
    wheelset = gpu_wheels.resolve(gpu_wheels.runtime_requirements(REPO_ROOT / "pyproject.toml"),
                                  gpu_wheels.installed_dist)
    assert {"fastapi", "uvicorn", "pydantic", "pydantic-core", "starlette", "llguidance", "gguf"} <= set(wheelset.pins)
    assert not set(wheelset.pins) & gpu_wheels.GPU_IMAGE_PACKAGES
    assert {"jax", "numpy", "transformers"} <= set(wheelset.image_requirements)


def _touch_wheel(dest: Path, filename: str, num_bytes: int) -> None:
    (dest / filename).write_bytes(b"\0" * num_bytes)


def test_prune_keeps_one_version_per_package_and_size_counts_wheels(tmp_path):
    _touch_wheel(tmp_path, "pydantic_core-2.50.5-cp312-cp312-manylinux_2_17_x86_64.whl", 1000)
    _touch_wheel(tmp_path, "pydantic_core-2.40.0-cp312-cp312-manylinux_2_17_x86_64.whl", 1000)
    _touch_wheel(tmp_path, "unrelated-1.0-py3-none-any.whl", 1000)
    (tmp_path / "notes.txt").write_text("not a wheel")
    pins = {"pydantic-core": "2.50.5"}
    gpu_wheels.prune(tmp_path, pins)
    assert [p.name for p in tmp_path.glob("*.whl")] == ["pydantic_core-2.50.5-cp312-cp312-manylinux_2_17_x86_64.whl"]
    gpu_wheels.check_complete(tmp_path, pins)
    assert gpu_wheels.total_bytes(tmp_path) == 1000
    with pytest.raises(SystemExit, match="no wheel .* for fastapi==0.165.0"):
        gpu_wheels.check_complete(tmp_path, {**pins, "fastapi": "0.165.0"})


def test_size_cap_fails_the_run(tmp_path, monkeypatch, capsys):
    """Over --max-mib the script exits non-zero (after downloading, which is faked here)."""
    monkeypatch.setattr(gpu_wheels, "resolve", lambda roots, lookup: gpu_wheels.Wheelset({"big": "1.0"}, {}))
    monkeypatch.setattr(gpu_wheels.subprocess, "run", lambda *args, **kwargs: None)
    _touch_wheel(tmp_path, "big-1.0-py3-none-any.whl", 2 * 2**20)
    assert gpu_wheels.main(["--dest", str(tmp_path), "--max-mib", "1"]) == 1
    assert "over the cap" in capsys.readouterr().err
    assert gpu_wheels.main(["--dest", str(tmp_path), "--max-mib", "3"]) == 0
