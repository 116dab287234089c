"""Where Inductor's code stands against the CPU platform's hand kernels, op by op: the smallest measurements
behind the bounds in docs/compilation.md ("What Inductor reaches on the CPU").

`linear`: one model's linear layers (SmolLM-135M's shapes by default, each layer a weight of its own so the
weights do not fit in the caches) at 1, 32 and 512 rows, as
- `aten`: eager `F.linear` (PyTorch's BLAS, MKL in the x86 wheels),
- `inductor`: `F.linear` compiled as Strata compiles a piece (weights are inputs, the row count dynamic),
- `inductor-frozen`: compiled with freezing and max-autotune, the weights constants of the graph (Inductor's
  C++ GEMM template may serve them; one compile per weight set, which Strata's pieces cannot afford),
- `onednn`: `strata_onednn::linear` compiled (the CPU pass `linears_to_onednn`),
- `kernel`: Strata's C++ linear on its packed weights, where the kernels build.

`attention`: paged decode attention at batch 1 and 32 over a 256- and 2,048-token context, as
- `reference`: the reference backend's eager decode (`torch_native._decode_attention`: gathers the blocks),
- `inductor`: `paged_decode_by_blocks` below compiled, the pure-PyTorch formulation that reads the cache in
  place (each block attended on its own, then combined; batch and blocks unbacked),
- `kernel`: `strata_cpu::paged_decode_attention`.

Variants take turns, round by round; the best round counts. Each row gives microseconds per call, the rate
(GB/s of weights or of K/V read; GFLOP/s for linears) and the ratio to `kernel`.

    python benchmarks/inductor_limits.py --json-out /tmp/limits.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from throughput import MODEL_SHAPES, machine_info

from strata.attention.backends.torch_native import _decode_attention
from strata.platforms.cpu import kernels, onednn

Call = Callable[[], Any]


def best_seconds(variants: dict[str, Call], rounds: int, calls: int) -> dict[str, float]:
    """Each variant's best mean seconds a call over `rounds` rounds, the variants taking turns each round."""
    for fn in variants.values():
        fn()  # compile, warm
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / calls)
    return best


def linear_shapes(model: str) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's linears (q, k, v, o, gate-up, down)."""
    s = MODEL_SHAPES[model]
    hidden, inter, heads, kv = s["hidden_size"], s["intermediate_size"], s["num_attention_heads"], s["num_key_value_heads"]
    head_dim = hidden // heads
    return [(hidden, hidden), (kv * head_dim, hidden), (kv * head_dim, hidden), (hidden, hidden),
            (2 * inter, hidden), (hidden, inter)]  # fmt: skip


def linear_rows(model: str, layers: int, rows: Sequence[int], rounds: int) -> list[dict[str, Any]]:
    weights = [torch.randn(n, k) for _ in range(layers) for n, k in linear_shapes(model)]
    nbytes = sum(w.numel() * 4 for w in weights)
    flops_per_row = sum(2 * w.numel() for w in weights)

    def run_all(op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], xs: dict[int, torch.Tensor]) -> Call:
        return lambda: [op(xs[w.shape[1]], w) for w in weights]

    class Frozen(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ws = torch.nn.ParameterList([torch.nn.Parameter(w, requires_grad=False) for w in weights])

        def forward(self, by_width: dict[int, torch.Tensor]) -> list[torch.Tensor]:
            return [F.linear(by_width[w.shape[1]], w) for w in self.ws]

    frozen = torch.compile(Frozen(), options={"freezing": True, "max_autotune": True})
    compiled_linear = torch.compile(F.linear)
    onednn_linear = torch.compile(
        lambda x, w: torch.ops.strata_onednn.linear(x, w, None), options={"cpp_wrapper": True}
    )
    report = []
    for m in rows:
        xs = {k: torch.randn(m, k) for k in {w.shape[1] for w in weights}}
        for x in xs.values():
            torch._dynamo.decorators.mark_unbacked(x, 0)
        variants: dict[str, Call] = {
            "aten": run_all(F.linear, xs),
            "inductor": run_all(compiled_linear, xs),
            "inductor-frozen": lambda xs=xs: frozen(xs),
        }
        if onednn.register():
            variants["onednn"] = run_all(onednn_linear, xs)
        if kernels.load("small_batch_linear"):
            # The op finds each packed weight from its stand-in while the packed tensor lives: `packed` holds them.
            packed = [torch.ops.strata_cpu.prepack_linear_weight(w) for w in weights]
            stand_ins = [torch.ops.strata_cpu.packed_stand_in(w) for w in weights]
            variants["kernel"] = lambda xs=xs, stand_ins=stand_ins, _packed=packed: [
                torch.ops.strata_cpu.linear(xs[s.shape[1]], s, None, None) for s in stand_ins
            ]
        with torch.no_grad():
            seconds = best_seconds(variants, rounds, 3)
        for name, sec in seconds.items():
            report.append({"part": "linear", "variant": name, "rows": m, "us": sec * 1e6,
                           "GB/s": nbytes / sec / 1e9, "GFLOP/s": m * flops_per_row / sec / 1e9,
                           "vs_kernel": seconds["kernel"] / sec if "kernel" in seconds else None})  # fmt: skip
    return report


def paged_decode_by_blocks(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float,
) -> torch.Tensor:  # fmt: skip
    """Decode attention reading each cache block in place: per block its scores' max, exponentials' sum and
    weighted values, then the blocks combined, rescaled to the largest max (blocks first, so the generated
    loops share them across threads)."""
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    blocks = block_tables.t()
    keys, values = k_cache[blocks], v_cache[blocks]  # [M, B, S, Hkv, D]
    q = query.view(1, batch, 1, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = (q * keys[..., None, :]).sum(-1) * scale  # [M, B, S, Hkv, G]
    positions = torch.arange(block_tables.shape[1] * block_size)
    invalid = (positions[None, :] >= seq_lens[:, None]).view(batch, -1, block_size).transpose(0, 1)
    scores = scores.masked_fill(invalid[..., None, None], torch.finfo(torch.float32).min)
    block_max = scores.amax(2)
    exp = torch.exp(scores - block_max[:, :, None])
    weight = torch.exp(block_max - block_max.amax(0))
    total = (weight * exp.sum(2)).sum(0)
    out = (weight[..., None] * (exp[..., None] * values[:, :, :, :, None, :]).sum(2)).sum(0)
    return (out / total[..., None]).reshape(batch, num_heads, head_dim)


def attention_rows(model: str, shapes: Sequence[tuple[int, int]], rounds: int) -> list[dict[str, Any]]:
    s = MODEL_SHAPES[model]
    heads, kv_heads, block_size = s["num_attention_heads"], s["num_key_value_heads"], 16
    head_dim = s["hidden_size"] // heads
    num_blocks = max(batch * -(-context // block_size) for batch, context in shapes) + 16
    k_cache, v_cache = (torch.randn(num_blocks, block_size, kv_heads, head_dim) for _ in range(2))
    compiled = torch.compile(paged_decode_by_blocks, fullgraph=True)
    report = []
    for batch, context in shapes:
        per_seq = -(-context // block_size)
        tables = torch.randperm(num_blocks)[: batch * per_seq].view(batch, per_seq)
        lens = torch.full((batch,), context, dtype=torch.int32)
        q = torch.randn(batch, heads, head_dim)
        for t in (q, lens, tables):
            torch._dynamo.decorators.mark_unbacked(t, 0)
        torch._dynamo.decorators.mark_unbacked(tables, 1)
        args = (q, k_cache, v_cache, tables, lens, head_dim**-0.5)
        variants: dict[str, Call] = {
            "reference": lambda args=args: _decode_attention(*args, 0.0, 0),
            "inductor": lambda args=args: compiled(*args),
        }
        if kernels.load("paged_decode_attention"):
            variants["kernel"] = lambda args=args: torch.ops.strata_cpu.paged_decode_attention(*args, 0.0, 0)
        want = _decode_attention(*args, 0.0, 0)
        assert (compiled(*args) - want).abs().max().item() < 1e-4, "the compiled formulation is wrong"
        seconds = best_seconds(variants, rounds, 10)
        nbytes = 2 * batch * context * kv_heads * head_dim * 4
        for name, sec in seconds.items():
            report.append({"part": "attention", "variant": name, "rows": batch, "context": context,
                           "us": sec * 1e6, "GB/s": nbytes / sec / 1e9,
                           "vs_kernel": seconds["kernel"] / sec if "kernel" in seconds else None})  # fmt: skip
    return report


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm-135m", choices=sorted(MODEL_SHAPES))
    p.add_argument("--parts", default="linear,attention")
    p.add_argument("--layers", type=int, default=8, help="decoder layers of linears (distinct weights)")
    p.add_argument("--rows", default="1,32,512")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    kernels.build_all()
    rows: list[dict[str, Any]] = []
    if "linear" in args.parts:
        rows += linear_rows(args.model, args.layers, [int(r) for r in args.rows.split(",")], args.rounds)
    if "attention" in args.parts:
        rows += attention_rows(args.model, [(1, 256), (1, 2048), (32, 256)], args.rounds)
    for row in rows:
        ratio = "" if row["vs_kernel"] is None else f"{row['vs_kernel']:.2f}x"
        where = f"rows {row['rows']}" + (f", context {row['context']}" if "context" in row else "")
        print(f"{row['part']:9} {row['variant']:15} {where:24} {row['us']:10.1f} us {row['GB/s']:7.1f} GB/s  {ratio}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"machine": machine_info(), "threads": torch.get_num_threads(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
