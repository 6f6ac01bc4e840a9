"""Hugging Face's float32 model of a GGUF file, the reference that parity tests compare with.

transformers reads a GGUF with its own dequantization (independent of jaxserve's), which takes the default
model about 35 s. Several test files, in several processes, want that model, so the first to read it stores
transformers' float32 model (config, generation config and safetensors weights, as transformers writes them)
under JAXSERVE_TEST_HF_CACHE, which .ci/run shares between its workers, and later reads take about a second.
The process that stores the copy reads it back and checks that it gives the read's logits, bit for bit
(`check_stored_copy`), before any other process can see it: so every run that reads the GGUF checks its copy
once, and no test reads the GGUF a second time to do so.
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


PROBE = list(range(1, 65))  # token ids whose logits the stored copy must reproduce


def logits(model: transformers.PreTrainedModel, token_ids: list[int]):
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]


def save_copy(model: transformers.PreTrainedModel, directory: Path) -> None:
    """The model as plain float32 safetensors: config, generation config and weights."""
    config = copy.deepcopy(model.config)
    config.__dict__.pop("quantization_config", None)
    config.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    save_model(model, str(directory / "model.safetensors"))  # the tied embedding and LM head saved once


def check_stored_copy(model: transformers.PreTrainedModel, stored: Path) -> None:
    """The copy in `stored` gives `model`'s logits, bit for bit, and ties its LM head to its embedding."""
    copy_ = transformers.AutoModelForCausalLM.from_pretrained(stored, dtype=torch.float32).eval()
    if not torch.equal(logits(copy_, PROBE), logits(model, PROBE)):
        raise AssertionError(f"the float32 copy in {stored} does not give the logits of the model it was saved from")
    if model.config.tie_word_embeddings and \
            copy_.lm_head.weight.data_ptr() != copy_.model.embed_tokens.weight.data_ptr():
        raise AssertionError(f"the float32 copy in {stored} does not tie its LM head to its embedding")


def stored_copy(path: str | Path) -> Path:
    """Where hf_model_of_gguf(path) stores, or has stored, its copy."""
    path = Path(path).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    return Path(os.environ[CACHE_ENV]) / key


def hf_model_of_gguf(path: str | Path) -> transformers.PreTrainedModel:
    """read_gguf(path), or its stored copy under JAXSERVE_TEST_HF_CACHE (the file's path, size and time
    name the copy). A copy appears whole or not at all: it is written to a folder of its own, then renamed."""
    if not os.environ.get(CACHE_ENV):
        return read_gguf(path)
    stored = stored_copy(path)
    if stored.is_dir():
        return transformers.AutoModelForCausalLM.from_pretrained(stored, dtype=torch.float32).eval()
    model = read_gguf(path)
    stored.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=stored.parent, prefix=f".{stored.name}-"))
    save_copy(model, partial)
    check_stored_copy(model, partial)
    try:
        os.rename(partial, stored)
    except OSError:  # another process stored it first
        shutil.rmtree(partial, ignore_errors=True)
    return model
