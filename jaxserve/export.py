"""`jaxserve convert --to hf`: writes a loaded model as a Hugging Face directory (float32 or bf16 safetensors).

The inverse of `weights._params_from_hf`: our input-major matrices go back to torch's [out, in],
Gemma's folded `1 + w` norms are unfolded, and the config, generation config and tokenizer are
written beside the tensors, so transformers, vLLM and jaxserve itself all read the result. Used
to hand other engines the very weights jaxserve serves (the default model ships only as a GGUF).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from jaxserve.config import ModelLoadError
from jaxserve.weights import LoadedModel, _hf_layer_names


def hf_state_dict(loaded: LoadedModel) -> dict[str, np.ndarray]:
    cfg = loaded.config
    norm_offset = 1.0 if cfg.architecture == "gemma3" else 0.0

    def to_hf(name: str, array) -> np.ndarray:
        array = np.asarray(array, np.float32)
        if name.startswith("w"):
            array = array.T
        if "norm" in name:
            array = array - norm_offset
        return np.ascontiguousarray(array)

    params = loaded.params
    tensors = {"model.embed_tokens.weight": to_hf("embed", params["embed"]),
               "model.norm.weight": to_hf("final_norm", params["final_norm"])}
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = to_hf("w_lm_head", params["lm_head"])
    for name, hf_name in _hf_layer_names(cfg).items():
        stacked = np.asarray(params["layers"][name], np.float32)
        for i in range(cfg.num_layers):
            tensors[f"model.layers.{i}.{hf_name}"] = to_hf(name, stacked[i])
    return tensors


def save_hf_dir(loaded: LoadedModel, hf_config, dst: str | os.PathLike, dtype: str = "float32") -> Path:
    """Writes config.json, generation_config.json, model.safetensors and the tokenizer into dst."""
    from safetensors.numpy import save_file

    dst = Path(dst).expanduser().resolve()
    if dst.exists() and any(dst.iterdir()):
        raise ModelLoadError(f"destination {str(dst)!r} exists and is not empty")
    dst.mkdir(parents=True, exist_ok=True)
    tensors = hf_state_dict(loaded)
    if dtype == "bfloat16":
        import ml_dtypes

        tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    hf_config.torch_dtype = dtype
    hf_config.save_pretrained(dst)
    eos = list(loaded.config.eos_token_ids)
    (dst / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": eos[0] if len(eos) == 1 else eos, "bos_token_id": getattr(hf_config, "bos_token_id", None)},
        indent=2))
    loaded.tokenizer.save_pretrained(dst)
    return dst
