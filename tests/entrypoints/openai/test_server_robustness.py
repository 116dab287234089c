"""What a client can send or do never gets a 5xx, a traceback or a stalled server: lone surrogates,
oversized chunked bodies, prompts of tens of megabytes, requests of too many sequences."""

from __future__ import annotations

import socket
import statistics
import threading
import time

import httpx
import pytest

from remote_server import RemoteServer, assert_error, metric
from stories260k import PROMPT


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b'{"prompt": "a\\ud800b"}', "prompt"),
        ("/v1/completions", b'{"prompt": ["ok", "\\udfff"]}', "prompt"),
        ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud800"]}', "stop"),
        ("/tokenize", b'{"prompt": "a\\ud800b"}', "prompt"),
        ("/tokenize", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages"),
    ],
)
def test_lone_surrogates_are_400(server: RemoteServer, path: str, body: bytes, param: str) -> None:
    """Regression: JSON's \\ud800 escape reached the tokenizer, which failed with a 500."""
    response = httpx.post(f"{server.url}{path}", content=body, headers={"content-type": "application/json"})
    assert "surrogate" in assert_error(response, 400, param)["message"]


def test_a_chunked_body_is_refused_once_it_passes_the_limit(server: RemoteServer) -> None:
    """Regression: without Content-Length, a 50 MB body was read to its end before it was refused."""
    sent = 0

    def send_chunked_body(sock: socket.socket) -> None:
        nonlocal sent
        chunk = b"a" * (1 << 20)
        try:
            sock.sendall(b'c\r\n{"prompt": "\r\n')
            for _ in range(50):
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
            sock.sendall(b'2\r\n"}\r\n0\r\n\r\n')
        except OSError:  # the server closed the connection after refusing the body
            pass

    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        sender = threading.Thread(target=send_chunked_body, args=(sock,))
        sender.start()
        head = sock.recv(65536)  # the answer comes while the client is still sending
        sender.join()
    assert head.startswith(b"HTTP/1.1 413 "), head[:200]
    assert b"connection: close" in head.lower()
    assert sent < 50 << 20
    assert metric(server, "strata:http_requests_total", endpoint="/v1/completions", status="413") >= 1
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_health_answers_while_a_30_mb_prompt_is_refused(server: RemoteServer) -> None:
    """Tokenization runs off the event loop, and a prompt far past the context is refused from the
    tokens of its start: /health stays quick meanwhile (median of many probes), and the prompt is a 400."""
    body = ('{"prompt": "' + "Once upon a time " * (30 * 2**20 // 17) + '", "max_tokens": 4}').encode()
    answers: list[httpx.Response] = []

    def send_huge_prompts() -> None:
        with httpx.Client(timeout=300) as client:
            for _ in range(3):
                answers.append(
                    client.post(
                        f"{server.url}/v1/completions",
                        content=body,
                        headers={"content-type": "application/json"},
                    )
                )

    sender = threading.Thread(target=send_huge_prompts)
    sender.start()
    latencies = []
    with httpx.Client(timeout=30) as client:
        while sender.is_alive():
            start = time.perf_counter()
            assert client.get(f"{server.url}/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.02)
    sender.join()
    assert len(answers) == 3
    for response in answers:
        assert assert_error(response, 400, "prompt")["code"] == "context_length_exceeded"
    assert statistics.median(latencies) < 0.1, latencies


def test_a_request_of_too_many_sequences_is_400_and_the_cap_is_configurable() -> None:
    remote = RemoteServer("--max-sequences-per-request", "6")
    try:
        body = {"prompt": [PROMPT] * 3, "n": 3, "max_tokens": 2}
        error = assert_error(httpx.post(f"{remote.url}/v1/completions", json=body, timeout=30), 400, "prompt")
        assert "9 sequences" in error["message"] and "--max-sequences-per-request" in error["message"]
        assert_error(
            httpx.post(f"{remote.url}/v1/completions", json={"prompt": PROMPT, "n": 7}, timeout=30), 400, "n"
        )
        result = httpx.post(f"{remote.url}/v1/completions", json={**body, "n": 2}, timeout=60).json()
        assert len(result["choices"]) == 6
    finally:
        assert remote.stop() == 0
