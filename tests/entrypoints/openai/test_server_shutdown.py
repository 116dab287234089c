"""SIGTERM during a stream: in-flight requests finish (or are aborted after --shutdown-timeout), new
connections are refused, and the server exits 0."""

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


def test_sigterm_aborts_requests_that_outlive_the_shutdown_timeout() -> None:
    remote = RemoteServer("--shutdown-timeout", "0.2")
    try:
        body = {"prompt": PROMPT, "max_tokens": 500, "n": 16, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{remote.url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            remote.process.send_signal(signal.SIGTERM)
            with pytest.raises(httpx.RemoteProtocolError):  # cut off mid-stream
                for _ in lines:
                    pass
        assert remote.process.wait(timeout=60) == 0
    finally:
        remote.stop()
