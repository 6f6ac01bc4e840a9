"""Building and caching the C++ CPU kernels: the cache key covers everything that decides the machine
code (a library built for another CPU's features must never be loaded here), and compiler warnings
reach the log instead of being silenced."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time

import pytest

from jaxserve.ops import cpu_ffi

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
    with caplog.at_level(logging.WARNING, logger="jaxserve.ops.cpu_ffi"):
        assert cpu_ffi.build_library("c++", (source,), tmp_path / "warns.so") is None
    assert (tmp_path / "warns.so").exists()
    assert any("unused" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def fake_compiler(tmp_path, body: str):
    """An executable standing in for the C++ compiler: answers the version and target queries at once,
    runs `body` (sh) for a build."""
    compiler = tmp_path / "fake-c++"
    compiler.write_text(f'#!/bin/sh\ncase "$*" in *--version*|*-dM*) exit 0;; esac\n{body}\n')
    compiler.chmod(0o755)
    return compiler


def process_gone(pid: int) -> bool:
    """Whether `pid` has exited (a zombie no init reaped counts: it runs no more)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads the compiler's child's state in /proc (Linux)")
def test_a_compiler_that_runs_past_the_timeout_is_stopped_with_all_it_started(tmp_path):
    """A hung compiler hung start-up: the build has a timeout, its error names it, and the compiler's own
    children (cc1plus, as, ld: here a `sleep`) are stopped too, leaving no half-written library."""
    child_pid = tmp_path / "child.pid"
    compiler = fake_compiler(tmp_path, f"sleep 3600 &\necho $! > {child_pid}\nwait")
    source = tmp_path / "k.cc"
    source.write_text("int f() { return 1; }\n")
    library = tmp_path / "lib" / "k.so"
    error = cpu_ffi.build_library(str(compiler), (source,), library, timeout_s=1)
    assert error is not None and "timed out" in error and "1 s timeout" in error and str(compiler) in error
    deadline = time.monotonic() + 60
    while not process_gone(int(child_pid.read_text())) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process_gone(int(child_pid.read_text()))
    assert list(library.parent.iterdir()) == []


def test_kernel_error_names_the_compiler_timeout_and_the_engine_keeps_xla(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(fake_compiler(tmp_path, "exec sleep 3600")))
    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setattr(cpu_ffi, "BUILD_TIMEOUT_S", 1)
    cpu_ffi.forget_kernel_error()
    try:
        error = cpu_ffi.kernel_error()
    finally:
        cpu_ffi.forget_kernel_error()  # later tests build with the real compiler
    assert error is not None and "timed out" in error and "BUILD_TIMEOUT_S" in error


@pytest.mark.parametrize("mode, why", [(0o777, "writable by other users"), (0o775, "writable by its group")])
def test_a_kernel_cache_others_can_write_to_is_refused_by_name(tmp_path, monkeypatch, caplog, mode, why):
    """Anyone who can write to the directory a library is loaded from can put their code into this
    process: the kernels are built elsewhere, privately, and a warning names the directory and why."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(shared))
    with caplog.at_level(logging.WARNING, logger="jaxserve.config.cache_dirs"):
        library = cpu_ffi.library_path("c++")
    assert library.parent != shared
    assert cpu_ffi.unsafe_to_load_from(library.parent) is None
    assert any(str(shared) in r.getMessage() and why in r.getMessage() for r in caplog.records)


def test_a_kernel_cache_that_cannot_be_created_is_left_out_and_said(tmp_path, monkeypatch, caplog):
    """A read-only or missing home (here: a path under a regular file, which stops root too): the kernels
    are built in a private temporary directory, with a warning."""
    (tmp_path / "file").write_text("")
    monkeypatch.delenv("JAXSERVE_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "file" / "home"))
    with caplog.at_level(logging.WARNING, logger="jaxserve.config.cache_dirs"):
        library = cpu_ffi.library_path("c++")
    assert not str(library).startswith(str(tmp_path))
    assert cpu_ffi.unsafe_to_load_from(library.parent) is None
    assert any("running without its kernels cache" in r.getMessage() and str(tmp_path / "file") in r.getMessage()
               for r in caplog.records)


def test_the_kernel_cache_this_user_alone_can_write_to_is_used(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(tmp_path / "kernels"))
    assert cpu_ffi.library_path("c++").parent == tmp_path / "kernels"
    assert (tmp_path / "kernels").stat().st_mode & 0o022 == 0


# A stand-in compiler that records each call and makes its output (-o, the last argument). A compile (-c) first
# waits, up to 20 s, until every source's compile has started, and records how many it saw; a link takes {link_s}.
RECORDING_COMPILER = r"""
dir="$(dirname "$0")"
eval out=\${$#}
echo "$*" >> "$dir/calls"
case "$*" in *" -c "*)
  touch "$dir/started.$$"
  n=0
  while [ "$(ls "$dir"/started.* | wc -l)" -lt {sources} ] && [ $n -lt 200 ]; do sleep 0.1; n=$((n+1)); done
  ls "$dir"/started.* | wc -l >> "$dir/seen";;
*) sleep {link_s};;
esac
: > "$out"
"""


def test_each_source_compiles_in_a_process_of_its_own_beside_the_others_then_links(tmp_path):
    sources = []
    for name in ("a", "b", "c"):
        sources.append(tmp_path / f"{name}.cc")
        sources[-1].write_text("int f() { return 1; }\n")
    compiler = fake_compiler(tmp_path, RECORDING_COMPILER.replace("{sources}", "3").replace("{link_s}", "0"))
    library = tmp_path / "lib" / "k.so"
    assert cpu_ffi.build_library(str(compiler), tuple(sources), library, timeout_s=120) is None
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 4 and sorted(" -c " in call for call in calls) == [False, True, True, True], calls
    assert (tmp_path / "seen").read_text().split() == ["3", "3", "3"]  # all three compiling at once
    assert calls[-1].endswith(".so") and " -shared " in calls[-1]  # linked last, into the library
    assert sorted(p.name for p in library.parent.iterdir()) == ["k.so"]  # no objects left behind


def test_two_processes_starting_at_once_build_the_kernels_once(tmp_path):
    """The second waits for the first one's build (a lock beside the library) and loads that."""
    recording = RECORDING_COMPILER.replace("{sources}", str(len(cpu_ffi.SOURCES)))
    compiler = fake_compiler(tmp_path, recording.replace("{link_s}", "5"))  # a window for a second build
    env = dict(os.environ, CXX=str(compiler), JAXSERVE_KERNEL_CACHE=str(tmp_path / "kernels"))
    code = "from jaxserve.ops import cpu_ffi; print(cpu_ffi.kernel_error())"
    processes = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [process.communicate(timeout=300) for process in processes]
    builds = [err.count("building the CPU kernels") for _, err in outputs]
    assert sorted(builds) == [0, 1], outputs
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == len(cpu_ffi.SOURCES) + 1, calls
    # the stand-in compiler's empty library cannot be loaded: both say so, the waiting one included
    assert all("cannot load the CPU kernels" in out for out, _ in outputs), outputs


def functions_in(library, names: tuple[str, ...]) -> dict[str, set[str]]:
    """The instruction mnemonics of each function in `library` whose demangled name starts with one of
    `names`, by its full demangled name (each overload and clone apart)."""
    listing = subprocess.run([shutil.which("objdump"), "-d", "-C", "--no-show-raw-insn", str(library)],
                             capture_output=True, text=True, check=True).stdout
    found: dict[str, set[str]] = {}
    current = None
    for line in listing.splitlines():
        if line.endswith(">:"):
            name = line.split("<", 1)[1].removeprefix("(anonymous namespace)::")
            current = name if any(name.startswith(n + "(") for n in names) else None
        elif current is not None and "\t" in line:
            found.setdefault(current, set()).add(line.split("\t")[1].split()[0])
    return found


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump")
def test_the_tile_units_matmul_keeps_both_its_prefetches():
    """GCC 12 dropped `__builtin_prefetch` from the functions that issue AMX tile instructions, so the built
    AmxPair and AmxBlock never fetched the next panel into L2. Their prefetches are asm statements now; the
    library must hold them: in each, the next panel into L2 (prefetcht2); in AmxBlock the next step's
    weight rows into L1 (prefetcht0), where AmxPair loads its weight tiles with the streaming hint
    (tileloaddt1) instead."""
    if not cpu_ffi.amx_available():
        pytest.skip("the kernels are not built for AMX tiles here")
    library = cpu_ffi.library_path(os.environ.get("CXX", "c++"))
    found = functions_in(library, ("AmxPair", "AmxBlock"))
    kinds = sorted(name.split("(")[0] + (" int8" if "U8Quads" in name else "") for name in found)
    assert kinds == ["AmxBlock", "AmxBlock int8", "AmxPair"], list(found)  # bfloat16's block and pair, int8's block
    for name, mnemonics in found.items():
        weights = "tileloaddt1" if name.startswith("AmxPair") else "prefetcht0"
        assert {weights, "prefetcht2"} <= mnemonics, (name, sorted(mnemonics))
        assert ("tdpbsud" if "U8Quads" in name else "tdpbf16ps") in mnemonics, (name, sorted(mnemonics))


@pytest.mark.skipif(shutil.which("c++") is None or os.uname().machine != "x86_64",
                    reason="needs a C++ compiler (c++ on PATH) on x86-64")
@pytest.mark.parametrize("march", ["haswell", "cooperlake", "sapphirerapids"])
def test_the_kernels_build_without_a_warning_for_each_x86_kind_users_have(march):
    """Each user's machine builds the kernels for itself (-march=native) and logs whatever the compiler
    warns. For the three kinds of x86 CPU the kernels have code for, AVX2 only (haswell), AVX512-BF16
    without AMX (cooperlake) and AMX (sapphirerapids), every source compiles, optimised, without one
    warning: a warning in the code one kind leaves out (an AMX-only variable on the others) reaches only
    those users' logs."""
    import jax

    flags = [f"-march={march}" if flag.startswith("-march") else flag for flag in cpu_ffi.FLAGS if flag != "-shared"]
    runs = [subprocess.Popen([os.environ.get("CXX", "c++"), *flags, "-isystem", jax.ffi.include_dir(), "-c",
                              str(source), "-o", os.devnull], stderr=subprocess.PIPE, text=True)
            for source in cpu_ffi.SOURCES]
    for source, run in zip(cpu_ffi.SOURCES, runs):
        stderr = run.communicate(timeout=600)[1]
        assert run.returncode == 0 and not stderr.strip(), f"{source.name} for {march}:\n{stderr[-2000:]}"
