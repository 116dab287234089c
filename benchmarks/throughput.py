"""Offline generation throughput: Strata's variants, transformers and llama.cpp side by side, same weights.

The models are random-weight Llama folders built from fixed seeds by shape (`MODEL_SHAPES`), cached under
--model-dir: nothing is downloaded and every machine measures the same weights. For each concurrency C,
each engine generates greedily from C prompts of random ids to --new-tokens (EOS ignored); the engines take
turns run by run, so drift in machine load hits them alike, and the median of --repeats runs is reported as
output tokens/s, with its ratio to transformers' own `generate` (float32, SDPA) and to llama.cpp.
--prefill-len times one prompt's forward (prompt tokens/s). The memory read bandwidth and float32 matmul
rate are measured first; batch-1 rows give `bw%`: tok/s x weight bytes a step reads / bandwidth.

--context N adds a decode row at batch 1 over a long context: each engine prefills a prompt of
N - new_tokens - 1 random ids and generates new_tokens + 1 tokens, so that the sequence fills N positions,
and only the --new-tokens decode steps after the prefill's token are timed: from the moment the engine
hands over its first token to its last (Strata's engine steps, llama.cpp's token stream, a transformers
streamer). The prefill, far longer, stays out of the figure instead of being subtracted from it.

llama.cpp runs through llama-cpp-python (`CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python`;
skipped with a note without it) on an F32 GGUF written from the folder. It holds one sequence, so at C > 1
it generates the prompts one after another ("(seq)" in the table).

GGUF engines: `strata-gguf` (Strata compiled, as `strata-compiled`, loading the GGUF file) and `llama.cpp`
run on the folder's F32 GGUF; `strata-gguf-F` and `llama.cpp-F` on its quantization F (q8_0, q4_0, q4_k_m),
written by llama.cpp's own quantizer and cached beside it (`-f32` names the F32 file too); without
llama-cpp-python, the `gguf` package writes q8_0 (`GGUF_PY_QUANTS`; each model's `gguf_quantized_by` in the
report says which wrote a file) and the engines on the others are skipped. A Strata GGUF row is compared
with llama.cpp on the same file (`vs_llama_cpp`) and with `strata-compiled` on the folder (`vs_strata_f32`)
when they ran. --gguf-file benchmarks an existing GGUF instead of the folders, with `strata-gguf` (and
`strata-gguf-hw-agnostic`) and `llama.cpp` on it. A GGUF engine's `bw%` counts the bytes of the file's 2-D
weights (the token embedding only when it is also the output head: a step reads one row of an untied one).

    python benchmarks/throughput.py --models smollm-135m --concurrency 1,8,32 --json-out /tmp/tp.json
    python benchmarks/throughput.py --engines strata,strata-compiled,strata-int8,transformers --prefill-len 0
    python benchmarks/throughput.py --models smollm-135m --concurrency 1,32 --engines \
        strata-compiled,strata-gguf-q4_0,llama.cpp-q4_0,strata-gguf-q4_k_m,llama.cpp-q4_k_m
    python benchmarks/throughput.py --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf --concurrency 1

Engines on the hw-agnostic layers: for any Strata engine `H[-R]`, H its head (strata, strata-compiled or
strata-gguf), `H-hw-agnostic[-R]` is the same engine with `layer_impl="hw-agnostic"`, every layer's
pure-PyTorch reference: strata-compiled-hw-agnostic, strata-compiled-hw-agnostic-bf16,
strata-gguf-hw-agnostic-q8_0. Its row's `vs_default` is its tokens/s over that default engine's (same
weights, options and run); its greedy ids are checked against the default's. Issue 49's table (float32 and
bfloat16 folder, Q8_0 and Q4_K_M files, each beside its default; then the real SmolLM2 Q4_1 file):

    F=strata-compiled,strata-compiled-hw-agnostic,strata-compiled-bf16,strata-compiled-hw-agnostic-bf16
    Q=strata-gguf-q8_0,strata-gguf-hw-agnostic-q8_0,strata-gguf-q4_k_m,strata-gguf-hw-agnostic-q4_k_m
    python benchmarks/throughput.py --models smollm-135m --concurrency 1,32 --prefill-len 512 \
        --context 2048 --engines $F,$Q --json-out /tmp/hw-agnostic.json
    python benchmarks/throughput.py --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf --concurrency 1 \
        --prefill-len 0 --engines strata-gguf,strata-gguf-hw-agnostic,llama.cpp

--structured json adds, for each Strata engine E, an engine `E+json` (its own `LLM`, same options) whose
requests are constrained to a JSON schema (`structured_outputs`): an array of at least --new-tokens objects
with a bounded string and an integer each, so no request can finish early; its row's `vs unconstrained`
is its tokens/s over E's. Every Strata engine then loads the tokenizer and detokenizes, as the constrained
one must, so the two differ only in the constraint. It needs the file's tokenizer, so it runs with
--gguf-file:

    python benchmarks/throughput.py --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf --engines strata-gguf \
        --concurrency 32 --new-tokens 64 --prefill-len 0 --structured json
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import math
import platform
import random
import shutil
import statistics
import sys
import time
import timeit
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.generation.streamers import BaseStreamer

REPO_ROOT = Path(__file__).resolve().parents[1]
BASELINE, LLAMA_CPP = "transformers", "llama.cpp"
PROMPT_LEN = 32
FIRST_PROMPT_ID = 3  # prompt ids start above the usual pad/bos/eos ids (0, 1, 2)
GREEDY_CHECK_TOKENS = 8  # the engines' greedy ids must agree this far; random weights have near-ties later
# Quantizations of the F32 GGUF that the GGUF engines run on, llama.cpp's quantizer writing each
# (`llama_cpp.LLAMA_FTYPE_MOSTLY_<name upper-cased>`).
GGUF_QUANTS = ("q8_0", "q4_0", "q4_k_m")
# The quantizations the `gguf` package writes where llama.cpp is missing, with llama.cpp's choices: its Q8_0
# is bit-exact with ggml's reference quantizer, and llama.cpp puts every 2-D weight in Q8_0 too. (It has no
# Q4_K or Q6_K quantizer, which Q4_K_M needs; its Q4_0 would miss llama.cpp's Q6_K output head.)
GGUF_PY_QUANTS, GGUF_PY = ("q8_0",), "gguf-py"  # the latter: their `general.quantized_by`
STRATA_GGUF, STRATA_F32 = "strata-gguf", "strata-compiled"  # Strata on a GGUF file; its float32 reference
STRUCTURED_SUFFIX = "+json"  # a Strata engine whose requests are constrained to `structured_schema`
# `E-tpN` / `E-ppN`: Strata engine E over N tensor-parallel processes / pipeline stages.
PARALLEL_SUFFIXES = {"-tp": "tensor_parallel_size", "-pp": "pipeline_parallel_size"}
# `H-hw-agnostic-R`: Strata engine H-R with every layer's pure-PyTorch reference (`layer_impl`), H its head.
HW_AGNOSTIC, HW_AGNOSTIC_OPTION = "-hw-agnostic", {"layer_impl": "hw-agnostic"}
STRATA_HEADS = (STRATA_F32, STRATA_GGUF, "strata")  # longest first: the head an engine's name starts with

_COMMON: dict[str, Any] = {"rope_theta": 10000.0, "rms_norm_eps": 1e-5}
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "smollm-135m": {**_COMMON, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                    "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                    "max_position_embeddings": 2048, "tie_word_embeddings": True},
    "stories15m": {**_COMMON, "hidden_size": 288, "intermediate_size": 768, "num_hidden_layers": 6,
                   "num_attention_heads": 6, "num_key_value_heads": 6, "vocab_size": 32000,
                   "max_position_embeddings": 1024, "tie_word_embeddings": False},
    "tiny": {**_COMMON, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
             "max_position_embeddings": 1024, "tie_word_embeddings": False},
}  # fmt: skip

# Strata's variants: the `LLM` keyword arguments each one is built with.
STRATA_VARIANTS: dict[str, dict[str, Any]] = {
    "strata": {},
    "strata-compiled": {"compile": True},
    "strata-compiled-bf16": {"compile": True, "dtype": "bfloat16"},
    "strata-compiled-kv16": {"compile": True, "kv_cache_dtype": "float16"},
    "strata-compiled-high": {"compile": True, "fp32_matmul_precision": "high"},
    "strata-compiled-layer": {"compile": True, "compilation_config": {"mode": "layer"}},
    "strata-bf16": {"dtype": "bfloat16"},
    "strata-int8": {"quantization": "int8"},
}


def with_hw_agnostic(engine: str) -> str:
    """Strata engine `engine` on the hw-agnostic layers: "-hw-agnostic" after its head."""
    head = next(h for h in STRATA_HEADS if engine == h or engine.startswith(f"{h}-"))
    return head + HW_AGNOSTIC + engine.removeprefix(head)


def split_hw_agnostic(engine: str) -> tuple[str, dict[str, str]]:
    """(the default engine, its `LLM` layer option) of an engine on the hw-agnostic layers; (engine, {}) for
    any other."""
    default = engine.replace(HW_AGNOSTIC, "", 1)
    return (default, HW_AGNOSTIC_OPTION) if default != engine else (engine, {})


ON_GGUF_FILE = [STRATA_GGUF, with_hw_agnostic(STRATA_GGUF), LLAMA_CPP]  # each on one GGUF file
GGUF_ENGINES = [*ON_GGUF_FILE, *(f"{e}-{q}" for q in GGUF_QUANTS for e in ON_GGUF_FILE)]
ENGINE_NAMES = [*STRATA_VARIANTS, *map(with_hw_agnostic, STRATA_VARIANTS), BASELINE, *GGUF_ENGINES]
ENGINE_ALIASES = {f"{e}-f32": e for e in ON_GGUF_FILE}
DEFAULT_ENGINES, GGUF_FILE_ENGINES = f"strata,{BASELINE},{LLAMA_CPP}", f"{STRATA_GGUF},{LLAMA_CPP}"

# (prompts, new tokens) -> (seconds spent generating, the new token ids of each prompt). Each engine's has a
# `decode` of the same form for one prompt, timing only decode steps (`time_decode_steps`).
Generate = Callable[[list[list[int]], int], tuple[float, list[list[int]]]]


def time_decode_steps(tokens: Generator[int, None, None], steps: int) -> tuple[float, list[list[int]]]:
    """Seconds from the first token an engine streams (the prefill yields it) to `steps` tokens more, and
    those: `steps` decode steps, the prefill left out. The stream is closed after."""
    next(tokens)
    start = time.perf_counter()
    ids = [int(token) for _, token in zip(range(steps), tokens, strict=False)]  # range first: no token more
    seconds = time.perf_counter() - start
    tokens.close()
    return seconds, [ids]


def structured_schema(new_tokens: int) -> dict[str, Any]:
    """A JSON schema no output can complete in `new_tokens` tokens (every item takes several), mixing the
    masks of keys, free strings and numbers."""
    item = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    return {"type": "array", "items": item, "minItems": new_tokens}


def strata_engine(
    folder: Path, max_batch: int, max_len: int, tokenizer: bool, structured: bool = False, **variant: Any
) -> Generate:
    """Strata's `LLM` with the variant's options, its cache sized to the workload, with the model's tokenizer
    or on token ids alone; with `structured`, its requests constrained to `structured_schema`."""
    from strata import LLM, SamplingParams
    from strata.sampling_params import StructuredOutputsParams

    llm = LLM(
        str(folder),
        skip_tokenizer_init=not tokenizer,
        max_model_len=max_len,
        max_num_seqs=max_batch,
        **variant,
    )

    def generate(prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        spec = StructuredOutputsParams(json=structured_schema(new_tokens)) if structured else None
        params = SamplingParams(
            temperature=0, max_tokens=new_tokens, ignore_eos=True, structured_outputs=spec
        )
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]

    def stream(prompt: list[int], new_tokens: int) -> Generator[int, None, None]:
        """The new tokens of a request as the engine's steps make them (`LLM.generate` hands all over at the
        end)."""
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        request_id = llm.engine.add_request({"prompt_token_ids": prompt}, params).request_id
        sent = 0
        while True:
            for output in llm.engine.step():
                if output.request_id == request_id:
                    ids = output.outputs[0].token_ids
                    yield from ids[sent:]
                    sent = len(ids)
                    if output.finished:
                        return

    def decode(prompts: list[list[int]], steps: int) -> tuple[float, list[list[int]]]:
        (prompt,) = prompts
        return time_decode_steps(stream(prompt, steps + 1), steps)

    generate.decode = decode  # type: ignore[attr-defined]
    generate.engine_stats = llm.stats  # type: ignore[attr-defined]
    generate.close = llm.shutdown  # type: ignore[attr-defined]
    return generate


def transformers_engine(folder: Path, max_batch: int, max_len: int) -> Generate:
    """transformers' own `generate`, float32 with SDPA attention: what a user of the library gets."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")

    def generate(prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        ids = torch.tensor(prompts)
        lengths = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "pad_token_id": 0}
        with torch.inference_mode():
            start = time.perf_counter()
            # An explicit mask, or transformers masks the prompt ids that equal pad_token_id.
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, **lengths)
            seconds = time.perf_counter() - start
        return seconds, out[:, ids.shape[1] :].tolist()

    def decode(prompts: list[list[int]], steps: int) -> tuple[float, list[list[int]]]:
        ids, stamps = torch.tensor(prompts), TokenTimes()
        lengths = {"max_new_tokens": steps + 1, "min_new_tokens": steps + 1, "pad_token_id": 0}
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, streamer=stamps, **lengths
            )
        # The streamer's first call brings the prompt, its second the prefill's token.
        return stamps.times[-1] - stamps.times[1], out[:, ids.shape[1] + 1 :].tolist()

    generate.decode = decode  # type: ignore[attr-defined]
    return generate


class TokenTimes(BaseStreamer):
    """When transformers' `generate` hands over the prompt, then each new token (batch 1)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def llama_cpp_unavailable() -> str | None:
    """Why `import llama_cpp` fails, or None."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as e:  # ImportError, or OSError from a library built for another CPU
        return f"import llama_cpp failed ({type(e).__name__}: {e})"
    return None


def llama_cpp_engine(path: Path, max_batch: int, max_len: int) -> Generate:
    """llama-cpp-python's `Llama` on the GGUF file with torch's thread count. It holds one sequence: a
    batch's prompts are generated one after another, each from an empty cache."""
    import llama_cpp

    n = torch.get_num_threads()
    llm = llama_cpp.Llama(str(path), n_ctx=max_len, n_batch=min(512, max_len), n_threads=n,
                          n_threads_batch=n, verbose=False)  # fmt: skip

    def stream(prompt: list[int]) -> Generator[int, None, None]:
        llm.reset()
        return llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True)

    def generate(prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        outputs = []
        start = time.perf_counter()
        for prompt in prompts:
            tokens = stream(prompt)
            # range first: zip stops before asking the stream for one token too many.
            outputs.append([int(token) for _, token in zip(range(new_tokens), tokens, strict=False)])
            tokens.close()
        return time.perf_counter() - start, outputs

    def decode(prompts: list[list[int]], steps: int) -> tuple[float, list[list[int]]]:
        (prompt,) = prompts
        return time_decode_steps(stream(prompt), steps)

    generate.decode = decode  # type: ignore[attr-defined]
    return generate


def gguf_format(engine: str) -> str | None:
    """The GGUF file a GGUF engine runs on ("f32": the model's own, else a quantization of it); None for the
    engines on the folder."""
    engine = split_hw_agnostic(engine.removesuffix(STRUCTURED_SUFFIX))[0]
    for family in (STRATA_GGUF, LLAMA_CPP):
        if engine == family or engine.startswith(f"{family}-"):
            return engine.removeprefix(family).removeprefix("-") or "f32"
    return None


def split_parallel(engine: str) -> tuple[str, dict[str, int]]:
    """(the engine, its `LLM` parallel option) of `E-tpN` or `E-ppN`; (engine, {}) for any other."""
    for suffix, option in PARALLEL_SUFFIXES.items():
        base, _, size = engine.rpartition(suffix)
        if base and size.isdigit():
            return base, {option: int(size)}
    return engine, {}


def strata_variant(engine: str) -> dict[str, Any]:
    """The `LLM` keyword arguments of a Strata engine on the folder."""
    engine, parallel = split_parallel(engine)
    default, layers = split_hw_agnostic(engine)
    return {**STRATA_VARIANTS[default], **layers, **parallel}


def peers(engine: str) -> dict[str, str]:
    """The engines a row is compared with, by ratio field: transformers; llama.cpp on the same file (the
    F32 GGUF for the engines on the folder); and for Strata on a GGUF file, Strata compiled on the folder.
    A structured engine is compared with the same engine unconstrained only, a tensor-parallel one with the
    same engine in one process (a pipeline-parallel one likewise). An engine on the hw-agnostic layers is
    compared with its default (`vs_default`: same weights and options, the platform's layers) and with its
    default's peers, Strata's on the hw-agnostic layers too."""
    if engine.endswith(STRUCTURED_SUFFIX):
        return {"vs_unconstrained": engine.removesuffix(STRUCTURED_SUFFIX)}
    if (base := split_parallel(engine))[1]:
        return {"vs_one_process": base[0]}
    if (default := split_hw_agnostic(engine)[0]) != engine:
        theirs = {
            key: with_hw_agnostic(p) if p.startswith("strata") else p for key, p in peers(default).items()
        }
        return {"vs_default": default, **theirs}
    fmt = gguf_format(engine)
    out = {"vs_transformers": BASELINE}
    if not engine.startswith(LLAMA_CPP):
        out["vs_llama_cpp"] = LLAMA_CPP if fmt in (None, "f32") else f"{LLAMA_CPP}-{fmt}"
    if fmt is not None and engine.startswith(STRATA_GGUF):
        out["vs_strata_f32"] = STRATA_F32
    return out


def build_engine(
    name: str, folder: Path | None, files: dict[str, Path], max_batch: int, max_len: int, tokenizer: bool
) -> Generate:
    """The engine `name` on the folder or on its GGUF file (`files`, by format); Strata's with the model's
    tokenizer when `tokenizer`."""
    structured = name.endswith(STRUCTURED_SUFFIX)
    name = name.removesuffix(STRUCTURED_SUFFIX)
    if (fmt := gguf_format(name)) is not None:
        if name.startswith(LLAMA_CPP):
            return llama_cpp_engine(files[fmt], max_batch, max_len)
        variant = {**STRATA_VARIANTS[STRATA_F32], **split_hw_agnostic(name)[1]}
        return strata_engine(files[fmt], max_batch, max_len, tokenizer, structured, **variant)
    assert folder is not None, f"{name} needs a model folder"
    if name == BASELINE:
        return transformers_engine(folder, max_batch, max_len)
    return strata_engine(folder, max_batch, max_len, tokenizer, structured, **strata_variant(name))


def bytes_per_weight(engine: str) -> int:
    """Bytes per matmul weight a Strata engine on the folder reads in a step (int8's per-row scales left
    out)."""
    variant = strata_variant(engine.removesuffix(STRUCTURED_SUFFIX)) if engine.startswith("strata") else {}
    return 1 if variant.get("quantization") == "int8" else 2 if variant.get("dtype") == "bfloat16" else 4


def gguf_step_weights(path: Path) -> tuple[int, int]:
    """(bytes, weights) of the GGUF file's 2-D tensors a decode step reads whole: all but the token
    embedding, which counts only when it is also the output head (no `output.weight`)."""
    from gguf import GGUFReader

    tensors = [t for t in GGUFReader(path).tensors if len(t.shape) == 2]
    tied = not any(t.name == "output.weight" for t in tensors)
    read = [t for t in tensors if tied or t.name != "token_embd.weight"]
    return sum(int(t.n_bytes) for t in read), sum(int(t.n_elements) for t in read)


def gguf_quantized_by(path: Path) -> str:
    """Who wrote one of the benchmark's quantized files: the `gguf` package says so, llama.cpp does not."""
    from gguf import GGUFReader, Keys

    field = GGUFReader(path).fields.get(Keys.General.QUANTIZED_BY)
    return field.contents() if field else LLAMA_CPP


def gguf_vocab_size(path: Path) -> int:
    """Rows of the file's token embedding."""
    from gguf import GGUFReader

    return next(int(t.shape[-1]) for t in GGUFReader(path).tensors if t.name == "token_embd.weight")


def ensure_model_folder(name: str, model_dir: Path) -> Path:
    """The random-weight model `name` under `model_dir`, built from a fixed seed when missing or when its
    config.json disagrees with `MODEL_SHAPES`."""
    folder, shape = model_dir / name, MODEL_SHAPES[name]
    if (folder / "model.safetensors").is_file():
        saved = json.loads((folder / "config.json").read_text())
        if all(saved.get(key, value) == value for key, value in shape.items()):
            return folder
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=torch.float32)
    partial = model_dir / f".{name}.partial"  # renamed into place: a killed build never looks complete
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


def matmul_params(folder: Path) -> int:
    """Parameters a decode step multiplies by: all but an untied input embedding (a step reads one row)."""
    from safetensors import safe_open

    tied = json.loads((folder / "config.json").read_text()).get("tie_word_embeddings", False)
    with safe_open(folder / "model.safetensors", "pt") as f:
        names = [name for name in f.keys() if tied or name != "model.embed_tokens.weight"]  # noqa: SIM118
        return sum(math.prod(f.get_slice(name).get_shape()) for name in names)


# HF Llama names -> GGUF (llama.cpp) names; the inverse of Strata's GGUF converter's mapping.
_GGUF_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}  # fmt: skip
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}  # fmt: skip


def gguf_name(name: str) -> str:
    parts = name.split(".")
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    if parts[:2] == ["model", "layers"] and (base := ".".join(parts[3:-1])) in _GGUF_LAYER:
        return f"blk.{int(parts[2])}.{_GGUF_LAYER[base]}.{parts[-1]}"
    raise ValueError(f"tensor {name!r} has no llama.cpp counterpart")


def rope_half_to_interleaved(weight: Any, n_heads: int) -> Any:
    """Q/K rows from HF's rotate_half layout to llama.cpp's adjacent pairs: per head (x0, x1, .., y0, y1, ..)
    become (x0, y0, x1, y1, ..), as llama.cpp's own HF converter permutes them."""
    rows, cols = weight.shape
    return weight.reshape(n_heads, 2, rows // n_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def write_gguf(folder: Path, out_path: Path, fmt: str = "f32") -> None:
    """The folder's weights as an F32 llama GGUF, or with its 2-D weights in `fmt` (from `GGUF_PY_QUANTS`;
    one whose rows do not fill the blocks stays F32), with a placeholder vocabulary ("<t{i}>" pieces, ids
    0/1/2 unknown/BOS/EOS): the prompts are token ids, so no piece is ever looked up."""
    import gguf
    from safetensors.numpy import load_file

    c = LlamaConfig.from_pretrained(folder)
    rope = getattr(c, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{folder}: RoPE scaling {rope.get('rope_type')!r} is not supported")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(out_path, "llama")
    w.add_name(folder.name)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    qtype = gguf.GGMLQuantizationType[fmt.upper()]
    w.add_file_type(
        gguf.LlamaFileType.ALL_F32 if fmt == "f32" else gguf.LlamaFileType[f"MOSTLY_{fmt.upper()}"]
    )
    if fmt != "f32":
        w.add_quantized_by(GGUF_PY)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(c.vocab_size)])
    w.add_token_scores([0.0] * c.vocab_size)
    special = {0: gguf.TokenType.UNKNOWN, 1: gguf.TokenType.CONTROL, 2: gguf.TokenType.CONTROL}
    w.add_token_types([special.get(i, gguf.TokenType.NORMAL) for i in range(c.vocab_size)])
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    rope_heads = {
        "self_attn.q_proj.weight": c.num_attention_heads,
        "self_attn.k_proj.weight": c.num_key_value_heads,
    }
    for name, array in load_file(folder / "model.safetensors").items():
        array = array.astype("float32", copy=False)
        if name.startswith("model.layers.") and (heads := rope_heads.get(name.split(".", 3)[-1])):
            array = rope_half_to_interleaved(array, heads)
        if fmt != "f32" and array.ndim == 2 and array.shape[1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantize_gguf(source: Path, out_path: Path, fmt: str) -> None:
    """`source` quantized to `fmt` by llama.cpp's own quantizer (its choices included: it keeps a tensor
    whose rows do not fill its blocks in another type)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{fmt.upper()}")
    params.nthread = torch.get_num_threads()
    if llama_cpp.llama_model_quantize(bytes(source), bytes(out_path), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp failed to quantize {source} to {fmt}")


def ensure_gguf(folder: Path, fmt: str = "f32") -> Path:
    """The folder's GGUF in `fmt` (f32, or a quantization of the F32 one), written once beside its weights
    (a rebuilt folder drops them with the rest). llama.cpp's quantizer writes a quantization, or where it
    is missing the `gguf` package (`GGUF_PY_QUANTS`)."""
    path, partial = folder / f"model-{fmt}.gguf", folder / f".model-{fmt}.gguf.partial"
    if not path.is_file():
        if fmt == "f32" or (fmt in GGUF_PY_QUANTS and llama_cpp_unavailable()):
            write_gguf(folder, partial, fmt)
        else:
            quantize_gguf(ensure_gguf(folder), partial, fmt)
        partial.rename(path)
    return path


def make_prompts(count: int, vocab_size: int, tag: str, length: int = PROMPT_LEN) -> list[list[int]]:
    """`count` prompts of random ids, the same for every engine and every run with this tag."""
    rng = random.Random(tag)
    return [[rng.randrange(FIRST_PROMPT_ID, vocab_size) for _ in range(length)] for _ in range(count)]


def best_seconds(fn: Callable[[], Any]) -> float:
    """The shortest of five timed calls after an untimed one: neighbours only ever slow a call down."""
    fn()
    return min(timeit.repeat(fn, repeat=5, number=1))


def machine_info() -> dict[str, Any]:
    """CPU, versions and date, and the two limits: memory read bandwidth (`torch.sum` over 512 MB of
    float32) and float32 matmul rate (2048x2048 `torch.mm`), each the best of a few runs."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    cpus = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    with torch.inference_mode():
        data = torch.ones(2**27)
        read_s = best_seconds(data.sum)
        del data
        a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
        mm_s = best_seconds(lambda: torch.mm(a, b))
    return {
        "cpu_model": cpus[0] if cpus else platform.processor(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "memory_read_gb_s": 2**29 / read_s / 1e9,
        "matmul_fp32_gflop_s": 2 * 2048**3 / mm_s / 1e9,
    }


def take_turns(
    runners: dict[str, Generate], batches: list[list[list[int]]], new_tokens: int, common: dict[str, Any]
) -> tuple[list[dict[str, Any]], dict[str, list[list[int]]]]:
    """One row per engine: `common`, the tokens/s of its median run (output tokens; prompt tokens for a
    prefill, whose `common` has a prompt_len) and its ratios to its peers' rows (`peers`).
    After an untimed warm-up on `batches[0]` the engines take turns on the others, the order reversing run
    by run. Also each engine's output of the first timed run."""
    for generate in runners.values():
        generate(batches[0], min(new_tokens, 2))
    runs: dict[str, list[float]] = {name: [] for name in runners}
    # Per run of a multi-process engine: (rank 0's seconds in collectives and messages, forward passes).
    collectives: dict[str, list[tuple[float, int]]] = {name: [] for name in runners}
    first: dict[str, list[list[int]]] = {}
    label = " ".join(f"{k}={v}" for k, v in common.items())
    for repeat, batch in enumerate(batches[1:]):
        for name in list(runners)[:: 1 if repeat % 2 == 0 else -1]:
            stats = getattr(runners[name], "engine_stats", None) if split_parallel(name)[1] else None
            before = stats() if stats else None
            seconds, ids = runners[name](batch, new_tokens)
            if stats and before:
                after = stats()
                collectives[name].append(
                    (
                        after["collective_seconds"] - before["collective_seconds"],
                        after["num_forward_passes"] - before["num_forward_passes"],
                    )
                )
            if len(ids) != len(batch) or {len(i) for i in ids} != {new_tokens}:
                raise RuntimeError(f"{name} returned {[len(i) for i in ids]} tokens, not {new_tokens} each")
            runs[name].append(seconds)
            first.setdefault(name, ids)
            print(f"{label} {name} run {repeat + 1}: {seconds:.3f} s", file=sys.stderr, flush=True)
    key = "prompt_tokens_per_s" if "prompt_len" in common else "tokens_per_s"
    tokens = len(batches[0]) * (len(batches[0][0]) if "prompt_len" in common else new_tokens)
    rows = []
    for name, times in runs.items():
        median = statistics.median(times)
        row = {**common, "engine": name, key: tokens / median, "median_s": median, "runs_s": times}
        if collectives[name]:  # a step's time in collectives, and their share of the run
            spent = sum(seconds for seconds, _ in collectives[name])
            row["collective_ms_per_step"] = 1e3 * spent / sum(steps for _, steps in collectives[name])
            row["collective_share"] = spent / sum(times)
        rows.append(row)
    rate = {row["engine"]: row[key] for row in rows}
    for row in rows:
        for field, peer in peers(row["engine"]).items():
            if peer in rate and row["engine"] != peer:
                row[field] = row[key] / rate[peer]
    return rows, first


def bench_model(model: str, engines: list[str], args: argparse.Namespace, report: dict[str, Any]) -> None:
    """One model's decode rows (into `report["results"]`), prefill rows (`report["prefill"]`), decode rows
    at --context (`report["context"]`), weights and greedy check (`report["models"]`), every engine loaded
    once for all of them. With --gguf-file the model is that file, and only the GGUF engines run, on it."""
    folder = None if args.gguf_file else ensure_model_folder(model, args.model_dir)
    files = {fmt: args.gguf_file or ensure_gguf(folder, fmt) for e in engines if (fmt := gguf_format(e))}
    gguf_reads = {fmt: gguf_step_weights(path) for fmt, path in files.items()}
    if folder is None:
        params, vocab = gguf_reads["f32"][1], gguf_vocab_size(args.gguf_file)
    else:
        params, vocab = matmul_params(folder), MODEL_SHAPES[model]["vocab_size"]
    # (weight bytes, weights) each engine reads in a decode step.
    reads = {
        e: gguf_reads[f] if (f := gguf_format(e)) else (params * bytes_per_weight(e), params) for e in engines
    }
    bandwidth = report["machine"]["memory_read_gb_s"] * 1e9
    max_len = max(PROMPT_LEN + args.new_tokens, args.prefill_len + 1, args.context)
    tokenizer = args.structured is not None
    runners = {
        name: build_engine(name, folder, files, max(args.concurrency), max_len, tokenizer) for name in engines
    }
    greedy_ref: dict[str, str] = {}
    greedy_match: dict[str, bool] = {}
    for c in args.concurrency:
        # Fresh prompts for each run, so that no prefix cache reuses an earlier run's.
        batches = [make_prompts(c, vocab, f"{c}:{run}") for run in range(-1, args.repeats)]
        rows, outputs = take_turns(runners, batches, args.new_tokens, {"model": model, "concurrency": c})
        for row in rows:
            row["sequential"] = row["engine"].startswith(LLAMA_CPP) and c > 1
            if c == 1:  # the share of the bandwidth limit: each step reads every matmul weight once
                row["bw_fraction"] = row["tokens_per_s"] * reads[row["engine"]][0] / bandwidth
        report["results"] += rows
        if c == 1:
            first = {name: ids[0][:GREEDY_CHECK_TOKENS] for name, ids in outputs.items()}
            greedy_ref = greedy_references(engines, folder is not None)
            greedy_match = {name: first[name] == first[ref] for name, ref in greedy_ref.items()}
    if n := args.prefill_len:
        batches = [make_prompts(1, vocab, f"prefill:{run}", n) for run in range(-1, args.repeats)]
        report["prefill"] += take_turns(runners, batches, 1, {"model": model, "prompt_len": n})[0]
    if n := args.context:  # --new-tokens decode steps after the prefill's token, the last at position n - 1
        prompt_len = n - args.new_tokens - 1
        batches = [make_prompts(1, vocab, f"context:{run}", prompt_len) for run in range(-1, args.repeats)]
        decoders = {
            name: generate.decode  # type: ignore[attr-defined]
            for name, generate in runners.items()
            if not name.endswith(STRUCTURED_SUFFIX)  # the constraint is no part of what the row measures
        }
        report["context"] += take_turns(decoders, batches, args.new_tokens, {"model": model, "context": n})[0]
    for generate in runners.values():
        if close := getattr(generate, "close", None):
            close()  # a tensor-parallel engine's processes
    runners.clear()
    gc.collect()
    report["models"][model] = {
        "matmul_params": params,
        "fp32_bandwidth_limit_tok_s": bandwidth / (4 * params),
        "bytes_per_weight": {engine: size / count for engine, (size, count) in reads.items()},
        "greedy_match": greedy_match,
        "greedy_reference": greedy_ref,
        "gguf_quantized_by": {
            fmt: gguf_quantized_by(path) for fmt, path in files.items() if fmt in GGUF_QUANTS
        },
    }


def greedy_references(engines: list[str], float_folder: bool) -> dict[str, str]:
    """The engine whose greedy ids each engine's must match: for one on the hw-agnostic layers, its default;
    for Strata on a GGUF file, llama.cpp on the same file; for the others on the float32 weights (of the
    folder, or its F32 GGUF), transformers or else the first engine. Engines with no peer on the same
    weights are left out."""
    default = BASELINE if BASELINE in engines else engines[0]
    refs = {}
    for name in engines:
        if name.endswith(STRUCTURED_SUFFIX):
            continue  # constrained: its ids differ by design
        peer = peers(name).get("vs_llama_cpp")
        if (own_default := peers(name).get("vs_default")) in engines:
            refs[name] = own_default
        elif name.startswith(STRATA_GGUF) and peer in engines:
            refs[name] = peer
        elif float_folder and gguf_format(name) in (None, "f32") and name != default:
            refs[name] = default
    return refs


# Ratio fields and their table headings.
RATIOS = {
    "vs_transformers": "vs transformers",
    "vs_llama_cpp": "vs llama.cpp",
    "vs_strata_f32": "vs strata f32",
    "vs_unconstrained": "vs unconstrained",
    "vs_one_process": "vs 1 process",
    "vs_default": "vs default",
}


def format_table(report: dict[str, Any]) -> str:
    """The measured limits, one line per row (prefill rows: prompt tokens/s) with the ratios some row has,
    and the greedy checks."""
    rows = report["results"] + report["prefill"] + report["context"]
    ratios = {key: heading for key, heading in RATIOS.items() if any(key in row for row in rows)}

    def cells(r: dict[str, Any]) -> list[str]:
        if "prompt_len" in r:
            run = f"prefill {r['prompt_len']}"
        else:
            run = f"context {r['context']}" if "context" in r else f"c={r['concurrency']}"
        rate = r["prompt_tokens_per_s"] if "prompt_len" in r else r["tokens_per_s"]
        shares = [f"{r[key]:.2f}" if key in r else "-" for key in ratios]
        bw = f"{100 * r['bw_fraction']:.1f}" if "bw_fraction" in r else "-"
        engine = r["engine"] + (" (seq)" if r.get("sequential") else "")
        return [r["model"], run, engine, f"{rate:.1f}", *shares, bw]

    lines = [["model", "run", "engine", "tok/s", *ratios.values(), "bw%"], *map(cells, rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    table = [" | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines]
    table.insert(1, "-+-".join("-" * w for w in widths))
    m = report["machine"]
    out = [f"{m['cpu_model']}, {m['threads']} threads: memory read {m['memory_read_gb_s']:.1f} GB/s, "
           f"fp32 matmul {m['matmul_fp32_gflop_s']:.0f} GFLOP/s", "", *table]  # fmt: skip
    for model, info in report["models"].items():
        refs = info["greedy_reference"]
        if checks := [
            f"{engine} {'match' if ok else 'MISMATCH'} ({refs[engine]})"
            for engine, ok in info["greedy_match"].items()
        ]:
            out.append(f"{model}: greedy ids, first {GREEDY_CHECK_TOKENS} at c=1: {', '.join(checks)}")
    if any(row["sequential"] for row in report["results"]):
        out.append("(seq): the engine generates a batch's prompts one after another")
    out += [
        f"{r['model']} {r['engine']} c={r['concurrency']}: {r['collective_ms_per_step']:.2f} ms of a step in "
        f"collectives ({100 * r['collective_share']:.1f}% of the run)"
        for r in report["results"]
        if "collective_ms_per_step" in r
    ]
    return "\n".join(out)


def _csv(allowed: Sequence[str] | None = None) -> Callable[[str], list[Any]]:
    """An option's comma-separated values: names from `allowed`, or positive integers without it."""

    def parse(text: str) -> list[Any]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        values = items if allowed else [int(item) for item in items if item.isdigit() and int(item) > 0]
        if not items or len(values) != len(items) or set(values) - set(allowed or values):
            expected = f"names from {', '.join(allowed)}" if allowed else "positive integers"
            raise argparse.ArgumentTypeError(f"expected {expected} separated by commas, got {text!r}")
        return values

    return parse


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    names = "comma-separated, from {} (default: %(default)s)".format
    add(
        "--models",
        type=_csv(list(MODEL_SHAPES)),
        default="smollm-135m,stories15m",
        help=names(", ".join(MODEL_SHAPES)),
    )
    add(
        "--engines",
        type=_csv([*ENGINE_NAMES, *ENGINE_ALIASES]),
        default=None,
        help=f"comma-separated, from {', '.join(ENGINE_NAMES)} (default: {DEFAULT_ENGINES}; with --gguf-file: "
        f"{GGUF_FILE_ENGINES})",
    )
    add("--concurrency", type=_csv(), default="1,8,32", help="prompts per batch (default: %(default)s)")
    add("--new-tokens", type=int, default=128, help="tokens generated per prompt (default: 128)")
    add("--prefill-len", type=int, default=512, help="prefill prompt length; 0: off (default: 512)")
    add(
        "--context",
        type=int,
        default=0,
        help="also time --new-tokens decode steps at batch 1 after a prompt filling this many positions with "
        "them; 0: off (default: 0)",
    )
    add("--repeats", type=int, default=3, help="timed runs per engine, the median reported (default: 3)")
    add("--threads", type=int, default=None, help="torch.set_num_threads(N) (default: torch's own)")
    add("--model-dir", type=Path, default=REPO_ROOT / "bench_models", help="default: bench_models/")
    add(
        "--gguf-file",
        type=Path,
        default=None,
        help="benchmark this GGUF file (not --models): strata-gguf and llama.cpp on it",
    )
    add(
        "--structured",
        choices=["json"],
        default=None,
        help="also run each Strata engine with its requests constrained to a JSON schema (needs --gguf-file)",
    )
    add(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="also run each Strata engine E on the folder as E-tpN, sharded over N processes (default: 1)",
    )
    add(
        "--pipeline-parallel-size",
        type=int,
        default=1,
        help="also run each Strata engine E on the folder as E-ppN, its layers over N stages (default: 1)",
    )
    add("--json-out", type=Path, default=None, help="also write the JSON report to this file")
    args = p.parse_args(argv)
    default = GGUF_FILE_ENGINES if args.gguf_file else DEFAULT_ENGINES
    args.engines = list(dict.fromkeys(ENGINE_ALIASES.get(e, e) for e in args.engines or default.split(",")))
    if args.structured and not args.gguf_file:
        p.error("--structured needs --gguf-file: the constrained requests need the file's tokenizer")
    if args.structured:
        strata = [e for e in args.engines if e.startswith("strata")]
        args.engines += [e + STRUCTURED_SUFFIX for e in strata]
    on_folder = [e for e in args.engines if split_hw_agnostic(e)[0] in STRATA_VARIANTS]
    for suffix, size in (("-tp", args.tensor_parallel_size), ("-pp", args.pipeline_parallel_size)):
        if size > 1:
            args.engines += [f"{e}{suffix}{size}" for e in on_folder]
    if len(multi := [e for e in args.engines if split_parallel(e)[1]]) > 1:
        p.error(f"one process holds one multi-process engine, not {', '.join(multi)}: run one Strata engine "
                "and one of --tensor-parallel-size and --pipeline-parallel-size at a time")  # fmt: skip
    if args.gguf_file and not args.gguf_file.is_file():
        p.error(f"--gguf-file {args.gguf_file}: no such file")
    if args.gguf_file and (others := [e for e in args.engines if gguf_format(e) != "f32"]):
        p.error(f"--gguf-file runs only {', '.join(ON_GGUF_FILE)} on the file, not {', '.join(others)}")
    if min(args.new_tokens, args.repeats, args.threads or 1) < 1 or min(args.prefill_len, args.context) < 0:
        p.error(
            "--new-tokens, --repeats and --threads must be at least 1, --prefill-len, --context at least 0"
        )
    if args.context and args.context < args.new_tokens + 2:
        p.error(f"--context {args.context} leaves no prompt before the prefill's token and the decode steps")
    if not args.gguf_file and any(
        max(args.prefill_len + 1, args.context) > MODEL_SHAPES[m]["max_position_embeddings"]
        for m in args.models
    ):
        p.error("--prefill-len plus a token, or --context, exceeds a model's max_position_embeddings")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engines, skipped = list(args.engines), {}
    # llama.cpp runs its engines and writes the quantized files (the `gguf` package some, without it).
    needs_llama_cpp = [
        e
        for e in engines
        if e.startswith(LLAMA_CPP) or gguf_format(e) in set(GGUF_QUANTS) - set(GGUF_PY_QUANTS)
    ]
    if needs_llama_cpp and (reason := llama_cpp_unavailable()):
        for name in needs_llama_cpp:
            engines.remove(name)
            skipped[name] = reason
        print(f"note: skipping {', '.join(needs_llama_cpp)}: {reason}", file=sys.stderr, flush=True)
    if not engines:
        print("error: no engine left to run", file=sys.stderr)
        return 2
    settings = {
        key: getattr(args, key)
        for key in ("concurrency", "new_tokens", "prefill_len", "context", "repeats", "structured")
    }
    settings["gguf_file"] = args.gguf_file and str(args.gguf_file)
    report: dict[str, Any] = {
        "machine": machine_info(),
        "settings": {**settings, "prompt_len": PROMPT_LEN, "engines": engines, "skipped_engines": skipped},
        "models": {},
        "results": [],
        "prefill": [],
        "context": [],
    }
    for model in [args.gguf_file.stem] if args.gguf_file else args.models:
        bench_model(model, engines, args, report)
    text = json.dumps(report, indent=2)
    if args.json_out is not None:
        args.json_out.write_text(text + "\n")
    print(f"{text}\n\n{format_table(report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
