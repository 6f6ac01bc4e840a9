"""Shared fixtures: tiny random models saved as HF directories, and a per-session compile cache."""

from __future__ import annotations

import atexit
import importlib.util
import mmap
import os
import shutil
import sys
import tempfile
from pathlib import Path


# The XLA flags users run with, kept for the tests that check users' arithmetic in a process of their own.
USERS_XLA_FLAGS = os.environ.get("JAXSERVE_TEST_USERS_XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
os.environ["JAXSERVE_TEST_USERS_XLA_FLAGS"] = USERS_XLA_FLAGS


def _with_fast_cpu_codegen(flags: str) -> str:
    """XLA_FLAGS with the CPU code XLA emits built for compile speed, where the flags do not choose otherwise:
    LLVM's optimization level 0, and XLA's older loop emitters for its fusions instead of the MLIR ones
    (where this jaxlib has their flag).

    Compiling dominates this suite's time on a 2-core machine: the default model's step is 30 unrolled
    layers, about 7 s an executable at XLA's default level and a little over half that at level 0 (2-core
    AVX2 EPYC, 2026-12-02). The older emitters take a third off what is left: the default model's 8 float32
    executables compiled in 36.7 s of compile time at level 0 and 23.6 s with them, and
    tests/test_cpu_attention.py with tests/test_kv_cache_fp8.py ran in 113 s and 72 s (2-core Zen 4 EPYC,
    avx512_bf16 avx512_vnni, 2026-12-04). Both leave XLA's own loops (norms, rotary embedding, sampling)
    less optimized; the matmuls and the attention are the C++ kernels' either way. They move results in their
    last bits (level 0 moved the default model's logprobs by about 1e-5), so tests/test_default_model.py
    checks Hugging Face's greedy tokens in a process at the users' flags too. Speed is measured by the
    benchmarks, which do not import this file. Set before JAX starts a backend, so that every process the tests
    start (servers, notebook kernels, replicas) inherits it."""
    if gpu_plugin_installed():  # level 0 would reach the GPU's own code too, never measured there
        return flags.strip()
    if "xla_backend_optimization_level" not in flags:
        flags = f"{flags} --xla_backend_optimization_level=0"
    if "xla_cpu_use_fusion_emitters" not in flags and xla_defines("xla_cpu_use_fusion_emitters"):
        flags = f"{flags} --xla_cpu_use_fusion_emitters=false"
    return flags.strip()


def gpu_plugin_installed() -> bool:
    """Whether JAX has a GPU plugin here (jax_plugins.xla_cuda12, xla_cuda13, xla_rocm...)."""
    spec = importlib.util.find_spec("jax_plugins")
    return spec is not None and any(
        path.name.startswith(("xla_cuda", "xla_rocm"))
        for location in spec.submodule_search_locations for path in Path(location).iterdir())


def xla_defines(flag: str, library: Path | None = None) -> bool:
    """Whether this jaxlib's XLA has the flag (jaxlib 0.10.2 has it; 0.11.2 does not): XLA stops a process at
    start-up on a flag it does not know (exit status 1), and flags come and go between releases. Read from the
    library, without loading it: a flag's name is a C string there, NUL on both sides. A bare match is not
    enough: a removed flag's name stays in the library as a reserved field name of XLA's DebugOptions
    message (jaxlib 0.11.2 holds `xla_cpu_use_fusion_emitters` only that way, and this check once added the
    flag there, which ended the GPU run's pytest section before it collected a test)."""
    if library is None:
        spec = importlib.util.find_spec("jaxlib")
        library = Path(next(iter(spec.submodule_search_locations))) / "libjax_common.so"
    if not library.is_file():
        return False
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return data.find(b"\0" + flag.encode() + b"\0") >= 0


os.environ["XLA_FLAGS"] = _with_fast_cpu_codegen(USERS_XLA_FLAGS)

import jax  # noqa: E402
import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

# Tensor-parallel tests split models over up to 8 CPU devices, which JAX makes only if asked before it
# starts; every other test runs on the first of them, as on a one-device machine.
jax.config.update("jax_num_cpu_devices", 8)

from tiny_models import make_tiny_model  # noqa: E402

# Every test session builds the C++ CPU kernels into a cache of its own (set before any test module is
# collected, since collection already loads them): the build itself is under test. .ci/run gives its two
# sessions one such cache, which the first builds.
if "JAXSERVE_KERNEL_CACHE" not in os.environ:
    os.environ["JAXSERVE_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="jaxserve-kernels-")
    atexit.register(shutil.rmtree, os.environ["JAXSERVE_KERNEL_CACHE"], ignore_errors=True)

# Hugging Face's float32 copy of the default model's GGUF, stored by the first test that reads it (tests/hf_gguf.py)
if "JAXSERVE_TEST_HF_CACHE" not in os.environ:
    os.environ["JAXSERVE_TEST_HF_CACHE"] = tempfile.mkdtemp(prefix="jaxserve-hf-")
    atexit.register(shutil.rmtree, os.environ["JAXSERVE_TEST_HF_CACHE"], ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache(tmp_path_factory):
    """One persistent XLA cache per test session, so engines built by several tests share compiles."""
    if "JAXSERVE_COMPILATION_CACHE" not in os.environ:
        os.environ["JAXSERVE_COMPILATION_CACHE"] = str(tmp_path_factory.mktemp("xla_cache"))
    yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Returns a function family -> directory of a saved tiny random model (built once per family)."""
    cache = {}

    def get(family: str = "llama") -> Path:
        if family not in cache:
            directory = tmp_path_factory.mktemp(f"tiny_{family}")
            make_tiny_model(family, directory)
            cache[family] = directory
        return cache[family]

    return get


@pytest.fixture(scope="session")
def default_llm():
    """The default model at the limits the default-model tests share (512 tokens, 8 sequences, 128 tokens a
    step), loaded and compiled once per session; float32 by name: its tests compare with Hugging Face's
    float32 tokens."""
    from jaxserve import LLM

    return LLM(None, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128, dtype="float32")


@pytest.fixture(params=["amx", "vector"])
def matmul_path(request):
    """The C++ bfloat16 and int8 matmuls on AMX tiles (bfloat16: every row; int8: whole blocks of 16 rows; on
    a CPU with AMX, skipped elsewhere) and on the vector code alone; the bfloat16 decode rows' attention
    scores likewise (paged_row_attention.cc's AttendRowTiles)."""
    from jaxserve.ops import cpu_ffi

    if request.param == "amx" and not cpu_ffi.amx_available():
        pytest.skip("the kernels do not use AMX tiles here (no AMX, or the OS refused the tile state)")
    cpu_ffi.set_amx(request.param == "amx")
    yield request.param
    cpu_ffi.set_amx(True)


# The files that take longest (seconds of setup and calls, summed; a fresh-clone run on a 2-core Zen 4 EPYC,
# 2026-12-04), run first. .ci/run gives each file to one of two workers, in collection order
# (--no-loadscope-reorder; xdist's own order puts the files with most tests first, and so left these few-test
# files to the end, one worker idle while the other ran the last of them): longest first keeps both busy.
LONGEST_FIRST = (
    "test_default_model.py",  # 204 (before its users'-flags check compiled 2 executables instead of 8)
    "test_notebook.py",  # 190
    "test_bench.py",  # 181
    "test_gpu_run.py",  # 166
    "test_pallas_attention.py",  # 148
    "test_multihost.py",  # 145
    "test_server_resilience.py",  # 136
    "test_structured_output.py",  # 99
    "test_pallas_lowering.py",  # 98
    "test_pallas_fp8.py",  # 65
    "test_speculative.py",  # 57
    "test_chat_page.py",  # 53
    "test_cpu_attention.py",  # 50
    "test_server.py",  # 50
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
