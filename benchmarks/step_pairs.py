"""Batch-1 decode, step by step: the engines' decode steps alternated one at a time in one process.

`throughput.py` alternates whole runs; on a shared machine the load moves between two runs about as much as
the engines differ (its per-pair ratios to llama.cpp spread from 0.77x to 0.92x in one run). Here step i of
every engine runs back to back, the order rotating every step, so all of them meet the same neighbours
within milliseconds (torch and llama.cpp's ggml also share one OpenMP thread pool: both load the one
`libgomp`). Each engine decodes one sequence greedily from the same prompt; per engine the report has the
median step time and tokens per second, and against the baseline (the first engine listed) the ratio of
the median steps and the share of steps in which the engine was the faster of the two.

    python benchmarks/step_pairs.py --model smollm-135m --engines llama.cpp,strata-compiled,transformers

Engines: Strata's variants of `throughput.py` (`STRATA_VARIANTS`: one `LLMEngine.step` a token),
`transformers` (its forward on one new token with a `DynamicCache`, then the argmax) and `llama.cpp`
(llama-cpp-python's token generator on the F32 GGUF; skipped with a note when it does not import). A step
starts once the prompt is in the cache: prefill and the first token are outside the timings. Models,
prompts and GGUF come from `throughput.py`, so both scripts measure the same weights.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import throughput
import torch
from throughput import BASELINE, LLAMA_CPP, PROMPT_LEN, STRATA_VARIANTS, Limits

ENGINE_NAMES = (*STRATA_VARIANTS, BASELINE, LLAMA_CPP)


class Stepper(Protocol):
    """One engine decoding one sequence: `start` puts the prompt in the cache and returns the first token
    (untimed), each `step` decodes one more and returns it."""

    def start(self, prompt: list[int], new_tokens: int) -> int: ...

    def step(self) -> int: ...


class StrataStepper:
    def __init__(self, folder: Path, limits: Limits, variant: dict[str, Any]) -> None:
        self.engine = throughput.strata_llm(folder, limits, **variant).engine

    def start(self, prompt: list[int], new_tokens: int) -> int:
        from strata import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        # Final-only, as `LLM.generate` adds requests: its steps build no output objects.
        self.sequence = self.engine.add_request(
            {"prompt_token_ids": prompt}, params, final_output_only=True
        ).seqs[0]
        return self.step()

    def step(self) -> int:
        self.engine.step()
        return self.sequence.token_ids[-1]


class TransformersStepper:
    def __init__(self, folder: Path) -> None:
        self.model = throughput.transformers_model(folder)
        # transformers 5.25 renamed the forward's `past_key_values` to `cache` (the old name warns).
        parameters = inspect.signature(self.model.forward).parameters
        self.cache_argument = "cache" if "cache" in parameters else "past_key_values"

    def _forward(self, ids: list[int]) -> int:
        with torch.inference_mode():
            inputs = {"input_ids": torch.tensor([ids]), self.cache_argument: self.cache}
            out = self.model(**inputs, use_cache=True)
        self.token = int(out.logits[0, -1].argmax())
        return self.token

    def start(self, prompt: list[int], new_tokens: int) -> int:
        from transformers import DynamicCache

        self.cache = DynamicCache()
        return self._forward(prompt)

    def step(self) -> int:
        return self._forward([self.token])


class LlamaCppStepper:
    def __init__(self, folder: Path, limits: Limits) -> None:
        self.llm = throughput.llama_cpp_model(folder, limits)
        self.stream: Any = None

    def start(self, prompt: list[int], new_tokens: int) -> int:
        if self.stream is not None:
            self.stream.close()
        self.stream = throughput.llama_cpp_greedy(self.llm, prompt)
        return self.step()

    def step(self) -> int:
        return int(next(self.stream))


def build_stepper(name: str, folder: Path, limits: Limits) -> Stepper:
    if name in STRATA_VARIANTS:
        return StrataStepper(folder, limits, STRATA_VARIANTS[name])
    if name == BASELINE:
        return TransformersStepper(folder)
    return LlamaCppStepper(folder, limits)


def run_pairs(
    steppers: dict[str, Stepper], prompt: list[int], new_tokens: int, repeats: int
) -> tuple[dict[str, list[float]], dict[str, list[list[int]]]]:
    """Per engine, the seconds of every decode step and each run's tokens. Every run starts all engines
    afresh on the prompt, then takes `new_tokens - 1` rounds of one step each, the order rotating by one
    engine every round."""
    names = list(steppers)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    tokens: dict[str, list[list[int]]] = {name: [] for name in names}
    for _ in range(repeats):
        for name in names:
            tokens[name].append([steppers[name].start(prompt, new_tokens)])
        for round_index in range(new_tokens - 1):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                start = time.perf_counter()
                token = steppers[name].step()
                seconds[name].append(time.perf_counter() - start)
                tokens[name][-1].append(token)
    return seconds, tokens


def summarize(seconds: dict[str, list[float]], tokens: dict[str, list[list[int]]]) -> dict[str, Any]:
    """Rows per engine and ratios of every other engine to the first (`baseline`)."""
    names = list(seconds)
    baseline = names[0]
    rows = [
        {
            "engine": name,
            "steps": len(times),
            "median_step_ms": statistics.median(times) * 1e3,
            "tokens_per_s": 1 / statistics.median(times),
            "steps_ms": [t * 1e3 for t in times],
            "first_run_tokens": tokens[name][0],
        }
        for name, times in seconds.items()
    ]
    ratios = [
        {
            "engine": name,
            "baseline": baseline,
            # > 1: the engine's median step is shorter than the baseline's.
            "speed_ratio": statistics.median(seconds[baseline]) / statistics.median(seconds[name]),
            "faster_share": sum(a < b for a, b in zip(seconds[name], seconds[baseline], strict=True))
            / len(seconds[name]),
            "greedy_match": tokens[name] == tokens[baseline],
        }
        for name in names[1:]
    ]
    return {"results": rows, "ratios": ratios}


def format_table(report: dict[str, Any]) -> str:
    baseline = report["settings"]["engines"][0]
    ratio = {r["engine"]: r for r in report["ratios"]}
    header = ["engine", "step ms", "tok/s", f"vs {baseline}", "faster in", "same tokens"]
    lines = [
        [
            row["engine"],
            f"{row['median_step_ms']:.3f}",
            f"{row['tokens_per_s']:.1f}",
            f"{r['speed_ratio']:.3f}" if (r := ratio.get(row["engine"])) else "-",
            f"{r['faster_share']:.0%}" if r else "-",
            ("yes" if r["greedy_match"] else "no") if r else "-",
        ]
        for row in report["results"]
    ]
    widths = [max(len(cells[i]) for cells in [header, *lines]) for i in range(len(header))]
    rendered = [
        " | ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True))
        for cells in [header, *lines]
    ]
    rendered.insert(1, "-+-".join("-" * width for width in widths))
    return "\n".join(line.rstrip() for line in rendered)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=list(throughput.MODEL_SHAPES), default="smollm-135m")
    parser.add_argument(
        "--engines",
        type=lambda text: throughput._name_list(text, list(ENGINE_NAMES)),
        default=[LLAMA_CPP, "strata-compiled"],
        help=f"comma-separated, the first is the baseline; from {', '.join(ENGINE_NAMES)} "
        f"(default: {LLAMA_CPP},strata-compiled)",
    )
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per run, the first untimed")
    parser.add_argument("--repeats", type=int, default=3, help="runs, each from a fresh prompt cache")
    throughput.add_run_options(parser)
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        parser.error(f"--new-tokens must be at least 2 (the first token is untimed), got {args.new_tokens}")
    throughput.require_at_least_one(parser, args, ("repeats", "threads"))
    if len(set(args.engines)) != len(args.engines) or len(args.engines) < 2:
        parser.error("--engines needs at least two different engines")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("STRATA_PLUGINS", "")  # installed plugins would swap Strata's layers
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    engines = list(args.engines)
    skipped: dict[str, str] = {}
    if LLAMA_CPP in engines and (reason := throughput.llama_cpp_unavailable()) is not None:
        engines.remove(LLAMA_CPP)
        skipped[LLAMA_CPP] = reason
        print(f"note: skipping {LLAMA_CPP}: {reason}", file=sys.stderr, flush=True)
    if len(engines) < 2:
        print("error: fewer than two engines left to compare", file=sys.stderr)
        return 2
    folder = throughput.ensure_model_folder(args.model, args.model_dir)
    (prompt,) = throughput.make_prompts(1, throughput.MODEL_SHAPES[args.model]["vocab_size"], "steps")
    limits = Limits(max_batch=1, max_len=PROMPT_LEN + args.new_tokens + 1)
    steppers = {name: build_stepper(name, folder, limits) for name in engines}
    seconds, tokens = run_pairs(steppers, prompt, args.new_tokens, args.repeats)
    report = {
        "machine": throughput.machine_info(),
        "settings": {
            "model": args.model,
            "engines": engines,
            "skipped_engines": skipped,
            "prompt_len": PROMPT_LEN,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
        },
        **summarize(seconds, tokens),
    }
    throughput.print_report(report, format_table(report), args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
