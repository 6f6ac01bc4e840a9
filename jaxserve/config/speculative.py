"""Speculative decoding's settings: vLLM's `speculative_config`, checked where it is parsed.

The proposers that use it are in `jaxserve/spec_decode/`.
"""

from __future__ import annotations

import dataclasses
import json

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

    @property
    def batch_limit(self) -> int:
        """The most running sequences a step may hold and still speculate."""
        return self.disable_by_batch_size or DEFAULT_DISABLE_BY_BATCH_SIZE

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
