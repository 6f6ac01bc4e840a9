"""Structured output: a request's JSON schema, regex, choice or grammar, held to as it is sampled.

`StructuredOutputsParams` is what a request asks for (vLLM's names). `Grammars` compiles it with
llguidance against the model's tokenizer, once per distinct source (a cache; compiling can take tens of
milliseconds, so the server does it on a worker thread before it submits), and gives each request its
own `GrammarMatcher`. The params a grammar was compiled for hold it from then on, so admission (on the
server's event loop) never compiles again, however many other grammars the cache took in between.
Per step the engine fills, for each constrained row that samples, a packed bitmask of the tokens the
grammar allows (`fill_bitmasks`, over a thread pool when several rows need one); the sampler bans the
rest on the device (`sampling.apply_token_bitmask`). Each sampled token then advances the matcher; a
grammar that can take nothing more ends the request with finish reason "stop".

What this module does not own: which requests run (scheduler.py), the device arrays (step_inputs.py).
"""

from __future__ import annotations

import collections
import threading

import numpy as np

from jaxserve.config.sampling_params import PARAM, StructuredOutputsParams
from jaxserve.errors import InvalidParameter

_CACHE_SIZE = 256  # compiled grammars kept, by source
_PARALLEL_FILL_ROWS = 4  # fewer constrained rows than this fill their masks on the calling thread


class GrammarMatcher:
    """One request's place in its grammar."""

    def __init__(self, matcher):
        self._matcher = matcher  # llguidance.LLMatcher

    def accept(self, token_id: int) -> bool:
        """Advances past a sampled token; False if the grammar does not allow it."""
        return self._matcher.consume_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and takes no more tokens."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self._matcher, bitmask, row)


class Grammars:
    """Compiles constraints against one tokenizer, caching them by source; safe from any thread."""

    def __init__(self, tokenizer, vocab_size: int):
        self._hf_tokenizer, self.vocab_size = tokenizer, vocab_size
        self._tokenizer = None  # llguidance's view of it, built on first use (about half a second)
        self._cache: collections.OrderedDict[StructuredOutputsParams, object] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._executor = None

    @property
    def words(self) -> int:
        """int32 words of one row's packed bitmask."""
        return -(-self.vocab_size // 32)

    def _llg_tokenizer(self):
        if self._tokenizer is None:
            import llguidance.hf

            if self._hf_tokenizer is None:
                raise InvalidParameter(PARAM, "structured output needs the model's tokenizer, and this engine has none")
            try:
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)
            except Exception as e:  # noqa: BLE001 - llguidance reads only Hugging Face fast tokenizers
                raise InvalidParameter(PARAM, f"structured output needs a Hugging Face fast tokenizer, and this "
                                              f"model's cannot be read as one ({type(e).__name__}: {e})") from None
        return self._tokenizer

    def compile(self, params: StructuredOutputsParams):
        """The compiled matcher of `params`: the one it holds, from the cache or built now (and then held
        by `params`); InvalidParameter names what is wrong with a schema, regex or grammar."""
        if params._compiled is not None and params._compiled[0] is self:
            return params._compiled[1]
        with self._lock:
            if params in self._cache:
                self._cache.move_to_end(params)
                matcher = self._cache[params]
                object.__setattr__(params, "_compiled", (self, matcher))
                return matcher
            tokenizer = self._llg_tokenizer()
        from llguidance import LLMatcher

        try:
            grammar = params.llguidance_grammar()
        except InvalidParameter:
            raise
        except (ValueError, TypeError) as e:  # llguidance's own message says what it could not read
            raise InvalidParameter(PARAM, f"invalid {_NAMES[params.kind]}: {e}") from None
        error = LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise InvalidParameter(PARAM, f"invalid {_NAMES[params.kind]}: {error.strip()}")
        matcher = LLMatcher(tokenizer, grammar)
        if matcher.is_error():
            raise InvalidParameter(PARAM, f"invalid {_NAMES[params.kind]}: {matcher.get_error()}")
        with self._lock:
            self._cache[params] = matcher
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        object.__setattr__(params, "_compiled", (self, matcher))
        return matcher

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for one request (a copy of the compiled one)."""
        return GrammarMatcher(self.compile(params).deep_copy())

    def fill_bitmasks(self, rows: list[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
        """Fills bitmask [S, words] rows with what each matcher allows next; other rows are untouched."""
        if len(rows) < _PARALLEL_FILL_ROWS:
            for matcher, row in rows:
                matcher.fill(bitmask, row)
            return
        from llguidance import LLExecutor
        from llguidance.numpy import fill_next_token_bitmask_par

        if self._executor is None:
            self._executor = LLExecutor()
        fill_next_token_bitmask_par(self._executor, [(m._matcher, row) for m, row in rows], bitmask)


_NAMES = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "choice": "choice",
          "grammar": "grammar"}


def allowed_token_ids(bitmask_row: np.ndarray) -> np.ndarray:
    """The token ids a packed bitmask row [words] int32 allows (for tests and debugging)."""
    return np.unpackbits(bitmask_row.view(np.uint8), bitorder="little").nonzero()[0]

