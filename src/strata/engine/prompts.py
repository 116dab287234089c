"""Checking and tokenizing prompts before they reach an engine: what a prompt may be, and the errors
that name what is wrong with one. Needs only the tokenizer, the vocabulary size and the context length,
so a server whose engines run in other processes checks prompts the same way."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as SequenceABC
from typing import Any

PromptType = str | list[int] | Mapping[str, Any]


class PromptError(ValueError):
    """A prompt the engine cannot run (empty, too long, ids outside the vocabulary, wrong type)."""


class PromptChecker:
    """Turns prompts into token ids for a model of `vocab_size` tokens and `max_model_len` positions,
    refusing what an engine could not run; `tokenizer` None takes token ids only."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Turn a prompt (text, token ids, or a `{"prompt": ...}` / `{"prompt_token_ids": ...}` dict) into ids."""
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                text, ids = self._encode(prompt["prompt"])
            else:
                raise PromptError(
                    "a prompt dict needs a 'prompt' (text) or 'prompt_token_ids' (list of ints) key"
                )
        elif isinstance(prompt, str):
            text, ids = self._encode(prompt)
        elif isinstance(prompt, SequenceABC) and not isinstance(prompt, bytes | bytearray):
            text, ids = None, self._check_token_ids(prompt)
        else:
            raise PromptError(
                f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}"
            )
        if not ids:
            raise PromptError("the prompt is empty: it must contain at least one token")
        if len(ids) >= self.max_model_len:
            raise PromptError(
                f"the prompt is {len(ids)} tokens long, but max_model_len={self.max_model_len} leaves no room to "
                "generate; shorten the prompt or raise max_model_len"
            )
        return text, ids

    def _encode(self, text: Any) -> tuple[str, list[int]]:
        if not isinstance(text, str):
            raise PromptError(f"'prompt' must be a string, got {type(text).__name__}")
        if self.tokenizer is None:
            raise PromptError(
                "this engine was started with skip_tokenizer_init=True: give prompts as token ids"
            )
        return text, list(self.tokenizer.encode(text))

    def _check_token_ids(self, ids: Any) -> list[int]:
        if isinstance(ids, str | bytes) or not isinstance(ids, SequenceABC):
            raise PromptError("'prompt_token_ids' must be a list of integers")
        checked = []
        for token in ids:
            if isinstance(token, bool) or not isinstance(token, int):
                raise PromptError(f"'prompt_token_ids' must hold integers, got {token!r}")
            if not 0 <= token < self.vocab_size:
                raise PromptError(
                    f"token id {token} in 'prompt_token_ids' is outside the vocabulary [0, {self.vocab_size})"
                )
            checked.append(token)
        return checked
