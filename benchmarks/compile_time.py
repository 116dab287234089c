"""Cold and warm compile time of Strata's piecewise `torch.compile` against model depth, in one run.

Random-weight Llama folders with SmolLM-135M's widths and 2, 8, 32, 64 layers are built here (no
downloads). Every measurement runs in a fresh subprocess: "cold" with an empty Strata cache and an empty
Inductor cache (so C++ kernels really compile), "warm" a second start on the caches the cold run left.
For each depth, compile mode ("model": the whole forward traced; "layer": one decoder layer traced and
reused) and `LayerName` on/off it reports the cold compile wall time (process start to first token, minus
the eager engine's), Dynamo graphs, pieces, distinct pieces, Inductor compilations, and the warm start
next to the eager start, both from process start (interpreter and imports included, as a user waits for
them) to the first token (medians of three starts), with their ratio. Prints a table and JSON.

    python benchmarks/compile_time.py --depths 2,8,32,64 --json-out /tmp/compile_time.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

SMOLLM_WIDTHS: dict[str, Any] = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
}


def build_model(depth: int, model_dir: Path) -> Path:
    folder = model_dir / f"llama-smollm-widths-{depth}l"
    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM_WIDTHS, num_hidden_layers=depth))
        model.save_pretrained(folder)
    return folder


def worker(folder: str, setting: dict[str, Any]) -> dict[str, Any]:
    """One engine start in this process: seconds from the process's start to the first token, and the
    compile statistics."""
    from strata import LLM, SamplingParams

    torch.set_num_threads(int(os.environ.get("STRATA_NUM_THREADS", "1")))
    compile_config = {"mode": setting.get("mode", "model"), "use_layer_name": setting.get("layer_name", True)}
    llm = LLM(
        folder,
        skip_tokenizer_init=True,
        max_model_len=256,
        max_num_seqs=4,
        compile=setting["compile"],
        compilation_config=compile_config,
    )
    llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=2), use_tqdm=False)
    result: dict[str, Any] = {"start_s": time.time() - setting["spawned"]}
    compiled = llm.engine.runner.compiled
    if compiled is not None:
        stats = compiled.stats
        result |= {
            "dynamo_graphs": stats.dynamo_graphs,
            "pieces": stats.pieces,
            "distinct_pieces": stats.distinct_pieces,
            "inductor_compilations": stats.compiled,
            "loaded": stats.loaded,
        }
    return result


def run_worker(
    folder: Path, setting: dict[str, Any], strata_cache: Path, inductor_cache: Path
) -> dict[str, Any]:
    env = {
        **os.environ,
        "STRATA_CACHE_ROOT": str(strata_cache),
        "TORCHINDUCTOR_CACHE_DIR": str(inductor_cache),
        "STRATA_PLUGINS": "",
    }
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", str(folder), json.dumps({**setting, "spawned": time.time()})],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"worker failed for {setting}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# Starts are short and the machine is shared: eager and warm starts are the median of this many.
REPEATS = 3


def _median_start(results: list[dict[str, Any]]) -> dict[str, Any]:
    return sorted(results, key=lambda result: result["start_s"])[len(results) // 2]


def _fresh_caches(scratch: str, kernels: Path) -> tuple[Path, Path]:
    """Empty Strata and Inductor caches, except Strata's CPU kernels: those are built once per machine (at
    the first start of any engine), not by compiling, so every run shares one build."""
    strata_cache = Path(scratch, "strata")
    strata_cache.mkdir()
    (strata_cache / "kernels").symlink_to(kernels, target_is_directory=True)
    return strata_cache, Path(scratch, "inductor")


def measure(depths: Sequence[int], modes: Sequence[str], model_dir: Path) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as shared:
        kernels = Path(shared, "kernels")
        kernels.mkdir()
        for depth in depths:
            rows.extend(_measure_depth(build_model(depth, model_dir), depth, modes, shared, kernels))
    return rows


def _measure_depth(
    folder: Path, depth: int, modes: Sequence[str], shared: str, kernels: Path
) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(dir=shared) as scratch:
        # A first start builds the kernels (at the first depth) and brings the weights into the page cache.
        run_worker(folder, {"compile": False}, *_fresh_caches(scratch, kernels))
    with tempfile.TemporaryDirectory(dir=shared) as scratch:
        caches = _fresh_caches(scratch, kernels)
        eager = _median_start([run_worker(folder, {"compile": False}, *caches) for _ in range(REPEATS)])
    for mode in modes:
        for layer_name in (True, False):
            setting = {"compile": True, "mode": mode, "layer_name": layer_name}
            with tempfile.TemporaryDirectory(dir=shared) as scratch:
                caches = _fresh_caches(scratch, kernels)
                cold = run_worker(folder, setting, *caches)
                warm = _median_start([run_worker(folder, setting, *caches) for _ in range(REPEATS)])
            rows.append(
                {
                    "layers": depth,
                    "mode": mode,
                    "layer_name": layer_name,
                    "cold_compile_s": round(cold["start_s"] - eager["start_s"], 2),
                    "dynamo_graphs": cold["dynamo_graphs"],
                    "pieces": cold["pieces"],
                    "distinct_pieces": cold["distinct_pieces"],
                    "inductor_compilations": cold["inductor_compilations"],
                    "warm_start_s": round(warm["start_s"], 2),
                    "warm_dynamo_graphs": warm["dynamo_graphs"],
                    "warm_inductor_compilations": warm["inductor_compilations"],
                    "eager_start_s": round(eager["start_s"], 2),
                    "warm_vs_eager": round(warm["start_s"] / eager["start_s"], 2),
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(row[key]) for key in header) + " |" for row in rows]
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--depths", type=_int_list, default=[2, 8, 32, 64])
    parser.add_argument("--modes", default="model,layer", help="comma-separated: model, layer")
    parser.add_argument(
        "--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "strata-compile-bench"
    )
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--worker", nargs=2, metavar=("FOLDER", "SETTING"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker[0], json.loads(args.worker[1]))))
        return 0
    rows = measure(args.depths, [m for m in args.modes.split(",") if m], args.model_dir)
    report = {
        "torch": torch.__version__,
        "threads": int(os.environ.get("STRATA_NUM_THREADS", "1")),
        "rows": rows,
    }
    print(json.dumps(report, indent=2))
    print(format_table(rows))
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
