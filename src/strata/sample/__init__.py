"""Batched token sampling: per-step metadata, the sampler, and prompt logprobs."""

from strata.sample.metadata import SamplingMetadata, SamplingRow
from strata.sample.sampler import Sampler, SamplerOutput, TokenLogprobs, compute_prompt_logprobs, plain_greedy
from strata.sample.token_constraints import TokenConstraints

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingRow",
    "TokenConstraints",
    "TokenLogprobs",
    "compute_prompt_logprobs",
    "plain_greedy",
]
