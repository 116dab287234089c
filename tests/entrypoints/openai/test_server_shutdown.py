"""SIGTERM during a stream: in-flight requests finish (or, after --shutdown-timeout, end with an error
event and `[DONE]`), new connections are refused, and the server exits 0."""

from __future__ import annotations

import json
import signal

import httpx
import pytest

from remote_server import RemoteServer
from stories260k import PROMPT


def test_sigterm_finishes_in_flight_streams_and_exits_0() -> None:
    remote = RemoteServer("--shutdown-timeout", "60")
    try:
        body = {"prompt": PROMPT, "max_tokens": 300, "n": 4, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{remote.url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            remote.process.send_signal(signal.SIGTERM)
            events = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        finished = [
            choice
            for event in events[:-1]
            for choice in json.loads(event)["choices"]
            if choice["finish_reason"] is not None
        ]
        assert sorted(c["index"] for c in finished) == [0, 1, 2, 3]
        assert all(c["finish_reason"] == "length" for c in finished)
        assert remote.process.wait(timeout=60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{remote.url}/health", timeout=5)
        assert "serving stories260K at http://127.0.0.1" in remote.process.stdout.read()  # type: ignore[union-attr]
    finally:
        remote.stop()


def test_sigterm_ends_streams_that_outlive_the_shutdown_timeout_with_an_error_and_done() -> None:
    """Regression: a stream still running at the shutdown timeout was cut mid-stream; now its request is
    aborted in the engine and the client gets an error event and `[DONE]`, and the server exits 0."""
    remote = RemoteServer("--shutdown-timeout", "0.2")
    try:
        body = {"prompt": PROMPT, "max_tokens": 500, "n": 16, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{remote.url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            remote.process.send_signal(signal.SIGTERM)
            events = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "service_unavailable" and "shut down" in error["message"]
        assert remote.process.wait(timeout=60) == 0
    finally:
        remote.stop()
