"""A checkpoint tensor's way into the model: pieces assembled in any order, shapes checked, mismatches named."""

from __future__ import annotations

import random
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from strata.models.transformers.fusers import WeightTarget
from strata.models.transformers.weight_pipeline import (
    PieceAssembly,
    WeightLoadError,
    check_shape,
    load_weights,
)

from tiny_models import TINY_CONFIGS


def test_expert_shards_are_assembled_whatever_their_order() -> None:
    experts, rows, cols = 3, 4, 5
    generator = torch.Generator().manual_seed(0)
    gate = [torch.randn(rows, cols, generator=generator) for _ in range(experts)]
    up = [torch.randn(rows, cols, generator=generator) for _ in range(experts)]
    expected = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up, strict=True)])
    pieces = [
        (WeightTarget("experts.gate_up_proj", shard=shard, num_shards=2, expert=e, num_experts=experts), tensor)
        for e in range(experts)
        for shard, tensor in enumerate((gate[e], up[e]))
    ]
    random.Random(0).shuffle(pieces)
    assembly = PieceAssembly()
    wholes = [assembly.add(target, tensor, tuple(expected.shape), torch.float32) for target, tensor in pieces]
    assert wholes[:-1] == [None] * (len(pieces) - 1)  # handed on only once the last piece arrived
    assert torch.equal(wholes[-1], expected)


def test_a_whole_tensor_passes_assembly_as_it_is() -> None:
    tensor = torch.ones(2, 3)
    assert PieceAssembly().add(WeightTarget("w"), tensor, (2, 3), torch.float32) is tensor


def test_an_expert_the_model_lacks_is_named() -> None:
    target = WeightTarget("experts.down_proj", expert=7, num_experts=3)
    with pytest.raises(
        WeightLoadError, match=re.escape("tensor e.7 in ckpt has shape (4, 5), the model expects (4, 5) for expert 7 of 3")
    ):
        check_shape("e.7", torch.zeros(4, 5), target, (3, 4, 5), "ckpt")


def test_a_mismatch_names_the_first_ten_missing_and_every_unexpected_tensor() -> None:
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS["llama"]())
    state = {name: param.detach().clone() for name, param in model.named_parameters(remove_duplicate=False)}
    dropped = sorted(state)[:11]
    stream = [(name, tensor) for name, tensor in state.items() if name not in dropped]
    stream.append(("model.extra.weight", torch.zeros(1)))
    with pytest.raises(WeightLoadError) as error:
        load_weights(model, stream, "ckpt", torch.float32)
    assert str(error.value) == (
        f"checkpoint in ckpt does not match {type(model).__name__}: missing tensors: {', '.join(dropped[:10])} ...; "
        "unexpected tensors: model.extra.weight"
    )


def test_every_parameter_holds_its_checkpoint_tensor() -> None:
    reference = AutoModelForCausalLM.from_config(TINY_CONFIGS["llama"]())
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS["llama"]())
    load_weights(model, reference.state_dict().items(), "ckpt", torch.float32)
    for name, param in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], param), name
