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
from strata.compilation.compiler import CompiledForward, model_forward
from strata.config import ConfigError, EngineConfig
from strata.distributed.parallel_state import local_rank, pp_rank, pp_world_size, set_group_device
from strata.models.transformers.loader import build_model
from strata.models.transformers.pipeline_parallel import set_stage_input

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


@dataclass
class StepPlan:
    """One step's inputs as plain lists: every scheduled token flattened (ids, positions, cache slots),
    each sequence's block table row, length and query start, and the rows whose logits are kept."""

    max_blocks: int
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    block_rows: list[int] = field(default_factory=list)  # [sequences, max_blocks], zero-padded
    seq_lens: list[int] = field(default_factory=list)
    query_start_loc: list[int] = field(default_factory=lambda: [0])
    max_query_len: int = 0
    rows: list[int] = field(default_factory=list)  # flattened rows whose logits are computed
    sample_rows: list[int] = field(default_factory=list)
    prompt_rows: dict[int, tuple[int, int]] = field(default_factory=dict)


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
    holds no tensor of a step past the next one's `_stage` (the engine runs one step at a time)."""

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
        self.device = platform.rank_device(config.torch_device, local_rank())
        set_group_device(self.device)
        self.block_size = config.cache_config.block_size
        self.model: nn.Module
        platform.prepare()
        compilation = config.compilation_config
        wait_for_warmup = platform.start_compile_warmup() if compilation.compile else None
        self.model, self.layers = build_model(
            config.model_config, config.layer_config, platform, bool(compilation.use_layer_name)
        )
        self.model.to(self.device)
        # A pipeline stage before the last returns hidden states for the next stage, not logits.
        self.last_stage = pp_rank() == pp_world_size() - 1
        self.compiled: CompiledForward | None = None
        if compilation.compile:
            if wait_for_warmup is not None:
                wait_for_warmup()
            self.compiled = CompiledForward(self.model, config, hidden=not self.last_stage)
        self.thread_policy = platform.thread_policy(bool(config.adaptive_threads))
        self._staging = StepStaging()
        self.kv_cache_dtype = config.cache_config.cache_dtype(config.model_config.torch_dtype)
        self.attn_backend = platform.attention_backend(
            self.kv_cache_dtype, reference=config.layer_config.use_hw_agnostic
        )
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

    def resize_kv_cache(self, num_blocks: int) -> None:
        """Reallocate the (still empty) cache with `num_blocks` blocks: what every rank agreed on."""
        if num_blocks != self.num_blocks:
            self.num_blocks = num_blocks
            self.kv_caches = self._allocate_kv_caches()

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
    def plan(self, scheduled: Sequence[ScheduledWork]) -> StepPlan:
        """A step's inputs as plain lists (what tensor-parallel ranks receive from rank 0).

        Python lists, staged into reused host buffers by `run`: per-step tensor arithmetic on a handful of
        ints costs more in op dispatch than the lists do (the slot of position p is its block's first slot
        plus p's offset in the block)."""
        plan = StepPlan(max_blocks=max(len(s.seq.block_table) for s in scheduled))
        size = self.block_size
        for i, item in enumerate(scheduled):
            seq, start, end = item.seq, item.start, item.start + item.num_tokens
            table = seq.block_table
            first = plan.query_start_loc[-1]
            if end - start == 1:  # a decode row: no slices, ranges or generators
                plan.input_ids.append(seq.token_ids[start])
                plan.positions.append(start)
                plan.slots.append(table[start // size] * size + start % size)
            else:
                plan.input_ids.extend(seq.token_ids[start:end])
                plan.positions.extend(range(start, end))
                plan.slots.extend(table[p // size] * size + p % size for p in range(start, end))
            plan.query_start_loc.append(end - start + first)
            plan.seq_lens.append(end)
            plan.block_rows.extend(table)
            if len(table) < plan.max_blocks:
                plan.block_rows.extend([0] * (plan.max_blocks - len(table)))
            plan.max_query_len = max(plan.max_query_len, item.num_tokens)
            if seq.needs_prompt_logprobs and start < seq.num_prompt_tokens - 1:
                # Position p predicts prompt token p + 1: every prompt position but the last one has a target.
                count = min(end, seq.num_prompt_tokens - 1) - start
                plan.prompt_rows[i] = (len(plan.rows), count)
                plan.rows.extend(range(first, first + count))
            if item.samples:
                plan.sample_rows.append(len(plan.rows))
                plan.rows.append(first + item.num_tokens - 1)
        if not plan.rows:  # a step of prefill chunks only: the cache is filled, no logits are needed
            plan.rows = [0]
        return plan

    def _stage(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input ids, positions, rows to keep, attention metadata) of a plan, as the model's device sees them."""
        staging = self._staging
        num_seqs = len(plan.seq_lens)
        metadata = AttentionMetadata(
            slot_mapping=self._on_device(staging.slots.fill(plan.slots)),
            block_tables=self._on_device(
                staging.block_tables.fill(plan.block_rows, (num_seqs, plan.max_blocks))
            ),
            seq_lens=self._on_device(staging.seq_lens.fill(plan.seq_lens)),
            query_start_loc=self._on_device(staging.query_start_loc.fill(plan.query_start_loc)),
            seq_lens_host=plan.seq_lens,
            query_start_loc_host=plan.query_start_loc,
            max_query_len=plan.max_query_len,
            max_seq_len=max(plan.seq_lens),
            block_size=self.block_size,
        )
        # HF's [batch 1, tokens] layout
        num_tokens = len(plan.input_ids)
        input_ids = self._on_device(staging.input_ids.fill(plan.input_ids, (1, num_tokens)))
        positions = self._on_device(staging.positions.fill(plan.positions, (1, num_tokens)))
        return input_ids, positions, self._on_device(staging.keep.fill(plan.rows)), metadata

    def _on_device(self, host: torch.Tensor) -> torch.Tensor:
        """A staged host tensor as the model's device sees it."""
        return self.platform.to_device(host, self.device)

    def execute(self, scheduled: Sequence[ScheduledWork]) -> ModelOutput:
        return self.run(self.plan(scheduled))

    def run(self, plan: StepPlan) -> ModelOutput:
        """The forward of one planned step: logits of the rows the plan keeps."""
        return ModelOutput(
            logits=self.forward(plan), sample_rows=plan.sample_rows, prompt_rows=plan.prompt_rows
        )

    @torch.inference_mode()
    def forward(self, plan: StepPlan, stage_input: torch.Tensor | None = None) -> torch.Tensor:
        """This process's part of a planned step: the logits of the rows the plan keeps, or, on a pipeline
        stage before the last, the hidden states of every token. A stage past the first starts from the
        previous stage's output, `stage_input`."""
        start = time.perf_counter()
        input_ids, positions, keep, metadata = self._stage(plan)
        if stage_input is not None:
            set_stage_input(stage_input)
        policy = self.thread_policy
        threads = policy.enter() if policy is not None else None
        try:
            with set_forward_context(metadata, self.kv_caches, self.attn_backend):
                if self.compiled is not None:
                    output = self.compiled(input_ids, positions, keep)
                else:
                    output = model_forward(not self.last_stage)(self.model, input_ids, positions, keep)
        finally:
            if policy is not None:
                policy.exit(threads)
        if policy is not None:
            policy.observe((len(plan.seq_lens), input_ids.shape[1]), time.perf_counter() - start)
        return output
