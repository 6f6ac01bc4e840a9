"""Speculative decoding: proposers of draft tokens, and what verification accepted.

A speculating sequence's step carries its newest token and k draft tokens. Each of the k + 1 runs as a
decode row of its own (one query row, its position's KV length, the sequence's block table and sampling
row shared through its device-batch slot): the step writes every row's K/V before any row attends, so
row j sees the K/V of rows 0..j-1, and the sampler draws at each row the token the target model would
draw at that position, with the same seeded uniform (`sampling.py` keys it by the position). Every
draft here is one token, not a distribution (q one-hot), so rejection sampling's test, "accept d with
probability min(1, p(d) / q(d)) = p(d), else draw from p without d, normalized", is the same as
drawing x ~ p and accepting d when x == d: the accepted run is the longest prefix of drafts equal to
the target's draws, followed by the first draw that differs (or the bonus draw after the last draft).
So greedy outputs equal the target's argmax run, random outputs follow the target's distribution, and
a seeded request draws the same tokens with speculation on or off (up to the rounding of a batched
pass).

Proposers: `NgramProposer` (prompt lookup: the tokens that followed the latest earlier occurrence of
the sequence's last n tokens) and `jaxserve.spec_decode.draft_model.DraftModelProposer` (a smaller model with the
same vocabulary, its own page pool, proposing greedily).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Protocol

import numpy as np

from jaxserve.errors import InvalidParameter

METHODS = ("ngram", "draft_model")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` (the JSON of `--speculative-config`)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int | None = None  # ngram: the shortest suffix looked up (default: prompt_lookup_max)
    prompt_lookup_max: int | None = None  # ngram: the longest (default: prompt_lookup_min, or 5 if both unset)
    model: str | None = None  # draft_model: its directory, GGUF file or checkpoint
    # Steps whose batch holds more running sequences than this do not speculate (None: the default below,
    # chosen from docs/benchmarks.md's measurement)
    disable_by_batch_size: int | None = None

    def __post_init__(self):
        def check(ok: bool, message: str):
            if not ok:
                raise InvalidParameter("speculative_config", f"speculative_config: {message}")

        check(self.method in METHODS, f"method must be one of {list(METHODS)}, got {self.method!r}")
        check(isinstance(self.num_speculative_tokens, int) and self.num_speculative_tokens >= 1,
              f"num_speculative_tokens must be an integer >= 1, got {self.num_speculative_tokens!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        lo, hi = (lo if lo is not None else hi or 5), (hi if hi is not None else lo or 5)
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        check(isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi,
              f"prompt_lookup_min ({lo}) and prompt_lookup_max ({hi}) must be integers with 1 <= min <= max")
        check((self.model is not None) == (self.method == "draft_model"),
              "method 'draft_model' needs a 'model' (and only it takes one)")
        check(self.disable_by_batch_size is None or self.disable_by_batch_size >= 1,
              f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """From a JSON object's text (the command line), a dict (`LLM(speculative_config=...)`) or itself."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise InvalidParameter("speculative_config", f"speculative_config is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise InvalidParameter("speculative_config", f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidParameter("speculative_config", f"speculative_config: unknown fields {unknown}; known: {sorted(known)}")
        return cls(**value)


# Batches above this many sequences do not speculate by default. On the 2-core CPU, prompt lookup on
# input-grounded prompts still gave 1.4x at 8 sequences, and nothing at 32, where the drafts find little
# room beside the sequences' own rows (docs/benchmarks.md, "Speculative decoding").
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


class Proposer(Protocol):
    def propose(self, requests: list, limits: list[int]) -> list[list[int]]:
        """Up to limits[i] draft tokens for each request (which has just sampled its newest token). A
        proposer that keeps state per request drops that of requests no longer running when called."""


def ngram_propose(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The k tokens that followed the latest earlier occurrence of the longest suffix of `tokens` of length
    max_n down to min_n that occurs earlier (of the occurrences with k tokens after them, if any: in a
    repeating run the latest is just before the end); fewer near the end; [] if none occurs."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # Windows starting at 0 .. length - n - 1 (the suffix itself excluded)
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:  # the latest match with k tokens after it (a repeating run's latest has fewer)
            full = hits[hits + n + k <= length]
            start = int(full[-1] if full.size else hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    """Prompt lookup (vLLM's "ngram"): drafts copied from earlier in the sequence itself."""

    def __init__(self, cfg: SpeculativeConfig):
        self.cfg = cfg

    def propose(self, requests: list, limits: list[int]) -> list[list[int]]:
        cfg = self.cfg
        return [ngram_propose(np.asarray(r.all_token_ids, np.int32), cfg.prompt_lookup_min, cfg.prompt_lookup_max,
                              limit) if limit > 0 else [] for r, limit in zip(requests, limits)]


@dataclasses.dataclass
class SpecDecodeStats:
    """vLLM's counters: drafts (sequences that proposed in a step), draft tokens, accepted tokens, and
    accepted tokens per draft position."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def observe(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos)}


def accepted_run(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts verification accepts: the longest prefix with drafts[j] == sampled[j] (sampled[j]
    is the target's draw at the position of drafts[j]; sampled has one more entry, the bonus draw)."""
    num = 0
    while num < len(drafts) and drafts[num] == sampled[num]:
        num += 1
    return num
