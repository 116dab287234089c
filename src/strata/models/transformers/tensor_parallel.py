"""Shard a transformers model over tensor-parallel ranks, following the TP plan its config carries.

transformers describes how each architecture splits (`config.base_model_tp_plan` for the decoder,
`_tp_plan` of the causal-LM class for its head): `colwise` projections (q, k, v, gate, up) keep 1/N of
their output rows on each rank, `rowwise` ones (o, down) 1/N of their input columns and sum their partial
outputs over the ranks; `colwise_gather_output` gathers the rows back (a vocabulary-split head), and
`rowwise_split_input` takes its slice of a full input first. Sharding runs on the meta model before any
other replacement, so the fused and platform layers built afterwards are simply smaller, and each
checkpoint tensor is sliced to this rank's part as it streams in: no rank ever holds the whole model.

Attention needs nothing of its own: HF attention modules reshape their projections with `-1` heads, so
a rank attends over its own heads, and the KV cache holds its own KV heads. Where there are fewer KV heads
than ranks, each rank keeps the one KV head its query heads share.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from strata.config import ConfigError
from strata.distributed.communication import all_gather, all_reduce
from strata.models.transformers.attention import AttentionLayerSpec

logger = logging.getLogger("strata.models.tensor_parallel")

_COLWISE = ("colwise", "colwise_gather_output")
_ROWWISE = ("rowwise", "rowwise_split_input")
_VOCABULARY = "embedding_rowwise"  # an embedding table split by token rows
# Styles that only matter for training (gradients of replicated weights) or that keep a module whole.
_REPLICATED = ("replicated_with_grad_allreduce", "replicate", "replicated")


@dataclass(frozen=True)
class LinearShard:
    """This rank's part of one linear layer: `size` rows (colwise) or columns (rowwise) from `start`."""

    style: str
    start: int
    size: int

    @property
    def colwise(self) -> bool:
        return self.style in _COLWISE

    @property
    def vocabulary(self) -> bool:
        """An embedding table's share of the token rows."""
        return self.style == _VOCABULARY


def _plan(model: nn.Module) -> dict[str, str]:
    """Module path pattern -> style, for the whole model (the base model's plan under its prefix)."""
    config = getattr(model.config, "get_text_config", lambda: model.config)()
    base_plan = getattr(config, "base_model_tp_plan", None) or getattr(
        model.config, "base_model_tp_plan", None
    )
    if not base_plan:
        raise ConfigError(
            f"{type(model).__name__} has no tensor-parallel plan (its config's base_model_tp_plan), so Strata "
            "cannot shard it; run it with tensor_parallel_size=1"
        )
    prefix = getattr(model, "base_model_prefix", "")
    plan = {f"{prefix}.{pattern}" if prefix else pattern: style for pattern, style in base_plan.items()}
    plan.update(getattr(model, "_tp_plan", None) or {})
    return plan


def _pattern(path_pattern: str) -> re.Pattern[str]:
    return re.compile(re.escape(path_pattern).replace(r"\*", r"\d+"))


class TensorParallelSharding:
    """One rank's sharding of a model: which linears are split and how, the slicing of checkpoint tensors,
    and the collectives installed on the sharded layers."""

    def __init__(self, model: nn.Module, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.shards: dict[str, LinearShard] = {}
        patterns = [(_pattern(pattern), pattern, style) for pattern, style in _plan(model).items()]
        head = tied_head(model)
        for path, module in list(model.named_modules()):
            match = next(((p, s) for regex, p, s in patterns if regex.fullmatch(path)), None)
            if match is None:
                continue
            pattern, style = match
            if getattr(module, "is_other_stage", False):
                continue  # another pipeline stage runs it
            if isinstance(module, nn.Embedding):
                if style == _VOCABULARY and self._splits_vocabulary(path, module, head):
                    self.shards[path] = LinearShard(style, rank * module.num_embeddings // world_size,
                                                    module.num_embeddings // world_size)  # fmt: skip
                    _make_local_embedding(module, self.shards[path])
                continue
            if style in _REPLICATED:
                continue
            if style not in _COLWISE + _ROWWISE:
                raise ConfigError(
                    f"{type(model).__name__}'s tensor-parallel plan shards {pattern} as {style!r}, which Strata "
                    "does not do yet; run it with tensor_parallel_size=1"
                )
            if type(module) is not nn.Linear:
                raise ConfigError(
                    f"{path} is a {type(module).__name__}, not a Linear, so Strata cannot shard it {style}"
                )
            if path == head:
                # The head shares the embedding's weight, which stays whole: the head stays whole too.
                logger.info("%s is tied to the input embedding: kept whole on every rank", path)
                continue
            self.shards[path] = self._shard(model, path, module, style)
            model.set_submodule(path, self._local_linear(module, self.shards[path]))
        if not self.shards:
            raise ConfigError(f"{type(model).__name__}'s tensor-parallel plan matched none of its layers")

    def _splits_vocabulary(self, path: str, module: nn.Embedding, head: str | None) -> bool:
        """Whether this embedding splits by token rows: not when a head is tied to it (both stay whole,
        sharing one weight), nor when its rows do not split evenly."""
        if head is not None or module.num_embeddings % self.world_size:
            logger.info("%s: kept whole on every rank (tied to the head, or rows that do not split)", path)
            return False
        return True

    def _shard(self, model: nn.Module, path: str, module: nn.Linear, style: str) -> LinearShard:
        full = module.out_features if style in _COLWISE else module.in_features
        kv_head = _kv_head_rows(model, path, full, self.world_size) if style in _COLWISE else None
        if kv_head is not None:
            # Fewer KV heads than ranks: this rank's query heads all share one KV head; it keeps that one.
            num_kv_heads, head_dim = kv_head
            return LinearShard(style, (self.rank * num_kv_heads // self.world_size) * head_dim, head_dim)
        if full % self.world_size:
            raise ConfigError(
                f"{path} has {full} {'output' if style in _COLWISE else 'input'} features, which do not split "
                f"over tensor_parallel_size={self.world_size}"
            )
        size = full // self.world_size
        return LinearShard(style, self.rank * size, size)

    @staticmethod
    def _local_linear(module: nn.Linear, shard: LinearShard) -> nn.Linear:
        in_features, out_features = module.in_features, module.out_features
        if shard.colwise:
            out_features = shard.size
        else:
            in_features = shard.size
        with torch.device("meta"):
            return nn.Linear(
                in_features, out_features, bias=module.bias is not None, dtype=module.weight.dtype
            )

    def slice_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name` (the tensor itself where it is not sharded)."""
        path, _, kind = name.rpartition(".")
        shard = self.shards.get(path)
        if shard is None:
            return tensor
        if shard.vocabulary:  # its rows, and the zero row other tokens read
            return torch.cat(
                [tensor.narrow(0, shard.start, shard.size), tensor.new_zeros(1, tensor.shape[1])]
            )
        if shard.colwise:
            return tensor.narrow(0, shard.start, shard.size).contiguous()
        if kind == "bias":
            # The partial outputs are summed over the ranks: the bias is added once, on rank 0.
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        return tensor.narrow(1, shard.start, shard.size).contiguous()

    def install_collectives(self, model: nn.Module) -> None:
        """Sum rowwise outputs over the ranks, gather `colwise_gather_output` ones, and slice the input of
        `rowwise_split_input` ones; hooks, so torch.compile traces them with the layer."""
        for path, shard in self.shards.items():
            if shard.style == "colwise":
                continue  # its output stays split: the next (rowwise) layer reads it so
            module = model.get_submodule(path)
            if shard.vocabulary:
                module.register_forward_pre_hook(_local_token_ids(shard))
                module.register_forward_hook(_reduce_output)
            elif shard.style == "colwise_gather_output":
                module.register_forward_hook(_gather_output)
            elif not shard.colwise:
                if shard.style == "rowwise_split_input":
                    module.register_forward_pre_hook(_split_input(shard))
                module.register_forward_hook(_reduce_output)

    def local_attention_specs(self, specs: list[AttentionLayerSpec]) -> list[AttentionLayerSpec]:
        """The heads each attention layer keeps on this rank (at least one KV head): a split of its heads
        where its projections are colwise, all of them where they are gathered back (Phi-3's fused qkv)."""
        world = self.world_size
        split = [spec for spec in specs if self._splits_heads(spec.name)]
        for spec in split:
            if spec.num_heads % world:
                raise ConfigError(
                    f"{spec.name} has {spec.num_heads} attention heads, which do not split over "
                    f"tensor_parallel_size={world}"
                )
            if spec.num_kv_heads % world and world % spec.num_kv_heads:
                raise ConfigError(
                    f"{spec.name} has {spec.num_kv_heads} KV heads: tensor_parallel_size={world} must divide "
                    "them or be a multiple of them"
                )
        return [
            replace(spec, num_heads=spec.num_heads // world, num_kv_heads=max(1, spec.num_kv_heads // world))
            if spec in split
            else spec
            for spec in specs
        ]

    def _splits_heads(self, attention_path: str) -> bool:
        prefix = f"{attention_path}."
        return any(
            path.startswith(prefix) and shard.style == "colwise" for path, shard in self.shards.items()
        )


def tied_head(model: nn.Module) -> str | None:
    """The module path of the head when its weight is the input embedding's."""
    ties = model.get_expanded_tied_weights_keys(all_submodels=True)
    heads = [target.removesuffix(".weight") for target in ties if target.endswith(".weight")]
    return heads[0] if heads else None


def _kv_head_rows(model: nn.Module, path: str, full: int, world: int) -> tuple[int, int] | None:
    """(KV heads, head size) when `path` projects the keys or values of an attention module with fewer KV
    heads than ranks; None otherwise."""
    parent = model.get_submodule(path.rpartition(".")[0]) if "." in path else model
    head_dim = getattr(parent, "head_dim", None)
    config = getattr(parent, "config", None)
    num_kv_heads = getattr(config, "num_key_value_heads", None)
    if not isinstance(head_dim, int) or not isinstance(num_kv_heads, int) or num_kv_heads >= world:
        return None
    return (num_kv_heads, head_dim) if full == num_kv_heads * head_dim else None


def _gather_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    return all_gather(output, dim=-1)


def _reduce_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    return all_reduce(output)


def _make_local_embedding(module: nn.Embedding, shard: LinearShard) -> None:
    """This rank's rows of the table, plus a zero row that every token of the other ranks reads (their
    embeddings come from those ranks in the sum)."""
    module.num_embeddings = shard.size + 1
    module.padding_idx = None
    with torch.device("meta"):
        module.weight = nn.Parameter(
            torch.empty(shard.size + 1, module.embedding_dim, dtype=module.weight.dtype), requires_grad=False
        )


def _local_token_ids(shard: LinearShard) -> Any:
    def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        ids, *rest = args
        local = ids - shard.start
        return (torch.where((local >= 0) & (local < shard.size), local, shard.size), *rest)

    return hook


def _split_input(shard: LinearShard) -> Any:
    def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x, *rest = args
        return (x.narrow(-1, shard.start, shard.size), *rest)

    return hook
