"""The C++ paged attention for XLA:CPU: built on first use, registered with the XLA FFI, called.

XLA's own paged attention (`attention.py`) gathers every page of every sequence into a copy and runs
on one thread; on a CPU that is most of a large decode step, and its loops over query tiles and key
blocks, repeated in every layer, made the prompt-step executables slow to compile.
`cpu_kernels/paged_row_attention.cc` takes every query row of a step (decode rows and prompt-chunk
rows alike), reads keys and values in place from the pages and spreads the rows over XLA's own
intra-op threads. It needs a C++ compiler (`c++`, or $CXX) once: the library is cached under
~/.cache/jaxserve/kernels (JAXSERVE_KERNEL_CACHE moves it), keyed by the source, the flags and the
jaxlib version. Without a compiler `kernel_error()` says why, and the engine keeps XLA's attention.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

SOURCE = Path(__file__).parent / "cpu_kernels" / "paged_row_attention.cc"
TARGET = "jaxserve_paged_row_attention"
_registered = False  # XLA keeps the first handler registered under TARGET for the process
_register_lock = threading.Lock()
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
         "-shared", "-fPIC", "-std=c++17", "-w")


def _library_path(compiler: str) -> Path:
    key = "|".join([SOURCE.read_text(), compiler, *FLAGS, jax.__version__, platform.machine()])
    root = os.environ.get("JAXSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "jaxserve" / "kernels"
    return Path(root).expanduser() / f"paged_row_attention-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def kernel_error() -> str | None:
    """Builds (once; then from the cache) and registers the kernel. None when it is ready, else why not."""
    with _register_lock:  # engines started on two threads at once must not register it twice
        return _build_and_register()


@functools.cache
def _build_and_register() -> str | None:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH) to build the CPU attention kernel"
    library = _library_path(compiler)
    if not library.exists():
        print("jaxserve: building the CPU paged attention kernel (once)", file=sys.stderr, flush=True)
        library.parent.mkdir(parents=True, exist_ok=True)
        tmp = library.with_name(f"{library.stem}.tmp{os.getpid()}.so")
        command = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(tmp)]
        build = subprocess.run(command, capture_output=True, text=True)
        if build.returncode != 0:
            tmp.unlink(missing_ok=True)
            return f"building the CPU attention kernel failed: {build.stderr.strip()[-500:]}"
        os.replace(tmp, library)
    global _registered
    if not _registered:
        try:
            handler = ctypes.cdll.LoadLibrary(str(library)).JaxservePagedRowAttention
        except (OSError, AttributeError) as e:
            return f"cannot load the CPU attention kernel {library}: {e}"
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform="cpu")
        _registered = True
    return None


def paged_row_attention(q, k_pages, v_pages, layer, kv_lens, row_seqs, block_tables, *, scale: float,
                        sliding_window=0, soft_cap: float = 0.0):
    """Attention of query rows q [R, H, D]: row r attends to keys 0..kv_lens[r]-1 of the pages
    [num_layers, num_pages, page_size, KVH, D] of `layer`, through block_tables[row_seqs[r]];
    [R, H, D] float32, zeros where kv_len is 0."""
    assert k_pages.dtype == jnp.float32, "the CPU kernel reads float32 pages"
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return call(q.astype(jnp.float32), k_pages, v_pages, i32(layer), i32(kv_lens), i32(row_seqs), i32(block_tables),
                i32(sliding_window), scale=np.float32(scale), soft_cap=np.float32(soft_cap))
