"""jaxserve's own checkpoints (`jaxserve convert`): the params pytree in orbax, the config as JSON
(`CHECKPOINT_MARKER`) and the tokenizer files, in one directory. The format that reloads fastest:
no renaming, transposing or dequantizing, just the arrays as the model reads them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax.numpy as jnp

from jaxserve.config import ModelLoadError
from jaxserve.weights.hf import load_tokenizer_dir
from jaxserve.weights.loaded import CHECKPOINT_MARKER, LoadedModel, config_from_dict


def is_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / CHECKPOINT_MARKER).exists()


def save_checkpoint(loaded: LoadedModel, dst: str | os.PathLike) -> Path:
    import orbax.checkpoint as ocp

    dst = Path(dst).expanduser().resolve()
    if dst.exists() and any(dst.iterdir()):
        raise ModelLoadError(f"destination {str(dst)!r} exists and is not empty")
    dst.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(dst / "params", loaded.params)
    loaded.tokenizer.save_pretrained(dst)
    meta = {"config": dataclasses.asdict(loaded.config), "dtype": str(loaded.params["embed"].dtype),
            "source": loaded.source}
    (dst / CHECKPOINT_MARKER).write_text(json.dumps(meta, indent=2))
    return dst


def load_checkpoint(path: Path, dtype: str) -> LoadedModel:
    import orbax.checkpoint as ocp

    meta = json.loads((path / CHECKPOINT_MARKER).read_text())
    cfg = config_from_dict(meta["config"])
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            params = checkpointer.restore(path.resolve() / "params")
    except Exception as e:
        raise ModelLoadError(f"cannot restore the jaxserve checkpoint in {str(path)!r}: {e}") from None
    params = _tree_cast(params, dtype)
    return LoadedModel(cfg, params, load_tokenizer_dir(path), meta.get("source", str(path)))


def _tree_cast(tree, dtype: str):
    if isinstance(tree, dict):
        return {k: _tree_cast(v, dtype) for k, v in tree.items()}
    return jnp.asarray(tree).astype(dtype)
