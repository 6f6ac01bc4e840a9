"""Tiny random-weight models of every supported family, saved as Hugging Face directories.

No downloads: configs come from transformers' config classes, weights are random (seeded), and the
tokenizer is a byte-level BPE without merges (256 byte tokens plus ChatML specials), so any text
round-trips. The PyTorch model is returned too, as the parity reference.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

VOCAB_SIZE = 320  # 256 bytes + specials, rounded up; ids >= 259 are never produced by the tokenizer
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_ID = 257  # <|im_end|> (the tokenizer gives <|im_start|> 256, <|im_end|> 257, <|endoftext|> 258)
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3", "gemma3", "llama_untied")

COMMON_CONFIG = dict(  # what every family shares; tests that build their own configs start from it
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    eos_token_id=EOS_ID,
    bos_token_id=256,
)


def hf_config(family: str, **overrides):
    """The tiny config of `family`; overrides replace COMMON_CONFIG's values (head counts, sizes)."""
    config = _family_config(family)
    for name, value in overrides.items():
        setattr(config, name, value)
    return config


def _family_config(family: str):
    if family in ("llama", "llama_untied"):
        return transformers.LlamaConfig(**COMMON_CONFIG, tie_word_embeddings=family == "llama", rope_theta=10000.0)
    if family == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return transformers.LlamaConfig(**COMMON_CONFIG, tie_word_embeddings=True, rope_parameters=rope)
    if family == "mistral":
        return transformers.MistralConfig(**COMMON_CONFIG, sliding_window=24, tie_word_embeddings=False)
    if family == "qwen2":
        return transformers.Qwen2Config(**COMMON_CONFIG, tie_word_embeddings=True)
    if family == "qwen3":
        return transformers.Qwen3Config(**COMMON_CONFIG, head_dim=32, tie_word_embeddings=True)
    if family == "gemma3":
        return transformers.Gemma3TextConfig(
            **COMMON_CONFIG, head_dim=16, sliding_window=20, layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=16, rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
            },
        )
    raise ValueError(family)


def byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>", pad_token="<|endoftext|>",
    )
    fast.add_special_tokens({"additional_special_tokens": SPECIALS})
    fast.chat_template = CHATML
    return fast


def make_tiny_model(family: str, directory: Path, seed: int = 0, *, attention_std: float | None = None,
                    embedding_std: float | None = None, **config_overrides):
    """Saves a random `family` model with a byte tokenizer to `directory`; returns the torch model.

    With the default init (std 0.02, tied embeddings) greedy decoding mostly repeats the last token,
    whatever the context. Tests that compare token streams across schedules (chunking, caching,
    preemption) pass `attention_std`/`embedding_std` (e.g. 0.3 / 1.0) to redraw the q/k/v/o
    projections and the embeddings, so every token depends on the whole context and its positions.
    config_overrides: see `hf_config`.
    """
    torch.manual_seed(seed)
    config = hf_config(family, **config_overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # default init leaves norms at 1 and biases at 0: randomize them too
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.normal_(0.0, 0.5 if family != "gemma3" else 0.2)
                if "norm" in name and family != "gemma3":
                    param.add_(1.0)
            elif attention_std is not None and name.endswith(("q_proj.weight", "k_proj.weight",
                                                              "v_proj.weight", "o_proj.weight")):
                param.normal_(0.0, attention_std)
            elif embedding_std is not None and "embed_tokens" in name:
                param.normal_(0.0, embedding_std)
    model.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return model


def assert_greedy_mostly_agrees_with_float32(llm, model_dir, **settings) -> None:
    """llm, a quantized engine over the tiny model in model_dir (warmed up), generates 8 greedy tokens for 4
    prompts with compilation forbidden, and its first tokens equal the float32 engine's (same settings) on
    at least 3 of the 4: a tiny random model's margins are small, so not token for token."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.runner.compilation import forbid_compilation

    prompts = [{"prompt_token_ids": list(range(1 + i, 9 + 3 * i))} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with forbid_compilation():
        outs = llm.generate(prompts, params, use_tqdm=False)
    reference = LLM(str(model_dir), dtype="float32", **settings).generate(prompts, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    assert [len(t) for t in tokens] == [8] * 4
    first = [t[0] for t in tokens], [o.outputs[0].token_ids[0] for o in reference]
    assert sum(a == b for a, b in zip(*first)) >= 3, first
