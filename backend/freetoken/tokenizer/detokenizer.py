"""Incremental detokenization that never splits a multibyte character across two deltas.

Byte-level BPE tokens can end in the middle of a UTF-8 sequence. Each step decodes a short window
of recent tokens twice (with and without the new ones) and emits the difference only once it no
longer ends in U+FFFD, the mark of an incomplete sequence.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"
# Tokens of the prompt decoded as left context, so the first output token's text comes out as it
# would in the middle of a sequence.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special_tokens: bool
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._vocab_size = len(tokenizer)
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        # Ids past the tokenizer (a vocabulary padded above it) decode to nothing.
        known = [i for i in ids if i < self._vocab_size]
        return self._tokenizer.decode(known, skip_special_tokens=self._skip_special)

    def step(self, new_token_ids: list[int]) -> str:
        """The text the new tokens complete (possibly empty while a character is incomplete)."""
        self._ids.extend(new_token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Whatever is still held back, at the end of the request (an incomplete tail shows as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or (full_text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta
