"""The steps that shape a model built on the meta device before its weights arrive, one concern each.

A step changes the model as it is made (split it into pipeline stages, shard it, replace its layers), and
may then change the attention layers this rank runs, the stream of checkpoint tensors (keep this stage's,
slice this rank's part) and the loaded model (`finish`: install collectives). `prepare_model` makes the
ones a configuration needs, in order; a new weight format or parallel style is one more step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from strata.config import ModelConfig
from strata.distributed.parallel_state import pp_rank, pp_world_size, tp_rank, tp_world_size
from strata.gguf.weights import GGUFCheckpoint
from strata.models.transformers.attention import AttentionLayerSpec
from strata.models.transformers.fusers import (
    WeightMapping,
    fuse_layers,
    replace_conv1d,
    replace_layer_norms,
    replace_linears,
)
from strata.models.transformers.layers import LayerResolver
from strata.models.transformers.pipeline_parallel import PipelineSplit
from strata.models.transformers.quantization import quantize_linears
from strata.models.transformers.tensor_parallel import LinearShard, TensorParallelSharding
from strata.models.transformers.weight_pipeline import TensorStream
from strata.models.transformers.weight_sources import GGUFSource, SafetensorsFolder, WeightSource


@dataclass
class ModelPlan:
    """What the steps decided about one model: its checkpoint names of replaced modules, this rank's
    shards of its linears, and where its weights come from."""

    model: nn.Module
    config: ModelConfig
    resolver: LayerResolver
    weight_mapping: WeightMapping = field(default_factory=dict)
    shards: dict[str, LinearShard] | None = None
    source: WeightSource | None = None

    def weight_source(self) -> WeightSource:
        """The checkpoint a step chose, else the model's folder of safetensors files."""
        return self.source if self.source is not None else SafetensorsFolder(Path(self.config.model))


class ModelStep:
    """One concern of building a model: making it changes the meta model (or the plan); each hook after
    that does nothing unless the step overrides it."""

    def attention_specs(self, specs: list[AttentionLayerSpec]) -> list[AttentionLayerSpec]:
        """The attention layers as this rank runs them."""
        return specs

    def tensors(self, tensors: TensorStream) -> TensorStream:
        """The checkpoint tensors this rank loads, as it loads them."""
        return tensors

    def finish(self, model: nn.Module) -> None:
        """Complete the model once its weights are in place."""


class PipelineStage(ModelStep):
    """Pipeline parallelism: this stage keeps its decoder layers (first, so that only they are sharded
    and replaced) and loads only their tensors."""

    def __init__(self, plan: ModelPlan, stage: int, num_stages: int) -> None:
        self.split = PipelineSplit(plan.model, stage, num_stages)

    def tensors(self, tensors: TensorStream) -> TensorStream:
        return ((name, tensor) for name, tensor in tensors if self.split.loads(name))


class TensorParallel(ModelStep):
    """Tensor parallelism: this rank's rows or columns of each sharded linear, its attention heads, and the
    collectives that join the ranks' partial results."""

    def __init__(self, plan: ModelPlan, rank: int, world_size: int) -> None:
        self.sharding = TensorParallelSharding(plan.model, rank, world_size)
        plan.shards = self.sharding.shards

    def attention_specs(self, specs: list[AttentionLayerSpec]) -> list[AttentionLayerSpec]:
        return self.sharding.local_attention_specs(specs)

    def tensors(self, tensors: TensorStream) -> TensorStream:
        return ((name, self.sharding.slice_tensor(name, tensor)) for name, tensor in tensors)

    def finish(self, model: nn.Module) -> None:
        self.sharding.install_collectives(model)


class GGUFWeights(ModelStep):
    """A GGUF file: the layers whose weights it keeps quantized become GGUF layers, and the file is the
    checkpoint."""

    def __init__(self, plan: ModelPlan, path: Path, dequantize: bool) -> None:
        gguf = GGUFCheckpoint(path, plan.model, dequantize)
        gguf.replace_layers(plan.model, plan.resolver, plan.config.torch_dtype, plan.shards)
        plan.source = GGUFSource(gguf)


class FusedLayers(ModelStep):
    """Fused GLU MLPs and projections, GPT-2's Conv1D as a linear, and the resolver's norms; the checkpoint
    names of what they replaced go to the plan's weight mapping."""

    def __init__(self, plan: ModelPlan) -> None:
        plan.weight_mapping = {**fuse_layers(plan.model, plan.resolver), **replace_conv1d(plan.model)}
        replace_layer_norms(plan.model, plan.resolver)


class Int8Weights(ModelStep):
    """int8 weight quantization: linears become int8 ones, quantized as their float weights arrive."""

    def __init__(self, plan: ModelPlan) -> None:
        quantize_linears(plan.model, plan.resolver)


class ResolvedLinears(ModelStep):
    """The remaining linears become the layers the resolver picks."""

    def __init__(self, plan: ModelPlan) -> None:
        replace_linears(plan.model, plan.resolver)


def prepare_model(plan: ModelPlan) -> list[ModelStep]:
    """Make the steps the model's configuration and this process's parallel ranks need, each changing
    `plan.model` in turn: the pipeline split first (only this stage's layers are then sharded and replaced),
    GGUF layers before the fusers and int8 quantization (the layers whose weights the file keeps quantized
    are taken first), int8 before the resolver's linears."""
    config = plan.config
    steps: list[ModelStep] = []
    if pp_world_size() > 1:
        steps.append(PipelineStage(plan, pp_rank(), pp_world_size()))
    if tp_world_size() > 1:
        steps.append(TensorParallel(plan, tp_rank(), tp_world_size()))
    if config.gguf_file is not None:
        steps.append(GGUFWeights(plan, config.gguf_file, config.gguf_dequantize))
    steps.append(FusedLayers(plan))
    if config.quantization == "int8":
        steps.append(Int8Weights(plan))
    steps.append(ResolvedLinears(plan))
    return steps
