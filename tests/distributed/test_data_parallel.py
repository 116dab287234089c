"""`strata serve --data-parallel-size 2`: two engine replicas behind one server, through the openai client.

One server serves the module, and its tests run in order: first both replicas serve, then one is killed
mid-generation (its requests fail naming it, the other's complete, new ones still succeed), then the last
(the server fails like a tensor-parallel engine whose rank died: 503s, then exit code 1)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from strata import LLM, SamplingParams

from remote_server import RemoteServer, metric
from stories260k import PROMPT

# Long enough that the requests are still running when a replica is killed: 16 sequences of 450 tokens.
LONG_REQUEST = {"prompt": PROMPT, "max_tokens": 450, "ignore_eos": True, "n": 16}


@pytest.fixture(scope="module")
def story() -> str:
    """The bundled model's greedy 40 tokens, from one process (first: it builds the CPU kernels)."""
    params = SamplingParams(temperature=0, max_tokens=40)
    return LLM().generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text


@pytest.fixture(scope="module")
def server(story: str) -> Iterator[RemoteServer]:
    server = RemoteServer("--data-parallel-size", "2")
    try:
        yield server
    finally:
        server.stop()


def replica_process(server: RemoteServer, index: int) -> psutil.Process:
    """Replica `index`'s process: a child of the server."""
    children = {child.pid: child for child in psutil.Process(server.process.pid).children()}
    return children[server.stats()["replicas"][index]["pid"]]


def post_long_request(server: RemoteServer, replies: list[httpx.Response]) -> threading.Thread:
    """A long whole completion on a thread; its response is appended to `replies`."""

    def post() -> None:
        replies.append(httpx.post(f"{server.url}/v1/completions", json=LONG_REQUEST, timeout=120))

    worker = threading.Thread(target=post)
    worker.start()
    return worker


def in_flight(server: RemoteServer) -> int:
    stats = server.stats()
    return stats["num_running"] + stats["num_waiting"]


def wait_for(condition: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_replicas_share_the_load_and_match_one_process(server: RemoteServer, story: str) -> None:
    client = server.client()
    model = client.models.list().data[0].id
    assert replica_process(server, 0).pid != replica_process(server, 1).pid

    def complete(_: int) -> str:
        reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0)
        return reply.choices[0].text

    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(complete, range(6))) == [story] * 6
    stats = server.stats()
    assert [replica["alive"] for replica in stats["replicas"]] == [True, True]
    passes = [replica["num_forward_passes"] for replica in stats["replicas"]]
    assert all(count > 0 for count in passes) and stats["num_forward_passes"] == sum(passes)
    for index, count in enumerate(passes):
        assert metric(server, "strata:num_forward_passes", replica=str(index)) == count
        assert metric(server, "strata:prefix_cache_queries_total", replica=str(index)) > 0


def stream(server: RemoteServer, started: threading.Event, events: list[dict | str]) -> None:
    """A long streamed completion: every event it sends, `started` set at the first."""
    body = {**LONG_REQUEST, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
                started.set()


def test_a_killed_replica_fails_only_its_own_requests(server: RemoteServer) -> None:
    replica = replica_process(server, 0)
    streams: list[list[dict | str]] = [[], []]
    replies: list[httpx.Response] = []
    workers = []
    # Each stream starts before the next, so they run on different replicas; the two whole completions
    # then go one to each (the least loaded replica takes a request).
    for events in streams:
        started = threading.Event()
        workers.append(threading.Thread(target=stream, args=(server, started, events)))
        workers[-1].start()
        assert started.wait(60)
    for expected in (3, 4):
        workers.append(post_long_request(server, replies))
        wait_for(lambda expected=expected: in_flight(server) == 16 * expected)
    replica.kill()
    for worker in workers:
        worker.join(timeout=120)

    died = "data-parallel replica 0 died (exit code -9)"
    # One stream and one whole completion ran on replica 0: they end at once with an error naming it.
    failed_streams = [events for events in streams if "error" in events[-2]]
    assert len(failed_streams) == 1 and failed_streams[0][-1] == "[DONE]"
    assert died in failed_streams[0][-2]["error"]["message"]
    assert sorted(reply.status_code for reply in replies) == [200, 503]
    failed_reply = next(reply for reply in replies if reply.status_code == 503)
    assert died in failed_reply.json()["error"]["message"]
    # Replica 1's requests completed.
    [finished_stream] = [events for events in streams if events is not failed_streams[0]]
    assert finished_stream[-1] == "[DONE]" and "error" not in finished_stream[-2]
    finished = next(reply for reply in replies if reply.status_code == 200).json()
    assert [choice["finish_reason"] for choice in finished["choices"]] == ["length"] * 16

    # The server keeps serving on replica 1.
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    client = server.client()
    model = client.models.list().data[0].id
    for _ in range(3):
        reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=5)
        assert reply.choices[0].finish_reason == "length"
    stats = server.stats()
    assert [replica["alive"] for replica in stats["replicas"]] == [False, True]
    assert stats["replicas"][0]["num_running"] == 0


def test_killing_every_replica_fails_the_server(server: RemoteServer) -> None:
    last = replica_process(server, 1)
    replies: list[httpx.Response] = []
    worker = post_long_request(server, replies)
    wait_for(lambda: in_flight(server) == 16)
    last.kill()
    worker.join(timeout=120)
    assert replies[0].status_code == 503
    assert "data-parallel replica 1 died" in replies[0].json()["error"]["message"]
    # The server stops at once: /health says 503 until it has closed its socket.
    with contextlib.suppress(httpx.TransportError):
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 503
    assert server.process.wait(timeout=60) == 1  # non-zero, for a supervisor to restart it
    server.stop()
    assert "every data-parallel replica died: data-parallel replica 0 died" in server.output


@pytest.mark.parametrize("kind", ["tensor", "pipeline"])
def test_model_parallel_replicas(story: str, kind: str) -> None:
    """Each replica may be tensor- or pipeline-parallel: it spawns its own rank."""
    server = RemoteServer("--data-parallel-size", "2", f"--{kind}-parallel-size", "2")
    try:
        for index in (0, 1):
            [rank] = replica_process(server, index).children()
            assert "spawn_main" in " ".join(rank.cmdline())
        client = server.client()
        model = client.models.list().data[0].id
        for _ in range(2):  # one on each replica
            reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0)
            assert reply.choices[0].text == story
        assert [replica["num_forward_passes"] > 0 for replica in server.stats()["replicas"]] == [True, True]
    finally:
        assert server.stop() == 0


def test_a_replica_that_cannot_start_is_a_clear_error() -> None:
    args = ["serve", "--data-parallel-size", "2", "--kv-cache-memory", "1", "--port", "0"]
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "strata.entrypoints.cli", *args], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert "strata: error: data-parallel replica" in result.stderr
    assert "failed to start (exit code 1): ConfigError: kv_cache_memory=1 bytes" in result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - start < 60
