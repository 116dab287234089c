"""From sampled tokens to what a caller reads: each sequence's text, its stop decision, `RequestOutput`s.

A new token is appended with its logprobs, detokenized incrementally, and checked against the request's
stops (EOS, stop token ids, stop strings, a grammar that ended, the length limits). The processor decides
that a sequence stops; the scheduler, told by the engine, frees its blocks.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf
from typing import Any

import torch

from strata.engine.detokenizer import IncrementalDetokenizer, TokenTexts
from strata.engine.scheduler import ScheduledSequence
from strata.engine.sequence import Request, Sequence, SequenceStatus
from strata.engine.step_sampler import SampledToken
from strata.outputs import CompletionOutput, Logprob, RequestOutput
from strata.sample import TokenLogprobs, compute_prompt_logprobs
from strata.sampling_params import SamplingParams
from strata.worker.model_runner import ModelOutput


class OutputProcessor:
    """Text, stops and outputs of an engine's sequences, for its tokenizer (None: token ids only)."""

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.token_texts = TokenTexts(tokenizer) if tokenizer is not None else None

    def detokenizer(self, prompt_token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        """A new sequence's detokenizer, when it has text at all."""
        if self.tokenizer is None or not params.detokenize:
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)

    # -- a step's tokens ------------------------------------------------------------------------------
    def append_tokens(self, tokens: Iterable[SampledToken]) -> list[tuple[Sequence, SequenceStatus]]:
        """Append each sampled token to its sequence; the sequences that stop with it, and how."""
        now = time.monotonic()
        stopped = []
        for sampled in tokens:
            seq = sampled.seq
            if seq.request.first_token_time is None:
                seq.request.first_token_time = now
            status = self._append(seq, sampled.token_id, sampled.logprobs)
            if status is not None:
                stopped.append((seq, status))
        return stopped

    def _append(self, seq: Sequence, token: int, token_logprobs: TokenLogprobs | None) -> SequenceStatus | None:
        seq.token_ids.append(token)
        if token_logprobs is not None:
            assert seq.logprobs is not None
            seq.cumulative_logprob += token_logprobs.logprob
            seq.logprobs.append(self._logprob_dict(token_logprobs))
        text_before = len(seq.output_text)
        if seq.detokenizer is not None:
            seq.output_text += seq.detokenizer.add_token(token)
        grammar_ended = seq.grammar is not None and seq.grammar.accept(token)
        status = self._check_stop(seq, token, text_before)
        if status is None and grammar_ended:
            status = SequenceStatus.FINISHED_STOPPED  # nothing may follow: vLLM ends the request too
        if status is not None and seq.detokenizer is not None and not isinstance(seq.stop_reason, str):
            seq.output_text += seq.detokenizer.flush()
        return status

    def _check_stop(self, seq: Sequence, token: int, text_before: int) -> SequenceStatus | None:
        params = seq.params
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED
            if params.stop_token_ids and token in params.stop_token_ids:
                seq.stop_reason = token
                return SequenceStatus.FINISHED_STOPPED
            if params.stop and _truncate_at_stop_string(seq, text_before):
                return SequenceStatus.FINISHED_STOPPED
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len
        if seq.num_output_tokens >= max_tokens or seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def record_prompt_logprobs(self, scheduled: SequenceOf[ScheduledSequence], model_output: ModelOutput) -> None:
        """The logprobs of the prompt positions this step computed, for requests that asked for them."""
        for index, (first_row, count) in model_output.prompt_rows.items():
            item = scheduled[index]
            if item.seq.is_finished:
                continue
            seq, request = item.seq, item.seq.request
            assert request.prompt_logprobs is not None and request.params.prompt_logprobs is not None
            targets = torch.tensor(seq.token_ids[item.start + 1 : item.start + 1 + count], dtype=torch.int64)
            entries = compute_prompt_logprobs(
                model_output.logits[first_row : first_row + count], targets, request.params.prompt_logprobs
            )
            # After a preemption the prompt is recomputed: keep only positions not recorded yet.
            skip = len(request.prompt_logprobs) - (item.start + 1)
            request.prompt_logprobs.extend(self._logprob_dict(entry) for entry in entries[max(skip, 0) :])

    # -- outputs --------------------------------------------------------------------------------------
    def outputs(self, requests: Iterable[Request]) -> list[RequestOutput]:
        """The outputs of requests a step moved: every one, or only the finished ones that asked for their
        final output only (vLLM's `RequestOutputKind.FINAL_ONLY`)."""
        return [
            make_output(request) for request in requests if request.is_finished or not request.final_output_only
        ]

    def token_text(self, token_id: int) -> str | None:
        """A token's text on its own, leading space kept (as vLLM shows it in logprobs), or its escaped
        bytes when it is only part of a character."""
        return self.token_texts.standalone(token_id) if self.token_texts is not None else None

    def _logprob_dict(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        result = {entry.token_id: Logprob(entry.logprob, entry.rank, self.token_text(entry.token_id))}
        for rank, (token_id, logprob) in enumerate(
            zip(entry.top_token_ids, entry.top_logprobs, strict=True), 1
        ):
            if token_id not in result:
                result[token_id] = Logprob(logprob, rank, self.token_text(token_id))
        return result


def _truncate_at_stop_string(seq: Sequence, text_before: int) -> bool:
    """Cut the output text at the earliest stop string that the newest text completed."""
    params = seq.params
    longest = max(len(s) for s in params.stop)
    search_from = max(0, text_before - longest + 1)
    hits = [(pos, stop) for stop in params.stop if (pos := seq.output_text.find(stop, search_from)) >= 0]
    if not hits:
        return False
    pos, stop = min(hits)
    seq.output_text = seq.output_text[: pos + len(stop) if params.include_stop_str_in_output else pos]
    seq.stop_reason = stop
    return True


def make_output(request: Request) -> RequestOutput:
    """A snapshot: the lists are copies, so later steps never change an output already handed out."""
    completions = [
        CompletionOutput(
            index=seq.index,
            text=seq.output_text,
            token_ids=seq.output_token_ids,
            cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            finish_reason=seq.status.finish_reason,
            stop_reason=seq.stop_reason,
        )
        for seq in request.seqs
    ]
    return RequestOutput(
        request_id=request.request_id,
        prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids,
        prompt_logprobs=list(request.prompt_logprobs) if request.prompt_logprobs is not None else None,
        outputs=completions,
        finished=request.is_finished,
        num_cached_tokens=request.seqs[0].num_cached_tokens,
    )
