"""`strata serve` options: clear one-line errors for what is not available, and layer implementations."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import openai
import pytest

from strata import LLM, SamplingParams

from example_plugins import install_example
from gguf_models import smollm2_gguf
from remote_server import RemoteServer
from stories260k import PROMPT


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "strata.entrypoints.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_unavailable_options_are_one_line_errors() -> None:
    result = _serve("--chat-template", "no-such-file.jinja")
    assert result.returncode == 2 and "--chat-template" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("compile_flag", [[], ["--compile"]], ids=["eager", "compiled"])
def test_layer_impl_reaches_the_engine(compile_flag: list[str]) -> None:
    remote = RemoteServer("--layer-impl", "hw-agnostic", *compile_flag)
    try:
        result = remote.client().completions.create(
            model="stories260K", prompt=PROMPT, max_tokens=16, temperature=0
        )
        params = SamplingParams(temperature=0, max_tokens=16)
        expected = LLM(layer_impl="hw-agnostic").generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text
        assert result.choices[0].text == expected
    finally:
        assert remote.stop() == 0


def test_serve_on_a_plugin_platform(tmp_path: Path) -> None:
    """`strata serve --device example` with the example platform plugin installed: the openai client gets
    what the CPU platform generates, computed by the plugin's layers and attention backend."""
    env = install_example("strata-example-platform", "strata_example_platform", tmp_path)
    remote = RemoteServer("--device", "example", env=env)
    try:
        result = remote.client().completions.create(
            model="stories260K", prompt=PROMPT, max_tokens=16, temperature=0
        )
        params = SamplingParams(temperature=0, max_tokens=16)
        assert result.choices[0].text == LLM().generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text
    finally:
        assert remote.stop() == 0
    assert "layers (layer_impl=default, platform example)" in remote.output


def test_serve_a_gguf_file_to_the_openai_client(tmp_path: Path) -> None:
    """`strata serve model.gguf`: the real quantized chat model, its chat template and tokenizer from the
    file, answers through the openai client."""
    path = smollm2_gguf(tmp_path)
    remote = RemoteServer(str(path), "--max-model-len", "512", "--kv-cache-memory", str(64 << 20))
    try:
        client = remote.client()
        (model,) = client.models.list().data
        assert model.id == str(path)
        reply = client.chat.completions.create(
            model=model.id,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0,
        )
        assert "Paris" in reply.choices[0].message.content
        assert_logprobs_join_up(client, model.id)
    finally:
        remote.stop()


def assert_logprobs_join_up(client: openai.OpenAI, model: str) -> None:
    """Byte-level BPE ('Ġthere'): logprob tokens are the text pieces, leading spaces kept, so they join up to
    the text, offsets included. A token that only opens a character (an emoji over several tokens) is
    OpenAI's `bytes:\\xf0\\x9f`, adds no text, and the token completing the character carries it; chat
    `bytes` are each token's own, so they join up to the UTF-8 of the text."""
    prompt = "My favourite emoji is 😀 and my favourite city is"
    echoed = client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, logprobs=2, echo=True
    ).choices[0]
    assert echoed.text.startswith(prompt)
    texts = [token if not token.startswith("bytes:") else "" for token in echoed.logprobs.tokens]
    assert "".join(texts) == echoed.text
    assert echoed.logprobs.text_offset == [sum(map(len, texts[:i])) for i in range(len(texts))]
    assert any(token.startswith(" ") for token in texts)
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Write one sentence about Paris, with an emoji."}],
        max_tokens=24,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    ).choices[0]
    content = reply.logprobs.content
    assert (
        "".join(item.token for item in content if not item.token.startswith("bytes:"))
        == reply.message.content
    )
    assert bytes(b for item in content for b in item.bytes) == reply.message.content.encode()
    assert all(item.token and item.bytes for item in content)
