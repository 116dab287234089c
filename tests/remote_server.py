"""A real `strata serve` subprocess on 127.0.0.1 for the server tests, with one torch thread, and the checks
the tests share: the error schema, a metric's value, the offline reference text."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai

from strata import LLM, SamplingParams

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RemoteServer:
    """Starts `strata serve ARGS`, waits for /health, and stops it with SIGTERM."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**(env or os.environ), "STRATA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "strata.entrypoints.cli", "serve", "--port", str(self.port), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited early:\n{self.process.stdout.read()}")  # type: ignore[union-attr]
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError("the server did not become healthy")

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)

    def async_client(self, api_key: str = "unused") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120)

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/stats", timeout=10).json()

    def stop(self) -> int:
        """SIGTERM, then the exit code (killing it only if it hangs); what it printed is kept in `output`.
        Stopping a server stopped before only returns its exit code."""
        if self.process.stdout.closed:  # type: ignore[union-attr]
            return self.process.wait()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise
        finally:
            self.output = self.process.stdout.read()  # type: ignore[union-attr]
            self.process.stdout.close()  # type: ignore[union-attr]


def greedy(llm: LLM, prompt: str | list[int], max_tokens: int, **kwargs: object) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)  # type: ignore[arg-type]
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text


def metric(server: RemoteServer, name: str, **labels: str) -> float:
    """The value of one sample in the Prometheus exposition (0 when absent)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert error["message"] and "pydantic" not in error["message"].lower()
    assert not re.search(r"https?://|Traceback|input_value", error["message"])
    return error
