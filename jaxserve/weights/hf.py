"""Hugging Face tensors <-> the params pytree, and Hugging Face model directories.

Owns the Hugging Face name of every param, the one conversion between torch's layout and ours (and
its inverse, which `export.py` writes), and the builder that every source goes through: safetensors
here, GGUF in `gguf.py` after renaming its tensors to these names. Also loads tokenizer directories,
which jaxserve's own checkpoints and caches store in the same format. The layout itself is declared
in `models/params.py`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxserve.config.model_config import ModelConfig, ModelLoadError
from jaxserve.models.params import param_shapes
from jaxserve.weights import lazy
from jaxserve.weights.lazy import LazyTensor
from jaxserve.weights.loaded import LoadedModel

HF_GLOBAL_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}
HF_LAYER_NAMES = {  # under `model.layers.{i}.`
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "post_attn_norm": "post_attention_layernorm.weight",
    "post_mlp_norm": "post_feedforward_layernorm.weight",
}


def hf_layer_names(cfg: ModelConfig) -> dict[str, str]:
    """Each per-layer param of `cfg` -> its Hugging Face name under `model.layers.{i}.`."""
    names = {name: HF_LAYER_NAMES[name] for name in param_shapes(cfg)["layers"]}
    if cfg.sandwich_norm:  # Gemma's post_attention_layernorm follows attention; the MLP has its own pre-norm
        names["mlp_norm"] = "pre_feedforward_layernorm.weight"
    return names


def _is_torch_linear(name: str) -> bool:
    """torch's Linear stores [out, in]; we multiply x @ w, so these are transposed."""
    return name.startswith("w") or name == "lm_head"


def _norm_offset(cfg: ModelConfig) -> float:
    return 1.0 if cfg.architecture == "gemma3" else 0.0  # Gemma scales by (1 + w)


def from_hf(cfg: ModelConfig, name: str, array) -> jnp.ndarray:
    """A Hugging Face tensor (torch layout) -> param `name` in ours, float32."""
    array = jnp.asarray(array, jnp.float32)
    if _is_torch_linear(name):
        array = array.T
    if "norm" in name:
        array = array + _norm_offset(cfg)
    return array


def to_hf(cfg: ModelConfig, name: str, array) -> np.ndarray:
    """The inverse of `from_hf`: param `name` -> the Hugging Face tensor, float32."""
    array = np.asarray(array, np.float32)
    if _is_torch_linear(name):
        array = array.T
    if "norm" in name:
        array = array - _norm_offset(cfg)
    return np.ascontiguousarray(array)


def params_from_hf(cfg: ModelConfig, get: Callable[[str], np.ndarray | LazyTensor], dtype: str, desc: str) -> dict:
    """Builds the params pytree; `get(name)` returns a Hugging Face tensor in torch layout, or a
    LazyTensor of it, which makes the param lazy too (read where it is indexed, `lazy.py`)."""
    shapes = param_shapes(cfg)

    def convert(name: str, hf_name: str, shape: tuple[int, ...]):
        source = get(hf_name)
        if isinstance(source, LazyTensor):
            array = lazy.converted(source.shape, dtype, source.__getitem__, transpose=_is_torch_linear(name),
                                   offset=_norm_offset(cfg) if "norm" in name else 0.0)
        else:
            array = from_hf(cfg, name, source).astype(dtype)
        if array.shape != shape:
            raise ModelLoadError(f"tensor {hf_name!r} gives {name} the shape {tuple(array.shape)}, "
                                 f"where the model's config implies {shape}")
        return array

    def stack(arrays: list):
        return lazy.stacked(arrays) if isinstance(arrays[0], LazyTensor) else jnp.stack(arrays)

    layer_names = hf_layer_names(cfg)
    layers = {name: [] for name in layer_names}
    for i in tqdm(range(cfg.num_layers), desc=desc, unit="layer", leave=False):
        for name, hf_name in layer_names.items():
            layers[name].append(convert(name, f"model.layers.{i}.{hf_name}", shapes["layers"][name][1:]))
    params = {name: convert(name, HF_GLOBAL_NAMES[name], shape) for name, shape in shapes.items() if name != "layers"}
    params["layers"] = {name: stack(arrays) for name, arrays in layers.items()}
    return params


def load_hf_dir(path: Path, dtype: str, lazy: bool = False) -> LoadedModel:
    """A Hugging Face model directory: config.json, safetensors (single or sharded), tokenizer files.
    lazy: the params are LazyTensors that read safetensors slices where they are indexed."""
    cfg = hf_dir_config(path)
    index_file = path / "model.safetensors.index.json"
    if index_file.exists():
        weight_map = json.loads(index_file.read_text())["weight_map"]
    elif (path / "model.safetensors").exists():
        weight_map = None
    else:
        raise ModelLoadError(f"{str(path)!r} has no model.safetensors or model.safetensors.index.json")
    if weight_map is not None:
        missing = [name for name in hf_names(cfg) if name not in weight_map]
        if missing:
            raise ModelLoadError(f"tensor {missing[0]!r} is missing from {str(index_file)!r}")
    files = SafetensorsFiles(lambda name: path / (weight_map[name] if weight_map else "model.safetensors"))
    params = params_from_hf(cfg, files.lazy if lazy else files.get, dtype, desc=f"loading {path.name}")
    return LoadedModel(cfg, params, load_tokenizer_dir(path), str(path))


def hf_dir_config(path: Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face directory: config.json, plus generation_config.json's eos ids."""
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {str(path / 'config.json')!r}: {e}") from None
    return _with_generation_eos(ModelConfig.from_hf(hf_config), path)


def hf_names(cfg: ModelConfig) -> list[str]:
    """The Hugging Face name of every tensor the params of `cfg` are built from."""
    layers = [f"model.layers.{i}.{name}" for i in range(cfg.num_layers) for name in hf_layer_names(cfg).values()]
    return [HF_GLOBAL_NAMES[name] for name in param_shapes(cfg) if name != "layers"] + layers


class SafetensorsFiles:
    """Tensors by name from safetensors files (`file_of(name)`, opened once each): whole (`get`) or as
    LazyTensors reading slices (`lazy`). Anything unreadable is a ModelLoadError naming the file."""

    def __init__(self, file_of: Callable[[str], Path]):
        self.file_of, self.handles = file_of, {}

    def _open(self, file: Path):
        from safetensors import safe_open

        if file not in self.handles:
            self.handles[file] = self._guard(file, lambda: safe_open(file, framework="flax"))
        return self.handles[file]

    def _handle(self, name: str):
        file = self.file_of(name)
        if name not in self._open(file).keys():
            raise ModelLoadError(f"tensor {name!r} is missing from {str(file)!r}")
        return file, self._open(file)

    def names(self, file: Path) -> list[str]:
        return list(self._open(file).keys())

    @staticmethod
    def _guard(file: Path, read: Callable):
        from safetensors import SafetensorError

        try:
            return read()
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read {str(file)!r} (truncated or corrupt safetensors?): {e}") from None

    def get(self, name: str):
        file, handle = self._handle(name)
        return self._guard(file, lambda: handle.get_tensor(name))

    def lazy(self, name: str, dtype=np.float32) -> LazyTensor:
        file, handle = self._handle(name)
        tensor = self._guard(file, lambda: handle.get_slice(name))
        return LazyTensor(tensor.get_shape(), dtype, lambda index: self._guard(file, lambda: tensor[index]))


def load_tokenizer_dir(path: Path, *, fast: bool = False, **kwargs):
    """AutoTokenizer, or with `fast` the `tokenizers`-backed class directly: for the tokenizers jaxserve
    saved itself, it skips the config machinery, which imports torch when torch is installed."""
    if fast:
        from transformers import PreTrainedTokenizerFast as tokenizer_class
    else:
        from transformers import AutoTokenizer as tokenizer_class

    try:
        return tokenizer_class.from_pretrained(path, **kwargs)
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {str(path)!r}: {str(e).splitlines()[0]}") from None


def _with_generation_eos(cfg: ModelConfig, path: Path) -> ModelConfig:
    """generation_config.json may list more end-of-sequence ids than config.json (Llama 3 does)."""
    gen_file = path / "generation_config.json"
    if not gen_file.exists():
        return cfg
    eos = json.loads(gen_file.read_text()).get("eos_token_id")
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    merged = tuple(dict.fromkeys([*cfg.eos_token_ids, *eos]))
    return dataclasses.replace(cfg, eos_token_ids=merged)
