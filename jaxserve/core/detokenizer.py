"""Incremental detokenization and stop strings, on the host.

Each request decodes its new tokens as they arrive (the `tokenizers` DecodeStream handles UTF-8
sequences split across tokens), and its text is searched for stop strings only where a new match
can start, so the work per token is O(new text + longest stop string).
"""

from __future__ import annotations

import logging

from tokenizers.decoders import DecodeStream

from jaxserve.config.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
_PROMPT_CONTEXT = 4  # prompt tokens fed first so the first output token decodes with its spacing


class IncrementalDetokenizer:
    def __init__(self, tokenizer, params: SamplingParams, prompt_token_ids: list[int]):
        self._backend = tokenizer._tokenizer  # the `tokenizers.Tokenizer` behind a fast tokenizer
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._skip_special_tokens = params.skip_special_tokens
        self._stream = DecodeStream(ids=context, skip_special_tokens=params.skip_special_tokens)
        self._stops = params.stop or []
        self._include_stop = params.include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self.text = ""

    @property
    def hold_back(self) -> int:
        """Characters at the end of `text` that a stop string might still claim (don't stream them yet)."""
        return max(self._max_stop_len - 1, 0)

    def add(self, token_ids: list[int]) -> str | None:
        """Appends the text of new tokens; returns the stop string that matched, if any.

        On a match `text` is cut before the stop string (or after it, with include_stop_str_in_output).
        """
        for token in token_ids:
            piece = self._step(token)
            if not piece:
                continue
            search_from = max(0, len(self.text) - self._max_stop_len + 1)
            self.text += piece
            match = self._find_stop(search_from)
            if match is not None:
                index, stop = match
                self.text = self.text[: index + (len(stop) if self._include_stop else 0)]
                return stop
        return None

    def _step(self, token: int) -> str | None:
        try:
            return self._stream.step(self._backend, token)
        except Exception as e:  # noqa: BLE001 - re-raised unless it is the known one
            if "invalid prefix" not in str(e).lower():
                raise
        # tokenizers' DecodeStream can raise "Invalid prefix encountered" when a token sequence
        # decodes to text that is not an extension of its earlier decoding (some byte sequences do).
        # Its state is then unusable: start a fresh stream at this token, as vLLM does.
        logger.warning("DecodeStream lost its prefix; restarting it at token %d", token)
        self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
        return self._stream.step(self._backend, token)

    def _find_stop(self, search_from: int) -> tuple[int, str] | None:
        found = [(i, s) for s in self._stops if (i := self.text.find(s, search_from)) >= 0]
        return min(found) if found else None
