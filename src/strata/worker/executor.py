"""`Executor`: what runs an engine's steps, in whatever processes its layout needs. The engine schedules and
samples; the executor turns a scheduled step into logits. It has rank 0's `ModelRunner` (`runner`: the
model, its layers, the KV cache), and spreads each step over the ranks of a tensor- or pipeline-parallel
engine (`worker.tensor_parallel`, `worker.pipeline_parallel`, on `worker.ranks`); one process runs it here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from strata.config import EngineConfig, ParallelConfig
from strata.worker.model_runner import ModelOutput, ModelRunner, ScheduledWork


class Executor(ABC):
    """Runs steps: `execute` one to its end, or `submit` up to `pipeline_depth` of them before `collect`ing
    the oldest one's logits. `shutdown` stops its processes (idempotent)."""

    runner: ModelRunner
    # Steps that may be in flight at once (a pipeline's stages); other layouts run each step to its end.
    pipeline_depth = 1

    def __init__(self) -> None:
        self._submitted: deque[Sequence[ScheduledWork]] = deque()

    @property
    def num_blocks(self) -> int:
        """KV-cache blocks (every rank has as many)."""
        return self.runner.num_blocks

    @abstractmethod
    def execute(self, scheduled: Sequence[ScheduledWork]) -> ModelOutput: ...

    def submit(self, scheduled: Sequence[ScheduledWork]) -> None:
        """Start a step; with one step in flight at a time, it runs when collected."""
        self._submitted.append(scheduled)

    def collect(self) -> ModelOutput:
        """The logits of the oldest step submitted."""
        return self.execute(self._submitted.popleft())

    def apply_model(self, fn: Callable[[torch.nn.Module], Any]) -> Any:
        """`fn` on rank 0's model (its shard or stage)."""
        return fn(self.runner.model)

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the executor's other processes; safe to call again, and after a failure."""


class OneProcessExecutor(Executor):
    """The whole model in the engine's process."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        self.runner = ModelRunner(config)

    def execute(self, scheduled: Sequence[ScheduledWork]) -> ModelOutput:
        return self.runner.execute(scheduled)

    def shutdown(self) -> None:
        """Nothing to stop: the engine's process is all there is."""


def executor_class(parallel: ParallelConfig) -> type[Executor]:
    """Pipeline parallel (its stages may be tensor-parallel too), tensor parallel, or one process."""
    # The parallel executors build on this module's `Executor`: imported here, not above, to avoid a cycle.
    from strata.worker.pipeline_parallel import PipelineParallelExecutor
    from strata.worker.tensor_parallel import TensorParallelExecutor

    if parallel.pipeline_parallel_size > 1:
        return PipelineParallelExecutor
    if parallel.tensor_parallel_size > 1:
        return TensorParallelExecutor
    return OneProcessExecutor


def create_executor(config: EngineConfig) -> Executor:
    """The executor `config`'s process layout asks for, its processes started and its model built."""
    return executor_class(config.parallel_config)(config)
