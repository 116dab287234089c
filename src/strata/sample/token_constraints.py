"""A request's `allowed_token_ids`, `bad_words` and `logit_bias`, resolved against the vocabulary once.

Bad words follow vLLM: each word is tokenized as written, and after a space where that gives other tokens
of the same count (byte-level BPE tokenizers), and a word's last token is banned whenever the output so
far ends with the word's other tokens (a one-token word is banned always).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from strata.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenConstraints:
    """The masking and biasing a request asks for beyond its grammar, as token ids."""

    # float32 [vocab_size]: -inf for the tokens outside allowed_token_ids, else 0; None when all are allowed.
    allowed_bias: torch.Tensor | None
    bias_ids: list[int]
    bias_values: list[float]
    bad_words: list[list[int]]

    @classmethod
    def resolve(cls, params: SamplingParams, tokenizer: Any, vocab_size: int) -> TokenConstraints | None:
        """None when the request sets none of the three. `bad_words` needs a tokenizer (the engine checks)."""
        if params.allowed_token_ids is None and not params.logit_bias and not params.bad_words:
            return None
        allowed_bias = None
        if params.allowed_token_ids is not None:
            allowed_bias = torch.full((vocab_size,), float("-inf"))
            allowed_bias[params.allowed_token_ids] = 0.0
        bad_words: list[list[int]] = []
        for word in params.bad_words or []:
            as_written = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            after_space = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if as_written:
                bad_words.append(as_written)
            # Byte-level BPE spells the word differently after a space ("Ġword"); SentencePiece marks the
            # space in both, and then only adds a lone "▁" token in front, which needs no ban of its own.
            if (
                after_space
                and as_written
                and after_space[0] != as_written[0]
                and len(after_space) == len(as_written)
            ):
                bad_words.append(after_space)
        bias = params.logit_bias or {}
        return cls(allowed_bias, list(bias), list(bias.values()), bad_words)

    def banned_now(self, output_token_ids: list[int]) -> list[int]:
        """Tokens a bad word bans at the next position, given the output so far."""
        banned = []
        for word in self.bad_words:
            prefix = len(word) - 1
            if prefix == 0 or (
                len(output_token_ids) >= prefix
                and output_token_ids[len(output_token_ids) - prefix :] == word[:-1]
            ):
                banned.append(word[-1])
        return banned
