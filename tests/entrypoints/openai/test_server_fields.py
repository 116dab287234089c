"""vLLM's request extensions do what they say: prompt_logprobs, truncate_prompt_tokens, add_special_tokens,
continuous usage, per-request chat templates, continue_final_message, chat echo, token ids as tokens."""

from __future__ import annotations

import json

import httpx
import pytest

from strata import LLM, SamplingParams

from remote_server import CHAT_TEMPLATE, RemoteServer, assert_error, greedy
from stories260k import PROMPT, PROMPT_IDS


def post(server: RemoteServer, path: str, body: dict) -> dict:
    response = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_prompt_logprobs_match_the_offline_engine(server: RemoteServer, llm: LLM) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    choice = post(server, "/v1/completions", body)["choices"][0]
    reference = llm.generate(PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
    got = choice["prompt_logprobs"]
    assert got[0] is None and len(got) == len(PROMPT_IDS)
    for token_id, entry, ref in zip(PROMPT_IDS[1:], got[1:], reference.prompt_logprobs[1:], strict=True):
        assert str(token_id) in entry and 2 <= len(entry) <= 3
        assert entry[str(token_id)]["logprob"] == pytest.approx(ref[token_id].logprob, abs=1e-4)
        assert {e["rank"] for e in entry.values()} >= {1, 2}
    assert entry[str(PROMPT_IDS[-1])]["decoded_token"] == " time"
    chat = post(
        server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "chat_template": CHAT_TEMPLATE,
            "max_tokens": 1,
            "prompt_logprobs": 0,
        },
    )
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


def test_truncate_prompt_tokens_keeps_the_last_tokens(server: RemoteServer, llm: LLM) -> None:
    body = {"prompt": "Lily and Tom went to the park. " + PROMPT, "max_tokens": 12, "temperature": 0}
    result = post(server, "/v1/completions", {**body, "truncate_prompt_tokens": 4})
    assert result["usage"]["prompt_tokens"] == 4
    assert result["choices"][0]["text"] == greedy(llm, PROMPT_IDS[1:], 12)
    # a prompt of token ids is truncated the same way; too long a prompt fits once truncated
    ids = post(server, "/v1/completions", {**body, "prompt": [1] + [403] * 600, "truncate_prompt_tokens": 4})
    assert ids["usage"]["prompt_tokens"] == 4


def test_add_special_tokens_false_leaves_out_bos(server: RemoteServer, llm: LLM) -> None:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "add_special_tokens": False}
    result = post(server, "/v1/completions", body)
    assert result["usage"]["prompt_tokens"] == len(PROMPT_IDS) - 1
    assert result["choices"][0]["text"] == greedy(llm, PROMPT_IDS[1:], 8)
    tokens = post(server, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    assert tokens["tokens"] == PROMPT_IDS[1:]


def test_continuous_usage_stats_puts_usage_in_every_chunk(server: RemoteServer) -> None:
    body = {
        "prompt": PROMPT,
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(event) for event in events[:-1]]
    assert events[-1] == "[DONE]" and all(chunk["usage"] for chunk in chunks)
    used = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert used == sorted(used) and used[-1] == 6 and chunks[0]["usage"]["prompt_tokens"] == 5


def test_per_request_chat_template_and_its_kwargs(server: RemoteServer) -> None:
    template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    messages = [{"role": "user", "content": "Once upon a time"}]
    body = {"messages": messages, "chat_template": template, "chat_template_kwargs": {"greeting": "Lily. "}}
    tokens = post(server, "/tokenize", body)["tokens"]
    assert (
        tokens
        == post(server, "/tokenize", {"prompt": "Lily. Once upon a time", "add_special_tokens": False})[
            "tokens"
        ]
    )
    reply = post(server, "/v1/chat/completions", {**body, "max_tokens": 4})
    assert reply["usage"]["prompt_tokens"] == len(tokens)
    error = assert_error(
        httpx.post(
            f"{server.url}/v1/chat/completions",
            json={**body, "chat_template_kwargs": {"tokenize": True}},
            timeout=30,
        ),
        400,
        "chat_template_kwargs",
    )
    assert "tokenize" in error["message"]


def test_continue_final_message_and_chat_echo(server: RemoteServer, llm: LLM) -> None:
    messages = [{"role": "user", "content": "Tell a story."}, {"role": "assistant", "content": PROMPT}]
    body = {
        "messages": messages,
        "chat_template": CHAT_TEMPLATE,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "max_tokens": 10,
        "temperature": 0,
    }
    plain = post(server, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    rendered = "user: Tell a story.\nassistant: " + PROMPT  # the open message: no newline after it
    assert plain == greedy(llm, llm.get_tokenizer().encode(rendered, add_special_tokens=False), 10)
    echoed = post(server, "/v1/chat/completions", {**body, "echo": True})["choices"][0]["message"]["content"]
    assert echoed == PROMPT + plain
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json={**body, "echo": True, "stream": True}, timeout=60
    ) as response:
        deltas = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert "".join(d["choices"][0]["delta"].get("content", "") for d in deltas) == echoed
    both = {**body, "add_generation_prompt": True}
    assert_error(httpx.post(f"{server.url}/v1/chat/completions", json=both), 400, "continue_final_message")


def test_return_tokens_as_token_ids(server: RemoteServer) -> None:
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 1, "echo": True}
    logprobs = post(server, "/v1/completions", {**body, "return_tokens_as_token_ids": True})["choices"][0][
        "logprobs"
    ]
    ids = post(server, "/tokenize", {"prompt": PROMPT})["tokens"][1:]  # <s> is not in the echoed text
    assert logprobs["tokens"][:4] == [f"token_id:{i}" for i in ids]
    assert all(key.startswith("token_id:") for top in logprobs["top_logprobs"][1:] for key in top)


def test_logit_bias_allowed_token_ids_and_bad_words_reach_the_sampler(server: RemoteServer) -> None:
    body = {
        "prompt": PROMPT,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }

    def tokens(**fields: object) -> list[str]:
        return post(server, "/v1/completions", {**body, **fields})["choices"][0]["logprobs"]["tokens"]

    assert set(tokens(allowed_token_ids=[403, 407])) <= {"token_id:403", "token_id:407"}
    assert tokens(logit_bias={"261": 100}) == ["token_id:261"] * 6
    plain = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 60, "temperature": 0})
    assert "Lily" in plain["choices"][0]["text"]
    banned = post(
        server,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 60, "temperature": 0, "bad_words": ["Lily"]},
    )
    assert "Lily" not in banned["choices"][0]["text"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logit_bias", {"5": 500}),
        ("logit_bias", {"100000": 1}),
        ("allowed_token_ids", [10**6]),
        ("bad_words", [3]),
    ],
)
def test_bad_sampling_controls_are_400(server: RemoteServer, field: str, value: object) -> None:
    assert_error(httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", field: value}), 400, field)
