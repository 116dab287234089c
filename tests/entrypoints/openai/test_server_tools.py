"""Tool calling through a real server and the openai client: tools rendered by a chat template, forced
calls (`required`, a named function) whose arguments always validate, `auto` calls found by the Hermes
parser, streamed `tool_calls` deltas, a tool's result fed back, and 400s for choices that cannot be honoured."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from remote_server import RemoteServer, assert_error

# A Hermes-style template (as Qwen 2.5's): tools listed in a system block (by name and parameter names:
# the bundled model's context is 512 tokens), the assistant's calls as <tool_call> blocks, a tool's result
# as a <tool_response>.
TOOLS_TEMPLATE = """
{%- if tools %}system: <tools>
{%- for tool in tools %} {{ tool.function.name }}({{ tool.function.parameters.properties | join(", ") }})
{%- endfor %}</tools>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}tool: <tool_response>{{ message.content }}</tool_response>
{% elif message.tool_calls %}assistant:
{%- for call in message.tool_calls %}<tool_call>{"name": "{{ call.function.name }}", "arguments": \
{{ call.function.arguments | tojson }}}</tool_call>{% endfor %}
{% else %}{{ message.role }}: {{ message.content }}
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}assistant:{% endif %}
"""

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
TIME_PARAMETERS = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER_PARAMETERS},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMETERS}},
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# A Hermes call the `auto` tests force with a regex, so the parser sees the format a tool model writes.
HERMES_CALL = r'Checking\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,8}", "days": [1-7], "unit": "celsius"\}\}</tool_call>'


@pytest.fixture(scope="module")
def template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tools") / "tools.jinja"
    path.write_text(TOOLS_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def hermes_server(template_file: Path) -> Iterator[RemoteServer]:
    remote = RemoteServer("--chat-template", str(template_file), "--tool-call-parser", "hermes")
    yield remote
    assert remote.stop() == 0


def chat(server: RemoteServer, **fields: object) -> openai.types.chat.ChatCompletion:
    client = server.client()
    body = {"model": client.models.list().data[0].id, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 120}
    return client.chat.completions.create(**{**body, **fields})  # type: ignore[call-overload]


def assert_valid_calls(calls: list, allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_named_function_arguments_validate(hermes_server: RemoteServer, seed: int) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    reply = chat(hermes_server, tool_choice=choice, temperature=1.0, seed=seed, n=2)
    for answer in reply.choices:
        assert answer.finish_reason == "stop"  # as OpenAI ends a forced function
        assert answer.message.content is None
        assert_valid_calls(answer.message.tool_calls, {"get_time"})
        assert len(answer.message.tool_calls) == 1


@pytest.mark.parametrize("seed", [0, 1])
def test_required_calls_listed_tools_with_valid_arguments(hermes_server: RemoteServer, seed: int) -> None:
    reply = chat(hermes_server, tool_choice="required", temperature=1.0, seed=seed, max_tokens=300)
    answer = reply.choices[0]
    # A random model may list calls until max_tokens: the complete ones are kept.
    assert answer.finish_reason in ("tool_calls", "length")
    assert_valid_calls(answer.message.tool_calls, set(SCHEMAS))
    single = chat(hermes_server, tool_choice="required", parallel_tool_calls=False, seed=seed, max_tokens=300)
    assert len(single.choices[0].message.tool_calls) == 1
    assert single.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(single.choices[0].message.tool_calls, set(SCHEMAS))


def stream_calls(server: RemoteServer, **fields: object) -> tuple[str, dict[int, dict], str | None]:
    """(content, calls by index, finish reason) put together from a stream's deltas."""
    content, calls, finish = "", {}, None
    for chunk in chat(server, stream=True, **fields):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
                assert call.id in (None, entry["id"])  # the id comes once, with the name
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


def test_streamed_calls_equal_whole_ones(hermes_server: RemoteServer) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for fields in (
        {"tool_choice": named},
        {"tool_choice": "required"},
        {"tool_choice": "auto", "extra_body": {"guided_regex": HERMES_CALL}},
    ):
        whole = chat(hermes_server, temperature=0, **fields).choices[0]
        content, calls, finish = stream_calls(hermes_server, temperature=0, **fields)
        assert finish == whole.finish_reason
        assert content == (whole.message.content or "")
        got = [(c["name"], json.loads(c["arguments"])) for c in calls.values()]
        assert got == [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
        assert all(c["id"].startswith("call_") for c in calls.values())


def test_auto_finds_hermes_calls_and_keeps_prose(hermes_server: RemoteServer) -> None:
    called = chat(hermes_server, temperature=0.8, seed=4, extra_body={"guided_regex": HERMES_CALL}).choices[0]
    assert called.finish_reason == "tool_calls"
    assert called.message.content == "Checking."
    assert_valid_calls(called.message.tool_calls, {"get_weather"})
    # Free prose (this tiny model writes no calls) is the content: all the text its tokens make.
    prose = chat(hermes_server, temperature=0, max_tokens=30, logprobs=True).choices[0]
    assert not prose.message.tool_calls and prose.finish_reason == "length"
    assert prose.message.content == "".join(t.token for t in prose.logprobs.content).strip()


def test_tool_result_fed_back(hermes_server: RemoteServer) -> None:
    first = chat(hermes_server, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
    ]
    reply = chat(hermes_server, messages=history, temperature=0, max_tokens=20)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The template saw the call's arguments as a mapping and the tool's answer.
    rendered = httpx.post(
        f"{hermes_server.url}/tokenize", json={"messages": history, "add_generation_prompt": True}, timeout=30
    ).json()["tokens"]
    text = httpx.post(f"{hermes_server.url}/detokenize", json={"tokens": rendered}, timeout=30).json()[
        "prompt"
    ]
    arguments = json.dumps(json.loads(call.function.arguments))
    assert f'<tool_call>{{"name": "get_weather", "arguments": {arguments}}}</tool_call>' in text
    assert "<tool_response>Sunny, 21 C</tool_response>" in text


def raw_chat(server: RemoteServer, **fields: object) -> httpx.Response:
    body = {"messages": MESSAGES, "max_tokens": 8, **fields}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "no-such"}}}],
                "tool_choice": "required",
            },
            "tool_choice",
        ),
    ],
)
def test_choices_that_cannot_be_honoured_are_400s(
    hermes_server: RemoteServer, fields: dict, param: str
) -> None:
    assert_error(raw_chat(hermes_server, **fields), 400, param)


def test_auto_needs_a_parser(template_file: Path) -> None:
    remote = RemoteServer("--chat-template", str(template_file))
    try:
        error = assert_error(raw_chat(remote, tools=TOOLS), 400, "tool_choice")
        assert "--tool-call-parser" in error["message"]
        # Forced calls need no parser.
        reply = raw_chat(remote, tools=TOOLS, tool_choice="required", max_tokens=200)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["tool_calls"]
    finally:
        assert remote.stop() == 0
