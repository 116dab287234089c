"""From a step's logits to one new token per sampling sequence.

The model returns a row of logits for every scheduled sequence that reached its last token. Some of those
rows are not sampled: the sequence was aborted while its step was in flight (pipeline parallel), or its
grammar did not compile for this vocabulary. `StepSampler` keeps each row with its sequence, so what it
returns pairs every token with the sequence it belongs to and nothing is aligned by index afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

import torch

from strata.engine.scheduler import ScheduledSequence
from strata.engine.sequence import Request, Sequence
from strata.sample import Sampler, SamplingMetadata, SamplingRow, TokenLogprobs
from strata.structured_output import StructuredOutputError, StructuredOutputManager
from strata.worker.model_runner import ModelOutput


@dataclass
class SampledToken:
    seq: Sequence
    token_id: int
    logprobs: TokenLogprobs | None


@dataclass
class SampledStep:
    """One step's new tokens, the sequences whose grammar failed instead, and the requests to report, in
    scheduled order: those of both (a request whose grammar failed is reported, finished)."""

    tokens: list[SampledToken] = field(default_factory=list)
    grammar_failures: list[tuple[Sequence, StructuredOutputError]] = field(default_factory=list)
    requests: dict[str, Request] = field(default_factory=dict)


class StepSampler:
    """Samples a step's tokens with the batched `Sampler`, building its metadata from the sequences."""

    def __init__(
        self, sampler: Sampler, structured_output: StructuredOutputManager, eos_token_ids: frozenset[int]
    ) -> None:
        self.sampler = sampler
        self.structured_output = structured_output
        self.eos_token_ids = eos_token_ids

    def sample(self, scheduled: SequenceOf[ScheduledSequence], model_output: ModelOutput) -> SampledStep:
        # The model's sampled rows, in order, belong to the scheduled items that sample.
        rows = [(row, item.seq) for row, item in enumerate(item for item in scheduled if item.samples)]
        step = SampledStep()
        live: list[tuple[int, Sequence]] = []
        for row, seq in rows:
            if seq.is_finished:  # aborted while its step was in flight
                continue
            step.requests[seq.request.request_id] = seq.request
            error = _grammar_failure(seq)
            if error is not None:
                step.grammar_failures.append((seq, error))
            else:
                live.append((row, seq))
        if not live:
            return step
        logits = model_output.sampled_logits()
        if len(live) < len(rows):
            keep = torch.tensor([row for row, _ in live], device=logits.device)
            logits = logits.index_select(0, keep)
        seqs = [seq for _, seq in live]
        token_ids, logprobs = self._sample(seqs, logits)
        step.tokens = [
            SampledToken(seq, token_id, entry) for seq, token_id, entry in zip(seqs, token_ids, logprobs, strict=True)
        ]
        return step

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[int], list[TokenLogprobs | None]]:
        if all(len(seq.token_ids) >= seq.argmax_only_from for seq in seqs):
            return self.sampler.greedy(logits), [None] * len(seqs)
        rows = [
            SamplingRow(
                seq.params,
                seq.request.prompt_token_ids,
                seq.output_token_ids,
                seq.generator,
                seq.request.constraints,
            )
            for seq in seqs
        ]
        masks = self.structured_output.masks([seq.grammar for seq in seqs])
        metadata = SamplingMetadata.build(rows, logits.shape[-1], self.eos_token_ids, logits.device, masks)
        result = self.sampler(logits, metadata)
        return result.sampled_token_ids, result.logprobs


def _grammar_failure(seq: Sequence) -> StructuredOutputError | None:
    """The error of a grammar that validated but did not compile for this vocabulary (rare: the spec was
    checked when its SamplingParams were built). Waits for an unfinished compile."""
    if seq.grammar is None:
        return None
    try:
        seq.grammar.matcher()
    except StructuredOutputError as exc:
        return exc
    return None
