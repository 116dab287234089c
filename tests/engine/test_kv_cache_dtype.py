"""`kv_cache_dtype`: keys and values stored in 16 bits under a float32 model, as vLLM's option and llama.cpp's
default float16 cache do. Checked against HF transformers' float32 forward on the bundled model: the cache's
rounding is all that changes, through Strata's kernels and through the pure-PyTorch backend alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from strata import LLM, SamplingParams
from strata.config import CacheConfig, ConfigError
from strata.platforms.cpu import kernels as cpu_kernels

from stories260k import PROMPT, PROMPT_IDS

# How far a logprob may move when keys and values are rounded to the cache's dtype (measured: 7e-4 and 9e-3;
# float16 keeps 11 significant bits, bfloat16 8); float32 through the same paths matches HF to 1e-4.
TOLERANCE = {"float16": 3e-3, "bfloat16": 3e-2}


@pytest.fixture(scope="module")
def reference(bundled_model_dir: Path) -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(bundled_model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "torch-native"])
def test_a_16_bit_cache_moves_logprobs_only_by_its_rounding(
    reference: AutoModelForCausalLM, monkeypatch: pytest.MonkeyPatch, kv_cache_dtype: str, kernels: bool
) -> None:
    if not kernels:  # what STRATA_DISABLE_CPU_KERNELS=1 does
        monkeypatch.setattr(cpu_kernels, "load", lambda name: False)
    llm = LLM(kv_cache_dtype=kv_cache_dtype)
    caches = llm.engine.runner.kv_caches.values()
    assert {cache.dtype for cache in caches} == {getattr(torch, kv_cache_dtype)}
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=1, prompt_logprobs=1)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    with torch.no_grad():
        expected = torch.log_softmax(reference(torch.tensor([PROMPT_IDS + tokens])).logits[0], dim=-1)
    tolerance = TOLERANCE[kv_cache_dtype]
    for step, (token, entry) in enumerate(zip(tokens, out.outputs[0].logprobs, strict=True)):
        row = expected[len(PROMPT_IDS) - 1 + step]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=tolerance)
        # Greedy on the rounded cache still picks a token the float32 model ranks first, or a near tie.
        assert row.max().item() - row[token].item() <= 2 * tolerance
    for position in range(1, len(PROMPT_IDS)):
        entry = out.prompt_logprobs[position]
        token = PROMPT_IDS[position]
        assert entry[token].logprob == pytest.approx(expected[position - 1, token].item(), abs=tolerance)


def test_the_same_cache_memory_holds_twice_the_blocks_in_16_bits() -> None:
    budget = 4 * 2**20
    wide = LLM(kv_cache_memory=budget).engine.runner
    narrow = LLM(kv_cache_memory=budget, kv_cache_dtype="bfloat16").engine.runner
    assert {cache.dtype for cache in wide.kv_caches.values()} == {torch.float32}
    assert narrow.num_blocks // 2 == wide.num_blocks  # the budget divided by half the bytes a block
    # Naming the model's own dtype is the same cache as "auto".
    explicit = LLM(kv_cache_memory=budget, kv_cache_dtype="float32").engine.runner
    assert {cache.dtype for cache in explicit.kv_caches.values()} == {torch.float32}
    assert explicit.num_blocks == wide.num_blocks


@pytest.mark.parametrize("value", ["fp8", "int8", "half", None, torch.float16])
def test_other_cache_dtypes_are_refused_by_name(value: object) -> None:
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, float32, bfloat16, float16"):
        CacheConfig(kv_cache_dtype=value)  # type: ignore[arg-type]


def test_the_compiled_forward_reads_and_writes_a_16_bit_cache_as_eager_does() -> None:
    """The compiled pieces write float32 keys and values into a float16 cache through the same ops. Their
    float32 arithmetic differs from eager's in the last bits (Inductor's fused loops against ATen's), and one
    such difference can round a cached key or value to the neighbouring float16 (a relative step of 1e-3), so
    logprobs agree to 1e-3; writing the cache wrongly would change them by far more."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    prompts = [PROMPT, "Lily had a dog"]
    runs = []
    for compile in (False, True):
        llm = LLM(kv_cache_dtype="float16", compile=compile)
        runs.append(llm.generate(prompts, params, use_tqdm=False))
    for eager, compiled in zip(*runs, strict=True):
        assert compiled.outputs[0].token_ids == eager.outputs[0].token_ids
        for token, eager_entry, compiled_entry in zip(
            eager.outputs[0].token_ids, eager.outputs[0].logprobs, compiled.outputs[0].logprobs, strict=True
        ):
            assert compiled_entry[token].logprob == pytest.approx(eager_entry[token].logprob, abs=1e-3)
