"""Speculative decoding: proposers of draft tokens, and what verification accepted.

A speculating sequence's step carries its newest token and k draft tokens. Each of the k + 1 runs as a
decode row of its own (one query row, its position's KV length, the sequence's page table and sampling
row shared through its row of the device batch, its req_index): the step writes every row's K/V before
any row attends, so row j sees the K/V of rows 0..j-1, and the sampler draws at each row the token the
target model would draw at that position, with the same seeded uniform (`sampling.py` keys it by the
position). Every draft here is one token, not a distribution (q one-hot), so rejection sampling's test,
"accept d with probability min(1, p(d) / q(d)) = p(d), else draw from p without d, normalized", is the
same as drawing x ~ p and accepting d when x == d: the accepted run is the longest prefix of drafts
equal to the target's draws, followed by the first draw that differs (or the bonus draw after the last
draft). So greedy outputs equal the target's argmax run, random outputs follow the target's
distribution, and a seeded request draws the same tokens with speculation on or off (up to the rounding
of a batched pass).

Proposers: `NgramProposer` (prompt lookup: the tokens that followed the latest earlier occurrence of
the sequence's last n tokens) and `jaxserve.spec_decode.draft_model.DraftModelProposer` (a smaller model with the
same vocabulary, its own page pool, proposing greedily).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from jaxserve.config.speculative import SpeculativeConfig


class ProposalRequest(Protocol):
    """What a proposer reads of a request (the engine core's `Request`, which this layer does not import)."""

    request_id: str
    num_admissions: int  # how many times it was admitted: a proposer's state from before a preemption is stale

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def is_running(self) -> bool: ...


class Proposer(Protocol):
    def propose(self, requests: list[ProposalRequest], limits: list[int]) -> list[list[int]]:
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

    def propose(self, requests: list[ProposalRequest], limits: list[int]) -> list[list[int]]:
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
