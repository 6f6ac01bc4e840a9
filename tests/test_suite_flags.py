"""The XLA flags this suite's conftest adds for compile speed: only flags this jaxlib's XLA knows (an unknown
one ends the process at start-up, exit status 1, before pytest prints a line)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

from conftest import gpu_plugin_installed, xla_defines

FLAG = "xla_cpu_use_fusion_emitters"


def test_a_flag_is_found_only_as_the_c_string_xla_registers(tmp_path):
    registered = tmp_path / "registered.so"  # jaxlib 0.10.2: the flag's name between NULs, as its flag table holds it
    registered.write_bytes(b"\0maximal_mesh[device_id=\0" + FLAG.encode() + b"\0Dump LLVM IR.\0")
    reserved = tmp_path / "reserved.so"  # jaxlib 0.11.2: only a reserved field name in DebugOptions' descriptor
    reserved.write_bytes(b"R\x1bxla_cpu_sparse_cuda_threadsR\x1b" + FLAG.encode() + b"R\x19xla_cpu_use_thunk_runtime")
    assert xla_defines(FLAG, registered)
    assert not xla_defines(FLAG, reserved)
    assert not xla_defines(FLAG, tmp_path / "absent.so")
    assert not xla_defines("xla_cpu_use_fusion", registered)  # a prefix of a flag is not a flag


def test_a_gpu_plugin_is_found_among_jaxs_plugins(tmp_path, monkeypatch):
    (tmp_path / "jax_plugins" / "xla_cuda13").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert gpu_plugin_installed()


def test_the_flags_the_suite_sets_start_this_jaxlibs_xla():
    flags = os.environ["XLA_FLAGS"]
    assert gpu_plugin_installed() or "--xla_backend_optimization_level=0" in flags  # CPU only: see conftest
    done = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; print(int(jnp.arange(4).sum()))"],
                          env=os.environ | {"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "6", (flags, done.stderr[-2000:])
