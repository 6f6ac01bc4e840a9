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

from jaxserve.config.model_config import ModelLoadError
from jaxserve.weights.hf import load_tokenizer_dir
from jaxserve.weights.lazy import LazyTensor
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


def load_checkpoint(path: Path, dtype: str, lazy: bool = False) -> LoadedModel:
    """lazy: the params are LazyTensors that read slices of the stored arrays (through tensorstore,
    which orbax stores them with), so a process reads only what its devices hold."""
    import orbax.checkpoint as ocp

    meta = json.loads((path / CHECKPOINT_MARKER).read_text())
    cfg = config_from_dict(meta["config"])
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            if lazy:
                stored = checkpointer.metadata(path.resolve() / "params").item_metadata
                params = _lazy_tree(stored.tree, path.resolve() / "params", stored.use_zarr3, dtype)
            else:
                params = _tree_cast(checkpointer.restore(path.resolve() / "params"), dtype)
    except Exception as e:  # noqa: BLE001 - orbax's many failure types, as one error naming the checkpoint
        raise ModelLoadError(f"cannot restore the jaxserve checkpoint in {str(path)!r}: {e}") from None
    return LoadedModel(cfg, params, load_tokenizer_dir(path), meta.get("source", str(path)))


def _lazy_tree(tree, directory: Path, use_zarr3: bool, dtype: str):
    """orbax's metadata tree (ArrayMetadata leaves) -> LazyTensors reading each array's slices."""
    if isinstance(tree, dict):
        return {k: _lazy_tree(v, directory, use_zarr3, dtype) for k, v in tree.items()}
    import tensorstore as ts

    spec = {"driver": "zarr3" if use_zarr3 else "zarr",
            "kvstore": {"driver": "ocdbt", "base": f"file://{directory}", "path": tree.name}}
    stored = ts.open(spec, open=True, read=True).result()

    def read(index):
        try:
            return stored[index].read().result()
        except Exception as e:  # noqa: BLE001 - tensorstore's failures, as one error naming the array and checkpoint
            raise ModelLoadError(f"cannot read {tree.name!r} from the jaxserve checkpoint in "
                                 f"{str(directory.parent)!r}: {e}") from None

    return LazyTensor(tree.shape, dtype, read)


def _tree_cast(tree, dtype: str):
    if isinstance(tree, dict):
        return {k: _tree_cast(v, dtype) for k, v in tree.items()}
    return jnp.asarray(tree).astype(dtype)
