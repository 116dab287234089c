"""One generated continuation and the request that owns it.

A `Sequence` knows its tokens, how many of them are already in the KV cache, and which cache blocks
hold them. A request with `n > 1` fans out into `n` sequences that share the prompt.
"""

from __future__ import annotations

import itertools
import sys
from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

from strata.outputs import PromptLogprobs, SampleLogprobs
from strata.sample.sampler import plain_greedy

if TYPE_CHECKING:
    from strata.engine.detokenizer import IncrementalDetokenizer
    from strata.sample.token_constraints import TokenConstraints
    from strata.sampling_params import SamplingParams
    from strata.structured_output import SequenceGrammar


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED_STOPPED = auto()
    FINISHED_LENGTH = auto()
    FINISHED_ABORTED = auto()

    @property
    def is_finished(self) -> bool:
        return self in (
            SequenceStatus.FINISHED_STOPPED,
            SequenceStatus.FINISHED_LENGTH,
            SequenceStatus.FINISHED_ABORTED,
        )

    @property
    def finish_reason(self) -> str | None:
        return {
            SequenceStatus.FINISHED_STOPPED: "stop",
            SequenceStatus.FINISHED_LENGTH: "length",
            SequenceStatus.FINISHED_ABORTED: "abort",
        }.get(self)


_seq_ids = itertools.count()


class Sequence:
    """Tokens (prompt then output), cache progress, and per-sequence sampling state."""

    def __init__(
        self,
        request: Request,
        index: int,
        generator: torch.Generator | None,
        detokenizer: IncrementalDetokenizer | None,
        grammar: SequenceGrammar | None = None,
    ) -> None:
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache at admission
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.generator = generator
        self.detokenizer = detokenizer
        # The structured-output matcher, advanced by each sampled token; each of n sequences has its own.
        self.grammar = grammar
        self.output_text = ""
        self.logprobs: SampleLogprobs | None = [] if request.params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.stop_reason: int | str | None = None
        # From this many tokens on, the next token is the argmax of its logits and nothing more
        # (`plain_greedy`: that holds past `min_tokens` or never); decided once, as the check is per step.
        params = request.params
        self.argmax_only_from = (
            self.num_prompt_tokens + params.min_tokens
            if plain_greedy(params, params.min_tokens)
            else sys.maxsize
        )

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs are computed once per request (by its first sequence), not again after preemption."""
        prompt_logprobs = self.request.prompt_logprobs
        return (
            self.index == 0 and prompt_logprobs is not None and len(prompt_logprobs) < self.num_prompt_tokens
        )

    def reset_for_recompute(self) -> None:
        """After preemption: the cache is gone, every token (prompt and output so far) is recomputed."""
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_table = []
        self.status = SequenceStatus.WAITING


class Request:
    """A user request: the prompt, its sampling parameters, and its `n` sequences."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        final_output_only: bool = False,
    ) -> None:
        self.request_id = request_id
        # Whether the engine reports this request only once it has finished, not after every step.
        self.final_output_only = final_output_only
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.arrival_time = arrival_time
        self.seqs: list[Sequence] = []
        self.prompt_logprobs: PromptLogprobs | None = [None] if params.prompt_logprobs is not None else None
        self.first_token_time: float | None = None
        # allowed_token_ids, bad_words and logit_bias as token ids; set by the engine when any is given.
        self.constraints: TokenConstraints | None = None

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)
