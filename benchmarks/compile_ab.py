"""Two compilations of one engine, A and B, their steps alternated over the same weights, cache and requests.

Two engines built in one process do not run alike even when configured alike: their weights' copies land
in different memory, and at batch 1 the engine built second measured 2-6% faster than the first in every
pair of runs (SmolLM-135M, Zen 4 VM, 2 threads; 10-15% on the big layers' GEMMs alone). An A/B of two
engines then measures where they were built as much as what differs. Here the engine is built once, with
B's compilation settings, and a second `CompiledForward` with A's is traced over the same model; the
engine's steps then alternate between the two forwards, the order within each pair rotating, so both
read the same weights, write the same KV cache and serve the same sequences. What can differ is what a
`compilation_config` sets: Inductor options, fusion passes, guard evaluation (mode "model" only: mode
"layer" rebinds the layers' forwards, so two of them cannot share a model).

    python benchmarks/compile_ab.py --model smollm-135m --concurrency 32 \\
        --a '{"inductor_compile_config": {"cpp.threads": 1}}' --b '{}'

Each repeat adds `--concurrency` fresh prompts and decodes `--new-tokens` from each; the first step of a
repeat (the prefill) is untimed and goes to A and B in turn. Before the timed steps one prompt is decoded
greedily by each forward alone, to check that both give the same tokens. The report has per forward the
median step, and the ratio of A's median to B's (> 1: B is faster) with the share of pairs B won.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import throughput
import torch
from throughput import GREEDY_CHECK_TOKENS, PROMPT_LEN

VARIANTS = ("A", "B")


def compilation_overrides(text: str) -> dict[str, Any]:
    """A variant's `compilation_config` fields as JSON; `mode` may only be "model" (see the module doc)."""
    try:
        overrides = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(overrides, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object of compilation_config fields, got {text}")
    from strata.config import CompilationConfig

    allowed = {field.name for field in dataclasses.fields(CompilationConfig)}
    if unknown := sorted(set(overrides) - allowed):
        raise argparse.ArgumentTypeError(
            f"unknown compilation_config fields {unknown}; allowed: {sorted(allowed)}"
        )
    if overrides.get("mode", "model") != "model":
        raise argparse.ArgumentTypeError("only mode 'model' can share a model with a second compilation")
    return overrides


class TwoForwards:
    """One engine and two compiled forwards over its model: `use(name)` makes the engine's steps run one."""

    def __init__(self, folder: Path, limits: throughput.Limits, a: dict[str, Any], b: dict[str, Any]) -> None:
        from strata import LLM
        from strata.compilation.compiler import CompiledForward

        self.llm = LLM(
            model=str(folder),
            seed=0,
            skip_tokenizer_init=True,
            max_model_len=limits.max_len,
            max_num_seqs=limits.max_batch,
            compile=True,
            adaptive_threads=False,  # a thread-count probe would slow whichever forward ran its steps
            compilation_config={**b, "mode": "model"},
        )
        self.engine = self.llm.engine
        runner = self.engine.runner
        config = self.engine.config
        compilation_a = dataclasses.replace(config.compilation_config, **a)
        self.forwards = {
            "A": CompiledForward(runner.model, dataclasses.replace(config, compilation_config=compilation_a)),
            "B": runner.compiled,
        }

    def use(self, name: str) -> None:
        self.engine.runner.compiled = self.forwards[name]

    def greedy(self, name: str, prompt: list[int], new_tokens: int) -> list[int]:
        """`new_tokens` greedy tokens of `prompt` by forward `name` alone (untimed; traces it if new)."""
        from strata import SamplingParams

        self.use(name)
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        (output,) = self.llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        return list(output.outputs[0].token_ids)


def run_pairs(
    forwards: TwoForwards, prompts: list[list[list[int]]], new_tokens: int
) -> dict[str, list[float]]:
    """Seconds of every timed step per forward. Each repeat's prompts decode together; its first step (the
    prefill) is untimed; then steps alternate A/B, the order within a pair rotating."""
    from strata import SamplingParams

    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    engine = forwards.engine
    for repeat, batch in enumerate(prompts):
        for prompt in batch:
            engine.add_request({"prompt_token_ids": prompt}, params, final_output_only=True)
        forwards.use(VARIANTS[repeat % 2])
        engine.step()
        pair = 0
        while engine.has_unfinished_requests():
            for name in VARIANTS if pair % 2 == 0 else VARIANTS[::-1]:
                if not engine.has_unfinished_requests():
                    break
                forwards.use(name)
                start = time.perf_counter()
                engine.step()
                seconds[name].append(time.perf_counter() - start)
            pair += 1
    return seconds


def summarize(seconds: dict[str, list[float]]) -> dict[str, Any]:
    """Per forward its median step; A's median over B's, and the share of pairs in which B was faster."""
    pairs = list(zip(seconds["A"], seconds["B"], strict=False))
    return {
        "results": [
            {
                "variant": name,
                "steps": len(times),
                "median_step_ms": statistics.median(times) * 1e3,
                "steps_ms": [t * 1e3 for t in times],
            }
            for name, times in seconds.items()
        ],
        # > 1: B's median step is shorter than A's.
        "a_over_b": statistics.median(seconds["A"]) / statistics.median(seconds["B"]),
        "b_faster_share": sum(b < a for a, b in pairs) / len(pairs),
    }


def format_table(report: dict[str, Any]) -> str:
    header = ["variant", "compilation_config", "step ms", "A / B", "B faster in", "same tokens"]
    settings = report["settings"]
    lines = [
        [
            row["variant"],
            json.dumps(settings[row["variant"].lower()]),
            f"{row['median_step_ms']:.3f}",
            f"{report['a_over_b']:.3f}" if row["variant"] == "B" else "-",
            f"{report['b_faster_share']:.0%}" if row["variant"] == "B" else "-",
            ("yes" if report["greedy_match"] else "no") if row["variant"] == "B" else "-",
        ]
        for row in report["results"]
    ]
    return "\n".join(throughput._render(header, lines))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=list(throughput.MODEL_SHAPES), default="smollm-135m")
    parser.add_argument(
        "--a", type=compilation_overrides, required=True, help="A's compilation_config fields (JSON)"
    )
    parser.add_argument(
        "--b", type=compilation_overrides, default={}, help="B's compilation_config fields (JSON; default {})"
    )
    parser.add_argument("--concurrency", type=int, default=1, help="requests decoded together")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per request")
    parser.add_argument("--repeats", type=int, default=2, help="batches of fresh prompts")
    throughput.add_run_options(parser)
    args = parser.parse_args(argv)
    if args.new_tokens < 3:
        parser.error(f"--new-tokens must be at least 3 (the first step is untimed), got {args.new_tokens}")
    throughput.require_at_least_one(parser, args, ("concurrency", "repeats", "threads"))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    from strata.config import CompilationConfig, ConfigError

    args = parse_args(argv)
    for flag, overrides in (("--a", args.a), ("--b", args.b)):
        try:
            CompilationConfig(**overrides)
        except ConfigError as exc:
            print(f"error: {flag}: {exc}", file=sys.stderr)
            return 2
    os.environ.setdefault("STRATA_PLUGINS", "")  # installed plugins would swap Strata's layers
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    folder = throughput.ensure_model_folder(args.model, args.model_dir)
    limits = throughput.Limits(max_batch=args.concurrency, max_len=PROMPT_LEN + args.new_tokens)
    forwards = TwoForwards(folder, limits, args.a, args.b)
    vocab_size = throughput.MODEL_SHAPES[args.model]["vocab_size"]
    (check,) = throughput.make_prompts(1, vocab_size, "compile_ab:check")
    tokens = {name: forwards.greedy(name, check, GREEDY_CHECK_TOKENS) for name in VARIANTS}
    prompts = [
        throughput.make_prompts(args.concurrency, vocab_size, f"compile_ab:{repeat}")
        for repeat in range(args.repeats)
    ]
    seconds = run_pairs(forwards, prompts, args.new_tokens)
    report = {
        "machine": throughput.machine_info(),
        "settings": {
            "model": args.model,
            "a": args.a,
            "b": args.b,
            "concurrency": args.concurrency,
            "prompt_len": PROMPT_LEN,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "threads": torch.get_num_threads(),
        },
        **summarize(seconds),
        "greedy_match": tokens["A"] == tokens["B"],
    }
    throughput.print_report(report, format_table(report), args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
