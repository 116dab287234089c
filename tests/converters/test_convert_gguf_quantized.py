"""`convert_gguf(..., keep_quantized=True)`: Q8_0 weights stay int8 on disk and load as Strata's int8 layers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from safetensors.numpy import load_file
from safetensors.torch import load_file as load_torch
from safetensors.torch import save_file

from strata import LLM, SamplingParams
from strata.gguf.converter import convert_gguf
from strata.models.transformers.loader import WeightLoadError
from strata.models.transformers.quantization import QuantizedTensorError

from .test_convert_cli import parse
from .test_convert_gguf import Q8_0, matrices_as, write_gguf

STEPS = 24
PROMPT = [1, 403, 407, 261, 378]  # "Once upon a time"
# Q8_0 needs rows of whole 32-value blocks: all stories260K matrices but down_proj (172 inputs) qualify.
KEPT = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
]


@pytest.fixture(scope="module")
def q8_0_folders(shared_models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same Q8_0 GGUF (with a separate classifier) converted to float32 and kept quantized."""
    tmp = tmp_path_factory.mktemp("q8_0")
    source = shared_models_dir / "stories260K.gguf"
    embedding = np.array(GGUFReader(source).get_tensor(0).data)
    path = write_gguf(tmp / "q8.gguf", source, matrices_as(Q8_0), replace={"output.weight": embedding * 0.5})
    return convert_gguf(path, tmp / "float32"), convert_gguf(path, tmp / "int8", keep_quantized=True)


def _greedy(llm: LLM) -> tuple[list[int], list[float]]:
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=1)
    out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0]
    return out.token_ids, [
        step[token].logprob for step, token in zip(out.logprobs, out.token_ids, strict=True)
    ]


def test_q8_0_stays_int8_on_disk(q8_0_folders: tuple[Path, Path]) -> None:
    floats, kept = q8_0_folders
    want, got = load_file(floats / "model.safetensors"), load_file(kept / "model.safetensors")
    config = json.loads((kept / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "strata_int8",
        "bits": 8,
        "group_size": 32,
        "source": "gguf Q8_0",
    }
    assert "quantization_config" not in json.loads((floats / "config.json").read_text())
    expected_kept = {f"model.layers.{i}.{name}" for i in range(5) for name in KEPT} | {"lm_head"}
    assert {name.removesuffix(".qweight") for name in got if name.endswith(".qweight")} == expected_kept
    for name, weight in want.items():
        base = name.removesuffix(".weight")
        if base not in expected_kept:
            np.testing.assert_array_equal(got[name], weight, err_msg=name)  # embedding, norms, down_proj
            continue
        q, scales = got[f"{base}.qweight"], got[f"{base}.qscale"]
        rows, cols = weight.shape
        assert q.dtype == np.int8 and q.shape == weight.shape, name
        assert scales.dtype == np.float16 and scales.shape == (rows, cols // 32), name
        # The block values times their scales are exactly what the float32 conversion wrote (Q/K rows
        # reordered for HF's rotary layout the same way).
        dequantized = (q.reshape(rows, -1, 32) * scales.astype(np.float32)[:, :, None]).reshape(rows, cols)
        np.testing.assert_array_equal(dequantized, weight, err_msg=name)
    assert (kept / "model.safetensors").stat().st_size < 0.5 * (floats / "model.safetensors").stat().st_size


def test_kept_folder_loads_as_int8_like_its_float32_conversion(q8_0_folders: tuple[Path, Path]) -> None:
    floats, kept = q8_0_folders
    llm = LLM(str(kept), max_model_len=64, max_num_seqs=1)
    assert llm.engine.config.model_config.quantization == "int8"
    assert sum(r["op"] == "int8_linear" for r in llm.layer_providers()) == 5 * 6 + 1
    # Dequantizing the blocks gives the float32 folder's exact weights, and both are then quantized per
    # channel the same way: the same int8 model, token for token and logprob for logprob.
    tokens, logprobs = _greedy(llm)
    assert (tokens, logprobs) == _greedy(
        LLM(str(floats), max_model_len=64, max_num_seqs=1, quantization="int8")
    )
    # Against the float32 model (a trained one, so no near-ties): the same greedy story.
    fp32_tokens, fp32_logprobs = _greedy(LLM(str(floats), max_model_len=64, max_num_seqs=1))
    assert tokens == fp32_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, fp32_logprobs, strict=True)) < 0.05


def _damaged(kept: Path, out: Path, change: dict[str, torch.Tensor | None]) -> Path:
    shutil.copytree(kept, out)
    tensors = load_torch(out / "model.safetensors")
    for name, tensor in change.items():
        if tensor is None:
            del tensors[name]
        else:
            tensors[name] = tensor
    save_file(tensors, out / "model.safetensors")
    return out


def test_malformed_quantized_tensors_are_clear_errors(
    q8_0_folders: tuple[Path, Path], tmp_path: Path
) -> None:
    _, kept = q8_0_folders
    name = "model.layers.2.self_attn.q_proj"
    cases = [
        ({f"{name}.qscale": None}, WeightLoadError, rf"{name}\.qweight has no {name}\.qscale"),
        ({f"{name}.qweight": None}, WeightLoadError, rf"{name}\.qscale has no {name}\.qweight"),
        ({f"{name}.qweight": torch.zeros(64, 64)},
         QuantizedTensorError, r"must be a 2-D int8 tensor, found torch\.float32"),
        ({f"{name}.qscale": torch.ones(64, 3)},
         QuantizedTensorError, r"shape \[64, G\] with G dividing 64, found .* \(64, 3\)"),
        ({f"{name}.qscale": torch.full((64, 2), float("nan"))}, QuantizedTensorError, "not finite"),
        ({f"{name}.qweight": torch.zeros(64, 32, dtype=torch.int8), f"{name}.qscale": torch.ones(64, 1)},
         WeightLoadError, rf"{name}\.weight .* has shape \(64, 32\), the model expects \(64, 64\)"),
    ]  # fmt: skip
    for i, (change, error, message) in enumerate(cases):
        folder = _damaged(kept, tmp_path / str(i), change)
        with pytest.raises(error, match=message):
            LLM(str(folder), max_model_len=64, max_num_seqs=1)


def test_keep_quantized_without_q8_0_tensors_writes_a_float_folder(
    shared_models_dir: Path, tmp_path: Path
) -> None:
    path = write_gguf(tmp_path / "f32.gguf", shared_models_dir / "stories260K.gguf")
    out = convert_gguf(path, tmp_path / "out", keep_quantized=True)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert not any(name.endswith(".qweight") for name in load_file(out / "model.safetensors"))


def test_cli_keep_quantized(q8_0_folders: tuple[Path, Path], tmp_path: Path) -> None:
    _, kept = q8_0_folders
    gguf = kept.parent / "q8.gguf"
    for flag, quantized in (([], False), (["--keep-quantized"], True)):
        out = tmp_path / str(quantized)
        args = parse(["convert", "gguf", str(gguf), "--out", str(out), *flag])
        assert args.func(args) == 0
        assert ("quantization_config" in json.loads((out / "config.json").read_text())) is quantized
