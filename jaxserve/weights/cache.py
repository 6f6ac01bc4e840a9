"""jaxserve's on-disk caches of what a GGUF file's first load builds: its tokenizer, and the whole
model converted (config as JSON, params as safetensors), so that later starts skip parsing GGUF
metadata, building a transformers config and dequantizing.

Entries are keyed by the file's path, size and modification time (and the dtype, for models). The
caches are an optimization: a damaged entry is rebuilt and a failed write is ignored, never an error.
`JAXSERVE_TOKENIZER_CACHE` and `JAXSERVE_MODEL_CACHE` move them (`JAXSERVE_MODEL_CACHE=off` turns the
model cache off). What to build on a miss is `gguf.py`'s business.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

from jaxserve.config import ModelConfig, ModelLoadError
from jaxserve.weights.hf import SafetensorsFiles, load_tokenizer_dir
from jaxserve.weights.loaded import CHECKPOINT_MARKER, LoadedModel, config_from_dict

CONVERTED_FORMAT = 1  # bump when the params layout or the conversion changes


def _file_key(path: Path) -> str:
    stat = path.stat()
    return f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"


# ----------------------------------------------------------------------------------------------
# Tokenizers: building one from GGUF metadata is slow for a large vocabulary


def tokenizer_dir(path: Path) -> Path:
    """Where the tokenizer built from the GGUF file `path` is kept."""
    key = hashlib.sha256(_file_key(path).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("JAXSERVE_TOKENIZER_CACHE", Path.home() / ".cache" / "jaxserve" / "tokenizers"))
    return cache.expanduser() / key


def load_tokenizer(cached: Path):
    """The tokenizer saved in `cached`, or None when there is no readable entry."""
    if not (cached / "tokenizer_config.json").exists():
        return None
    try:
        return load_tokenizer_dir(cached, fast=True)
    except ModelLoadError:
        return None  # a damaged entry: the caller builds it again


def save_tokenizer(tokenizer, cached: Path) -> None:
    try:
        tmp = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, cached) if not cached.exists() else shutil.rmtree(tmp)
    except OSError:
        pass  # a read-only home must not stop loading


# ----------------------------------------------------------------------------------------------
# Converted models


def converted_model_dir(path: Path, dtype: str) -> Path | None:
    """Where the converted copy of the GGUF file `path` lives; None when JAXSERVE_MODEL_CACHE=off."""
    setting = os.environ.get("JAXSERVE_MODEL_CACHE", "")
    if setting.lower() in ("off", "0", "false", "none"):
        return None
    key = f"{CONVERTED_FORMAT}|{_file_key(path)}|{dtype}"
    root = Path(setting or Path.home() / ".cache" / "jaxserve" / "models").expanduser()
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
    tmp = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        save_file(flat, tmp / "params.safetensors")
        meta = {"config": dataclasses.asdict(loaded.config), "source": loaded.source}
        (tmp / CHECKPOINT_MARKER).write_text(json.dumps(meta, indent=2))
        if cached.exists():
            shutil.rmtree(cached)
        os.replace(tmp, cached)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk must not stop loading
