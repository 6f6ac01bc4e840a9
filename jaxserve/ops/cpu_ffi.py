"""jaxserve's C++ kernels for XLA:CPU: built on first use, registered with the XLA FFI, called.

- `paged_row_attention` (`cpu_kernels/paged_row_attention.cc`). XLA's own paged attention
  (`attention.py`) gathers every page of every sequence into a copy and runs on one thread; on a CPU
  that is most of a large decode step, and its loops over query tiles and key tiles, repeated in
  every layer, made the prompt-step executables slow to compile. The kernel takes every query row of
  a step (decode rows and prompt-chunk rows alike) and reads keys and values in place from the pages.
- the packed-weight matmul (`cpu_kernels/packed_matmul.cc`): the weights packed in column panels at
  load, in float32, bfloat16 or int8; its Python side (`PackedWeight`, `matmul`, `silu_gated_matmul`)
  is `packed_matmul.py`.
- `lora_bgmv` (`cpu_kernels/lora_bgmv.cc`): the LoRA deltas of a batch mixing adapters, each token
  through its own adapter slot; its Python side is `ops/lora.py`.
- `truncation_threshold` and `argmax_rows` (`cpu_kernels/truncation.cc`): the sampler's top-k / top-p
  threshold of each row, where XLA's reductions take dozens of passes over the vocabulary, and its greedy
  token in one pass over the row, where XLA's takes two; their Python side is `ops/sampling.py`.
- `add_rms_norm` (`cpu_kernels/residual_norm.cc`): a decoder layer's residual add and the RMSNorm after it,
  rounded to bfloat16 for the next bfloat16 matmul (or in float32 for the int8 one), in one pass over each
  row where XLA ran three operations; its user is `models/transformer.py`.

All five spread their work over XLA's own intra-op threads. They need a C++ compiler (`c++`, or $CXX)
once: the library is cached under ~/.cache/jaxserve/kernels (JAXSERVE_KERNEL_CACHE moves it), keyed
by everything that decides the machine code (`cache_key`): the sources, the compiler and its flags,
the jax version, and the CPU's instruction-set features, since `-march=native` builds for this CPU
alone and a cache shared with another CPU (a home directory on a cluster) must not load it, or the
first kernel call dies of SIGILL. The features come from two places: the compiler itself (the macros
that `-march=native` predefines, `__AVX2__`, `__AVX512F__`, `__ARM_FEATURE_SVE` ...: exactly the
instruction sets the library may use, on any OS, with GCC or clang) and, on Linux, the `flags` line
of /proc/cpuinfo, which also tells apart CPUs whose differences no macro names; a key a little finer
than needed costs at most a rebuild. Compiler warnings (-Wall) go to the log. Without a compiler, or
when the compiler runs past BUILD_TIMEOUT_S, `kernel_error()` says why, and the engine keeps XLA's
attention and dot. Activations are float32; KV pages float32, bfloat16 or float8 e4m3 (`kv_cache_dtype`).

On a CPU with AMX (Intel Xeon since Sapphire Rapids) the bfloat16 and int8 matmuls multiply whole
blocks of 16 rows on its tiles (`amx_in_use`); JAXSERVE_CPU_AMX=0 keeps them on the vector code.

A library is loaded only from a directory of this user's that nobody else can write to (a directory
others can write to lets them put their code into this process): a kernel cache that is not (a shared
/tmp, a group-writable home), or that cannot be created (no home directory, a read-only one), is left
out with a warning naming it and why, and the kernels are built for this process alone in a private
temporary directory (JAXSERVE_KERNEL_CACHE=off does the same without the warning).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import cache_dirs

logger = logging.getLogger(__name__)
KERNELS_DIR = Path(__file__).parent / "cpu_kernels"
SOURCES = (KERNELS_DIR / "paged_row_attention.cc", KERNELS_DIR / "packed_matmul.cc", KERNELS_DIR / "lora_bgmv.cc",
           KERNELS_DIR / "truncation.cc", KERNELS_DIR / "residual_norm.cc")
HEADERS = (KERNELS_DIR / "parallel_for.h", KERNELS_DIR / "vec_math.h", KERNELS_DIR / "amx.h")
TARGETS = {  # FFI target -> handler symbol
    "jaxserve_paged_row_attention": "JaxservePagedRowAttention",
    "jaxserve_paged_row_attention_bf16_pages": "JaxservePagedRowAttentionBf16Pages",
    "jaxserve_write_bf16_pages": "JaxserveWriteBf16Pages",
    "jaxserve_packed_matmul": "JaxservePackedMatmul",
    "jaxserve_packed_gated_matmul": "JaxservePackedGatedMatmul",
    "jaxserve_packed_matmul_bf16": "JaxservePackedMatmulBf16",
    "jaxserve_packed_gated_matmul_bf16": "JaxservePackedGatedMatmulBf16",
    "jaxserve_packed_gated_matmul_bf16_out": "JaxservePackedGatedMatmulBf16Out",
    "jaxserve_packed_gated_matmul_add": "JaxservePackedGatedMatmulAdd",
    "jaxserve_packed_gated_matmul_add_bf16": "JaxservePackedGatedMatmulAddBf16",
    "jaxserve_packed_matmul_int8": "JaxservePackedMatmulInt8",
    "jaxserve_packed_gated_matmul_int8": "JaxservePackedGatedMatmulInt8",
    "jaxserve_packed_matmul_fp8": "JaxservePackedMatmulFp8",
    "jaxserve_packed_gated_matmul_fp8": "JaxservePackedGatedMatmulFp8",
    "jaxserve_packed_gated_matmul_fp8_bf16_out": "JaxservePackedGatedMatmulFp8Bf16Out",
    "jaxserve_paged_row_attention_fp8_pages": "JaxservePagedRowAttentionFp8Pages",
    "jaxserve_paged_row_attention_bf16_pages_bf16_out": "JaxservePagedRowAttentionBf16PagesBf16Out",
    "jaxserve_paged_row_attention_fp8_pages_bf16_out": "JaxservePagedRowAttentionFp8PagesBf16Out",
    "jaxserve_write_fp8_pages": "JaxserveWriteFp8Pages",
    "jaxserve_rope_write_bf16_pages": "JaxserveRopeWriteBf16Pages",
    "jaxserve_rope_write_fp8_pages": "JaxserveRopeWriteFp8Pages",
    "jaxserve_lora_bgmv": "JaxserveLoraBgmv",
    "jaxserve_lora_bgmv_bf16": "JaxserveLoraBgmvBf16",
    "jaxserve_truncation_threshold": "JaxserveTruncationThreshold",
    "jaxserve_argmax_rows": "JaxserveArgmaxRows",
    "jaxserve_add_rms_norm": "JaxserveAddRmsNorm",
    "jaxserve_add_rms_norm_f32": "JaxserveAddRmsNormF32",
}
# The attention kernel's and the page writer's FFI targets by page dtype (float32 pages are written by XLA).
_PAGE_SUFFIX = {jnp.dtype(jnp.float32): "", jnp.dtype(jnp.bfloat16): "_bf16_pages",
                jnp.dtype(jnp.float8_e4m3fn): "_fp8_pages"}
PANEL_WIDTH = 48  # columns per packed panel: kPanelWidth in packed_matmul.cc, which checks it
_registered = False  # XLA keeps the first handler registered under a target for the process
_library: ctypes.CDLL | None = None  # the loaded kernels, once registered
_register_lock = threading.Lock()
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math", "-shared", "-fPIC", "-std=c++17", "-Wall")
# The compiler's limit: far above a build's time on a slow machine, so that only a hung compiler meets it.
BUILD_TIMEOUT_S = 600


def cpu_features() -> str:
    """This CPU's instruction-set features as the operating system reports them (Linux: the `flags`
    line of /proc/cpuinfo on x86, `Features` on Arm), else the processor's name."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() in ("flags", "Features"):
                    return " ".join(sorted(value.split()))
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def native_target(compiler: str) -> str:
    """The macros `compiler` predefines for this CPU under FLAGS' target options (`-march=native`):
    what the flag resolved to, sorted; empty when the compiler cannot say."""
    target_flags = [flag for flag in FLAGS if flag.startswith("-m")]
    command = [compiler, *target_flags, "-dM", "-E", "-x", "c++", os.devnull]
    try:
        macros = subprocess.run(command, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        macros = ""
    return "\n".join(sorted(macros.splitlines()))


def bf16_dot_instructions() -> bool:
    """Whether the kernels are built for AVX512-BF16 here (vdpbf16ps: the bfloat16 matmul at twice float32's
    rate); False without a compiler."""
    compiler = os.environ.get("CXX", "c++")
    return shutil.which(compiler) is not None and "__AVX512BF16__" in native_target(compiler)


@functools.cache
def compiler_identity(compiler: str) -> str:
    """The compiler's resolved path and version line: another compiler makes other code."""
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    first_line = version.splitlines()[0] if version else ""
    return f"{shutil.which(compiler) or compiler} {first_line}"


def cache_key(sources: list[str], compiler: str, flags: tuple[str, ...], jax_version: str, machine: str,
              features: str) -> str:
    """The library's cache key: a change in any input that decides the machine code changes it.

    compiler: its identity (`compiler_identity`); features: the CPU's instruction sets (`cpu_features`
    and `native_target`). JSON keeps the inputs apart: no two different input lists hash the same text.
    """
    parts = [sources, compiler, list(flags), jax_version, machine, features]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def library_path(compiler: str) -> Path:
    """Where the library for `compiler` is built and loaded from: in `kernel_dir()`, named by `cache_key`."""
    features = f"{cpu_features()}\n{native_target(compiler)}"
    key = cache_key([source.read_text() for source in SOURCES + HEADERS], compiler_identity(compiler), FLAGS,
                    jax.__version__, platform.machine(), features)
    return kernel_dir() / f"cpu_kernels-{key}.so"


def unsafe_to_load_from(directory: Path) -> str | None:
    """Why a shared library in `directory` must not be loaded: someone other than this user owns the
    directory or can write to it, and so could have put their code there. None when it is safe."""
    info = directory.stat()
    if info.st_uid != os.getuid():
        return f"it is owned by uid {info.st_uid}, not by this user (uid {os.getuid()})"
    if info.st_mode & 0o022:
        who = "other users" if info.st_mode & 0o002 else "its group"
        return f"it is writable by {who} (mode {stat.S_IMODE(info.st_mode):#o})"
    return None


def kernel_dir() -> Path:
    """The kernel cache directory, created, where it can be and is safe to load from (`unsafe_to_load_from`);
    else, with a warning naming it and why, a private temporary directory of this process's."""
    root = cache_dirs.cache_dir("kernels", "JAXSERVE_KERNEL_CACHE", mode=0o755)
    if root is None:
        return _private_kernel_dir()
    try:
        reason = unsafe_to_load_from(root)
    except OSError as e:
        reason = f"it cannot be examined ({e.strerror or e})"
    if reason is None:
        return root
    cache_dirs.warn_without_cache("kernels", f"not loading the CPU kernels from {str(root)!r}: {reason}; building "
                                             f"them for this process alone (make it yours and `chmod go-w` it, or "
                                             f"point JAXSERVE_KERNEL_CACHE elsewhere)")
    return _private_kernel_dir()


@functools.cache
def _private_kernel_dir() -> Path:
    directory = Path(tempfile.mkdtemp(prefix="jaxserve-kernels-"))  # mode 0o700, this user's
    atexit.register(shutil.rmtree, directory, ignore_errors=True)  # a loaded library stays mapped
    return directory


def build_library(compiler: str, sources: tuple[Path, ...], library: Path,
                  timeout_s: float | None = None) -> str | None:
    """Compiles `sources` into the shared library `library` (atomically); returns why it failed, or
    None. Compiler warnings are logged. timeout_s (default BUILD_TIMEOUT_S): the compiler is stopped
    after that long, and the build has failed.

    Each source compiles in a compiler process of its own, side by side, and the objects are linked:
    the attention kernel alone is most of a build (on a 2-core AVX2 EPYC, 36 s of the 57 s that one
    compiler process took for all three sources)."""
    timeout_s = BUILD_TIMEOUT_S if timeout_s is None else timeout_s
    tmp = library.with_name(f"{library.stem}.tmp{os.getpid()}-{threading.get_ident()}.so")
    objects_dir = tmp.with_suffix(".objects")
    objects = [objects_dir / f"{i}-{source.stem}.o" for i, source in enumerate(sources)]
    # JAX's FFI headers as system headers: their warnings are not ours to fix.
    compile_flags = [flag for flag in FLAGS if flag != "-shared"]
    compiles = [[compiler, *compile_flags, "-isystem", jax.ffi.include_dir(), "-c", str(source), "-o", str(obj)]
                for source, obj in zip(sources, objects)]
    link = [compiler, *FLAGS, *map(str, objects), "-o", str(tmp)]
    deadline = time.monotonic() + timeout_s
    try:
        objects_dir.mkdir(parents=True)
        warnings = []
        for step in (compiles, [link]):
            for returncode, stderr in _run_compilers(step, deadline):
                if returncode != 0:
                    return f"building the CPU kernels failed: {stderr.strip()[-500:]}"
                warnings.append(stderr.strip())
        if any(warnings):
            logger.warning("the CPU kernels built with compiler warnings:\n%s", "\n".join(filter(None, warnings)))
        os.chmod(tmp, 0o755)  # whatever the umask: nobody else may write code this process loads
        os.replace(tmp, library)
    except subprocess.TimeoutExpired:
        return (f"building the CPU kernels timed out: the compiler {compiler!r} ran longer than the "
                f"{timeout_s:g} s timeout (BUILD_TIMEOUT_S) and was stopped")
    except OSError as e:
        return f"building the CPU kernels into {str(library.parent)!r} failed: {e}"
    finally:
        tmp.unlink(missing_ok=True)
        shutil.rmtree(objects_dir, ignore_errors=True)
    return None


def _run_compilers(commands: list[list[str]], deadline: float) -> list[tuple[int, str]]:
    """(exit status, stderr) of each command, run side by side, each in its own process group so that a
    timeout stops all they started (the driver's cc1plus, as and ld would outlive it and write the output
    after we gave up). Raises subprocess.TimeoutExpired when time.monotonic() passes `deadline` first."""
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in commands]  # a pipe could fill
        processes = []
        try:
            for command, log in zip(commands, logs):
                processes.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, text=True,
                                                  start_new_session=True))
            for process in processes:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except BaseException:  # the deadline, or a process that could not start: stop every one started
            for process in processes:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            raise
        results = []
        for process, log in zip(processes, logs):
            log.seek(0)
            results.append((process.returncode, log.read()))
        return results


@contextlib.contextmanager
def _build_lock(library: Path):
    """Held while `library` is built: a second process (a test suite's other worker, a server's replica)
    waits for the first one's build and loads it, rather than compiling the same kernels beside it."""
    with open(library.with_name(library.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def kernel_error() -> str | None:
    """Builds (once; then from the cache) and registers the kernels. None when they are ready, else why not."""
    with _register_lock:  # engines started on two threads at once must not register them twice
        return _build_and_register()


def forget_kernel_error() -> None:
    """Forgets kernel_error()'s answer, so that its next call looks for the compiler and the cached
    library again (after $CXX or the cache directory changed). Registered kernels stay registered."""
    with _register_lock:
        _build_and_register.cache_clear()


@functools.cache
def _build_and_register() -> str | None:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH) to build the CPU kernels"
    try:
        library = library_path(compiler)
    except OSError as e:  # not even a temporary directory to build in
        return f"no directory to build the CPU kernels in: {e}"
    if not library.exists():
        try:
            with _build_lock(library):
                if not library.exists():  # nobody built it while this process waited for the lock
                    print("jaxserve: building the CPU kernels (once)", file=sys.stderr, flush=True)
                    error = build_library(compiler, SOURCES, library)
                    if error is not None:
                        return error
        except OSError as e:
            return f"cannot lock the CPU kernels' build in {str(library.parent)!r}: {e}"
    global _registered, _library
    if not _registered:
        try:
            lib = ctypes.cdll.LoadLibrary(str(library))
            handlers = {target: getattr(lib, symbol) for target, symbol in TARGETS.items()}
            panel_width = lib.JaxservePackedMatmulPanelWidth()
        except (OSError, AttributeError) as e:
            return f"cannot load the CPU kernels {library}: {e}"
        if panel_width != PANEL_WIDTH:
            return f"the CPU matmul kernel packs {panel_width} columns per panel, cpu_ffi.py {PANEL_WIDTH}"
        for target, handler in handlers.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
        _library = lib
        _registered = True
        if os.environ.get("JAXSERVE_CPU_AMX") == "0":  # the vector code alone, for comparison
            lib.JaxserveSetAmx(0)
    return None


def amx_available() -> bool:
    """Whether the bfloat16 and int8 matmuls can multiply their rows on AMX tiles (bfloat16: every row; int8:
    whole blocks of 16): kernels built for a CPU with AMX-BF16 and AMX-INT8 (Intel Xeon since Sapphire
    Rapids), and Linux granting the tile state. False where the kernels are not built."""
    return kernel_error() is None and _library is not None and bool(_library.JaxserveAmxAvailable())


def amx_in_use() -> bool:
    """amx_available(), and not turned off by `set_amx(False)`."""
    return amx_available() and bool(_library.JaxserveAmxInUse())


def amx_blocks() -> int:
    """How many blocks of 16 rows by one 48-column panel the matmuls have multiplied on AMX tiles in this
    process (0 where the kernels are not built)."""
    if kernel_error() is not None or _library is None:
        return 0
    _library.JaxserveAmxBlocks.restype = ctypes.c_int64
    return int(_library.JaxserveAmxBlocks())


def set_amx(enabled: bool) -> None:
    """Lets (or stops) the bfloat16 and int8 matmuls use AMX tiles, process-wide, from the next call on: the
    vector path then does every row (the tests compare the two). No effect where the kernels are not built."""
    if kernel_error() is None and _library is not None:
        _library.JaxserveSetAmx(int(bool(enabled)))


def paged_row_attention(q, k_pages, v_pages, layer, kv_lens, row_seqs, block_tables, *, scale: float,
                        sliding_window=0, soft_cap: float = 0.0, bf16_products: bool = False, out_dtype=jnp.float32):
    """Attention of query rows q [R, H, D]: row r attends to keys 0..kv_lens[r]-1 of the pages
    [num_layers, num_pages, page_size, KVH, D] of `layer`, through block_tables[row_seqs[r]];
    [R, H, D] float32, zeros where kv_len is 0. Pages in float32, bfloat16 or float8 e4m3 (kv_cache_dtype;
    read and widened to float32 in the kernel: a half or a quarter of the bytes).

    bf16_products: the prompt tiles' two products take operands rounded to bfloat16 (float32 sums), and
    over bfloat16 or float8 pages a decode row multiplies the pages' keys and values as they lie (float8
    widened to bfloat16 in the register, its subnormals read as zero) by its query and softmax weights
    rounded to bfloat16, where the kernels are built for AVX512-BF16 (`bf16_dot_instructions`); ignored
    elsewhere.

    out_dtype bfloat16 (over bfloat16 or float8 pages): the result rounded to nearest even in the kernel, each
    part by the thread that computed it (float32 subnormals to zero where the CPU has AVX512-BF16), for a
    bfloat16 matmul next, in place of XLA's conversion between the two calls."""
    assert k_pages.dtype == v_pages.dtype and k_pages.dtype in _PAGE_SUFFIX, k_pages.dtype
    out_dtype = jnp.dtype(out_dtype)
    assert out_dtype == jnp.float32 or (out_dtype == jnp.bfloat16 and k_pages.dtype != jnp.float32), out_dtype
    suffix = _PAGE_SUFFIX[k_pages.dtype] + ("_bf16_out" if out_dtype == jnp.bfloat16 else "")
    target = "jaxserve_paged_row_attention" + suffix
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, out_dtype))
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return call(q.astype(jnp.float32), k_pages, v_pages, i32(layer), i32(kv_lens), i32(row_seqs), i32(block_tables),
                i32(sliding_window), scale=np.float32(scale), soft_cap=np.float32(soft_cap),
                bf16_products=np.int32(bf16_products))


def write_pages(k_pages, v_pages, layer, k, v, slot_mapping):
    """`attention.write_kv` for bfloat16 or float8 e4m3 pages: k and v [T, KVH, D] rounded (float8:
    clipped to +-attention.FP8_MAX first) into the slots of `layer`, in place (the page arrays are
    aliased to the results). XLA:CPU has no scatter in these dtypes: it widens the whole page array to
    float32 and back around one, seconds per step for a large pool."""
    assert k_pages.dtype == v_pages.dtype and _PAGE_SUFFIX.get(k_pages.dtype), k_pages.dtype
    pages = jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype)
    call = jax.ffi.ffi_call("jaxserve_write" + _PAGE_SUFFIX[k_pages.dtype], (pages, pages),
                            input_output_aliases={0: 0, 1: 1})
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return call(k_pages, v_pages, k.astype(jnp.float32), v.astype(jnp.float32), i32(layer), i32(slot_mapping))


def rope_write_pages(k_pages, v_pages, layer, qkv, cos, sin, slot_mapping, *, num_heads: int):
    """The qkv matmul's rows [T, (H + 2 KVH) D] -> q [T, H, D] float32 rotated by the rope (cos and sin
    [T, D / 2], `transformer.apply_rope`'s halves, each x1 cos - x2 sin and x2 cos + x1 sin one fused
    multiply-add onto the other product), with k rotated the same way and v written into the bfloat16 or
    float8 pages of `layer` as `write_pages` writes them, in one call (the pages aliased to the results)."""
    assert k_pages.dtype == v_pages.dtype and _PAGE_SUFFIX.get(k_pages.dtype), k_pages.dtype
    head_dim = k_pages.shape[-1]
    pages = jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype)
    q = jax.ShapeDtypeStruct((qkv.shape[0], num_heads, head_dim), jnp.float32)
    call = jax.ffi.ffi_call("jaxserve_rope_write" + _PAGE_SUFFIX[k_pages.dtype], (pages, pages, q),
                            input_output_aliases={0: 0, 1: 1})
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    k_pages, v_pages, q = call(k_pages, v_pages, f32(qkv), f32(cos), f32(sin), i32(layer), i32(slot_mapping))
    return q, k_pages, v_pages


def add_rms_norm(h, add, weight, eps: float, norm_dtype=jnp.bfloat16):
    """(h + add, rms_norm(h + add, weight, eps) in norm_dtype) for h, add [T, E] and weight [E], in one kernel
    call (cpu_kernels/residual_norm.cc): the sum in float32, the norm as `transformer.rms_norm` computes it in
    float32 (its mean summed in another order), rounded to nearest even under bfloat16 (the next bfloat16
    matmul's input), kept in float32 under float32 (the int8 matmul's, which quantizes its rows itself). The
    sum takes h's buffer where XLA can give it."""
    f32 = jnp.float32
    bf16 = jnp.dtype(norm_dtype) == jnp.bfloat16
    assert bf16 or jnp.dtype(norm_dtype) == f32, norm_dtype
    out = (jax.ShapeDtypeStruct(h.shape, f32), jax.ShapeDtypeStruct(h.shape, norm_dtype))
    call = jax.ffi.ffi_call("jaxserve_add_rms_norm" if bf16 else "jaxserve_add_rms_norm_f32", out,
                            input_output_aliases={0: 0})
    return call(h.astype(f32), add.astype(f32), weight.astype(f32), eps=np.float32(eps))
