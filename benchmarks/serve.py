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

`--scenario mixed` is what agents and apps send at once, in turn: streamed and whole completions (`n` > 1),
streamed chat, JSON-schema output, forced tool calls (a named function, `required`), `auto` tool choice,
and clients that disconnect mid-stream or before a whole reply. Every reply is checked (a constrained
output parses and validates, a call's arguments match its tool's schema) and afterwards the server must
hold no running request and no KV block; the report counts failures and 5xx by kind. With --launch the
server gets a template that renders tools and the Hermes tool call parser.

    python benchmarks/serve.py --launch --scenario mixed --concurrency 64 --num-requests 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
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
    ttft: float | None  # None: not streamed
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


class HTTPStatusError(RuntimeError):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text[:300]}")
        self.status = status


def chunk_text(choice: dict[str, Any]) -> str:
    """The text of a streamed choice: a completion's `text`, a chat delta's content or call arguments."""
    if "text" in choice:
        return choice["text"]
    delta = choice.get("delta", {})
    calls = delta.get("tool_calls") or []
    return (delta.get("content") or "") + "".join(c.get("function", {}).get("arguments", "") for c in calls)


async def one_request(
    client: httpx.AsyncClient,
    body: dict[str, Any],
    path: str = "/v1/completions",
    stop_after: int | None = None,
) -> RequestResult:
    """A streamed request, timed; with `stop_after`, the client disconnects after that many text chunks."""
    start = time.perf_counter()
    last: float | None = None
    result = RequestResult(ttft=0.0)
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            raise HTTPStatusError(response.status_code, (await response.aread()).decode())
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RuntimeError(f"error event: {chunk['error']}")
            if chunk.get("usage"):
                result.output_tokens = chunk["usage"]["completion_tokens"]
            if not any(chunk_text(choice) for choice in chunk["choices"]):
                continue
            now = time.perf_counter()
            if last is None:
                result.ttft = now - start
            else:
                result.itls.append(now - last)
            last = now
            if stop_after is not None and len(result.itls) + 1 >= stop_after:
                break  # leaving the block closes the connection: the server must abort the request
    result.e2e = time.perf_counter() - start
    return result


def server_client(args: argparse.Namespace, timeout: float = 600) -> httpx.AsyncClient:
    """A client of the server with the API key, one connection per concurrent client."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency)
    return httpx.AsyncClient(base_url=args.url, headers=headers, timeout=timeout, limits=limits)


async def served_model(client: httpx.AsyncClient, args: argparse.Namespace) -> str:
    return args.model or (await client.get("/v1/models")).json()["data"][0]["id"]


async def run_load(args: argparse.Namespace) -> dict[str, Any]:
    async with server_client(args) as client:
        model = await served_model(client, args)
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
    async with server_client(args, timeout=3600) as client:
        model = await served_model(client, args)
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


# -- the mixed load ------------------------------------------------------------------------------------
# A chat template that renders tools (the bundled model has none): Hermes-style, compact for its context.
TOOLS_TEMPLATE = (
    "{% if tools %}system: <tools>{% for tool in tools %} {{ tool.function.name }}{% endfor %}</tools>\n"
    "{% endif %}{% for message in messages %}{{ message.role }}: {{ message.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "find_person", "parameters": PERSON}},
]
TOOL_SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MIXED_KINDS = (
    "stream",
    "completion_n",
    "chat_stream",
    "json_schema",
    "tool_named",
    "tool_required",
    "tool_auto",
    "disconnect_stream",
    "disconnect_whole",
)


def check_json(text: str, schema: dict[str, Any]) -> None:
    import jsonschema

    jsonschema.validate(json.loads(text), schema)


def check_calls(message: dict[str, Any], names: set[str]) -> None:
    calls = message.get("tool_calls") or []
    if not calls:
        raise ValueError(f"no tool_calls in {message}")
    for call in calls:
        if call["function"]["name"] not in names:
            raise ValueError(f"a call of {call['function']['name']!r}, not one of {sorted(names)}")
        check_json(call["function"]["arguments"], TOOL_SCHEMAS[call["function"]["name"]])


async def mixed_request(
    client: httpx.AsyncClient, kind: str, index: int, model: str, args: argparse.Namespace
) -> RequestResult | None:
    """One request of `kind`, its reply checked (raises on a wrong one): its timing and output tokens, or
    None for a client that disconnected on purpose."""
    prompt = PROMPTS[index % len(PROMPTS)]
    common = {"model": model, "max_tokens": args.max_tokens, "temperature": 0.8, "seed": index}
    chat = {**common, "messages": [{"role": "user", "content": prompt}]}
    streamed = {"stream": True, "stream_options": {"include_usage": True}}
    if kind == "stream":
        return await one_request(client, {**common, "prompt": prompt, "ignore_eos": True, **streamed})
    if kind == "chat_stream":
        return await one_request(client, {**chat, **streamed}, "/v1/chat/completions")
    if kind == "disconnect_stream":
        body = {**common, "prompt": prompt, "max_tokens": 400, "ignore_eos": True, **streamed}
        await one_request(client, body, stop_after=3)
        return None
    if kind == "disconnect_whole":
        body = {**common, "prompt": prompt, "max_tokens": 400, "ignore_eos": True, "n": 4}
        try:
            await client.post("/v1/completions", json=body, timeout=0.3)
        except httpx.TimeoutException:
            return None  # the client gave up, as it meant to: the server must abort the request
        raise ValueError("a 400-token request finished within the client's 0.3 s")
    start = time.perf_counter()
    if kind == "completion_n":
        body = {**common, "prompt": prompt, "n": 3}
        reply = await post_json(client, "/v1/completions", body)
        if len(reply["choices"]) != 3:
            raise ValueError(f"{len(reply['choices'])} choices for n=3")
        return whole_result(reply, start)
    tools = {"tools": TOOLS}
    if kind == "json_schema":
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
        body = {**chat, "response_format": fmt, "max_tokens": 200}
    elif kind == "tool_named":
        body = {**chat, **tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
        body["max_tokens"] = 200
    elif kind == "tool_required":
        body = {**chat, **tools, "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 200}
    else:  # tool_auto: the model may call or answer
        body = {**chat, **tools}
    reply = await post_json(client, "/v1/chat/completions", body)
    choice = reply["choices"][0]
    if kind == "json_schema" and choice["finish_reason"] == "stop":
        check_json(choice["message"]["content"], PERSON)
    elif kind in ("tool_named", "tool_required") and choice["finish_reason"] != "length":
        check_calls(choice["message"], {"get_weather"} if kind == "tool_named" else set(TOOL_SCHEMAS))
    return whole_result(reply, start)


def whole_result(reply: dict[str, Any], start: float) -> RequestResult:
    """A non-streamed reply's latency and output tokens."""
    return RequestResult(
        None, e2e=time.perf_counter() - start, output_tokens=reply["usage"]["completion_tokens"]
    )


async def post_json(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(path, json=body)
    if response.status_code != 200:
        raise HTTPStatusError(response.status_code, response.text)
    return response.json()


async def run_mixed(args: argparse.Namespace) -> dict[str, Any]:
    async with server_client(args) as client:
        model = await served_model(client, args)
        next_index = iter(range(args.num_requests))
        results: list[RequestResult] = []
        outcomes = {kind: {"sent": 0, "failed": 0, "5xx": 0} for kind in MIXED_KINDS}
        errors: list[str] = []

        async def worker() -> None:
            for index in next_index:
                kind = MIXED_KINDS[index % len(MIXED_KINDS)]
                outcomes[kind]["sent"] += 1
                try:
                    result = await mixed_request(client, kind, index, model, args)
                except Exception as exc:  # a wrong reply or a failed request: counted, not fatal
                    outcomes[kind]["failed"] += 1
                    outcomes[kind]["5xx"] += isinstance(exc, HTTPStatusError) and exc.status >= 500
                    errors.append(f"{kind}: {type(exc).__name__}: {exc}")
                    continue
                if result is not None:
                    results.append(result)

        before = await server_counts(client)
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        duration = time.perf_counter() - start
        leftover = await settled_stats(client)
        counted = {key: value - before[key] for key, value in (await server_counts(client)).items()}
    result = report(model, args, results, duration)
    result["num_requests"] = args.num_requests
    result["requests_per_s"] = round(args.num_requests / duration, 3)
    return {
        **result,
        "scenario": "mixed",
        "requests_completed": len(results),
        "failures": sum(o["failed"] for o in outcomes.values()),
        "server_errors_5xx": sum(o["5xx"] for o in outcomes.values()),
        "by_kind": outcomes,
        "first_errors": errors[:10],
        "after": leftover,
        # What the server itself counted meanwhile: 5xx answers (a disconnect must not be one) and aborts.
        "server_counted": counted,
    }


async def server_counts(client: httpx.AsyncClient) -> dict[str, float]:
    """From /metrics: HTTP answers with a 5xx status, and generation requests that ended aborted."""
    counts = {"http_5xx": 0.0, "requests_aborted": 0.0}
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith("strata:http_requests_total{") and 'status="5' in line:
            counts["http_5xx"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("strata:request_success_total{") and 'finished_reason="abort"' in line:
            counts["requests_aborted"] += float(line.rsplit(" ", 1)[1])
    return counts


async def settled_stats(client: httpx.AsyncClient, timeout: float = 30.0) -> dict[str, Any]:
    """The server's running and waiting requests and KV cache use once it has settled (aborts of
    disconnected clients land within a step or two): all must be 0, or something leaked."""
    deadline = time.monotonic() + timeout
    while True:
        stats = (await client.get("/stats")).json()
        after = {key: stats[key] for key in ("num_running", "num_waiting", "kv_cache_usage")}
        if not any(after.values()) or time.monotonic() > deadline:
            return after
        await asyncio.sleep(0.2)


def mixed_table(result: dict[str, Any]) -> str:
    kinds = ", ".join(f"{kind} {o['sent']}" for kind, o in result["by_kind"].items())
    after, counted = result["after"], result["server_counted"]
    extra = [
        f"kinds: {kinds}",
        f"failures {result['failures']}, 5xx seen {result['server_errors_5xx']}, 5xx counted by the server "
        f"{counted['http_5xx']:.0f}, requests aborted {counted['requests_aborted']:.0f}",
        f"afterwards: running {after['num_running']}, waiting {after['num_waiting']}, KV cache used "
        f"{after['kv_cache_usage']:.3f}",
    ]
    return "\n".join([table(result), *extra])


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
        "ttft_ms": summary([r.ttft for r in results if r.ttft is not None]),
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


def launch_server(port: int, *serve_args: str) -> subprocess.Popen[str]:
    """`strata serve` on 127.0.0.1:`port` with the bundled model (OMP_NUM_THREADS 1 unless set), its output
    on stderr; returns once /health answers."""
    process = subprocess.Popen(
        [sys.executable, "-m", "strata.entrypoints.cli", "serve", "--port", str(port), *serve_args],
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
    parser.add_argument(
        "--data-parallel-size", type=int, default=1, help="with --launch: the server's engine replicas"
    )
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
        choices=("load", "fairness", "mixed"),
        default="load",
        help="steady load, a small request's TTFT beside a huge one, or the mixed load of agents",
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
    scenarios = {
        "load": (run_load, table),
        "fairness": (run_fairness, fairness_table),
        "mixed": (run_mixed, mixed_table),
    }
    run, render = scenarios[args.scenario]
    with tempfile.TemporaryDirectory() as folder:
        serve_args: list[str] = []
        if args.scenario == "mixed":
            template = Path(folder) / "tools.jinja"
            template.write_text(TOOLS_TEMPLATE)
            serve_args = ["--chat-template", str(template), "--tool-call-parser", "hermes"]
        serve_args += ["--data-parallel-size", str(args.data_parallel_size)]
        server = launch_server(httpx.URL(args.url).port or 8000, *serve_args) if args.launch else None
        try:
            result = asyncio.run(run(args))
        finally:
            if server is not None:
                server.send_signal(signal.SIGTERM)
                server.wait(timeout=60)
    text = json.dumps(result, indent=2)
    if args.json_out is not None:
        args.json_out.write_text(text + "\n")
    print(f"{text}\n\n{render(result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
