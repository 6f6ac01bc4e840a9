"""`jaxserve convert --to hf`: writes a loaded model as a Hugging Face directory (float32 or bf16 safetensors).

The inverse of `weights.hf.params_from_hf`: each param goes through `weights.hf.to_hf` (our input-major
matrices back to torch's [out, in], Gemma's folded `1 + w` norms unfolded) under its Hugging Face name,
and the config, generation config and tokenizer are written beside the tensors, so transformers, vLLM
and jaxserve itself all read the result. Used to hand other engines the very weights jaxserve serves
(the default model ships only as a GGUF).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from jaxserve.config.model_config import ModelLoadError
from jaxserve.models.params import param_shapes
from jaxserve.weights import LoadedModel
from jaxserve.weights.hf import HF_GLOBAL_NAMES, hf_layer_names, to_hf


def hf_state_dict(loaded: LoadedModel) -> dict[str, np.ndarray]:
    cfg, params = loaded.config, loaded.params
    tensors = {HF_GLOBAL_NAMES[name]: to_hf(cfg, name, params[name]) for name in param_shapes(cfg) if name != "layers"}
    for name, hf_name in hf_layer_names(cfg).items():
        stacked = np.asarray(params["layers"][name], np.float32)
        for i in range(cfg.num_layers):
            tensors[f"model.layers.{i}.{hf_name}"] = to_hf(cfg, name, stacked[i])
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
