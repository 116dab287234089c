"""Runs the model for one scheduled step and owns the KV-cache tensors.

All scheduled tokens of all sequences (prefill chunks and decode tokens mixed) are flattened into one
row with explicit `position_ids`; the attention metadata tells the paged backend which rows belong to
which sequence and where their keys and values live in the cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from strata.attention.forward_context import AttentionMetadata, set_forward_context
from strata.compilation.compiler import CompiledForward
from strata.config import ConfigError, EngineConfig
from strata.models.transformers.loader import build_model

logger = logging.getLogger("strata.worker")

# Without an explicit kv_cache_memory, the cache takes at most this share of the memory that is free now.
_DEFAULT_FREE_MEMORY_FRACTION = 0.25
# Views a staging buffer keeps for reuse: decode steps use a handful of shapes, prefill lengths come and go.
_MAX_STAGED_VIEWS = 64


class ScheduledSequenceState(Protocol):
    """What the runner reads of a scheduled sequence (the engine's `Sequence`)."""

    token_ids: list[int]
    block_table: list[int]
    num_prompt_tokens: int
    needs_prompt_logprobs: bool


class ScheduledWork(Protocol):
    """One sequence's share of a step (the engine's `ScheduledSequence`): `num_tokens` tokens from `start`,
    and whether a token is sampled after them."""

    seq: ScheduledSequenceState
    num_tokens: int

    @property
    def start(self) -> int: ...

    @property
    def samples(self) -> bool: ...


@dataclass
class ModelOutput:
    """Logits for the rows the engine asked for: one per sampling sequence, plus prompt-logprob rows."""

    logits: torch.Tensor  # [num_rows, vocab]
    sample_rows: list[int]  # row of `logits` to sample from, per sampling sequence (in scheduled order)
    prompt_rows: dict[int, tuple[int, int]]  # scheduled index -> (first row, number of prompt-logprob rows)

    def sampled_logits(self) -> torch.Tensor:
        """The rows to sample from, in order: `logits` itself when those are all its rows (the usual step,
        and then no copy of [rows, vocab] floats), else the selected rows."""
        if self.sample_rows == list(range(self.logits.shape[0])):
            return self.logits
        rows = torch.tensor(self.sample_rows, dtype=torch.int64, device=self.logits.device)
        return self.logits.index_select(0, rows)


class StagingBuffer:
    """A reused 1-D host tensor for one per-step input, with its views by shape. Filling it through its numpy
    view and returning a view made at an earlier step is several times cheaper than a fresh
    `torch.tensor(list)` or a slice of a tensor, which matters at batch 1, where a step's preparation is a
    visible share of the step. Grows when a step needs more room.

    An inference tensor, as the engine's step creates its tensors: the compiled forward's guards see the
    same kind of tensor either way."""

    def __init__(self, dtype: torch.dtype) -> None:
        self._allocate(dtype, 0)

    def _allocate(self, dtype: torch.dtype, size: int) -> None:
        with torch.inference_mode():
            self.tensor = torch.empty(size, dtype=dtype)
        self.array = self.tensor.numpy()
        self.views: dict[tuple[int, ...], torch.Tensor] = {}

    def fill(self, values: list[int], shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The first `len(values)` entries set to `values`, as a tensor of `shape` (default 1-D); valid until
        the next `fill`."""
        count = len(values)
        if count > self.tensor.numel():
            self._allocate(self.tensor.dtype, max(count, 2 * self.tensor.numel()))
        self.array[:count] = values
        shape = shape or (count,)
        view = self.views.get(shape)
        if view is None:
            if len(self.views) >= _MAX_STAGED_VIEWS:
                self.views.clear()
            with torch.inference_mode():
                view = self.views[shape] = self.tensor[:count].view(shape)
        return view


@dataclass
class StepStaging:
    """The host buffers one step's inputs are staged in. A step's tensors are views of them, so the runner
    holds no tensor of a step past the next one's `_prepare` (the engine runs one step at a time)."""

    input_ids: StagingBuffer = field(default_factory=lambda: StagingBuffer(torch.int64))
    positions: StagingBuffer = field(default_factory=lambda: StagingBuffer(torch.int64))
    slots: StagingBuffer = field(default_factory=lambda: StagingBuffer(torch.int64))
    block_tables: StagingBuffer = field(default_factory=lambda: StagingBuffer(torch.int64))
    seq_lens: StagingBuffer = field(default_factory=lambda: StagingBuffer(torch.int32))
    query_start_loc: StagingBuffer = field(default_factory=lambda: StagingBuffer(torch.int32))
    keep: StagingBuffer = field(default_factory=lambda: StagingBuffer(torch.int64))


class ModelRunner:
    """Builds the model on the engine's platform, owns its KV cache and runs one step at a time. Everything
    that depends on the hardware (kernels, the attention backend, memory, threads) it asks the platform."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.platform = platform = config.platform
        self.device = config.torch_device
        self.block_size = config.cache_config.block_size
        self.model: nn.Module
        platform.prepare()
        compilation = config.compilation_config
        wait_for_warmup = platform.start_compile_warmup() if compilation.compile else None
        self.model, self.layers = build_model(
            config.model_config, config.layer_config, platform, bool(compilation.use_layer_name)
        )
        self.model.to(self.device)
        self.compiled: CompiledForward | None = None
        if compilation.compile:
            if wait_for_warmup is not None:
                wait_for_warmup()
            self.compiled = CompiledForward(self.model, config)
        self.thread_policy = platform.thread_policy(bool(config.adaptive_threads))
        self._staging = StepStaging()
        self.kv_cache_dtype = config.cache_config.cache_dtype(config.model_config.torch_dtype)
        self.attn_backend = platform.attention_backend(self.kv_cache_dtype)
        self.num_blocks = self._decide_num_blocks()
        self.kv_caches = self._allocate_kv_caches()

    # -- KV cache -------------------------------------------------------------------------------------
    def _bytes_per_block(self) -> int:
        itemsize = self.kv_cache_dtype.itemsize
        return sum(2 * self.block_size * spec.num_kv_heads * spec.head_dim * itemsize for spec in self.layers)

    def _decide_num_blocks(self) -> int:
        model_config = self.config.model_config
        per_block = self._bytes_per_block()
        min_blocks = -(-model_config.max_model_len // self.block_size)  # one full-length sequence must fit
        requested = self.config.cache_config.kv_cache_memory
        if requested is not None:
            num_blocks = requested // per_block
            if num_blocks < min_blocks:
                raise ConfigError(
                    f"kv_cache_memory={requested} bytes holds {num_blocks} blocks of {self.block_size} tokens, but one "
                    f"sequence of max_model_len={model_config.max_model_len} needs {min_blocks} "
                    f"({min_blocks * per_block} bytes); raise kv_cache_memory or lower max_model_len"
                )
            return num_blocks
        # Enough for every sequence slot at full length, bounded by a share of the free memory.
        wanted = self.config.scheduler_config.max_num_seqs * min_blocks
        free = self.platform.available_memory(self.device)
        affordable = int(free * _DEFAULT_FREE_MEMORY_FRACTION) // per_block
        return max(min_blocks, min(wanted, affordable))

    def _allocate_kv_caches(self) -> dict[str, torch.Tensor]:
        dtype = self.kv_cache_dtype
        caches = {
            spec.name: torch.zeros(
                2,
                self.num_blocks,
                self.block_size,
                spec.num_kv_heads,
                spec.head_dim,
                dtype=dtype,
                device=self.device,
            )
            for spec in self.layers
        }
        total = self.num_blocks * self._bytes_per_block()
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB of %s) over %d layers",
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.block_size,
            total / 2**20,
            str(dtype).removeprefix("torch."),
            len(self.layers),
        )
        return caches

    # -- one step -------------------------------------------------------------------------------------
    def _prepare(
        self, scheduled: Sequence[ScheduledWork]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        # Built as Python lists and staged into reused host buffers: per-step tensor arithmetic on a handful
        # of ints costs more in op dispatch than the lists do (the slot of position p is its block's first
        # slot plus p's offset in the block).
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        max_blocks = max(len(s.seq.block_table) for s in scheduled)
        block_rows: list[int] = []
        size = self.block_size
        for item in scheduled:
            seq, start, end = item.seq, item.start, item.start + item.num_tokens
            table = seq.block_table
            if end - start == 1:  # a decode row: no slices, ranges or generators
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // size] * size + start % size)
            else:
                input_ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend(table[p // size] * size + p % size for p in range(start, end))
            query_start_loc.append(end - start + query_start_loc[-1])
            seq_lens.append(end)
            block_rows.extend(table)
            if len(table) < max_blocks:
                block_rows.extend([0] * (max_blocks - len(table)))
        staging = self._staging
        metadata = AttentionMetadata(
            slot_mapping=self._on_device(staging.slots.fill(slots)),
            block_tables=self._on_device(staging.block_tables.fill(block_rows, (len(scheduled), max_blocks))),
            seq_lens=self._on_device(staging.seq_lens.fill(seq_lens)),
            query_start_loc=self._on_device(staging.query_start_loc.fill(query_start_loc)),
            seq_lens_host=seq_lens,
            query_start_loc_host=query_start_loc,
            max_query_len=max(s.num_tokens for s in scheduled),
            max_seq_len=max(seq_lens),
            block_size=self.block_size,
        )
        # HF's [batch 1, tokens] layout
        input_ids_t = self._on_device(staging.input_ids.fill(input_ids, (1, len(input_ids))))
        return input_ids_t, self._on_device(staging.positions.fill(positions, (1, len(positions)))), metadata

    def _on_device(self, host: torch.Tensor) -> torch.Tensor:
        """A staged host tensor as the model's device sees it."""
        return self.platform.to_device(host, self.device)

    @torch.inference_mode()
    def execute(self, scheduled: Sequence[ScheduledWork]) -> ModelOutput:
        start = time.perf_counter()
        input_ids, positions, metadata = self._prepare(scheduled)
        rows: list[int] = []
        sample_rows: list[int] = []
        prompt_rows: dict[int, tuple[int, int]] = {}
        for i, item in enumerate(scheduled):
            first, seq = metadata.query_start_loc_host[i], item.seq
            if seq.needs_prompt_logprobs and item.start < seq.num_prompt_tokens - 1:
                # Position p predicts prompt token p + 1: every prompt position but the last one has a target.
                count = min(item.start + item.num_tokens, seq.num_prompt_tokens - 1) - item.start
                prompt_rows[i] = (len(rows), count)
                rows.extend(range(first, first + count))
            if item.samples:
                sample_rows.append(len(rows))
                rows.append(first + item.num_tokens - 1)
        if not rows:  # a step of prefill chunks only: the cache is filled, no logits are needed
            rows = [0]
        keep = self._on_device(self._staging.keep.fill(rows))
        policy = self.thread_policy
        threads = policy.enter() if policy is not None else None
        try:
            with set_forward_context(metadata, self.kv_caches, self.attn_backend):
                if self.compiled is not None:
                    logits = self.compiled(input_ids, positions, keep)
                else:
                    logits = self.model(
                        input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=keep
                    ).logits[0]
        finally:
            if policy is not None:
                policy.exit(threads)
        if policy is not None:
            policy.observe((len(scheduled), input_ids.shape[1]), time.perf_counter() - start)
        return ModelOutput(logits=logits, sample_rows=sample_rows, prompt_rows=prompt_rows)
