"""SamplingParams: vLLM defaults, normalisation, and one test per validation rule."""

from __future__ import annotations

import math

import numpy as np
import pytest

from strata.sampling_params import (
    SamplingParams,
    SamplingParamsError,
    SamplingParamsTypeError,
    SamplingType,
)


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (1, 0.0, 0.0, 1.0)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1.0, 1.0, 0, 0.0, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert (p.ignore_eos, p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (
        False,
        16,
        0,
        None,
        None,
    )
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert not p.include_stop_str_in_output
    assert p.sampling_type is SamplingType.RANDOM


# (kwargs, field named in the message, True when it is a type error)
INVALID = [
    ({"n": 0}, "n", False),
    ({"n": 1.0}, "n", True),
    ({"n": True}, "n", True),
    ({"presence_penalty": 2.5}, "presence_penalty", False),
    ({"presence_penalty": -2.01}, "presence_penalty", False),
    ({"presence_penalty": "0"}, "presence_penalty", True),
    ({"frequency_penalty": -3}, "frequency_penalty", False),
    ({"frequency_penalty": math.nan}, "frequency_penalty", False),
    ({"repetition_penalty": 0.0}, "repetition_penalty", False),
    ({"repetition_penalty": -1.0}, "repetition_penalty", False),
    ({"repetition_penalty": math.inf}, "repetition_penalty", False),
    ({"temperature": -0.1}, "temperature", False),
    ({"temperature": math.inf}, "temperature", False),
    ({"temperature": None}, "temperature", True),
    ({"temperature": False}, "temperature", True),
    ({"top_p": 0.0}, "top_p", False),
    ({"top_p": 1.01}, "top_p", False),
    ({"top_p": math.nan}, "top_p", False),
    ({"top_k": -2}, "top_k", False),
    ({"top_k": 2.0}, "top_k", True),
    ({"top_k": True}, "top_k", True),
    ({"min_p": -0.01}, "min_p", False),
    ({"min_p": 1.5}, "min_p", False),
    ({"seed": 1.5}, "seed", True),
    ({"seed": True}, "seed", True),
    ({"seed": 2**64}, "seed", False),
    ({"stop": ""}, "stop", False),
    ({"stop": ["ok", ""]}, "stop", False),
    ({"stop": ["ok", 3]}, "stop", True),
    ({"stop": 3}, "stop", True),
    ({"stop_token_ids": [1, -1]}, "stop_token_ids", False),
    ({"stop_token_ids": [1, 2.0]}, "stop_token_ids", True),
    ({"stop_token_ids": [True]}, "stop_token_ids", True),
    ({"stop_token_ids": 5}, "stop_token_ids", True),
    ({"max_tokens": 0}, "max_tokens", False),
    ({"max_tokens": 16.0}, "max_tokens", True),
    ({"min_tokens": -1}, "min_tokens", False),
    ({"min_tokens": 17}, "min_tokens", False),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens", False),
    ({"logprobs": -2}, "logprobs", False),
    ({"logprobs": 1.0}, "logprobs", True),
    ({"logprobs": True}, "logprobs", True),
    ({"prompt_logprobs": -5}, "prompt_logprobs", False),
    ({"prompt_logprobs": "3"}, "prompt_logprobs", True),
    ({"ignore_eos": 1}, "ignore_eos", True),
    ({"detokenize": None}, "detokenize", True),
    ({"skip_special_tokens": "yes"}, "skip_special_tokens", True),
    ({"spaces_between_special_tokens": 0}, "spaces_between_special_tokens", True),
    ({"include_stop_str_in_output": 1.0}, "include_stop_str_in_output", True),
]


@pytest.mark.parametrize(("kwargs", "field", "is_type_error"), INVALID)
def test_invalid_values_are_rejected_naming_the_field(kwargs: dict, field: str, is_type_error: bool) -> None:
    with pytest.raises(SamplingParamsError, match=rf"\b{field}\b") as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, SamplingParamsTypeError) == is_type_error
    assert isinstance(info.value, TypeError) == is_type_error


@pytest.mark.parametrize(
    "kwargs",
    [
        {"presence_penalty": -2, "frequency_penalty": 2},
        {"repetition_penalty": 1e-3},
        {"temperature": 0},
        {"top_p": 1e-9},
        {"top_k": 1},
        {"min_p": 1.0},
        {"seed": -(2**63)},
        {"seed": 2**64 - 1},
        {"max_tokens": None, "min_tokens": 10_000},
        {"max_tokens": 5, "min_tokens": 5},
        {"logprobs": -1, "prompt_logprobs": 0},
        {"logprobs": 0, "prompt_logprobs": -1},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs)


def test_stop_is_normalised_to_a_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop_token_ids=(7, 3)).stop_token_ids == [7, 3]


def test_top_k_disabled_values_normalise_to_zero() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=0).top_k == 0
    assert SamplingParams(top_k=5).top_k == 5


def test_numeric_types_are_normalised() -> None:
    p = SamplingParams(temperature=1, top_p=np.float32(0.5), max_tokens=np.int64(8), seed=np.int32(3))
    assert type(p.temperature) is float and p.temperature == 1.0
    assert type(p.top_p) is float and p.top_p == 0.5
    assert type(p.max_tokens) is int and p.max_tokens == 8
    assert type(p.seed) is int and p.seed == 3


def test_greedy_threshold_and_sampling_type() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=9e-6).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=1e-5).sampling_type is SamplingType.RANDOM
    assert SamplingParams(temperature=0.7, seed=1).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(temperature=0.0, seed=1).sampling_type is SamplingType.GREEDY


def test_greedy_resets_filters_that_cannot_change_an_argmax() -> None:
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    q = SamplingParams(temperature=0.5, top_p=0.5, top_k=3, min_p=0.2)
    assert (q.top_p, q.top_k, q.min_p) == (0.5, 3, 0.2)


def test_clone_is_deep_and_equal() -> None:
    p = SamplingParams(stop=["x"], stop_token_ids=[4], seed=9, max_tokens=None)
    c = p.clone()
    assert c == p and c is not p
    c.stop.append("y")
    c.stop_token_ids.append(5)
    c.max_tokens = 3
    assert p.stop == ["x"] and p.stop_token_ids == [4] and p.max_tokens is None
