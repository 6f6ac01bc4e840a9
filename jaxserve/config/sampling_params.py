"""What a request asks to generate: `SamplingParams` and `StructuredOutputsParams` (vLLM's names and
defaults), checked where they are made, so bad input fails at the public edge with the field it names.

The device sampler that carries them out is `jaxserve/ops/sampling.py`; grammars are compiled and held
to in `jaxserve/core/structured_output.py`.
"""

from __future__ import annotations

import dataclasses
import json

from jaxserve.errors import InvalidParameter

MAX_LOGPROBS = 20  # top alternatives per token, as vLLM's default max_logprobs
MAX_LOGIT_BIAS = 300  # logit_bias entries per request
MAX_STOP_TOKEN_IDS = 64
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LENGTH = 256  # characters
PARAM = "structured_outputs"
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's `StructuredOutputsParams`): exactly one of
    json (a JSON schema, as a dict or its JSON text), regex, choice (the output is one of these strings),
    grammar (Lark, or llama.cpp's GBNF) or json_object (any JSON object).
    JSON is written on one line, with Python's separators (`{"a": 1, "b": [2, 3]}`): free whitespace lets
    a small model fall into runs of newlines and indentation that end only at max_tokens, with JSON that
    does not parse. whitespace_pattern: a regex for the whitespace allowed between JSON tokens instead
    (vLLM's field). disable_any_whitespace (vLLM's) is accepted: it asks for what is already the default."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    # (the Grammars, its compiled LLMatcher), set by `Grammars.compile`. Not a field (no annotation), so not
    # part of the value: never compared, hashed, shown, copied or pickled.
    _compiled = None

    def __post_init__(self):
        given = [kind for kind in _KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise InvalidParameter(PARAM, "structured_outputs needs exactly one of json, regex, choice, grammar or "
                                          f"json_object; got {', '.join(given) if given else 'none'}")
        if self.choice is not None:
            choice = self.choice
            if not (isinstance(choice, (list, tuple)) and choice and all(isinstance(c, str) for c in choice)):
                raise InvalidParameter(PARAM, "choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(choice))
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and not (isinstance(value, str) and value):
                raise InvalidParameter(PARAM, f"{kind} must be a non-empty string")
        if isinstance(self.json, dict):  # hashable, and one cache entry whatever the key order
            object.__setattr__(self, "json", json.dumps(self.json, sort_keys=True))

    def __getstate__(self) -> dict:
        return {name: value for name, value in self.__dict__.items() if name != "_compiled"}

    @property
    def kind(self) -> str:
        return next(kind for kind in _KINDS if getattr(self, kind) not in (None, False))

    def llguidance_grammar(self) -> str:
        """This constraint as an llguidance grammar (not yet checked against a tokenizer)."""
        from llguidance import LLMatcher, grammar_from

        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return grammar_from("choice", json.dumps(list(self.choice)))
        if self.grammar is not None:
            return grammar_from("grammar", self.grammar)
        schema = {"type": "object"} if self.json_object else _parse_schema(self.json)
        options = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
        if self.whitespace_pattern is not None:
            options = {"whitespace_flexible": True, "whitespace_pattern": self.whitespace_pattern}
        return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)


def _parse_schema(text: str) -> dict | bool:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidParameter(PARAM, f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidParameter(PARAM, f"a JSON schema must be an object or a boolean, got {type(schema).__name__}")
    return schema


@dataclasses.dataclass
class SamplingParams:
    """What to generate for one prompt. Defaults follow vLLM's `SamplingParams`."""

    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 means off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None means up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives to return besides the sampled token
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # a JSON schema, regex, choice or grammar

    def __post_init__(self):
        def check(ok: bool, param: str, message: str):
            if not ok:
                raise InvalidParameter(param, message)

        check(isinstance(self.n, int) and self.n >= 1, "n", f"n must be an integer >= 1, got {self.n!r}")
        check(self.temperature >= 0, "temperature", f"temperature must be >= 0, got {self.temperature}")
        check(0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        check(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 0), "top_k",
              f"top_k must be an integer: -1, 0 (off) or positive, got {self.top_k!r}")
        check(0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        check(-2 <= self.presence_penalty <= 2, "presence_penalty",
              f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        check(-2 <= self.frequency_penalty <= 2, "frequency_penalty",
              f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        check(self.repetition_penalty > 0, "repetition_penalty",
              f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
              f"max_tokens must be >= 1, got {self.max_tokens}")
        check(self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        check(self.seed is None or 0 <= self.seed < 2**32, "seed", f"seed must be in [0, 2**32), got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or 0 <= value <= MAX_LOGPROBS, name,
                  f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        # Every stop string is searched for after every token, and the longest one sets how much
        # streamed text is held back: both are bounded.
        check(len(self.stop) <= MAX_STOP_STRINGS, "stop",
              f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings")
        longest = max(map(len, self.stop), default=0)
        check(longest <= MAX_STOP_STRING_LENGTH, "stop",
              f"stop strings must be at most {MAX_STOP_STRING_LENGTH} characters, got one of {longest}")
        check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
              f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}")
        bias = self.logit_bias or {}
        check(len(bias) <= MAX_LOGIT_BIAS, "logit_bias",
              f"at most {MAX_LOGIT_BIAS} logit_bias entries, got {len(bias)}")
        self.logit_bias = {int(k): float(v) for k, v in bias.items()} or None
        check(all(v == v for v in (self.logit_bias or {}).values()), "logit_bias",
              "logit_bias values must not be NaN")
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            unknown = set(self.structured_outputs) - {f.name for f in dataclasses.fields(StructuredOutputsParams)}
            check(not unknown, "structured_outputs", f"unknown structured_outputs fields: {sorted(unknown)}")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", "structured_outputs must be a StructuredOutputsParams")

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)
