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
from jaxserve.ops.quantized import KINDS, QuantizedWeight
from jaxserve.weights import lazy
from jaxserve.weights.lazy import LazyTensor
from jaxserve.weights.loaded import LoadedModel

# safetensors' dtype codes of the quantized weights and their scales (the rest read as float32)
SAFETENSORS_DTYPES = {"I8": jnp.int8, "F8_E4M3": jnp.float8_e4m3fn, "F32": jnp.float32, "BF16": jnp.float32,
                      "F16": jnp.float32}
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


def quantized_from_hf(cfg: ModelConfig, hf_name: str, weight, scale) -> QuantizedWeight:
    """A quantized checkpoint's matrix (torch layout [N, K], int8 or float8_e4m3fn, as `cfg.quantization`
    says) and its `weight_scale` (one per tensor, or per output channel: [N] or [N, 1]) -> a QuantizedWeight
    [K, N] with a scale per column, the integers or float8 values untouched. LazyTensors stay lazy."""
    dtype = np.dtype(KINDS[cfg.quantization][0])
    if np.dtype(weight.dtype) != dtype:
        raise ModelLoadError(f"tensor {hf_name!r} is {np.dtype(weight.dtype)}, where the checkpoint's "
                             f"quantization_config declares {cfg.quantization} weights ({dtype})")
    n = weight.shape[0]
    if int(np.prod(scale.shape)) not in (1, n):
        raise ModelLoadError(f"tensor {hf_name}_scale has the shape {tuple(scale.shape)}: jaxserve reads a scale "
                             f"per tensor or per output channel ({n}), not per group or block")
    if isinstance(weight, LazyTensor):
        data = lazy.converted(weight.shape, dtype, weight.__getitem__, transpose=True)
        return QuantizedWeight(data, lazy.broadcast_scale(scale, n))
    per_channel = jnp.broadcast_to(jnp.asarray(scale, jnp.float32).reshape(-1), (n,))
    return QuantizedWeight(jnp.asarray(weight).T, per_channel)


def params_from_hf(cfg: ModelConfig, get: Callable[[str], np.ndarray | LazyTensor], dtype: str, desc: str,
                   get_scale: Callable[[str], np.ndarray | LazyTensor | None] | None = None) -> dict:
    """Builds the params pytree; `get(name)` returns a Hugging Face tensor in torch layout, or a
    LazyTensor of it, which makes the param lazy too (read where it is indexed, `lazy.py`).
    get_scale (a quantized checkpoint, `cfg.quantization`): a weight's scale tensor, None where the weight
    is float (the layers the checkpoint left out); the quantized matrices become `QuantizedWeight`s."""
    shapes = param_shapes(cfg)

    def convert(name: str, hf_name: str, shape: tuple[int, ...]):
        source = get(hf_name)
        scale = get_scale(hf_name) if get_scale is not None and _is_torch_linear(name) else None
        if scale is not None:
            array = quantized_from_hf(cfg, hf_name, source, scale)
        elif isinstance(source, LazyTensor):
            array = lazy.converted(source.shape, dtype, source.__getitem__, transpose=_is_torch_linear(name),
                                   offset=_norm_offset(cfg) if "norm" in name else 0.0)
        else:
            array = from_hf(cfg, name, source).astype(dtype)
        if array.shape != shape:
            raise ModelLoadError(f"tensor {hf_name!r} gives {name} the shape {tuple(array.shape)}, "
                                 f"where the model's config implies {shape}")
        return array

    def stack(arrays: list):
        if isinstance(arrays[0], QuantizedWeight):
            if not all(isinstance(a, QuantizedWeight) for a in arrays):
                raise ModelLoadError("a quantized checkpoint's layers must quantize the same matrices")
            return QuantizedWeight(stack([a.data for a in arrays]), stack([a.scale for a in arrays]))
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
    files = SafetensorsFiles(lambda name: path / (weight_map.get(name, "") if weight_map else "model.safetensors"))
    get = files.lazy if lazy else files.get
    get_scale = None
    if cfg.quantization and lazy:  # tp_layout.shard_params cuts arrays, not a QuantizedWeight's data and scales
        raise ModelLoadError(f"{str(path)!r} holds {cfg.quantization} weights (its quantization_config): "
                             f"tensor parallelism over a quantized checkpoint is not supported yet")
    if cfg.quantization:  # the matrices with a weight_scale are quantized, the rest (lm_head, ignored layers) float

        def get_scale(name: str):
            if files.has(f"{name}_scale_inv"):
                raise ModelLoadError(f"tensor {name!r} has block-wise scales ({name}_scale_inv): jaxserve reads "
                                     f"a scale per tensor or per output channel")
            return get(f"{name}_scale") if files.has(f"{name}_scale") else None

        get = (lambda name: files.lazy(name, files.dtype(name))) if lazy else files.get
    params = params_from_hf(cfg, get, dtype, desc=f"loading {path.name}", get_scale=get_scale)
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

    def has(self, name: str) -> bool:
        file = self.file_of(name)
        return file.is_file() and name in self._open(file).keys()

    def dtype(self, name: str) -> np.dtype:
        """The tensor's dtype in its file (safetensors' names: I8, F8_E4M3, BF16, ...)."""
        file, handle = self._handle(name)
        code = self._guard(file, lambda: handle.get_slice(name).get_dtype())
        return np.dtype(SAFETENSORS_DTYPES.get(code, jnp.float32))

    @staticmethod
    def _guard(file: Path, read: Callable):
        from safetensors import SafetensorError

        try:
            return read()
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read {str(file)!r} (truncated or corrupt safetensors?): {e}") from None

    def get(self, name: str):
        file, handle = self._handle(name)
        if self.dtype(name) == jnp.float8_e4m3fn:
            return jnp.asarray(self._guard(file, lambda: self._float8(file, name)))
        return self._guard(file, lambda: handle.get_tensor(name))

    def lazy(self, name: str, dtype=np.float32) -> LazyTensor:
        file, handle = self._handle(name)
        if self.dtype(name) == jnp.float8_e4m3fn:
            tensor = self._guard(file, lambda: self._float8(file, name))
            return LazyTensor(tensor.shape, dtype, lambda index: tensor[index])
        tensor = self._guard(file, lambda: handle.get_slice(name))
        return LazyTensor(tensor.get_shape(), dtype, lambda index: self._guard(file, lambda: tensor[index]))

    @staticmethod
    def _float8(file: Path, name: str) -> np.ndarray:
        """A float8_e4m3fn tensor, mapped from the file: safetensors' numpy reader asks numpy for a type it
        does not have. The format: an 8-byte little-endian header size, the JSON header, the tensors' bytes."""
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            info = json.loads(f.read(size))[name]
        start, _ = info["data_offsets"]
        return np.memmap(file, np.dtype(jnp.float8_e4m3fn), "r", offset=8 + size + start, shape=tuple(info["shape"]))


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
