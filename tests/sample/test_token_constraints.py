"""Token masks and biases: bad words tokenized as vLLM does and banned only after their other tokens, and
the sampler's order (a grammar's mask before logprobs, allowed_token_ids and logit_bias after)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from strata.bundled import default_model
from strata.engine.llm_engine import load_tokenizer
from strata.sample import Sampler, SamplingMetadata, SamplingRow, TokenConstraints
from strata.sampling_params import SamplingParams
from strata.structured_output import GrammarMasks
from strata.structured_output.manager import banned_bias


def test_bad_words_ban_their_last_token_after_the_others_and_resolve_once() -> None:
    tokenizer = load_tokenizer(default_model())  # SentencePiece: "▁" marks the space either way
    params = SamplingParams(bad_words=["Lily", " little girl"], logit_bias={5: 1.5}, allowed_token_ids=[3, 7])
    constraints = TokenConstraints.resolve(params, tokenizer, vocab_size=512)
    assert constraints is not None
    lily = tokenizer.encode("Lily", add_special_tokens=False)
    girl = tokenizer.encode("little girl", add_special_tokens=False)
    assert len(lily) == 1 and len(girl) > 1
    assert constraints.bad_words == [lily, girl]
    assert constraints.banned_now([]) == lily  # a one-token word is always banned
    assert constraints.banned_now([9, *girl[:-1]]) == [*lily, girl[-1]]
    assert constraints.banned_now(girl[:-2]) == lily
    assert constraints.allowed_bias is not None
    assert (constraints.allowed_bias == 0).nonzero().flatten().tolist() == [3, 7]
    assert constraints.allowed_bias.isneginf().sum() == 510
    assert (constraints.bias_ids, constraints.bias_values) == ([5], [1.5])
    assert TokenConstraints.resolve(SamplingParams(), tokenizer, 512) is None


def test_masks_and_biases_apply_to_their_own_rows_in_vllms_order() -> None:
    vocab = 8
    logits = torch.tensor(np.random.default_rng(0).normal(size=(3, vocab)), dtype=torch.float32)
    original = logits.clone()
    greedy = SamplingParams(temperature=0, logprobs=vocab)
    allowed = SamplingParams(temperature=0, logprobs=vocab, allowed_token_ids=[1, 2], logit_bias={1: -50.0})
    rows = [
        SamplingRow(greedy, [], []),  # a grammar allows tokens 4 and 6
        SamplingRow(greedy, [], []),  # unconstrained
        SamplingRow(allowed, [], [], constraints=TokenConstraints.resolve(allowed, None, vocab)),
    ]
    grammar_banned = np.ones((1, vocab), dtype=np.uint8)
    grammar_banned[0, [4, 6]] = 0
    masks = GrammarMasks([0], torch.from_numpy(banned_bias(grammar_banned)))
    metadata = SamplingMetadata.build(rows, vocab, [], torch.device("cpu"), masks)
    out = Sampler()(logits, metadata)

    assert torch.equal(logits, original)  # the caller's logits are untouched
    assert out.sampled_token_ids[0] == 4 + 2 * int(original[0, 6] > original[0, 4])
    assert out.sampled_token_ids[1] == int(original[1].argmax())
    assert out.sampled_token_ids[2] == 2  # 1 is allowed but biased far down
    # The grammar's mask comes before logprobs (as vLLM's bitmask): banned tokens have -inf logprobs.
    grammar_logprobs = dict(zip(out.logprobs[0].top_token_ids, out.logprobs[0].top_logprobs, strict=True))
    assert {t for t, lp in grammar_logprobs.items() if lp > -math.inf} == {4, 6}
    # allowed_token_ids and logit_bias come after: the logprobs are the raw distribution's.
    expected = torch.log_softmax(original[2], dim=-1)
    assert out.logprobs[2].logprob == pytest.approx(expected[2].item(), abs=1e-6)
