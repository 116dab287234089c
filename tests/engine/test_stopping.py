"""EOS, min_tokens, max_tokens and abort, on a tiny model whose EOS is a token it really generates."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from strata import LLM, SamplingParams

PROMPT = {"prompt_token_ids": [5, 17, 99, 42, 8, 23]}


@pytest.fixture(scope="module")
def greedy_run(tiny_model_dir: Callable[[str], Path]) -> list[int]:
    llm = LLM(str(tiny_model_dir("llama")), skip_tokenizer_init=True)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def eos_model(
    tiny_model_dir: Callable[[str], Path], greedy_run: list[int], tmp_path_factory
) -> tuple[Path, int]:
    """A copy of the tiny model whose EOS is the token greedy decoding emits 6th."""
    eos = greedy_run[5]
    folder = tmp_path_factory.mktemp("eos-model")
    shutil.copytree(tiny_model_dir("llama"), folder, dirs_exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.exists():
            data = json.loads(path.read_text())
            data["eos_token_id"] = eos
            path.write_text(json.dumps(data))
    return folder, eos


def test_eos_stops_and_min_tokens_bans_it(eos_model: tuple[Path, int], greedy_run: list[int]) -> None:
    folder, eos = eos_model
    first = greedy_run.index(eos)
    llm = LLM(str(folder), skip_tokenizer_init=True)
    completion = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[
        0
    ].outputs[0]
    assert completion.token_ids == greedy_run[: first + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason is None

    params = SamplingParams(temperature=0, max_tokens=40, min_tokens=first + 3)
    completion = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert len(completion.token_ids) >= first + 3
    assert eos not in completion.token_ids[: first + 2]

    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    completion = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert completion.token_ids == greedy_run and completion.finish_reason == "length"


def test_abort_frees_blocks_at_once(tiny_model_dir: Callable[[str], Path]) -> None:
    llm = LLM(str(tiny_model_dir("llama")), skip_tokenizer_init=True, enable_prefix_caching=False)
    engine = llm.engine
    engine.add_request(PROMPT, SamplingParams(max_tokens=100, ignore_eos=True), request_id="a")
    engine.add_request(PROMPT, SamplingParams(max_tokens=100, ignore_eos=True), request_id="b")
    for _ in range(3):
        engine.step()
    assert engine.scheduler.block_manager.num_free_blocks < engine.scheduler.block_manager.num_blocks
    engine.abort_request("a")
    engine.abort_request("b")
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks
    assert not engine.has_unfinished_requests() and engine.step() == []


def test_outputs_are_snapshots(tiny_model_dir: Callable[[str], Path]) -> None:
    """A streamed output must not change when the engine takes later steps."""
    engine = LLM(str(tiny_model_dir("llama")), skip_tokenizer_init=True).engine
    engine.add_request(PROMPT, SamplingParams(max_tokens=5, logprobs=1, prompt_logprobs=1, ignore_eos=True))
    first = engine.step()[0]
    seen = (list(first.outputs[0].token_ids), len(first.outputs[0].logprobs), len(first.prompt_logprobs))
    while engine.has_unfinished_requests():
        last = engine.step()
    assert len(last[0].outputs[0].token_ids) == 5
    assert (first.outputs[0].token_ids, len(first.outputs[0].logprobs), len(first.prompt_logprobs)) == seen
