"""The model runner an engine's parallel configuration asks for (rank 0's, for several processes)."""

from __future__ import annotations

from strata.config import ParallelConfig
from strata.worker.model_runner import ModelRunner
from strata.worker.pipeline_parallel import PipelineParallelRunner
from strata.worker.tensor_parallel import TensorParallelRunner


def runner_class(parallel: ParallelConfig) -> type[ModelRunner]:
    """Pipeline parallel (its stages may be tensor-parallel too), tensor parallel, or one process."""
    if parallel.pipeline_parallel_size > 1:
        return PipelineParallelRunner
    if parallel.tensor_parallel_size > 1:
        return TensorParallelRunner
    return ModelRunner
