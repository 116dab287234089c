"""Bad input gets a clear error naming the problem, and leaves the engine usable."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import BertConfig

from strata import LLM, SamplingParams
from strata.config import ConfigError
from strata.engine.prompts import PromptError


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Callable[[str], Path]) -> LLM:
    return LLM(str(tiny_model_dir("llama")), skip_tokenizer_init=True, max_model_len=64)


def test_prompt_errors(llm: LLM) -> None:
    with pytest.raises(PromptError, match="max_model_len=64"):
        llm.generate({"prompt_token_ids": [5] * 64}, use_tqdm=False)
    with pytest.raises(PromptError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(PromptError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [5, 128]}, use_tqdm=False)
    with pytest.raises(PromptError, match="integers"):
        llm.generate({"prompt_token_ids": [5, "x"]}, use_tqdm=False)
    with pytest.raises(PromptError, match="skip_tokenizer_init"):
        llm.generate("text needs a tokenizer", use_tqdm=False)
    with pytest.raises(PromptError):
        llm.generate(3.5, use_tqdm=False)
    # One bad prompt in a batch: nothing of the batch is queued, and the engine still works.
    with pytest.raises(PromptError):
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": []}], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_sampling_params_errors_name_the_field(llm: LLM) -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.generate({"prompt_token_ids": [5]}, sampling_params={"temperature": 0}, use_tqdm=False)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="a SamplingParams or a list of them, got str"):
        llm.generate({"prompt_token_ids": [5]}, "greedy", use_tqdm=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm.generate({"prompt_token_ids": [5]}, [SamplingParams(), SamplingParams()], use_tqdm=False)


def test_model_folder_errors(tmp_path: Path, tiny_model_dir: Callable[[str], Path]) -> None:
    with pytest.raises(ConfigError, match="not a directory"):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=r"no config\.json"):
        LLM(str(tmp_path))
    bert = tmp_path / "bert"
    BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37
    ).save_pretrained(bert)
    with pytest.raises(ConfigError, match="not a causal language model"):
        LLM(str(bert))
    with pytest.raises(ConfigError, match="dtype"):
        LLM(str(tiny_model_dir("llama")), dtype="int3")
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(str(tiny_model_dir("llama")), max_model_len=100_000)
    with pytest.raises(ConfigError, match="kv_cache_memory"):
        LLM(str(tiny_model_dir("llama")), skip_tokenizer_init=True, kv_cache_memory=1000)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json"):
        LLM(str(broken))
    no_tokenizer = tiny_model_dir("llama")
    with pytest.raises(ConfigError, match="skip_tokenizer_init"):
        LLM(str(no_tokenizer))


def test_weight_mismatch_names_tensors(tmp_path: Path, tiny_model_dir: Callable[[str], Path]) -> None:
    folder = tmp_path / "wrong"
    shutil.copytree(tiny_model_dir("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 4
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.3\."):
        LLM(str(folder), skip_tokenizer_init=True)


def test_mixture_of_experts_checkpoint_errors_name_the_expert(
    tmp_path: Path, tiny_model_dir: Callable[[str], Path]
) -> None:
    """Per-expert checkpoint tensors fill one fused parameter: one missing leaves that parameter missing,
    and an expert the config does not have is named as such."""
    from safetensors.torch import load_file, save_file

    def with_tensors(name: str, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
        folder = tmp_path / name
        shutil.copytree(tiny_model_dir("mixtral"), folder)
        tensors = load_file(folder / "model.safetensors")
        edit(tensors)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        return folder

    missing = with_tensors("missing", lambda t: t.pop("model.layers.1.block_sparse_moe.experts.2.w3.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.experts\.gate_up_proj"):
        LLM(str(missing), skip_tokenizer_init=True)

    def add_expert(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.0.block_sparse_moe.experts.7.w2.weight"] = tensors[
            "model.layers.0.block_sparse_moe.experts.0.w2.weight"
        ].clone()

    extra = with_tensors("extra", add_expert)
    with pytest.raises(ValueError, match=r"experts\.7\.w2\.weight .* for expert 7 of 4"):
        LLM(str(extra), skip_tokenizer_init=True)


def test_device_errors_name_the_platforms(tiny_model_dir: Callable[[str], Path]) -> None:
    folder = str(tiny_model_dir("llama"))
    with pytest.raises(ConfigError, match=r"device 'tpu' names no platform; known: cpu, cuda"):
        LLM(folder, skip_tokenizer_init=True, device="tpu")
    with pytest.raises(ConfigError, match="device must be a string"):
        LLM(folder, skip_tokenizer_init=True, device=0)  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="the cuda platform is not available on this machine"):
            LLM(folder, skip_tokenizer_init=True, device="cuda:0")
