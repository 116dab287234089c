"""How far lower-precision weights move greedy decoding from float32: top-1 agreement over N tokens.

Float32 generates N tokens greedily from a prompt; each variant (bfloat16 weights, int8 weight-only, float32
packed at "high" precision: bf16x3 on AMX CPUs, which batch-1 decode does not read) then
reads prompt + those tokens as its prompt (teacher forcing) and, at every position, we check whether the
float32 token is its own top-1 choice, and how far that token's logprob moved; once with the whole sequence
in one step (`prefill`) and once one token per step (`decode`, the path of batch-1 generation; the int8
layer uses different kernels for the two). Comparing two free-running
generations instead would only measure where they first part: after one different token the contexts
differ and later disagreement means nothing. Uses the same random-weight folders as `throughput.py`.

    python benchmarks/quantization.py --models smollm-135m --tokens 256
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

# Run as a script, its own folder is on sys.path.
from throughput import MODEL_SHAPES, PROMPT_LEN, REPO_ROOT, ensure_model_folder, make_prompts

# name -> LLM keyword arguments of each variant compared with float32; "fp32" itself is the control: its
# prefill path differs from its decode path only by float32 rounding, the floor of any comparison here.
VARIANTS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "fp32-high": {"fp32_matmul_precision": "high"},  # bf16x3 on AMX CPUs, from 4 rows: prefill only here
}


# How each variant reads float32's tokens: all at once (prefill matmuls), or one per step, as batch-1
# generation does (the int8 layer's small-batch kernel); the two paths round differently.
PATHS: dict[str, dict[str, Any]] = {"decode": {"max_num_batched_tokens": 1}, "prefill": {}}


def agreement(folder: Path, prompt: list[int], tokens: int, variants: Sequence[str]) -> dict[str, Any]:
    """Float32's greedy tokens, and for each variant and path the top-1 agreement and logprob differences."""
    from strata import LLM, SamplingParams

    def engine(**kwargs: Any) -> LLM:
        length = len(prompt) + tokens + 1
        return LLM(str(folder), skip_tokenizer_init=True, max_model_len=length, max_num_seqs=1, **kwargs)

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=1)
    out = engine().generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    reference = list(out.token_ids)
    ref_logprobs = [step[t].logprob for step, t in zip(out.logprobs, reference, strict=True)]
    report: dict[str, Any] = {"tokens": tokens, "variants": {}}
    forced = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    for name in variants:
        for path, path_kwargs in PATHS.items():
            llm = engine(**VARIANTS[name], **path_kwargs)
            result = llm.generate({"prompt_token_ids": prompt + reference}, forced, use_tqdm=False)[0]
            positions = result.prompt_logprobs[len(prompt) :]
            ranks = [step[t].rank for step, t in zip(positions, reference, strict=True)]
            diffs = [
                abs(step[t].logprob - lp)
                for step, t, lp in zip(positions, reference, ref_logprobs, strict=True)
            ]
            report["variants"][f"{name}/{path}"] = {
                "top1_agreement": sum(rank == 1 for rank in ranks) / tokens,
                "first_disagreement": next((i for i, rank in enumerate(ranks) if rank != 1), None),
                "max_logprob_diff": max(diffs),
                "mean_logprob_diff": sum(diffs) / tokens,
            }
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models", default="smollm-135m", help=f"comma-separated, from {', '.join(MODEL_SHAPES)}"
    )
    parser.add_argument("--tokens", type=int, default=256, help="greedy tokens compared (default: 256)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"from {', '.join(VARIANTS)}")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(N)")
    parser.add_argument("--model-dir", type=Path, default=REPO_ROOT / "bench_models")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS] + [
        m for m in args.models.split(",") if m not in MODEL_SHAPES
    ]
    if unknown or args.tokens < 1:
        parser.error(f"unknown names {unknown} or --tokens {args.tokens} below 1")
    os.environ.setdefault("STRATA_PLUGINS", "")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    reports = {}
    for model in args.models.split(","):
        folder = ensure_model_folder(model, args.model_dir)
        prompt = make_prompts(1, MODEL_SHAPES[model]["vocab_size"], "agreement")[0]
        reports[model] = {"prompt_len": PROMPT_LEN, **agreement(folder, prompt, args.tokens, variants)}
    print(json.dumps(reports, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
