"""Offline generation throughput: Strata against transformers' `generate`, on the same weights, in one run.

The models are random-weight Llama folders built here from fixed seeds, so the benchmark needs no downloads
and every machine measures the same weights. For each concurrency C, C prompts of random token ids are
generated greedily to a fixed length (EOS ignored) by every engine; engines take turns run by run so drift in
machine load hits them alike, and the median of the runs is reported as output tokens per second.

An engine is an entry in `ENGINES`: a factory that loads a model folder once and returns a `Generate`
function timing only the generation itself. Peers (llama.cpp) and variants (compiled, other layers) are
added as more entries; `--engines strata,strata-hw-agnostic,strata-example-plugin,transformers` compares
Strata's default layers, its hw-agnostic layers and the example plugin's override in one run;
`--engines strata,strata-compiled` compares eager and compiled decode.

    python benchmarks/throughput.py --models smollm-135m --concurrency 1,8,32 --json-out /tmp/throughput.json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import random
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
BASELINE = "transformers"
BUILD_SEED = 0
PROMPT_LEN = 32
WARMUP_TOKENS = 2
# Greedy outputs of the engines must agree this far; random weights can have near-ties further on.
GREEDY_CHECK_TOKENS = 8
# Prompt ids start above the usual pad/bos/eos ids (0, 1, 2) so no prompt token is special.
FIRST_PROMPT_ID = 3

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
        "max_position_embeddings": 256,
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


def strata_engine(
    folder: Path,
    limits: Limits,
    layer_impl: str = "default",
    compile: bool = False,
    compile_mode: str = "model",
) -> Generate:
    """Strata's offline `LLM` with its default scheduler and cache settings, the cache sized to the workload.

    With `compile` the forward is compiled when the engine is built (a one-token warm-up), so timed runs
    measure compiled decode, not compilation."""
    from strata import LLM, SamplingParams

    # Without max_model_len/max_num_seqs the default cache would take a quarter of free memory.
    llm = LLM(
        model=str(folder),
        dtype="float32",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=limits.max_len,
        max_num_seqs=limits.max_batch,
        layer_impl=layer_impl,
        compile=compile,
        compilation_config={"mode": compile_mode},
    )
    if compile:
        llm.generate({"prompt_token_ids": [FIRST_PROMPT_ID]}, SamplingParams(max_tokens=1), use_tqdm=False)

    def generate(prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        batch = [{"prompt_token_ids": prompt} for prompt in prompts]
        start = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return seconds, [list(output.outputs[0].token_ids) for output in outputs]

    return generate


def transformers_engine(folder: Path, limits: Limits) -> Generate:
    """transformers' own `generate` with SDPA attention: what a user of the library gets out of the box."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()

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


ENGINES: dict[str, EngineFactory] = {
    "strata": strata_engine,
    BASELINE: transformers_engine,
    "strata-hw-agnostic": functools.partial(strata_engine, layer_impl="hw-agnostic"),
    "strata-compiled": functools.partial(strata_engine, compile=True),
    "strata-compiled-layer": functools.partial(strata_engine, compile=True, compile_mode="layer"),
    "strata-example-plugin": strata_example_plugin_engine,
}
DEFAULT_ENGINES = ("strata", BASELINE)


def ensure_model_folder(name: str, model_dir: Path) -> Path:
    """The saved random-weight model `name` under `model_dir`, built from a fixed seed when missing."""
    folder = model_dir / name
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    config = LlamaConfig(**MODEL_SHAPES[name])
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


def make_prompts(count: int, vocab_size: int, tag: str) -> list[list[int]]:
    """`count` prompts of PROMPT_LEN random ids, the same for every engine and every run with this tag."""
    rng = random.Random(tag)
    return [[rng.randrange(FIRST_PROMPT_ID, vocab_size) for _ in range(PROMPT_LEN)] for _ in range(count)]


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


def bench_model(
    model: str,
    folder: Path,
    engines: Sequence[str],
    concurrencies: Sequence[int],
    new_tokens: int,
    repeats: int,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Result rows and ratio rows of one model, every engine loaded once and reused for every concurrency."""
    limits = Limits(max_batch=max(concurrencies), max_len=PROMPT_LEN + new_tokens)
    runners = {name: ENGINES[name](folder, limits) for name in engines}
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
            results.append(
                {
                    "model": model,
                    "concurrency": concurrency,
                    "engine": name,
                    "tokens_per_s": concurrency * new_tokens / median,
                    "median_s": median,
                    "runs_s": runs[name],
                }
            )
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
    return results, ratios


def format_table(report: dict[str, Any]) -> str:
    """One line per (model, concurrency): tokens/s of every engine, then each engine's ratio to the baseline."""
    engines = report["settings"]["engines"]
    compared = [name for name in engines if name != BASELINE] if BASELINE in engines else []
    ratio_headers = ["ratio"] if len(compared) == 1 else [f"{name}/{BASELINE}" for name in compared]
    header = ["model", "concurrency", *(f"{name} tok/s" for name in engines), *ratio_headers]
    tok_s = {(r["model"], r["concurrency"], r["engine"]): r["tokens_per_s"] for r in report["results"]}
    ratio = {(r["model"], r["concurrency"], r["engine"]): r["ratio"] for r in report["ratios"]}
    keys = list(dict.fromkeys((r["model"], r["concurrency"]) for r in report["results"]))
    lines = [
        [
            model,
            str(concurrency),
            *(f"{tok_s[model, concurrency, name]:.1f}" for name in engines),
            *(f"{ratio[model, concurrency, name]:.2f}" for name in compared),
        ]
        for model, concurrency in keys
    ]
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
    rendered = [
        " | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        for row in [header, *lines]
    ]
    rendered.insert(1, "-+-".join("-" * width for width in widths))
    checks = [
        f"{r['model']}: {'match' if r['greedy_match'] else 'MISMATCH'}"
        for r in report["ratios"]
        if "greedy_match" in r
    ]
    if checks:
        rendered.append(
            f"greedy ids, first {GREEDY_CHECK_TOKENS} tokens at concurrency 1: " + ", ".join(checks)
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
        help=f"comma-separated, from {', '.join(ENGINES)} (default: {','.join(DEFAULT_ENGINES)})",
    )
    parser.add_argument(
        "--concurrency", type=_int_list, default=[1, 8, 32], help="prompts per batch (default: 1,8,32)"
    )
    parser.add_argument(
        "--new-tokens", type=int, default=128, help="tokens generated per prompt (default: 128)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per engine; the median is reported"
    )
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
    args = parser.parse_args(argv)
    for option in ("new_tokens", "repeats", "threads"):
        value = getattr(args, option)
        if value is not None and value < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1, got {value}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # Installed plugins would swap the layers of every Strata engine; the plugin variant registers its own.
    os.environ.setdefault("STRATA_PLUGINS", "")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    report: dict[str, Any] = {
        "machine": machine_info(),
        "settings": {
            "engines": args.engines,
            "prompt_len": PROMPT_LEN,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "dtype": "float32",
        },
        "results": [],
        "ratios": [],
    }
    for model in args.models:
        folder = ensure_model_folder(model, args.model_dir)
        results, ratios = bench_model(
            model, folder, args.engines, args.concurrency, args.new_tokens, args.repeats
        )
        report["results"].extend(results)
        report["ratios"].extend(ratios)
    report["machine"]["load_average_end"] = list(os.getloadavg())
    text = json.dumps(report, indent=2)
    print(text)
    print()
    print(format_table(report))
    if args.json_out is not None:
        args.json_out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
