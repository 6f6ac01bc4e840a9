"""Where jaxserve's caches live (`jaxserve/config/cache_dirs.py`) and the rule that each is optional: without a
usable home directory a start goes on without them, saying so, instead of failing. The GGUF caches' and
the kernels' own tests are in test_gguf_cache.py and test_cpu_kernel_build.py."""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from jaxserve.config import cache_dirs
from jaxserve.runner.compilation import enable_persistent_cache


@pytest.fixture
def home_under_a_file(tmp_path, monkeypatch):
    """A HOME nothing can be created in, not even by root (for whom a read-only mode bit stops nothing)."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("HOME", str(tmp_path / "file" / "home"))
    return tmp_path / "file" / "home"


def test_a_cache_that_cannot_be_created_is_none_and_said_once(home_under_a_file, monkeypatch, caplog):
    monkeypatch.delenv("JAXSERVE_TEST_CACHE", raising=False)
    with caplog.at_level(logging.WARNING, logger="jaxserve.config.cache_dirs"):
        assert cache_dirs.cache_dir("test", "JAXSERVE_TEST_CACHE") is None
        assert cache_dirs.cache_dir("test", "JAXSERVE_TEST_CACHE") is None
    (record,) = caplog.records
    assert "running without its test cache" in record.getMessage()
    assert str(home_under_a_file / ".cache" / "jaxserve" / "test") in record.getMessage()
    assert "JAXSERVE_TEST_CACHE" in record.getMessage()


def test_without_a_home_directory_a_cache_is_none_and_said(monkeypatch, caplog):
    """No HOME and no password entry: pathlib cannot name a home, and raises."""
    def no_home(cls):
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("JAXSERVE_TEST_CACHE", raising=False)
    monkeypatch.setattr(pathlib.Path, "home", classmethod(no_home))
    with caplog.at_level(logging.WARNING, logger="jaxserve.config.cache_dirs"):
        assert cache_dirs.cache_dir("nohome", "JAXSERVE_TEST_CACHE") is None
    assert any("no home directory" in r.getMessage() for r in caplog.records)


def test_a_cache_moved_or_turned_off_by_its_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_TEST_CACHE", str(tmp_path / "moved"))
    assert cache_dirs.cache_dir("test", "JAXSERVE_TEST_CACHE") == tmp_path / "moved"
    assert (tmp_path / "moved").is_dir()
    monkeypatch.setenv("JAXSERVE_TEST_CACHE", "off")
    assert cache_dirs.cache_dir("test", "JAXSERVE_TEST_CACHE") is None


def test_the_compilation_cache_without_a_usable_home_is_left_off_and_said(home_under_a_file, monkeypatch, caplog):
    """An engine's start called enable_persistent_cache, which raised on a read-only or missing home."""
    monkeypatch.delenv("JAXSERVE_COMPILATION_CACHE", raising=False)
    before = jax.config.jax_compilation_cache_dir
    with caplog.at_level(logging.WARNING, logger="jaxserve.config.cache_dirs"):
        assert enable_persistent_cache() is None
    assert jax.config.jax_compilation_cache_dir == before
    assert any("running without its xla cache" in r.getMessage() and str(home_under_a_file) in r.getMessage()
               for r in caplog.records)


_COMPILE_INTO = """
import sys
import jax
from jaxserve.runner.compilation import enable_persistent_cache
if len(sys.argv) > 2:
    jax.config.update("jax_compilation_cache_max_size", int(sys.argv[2]))
enable_persistent_cache(sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.jit(lambda x: x * 2 + 1)(jax.numpy.arange(3.0)).block_until_ready()
print(jax.config.jax_compilation_cache_max_size)
"""


@pytest.mark.parametrize("bound", [None, 1 << 20])
def test_the_compilation_cache_is_bounded_so_that_processes_sharing_it_lock_it(tmp_path, bound):
    """JAX writes an unbounded cache's entries without a lock; bounded, it takes its directory's file lock
    around each read and write. Ours is bounded, and a bound the user set is kept."""
    from jaxserve.runner.compilation import CACHE_MAX_BYTES

    extra = [] if bound is None else [str(bound)]
    done = subprocess.run([sys.executable, "-c", _COMPILE_INTO, str(tmp_path), *extra], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) == (CACHE_MAX_BYTES if bound is None else bound)
    names = [p.name for p in tmp_path.iterdir()]
    assert ".lockfile" in names and any(name.endswith("-cache") for name in names), names


def test_entries_written_unbounded_get_a_last_use_time_and_new_entries_are_still_written(tmp_path):
    """A cache that an unbounded JAX filled (jaxserve's, before it was bounded) has entries without the
    last-use time that bounded JAX reads before each write; without one every write failed."""
    legacy = tmp_path / "jit_old-0123456789abcdef-cache"
    legacy.write_bytes(b"an entry from before")
    done = subprocess.run([sys.executable, "-c", _COMPILE_INTO, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Error writing persistent compilation cache" not in done.stderr, done.stderr[-2000:]
    entries = {p.name.removesuffix("-cache") for p in tmp_path.glob("*-cache")}
    assert legacy.name.removesuffix("-cache") in entries and len(entries) > 1, entries  # new ones written
    assert all((tmp_path / f"{key}-atime").exists() for key in entries), entries
