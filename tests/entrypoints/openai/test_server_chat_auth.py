"""A server with `--api-key`, `--chat-template` and `--served-model-name`: chat and authentication."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from strata import LLM, SamplingParams

from remote_server import CHAT_TEMPLATE, RemoteServer

KEY = "sk-strata-test"
NAME = "stories"
MESSAGES = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "Lily and the dog"}]


@pytest.fixture(scope="module")
def server(chat_template_file: Path) -> Iterator[RemoteServer]:
    remote = RemoteServer(
        "--api-key", KEY, "--chat-template", str(chat_template_file), "--served-model-name", NAME
    )
    yield remote
    assert remote.stop() == 0


def reference(llm: LLM, max_tokens: int, logprobs: int | None = None) -> tuple[str, list[int], list]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=logprobs)
    out = llm.chat(MESSAGES, params, use_tqdm=False, chat_template=CHAT_TEMPLATE)[0]
    return out.outputs[0].text, out.prompt_token_ids, out.outputs[0].logprobs or []


def test_chat_greedy_matches_llm_chat(server: RemoteServer, llm: LLM) -> None:
    text, prompt_ids, ref_logprobs = reference(llm, 30, logprobs=3)
    result = server.client(KEY).chat.completions.create(
        model=NAME, messages=MESSAGES, temperature=0, max_completion_tokens=30, logprobs=True, top_logprobs=3
    )
    choice = result.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == text
    assert choice.finish_reason in ("length", "stop")
    assert result.object == "chat.completion" and result.id.startswith("chatcmpl-") and result.model == NAME
    assert result.usage.prompt_tokens == len(prompt_ids)
    assert result.usage.completion_tokens == len(ref_logprobs)
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
    content = choice.logprobs.content
    assert len(content) == len(ref_logprobs)
    for item in content:
        assert len(item.top_logprobs) == 3
        assert [t.logprob for t in item.top_logprobs] == sorted(
            (t.logprob for t in item.top_logprobs), reverse=True
        )
        assert item.logprob <= 0 and bytes(item.bytes).decode() == item.token
    # the tokens are the text's pieces, leading spaces kept ('▁there' is ' there')
    assert "".join(item.token for item in content) == choice.message.content


def test_chat_stream_sends_the_role_first_and_the_same_text(server: RemoteServer, llm: LLM) -> None:
    text, prompt_ids, _ = reference(llm, 30)
    stream = server.client(KEY).chat.completions.create(
        model=NAME,
        messages=MESSAGES,
        temperature=0,
        max_tokens=30,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    pieces = [c.choices[0].delta.content or "" for c in chunks[1:] if c.choices]
    assert "".join(pieces) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids) and chunks[-1].choices == []


def test_chat_n_and_tokenize_messages(server: RemoteServer, llm: LLM) -> None:
    text, prompt_ids, _ = reference(llm, 10)
    result = server.client(KEY).chat.completions.create(
        model=NAME, messages=MESSAGES, temperature=0, max_tokens=10, n=3
    )
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert all(c.message.content == text for c in result.choices)
    tokens = httpx.post(
        f"{server.url}/tokenize", json={"messages": MESSAGES}, headers={"Authorization": f"Bearer {KEY}"}
    ).json()
    assert tokens["tokens"] == prompt_ids


def test_chat_errors(server: RemoteServer) -> None:
    client = server.client(KEY)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=NAME, messages=MESSAGES, top_logprobs=2)
    assert bad.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=NAME, messages=MESSAGES, max_completion_tokens=10**6)
    assert bad.value.body["param"] == "max_completion_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="stories260K", messages=MESSAGES)


def test_api_key_is_required_except_for_health(server: RemoteServer) -> None:
    with pytest.raises(openai.AuthenticationError) as denied:
        server.client("wrong").models.list()
    assert denied.value.status_code == 401 and set(denied.value.body) == {"message", "type", "param", "code"}
    for path in ("/v1/models", "/metrics", "/tokenize", "/version"):
        response = httpx.get(f"{server.url}{path}")
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    response = httpx.post(f"{server.url}/v1/completions", content=b"{broken")
    assert response.status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert [m.id for m in server.client(KEY).models.list().data] == [NAME]
