"""jaxserve's on-disk caches of what a GGUF file's first load builds: its tokenizer, and the whole
model converted (config as JSON, params as safetensors), so that later starts skip parsing GGUF
metadata, building a transformers config and dequantizing.

Entries are keyed by the file's content (a sha256 of all of it, and the dtype for models): a file
replaced in place, even with its size and modification time put back, is another entry. Hashing reads
the whole file once per load, a small part of a start (benchmarks/results/gguf_cache_hash.md). An
entry is written into a temporary directory beside it and renamed into place, under a lock file next to
it (`entry_lock`), so that concurrent first loads of one file convert it once and a reader never sees
half an entry.

The caches are an optimization: a damaged entry is rebuilt, and a cache that cannot be created or written
(no home directory, a read-only one, a full disk) is left out with a warning (`cache_dirs.py`), never an
error. `JAXSERVE_TOKENIZER_CACHE` and `JAXSERVE_MODEL_CACHE` move them (`off` turns either off). What to
build on a miss is `gguf.py`'s business.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from jaxserve.config.cache_dirs import cache_dir, warn_without_cache
from jaxserve.config.model_config import ModelConfig, ModelLoadError
from jaxserve.weights.hf import SafetensorsFiles, load_tokenizer_dir
from jaxserve.weights.loaded import CHECKPOINT_MARKER, LoadedModel, config_from_dict

try:
    import fcntl
except ImportError:  # no flock (Windows): concurrent first loads may each convert; the rename stays atomic
    fcntl = None

CONVERTED_FORMAT = 1  # bump when the params layout or the conversion changes


def file_digest(path: Path) -> str:
    """The sha256 of the file's content: what its cache entries are keyed by (a file's size and
    modification time can be put back after its content changed)."""
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as e:
        raise ModelLoadError(f"cannot read GGUF file {str(path)!r}: {e.strerror or e}") from None


@contextlib.contextmanager
def entry_lock(entry: Path) -> Iterator[None]:
    """Holds the lock of the cache entry `entry` (the file `<entry>.lock` beside it): one process or thread
    at a time checks, builds and writes it. Holding it, no other writer's temporary directory for `entry`
    can be live, so any left (by a process killed mid-write) is removed. Where no lock file can be
    created (a read-only cache) nothing is locked: nothing can be written there either."""
    try:
        fd = os.open(entry.with_name(f"{entry.name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        fd = None
    if fd is None or fcntl is None:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # flock, not lockf: it also excludes this process's other threads
        for stale in entry.parent.glob(f"{glob.escape(entry.name)}.tmp*"):
            shutil.rmtree(stale, ignore_errors=True)
        yield
    finally:
        os.close(fd)  # releases the lock


def _write_entry(entry: Path, write: Callable[[Path], None], cache_name: str) -> None:
    """Calls write(directory) on a fresh temporary directory beside `entry`, then renames it to `entry`;
    removes the temporary directory whatever happens. A cache that cannot be written is warned about and
    skipped. The caller holds `entry_lock(entry)`."""
    tmp = None
    try:
        tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f"{entry.name}.tmp"))
        os.chmod(tmp, 0o755)  # mkdtemp's 0o700 would hide a shared cache's entries from its other users
        write(tmp)
        if entry.exists():
            shutil.rmtree(entry)  # a damaged entry: os.replace cannot replace a non-empty directory
        os.replace(tmp, entry)
        tmp = None
    except OSError as e:
        warn_without_cache(cache_name, f"cannot write {str(entry)!r} ({e.strerror or e})")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# Tokenizers: building one from GGUF metadata is slow for a large vocabulary


def tokenizer_dir(digest: str) -> Path | None:
    """Where the tokenizer built from the GGUF file whose content hashes to `digest` is kept; None
    without a tokenizer cache."""
    root = cache_dir("tokenizers", "JAXSERVE_TOKENIZER_CACHE")
    return None if root is None else root / digest[:32]


def load_tokenizer(cached: Path):
    """The tokenizer saved in `cached`, or None when there is no readable entry."""
    if not (cached / "tokenizer_config.json").exists():
        return None
    try:
        return load_tokenizer_dir(cached, fast=True)
    except ModelLoadError:
        return None  # a damaged entry: the caller builds it again


def save_tokenizer(tokenizer, cached: Path) -> None:
    _write_entry(cached, tokenizer.save_pretrained, "tokenizers")


# ----------------------------------------------------------------------------------------------
# Converted models


def converted_model_dir(path: Path, digest: str, dtype: str) -> Path | None:
    """Where the converted copy of the GGUF file `path`, whose content hashes to `digest`, lives; None
    without a model cache (JAXSERVE_MODEL_CACHE=off, or none can be created)."""
    root = cache_dir("models", "JAXSERVE_MODEL_CACHE")
    if root is None:
        return None
    key = f"{CONVERTED_FORMAT}|{digest}|{dtype}"
    return root / f"{path.stem}-{dtype}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def load_converted(cached: Path, dtype: str, lazy: bool = False) -> tuple[ModelConfig, dict] | None:
    """The cached config and params (of `dtype`, part of the entry's key), or None when there is no
    complete, readable entry. lazy: the params are LazyTensors reading slices of its safetensors file."""
    from safetensors import SafetensorError
    from safetensors.flax import load_file

    if not (cached / CHECKPOINT_MARKER).exists():
        return None
    try:
        cfg = config_from_dict(json.loads((cached / CHECKPOINT_MARKER).read_text())["config"])
        if lazy:
            files = SafetensorsFiles(lambda name: cached / "params.safetensors")
            flat = {name: files.lazy(name, dtype) for name in files.names(cached / "params.safetensors")}
        else:
            flat = load_file(cached / "params.safetensors")
    except (OSError, ValueError, KeyError, TypeError, SafetensorError, ModelLoadError):
        return None  # damaged: the caller converts again and overwrites it
    params: dict = {}
    for name, array in flat.items():
        *parents, leaf = name.split("/")
        node = params
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = array
    return cfg, params


def save_converted(loaded: LoadedModel, cached: Path) -> None:
    from safetensors.flax import save_file

    flat = {}

    def walk(tree: dict, prefix: str) -> None:
        for name, value in tree.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{name}/")
            else:
                flat[prefix + name] = value

    walk(loaded.params, "")

    def write(directory: Path) -> None:
        save_file(flat, directory / "params.safetensors")
        meta = {"config": dataclasses.asdict(loaded.config), "source": loaded.source}
        (directory / CHECKPOINT_MARKER).write_text(json.dumps(meta, indent=2))

    _write_entry(cached, write, "models")
