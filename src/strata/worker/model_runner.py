"""Runs the model for one scheduled step and owns the KV-cache tensors.

All scheduled tokens of all sequences (prefill chunks and decode tokens mixed) are flattened into one
row with explicit `position_ids`; the attention metadata tells the paged backend which rows belong to
which sequence and where their keys and values live in the cache.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from strata import host_memory
from strata.attention.forward_context import AttentionMetadata, set_forward_context
from strata.attention.ops import prepare_backend
from strata.compilation.compiler import CompiledForward
from strata.compilation.warmup import InductorWarmup
from strata.config import ConfigError, EngineConfig
from strata.engine.scheduler import ScheduledSequence
from strata.models.transformers.loader import build_model
from strata.worker.thread_tuner import ThreadTuner

logger = logging.getLogger("strata.worker")

# Without an explicit kv_cache_memory, the cache takes at most this share of the memory that is free now.
_DEFAULT_FREE_MEMORY_FRACTION = 0.25


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


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.cache_config.block_size
        self.model: nn.Module
        compilation = config.compilation_config
        warmup = InductorWarmup() if compilation.compile and self.device.type == "cpu" else None
        self.model, self.layers = build_model(
            config.model_config, config.layer_config, bool(compilation.use_layer_name)
        )
        self.model.to(self.device)
        self.compiled: CompiledForward | None = None
        if compilation.compile:
            if warmup is not None:
                warmup.wait()
            self.compiled = CompiledForward(self.model, config)
        self.thread_tuner = (
            ThreadTuner(torch.get_num_threads())
            if config.adaptive_threads and self.device.type == "cpu" and torch.get_num_threads() > 1
            else None
        )
        self.num_blocks = self._decide_num_blocks()
        self.kv_caches = self._allocate_kv_caches()
        prepare_backend(self.device)

    # -- KV cache -------------------------------------------------------------------------------------
    def _bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.config.model_config.torch_dtype).element_size()
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
        affordable = int(host_memory.available_bytes() * _DEFAULT_FREE_MEMORY_FRACTION) // per_block
        return max(min_blocks, min(wanted, affordable))

    def _allocate_kv_caches(self) -> dict[str, torch.Tensor]:
        dtype = self.config.model_config.torch_dtype
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
            "KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB) over %d layers",
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.block_size,
            total / 2**20,
            len(self.layers),
        )
        return caches

    # -- one step -------------------------------------------------------------------------------------
    def _prepare(
        self, scheduled: list[ScheduledSequence]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        # Built as Python lists and turned into tensors once each: per-step tensor arithmetic on a handful of
        # ints costs more in op dispatch than the lists do (the slot of position p is its block's first slot
        # plus p's offset in the block).
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        max_blocks = max(len(s.seq.block_table) for s in scheduled)
        block_rows: list[list[int]] = []
        size = self.block_size
        for item in scheduled:
            seq, start, end = item.seq, item.start, item.start + item.num_tokens
            table = seq.block_table
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // size] * size + p % size for p in range(start, end))
            query_start_loc.append(query_start_loc[-1] + item.num_tokens)
            seq_lens.append(end)
            block_rows.append(table + [0] * (max_blocks - len(table)))
        positions_t = torch.tensor(positions, dtype=torch.int64)
        slot_mapping = torch.tensor(slots, dtype=torch.int64)
        block_tables = torch.tensor(block_rows, dtype=torch.int64)
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping.to(self.device),
            block_tables=block_tables.to(self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=self.device),
            seq_lens_host=seq_lens,
            query_start_loc_host=query_start_loc,
            max_query_len=max(s.num_tokens for s in scheduled),
            max_seq_len=max(seq_lens),
            block_size=self.block_size,
        )
        input_ids_t = torch.tensor(input_ids, dtype=torch.int64, device=self.device).unsqueeze(0)
        return input_ids_t, positions_t.to(self.device).unsqueeze(0), metadata

    @contextlib.contextmanager
    def _step_threads(self) -> Iterator[None]:
        """Run a step with the tuner's thread count and give the process back the count it had: torch's count
        is one per process, shared with other engines and the caller's own work (2 us a switch)."""
        outer = torch.get_num_threads()
        wanted = self.thread_tuner.threads if self.thread_tuner is not None else outer
        if wanted != outer:
            torch.set_num_threads(wanted)
        try:
            yield
        finally:
            if wanted != outer:
                torch.set_num_threads(outer)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSequence]) -> ModelOutput:
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
        keep = torch.tensor(rows, dtype=torch.int64, device=self.device)
        with set_forward_context(metadata, self.kv_caches), self._step_threads():
            if self.compiled is not None:
                logits = self.compiled(input_ids, positions, keep)
            else:
                logits = self.model(
                    input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=keep
                ).logits[0]
        if self.thread_tuner is not None:
            self.thread_tuner.observe((len(scheduled), input_ids.shape[1]), time.perf_counter() - start)
        return ModelOutput(logits=logits, sample_rows=sample_rows, prompt_rows=prompt_rows)
