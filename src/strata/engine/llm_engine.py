"""The engine loop: add requests, then `step()` until they finish.

One step = schedule -> run the model on all scheduled tokens -> sample -> detokenise and check stops.
`step()` returns a cumulative `RequestOutput` for every request that advanced, so callers can stream.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import asdict
from typing import Any

import torch

from strata.config import ConfigError, EngineConfig
from strata.distributed.communication import collective_seconds
from strata.engine.block_manager import BlockManager
from strata.engine.detokenizer import IncrementalDetokenizer
from strata.engine.prompts import PromptChecker, PromptType
from strata.engine.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from strata.engine.sequence import Request, Sequence, SequenceStatus
from strata.engine.token_text import TokenTexts
from strata.gguf_file import find_gguf
from strata.gguf_file import load_tokenizer as load_gguf_tokenizer
from strata.outputs import CompletionOutput, Logprob, RequestOutput
from strata.sample import (
    Sampler,
    SamplingMetadata,
    SamplingRow,
    TokenConstraints,
    TokenLogprobs,
    compute_prompt_logprobs,
)
from strata.sampling_params import SamplingParams, SamplingParamsError
from strata.structured_output import StructuredOutputError, StructuredOutputManager
from strata.worker.executor import create_executor
from strata.worker.model_runner import ModelOutput, ModelRunner

logger = logging.getLogger("strata.engine")


def load_tokenizer(path: str) -> Any:
    """The tokenizer of a Hugging Face folder, or the one a GGUF file's metadata describes."""
    from transformers import AutoTokenizer

    try:
        gguf_file = find_gguf(path)
        if gguf_file is not None:
            return load_gguf_tokenizer(gguf_file)
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(
            f"could not load a tokenizer from {path!r} ({exc}); pass skip_tokenizer_init=True to run on token ids"
        ) from exc


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_config = config.model_config
        self.max_model_len: int = model_config.max_model_len  # type: ignore[assignment]
        self.tokenizer = None if model_config.skip_tokenizer_init else load_tokenizer(model_config.tokenizer)
        self.executor = create_executor(config)
        # Steps submitted to a pipeline and not collected yet, oldest first.
        self._in_flight: deque[SchedulerOutput] = deque()
        self.vocab_size = model_config.vocab_size
        self.prompts = PromptChecker(self.tokenizer, self.vocab_size, self.max_model_len)
        self.eos_token_ids = self._eos_token_ids()
        cache = config.cache_config
        self.block_manager = BlockManager(
            self.executor.num_blocks, cache.block_size, cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler_config, self.block_manager)
        self.sampler = Sampler(torch.Generator().manual_seed(model_config.seed), config.platform.argmax_rows)
        self.structured_output = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._request_counter = itertools.count()
        self.token_texts = TokenTexts(self.tokenizer) if self.tokenizer is not None else None
        self.num_forward_passes = 0
        self.num_forward_tokens = 0
        logger.info("engine ready: %s, max_model_len=%d", model_config.model, self.max_model_len)

    def _eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (self.config.model_config.hf_config, self.generation_config()):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list | tuple):
                ids.update(int(v) for v in value)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)

    def generation_config(self) -> Any:
        from transformers import GenerationConfig

        if self.config.model_config.gguf_file is not None:
            return None  # a GGUF file's generation settings (its EOS ids) are in the config already
        try:
            return GenerationConfig.from_pretrained(self.config.model_config.model)
        except OSError:
            return None

    # -- requests -------------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Turn a prompt (text, token ids, or a `{"prompt": ...}` / `{"prompt_token_ids": ...}` dict) into ids."""
        return self.prompts.tokenize(prompt)

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        final_output_only: bool = False,
    ) -> Request:
        """Queue a request. `step` reports it after every step it advances, or with `final_output_only`
        only in the step that finishes it (vLLM's `RequestOutputKind.FINAL_ONLY`, what `LLM.generate`
        asks for: a snapshot per step of every request would cost time nobody reads it for)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        request_id = request_id if request_id is not None else str(next(self._request_counter))
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        params.check_token_ids(self.vocab_size)
        if (params.structured_outputs is not None or params.bad_words) and self.tokenizer is None:
            raise SamplingParamsError(
                "structured_outputs and bad_words need a tokenizer; this engine was started with "
                "skip_tokenizer_init=True"
            )
        request = Request(request_id, text, ids, params, time.monotonic(), final_output_only)
        request.constraints = TokenConstraints.resolve(params, self.tokenizer, self.vocab_size)
        for index in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator().manual_seed(params.seed + index)
            detokenizer = None
            if self.tokenizer is not None and params.detokenize:
                detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
            grammar = None
            if params.structured_outputs is not None:
                grammar = self.structured_output.sequence_grammar(params.structured_outputs)
            request.seqs.append(Sequence(request, index, generator, detokenizer, grammar))
        self.requests[request_id] = request
        for seq in request.seqs:
            self.scheduler.add(seq)
        return request

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks; unknown or finished ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the step -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.executor.pipeline_depth > 1:
            return self._pipelined_step()
        schedule = self.scheduler.schedule()
        if schedule.is_empty:
            return []
        return self._complete(schedule, self.executor.execute(schedule.scheduled))

    def _pipelined_step(self) -> list[RequestOutput]:
        """Start the next step while earlier ones are still in the pipeline's later stages; complete the
        oldest once every stage has one, or when nothing new can start (all in flight)."""
        executor = self.executor
        depth = executor.pipeline_depth
        # Each step takes its share of the sequences, so that every stage has a step to run.
        schedule = self.scheduler.schedule(max_seqs=-(-self.scheduler.num_unfinished // depth))
        if not schedule.is_empty:
            executor.submit(schedule.scheduled)
            for item in schedule.scheduled:
                item.seq.in_flight = True
            self._in_flight.append(schedule)
        if not self._in_flight or (len(self._in_flight) < depth and not schedule.is_empty):
            return []
        oldest = self._in_flight.popleft()
        for item in oldest.scheduled:
            item.seq.in_flight = False
        return self._complete(oldest, executor.collect())

    def _complete(self, schedule: SchedulerOutput, model_output: ModelOutput) -> list[RequestOutput]:
        """Sample after a step's forward, advance its sequences and report the requests it moved."""
        self.num_forward_passes += 1
        self.num_forward_tokens += schedule.num_tokens
        # Sequences aborted while their step was in flight (pipeline parallel) are skipped.
        gone = {item.seq.seq_id for item in schedule.scheduled if item.seq.is_finished}
        sampling = [item for item in schedule.scheduled if item.samples]
        failed = {
            index: error
            for index, error in self._grammar_failures(sampling).items()
            if sampling[index].seq.seq_id not in gone
        }
        skipped = failed.keys() | {index for index, item in enumerate(sampling) if item.seq.seq_id in gone}
        sampled = [item for index, item in enumerate(sampling) if index not in skipped]
        sampled_tokens, sampled_logprobs = self._sample(sampled, model_output, skipped)
        self._record_prompt_logprobs(schedule.scheduled, model_output)
        for item in schedule.scheduled:
            seq = item.seq
            if seq.seq_id not in gone:
                computed_before = seq.num_computed_tokens
                seq.num_computed_tokens += item.num_tokens
                self.block_manager.cache_full_blocks(seq, computed_before)
        for index, error in failed.items():
            logger.error("request %s aborted: %s", sampling[index].seq.request.request_id, error)
            self.scheduler.finish(sampling[index].seq, SequenceStatus.FINISHED_ABORTED)
        now = time.monotonic()
        for item, token, token_logprobs in zip(sampled, sampled_tokens, sampled_logprobs, strict=True):
            seq = item.seq
            if seq.request.first_token_time is None:
                seq.request.first_token_time = now
            self._append_token(seq, token, token_logprobs)
        # Every request that was to sample is reported, also one whose grammar failed.
        touched = {
            item.seq.request.request_id: item.seq.request for item in sampling if item.seq.seq_id not in gone
        }
        outputs = []
        for request in touched.values():
            finished = request.is_finished
            if finished or not request.final_output_only:
                outputs.append(self._make_output(request))
            if finished:
                self.requests.pop(request.request_id, None)
        return outputs

    def _sample(
        self, sampling: list[ScheduledSequence], model_output: ModelOutput, skipped_rows: Collection[int]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """A token for each item of `sampling`: the model's sampled rows less `skipped_rows`."""
        if not sampling:
            return [], []
        logits = model_output.sampled_logits()
        if skipped_rows:
            keep = [row for row in range(logits.shape[0]) if row not in skipped_rows]
            logits = logits.index_select(0, torch.tensor(keep, device=logits.device))
        if all(len(item.seq.token_ids) >= item.seq.argmax_only_from for item in sampling):
            return self.sampler.greedy(logits), [None] * len(sampling)
        rows = [
            SamplingRow(
                item.seq.params,
                item.seq.request.prompt_token_ids,
                item.seq.output_token_ids,
                item.seq.generator,
                item.seq.request.constraints,
            )
            for item in sampling
        ]
        masks = self.structured_output.masks([item.seq.grammar for item in sampling])
        metadata = SamplingMetadata.build(rows, logits.shape[-1], self.eos_token_ids, logits.device, masks)
        result = self.sampler(logits, metadata)
        return result.sampled_token_ids, result.logprobs

    @staticmethod
    def _grammar_failures(sampling: list[ScheduledSequence]) -> dict[int, StructuredOutputError]:
        """Index -> error of the items whose grammar validated but did not compile for this vocabulary
        (rare: the spec was checked when its SamplingParams were built). Waits for unfinished compiles."""
        failed = {}
        for index, item in enumerate(sampling):
            if item.seq.grammar is not None:
                try:
                    item.seq.grammar.matcher()
                except StructuredOutputError as exc:
                    failed[index] = exc
        return failed

    def _record_prompt_logprobs(self, scheduled: list[ScheduledSequence], model_output: ModelOutput) -> None:
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

    def _append_token(self, seq: Sequence, token: int, token_logprobs: TokenLogprobs | None) -> None:
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
        if status is not None:
            if seq.detokenizer is not None and not isinstance(seq.stop_reason, str):
                seq.output_text += seq.detokenizer.flush()
            self.scheduler.finish(seq, status)

    def _check_stop(self, seq: Sequence, token: int, text_before: int) -> SequenceStatus | None:
        params = seq.params
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED
            if params.stop_token_ids and token in params.stop_token_ids:
                seq.stop_reason = token
                return SequenceStatus.FINISHED_STOPPED
            if params.stop and self._truncate_at_stop_string(seq, text_before):
                return SequenceStatus.FINISHED_STOPPED
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len
        if seq.num_output_tokens >= max_tokens or seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    @staticmethod
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

    # -- outputs --------------------------------------------------------------------------------------
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

    def _make_output(self, request: Request) -> RequestOutput:
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

    # -- introspection --------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters for tests, logs and the server's metrics."""
        return {
            **asdict(self.scheduler.stats),
            **asdict(self.block_manager.stats),
            "num_forward_passes": self.num_forward_passes,
            "num_forward_tokens": self.num_forward_tokens,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": self.block_manager.usage,
            "num_kv_blocks": self.block_manager.num_blocks,
            # Rank 0's time in tensor-parallel collectives, waits for the other ranks included.
            "collective_seconds": collective_seconds(),
        }

    @property
    def runner(self) -> ModelRunner:
        """Rank 0's model runner: the model, its layers, the KV cache."""
        return self.executor.runner

    def shutdown(self) -> None:
        """Stop the engine's other processes (its ranks); a one-process engine has none."""
        self.executor.shutdown()

    def apply_model(self, fn: Callable[[torch.nn.Module], Any]) -> Any:
        return self.executor.apply_model(fn)
