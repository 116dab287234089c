"""The engine: add requests, then `step()` until they finish.

One step = the scheduler picks the work -> the executor runs the model on it -> the step sampler draws the
new tokens -> the scheduler takes the step's output (its sequences' cache progress) and the output
processor the tokens (text, stops, outputs). `step()` returns a cumulative `RequestOutput` for every request
that advanced, so callers can stream. With pipeline parallelism several steps are in flight at once.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from strata.config import ConfigError, EngineConfig
from strata.distributed.communication import collective_seconds
from strata.engine.output_processor import OutputProcessor
from strata.engine.prompts import PromptChecker, PromptType
from strata.engine.scheduler import Scheduler, SchedulerOutput
from strata.engine.sequence import Request, Sequence, SequenceStatus
from strata.engine.step_sampler import StepSampler
from strata.gguf.file import find_gguf
from strata.gguf.file import load_tokenizer as load_gguf_tokenizer
from strata.outputs import RequestOutput
from strata.sample import Sampler, TokenConstraints
from strata.sampling_params import SamplingParams, SamplingParamsError
from strata.structured_output import StructuredOutputManager
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
        # Steps submitted to the executor and not collected yet, oldest first.
        self._in_flight: deque[SchedulerOutput] = deque()
        self.vocab_size = model_config.vocab_size
        self.prompts = PromptChecker(self.tokenizer, self.vocab_size, self.max_model_len)
        self.eos_token_ids = self._eos_token_ids()
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config, self.executor.num_blocks)
        self.structured_output = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids)
        sampler = Sampler(torch.Generator().manual_seed(model_config.seed), config.platform.argmax_rows)
        self.step_sampler = StepSampler(sampler, self.structured_output, self.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self._request_counter = itertools.count()
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
            detokenizer = self.output_processor.detokenizer(ids, params)
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
        """Start the next step, and complete the oldest step in flight once the executor holds as many as it
        can run at once (`pipeline_depth`: one, or one per pipeline stage), or when nothing new can start."""
        executor = self.executor
        depth = executor.pipeline_depth
        # In a pipeline each step takes its share of the sequences, so that every stage has a step to run;
        # with one stage, the share is all of them.
        schedule = self.scheduler.schedule(max_seqs=-(-self.scheduler.num_unfinished // depth))
        if not schedule.is_empty:
            executor.submit(schedule.scheduled)
            self._in_flight.append(schedule)
        if not self._in_flight or (len(self._in_flight) < depth and not schedule.is_empty):
            return []
        return self._complete(self._in_flight.popleft(), executor.collect())

    def _complete(self, schedule: SchedulerOutput, model_output: ModelOutput) -> list[RequestOutput]:
        """Sample after a step's forward, advance its sequences and report the requests it moved."""
        self.num_forward_passes += 1
        self.num_forward_tokens += schedule.num_tokens
        step = self.step_sampler.sample(schedule.scheduled, model_output)
        self.output_processor.record_prompt_logprobs(schedule.scheduled, model_output)
        self.scheduler.update_from_output(schedule)
        for seq, error in step.grammar_failures:
            logger.error("request %s aborted: %s", seq.request.request_id, error)
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        for seq, status in self.output_processor.append_tokens(step.tokens):
            self.scheduler.finish(seq, status)
        for request_id, request in step.requests.items():
            if request.is_finished:
                self.requests.pop(request_id, None)
        return self.output_processor.outputs(step.requests.values())

    # -- introspection --------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters for tests, logs and the server's metrics."""
        return {
            **asdict(self.scheduler.stats),
            **asdict(self.scheduler.block_manager.stats),
            "num_forward_passes": self.num_forward_passes,
            "num_forward_tokens": self.num_forward_tokens,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": self.scheduler.block_manager.usage,
            "num_kv_blocks": self.scheduler.block_manager.num_blocks,
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
