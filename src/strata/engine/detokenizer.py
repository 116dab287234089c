"""Incremental detokenisation: text grows token by token and never splits a multi-byte character.

Decoding a token alone loses context (SentencePiece drops a leading space, byte-fallback tokens are
fragments of one character), so each step decodes a short window ending at the new token and emits only
what the window added past its already-emitted part. A window whose text ends in U+FFFD is waiting for
the rest of a character and emits nothing yet.
"""

from __future__ import annotations

from typing import Any

# Prompt tokens kept as left context so the first output token decodes with its real spacing.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str:
        """Append one generated token and return the text it completes (possibly empty)."""
        self.token_ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of generation: emit whatever is pending, even an incomplete character."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        if self.prefix_offset > 4 * _CONTEXT_TOKENS:  # keep the list short for long generations
            drop = self.prefix_offset
            self.token_ids = self.token_ids[drop:]
            self.prefix_offset -= drop
            self.read_offset -= drop
        return full_text[len(prefix_text) :]
