"""Offline generation throughput: Strata against transformers' `generate`, on the same weights, in one run.

The models are random-weight Llama folders built here from fixed seeds, so the benchmark needs no downloads
and every machine measures the same weights. For each concurrency C, C prompts of random token ids are
generated greedily to a fixed length (EOS ignored) by every engine; engines take turns run by run so drift in
machine load hits them alike, and the median of the runs is reported as output tokens per second.

An engine is an entry in `ENGINES`: a factory that loads a model folder once and returns a `Generate`
function timing only the generation itself. Peers (llama.cpp) and variants (compiled, other layers) are
added as more entries; `--engines strata,strata-hw-agnostic,strata-example-plugin,transformers` compares
Strata's default layers, its hw-agnostic layers and the example plugin's override in one run;
`--engines strata,strata-compiled` compares eager and compiled decode;
`--engines strata,strata-bf16,strata-int8` compares float32 weights with bfloat16 and int8 weight-only ones;
`--engines strata-compiled,strata-compiled-high` the default float32 matmuls with bf16x3 ones on AMX CPUs.

    python benchmarks/throughput.py --models smollm-135m --concurrency 1,8,32 --json-out /tmp/throughput.json

Roofline. Twice per run, before any model loads and after the last one is freed, with the run's thread
count, the script measures the machine's memory read bandwidth (best of several `torch.sum` over a 512 MB
float32 tensor) and its matmul rate (best of several 2048x2048 `torch.mm`, float32 and bfloat16, and float32
through oneDNN's linear where PyTorch has it). Each limit is the better of the two measurements (a neighbour
only ever makes one slower, and one `torch.mm` measurement on a noisy machine once read 138 GFLOP/s where
the other read 207), recorded in the JSON `machine` section (`roofline`; both measurements under
`roofline_measurements`). Every result row then says how close it came to the two limits:
- `bw%` (`bw_fraction`), batch-1 decode rows only: `tok/s * weight_bytes / bandwidth`, where `weight_bytes`
  is what one decode step must read: the weights of every matmul (all parameters but an untied input
  embedding table, of which a step reads one row) at the engine's weight precision (4 bytes for float32,
  2 for `strata-bf16`, 1 for `strata-int8`; see `ENGINE_WEIGHT_BYTES`).
- `flop%` (`flop_fraction`), every row: `tok/s * 2 * params / matmul_rate` (float32 `torch.mm` rate), with
  `params` the same matmul parameters. Attention's own FLOPs are left out, so long prompts read a little low.
- `flop%best` (`flop_fraction_best`): the same against the faster of `torch.mm` and oneDNN. On CPUs where
  `torch.mm`'s BLAS is far from the machine's peak (MKL on AMD runs float32 at about half oneDNN's rate),
  this is the honest share of the compute limit.
- `flop%work` (`work_flop_fraction`): the matmul FLOPs the run really did, per second, against the `torch.mm`
  rate. `flop%` credits output tokens only, so the time a run spends on its prompts counts against it; here
  every sequence's prompt and generated tokens but the last go through the layers (2 * (params - head) each)
  and each generated token through the LM head (2 * head_params), as vLLM's total-token throughput counts
  prompts. Decode rows also give `total_tokens_per_s` (prompt and output tokens per second).
- `roof%` (`roofline_fraction`), decode rows (not those of an engine that takes a batch's prompts one after
  another): the least time the run could take at both limits at once (`roofline_seconds`: each step the
  longer of reading its weights and KV cache and doing its FLOPs, perfectly overlapped) over its median
  time. `flop%` and `bw%` each hold a row to one limit; where a batch's steps need about as long for their
  reads as for their FLOPs (the ridge), neither can come near 100%, and `roof%` says how much is really left.

Prefill. `--prefill-len N` (default 512; 0 turns it off) times, for each engine, one prompt of N random ids
that produces a single token: the time is the prompt's forward pass. Engines for it are built again with
limits of one sequence of N + 1 tokens (after the decode engines are freed), so the decode rows keep their
own cache sizes. Reported as prompt tokens per second in the `prefill` section, with ratios to the baseline
in `prefill_ratios`, and in a table of its own.

llama.cpp peer. The `llama.cpp` engine runs llama-cpp-python on an F32 GGUF written from the same folder
(`write_gguf`, cached as `model-f32.gguf` inside the model folder). It is in the default engines but used
only when `import llama_cpp` works; otherwise it is skipped with a note on stderr and listed under
`settings.skipped_engines`. Install it on the benchmark machine from the sdist, built for the host CPU:

    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python

llama-cpp-python's `Llama` holds one sequence, so at concurrency C > 1 the llama.cpp row generates the C
prompts one after another (rows say `"sequential": true`; its tok/s is then total tokens / total time):
that is what a llama-cpp-python user gets, not llama.cpp server's batched slots.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import math
import os
import platform
import random
import shutil
import statistics
import struct
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
BASELINE = "transformers"
LLAMA_CPP = "llama.cpp"
BUILD_SEED = 0
PROMPT_LEN = 32
DEFAULT_PREFILL_LEN = 512
WARMUP_TOKENS = 2
# Greedy outputs of the engines must agree this far; random weights can have near-ties further on.
GREEDY_CHECK_TOKENS = 8
# Prompt ids start above the usual pad/bos/eos ids (0, 1, 2) so no prompt token is special.
FIRST_PROMPT_ID = 3
# Roofline measurements: bytes summed for the read bandwidth, matmul size, timed repeats (best is kept) and
# a time budget per measurement that stops the repeats early on a slow machine.
ROOFLINE_READ_BYTES = 512 * 2**20
ROOFLINE_MATMUL_N = 2048
ROOFLINE_REPEATS = 5
ROOFLINE_BUDGET_S = 2.0
GGUF_NAME = "model-f32.gguf"

_COMMON_SHAPE: dict[str, Any] = {"rope_theta": 10000.0, "rms_norm_eps": 1e-5}

# Llama shapes of real small checkpoints; "tiny" exists for the harness's own test.
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "smollm-135m": {
        **_COMMON_SHAPE,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
    },
    "stories15m": {
        **_COMMON_SHAPE,
        "hidden_size": 288,
        "intermediate_size": 768,
        "num_hidden_layers": 6,
        "num_attention_heads": 6,
        "num_key_value_heads": 6,
        "vocab_size": 32000,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
    },
    "tiny": {
        **_COMMON_SHAPE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        # Room for the default 512-token prefill prompt.
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
    },
}
DEFAULT_MODELS = ("smollm-135m", "stories15m")


class Limits(NamedTuple):
    """What an engine may size its buffers (KV cache, batch slots) for: the largest batch and sequence."""

    max_batch: int
    max_len: int


# (prompts, new_tokens) -> (seconds spent generating, the new token ids of each prompt)
Generate = Callable[[list[list[int]], int], tuple[float, list[list[int]]]]
EngineFactory = Callable[[Path, Limits], Generate]


def strata_llm(
    folder: Path,
    limits: Limits,
    layer_impl: str = "default",
    compile: bool = False,
    compile_mode: str = "model",
    dtype: str = "float32",
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
    fp32_matmul_precision: str | None = None,
) -> Any:
    """Strata's offline `LLM` with its default scheduler and cache settings, the cache sized to the workload.

    With `compile` the forward is compiled when the engine is built (a one-token warm-up), so timed runs
    measure compiled decode, not compilation. `dtype` and `quantization` give the lower-precision variants
    (the weights are the same float32 folder, converted or quantized as they load); `kv_cache_dtype` a 16-bit
    KV cache under float32 weights (llama.cpp's default keeps its cache in float16); `fp32_matmul_precision`
    the precision float32 weights are packed under ("high": bf16x3 on AMX CPUs)."""
    from strata import LLM, SamplingParams

    # Without max_model_len/max_num_seqs the default cache would take a quarter of free memory.
    llm = LLM(
        model=str(folder),
        dtype=dtype,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=limits.max_len,
        max_num_seqs=limits.max_batch,
        layer_impl=layer_impl,
        fp32_matmul_precision=fp32_matmul_precision,
        compile=compile,
        compilation_config={"mode": compile_mode},
    )
    if compile:
        llm.generate({"prompt_token_ids": [FIRST_PROMPT_ID]}, SamplingParams(max_tokens=1), use_tqdm=False)
    return llm


def strata_engine(folder: Path, limits: Limits, **variant: Any) -> Generate:
    """`strata_llm(folder, limits, **variant)` generating greedily through `LLM.generate`."""
    from strata import SamplingParams

    llm = strata_llm(folder, limits, **variant)

    def generate(prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        batch = [{"prompt_token_ids": prompt} for prompt in prompts]
        start = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return seconds, [list(output.outputs[0].token_ids) for output in outputs]

    return generate


def transformers_model(folder: Path) -> Any:
    """The folder's model in transformers, float32 with SDPA attention, in eval mode."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def transformers_engine(folder: Path, limits: Limits) -> Generate:
    """transformers' own `generate` with SDPA attention: what a user of the library gets out of the box."""
    model = transformers_model(folder)

    def generate(prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        input_ids = torch.tensor(prompts, dtype=torch.int64)
        # Explicit mask: otherwise transformers infers one from pad_token_id and masks prompt ids equal to it.
        attention_mask = torch.ones_like(input_ids)
        with torch.inference_mode():
            start = time.perf_counter()
            output = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
            )
            seconds = time.perf_counter() - start
        return seconds, output[:, input_ids.shape[1] :].tolist()

    return generate


def strata_example_plugin_engine(folder: Path, limits: Limits) -> Generate:
    """Strata with the example plugin's RMSNorm override (examples/strata-example-plugin), registered only
    while this engine's model is built so the other engines in the run keep Strata's own layers."""
    from strata_example_plugin import register

    from strata.custom_op import registering_plugin, unregister_oot

    with registering_plugin("strata_example"):
        register()
    try:
        return strata_engine(folder, limits)
    finally:
        unregister_oot("RMSNorm")


def llama_cpp_unavailable() -> str | None:
    """Why `import llama_cpp` fails (not installed, or its shared library does not load), or None."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as e:  # an ImportError, or an OSError from a library built for another machine
        return f"import llama_cpp failed ({type(e).__name__}: {e}); see the module docstring to install it"
    return None


def llama_cpp_model(folder: Path, limits: Limits) -> Any:
    """llama-cpp-python's `Llama` on the folder's F32 GGUF, with torch's thread count; one sequence."""
    import llama_cpp

    threads = torch.get_num_threads()
    return llama_cpp.Llama(
        model_path=str(ensure_gguf(folder)),
        n_ctx=limits.max_len,
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=min(512, limits.max_len),
        logits_all=False,
        verbose=False,
    )


def llama_cpp_greedy(llm: Any, prompt: list[int]) -> Iterator[int]:
    """The tokens `llm` generates greedily after `prompt`, from an empty cache (no reuse of the previous
    prompt's: every prompt is processed in full). Close the generator when done with it."""
    llm.reset()
    return llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True)


def llama_cpp_engine(folder: Path, limits: Limits) -> Generate:
    """llama.cpp through llama-cpp-python on an F32 GGUF of the same weights, greedy from token ids.

    One `Llama` holds one sequence: a batch of prompts is generated one prompt after another."""
    llm = llama_cpp_model(folder, limits)

    def generate(prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        outputs: list[list[int]] = []
        start = time.perf_counter()
        for prompt in prompts:
            tokens: list[int] = []
            stream = llama_cpp_greedy(llm, prompt)
            for token in stream:
                tokens.append(int(token))
                if len(tokens) == new_tokens:
                    break
            stream.close()
            outputs.append(tokens)
        seconds = time.perf_counter() - start
        return seconds, outputs

    return generate


# Strata's variants: the keyword arguments of `strata_llm` each one is built with.
STRATA_VARIANTS: dict[str, dict[str, Any]] = {
    "strata": {},
    "strata-hw-agnostic": {"layer_impl": "hw-agnostic"},
    "strata-compiled": {"compile": True},
    "strata-compiled-kv16": {"compile": True, "kv_cache_dtype": "float16"},
    "strata-compiled-high": {"compile": True, "fp32_matmul_precision": "high"},
    "strata-compiled-high-kv16": {
        "compile": True,
        "fp32_matmul_precision": "high",
        "kv_cache_dtype": "float16",
    },
    "strata-compiled-layer": {"compile": True, "compile_mode": "layer"},
    "strata-hw-agnostic-compiled": {"layer_impl": "hw-agnostic", "compile": True},
    "strata-bf16": {"dtype": "bfloat16"},
    "strata-bf16-compiled": {"dtype": "bfloat16", "compile": True},
    "strata-int8": {"quantization": "int8"},
    "strata-int8-compiled": {"quantization": "int8", "compile": True},
}
ENGINES: dict[str, EngineFactory] = {
    **{name: functools.partial(strata_engine, **variant) for name, variant in STRATA_VARIANTS.items()},
    BASELINE: transformers_engine,
    LLAMA_CPP: llama_cpp_engine,
    "strata-example-plugin": strata_example_plugin_engine,
}
DEFAULT_ENGINES = ("strata", BASELINE, LLAMA_CPP)
# Bytes per matmul weight an engine reads in a decode step (default: the folder's float32). int8's one
# scale per output row is left out (a few KB); its input embedding stays float but only one row is read.
ENGINE_WEIGHT_BYTES: dict[str, float] = {
    "strata-bf16": 2.0,
    "strata-bf16-compiled": 2.0,
    "strata-int8": 1.0,
    "strata-int8-compiled": 1.0,
}
# Bytes per cached key or value (default: float32, the folder's dtype): a 16-bit cache, bfloat16 weights'
# own, and llama.cpp's default float16 cache.
ENGINE_KV_BYTES: dict[str, float] = {
    "strata-compiled-kv16": 2.0,
    "strata-compiled-high-kv16": 2.0,
    "strata-bf16": 2.0,
    "strata-bf16-compiled": 2.0,
    LLAMA_CPP: 2.0,
}
# Engines whose matmuls run at the bfloat16 rate (bfloat16 weights; int8 ones are multiplied as bfloat16
# from 9 rows on); the others at float32's.
BF16_MATMUL_ENGINES = frozenset(
    {"strata-bf16", "strata-bf16-compiled", "strata-int8", "strata-int8-compiled"}
)
# Engines that generate a batch's prompts one after another rather than together.
SEQUENTIAL_ENGINES = frozenset({LLAMA_CPP})


def ensure_model_folder(name: str, model_dir: Path) -> Path:
    """The saved random-weight model `name` under `model_dir`, built from a fixed seed when missing.

    A cached folder whose config.json disagrees with `MODEL_SHAPES` (an older shape) is rebuilt."""
    folder = model_dir / name
    shape = MODEL_SHAPES[name]
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        saved = json.loads((folder / "config.json").read_text())
        if all(saved[key] == value for key, value in shape.items() if key in saved):
            return folder
    config = LlamaConfig(**shape)
    torch.manual_seed(BUILD_SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Build beside the target and rename, so an interrupted build never leaves a folder that looks complete.
    model_dir.mkdir(parents=True, exist_ok=True)
    partial = model_dir / f".{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


def _safetensors_shapes(path: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) from a safetensors file's JSON header, without reading the tensors."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {name: (t["dtype"], t["shape"]) for name, t in header.items() if name != "__metadata__"}


_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1, "F64": 8, "I32": 4, "I64": 8}


def model_weights(folder: Path) -> dict[str, int]:
    """Parameter and byte counts of a model folder, from its safetensors header and config.

    `params` and `bytes` count every stored tensor; `matmul_params` and `matmul_bytes` leave out an untied
    input embedding table (a token reads one row of it), so they are what one decode step multiplies by and
    reads. A tied table is stored once and counted once, as the LM head. `head_params`: the LM head's share
    of `matmul_params`, which only the positions that produce a token multiply by. `kv_values_per_token`: the
    keys and values a token leaves in the cache, over all layers."""
    config = json.loads((folder / "config.json").read_text())
    shapes = _safetensors_shapes(folder / "model.safetensors")
    params = total_bytes = matmul_params = matmul_bytes = 0
    head = "lm_head.weight" if "lm_head.weight" in shapes else "model.embed_tokens.weight"
    for name, (dtype, shape) in shapes.items():
        count = math.prod(shape)
        nbytes = count * _DTYPE_BYTES[dtype]
        params += count
        total_bytes += nbytes
        if name == "model.embed_tokens.weight" and not config.get("tie_word_embeddings", False):
            continue
        matmul_params += count
        matmul_bytes += nbytes
    return {
        "params": params,
        "bytes": total_bytes,
        "matmul_params": matmul_params,
        "matmul_bytes": matmul_bytes,
        "head_params": math.prod(shapes[head][1]),
        "kv_values_per_token": 2
        * config["num_hidden_layers"]
        * config.get("num_key_value_heads", config["num_attention_heads"])
        * (config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]),
    }


# HF Llama name suffix -> GGUF (llama.cpp) name suffix; the inverse of strata.converters.gguf's mapping.
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# The placeholder vocabulary's special ids (prompts are token ids, so no piece is ever looked up by text).
_GGUF_UNK, _GGUF_BOS, _GGUF_EOS = 0, 1, 2


def _gguf_name(name: str) -> str:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) >= 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        base, suffix = ".".join(parts[3:-1]), parts[-1]
        if base in _GGUF_LAYER_NAMES:
            return f"blk.{int(parts[2])}.{_GGUF_LAYER_NAMES[base]}.{suffix}"
    raise ValueError(f"tensor {name!r} has no llama.cpp counterpart")


def rope_half_to_interleaved(weight: Any, n_heads: int) -> Any:
    """Reorder Q/K rows from HF Llama's rotate_half layout to llama.cpp's adjacent-pair rotary layout.

    The inverse of `strata.converters.hf_folder.rope_interleaved_to_half` (llama.cpp's own HF converter
    does the same `permute`): per head, rows (x0, x1, ..., y0, y1, ...) become (x0, y0, x1, y1, ...)."""
    rows, cols = weight.shape
    return weight.reshape(n_heads, 2, rows // n_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def write_gguf(folder: Path, out_path: Path) -> Path:
    """Write the HF Llama folder's weights as an F32 llama-architecture GGUF at `out_path`; returns it.

    The vocabulary is a placeholder of the model's size ("<t{i}>" pieces, SentencePiece "llama" type, ids
    0/1/2 unknown/BOS/EOS) since the benchmark's prompts are token ids."""
    import gguf
    from safetensors.numpy import load_file

    config = LlamaConfig.from_pretrained(folder)
    rope = getattr(config, "rope_parameters", None) or {}
    rope_theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{folder}: RoPE scaling {rope.get('rope_type')!r} is not supported")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    n_heads, n_kv_heads = config.num_attention_heads, config.num_key_value_heads
    tensors = load_file(folder / "model.safetensors")

    writer = gguf.GGUFWriter(out_path, "llama")
    writer.add_name(folder.name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    special = {
        _GGUF_UNK: gguf.TokenType.UNKNOWN,
        _GGUF_BOS: gguf.TokenType.CONTROL,
        _GGUF_EOS: gguf.TokenType.CONTROL,
    }
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"<t{i}>" for i in range(config.vocab_size)])
    writer.add_token_scores([0.0] * config.vocab_size)
    writer.add_token_types([special.get(i, gguf.TokenType.NORMAL) for i in range(config.vocab_size)])
    writer.add_unk_token_id(_GGUF_UNK)
    writer.add_bos_token_id(_GGUF_BOS)
    writer.add_eos_token_id(_GGUF_EOS)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)

    rope_heads = {"self_attn.q_proj.weight": n_heads, "self_attn.k_proj.weight": n_kv_heads}
    for name, array in tensors.items():
        array = array.astype("float32", copy=False)
        heads = rope_heads.get(name.split(".", 3)[-1]) if name.startswith("model.layers.") else None
        if heads is not None:
            array = rope_half_to_interleaved(array, heads)
        writer.add_tensor(_gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def ensure_gguf(folder: Path) -> Path:
    """The folder's F32 GGUF, written once beside its weights (a rebuilt folder drops it with the rest)."""
    path = folder / GGUF_NAME
    if not path.is_file():
        partial = folder / f".{GGUF_NAME}.partial"
        write_gguf(folder, partial)
        partial.rename(path)
    return path


def make_prompts(count: int, vocab_size: int, tag: str, length: int = PROMPT_LEN) -> list[list[int]]:
    """`count` prompts of `length` random ids, the same for every engine and every run with this tag."""
    rng = random.Random(tag)
    return [[rng.randrange(FIRST_PROMPT_ID, vocab_size) for _ in range(length)] for _ in range(count)]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        # Other work on the machine skews every number; the load average says whether there was any.
        "load_average_start": list(os.getloadavg()),
    }


def _best_seconds(fn: Callable[[], Any], repeats: int, budget_s: float) -> float:
    """Shortest of up to `repeats` timed calls after one untimed one, stopping once `budget_s` is spent."""
    fn()
    best = math.inf
    deadline = time.perf_counter() + budget_s
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        if time.perf_counter() > deadline:
            break
    return best


def measure_roofline(
    read_bytes: int = ROOFLINE_READ_BYTES,
    matmul_n: int = ROOFLINE_MATMUL_N,
    repeats: int = ROOFLINE_REPEATS,
    budget_s: float = ROOFLINE_BUDGET_S,
) -> dict[str, Any]:
    """Memory read bandwidth and float32/bfloat16 matmul rates measured now, with torch's current threads.

    Best of several runs, since neighbours only ever make a run slower."""
    with torch.inference_mode():
        data = torch.ones(read_bytes // 4, dtype=torch.float32)
        read_s = _best_seconds(data.sum, repeats, budget_s)
        del data
        generator = torch.Generator().manual_seed(0)
        a = torch.randn(matmul_n, matmul_n, generator=generator)
        b = torch.randn(matmul_n, matmul_n, generator=generator)
        fp32_s = _best_seconds(lambda: torch.mm(a, b), repeats, budget_s)
        a16, b16 = a.bfloat16(), b.bfloat16()
        bf16_s = _best_seconds(lambda: torch.mm(a16, b16), repeats, budget_s)
        onednn_s = None
        if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
            linear = torch.ops.mkldnn._linear_pointwise  # a @ b.T: the same FLOPs as torch.mm
            onednn_s = _best_seconds(lambda: linear(a, b, None, "none", [], ""), repeats, budget_s)
    flops = 2 * matmul_n**3
    fp32_rate = flops / fp32_s / 1e9
    onednn_rate = None if onednn_s is None else flops / onednn_s / 1e9
    return {
        "threads": torch.get_num_threads(),
        "memory_read_gb_s": read_bytes / read_s / 1e9,
        "matmul_fp32_gflop_s": fp32_rate,
        "matmul_fp32_onednn_gflop_s": onednn_rate,
        "matmul_fp32_best_gflop_s": max(fp32_rate, onednn_rate or 0.0),
        "matmul_bf16_gflop_s": flops / bf16_s / 1e9,
        "read_bytes": read_bytes,
        "matmul_n": matmul_n,
    }


def work_flops(weights: dict[str, int], sequences: int, prompt_len: int, new_tokens: int) -> int:
    """Matmul FLOPs of generating `new_tokens` after a prompt of `prompt_len`, for each of `sequences`: every
    position but the last generated one goes through the layers, and each generated token's through the head."""
    head = weights["head_params"]
    layers = weights["matmul_params"] - head
    return sequences * 2 * (layers * (prompt_len + new_tokens - 1) + head * new_tokens)


def engine_weight_bytes(engine: str, weights: dict[str, int]) -> float:
    """What one decode step of `engine` reads of the matmul weights, at its weight precision."""
    return weights["matmul_params"] * ENGINE_WEIGHT_BYTES.get(engine, 4.0)


def roofline_seconds(
    engine: str,
    weights: dict[str, int],
    roofline: dict[str, Any],
    sequences: int,
    prompt_len: int,
    new_tokens: int,
) -> float:
    """The least time `sequences` prompts of `prompt_len` generating `new_tokens` each could take at the
    machine's two limits, each step overlapping its memory reads and its FLOPs perfectly and doing nothing
    else: the prompts as one step (their FLOPs, or one read of the weights), then each decode step the
    longer of reading the weights and every sequence's KV cache so far at the memory's rate and doing its
    FLOPs at the matmul rate. A batch decoding at the roofline's ridge is bound by both at once, and no
    engine can reach either limit there."""
    rate_key = "matmul_bf16_gflop_s" if engine in BF16_MATMUL_ENGINES else "matmul_fp32_gflop_s"
    rate, bandwidth = roofline[rate_key] * 1e9, roofline["memory_read_gb_s"] * 1e9
    weight_bytes = engine_weight_bytes(engine, weights)
    kv_bytes_per_token = weights["kv_values_per_token"] * ENGINE_KV_BYTES.get(engine, 4.0)
    seconds = max(work_flops(weights, sequences, prompt_len, 1) / rate, weight_bytes / bandwidth)
    step_flops = 2 * sequences * weights["matmul_params"]  # each further token: the layers and the head
    for context in range(prompt_len + 1, prompt_len + new_tokens):  # tokens in the cache after the step
        step_bytes = weight_bytes + sequences * context * kv_bytes_per_token
        seconds += max(step_flops / rate, step_bytes / bandwidth)
    return seconds


def _limit_fields(
    engine: str,
    weights: dict[str, int],
    roofline: dict[str, Any],
    tokens_per_s: float,
    decode_batch1: bool,
    flops_per_s: float,
) -> dict[str, Any]:
    """params, weight_bytes and the fractions of the bandwidth (batch-1 decode only) and compute limits, for
    a row of `tokens_per_s` output tokens whose run did `flops_per_s` matmul FLOPs in all (`work_flops`)."""
    params = weights["matmul_params"]
    weight_bytes = engine_weight_bytes(engine, weights)
    bandwidth = roofline["memory_read_gb_s"] * 1e9
    return {
        "params": params,
        "weight_bytes": int(weight_bytes),
        "bw_fraction": tokens_per_s * weight_bytes / bandwidth if decode_batch1 else None,
        "flop_fraction": tokens_per_s * 2 * params / (roofline["matmul_fp32_gflop_s"] * 1e9),
        "flop_fraction_best": tokens_per_s * 2 * params / (roofline["matmul_fp32_best_gflop_s"] * 1e9),
        "work_flop_fraction": flops_per_s / (roofline["matmul_fp32_gflop_s"] * 1e9),
    }


def best_roofline(measurements: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each rate the best of the measurements: the machine's limits, which noise only ever lowers."""
    best = dict(measurements[0])
    for measured in measurements[1:]:
        for key, value in measured.items():
            if key.endswith(("_gb_s", "_gflop_s")) and value is not None:
                best[key] = max(best[key] or 0.0, value)
    return best


def add_limit_fields(report: dict[str, Any], roofline: dict[str, Any]) -> None:
    """The limits of each model and each row's fractions of them (`_limit_fields`), from `roofline`."""
    new_tokens = report["settings"]["new_tokens"]
    for weights in report["models"].values():
        weights.update(
            {
                # Batch-1 decode can go no faster than reading the matmul weights once per token.
                "fp32_bandwidth_limit_tok_s": roofline["memory_read_gb_s"] * 1e9 / weights["matmul_bytes"],
                "fp32_compute_limit_tok_s": roofline["matmul_fp32_gflop_s"]
                * 1e9
                / (2 * weights["matmul_params"]),
                "fp32_best_compute_limit_tok_s": roofline["matmul_fp32_best_gflop_s"]
                * 1e9
                / (2 * weights["matmul_params"]),
            }
        )
    for row in report["results"]:
        weights = report["models"][row["model"]]
        flops_per_s = work_flops(weights, row["concurrency"], PROMPT_LEN, new_tokens) / row["median_s"]
        decode_batch1 = row["concurrency"] == 1
        row.update(
            _limit_fields(row["engine"], weights, roofline, row["tokens_per_s"], decode_batch1, flops_per_s)
        )
        if not (row.get("sequential") and row["concurrency"] > 1):
            bound = roofline_seconds(
                row["engine"], weights, roofline, row["concurrency"], PROMPT_LEN, new_tokens
            )
            row["roofline_fraction"] = bound / row["median_s"]
    for row in report["prefill"]:
        weights = report["models"][row["model"]]
        flops_per_s = work_flops(weights, 1, row["prompt_len"], 1) / row["median_s"]
        limit = _limit_fields(
            row["engine"], weights, roofline, row["prompt_tokens_per_s"], False, flops_per_s
        )
        row.update(
            {
                key: limit[key]
                for key in ("params", "flop_fraction", "flop_fraction_best", "work_flop_fraction")
            }
        )


def _build_runners(engines: Sequence[str], folder: Path, limits: Limits) -> dict[str, Generate]:
    return {name: ENGINES[name](folder, limits) for name in engines}


def _release(runners: dict[str, Generate]) -> None:
    """Drop the engines (and the memory their models and caches hold) before the next ones load."""
    runners.clear()
    gc.collect()


def bench_model(
    model: str,
    folder: Path,
    engines: Sequence[str],
    concurrencies: Sequence[int],
    new_tokens: int,
    repeats: int,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Result rows and ratio rows of one model, every engine loaded once and reused for every concurrency
    (the limit fractions are added once the run's roofline is known: `add_limit_fields`)."""
    limits = Limits(max_batch=max(concurrencies), max_len=PROMPT_LEN + new_tokens)
    runners = _build_runners(engines, folder, limits)
    vocab_size = MODEL_SHAPES[model]["vocab_size"]
    results: list[dict[str, Any]] = []
    ratios: list[dict[str, Any]] = []
    for concurrency in concurrencies:
        warmup = make_prompts(concurrency, vocab_size, f"{concurrency}:warmup")
        for generate in runners.values():
            generate(warmup, WARMUP_TOKENS)
        runs: dict[str, list[float]] = {name: [] for name in engines}
        first_outputs: dict[str, list[list[int]]] = {}
        for repeat in range(repeats):
            # Fresh prompts per run, so prefix caching cannot reuse an earlier run's prompts.
            prompts = make_prompts(concurrency, vocab_size, f"{concurrency}:{repeat}")
            order = list(engines) if repeat % 2 == 0 else list(reversed(engines))
            for name in order:
                seconds, token_ids = runners[name](prompts, new_tokens)
                lengths = {len(ids) for ids in token_ids}
                if len(token_ids) != concurrency or lengths != {new_tokens}:
                    raise RuntimeError(
                        f"{name} returned {len(token_ids)} outputs of lengths {sorted(lengths)}; "
                        f"expected {concurrency} of {new_tokens} tokens"
                    )
                runs[name].append(seconds)
                # Progress on stderr: a full run takes minutes, and stdout is kept for the report.
                print(
                    f"{model} concurrency={concurrency} {name} run {repeat + 1}/{repeats}: {seconds:.2f} s",
                    file=sys.stderr,
                    flush=True,
                )
                first_outputs.setdefault(name, token_ids)
        for name in engines:
            median = statistics.median(runs[name])
            row: dict[str, Any] = {
                "model": model,
                "concurrency": concurrency,
                "engine": name,
                "tokens_per_s": concurrency * new_tokens / median,
                "total_tokens_per_s": concurrency * (PROMPT_LEN + new_tokens) / median,
                "median_s": median,
                "runs_s": runs[name],
            }
            if name in SEQUENTIAL_ENGINES:
                row["sequential"] = True
            results.append(row)
        if BASELINE not in engines:
            continue
        baseline_s = statistics.median(runs[BASELINE])
        for name in engines:
            if name == BASELINE:
                continue
            ratio: dict[str, Any] = {
                "model": model,
                "concurrency": concurrency,
                "engine": name,
                "baseline": BASELINE,
                "ratio": baseline_s / statistics.median(runs[name]),
            }
            if concurrency == 1:
                ours = first_outputs[name][0][:GREEDY_CHECK_TOKENS]
                theirs = first_outputs[BASELINE][0][:GREEDY_CHECK_TOKENS]
                ratio["greedy_match"] = ours == theirs
                if ours != theirs:
                    print(
                        f"warning: {model}: greedy ids of {name} {ours} differ from {BASELINE} {theirs}",
                        file=sys.stderr,
                    )
            ratios.append(ratio)
    _release(runners)
    return results, ratios


def bench_prefill(
    model: str,
    folder: Path,
    engines: Sequence[str],
    prefill_len: int,
    repeats: int,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Prefill rows and ratio rows of one model: one prompt of `prefill_len` ids producing one token.

    The engines are built for exactly that sequence (one prompt of prefill_len + 1 tokens)."""
    max_positions = MODEL_SHAPES[model]["max_position_embeddings"]
    if prefill_len + 1 > max_positions:
        raise ValueError(
            f"{model}: a prefill of {prefill_len} tokens plus one generated exceeds its "
            f"max_position_embeddings {max_positions}"
        )
    runners = _build_runners(engines, folder, Limits(max_batch=1, max_len=prefill_len + 1))
    vocab_size = MODEL_SHAPES[model]["vocab_size"]
    warmup = make_prompts(1, vocab_size, f"prefill:{prefill_len}:warmup", prefill_len)
    for generate in runners.values():
        generate(warmup, 1)
    runs: dict[str, list[float]] = {name: [] for name in engines}
    first_token: dict[str, int] = {}
    for repeat in range(repeats):
        prompts = make_prompts(1, vocab_size, f"prefill:{prefill_len}:{repeat}", prefill_len)
        order = list(engines) if repeat % 2 == 0 else list(reversed(engines))
        for name in order:
            seconds, token_ids = runners[name](prompts, 1)
            if len(token_ids) != 1 or len(token_ids[0]) != 1:
                raise RuntimeError(f"{name} returned {token_ids!r} for one prompt of one new token")
            runs[name].append(seconds)
            print(
                f"{model} prefill={prefill_len} {name} run {repeat + 1}/{repeats}: {seconds:.3f} s",
                file=sys.stderr,
                flush=True,
            )
            first_token.setdefault(name, token_ids[0][0])
    _release(runners)
    rows: list[dict[str, Any]] = []
    for name in engines:
        median = statistics.median(runs[name])
        row: dict[str, Any] = {
            "model": model,
            "engine": name,
            "prompt_len": prefill_len,
            "prompt_tokens_per_s": prefill_len / median,
            "median_s": median,
            "runs_s": runs[name],
        }
        rows.append(row)
    ratios: list[dict[str, Any]] = []
    if BASELINE in engines:
        baseline_s = statistics.median(runs[BASELINE])
        ratios = [
            {
                "model": model,
                "engine": name,
                "baseline": BASELINE,
                "prompt_len": prefill_len,
                "ratio": baseline_s / statistics.median(runs[name]),
                "greedy_match": first_token[name] == first_token[BASELINE],
            }
            for name in engines
            if name != BASELINE
        ]
    return rows, ratios


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def _render(header: list[str], lines: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
    rendered = [
        " | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [header, *lines]
    ]
    rendered.insert(1, "-+-".join("-" * width for width in widths))
    return rendered


def format_roofline(roofline: dict[str, Any]) -> str:
    return (
        f"roofline ({roofline['threads']} threads): memory read {roofline['memory_read_gb_s']:.1f} GB/s, "
        f"fp32 matmul {roofline['matmul_fp32_gflop_s']:.0f} GFLOP/s "
        f"(best {roofline['matmul_fp32_best_gflop_s']:.0f}), "
        f"bf16 matmul {roofline['matmul_bf16_gflop_s']:.0f} GFLOP/s"
    )


def format_table(report: dict[str, Any]) -> str:
    """One line per (model, concurrency, engine): tok/s, the ratio to the baseline and the limit fractions.

    `bw%` is the share of the memory-bandwidth limit (batch-1 decode only), `flop%` of the fp32 compute one
    counting output tokens, `flop%work` counting every matmul the run did (prompts too). A prefill table follows when the report has prefill rows."""
    ratio = {(r["model"], r["concurrency"], r["engine"]): r["ratio"] for r in report["ratios"]}
    vs = f"vs {BASELINE}"
    lines = [
        [
            r["model"],
            str(r["concurrency"]),
            r["engine"] + (" (seq)" if r.get("sequential") and r["concurrency"] > 1 else ""),
            f"{r['tokens_per_s']:.1f}",
            f"{ratio[key]:.2f}" if (key := (r["model"], r["concurrency"], r["engine"])) in ratio else "-",
            _percent(r.get("bw_fraction")),
            _percent(r.get("flop_fraction")),
            _percent(r.get("flop_fraction_best")),
            _percent(r.get("work_flop_fraction")),
            _percent(r.get("roofline_fraction")),
        ]
        for r in report["results"]
    ]
    header = [
        "model",
        "concurrency",
        "engine",
        "tok/s",
        vs,
        "bw%",
        "flop%",
        "flop%best",
        "flop%work",
        "roof%",
    ]
    rendered = _render(header, lines)
    checks = [
        f"{r['model']} {r['engine']}: {'match' if r['greedy_match'] else 'MISMATCH'}"
        for r in report["ratios"]
        if "greedy_match" in r
    ]
    if checks:
        rendered.append(
            f"greedy ids, first {GREEDY_CHECK_TOKENS} tokens at concurrency 1: " + ", ".join(checks)
        )
    if any(r.get("sequential") and r["concurrency"] > 1 for r in report["results"]):
        rendered.append("(seq): the engine generates the batch's prompts one after another")
    prefill = report.get("prefill") or []
    if prefill:
        prefill_ratio = {(r["model"], r["engine"]): r["ratio"] for r in report.get("prefill_ratios", [])}
        prefill_lines = [
            [
                r["model"],
                str(r["prompt_len"]),
                r["engine"],
                f"{r['prompt_tokens_per_s']:.1f}",
                f"{prefill_ratio[r['model'], r['engine']]:.2f}"
                if (r["model"], r["engine"]) in prefill_ratio
                else "-",
                _percent(r.get("flop_fraction")),
                _percent(r.get("flop_fraction_best")),
                _percent(r.get("work_flop_fraction")),
            ]
            for r in prefill
        ]
        rendered.append("")
        rendered.extend(
            _render(
                ["model", "prompt", "engine", "prompt tok/s", vs, "flop%", "flop%best", "flop%work"],
                prefill_lines,
            )
        )
    return "\n".join(rendered)


def _name_list(text: str, allowed: Sequence[str]) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in allowed]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)}; got {text!r}")
    return names


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """--threads, --model-dir and --json-out, which every benchmark script takes."""
    parser.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads(N); default: torch's own"
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=REPO_ROOT / "bench_models",
        help="where the random-weight model folders are cached (default: bench_models/ in the repo)",
    )
    parser.add_argument("--json-out", type=Path, default=None, help="also write the JSON report to this file")


def require_at_least_one(
    parser: argparse.ArgumentParser, args: argparse.Namespace, options: Sequence[str]
) -> None:
    """`parser.error` for the first of `options` (attribute names) given below 1."""
    for option in options:
        value = getattr(args, option)
        if value is not None and value < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1, got {value}")


def print_report(report: dict[str, Any], table: str, json_out: Path | None) -> None:
    """The JSON report, a blank line and the table on stdout (and the JSON into `json_out`, if given)."""
    text = json.dumps(report, indent=2)
    if json_out is not None:
        json_out.write_text(text + "\n")
    print(f"{text}\n\n{table}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models",
        type=lambda text: _name_list(text, list(MODEL_SHAPES)),
        default=list(DEFAULT_MODELS),
        help=f"comma-separated, from {', '.join(MODEL_SHAPES)} (default: {','.join(DEFAULT_MODELS)})",
    )
    parser.add_argument(
        "--engines",
        type=lambda text: _name_list(text, list(ENGINES)),
        default=list(DEFAULT_ENGINES),
        help=f"comma-separated, from {', '.join(ENGINES)} (default: {','.join(DEFAULT_ENGINES)}; "
        f"{LLAMA_CPP} is skipped with a note when llama_cpp is not installed)",
    )
    parser.add_argument(
        "--concurrency", type=_int_list, default=[1, 8, 32], help="prompts per batch (default: 1,8,32)"
    )
    parser.add_argument(
        "--new-tokens", type=int, default=128, help="tokens generated per prompt (default: 128)"
    )
    parser.add_argument(
        "--prefill-len",
        type=int,
        default=DEFAULT_PREFILL_LEN,
        help=f"prompt length of the prefill measurement; 0 turns it off (default: {DEFAULT_PREFILL_LEN})",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per engine; the median is reported"
    )
    add_run_options(parser)
    args = parser.parse_args(argv)
    require_at_least_one(parser, args, ("new_tokens", "repeats", "threads"))
    if args.prefill_len < 0:
        parser.error(f"--prefill-len must be 0 (off) or positive, got {args.prefill_len}")
    for model in args.models:
        max_positions = MODEL_SHAPES[model]["max_position_embeddings"]
        if args.prefill_len + 1 > max_positions:
            parser.error(
                f"--prefill-len {args.prefill_len} plus one generated token exceeds {model}'s "
                f"max_position_embeddings {max_positions}"
            )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # Installed plugins would swap the layers of every Strata engine; the plugin variant registers its own.
    os.environ.setdefault("STRATA_PLUGINS", "")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    engines = list(args.engines)
    skipped: dict[str, str] = {}
    if LLAMA_CPP in engines and (reason := llama_cpp_unavailable()) is not None:
        engines.remove(LLAMA_CPP)
        skipped[LLAMA_CPP] = reason
        print(f"note: skipping {LLAMA_CPP}: {skipped[LLAMA_CPP]}", file=sys.stderr, flush=True)
    if not engines:
        print("error: no engine left to run", file=sys.stderr)
        return 2
    first_roofline = measure_roofline()
    print(format_roofline(first_roofline), file=sys.stderr, flush=True)
    report: dict[str, Any] = {
        "machine": machine_info(),
        "settings": {
            "engines": engines,
            "skipped_engines": skipped,
            "prompt_len": PROMPT_LEN,
            "new_tokens": args.new_tokens,
            "prefill_len": args.prefill_len,
            "repeats": args.repeats,
            "dtype": "float32",
        },
        "models": {},
        "results": [],
        "ratios": [],
        "prefill": [],
        "prefill_ratios": [],
    }
    for model in args.models:
        folder = ensure_model_folder(model, args.model_dir)
        report["models"][model] = model_weights(folder)
        results, ratios = bench_model(model, folder, engines, args.concurrency, args.new_tokens, args.repeats)
        report["results"].extend(results)
        report["ratios"].extend(ratios)
        if args.prefill_len:
            rows, prefill_ratios = bench_prefill(model, folder, engines, args.prefill_len, args.repeats)
            report["prefill"].extend(rows)
            report["prefill_ratios"].extend(prefill_ratios)
    report["machine"]["load_average_end"] = list(os.getloadavg())
    measurements = [first_roofline, measure_roofline()]
    roofline = best_roofline(measurements)
    report["machine"].update({"roofline": roofline, "roofline_measurements": measurements})
    add_limit_fields(report, roofline)
    text = json.dumps(report, indent=2)
    print(text)
    print()
    print(format_roofline(roofline))
    for model, info in report["models"].items():
        print(
            f"{model}: {info['matmul_params'] / 1e6:.1f}M matmul params, {info['matmul_bytes'] / 1e6:.1f} MB fp32 "
            f"per token: bandwidth limit {info['fp32_bandwidth_limit_tok_s']:.0f} tok/s at batch 1, "
            f"compute limit {info['fp32_compute_limit_tok_s']:.0f} tok/s"
        )
    print()
    print(format_table(report))
    if args.json_out is not None:
        args.json_out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
