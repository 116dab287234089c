"""Continuous batching, chunked prefill, preemption and prefix caching never change what a request gets."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from strata import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts(count: int, seed: int = 0) -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 60, (count,), generator=generator).tolist()
    return [{"prompt_token_ids": torch.randint(3, 128, (n,), generator=generator).tolist()} for n in lengths]


def _tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def folder(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def alone(folder: Path) -> list[list[int]]:
    """What each of the 16 prompts gives when it runs by itself."""
    llm = LLM(str(folder), skip_tokenizer_init=True, enable_prefix_caching=False)
    return [_tokens(llm, [prompt])[0] for prompt in _prompts(16)]


def test_batch_equals_alone(folder: Path, alone: list[list[int]]) -> None:
    llm = LLM(str(folder), skip_tokenizer_init=True, enable_prefix_caching=False)
    assert _tokens(llm, _prompts(16)) == alone
    stats = llm.stats()
    assert stats["max_batch_size"] == 16  # they really shared forward passes
    assert stats["num_preemptions"] == 0


def test_chunked_prefill_equals_alone(folder: Path, alone: list[list[int]]) -> None:
    llm = LLM(str(folder), skip_tokenizer_init=True, enable_prefix_caching=False, max_num_batched_tokens=16)
    assert _tokens(llm, _prompts(16)) == alone


def test_preemption_under_a_small_cache_equals_alone(folder: Path, alone: list[list[int]]) -> None:
    # 3 layers x 2 (K, V) x 16 tokens x 2 heads x 16 dims x 4 bytes = 12 KiB per block; 24 blocks hold 384
    # tokens, far fewer than the 16 requests need together (max_model_len=128 needs 8 blocks for one).
    llm = LLM(
        str(folder),
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        max_model_len=128,
        kv_cache_memory=24 * 12 * 1024,
    )
    assert llm.stats()["num_kv_blocks"] == 24
    assert _tokens(llm, _prompts(16)) == alone
    assert llm.stats()["num_preemptions"] > 0
    assert llm.stats()["kv_cache_usage"] == 0.0  # everything was freed at the end


def test_prefix_caching_hits_and_equals_uncached(folder: Path) -> None:
    generator = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 128, (40,), generator=generator).tolist()
    prompts = [
        {"prompt_token_ids": shared + torch.randint(3, 128, (n,), generator=generator).tolist()}
        for n in (1, 5, 17)
    ]
    uncached = LLM(str(folder), skip_tokenizer_init=True, enable_prefix_caching=False)
    expected = [_tokens(uncached, [p])[0] for p in prompts]

    cached = LLM(str(folder), skip_tokenizer_init=True, enable_prefix_caching=True)
    first = _tokens(cached, prompts[:1])
    assert cached.stats()["prefix_cache_hits"] == 0
    rest = _tokens(cached, prompts[1:])
    assert first + rest == expected
    # Both later prompts reuse the 2 full blocks (32 tokens) of the shared 40-token prefix.
    assert cached.stats()["prefix_cache_hits"] == 2 * 32
    outputs = cached.generate(prompts[2:], GREEDY, use_tqdm=False)
    assert outputs[0].num_cached_tokens == 48  # the whole prompt minus its last partial block is cached now
    assert outputs[0].outputs[0].token_ids == expected[2]


def test_final_output_only_requests_are_reported_once_and_alike(folder: Path, alone: list[list[int]]) -> None:
    """A request added with `final_output_only` (as `LLM.generate` adds them) appears in no step's outputs
    until the step that finishes it, and then exactly as a request reported every step ends; both kinds
    batch together."""
    llm = LLM(str(folder), skip_tokenizer_init=True, enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2, n=2)
    prompts = _prompts(16)[:4]
    final_ids = [engine.add_request(p, params, final_output_only=True).request_id for p in prompts[:2]]
    every_ids = [engine.add_request(p, params).request_id for p in prompts[2:]]
    seen: dict[str, list] = {request_id: [] for request_id in final_ids + every_ids}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen[output.request_id].append(output)
    for request_id in final_ids:
        (only,) = seen[request_id]
        assert only.finished
    for request_id in every_ids:
        assert len(seen[request_id]) == 24 and seen[request_id][-1].finished
        assert not any(output.finished for output in seen[request_id][:-1])
    # The same prompts reported the other way round give the same final outputs.
    again = LLM(str(folder), skip_tokenizer_init=True, enable_prefix_caching=False).engine
    swapped = {
        again.add_request(p, params, final_output_only=i >= 2).request_id: i for i, p in enumerate(prompts)
    }
    finals = {}
    while again.has_unfinished_requests():
        finals.update({swapped[o.request_id]: o for o in again.step() if o.finished})
    ordered = [seen[request_id][-1] for request_id in final_ids + every_ids]
    for index, output in enumerate(ordered):
        assert [c.token_ids for c in output.outputs] == [c.token_ids for c in finals[index].outputs]
        assert [c.logprobs for c in output.outputs] == [c.logprobs for c in finals[index].outputs]
    assert [output.outputs[0].token_ids for output in ordered] == alone[:4]
