"""Two builds of one of Strata's CPU kernels, A and B, loaded into one process and their passes alternated.

On a shared machine whole processes cannot tell a few percent apart: the 30 layers' GEMMs of SmolLM-135M
at 32 rows swung 31-40 ms from run to run (Intel Xeon model 207, 2 threads), so an A/B of processes
measures the neighbours. Here both builds of `small_batch_linear.cpp` (sources from a git revision or the
working tree) are compiled with Strata's flags, each with its op namespace and C++ namespace renamed so
that both load side by side, and each packs its own panels of the same weights, layer by layer in turn.
A pass runs one model's linear layers once (per decoder layer its q/k/v group, o, gate-up GLU and down,
then the LM head) at the given rows; passes alternate between the builds, the order within a pair
rotating, so both meet the same neighbours. A control (the same sources twice) read 0.978-1.024 there
(20-100 passes), where whole processes had spread over 1.3x.

    python benchmarks/kernel_ab.py --base HEAD --rows 1,32,128          # HEAD against the working tree
    python benchmarks/kernel_ab.py --base HEAD --candidate HEAD          # control
    python benchmarks/kernel_ab.py --layers 2 --no-head --passes 200    # weights in cache, not memory

`--base aten` (or `--candidate aten`) puts ATen's own linear in place of a build: `torch.nn.functional.linear`
on the unpacked weights (MKL or oneDNN, whichever this torch runs), q, k and v as three calls and the GLU's
activation in eager ops, as transformers computes them; so the report says how Strata's kernels compare with
the GEMM torch itself runs at the same rows and weights, which `torch.mm`'s rate on large squares does not.

    python benchmarks/kernel_ab.py --base aten --rows 8,32,128         # ATen against the working tree

`--kernel attention` does the same for `paged_decode_attention.cpp`. A pass runs every layer's decode
attention once, each layer over a paged cache of its own laid out as the engine allocates it ([2, blocks,
16, KV heads, head dim]; sequence b's j-th block is block b + j * rows, as a batch decoding together fills
them), for `--rows` sequences of `--context` tokens each, the cache in `--kv-dtype`.

    python benchmarks/kernel_ab.py --kernel attention --rows 1,32 --context 96 --kv-dtype float16

Before timing, both builds' outputs are compared on every layer (they must agree to float32 rounding).
The report has per rows and build the median pass, its GFLOP/s and weight GB/s (attention: the GB/s of
keys and values read), and the ratio of A's median to B's (> 1: B is faster) with the share of pairs B won.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import throughput
import torch
from throughput import MODEL_SHAPES, REPO_ROOT

from strata.config import KV_CACHE_DTYPES, CacheConfig
from strata.layers import cpu_kernels

SOURCE_DIR = "src/strata/layers/csrc"
LINEAR_SOURCE = "small_batch_linear.cpp"
KERNEL_SOURCES = {"linear": LINEAR_SOURCE, "attention": "paged_decode_attention.cpp"}
# The engine's cache dtypes by name ("auto", the model's dtype, means nothing without a model).
KV_DTYPES = sorted(name for name in KV_CACHE_DTYPES if name != "auto")
BLOCK_SIZE = CacheConfig.block_size  # the engine's default
VARIANTS = ("A", "B")
ATEN = "aten"  # a --base/--candidate that is ATen's linear, not a build (`AtenLinear`)
SEED = 0


class BuildError(Exception):
    """A variant's sources could not be exported or compiled; the message says which and why."""


def export_sources(revision: str | None, into: Path) -> None:
    """The kernel sources (`*.cpp`, `*.h`) of a git revision, or of the working tree when None, into `into`."""
    into.mkdir(parents=True)
    if revision is None:
        for path in (REPO_ROOT / SOURCE_DIR).iterdir():
            if path.suffix in (".cpp", ".h"):
                (into / path.name).write_text(path.read_text())
        return
    archive = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "archive", revision, SOURCE_DIR], capture_output=True
    )
    if archive.returncode != 0:
        raise BuildError(f"no kernel sources at revision {revision!r}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(into), f"--strip-components={SOURCE_DIR.count('/') + 1}"],
                   input=archive.stdout, check=True)  # fmt: skip


def build_variants(
    revisions: dict[str, str | None], workdir: Path, kernel: str = LINEAR_SOURCE
) -> dict[str, Any]:
    """Each variant's `kernel` source (`revisions[variant]`: a git revision, or None for the working tree) built at
    once (a build takes a minute or more), its op and C++ namespaces made unique to it, and loaded: the op
    namespaces by variant, and an `AtenLinear` for a variant whose revision is `ATEN`."""
    aten = {variant: AtenLinear() for variant, revision in revisions.items() if revision == ATEN}
    revisions = {variant: revision for variant, revision in revisions.items() if variant not in aten}
    namespaces = {variant: f"strata_ab_{variant.lower()}_{uuid.uuid4().hex[:12]}" for variant in revisions}
    for variant, revision in revisions.items():  # every export before any build starts
        sources = workdir / namespaces[variant]
        export_sources(revision, sources)
        for path in sources.iterdir():
            text = re.sub(r"\bstrata_cpu\b", namespaces[variant], path.read_text())
            path.write_text(re.sub(r"\bstrata_kernels\b", f"{namespaces[variant]}_kernels", text))
    compiler = os.environ.get("CXX") or "c++"
    builds = {}
    for variant, namespace in namespaces.items():
        library = workdir / f"{namespace}.so"
        command = cpu_kernels.compile_command(compiler, workdir / namespace / kernel, str(library))
        builds[variant] = (library, subprocess.Popen(command, stderr=subprocess.PIPE, text=True))
    errors = {variant: process.communicate()[1] for variant, (_, process) in builds.items()}
    for variant, (library, process) in builds.items():
        if process.returncode != 0:
            raise BuildError(f"building variant {variant} ({revisions[variant] or 'working tree'}) failed:\n"
                             f"{errors[variant][-3000:]}")  # fmt: skip
        torch.ops.load_library(str(library))
    return {**aten, **{variant: getattr(torch.ops, namespace) for variant, namespace in namespaces.items()}}


class AtenLinear:
    """ATen's linear with the ops of a build that `run_layer` calls, on the weights as they are (nothing is
    packed): what transformers runs for the same layers."""

    name = ATEN

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, scale: None, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return torch.nn.functional.linear(x, weight, bias)

    def linear_group(self, x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([torch.nn.functional.linear(x, w) for w in weights], dim=1)

    def linear_glu(self, x: torch.Tensor, weight: torch.Tensor, activation: str) -> torch.Tensor:
        assert activation == "silu", "the harness's GLU layers are SiLU"
        gate, up = torch.nn.functional.linear(x, weight).chunk(2, dim=1)
        return torch.nn.functional.silu(gate) * up

    def prepack_linear_weight(self, weight: torch.Tensor) -> None:
        return None

    def prepack_glu_weight(self, weight: torch.Tensor, activation: str) -> None:
        return None


def layer_weights(
    shape: dict[str, Any], generator: torch.Generator, head: bool = True
) -> list[tuple[str, list[torch.Tensor]]]:
    """A Llama shape's linear weights in a forward's order: per layer ("group", [q, k, v]), ("linear", [o]),
    ("glu", [gate; up]) and ("linear", [down]), then, with `head`, ("linear", [head])."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim = hidden // shape["num_attention_heads"]
    q_out, kv_out = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim

    def weight(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, generator=generator) / k**0.5

    layers: list[tuple[str, list[torch.Tensor]]] = []
    for _ in range(shape["num_hidden_layers"]):
        layers.append(("group", [weight(q_out, hidden), weight(kv_out, hidden), weight(kv_out, hidden)]))
        layers.append(("linear", [weight(hidden, q_out)]))
        layers.append(("glu", [weight(2 * inter, hidden)]))
        layers.append(("linear", [weight(hidden, inter)]))
    if head:
        layers.append(("linear", [weight(shape["vocab_size"], hidden)]))
    return layers


def prepack(ops: Any, layers: list[tuple[str, list[torch.Tensor]]]) -> list[torch.Tensor]:
    """`ops`' packed copies of every weight (held here: the kernels keep only weak references)."""
    held = []
    for kind, weights in layers:
        for w in weights:
            packed = ops.prepack_glu_weight(w, "silu") if kind == "glu" else ops.prepack_linear_weight(w)
            if packed is not None:
                held.append(packed)
    return held


def run_layer(ops: Any, kind: str, weights: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    if kind == "group":
        return ops.linear_group(x, weights)
    if kind == "glu":
        return ops.linear_glu(x, weights[0], "silu")
    return ops.linear(x, weights[0], None, None)


def model_pass(
    ops: Any, layers: list[tuple[str, list[torch.Tensor]]], inputs: dict[int, torch.Tensor]
) -> None:
    for kind, weights in layers:
        run_layer(ops, kind, weights, inputs[weights[0].shape[1]])


def disagreement(
    builds: dict[str, Any], layers: list[tuple[str, list[torch.Tensor]]], rows: int
) -> str | None:
    """Where the builds' outputs differ beyond float32 rounding on some layer at `rows` rows, or None."""
    generator = torch.Generator().manual_seed(SEED + rows)
    for kind, weights in layers:
        x = torch.randn(rows, weights[0].shape[1], generator=generator)
        a, b = (run_layer(builds[v], kind, weights, x) for v in VARIANTS)
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-4):
            shapes = [tuple(w.shape) for w in weights]
            return (
                f"a {kind} layer of {shapes} at {rows} rows: max difference {(a - b).abs().max().item():.3g}"
            )
    return None


def timed(run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def alternate(runs: dict[str, Callable[[], None]], passes: int, warmup: int) -> dict[str, Any]:
    """Each variant's pass times, the variants alternated and their order rotating pair by pair; with the
    median pass of each, A's median over B's and the share of pairs B won."""
    for _ in range(warmup):
        for v in VARIANTS:
            runs[v]()
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for i in range(passes):
        for v in VARIANTS[i % 2 :] + VARIANTS[: i % 2]:
            times[v].append(timed(runs[v]))
    medians = {v: statistics.median(times[v]) for v in VARIANTS}
    won = sum(b < a for a, b in zip(times["A"], times["B"], strict=True))
    return {
        "median_ms": {v: medians[v] * 1e3 for v in VARIANTS},
        "pass_ms": {v: [t * 1e3 for t in times[v]] for v in VARIANTS},
        "ratio_a_over_b": medians["A"] / medians["B"],
        "b_won": won / passes,
    }


def measure(builds: dict[str, Any], layers: list[tuple[str, list[torch.Tensor]]], rows: int, passes: int,
            warmup: int) -> dict[str, Any]:  # fmt: skip
    """The linear layers' passes at `rows` rows, alternated, with each build's GFLOP/s and weight GB/s."""
    generator = torch.Generator().manual_seed(SEED)
    features = {w.shape[1] for _, weights in layers for w in weights}
    inputs = {k: torch.randn(rows, k, generator=generator) for k in features}
    runs = {v: (lambda ops=builds[v]: model_pass(ops, layers, inputs)) for v in VARIANTS}
    result = alternate(runs, passes, warmup)
    params = sum(w.numel() for _, weights in layers for w in weights)
    seconds = {v: result["median_ms"][v] / 1e3 for v in VARIANTS}
    return {
        "rows": rows,
        **result,
        "gflops": {v: 2 * params * rows / seconds[v] / 1e9 for v in VARIANTS},
        "weight_gbps": {v: 4 * params / seconds[v] / 1e9 for v in VARIANTS},
    }


class AttentionStep(NamedTuple):
    """One decode step's attention inputs for every layer: `rows` sequences of `context` tokens."""

    query: torch.Tensor  # [rows, heads, head_dim]
    caches: list[torch.Tensor]  # per layer [2, blocks, BLOCK_SIZE, kv_heads, head_dim]
    tables: torch.Tensor  # [rows, blocks a sequence], int32
    lens: torch.Tensor  # [rows], int32
    scale: float

    def kv_bytes(self) -> int:
        """Bytes of keys and values one pass reads."""
        _, _, _, kv_heads, head_dim = self.caches[0].shape
        tokens = int(self.lens.sum())
        return 2 * tokens * kv_heads * head_dim * self.caches[0].element_size() * len(self.caches)


def attention_step(shape: dict[str, Any], rows: int, context: int, kv_dtype: torch.dtype) -> AttentionStep:
    """Random queries and caches of a Llama shape's layers, each sequence's blocks `rows` apart."""
    generator = torch.Generator().manual_seed(SEED + rows)
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape["hidden_size"] // heads
    blocks = -(-context // BLOCK_SIZE)
    cache_shape = (2, rows * blocks, BLOCK_SIZE, kv_heads, head_dim)
    caches = [
        torch.randn(cache_shape, generator=generator).to(kv_dtype) for _ in range(shape["num_hidden_layers"])
    ]
    tables = torch.arange(blocks, dtype=torch.int32) * rows + torch.arange(rows, dtype=torch.int32)[:, None]
    query = torch.randn(rows, heads, head_dim, generator=generator)
    lens = torch.full((rows,), context, dtype=torch.int32)
    return AttentionStep(query, caches, tables, lens, head_dim**-0.5)


def attend(ops: Any, step: AttentionStep, layer: int) -> torch.Tensor:
    cache = step.caches[layer]
    return ops.paged_decode_attention(
        step.query, cache[0], cache[1], step.tables, step.lens, step.scale, 0.0, 0
    )


def attention_disagreement(builds: dict[str, Any], step: AttentionStep) -> str | None:
    """The first layer where the builds' attention outputs differ beyond float32 rounding, or None."""
    for layer in range(len(step.caches)):
        a, b = (attend(builds[v], step, layer) for v in VARIANTS)
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
            return f"layer {layer}'s attention: max difference {(a - b).abs().max().item():.3g}"
    return None


def measure_attention(
    builds: dict[str, Any], step: AttentionStep, passes: int, warmup: int
) -> dict[str, Any]:
    """Every layer's decode attention, alternated, with each build's GB/s of keys and values."""

    def run(ops: Any) -> None:
        for layer in range(len(step.caches)):
            attend(ops, step, layer)

    result = alternate({v: (lambda ops=builds[v]: run(ops)) for v in VARIANTS}, passes, warmup)
    return {
        "rows": len(step.lens),
        "context": int(step.lens[0]),
        **result,
        "kv_gbps": {v: step.kv_bytes() / result["median_ms"][v] * 1e3 / 1e9 for v in VARIANTS},
    }


def format_table(results: Sequence[dict[str, Any]]) -> str:
    """One line per rows: the medians, B's rate (GFLOP/s and weight GB/s, or attention's KV GB/s), A/B."""

    def rates(r: dict[str, Any]) -> list[str]:
        if "kv_gbps" in r:
            return [f"{r['kv_gbps']['B']:.1f}"]
        return [f"{r['gflops']['B']:.1f}", f"{r['weight_gbps']['B']:.1f}"]

    rate_header = ["B KV GB/s"] if "kv_gbps" in results[0] else ["B GFLOP/s", "B GB/s"]
    header = ["rows", "A ms", "B ms", *rate_header, "A/B", "B won"]
    lines = [
        [str(r["rows"]), f"{r['median_ms']['A']:.2f}", f"{r['median_ms']['B']:.2f}", *rates(r),
         f"{r['ratio_a_over_b']:.3f}", f"{r['b_won']:.0%}"]
        for r in results
    ]  # fmt: skip
    return "\n".join(throughput._render(header, lines))


class Disagreement(Exception):
    """The builds' outputs differ beyond float32 rounding; the message says where."""


def run_linear(
    builds: dict[str, Any], shape: dict[str, Any], args: argparse.Namespace
) -> list[dict[str, Any]]:
    layers = layer_weights(shape, torch.Generator().manual_seed(SEED), args.head)
    # Interleaved, so that neither build's panels all lie in memory allocated later.
    held = [prepack(builds[v], [layer]) for layer in layers for v in VARIANTS]
    for r in args.rows:
        if where := disagreement(builds, layers, r):
            raise Disagreement(f"the builds disagree on {where}")
    results = [measure(builds, layers, r, args.passes, args.warmup) for r in args.rows]
    del held
    return results


def run_attention(
    builds: dict[str, Any], shape: dict[str, Any], args: argparse.Namespace
) -> list[dict[str, Any]]:
    results = []
    for r in args.rows:
        step = attention_step(shape, r, args.context, getattr(torch, args.kv_dtype))
        if where := attention_disagreement(builds, step):
            raise Disagreement(f"the builds disagree on {r} sequences' {where}")
        results.append(measure_attention(builds, step, args.passes, args.warmup))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--base",
        default="HEAD",
        help=f"git revision of build A (default HEAD), or {ATEN!r}: ATen's own linear",
    )
    parser.add_argument(
        "--candidate", default=None, help=f"git revision of build B (default: the working tree), or {ATEN!r}"
    )
    parser.add_argument(
        "--kernel", default="linear", choices=sorted(KERNEL_SOURCES), help="which kernel (default: linear)"
    )
    parser.add_argument("--model", default="smollm-135m", choices=sorted(MODEL_SHAPES))
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="decoder layers (default: the model's); few enough, the weights stay in cache",
    )
    parser.add_argument(
        "--head", action=argparse.BooleanOptionalAction, default=True, help="include the LM head"
    )
    parser.add_argument(
        "--rows",
        type=throughput._int_list,
        default=[32],
        help="comma-separated rows of x (tokens in a step), or sequences for attention (default: 32)",
    )
    parser.add_argument(
        "--context", type=int, default=96, help="attention: tokens in each sequence's cache (default: 96)"
    )
    parser.add_argument(
        "--kv-dtype", default="float32", choices=KV_DTYPES, help="attention: the cache's dtype"
    )
    parser.add_argument("--passes", type=int, default=60, help="timed passes of each build per rows")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    throughput.require_at_least_one(parser, args, ("passes", "layers", "threads", "context"))
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    if args.kernel != "linear" and ATEN in (args.base, args.candidate):
        parser.error(f"{ATEN!r} stands for ATen's linear, so it goes with --kernel linear only")
    shape = dict(MODEL_SHAPES[args.model])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="strata-kernel-ab-") as workdir:
        try:
            builds = build_variants(
                {"A": args.base, "B": args.candidate}, Path(workdir), KERNEL_SOURCES[args.kernel]
            )
            run = run_attention if args.kernel == "attention" else run_linear
            results = run(builds, shape, args)
        except (BuildError, Disagreement) as exc:
            print(f"kernel_ab: {exc}", file=sys.stderr)
            return 1
    report = {
        "kernel": args.kernel,
        "model": args.model,
        "layers": shape["num_hidden_layers"],
        **(
            {"context": args.context, "kv_dtype": args.kv_dtype}
            if args.kernel == "attention"
            else {"head": args.head}
        ),
        "base": args.base,
        "candidate": args.candidate or "working tree",
        "threads": torch.get_num_threads(),
        "passes": args.passes,
        "op_namespaces": {v: ops.name for v, ops in builds.items()},
        "results": results,
    }
    throughput.print_report(report, format_table(results), args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
