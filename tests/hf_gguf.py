"""Hugging Face's float32 model of a GGUF file, the reference that parity tests compare with.

transformers reads a GGUF with its own dequantization (independent of jaxserve's), which takes the default
model about 35 s. Several test files, in several processes, want that model, so the first to read it stores
transformers' float32 model (config, generation config and safetensors weights, as transformers writes them)
under JAXSERVE_TEST_HF_CACHE, which .ci/run shares between its workers, and later reads take about a second.
The stored copy gives the same logits, bit for bit (tests/test_weights.py compares them).
"""

from __future__ import annotations

import copy
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_model

CACHE_ENV = "JAXSERVE_TEST_HF_CACHE"


def read_gguf(path: str | Path) -> transformers.PreTrainedModel:
    """transformers' own read of the file, dequantized to float32."""
    path = Path(path)
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def hf_model_of_gguf(path: str | Path) -> transformers.PreTrainedModel:
    """read_gguf(path), or its stored copy under JAXSERVE_TEST_HF_CACHE (the file's path, size and time
    name the copy). A copy appears whole or not at all: it is written to a folder of its own, then renamed."""
    path = Path(path).resolve()
    if not os.environ.get(CACHE_ENV):
        return read_gguf(path)
    stat = path.stat()
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    stored = Path(os.environ[CACHE_ENV]) / key
    if stored.is_dir():
        return transformers.AutoModelForCausalLM.from_pretrained(stored, dtype=torch.float32).eval()
    model = read_gguf(path)
    stored.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=stored.parent, prefix=f".{key}-"))
    config = copy.deepcopy(model.config)
    config.__dict__.pop("quantization_config", None)  # the copy is plain float32
    config.save_pretrained(partial)
    model.generation_config.save_pretrained(partial)
    save_model(model, str(partial / "model.safetensors"))  # the tied embedding and LM head saved once
    try:
        os.rename(partial, stored)
    except OSError:  # another process stored it first
        shutil.rmtree(partial, ignore_errors=True)
    return model
