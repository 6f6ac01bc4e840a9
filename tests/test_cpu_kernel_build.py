"""Building and caching the C++ CPU kernels: the cache key covers everything that decides the machine
code (a library built for another CPU's features must never be loaded here), and compiler warnings
reach the log instead of being silenced."""

from __future__ import annotations

import logging
import shutil

import pytest

from jaxserve import cpu_ffi

BASE = dict(sources=["int f();"], compiler="/usr/bin/c++ c++ 12.2.0", flags=("-O3", "-march=native"),
            jax_version="0.10.2", machine="x86_64", features="avx2 avx512f fma sse4_2")


@pytest.mark.parametrize("field, other", [
    ("features", "avx2 fma sse4_2"),  # the same machine type without AVX-512: -march=native differs
    ("compiler", "/usr/bin/clang++ clang 17"),
    ("flags", ("-O2", "-march=native")),
    ("jax_version", "0.11.2"),
    ("machine", "aarch64"),
    ("sources", ["int f(); // changed"]),
])
def test_the_cache_key_changes_with_everything_that_decides_the_machine_code(field, other):
    assert cpu_ffi.cache_key(**BASE) == cpu_ffi.cache_key(**BASE)
    assert cpu_ffi.cache_key(**{**BASE, field: other}) != cpu_ffi.cache_key(**BASE)


def test_the_cache_key_keeps_its_inputs_apart():
    """Inputs shifted by one place (the compiler read as a second source, the first flag as the
    compiler) are another key: joined with a separator they would be the same text."""
    shifted = {**BASE, "sources": [*BASE["sources"], BASE["compiler"]], "compiler": BASE["flags"][0],
               "flags": BASE["flags"][1:]}
    assert cpu_ffi.cache_key(**shifted) != cpu_ffi.cache_key(**BASE)


def test_the_library_path_depends_on_this_cpus_features(monkeypatch, tmp_path):
    """Both sources of the CPU's features reach the library's name: the operating system's list and
    what the compiler resolves -march=native to."""
    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(tmp_path))
    here = cpu_ffi.library_path("c++")
    with monkeypatch.context() as patch:
        patch.setattr(cpu_ffi, "cpu_features", lambda: "sse2")
        assert cpu_ffi.library_path("c++") != here
    with monkeypatch.context() as patch:
        patch.setattr(cpu_ffi, "native_target", lambda compiler: "#define __SSE2__ 1")
        assert cpu_ffi.library_path("c++") != here
    assert cpu_ffi.library_path("c++") == here


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler (c++ on PATH)")
def test_native_target_is_what_march_native_resolves_to():
    """The compiler names the instruction sets -march=native gives it here (on x86-64 at least SSE2,
    the architecture's baseline), in a stable order; a compiler that cannot run gives nothing."""
    target = cpu_ffi.native_target("c++")
    assert "#define __SSE2__ 1" in target or "__aarch64__" in target
    assert target == cpu_ffi.native_target("c++") and target.splitlines() == sorted(target.splitlines())
    assert cpu_ffi.native_target("no-such-compiler") == ""


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler (c++ on PATH)")
def test_compiler_warnings_are_logged(tmp_path, caplog):
    source = tmp_path / "warns.cc"
    source.write_text("int answer() { int unused = 1; return 42; }\n")
    with caplog.at_level(logging.WARNING, logger="jaxserve.cpu_ffi"):
        assert cpu_ffi.build_library("c++", (source,), tmp_path / "warns.so") is None
    assert (tmp_path / "warns.so").exists()
    assert any("unused" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
