"""Serving load generator: N concurrent streaming clients against a running `strata serve` (or any
OpenAI-compatible server), reporting requests/s, output tokens/s, and TTFT / ITL / end-to-end latency
percentiles as JSON and a table.

Each client sends its next `/v1/completions` request as soon as its previous one ends, so the server sees
a steady `--concurrency` requests in flight. TTFT is the time to the first streamed text, ITL the gaps
between later text chunks, and output tokens come from the stream's final usage chunk.

    strata serve &                                     # the bundled model on 127.0.0.1:8000
    python benchmarks/serve.py --concurrency 8 --num-requests 64 --max-tokens 64
    python benchmarks/serve.py --launch --concurrency 16   # start (and stop) a server itself

`--scenario fairness` measures instead what a small request waits beside a huge one: the TTFT of
`--small-requests` small streaming requests sent one after another, first alone, then while one request
of `--huge-prompts` prompts x `--huge-n` sequences x `--huge-max-tokens` tokens runs.

    python benchmarks/serve.py --launch --scenario fairness --huge-prompts 8 --huge-n 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

PROMPTS = [
    "Once upon a time",
    "Lily had a dog",
    "The sun was shining and",
    "Tom and his mom went to the park",
    "One day, a little bird",
    "There was a big red ball",
]


@dataclass
class RequestResult:
    ttft: float
    itls: list[float] = field(default_factory=list)
    e2e: float = 0.0
    output_tokens: int = 0


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


async def one_request(client: httpx.AsyncClient, body: dict[str, Any]) -> RequestResult:
    start = time.perf_counter()
    last: float | None = None
    result = RequestResult(ttft=0.0)
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("usage"):
                result.output_tokens = chunk["usage"]["completion_tokens"]
            if not any(choice["text"] for choice in chunk["choices"]):
                continue
            now = time.perf_counter()
            if last is None:
                result.ttft = now - start
            else:
                result.itls.append(now - last)
            last = now
    result.e2e = time.perf_counter() - start
    return result


async def run_load(args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=600, limits=limits) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        next_index = iter(range(args.num_requests))
        results: list[RequestResult] = []

        async def worker() -> None:
            for index in next_index:
                body = {
                    "model": model,
                    "prompt": PROMPTS[index % len(PROMPTS)],
                    "max_tokens": args.max_tokens,
                    "temperature": args.temperature,
                    "ignore_eos": args.ignore_eos,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                results.append(await one_request(client, body))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        duration = time.perf_counter() - start
    return report(model, args, results, duration)


async def run_fairness(args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=3600) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        small = {
            "model": model,
            "prompt": PROMPTS[0],
            "max_tokens": args.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        huge = {
            "model": model,
            "prompt": [PROMPTS[i % len(PROMPTS)] for i in range(args.huge_prompts)],
            "n": args.huge_n,
            "max_tokens": args.huge_max_tokens,
            "temperature": 1.0,
            "ignore_eos": True,
        }
        alone = [await one_request(client, small) for _ in range(args.small_requests)]
        start = time.perf_counter()
        huge_task = asyncio.create_task(client.post("/v1/completions", json=huge))
        await asyncio.sleep(args.huge_head_start)  # the huge request's sequences fill the batch first
        beside = []
        for _ in range(args.small_requests):
            if huge_task.done():
                break
            beside.append(await one_request(client, small))
        response = await huge_task
        huge_seconds = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"the huge request failed: HTTP {response.status_code}: {response.text[:300]}")

    def ttft(results: list[RequestResult]) -> dict[str, float]:
        values = [r.ttft for r in results]
        return {
            "p50": round(percentile(values, 50) * 1000, 1),
            "max": round(max(values, default=0) * 1000, 1),
        }

    return {
        "scenario": "fairness",
        "model": model,
        "url": args.url,
        "huge_request": f"{args.huge_prompts} prompts x n={args.huge_n} x {args.huge_max_tokens} tokens",
        "huge_request_s": round(huge_seconds, 2),
        "small_max_tokens": args.max_tokens,
        "small_ttft_alone_ms": ttft(alone),
        "small_ttft_beside_huge_ms": ttft(beside),
        "small_requests_beside_huge": len(beside),
    }


def fairness_table(result: dict[str, Any]) -> str:
    title = (
        f"{result['model']}: a small request beside {result['huge_request']} ({result['huge_request_s']} s)"
    )
    rows = [
        ("small request TTFT alone, ms p50 / max", result["small_ttft_alone_ms"]),
        ("small request TTFT beside it, ms p50 / max", result["small_ttft_beside_huge_ms"]),
    ]
    width = max(len(label) for label, _ in rows)
    lines = [title, "-" * len(title)]
    lines += [f"{label:<{width}}  {stats['p50']:.1f} / {stats['max']:.1f}" for label, stats in rows]
    return "\n".join(lines)


def report(
    model: str, args: argparse.Namespace, results: list[RequestResult], duration: float
) -> dict[str, Any]:
    def summary(values: list[float]) -> dict[str, float]:
        stats = {f"p{q}": round(percentile(values, q) * 1000, 3) for q in (50, 90, 99)}
        return {"mean": round(sum(values) / len(values) * 1000, 3) if values else 0.0, **stats}

    output_tokens = sum(r.output_tokens for r in results)
    return {
        "model": model,
        "url": args.url,
        "concurrency": args.concurrency,
        "num_requests": len(results),
        "max_tokens": args.max_tokens,
        "duration_s": round(duration, 3),
        "requests_per_s": round(len(results) / duration, 3),
        "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / duration, 2),
        "ttft_ms": summary([r.ttft for r in results]),
        "itl_ms": summary([itl for r in results for itl in r.itls]),
        "e2e_ms": summary([r.e2e for r in results]),
    }


def table(result: dict[str, Any]) -> str:
    rows = [
        ("requests/s", f"{result['requests_per_s']:.2f}"),
        ("output tokens/s", f"{result['output_tokens_per_s']:.1f}"),
    ]
    for key, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        stats = result[key]
        rows.append((f"{label} ms mean / p50 / p90 / p99", " / ".join(f"{stats[k]:.1f}" for k in stats)))
    title = f"{result['model']}: {result['num_requests']} requests, concurrency {result['concurrency']}"
    width = max(len(label) for label, _ in rows)
    lines = [title, "-" * len(title)]
    lines += [f"{label:<{width}}  {value}" for label, value in rows]
    return "\n".join(lines)


def launch_server(port: int) -> subprocess.Popen[str]:
    """`strata serve` on 127.0.0.1:`port` with the bundled model (OMP_NUM_THREADS 1 unless set), its output
    on stderr; returns once /health answers."""
    process = subprocess.Popen(
        [sys.executable, "-m", "strata.entrypoints.cli", "serve", "--port", str(port)],
        env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
        stdout=sys.stderr,
        text=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("the launched server did not become healthy")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    parser.add_argument("--launch", action="store_true", help="start `strata serve` on the URL's port first")
    parser.add_argument("--model", default=None, help="model name (default: the server's first)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", type=int, default=8, help="clients with one request in flight each")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--no-ignore-eos", dest="ignore_eos", action="store_false", help="let requests stop at EOS"
    )
    parser.add_argument("--json-out", type=Path, default=None, help="also write the JSON report to this file")
    parser.add_argument(
        "--scenario",
        choices=("load", "fairness"),
        default="load",
        help="steady load, or a small request's TTFT beside a huge one",
    )
    parser.add_argument(
        "--small-requests", type=int, default=5, help="fairness: small requests, alone and beside"
    )
    parser.add_argument("--huge-prompts", type=int, default=8, help="fairness: prompts of the huge request")
    parser.add_argument("--huge-n", type=int, default=128, help="fairness: n of the huge request")
    parser.add_argument(
        "--huge-max-tokens", type=int, default=200, help="fairness: max_tokens of the huge request"
    )
    parser.add_argument(
        "--huge-head-start",
        type=float,
        default=1.0,
        help="fairness: seconds the huge request runs before the small ones",
    )
    args = parser.parse_args(argv)
    if args.concurrency < 1 or args.num_requests < 1 or args.max_tokens < 1:
        parser.error("--concurrency, --num-requests and --max-tokens must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    server = launch_server(httpx.URL(args.url).port or 8000) if args.launch else None
    try:
        result = asyncio.run(run_fairness(args) if args.scenario == "fairness" else run_load(args))
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)
    text = json.dumps(result, indent=2)
    if args.json_out is not None:
        args.json_out.write_text(text + "\n")
    print(f"{text}\n\n{fairness_table(result) if args.scenario == 'fairness' else table(result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
