"""Cold and warm compile time of Strata's piecewise `torch.compile` against model depth.

Random-weight Llama folders with one shape's widths (`throughput.MODEL_SHAPES`, default smollm-135m) at
each of --depths layers are built under --model-dir. Every measurement is a fresh process timed from its
start to its first token (interpreter and imports included, as a user waits for them): "cold" on empty
Strata and Inductor caches, "warm" a second start on the caches the cold one left, "eager" without
compiling. For each depth, compile mode ("model": the whole forward traced; "layer": one decoder layer
traced and reused) and LayerName on/off, a row gives the cold compile time (cold start minus eager start),
Dynamo graphs, pieces, distinct pieces and Inductor compilations of the cold start, and the warm and eager
starts (medians of --repeats) with their ratio. Prints JSON and a table.

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
from throughput import MODEL_SHAPES, REPO_ROOT
from transformers import AutoModelForCausalLM, LlamaConfig


def build_model(shape: str, depth: int, model_dir: Path) -> Path:
    folder = model_dir / f"{shape}-{depth}l"
    if not (folder / "model.safetensors").is_file():
        torch.manual_seed(0)
        config = LlamaConfig(**{**MODEL_SHAPES[shape], "num_hidden_layers": depth})
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def worker(folder: str, setting: dict[str, Any]) -> dict[str, Any]:
    """One engine start in this process: seconds from the process's start to the first token, and the
    compile statistics."""
    from strata import LLM, SamplingParams

    torch.set_num_threads(setting["threads"])
    config = {"mode": setting.get("mode", "model"), "use_layer_name": setting.get("layer_name", True)}
    llm = LLM(folder, skip_tokenizer_init=True, max_model_len=256, max_num_seqs=4, compile=setting["compile"],
              compilation_config=config)  # fmt: skip
    llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=2), use_tqdm=False)
    result: dict[str, Any] = {"start_s": time.time() - setting["spawned"]}
    if (compiled := llm.engine.runner.compiled) is not None:
        stats = compiled.stats
        result |= {"dynamo_graphs": stats.dynamo_graphs, "pieces": stats.pieces}
        result |= {"distinct_pieces": stats.distinct_pieces, "inductor_compilations": stats.compiled}
    return result


def start(folder: Path, setting: dict[str, Any], caches: Path) -> dict[str, Any]:
    """`worker` in a fresh process on the Strata and Inductor caches under `caches`. Strata's CPU kernels
    are shared by every start of the run (`caches/../kernels`): they are built once per machine, not by
    compiling."""
    (caches / "strata").mkdir(parents=True, exist_ok=True)
    if not (caches / "strata" / "kernels").exists():
        (caches / "strata" / "kernels").symlink_to(caches.parent / "kernels", target_is_directory=True)
    env = {**os.environ, "STRATA_CACHE_ROOT": str(caches / "strata"), "STRATA_PLUGINS": "",
           "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor")}  # fmt: skip
    setting = {**setting, "spawned": time.time()}
    command = [sys.executable, __file__, "--worker", str(folder), json.dumps(setting)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"worker failed for {setting}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_depth(folder: Path, depth: int, args: argparse.Namespace, scratch: Path) -> list[dict[str, Any]]:
    def median_start(setting: dict[str, Any], caches: Path) -> dict[str, Any]:
        starts = sorted(
            (start(folder, setting, caches) for _ in range(args.repeats)), key=lambda s: s["start_s"]
        )
        return starts[len(starts) // 2]

    eager = {"compile": False, "threads": args.threads}
    start(folder, eager, scratch / f"{depth}-first")  # builds the kernels; brings the weights into memory
    eager_s = median_start(eager, scratch / f"{depth}-eager")["start_s"]
    rows = []
    for mode in args.modes:
        for layer_name in args.layer_name:
            setting = {**eager, "compile": True, "mode": mode, "layer_name": layer_name}
            caches = scratch / f"{depth}-{mode}-{layer_name}"
            cold = start(folder, setting, caches)
            warm = median_start(setting, caches)
            rows.append({"layers": depth, "mode": mode, "layer_name": layer_name,
                         "cold_compile_s": round(cold.pop("start_s") - eager_s, 2), **cold,
                         "warm_start_s": round(warm["start_s"], 2), "eager_start_s": round(eager_s, 2),
                         "warm_vs_eager": round(warm["start_s"] / eager_s, 2),
                         "warm_inductor_compilations": warm["inductor_compilations"]})  # fmt: skip
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(row[key]) for key in header) + " |" for row in rows])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shape", default="smollm-135m", choices=sorted(MODEL_SHAPES), help="the layers' widths"
    )
    parser.add_argument(
        "--depths", default="2,8,32,64", help="comma-separated layer counts (default: 2,8,32,64)"
    )
    parser.add_argument(
        "--modes", default="model,layer", help="comma-separated: model, layer (default: both)"
    )
    parser.add_argument("--layer-name", default="on,off", help="comma-separated: on, off (default: both)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="warm and eager starts, the median kept (default: 3)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each start (default: 1)")
    parser.add_argument(
        "--model-dir", type=Path, default=REPO_ROOT / "bench_models", help="default: bench_models/"
    )
    parser.add_argument("--json-out", type=Path, default=None, help="also write the JSON report to this file")
    parser.add_argument("--worker", nargs=2, metavar=("FOLDER", "SETTING"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker[0], json.loads(args.worker[1]))))
        return 0
    args.modes, layer_name = args.modes.split(","), args.layer_name.split(",")
    if set(args.modes) - {"model", "layer"} or set(layer_name) - {"on", "off"} or args.repeats < 1:
        parser.error("--modes takes model and/or layer, --layer-name on and/or off, --repeats at least 1")
    args.layer_name = [value == "on" for value in layer_name]
    rows = []
    with tempfile.TemporaryDirectory(prefix="strata-compile-time-") as scratch:
        (Path(scratch) / "kernels").mkdir()
        for depth in [int(d) for d in args.depths.split(",")]:
            folder = build_model(args.shape, depth, args.model_dir)
            rows += measure_depth(folder, depth, args, Path(scratch))
    report = {"shape": args.shape, "torch": torch.__version__, "threads": args.threads, "rows": rows}
    text = json.dumps(report, indent=2)
    if args.json_out is not None:
        args.json_out.write_text(text + "\n")
    print(f"{text}\n\n{format_table(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
