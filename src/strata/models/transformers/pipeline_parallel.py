"""Split a transformers model's decoder layers over pipeline stages, following the PP plan its config carries.

transformers names the parts of each architecture's base model in pipeline order
(`config.base_model_pp_plan`: the input embedding, the list of decoder layers, the final norm) and the
causal-LM head after them (`_pp_plan`). Stage s of M keeps a consecutive 1/M of the decoder layers; the
first stage also keeps what comes before the layers, the last what comes after them and the head. Every
other part is replaced before any weight loads, so a stage never holds (or reads) the rest of the model:
another stage's decoder layer becomes a pass-through, its embedding a placeholder of the right shape, its
norm and head identities.

Each stage still runs the base model's own forward, so whatever the architecture computes around its
layers (rotary tables, masks, scaled embeddings) happens as transformers wrote it. On a stage past the
first, the first local layer's input is swapped for the activations the previous stage sent
(`strata::pipeline_stage_input`, an opaque op so torch.compile keeps reading them each step).
"""

from __future__ import annotations

import itertools
import logging
import math
from typing import Any

import torch
from torch import nn

from strata.config import ConfigError
from strata.models.transformers.tensor_parallel import tied_head

logger = logging.getLogger("strata.models.pipeline_parallel")

# The activations the previous stage sent for the step this stage runs now.
_received: list[torch.Tensor] = []


def set_stage_input(hidden_states: torch.Tensor) -> None:
    """The previous stage's output for the next forward of this stage ([tokens, hidden])."""
    _received[:] = [hidden_states]


@torch.library.custom_op("strata::pipeline_stage_input", mutates_args=())
def _stage_input(placeholder: torch.Tensor) -> torch.Tensor:
    return _received[0].view(placeholder.shape).to(placeholder.dtype)


@_stage_input.register_fake
def _(placeholder: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(placeholder)


class OtherStageLayer(nn.Module):
    """A decoder layer another stage runs: passes the hidden states through. It keeps the layer's plain
    attributes (say `attention_type`), which base models read while they loop over their layers."""

    is_other_stage = True

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        for name, value in vars(layer).items():
            if not name.startswith("_") and isinstance(value, str | int | float | bool | type(None)):
                setattr(self, name, value)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states


class OtherStagePart(nn.Identity):
    """The final norm or the head on a stage before the last: never used there."""

    is_other_stage = True


class PlaceholderEmbedding(nn.Module):
    """The input embedding of a stage past the first: zeros of the embedding's shape, which the first local
    layer's input then replaces with the previous stage's activations."""

    is_other_stage = True

    def __init__(self, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.embedding_dim, self.dtype = embedding_dim, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*input_ids.shape, self.embedding_dim, dtype=self.dtype, device=input_ids.device)


def _plan(model: nn.Module) -> dict[str, Any]:
    config = getattr(model.config, "get_text_config", lambda: model.config)()
    plan = getattr(config, "base_model_pp_plan", None) or getattr(model.config, "base_model_pp_plan", None)
    if not plan:
        raise ConfigError(
            f"{type(model).__name__} has no pipeline-parallel plan (its config's base_model_pp_plan), so Strata "
            "cannot split it into stages; run it with pipeline_parallel_size=1"
        )
    return dict(plan)


def stage_layers(layer_costs: list[int], head_cost: int, stage: int, num_stages: int) -> range:
    """The decoder layers of `stage`: consecutive, at least one a stage, split so that the costliest stage
    costs least. A layer costs its parameters; the last stage also runs the head, which at decode costs
    as much as a layer of as many parameters (for a small model it outweighs several layers)."""
    count = len(layer_costs)
    if count < num_stages:
        raise ConfigError(
            f"the model has {count} decoder layers, fewer than pipeline_parallel_size={num_stages}"
        )
    prefix = [0, *itertools.accumulate(layer_costs)]
    # cost[s][i]: the least cost of the costliest stage when stages 0..s-1 run layers 0..i-1; start[s][i]
    # where stage s - 1 then starts.
    cost = [[math.inf] * (count + 1) for _ in range(num_stages + 1)]
    start = [[0] * (count + 1) for _ in range(num_stages + 1)]
    cost[0][0] = 0
    for s in range(1, num_stages + 1):
        extra = head_cost if s == num_stages else 0
        for i in range(s, count + 1):
            for j in range(s - 1, i):
                candidate = max(cost[s - 1][j], prefix[i] - prefix[j] + extra)
                if candidate < cost[s][i]:
                    cost[s][i], start[s][i] = candidate, j
    end = count
    for s in range(num_stages, stage + 1, -1):
        end = start[s][end]
    return range(start[stage + 1][end], end)


class PipelineSplit:
    """One stage's part of a model: which decoder layers it runs, and which checkpoint tensors it loads."""

    def __init__(self, model: nn.Module, stage: int, num_stages: int) -> None:
        self.stage, self.num_stages = stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        plan = _plan(model)
        prefix = getattr(model, "base_model_prefix", "")
        base = model.base_model
        names = list(plan)
        layer_names = [name for name in names if isinstance(base.get_submodule(name), nn.ModuleList)]
        if len(layer_names) != 1:
            raise ConfigError(f"{type(model).__name__}'s pipeline-parallel plan has no single list of layers")
        position = names.index(layer_names[0])
        layers = base.get_submodule(layer_names[0])
        head = model.get_output_embeddings()
        self.layers = stage_layers(
            [sum(p.numel() for p in layer.parameters()) for layer in layers],
            head.weight.numel() if head is not None else 0,
            stage,
            num_stages,
        )
        self.dropped: list[str] = []  # module paths whose tensors this stage does not load

        def path(name: str) -> str:
            return f"{prefix}.{name}" if prefix else name

        for index in range(len(layers)):
            if index not in self.layers:
                layers[index] = OtherStageLayer(layers[index])
                self.dropped.append(path(f"{layer_names[0]}.{index}"))
        tied = tied_head(model)
        for name in names[:position] if not self.is_first else ():
            module = base.get_submodule(name)
            # A head tied to the embedding reads its weight: the last stage keeps the embedding then.
            keep = self.is_last and tied is not None
            if isinstance(module, nn.Embedding) and not keep:
                base.set_submodule(name, PlaceholderEmbedding(module.embedding_dim, module.weight.dtype))
                self.dropped.append(path(name))
        if not self.is_last:
            for name in names[position + 1 :]:
                base.set_submodule(name, OtherStagePart())
                self.dropped.append(path(name))
            # The causal LM's own plan (the head); transformers merges the base model's into it.
            for name in getattr(model, "_pp_plan", None) or {}:
                if not prefix or not name.startswith(f"{prefix}."):
                    model.set_submodule(name, OtherStagePart())
                    self.dropped.append(name)
        if not self.is_first:
            layers[self.layers.start].register_forward_pre_hook(_take_stage_input, with_kwargs=True)
        logger.info("pipeline stage %d of %d: decoder layers %d-%d", stage, num_stages, self.layers.start,
                    self.layers.stop - 1)  # fmt: skip

    def loads(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to this stage."""
        return not any(name == path or name.startswith(f"{path}.") for path in self.dropped)


def _take_stage_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The first local layer's hidden states are the previous stage's output."""
    if args:
        return (_stage_input(args[0]), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": _stage_input(kwargs["hidden_states"])}
