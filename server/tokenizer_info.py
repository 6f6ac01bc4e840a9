"""`GET /tokenizer_info` (vLLM's, behind --enable-tokenizer-info-endpoint): what a client needs to build the
server's tokenizer itself, or to use the server's /tokenize and /detokenize as its tokenizer
(lm-evaluation-harness's `tokenizer_backend="remote"` checks for `eos_token` here).

The body is the Hugging Face tokenizer's `init_kwargs` (its special tokens as strings, model_max_length,
flags such as add_bos_token...) without the paths of its vocabulary files, plus `tokenizer_class` and the
chat template the server applies. Values JSON cannot hold are written as text.
"""

from __future__ import annotations

_LEFT_OUT = ("vocab_file", "merges_file", "tokenizer_file", "tokenizer_object")  # files on the server, objects


def tokenizer_info(tokenizer) -> dict:
    info = {"tokenizer_class": type(tokenizer).__name__}
    info |= {name: _json(value) for name, value in getattr(tokenizer, "init_kwargs", {}).items()
             if name not in _LEFT_OUT}
    if getattr(tokenizer, "chat_template", None) is not None:
        info["chat_template"] = tokenizer.chat_template
    return info


def _json(value):
    """value as JSON can hold it: an AddedToken as its text, containers item by item, anything else as text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json(v) for v in value]
    return value.content if hasattr(value, "content") else str(value)
