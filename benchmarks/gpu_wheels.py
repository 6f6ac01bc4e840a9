"""Gather the wheels the GPU machine's image lacks for `jaxserve serve` and `jaxserve bench serve`.

    .venv/bin/python benchmarks/gpu_wheels.py [--dest .whl] [--max-mib 40]

The GPU machine has no network, and its image (Python 3.12) lacks the HTTP layer's packages (fastapi,
uvicorn, pydantic, ...), llguidance and gguf. This script, run here with the repo's venv, takes the
runtime dependencies from pyproject.toml, follows their requirements (markers evaluated for CPython 3.12
on Linux x86_64) through every package the image does not have, pins each to the version this venv has
installed (so the GPU run behaves as CI does; one version per package), and downloads those wheels,
binary only, into `--dest` (ignored by git), removing any other version left there. It prints the
total size and exits 1 over `--max-mib`.

On the GPU machine the wheels install without an index or dependency resolution:

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:$PWD python3 -m jaxserve.cli serve ...

jaxserve itself runs from the checkout (the PYTHONPATH entry), not from a wheel. Packages the image
already has are assumed to satisfy the requirements on them; the script lists those requirements so a
version mismatch can be checked there.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Callable

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent

# The GPU image's package list as read in November 2026 (distribution names).
GPU_IMAGE_PACKAGES = frozenset(canonicalize_name(name) for name in """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings
cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils
execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet
httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax
jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning
lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib
mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink
nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax
opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp
""".split())

# Where the wheels run: markers are evaluated for this interpreter and platform, not the one running here.
GPU_MARKER_ENV = {
    "python_version": "3.12", "python_full_version": "3.12.0", "implementation_name": "cpython",
    "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
    "os_name": "posix", "platform_machine": "x86_64",
}
# pip takes each manylinux tag literally (no older glibc implied), so every tag a wheel may carry is named.
# llguidance ships manylinux_2_31 wheels only: the GPU image's glibc must be 2.31 or newer, and pip says so
# there ("not a supported wheel on this platform") if it is not.
PLATFORMS = ["manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
PIP_TARGET = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
              *(arg for platform in PLATFORMS for arg in ("--platform", platform))]


@dataclasses.dataclass(frozen=True)
class Dist:
    version: str
    requires: tuple[str, ...]  # Requires-Dist lines, markers included


@dataclasses.dataclass(frozen=True)
class Wheelset:
    pins: dict[str, str]  # canonical name -> version, every package to download
    image_requirements: dict[str, str]  # canonical name -> specifier asked of the image's copy


def installed_dist(name: str) -> Dist | None:
    """The venv's installed copy of `name`, or None."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    return Dist(dist.version, tuple(dist.requires or ()))


def runtime_requirements(pyproject: Path) -> list[str]:
    return tomllib.loads(pyproject.read_text())["project"]["dependencies"]


def _applies(req: Requirement, extras: frozenset[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**GPU_MARKER_ENV, "extra": extra}) for extra in extras | {""})


def resolve(roots: list[str], lookup: Callable[[str], Dist | None],
            present: frozenset[str] = GPU_IMAGE_PACKAGES) -> Wheelset:
    """The closure of `roots` over packages not in `present`, each pinned to `lookup`'s version.

    A present package is not followed: the image is taken to hold its requirements too. Raises
    SystemExit when a needed package is not installed here or its version misses a requirement."""
    specifiers: dict[str, SpecifierSet] = {}
    extras: dict[str, frozenset[str]] = {}
    pending = [(Requirement(line), frozenset()) for line in roots]
    dists: dict[str, Dist] = {}
    while pending:
        req, parent_extras = pending.pop()
        if not _applies(req, parent_extras):
            continue
        name = canonicalize_name(req.name)
        specifiers[name] = specifiers.get(name, SpecifierSet()) & req.specifier
        if name in present:
            continue
        new_extras = frozenset(req.extras) - extras.get(name, frozenset())
        if name in dists and not new_extras:
            continue
        extras[name] = extras.get(name, frozenset()) | new_extras
        if name not in dists:
            dist = lookup(name)
            if dist is None:
                raise SystemExit(f"{name} is needed on the GPU but not installed here: pip install it first")
            dists[name] = dist
        pending += [(Requirement(line), extras[name]) for line in dists[name].requires]
    for name, dist in dists.items():
        if not specifiers[name].contains(dist.version, prereleases=True):
            raise SystemExit(f"{name}=={dist.version} installed here misses the requirement {specifiers[name]}")
    image = {name: str(spec) for name, spec in specifiers.items() if name in present}
    return Wheelset(pins={name: dists[name].version for name in sorted(dists)},
                    image_requirements={name: image[name] for name in sorted(image)})


def wheel_key(path: Path) -> tuple[str, str]:
    """(canonical name, version) from a wheel's file name."""
    name, version = path.name.split("-")[:2]
    return canonicalize_name(name), version


def prune(dest: Path, pins: dict[str, str]) -> None:
    """Remove wheels that are not the pinned version of a pinned package (earlier runs' leftovers)."""
    for path in dest.glob("*.whl"):
        name, version = wheel_key(path)
        if pins.get(name) != version:
            path.unlink()


def total_bytes(dest: Path) -> int:
    return sum(path.stat().st_size for path in dest.glob("*.whl"))


def check_complete(dest: Path, pins: dict[str, str]) -> None:
    found = {wheel_key(path) for path in dest.glob("*.whl")}
    missing = [f"{name}=={version}" for name, version in pins.items() if (name, version) not in found]
    if missing:
        raise SystemExit(f"no wheel in {dest} for {', '.join(missing)}")
    assert len(found) == len(pins), f"{found=} holds more than {pins=}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dest", type=Path, default=REPO / ".whl")
    parser.add_argument("--max-mib", type=float, default=40.0)
    args = parser.parse_args(argv)
    wheelset = resolve(runtime_requirements(REPO / "pyproject.toml"), installed_dist)
    args.dest.mkdir(parents=True, exist_ok=True)
    prune(args.dest, wheelset.pins)
    pinned = [f"{name}=={version}" for name, version in wheelset.pins.items()]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PIP_TARGET,
                    "-d", str(args.dest), *pinned], check=True)
    check_complete(args.dest, wheelset.pins)
    for path in sorted(args.dest.glob("*.whl")):
        print(f"{path.stat().st_size / 2**20:7.2f} MiB  {path.name}")
    print("assumed from the GPU image: " + ", ".join(
        f"{name}{spec}" for name, spec in wheelset.image_requirements.items()))
    size_mib = total_bytes(args.dest) / 2**20
    print(f"{len(wheelset.pins)} wheels, {size_mib:.2f} MiB in {args.dest} (cap {args.max_mib:g} MiB)")
    if size_mib > args.max_mib:
        print(f"over the cap: {size_mib=:.2f} > {args.max_mib=:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
