"""Where jaxserve's on-disk caches live: one directory per cache under ~/.cache/jaxserve (the GGUF
conversions `models`, the GGUF tokenizers `tokenizers`, XLA's compiled executables `xla`, the C++
kernels `kernels`), each movable by its environment variable and turned off by `off` there.

Owns only the location and the rule that a cache is optional: a cache that cannot be created (no home
directory, a read-only one, a path under a regular file) is left out with one warning saying so, and
jaxserve starts without it. What goes into each cache, and reading it, is its owner's business
(`weights/cache.py`, `compilation.py`, `cpu_ffi.py`).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

logger = logging.getLogger(__name__)
OFF = ("off", "0", "false", "none")
_warned: set[str] = set()
_warned_lock = threading.Lock()


def cache_setting_off(env_var: str) -> bool:
    """Whether the user turned the cache that `env_var` locates off."""
    return os.environ.get(env_var, "").strip().lower() in OFF


def cache_root(name: str, env_var: str) -> Path | None:
    """The directory of the `name` cache, not created: $env_var if set, else ~/.cache/jaxserve/<name>.
    None when $env_var turns it off or there is no home directory to put it in (said once)."""
    if cache_setting_off(env_var):
        return None
    setting = os.environ.get(env_var, "")
    try:
        return Path(setting or Path.home() / ".cache" / "jaxserve" / name).expanduser()
    except RuntimeError as e:  # no $HOME and no password-database entry: Path.home() cannot answer
        warn_without_cache(name, f"there is no home directory ({e}); set {env_var} to keep one")
        return None


def cache_dir(name: str, env_var: str, path: str | os.PathLike | None = None, mode: int = 0o777) -> Path | None:
    """`cache_root` (or `path`, a caller's own choice), created (its last part with `mode`, less the umask);
    None (said once) when it is off or cannot be created."""
    root = cache_root(name, env_var) if path is None or cache_setting_off(env_var) else Path(path).expanduser()
    if root is None:
        return None
    try:
        root.mkdir(mode=mode, parents=True, exist_ok=True)
    except OSError as e:
        warn_without_cache(name, f"cannot create {str(root)!r} ({e.strerror or e}); set {env_var} to move it")
        return None
    return root


def warn_without_cache(name: str, why: str) -> None:
    """Says that jaxserve goes on without the `name` cache and why: once per process for each reason, since
    every load asks again."""
    message = f"jaxserve: running without its {name} cache: {why}"
    with _warned_lock:
        if message in _warned:
            return
        _warned.add(message)
    logger.warning("%s", message)
