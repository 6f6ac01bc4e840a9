"""Counting XLA compilations, forbidding them after warm-up, and the persistent compilation cache.

Every executable JAX builds (a real compile or a load from the persistent cache) fires the
backend-compile monitoring event; we count those. `forbid_compilation()` turns any such event into
an error, which is how tests prove that no request compiles anything after warm-up.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
from pathlib import Path
from typing import Callable, Hashable

import jax

from jaxserve.config import cache_dirs

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_count = 0
_forbidden = 0  # nesting depth of forbid_compilation()


class CompilationForbiddenError(RuntimeError):
    """An XLA compilation happened where the engine promised none (after warm-up)."""


def _listener(event: str, duration_secs: float, **kwargs) -> None:
    global _count
    if event != _BACKEND_COMPILE_EVENT:
        return
    with _lock:
        _count += 1
    if _forbidden:
        raise CompilationForbiddenError(
            "an XLA compilation happened after warm-up; a shape escaped the declared buckets"
        )


jax.monitoring.register_event_duration_secs_listener(_listener)

_cache_hits = 0


def _cache_listener(event: str, **kwargs) -> None:
    global _cache_hits
    if event == "/jax/compilation_cache/cache_hits":
        with _lock:
            _cache_hits += 1


jax.monitoring.register_event_listener(_cache_listener)


def num_cache_hits() -> int:
    """Executables loaded from the persistent compilation cache instead of compiled."""
    return _cache_hits


def num_compilations() -> int:
    """Executables built in this process so far."""
    return _count


@contextlib.contextmanager
def forbid_compilation():
    global _forbidden
    _forbidden += 1
    try:
        yield
    finally:
        _forbidden -= 1


# Processes share the cache's directory: data-parallel replicas, servers side by side, test workers. JAX writes
# an entry in place and without a lock unless the cache is bounded, so a process could read an entry that
# another is still writing. Bounded, JAX's least-recently-used eviction holds a file lock around each read and
# write, and every entry is read whole. A bound set by the user (JAX_COMPILATION_CACHE_MAX_SIZE) is kept.
CACHE_MAX_BYTES = 8 << 30


def _stamp_unstamped_entries(path: Path) -> None:
    """Bounded, JAX reads every entry's last-use time (its `-atime` file) before it writes a new entry, and
    drops the write when one is missing. Entries written unbounded (by jaxserve before it bounded the cache,
    or by JAX at its default) have none: each gets its file's modification time."""
    for entry in path.glob("*-cache"):
        stamp = entry.with_name(entry.name.removesuffix("-cache") + "-atime")
        if not stamp.exists():
            with contextlib.suppress(OSError):  # an entry evicted meanwhile
                stamp.write_bytes(entry.stat().st_mtime_ns.to_bytes(8, "little"))


def enable_persistent_cache(cache_dir: str | os.PathLike | None = None) -> Path | None:
    """Points JAX's persistent compilation cache at `cache_dir` (default ~/.cache/jaxserve/xla), bounded
    to CACHE_MAX_BYTES, least recently used entries evicted first.

    JAXSERVE_COMPILATION_CACHE=off disables it; a path there overrides the default. None when it is off,
    or its directory cannot be created (no home directory, a read-only one: said in a warning).
    """
    path = cache_dirs.cache_dir("xla", "JAXSERVE_COMPILATION_CACHE", cache_dir)
    if path is None:
        return None
    if jax.config.jax_compilation_cache_max_size == -1:  # JAX's default: unbounded, and written without a lock
        jax.config.update("jax_compilation_cache_max_size", CACHE_MAX_BYTES)
    if jax.config.jax_compilation_cache_max_size > 0:
        _stamp_unstamped_entries(path)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def compile_all(lower: Callable[[Hashable], object], keys: list, desc: str, show_progress: bool) -> dict:
    """{key: lower(key).compile()} for every key. Lowering traces Python, so it runs one key at a time;
    XLA's compilations release the GIL, so they run side by side on the machine's cores (a GPU host
    compiles a model's buckets several times faster than one after another)."""
    from tqdm.auto import tqdm

    lowered = {key: lower(key) for key in keys}
    workers = max(1, min(len(keys), os.cpu_count() or 1, 8))
    compiled = {}
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jaxserve-compile") as pool, \
            tqdm(total=len(keys), desc=desc, unit="exe", disable=not show_progress) as bar:
        futures = {pool.submit(module.compile): key for key, module in lowered.items()}
        for future in concurrent.futures.as_completed(futures):
            compiled[futures[future]] = future.result()
            bar.update(1)
    return compiled
