"""Benchmark prompts: a random dataset of given token lengths, or a JSONL file of prompts.

The random dataset follows `vllm bench serve --dataset-name random`: input and output lengths are
drawn uniformly from [len * (1 - range_ratio), len * (1 + range_ratio)], and a prompt is text made
of random vocabulary tokens whose re-encoding has exactly the drawn length, so any OpenAI server
sees the same number of prompt tokens.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int  # tokens, by the benchmark's tokenizer (the server's usage is preferred when sent)
    output_len: int  # max_tokens to ask for
    json_schema: dict | None = None  # asked for as response_format (structured output), if set


def _length_range(length: int, range_ratio: float) -> tuple[int, int]:
    if length < 1:
        raise ValueError(f"lengths must be at least 1, got {length}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    return max(1, round(length * (1 - range_ratio))), max(1, round(length * (1 + range_ratio)))


def _token_pool(tokenizer) -> list[int]:
    """Ids that decode to text which encodes back to themselves alone (no specials, no partial bytes)."""
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    texts = tokenizer.batch_decode([[i] for i in ids])
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    pool = [i for i, e in zip(ids, encoded) if e == [i]]
    if not pool:
        raise ValueError("no token of this tokenizer round-trips through its text; use --dataset-path")
    return pool


def _text_of_length(tokenizer, rng: random.Random, length: int, pool: list[int]) -> tuple[str, int]:
    """Text whose encoding is `length` tokens (or as close as 10 repairs get; the count is returned)."""
    ids = [rng.choice(pool) for _ in range(length)]
    for _ in range(10):
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == length:
            break
        ids = ids[:length] + [rng.choice(pool) for _ in range(length - len(ids))]
    return text, len(ids)


def random_requests(tokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    seed: int = 0) -> list[BenchRequest]:
    in_lo, in_hi = _length_range(input_len, range_ratio)
    out_lo, out_hi = _length_range(output_len, range_ratio)
    pool = _token_pool(tokenizer)
    rng = random.Random(seed)
    requests = []
    for _ in range(num_prompts):
        text, num_tokens = _text_of_length(tokenizer, rng, rng.randint(in_lo, in_hi), pool)
        requests.append(BenchRequest(text, num_tokens, rng.randint(out_lo, out_hi)))
    return requests


def jsonl_requests(path: str | Path, tokenizer, num_prompts: int, output_len: int) -> list[BenchRequest]:
    """One JSON object per line with a "prompt" (and optionally "output_len"); cycles if too few."""
    rows = []
    for line_no, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = row["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{path}:{line_no}: expected a JSON object with a \"prompt\" string") from None
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{path}:{line_no}: \"prompt\" must be a non-empty string")
        rows.append((prompt, int(row.get("output_len", output_len))))
    if not rows:
        raise ValueError(f"{path} holds no prompts")
    return [BenchRequest(p, len(tokenizer.encode(p, add_special_tokens=False)), n)
            for p, n in (rows[i % len(rows)] for i in range(num_prompts))]
