"""GGUF files (llama.cpp's format): metadata -> config and tokenizer via transformers, tensors via the
`gguf` package.

Owns llama.cpp's tensor names (renamed to Hugging Face's, so `hf.params_from_hf` builds the params),
what llama.cpp changes in the weights on the way in (q/k row order, Gemma's folded norms), and which
tensor types load: every type the installed `gguf` package can dequantize. A first load converts the
file and stores the result in `cache.py`'s caches; later loads read those.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from pathlib import Path

import numpy as np

from jaxserve.config.model_config import ModelConfig, ModelLoadError
from jaxserve.weights import cache
from jaxserve.weights.hf import load_tokenizer_dir, params_from_hf
from jaxserve.weights.lazy import LazyTensor
from jaxserve.weights.loaded import LoadedModel

GGUF_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GGUF_LAYER_NAMES = {  # blk.{i}.<name> -> model.layers.{i}.<Hugging Face name>
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


def gguf_to_hf_name(name: str, arch: str) -> str | None:
    """A GGUF tensor name -> the Hugging Face one; None for tensors jaxserve does not read."""
    base, _, kind = name.rpartition(".")
    if base in GGUF_GLOBAL_NAMES:
        return f"{GGUF_GLOBAL_NAMES[base]}.{kind}"
    parts = base.split(".")
    if len(parts) != 3 or parts[0] != "blk":
        return None
    layer_names = dict(GGUF_LAYER_NAMES)
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


def load_gguf(path: Path, dtype: str, lazy: bool = False) -> LoadedModel:
    """Reads a GGUF file, or the converted copy of it that an earlier load left in the model cache.
    lazy: LazyTensor params, which read slices of the converted copy, or else dequantize their GGUF
    tensor and slice it (a lazy load writes no converted copy: that needs the whole model at once)."""
    digest = cache.file_digest(path)
    cached = cache.converted_model_dir(path, digest, dtype)
    if cached is None:
        return _convert(path, dtype, lazy, digest)
    with cache.entry_lock(cached):  # concurrent first loads of one file: one converts, the rest read its copy
        converted = cache.load_converted(cached, dtype, lazy)
        if converted is not None:
            cfg, params = converted
            return LoadedModel(cfg, params, load_gguf_tokenizer(path, digest), str(path))
        loaded = _convert(path, dtype, lazy, digest)
        if not lazy:
            cache.save_converted(loaded, cached)
        return loaded


def _convert(path: Path, dtype: str, lazy: bool, digest: str) -> LoadedModel:
    import gguf
    from transformers import AutoConfig

    try:
        reader = gguf.GGUFReader(path)
        arch = reader.fields["general.architecture"].contents()
    except Exception as e:  # noqa: BLE001 - the gguf package raises many types on a damaged file
        raise ModelLoadError(f"cannot read GGUF file {str(path)!r} (truncated or corrupt?): {e}") from None
    if arch not in GGUF_ARCHS:
        raise ModelLoadError(f"GGUF architecture {arch!r} in {str(path)!r} is not supported; jaxserve reads {GGUF_ARCHS}")
    supported = gguf_tensor_types()
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in supported:
            raise ModelLoadError(
                f"tensor {tensor.name!r} in {str(path)!r} has GGUF quantization type {tensor.tensor_type.name}, "
                f"which the installed gguf package cannot dequantize (it can: {', '.join(supported)})"
            )
    require_torch(path)
    try:
        hf_config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:  # noqa: BLE001 - any metadata transformers cannot read, as one error naming the file
        raise ModelLoadError(f"cannot build a model config from GGUF metadata in {str(path)!r}: {e}") from None
    cfg = ModelConfig.from_hf(hf_config)
    key_length = reader.fields.get(f"{arch}.attention.key_length")
    if key_length is not None:  # transformers ignores it for qwen3 and falls back to head_dim=128
        cfg = dataclasses.replace(cfg, head_dim=int(key_length.contents()))
    tensors = {}
    for tensor in reader.tensors:
        hf_name = gguf_to_hf_name(tensor.name, arch)
        if hf_name is not None:
            tensors[hf_name] = tensor

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ModelLoadError(f"tensor for {name!r} is missing from GGUF file {str(path)!r}")
        tensor = tensors[name]
        try:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except Exception as e:  # noqa: BLE001 - a damaged tensor, as one error naming it and the file
            raise ModelLoadError(f"cannot dequantize {tensor.name!r} in {str(path)!r}: {e}") from None
        array = np.asarray(array, np.float32).reshape(tuple(reversed([int(d) for d in tensor.shape])))
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            array = _unpermute_rope_rows(array, heads)
        if arch == "gemma3" and "norm" in name:
            array = array - 1.0  # llama.cpp stores Gemma norms with the +1 already added
        return array

    def get_lazy(name: str) -> LazyTensor:
        if name not in tensors:
            raise ModelLoadError(f"tensor for {name!r} is missing from GGUF file {str(path)!r}")
        shape = tuple(reversed([int(d) for d in tensors[name].shape]))
        return LazyTensor(shape, np.float32, lambda index: get(name)[index])

    params = params_from_hf(cfg, get_lazy if lazy else get, dtype, desc=f"loading {path.name}")
    return LoadedModel(cfg, params, load_gguf_tokenizer(path, digest), str(path))


def torch_installed() -> bool:
    return importlib.util.find_spec("torch") is not None


def require_torch(path: Path) -> None:
    """transformers reads GGUF metadata (for the config and the tokenizer) in modules that import torch.
    Only a GGUF's first load needs it: later loads read jaxserve's model and tokenizer caches."""
    if not torch_installed():
        raise ModelLoadError(
            f"reading the GGUF file {str(path)!r} the first time needs torch (transformers' GGUF reader imports "
            f"it): pip install 'jaxserve[gguf]'"
        )


def load_gguf_tokenizer(path: Path, digest: str | None = None):
    """The tokenizer of a GGUF file, built from its metadata on the first load and cached on disk.
    digest: the file's `cache.file_digest`, where the caller has it already."""
    cached = cache.tokenizer_dir(digest or cache.file_digest(path))
    if cached is None:
        return _build_tokenizer(path)
    with cache.entry_lock(cached):
        tokenizer = cache.load_tokenizer(cached)
        if tokenizer is None:
            tokenizer = _build_tokenizer(path)
            cache.save_tokenizer(tokenizer, cached)
    return tokenizer


def _build_tokenizer(path: Path):
    require_torch(path)
    return load_tokenizer_dir(path.parent, gguf_file=path.name)
