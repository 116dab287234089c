"""A/B of Strata's C++ linear kernel (`small_batch_linear.cpp`) between two git revisions, in one process.

Whole processes on a shared machine cannot tell a few percent apart. Here both builds (each from a git
revision or the working tree) are compiled with Strata's flags, their op and C++ namespaces renamed so
both load side by side, and each packs its own copy of the same weights. A pass runs one model's linear
layers once at the given rows (per decoder layer: the q/k/v group, o, the gate-up GLU, down; then the LM
head); passes alternate between the builds, the order flipping pair by pair, so both meet the same
neighbours. Both builds' outputs must agree to float32 rounding first. For each rows count the report gives
each build's median pass, A's median over B's (> 1: B is faster) and the share of pairs B won.

    python benchmarks/kernel_ab.py --base HEAD --rows 1,32,128     # HEAD against the working tree
    python benchmarks/kernel_ab.py --base HEAD --candidate HEAD     # a control: about 1.00
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from throughput import MODEL_SHAPES, REPO_ROOT

from strata.platforms.cpu import kernels

SOURCE = "small_batch_linear.cpp"
# Where the kernel sources are, newest layout first (revisions before the move have the older one).
SOURCE_DIRS = ("src/strata/platforms/cpu/csrc", "src/strata/layers/csrc")
VARIANTS = ("A", "B")

Layers = list[tuple[str, list[torch.Tensor]]]


def export_sources(revision: str | None, into: Path) -> None:
    """The kernel sources (`*.cpp`, `*.h`) of a git revision, or of the working tree when None."""
    into.mkdir(parents=True)
    if revision is None:
        for path in kernels.csrc_dir().iterdir():
            if path.suffix in (".cpp", ".h"):
                (into / path.name).write_text(path.read_text())
        return
    for folder in SOURCE_DIRS:
        archive = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "archive", revision, folder], capture_output=True
        )
        if archive.returncode == 0:
            strip = f"--strip-components={folder.count('/') + 1}"
            subprocess.run(["tar", "-x", "-C", str(into), strip], input=archive.stdout, check=True)
            return
    raise SystemExit(f"kernel_ab: no kernel sources at {revision!r}: {archive.stderr.decode().strip()}")


def build(revisions: dict[str, str | None], workdir: Path, extra_flags: list[str]) -> dict[str, Any]:
    """Each variant's build (its sources renamed to a namespace of its own), compiled in parallel with
    Strata's flags and `extra_flags`, and loaded: its ops, by variant."""
    namespaces = {v: f"strata_ab_{v.lower()}_{uuid.uuid4().hex[:12]}" for v in revisions}
    processes = {}
    for v, revision in revisions.items():
        sources = workdir / namespaces[v]
        export_sources(revision, sources)
        for path in sources.iterdir():
            text = re.sub(r"\bstrata_cpu\b", namespaces[v], path.read_text())
            path.write_text(re.sub(r"\bstrata_kernels\b", f"{namespaces[v]}_kernels", text))
        command = kernels.compile_command(os.environ.get("CXX") or "c++", sources / SOURCE, f"{sources}.so")
        processes[v] = subprocess.Popen([*command, *extra_flags], stderr=subprocess.PIPE, text=True)
    for v, process in processes.items():
        errors = process.communicate()[1]
        if process.returncode != 0:
            raise SystemExit(
                f"kernel_ab: building {v} ({revisions[v] or 'working tree'}) failed:\n{errors[-3000:]}"
            )
        torch.ops.load_library(f"{workdir / namespaces[v]}.so")
    return {v: getattr(torch.ops, namespace) for v, namespace in namespaces.items()}


def layer_weights(shape: dict[str, Any]) -> Layers:
    """A Llama shape's linear weights in a forward's order: per layer ("group", [q, k, v]), ("linear", [o]),
    ("glu", [gate; up]) and ("linear", [down]); then ("linear", [LM head])."""
    generator = torch.Generator().manual_seed(0)
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * hidden // shape["num_attention_heads"]

    def weight(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, generator=generator) / k**0.5

    layers: Layers = []
    for _ in range(shape["num_hidden_layers"]):
        layers.append(("group", [weight(hidden, hidden), weight(kv, hidden), weight(kv, hidden)]))
        layers += [("linear", [weight(hidden, hidden)]), ("glu", [weight(2 * inter, hidden)])]
        layers.append(("linear", [weight(hidden, inter)]))
    return [*layers, ("linear", [weight(shape["vocab_size"], hidden)])]


def run_layer(ops: Any, kind: str, weights: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    if kind == "group":
        return ops.linear_group(x, weights)
    if kind == "glu":
        return ops.linear_glu(x, weights[0], "silu")
    return ops.linear(x, weights[0], None, None)


def measure(builds: dict[str, Any], layers: Layers, rows: int, passes: int, warmup: int) -> dict[str, Any]:
    """Both builds' passes at `rows` rows, alternated after `warmup` untimed passes each."""
    generator = torch.Generator().manual_seed(rows)
    inputs = {k: torch.randn(rows, k, generator=generator) for k in {w[0].shape[1] for _, w in layers}}
    for kind, weights in layers:
        a, b = (run_layer(builds[v], kind, weights, inputs[weights[0].shape[1]]) for v in VARIANTS)
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-4):
            shapes = [tuple(w.shape) for w in weights]
            raise SystemExit(f"kernel_ab: the builds disagree on a {kind} layer of {shapes} at {rows} rows")

    def one_pass(v: str) -> float:
        start = time.perf_counter()
        for kind, weights in layers:
            run_layer(builds[v], kind, weights, inputs[weights[0].shape[1]])
        return time.perf_counter() - start

    for _ in range(warmup):
        for v in VARIANTS:
            one_pass(v)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for i in range(passes):
        for v in VARIANTS[i % 2 :] + VARIANTS[: i % 2]:
            times[v].append(one_pass(v) * 1e3)
    medians = {v: statistics.median(times[v]) for v in VARIANTS}
    return {
        "rows": rows,
        "median_ms": medians,
        "ratio_a_over_b": medians["A"] / medians["B"],
        "b_won": sum(b < a for a, b in zip(times["A"], times["B"], strict=True)) / passes,
        "pass_ms": times,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--base", default="HEAD", help="git revision of build A (default: HEAD)")
    add("--candidate", default=None, help="git revision of build B (default: the working tree)")
    add("--model", default="smollm-135m", choices=sorted(MODEL_SHAPES), help="the layers' shapes")
    add("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    add("--rows", default="32", help="comma-separated rows of x, tokens in a step (default: 32)")
    add("--passes", type=int, default=60, help="timed passes of each build per rows (default: 60)")
    add("--warmup", type=int, default=3, help="untimed passes of each build first (default: 3)")
    add("--extra-flags", default="", help="compiler flags added to Strata's for both builds (-O0: quick)")
    add("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    add("--json-out", type=Path, default=None, help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    if min(rows) < 1 or args.passes < 1 or args.warmup < 0 or (args.layers or 1) < 1:
        parser.error("--rows, --passes and --layers must be at least 1, --warmup at least 0")
    shape = {**MODEL_SHAPES[args.model], **({"num_hidden_layers": args.layers} if args.layers else {})}
    if args.threads:
        torch.set_num_threads(args.threads)
    layers = layer_weights(shape)
    with tempfile.TemporaryDirectory(prefix="strata-kernel-ab-") as workdir:
        builds = build({"A": args.base, "B": args.candidate}, Path(workdir), args.extra_flags.split())
        # Each build's packed weights, interleaved so neither build's all lie in memory allocated later;
        # held here, as the kernels keep only weak references to them.
        packed = [
            builds[v].prepack_glu_weight(w, "silu") if kind == "glu" else builds[v].prepack_linear_weight(w)
            for kind, weights in layers
            for w in weights
            for v in VARIANTS
        ]
        results = [measure(builds, layers, r, args.passes, args.warmup) for r in rows]
        del packed
    report = {
        "model": args.model,
        "layers": shape["num_hidden_layers"],
        "base": args.base,
        "candidate": args.candidate or "working tree",
        "extra_flags": args.extra_flags,
        "threads": torch.get_num_threads(),
        "passes": args.passes,
        "op_namespaces": {v: ops.name for v, ops in builds.items()},
        "results": results,
    }
    text = json.dumps(report, indent=2)
    if args.json_out is not None:
        args.json_out.write_text(text + "\n")
    print(text + "\n\nrows | A ms | B ms | A/B | B won")
    for r in results:
        a, b = r["median_ms"]["A"], r["median_ms"]["B"]
        print(f"{r['rows']} | {a:.3f} | {b:.3f} | {r['ratio_a_over_b']:.3f} | {r['b_won']:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
