"""PEFT LoRA adapters made in the tests, and Hugging Face + PEFT's greedy tokens with them (the reference).

`make_peft_adapter` wraps a saved base model with peft's `LoraConfig` and random (seeded) A and B, B not
zero, scaled so that the adapter changes greedy tokens, and saves it as PEFT does (adapter_config.json +
adapter_model.safetensors). A base is a Hugging Face directory (tests/tiny_models.py makes tiny ones) or
a GGUF file (the default model: `jaxserve.weights.default_model_path()`).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import transformers

from hf_gguf import hf_model_of_gguf

# A and B are drawn uniform, then scaled so each element of a projection's delta has about this fraction
# of its input's root mean square, whatever the rank, width and lora_alpha: large enough to change greedy
# tokens on the tiny models and on the default model.
DELTA_SCALE = 0.5


_BASES: dict[tuple[Path, int], transformers.PreTrainedModel] = {}  # by path and modification time


def load_base(base: str | Path) -> transformers.PreTrainedModel:
    """The float32 Hugging Face model of a directory or a GGUF file: a fresh copy (PEFT wraps it in place)
    of the one read the first time (a GGUF takes many seconds to dequantize)."""
    base = Path(base).resolve()
    key = (base, (base if base.is_file() else base / "config.json").stat().st_mtime_ns)
    if key not in _BASES:
        if base.is_file():
            model = hf_model_of_gguf(base)
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        _BASES[key] = model.eval()
    return copy.deepcopy(_BASES[key])


def make_peft_adapter(base_dir: str | Path, out_dir: str | Path, *, rank: int = 8, alpha: int = 16,
                      targets: tuple[str, ...] = ("q_proj", "v_proj"), seed: int = 0, use_rslora: bool = False,
                      layers_to_transform: list[int] | None = None) -> Path:
    """Saves a random LoRA adapter of the model at `base_dir` to `out_dir`; returns `out_dir`."""
    import peft

    base = load_base(base_dir)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
                             layers_to_transform=layers_to_transform, init_lora_weights=False, lora_dropout=0.0,
                             bias="none", task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, peft.tuners.lora.LoraLayer) or "default" not in module.lora_A:
                continue
            lora_a, lora_b = module.lora_A["default"].weight, module.lora_B["default"].weight  # [r, in], [out, r]
            scaling = module.scaling["default"]
            lora_a.copy_(torch.rand(lora_a.shape, generator=generator) * 2 - 1)
            lora_b.copy_(torch.rand(lora_b.shape, generator=generator) * 2 - 1)
            # Entries of variance 1 / in in A and DELTA_SCALE**2 / r in B (before the scaling, which PEFT applies).
            lora_a.mul_((3.0 / lora_a.shape[1]) ** 0.5)
            lora_b.mul_(DELTA_SCALE * (3.0 / rank) ** 0.5 / scaling)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def peft_greedy(base_dir: str | Path, adapter_dir: str | Path, prompt_ids: list[int], max_new_tokens: int,
                eos_id: int | None = None) -> list[int]:
    """Hugging Face transformers + PEFT's greedy tokens (float32) after `prompt_ids`, up to max_new_tokens
    (or through eos_id); adapter_dir None: the base model's."""
    import peft

    model = load_base(base_dir)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    return hf_greedy(model, prompt_ids, max_new_tokens, eos_id)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_id: int | None = None) -> list[int]:
    """A loaded model's greedy tokens, for callers that reuse one model over many prompts."""
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                             dtype=torch.long), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos_id, pad_token_id=eos_id if eos_id is not None else 0)
    new = out[0, len(prompt_ids):].tolist()
    return new[: new.index(eos_id) + 1] if eos_id is not None and eos_id in new else new
