"""The tool call parsers on texts: calls and content of whole replies, and streams (the text cut anywhere)
that send the same content and calls a whole reply gets."""

from __future__ import annotations

import json
import random

import pytest

from strata.entrypoints.openai.cli_args import TOOL_CALL_PARSER_NAMES
from strata.entrypoints.openai.protocol import ChatCompletionRequest
from strata.entrypoints.openai.tool_calls import (
    TOOL_CALL_PARSERS,
    HermesToolParser,
    JsonToolParser,
    ToolCalling,
)

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}
TIME = {"name": "get_time", "arguments": {}}


def hermes(call: dict) -> str:
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def calls_of(parsed) -> list[tuple[str, dict]]:
    for call in parsed.calls:
        call.arguments.encode("utf-8")  # valid text, as a response must be
    return [(call.name, json.loads(call.arguments)) for call in parsed.calls]


def test_cli_names_every_parser() -> None:
    assert set(TOOL_CALL_PARSER_NAMES) == set(TOOL_CALL_PARSERS)


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("Let me look. " + hermes(WEATHER), "Let me look.", [WEATHER]),
        (hermes(WEATHER) + "\n" + hermes(TIME), None, [WEATHER, TIME]),
        # Unclosed at the end (the model stopped there): it counts when its JSON is whole.
        ('<tool_call>{"name": "get_time", "arguments": {}}', None, [TIME]),
        ('<tool_call>{"name": "get_time", "argu', '<tool_call>{"name": "get_time", "argu', []),
        # A block that is not a call stays in the content.
        ("a <tool_call>not json</tool_call> b", "a <tool_call>not json</tool_call> b", []),
        (
            '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',
            None,
            [{"name": "f", "arguments": {"x": 1}}],
        ),
        ("The weather is fine.", "The weather is fine.", []),
        # Escapes of lone surrogates stay escaped: the arguments must remain text.
        (
            '<tool_call>{"name": "f", "arguments": {"x": "\\ud800é"}}</tool_call>',
            None,
            [{"name": "f", "arguments": {"x": "\ud800é"}}],
        ),
        ("   ", None, []),
    ],
)
def test_hermes_whole_replies(text: str, content: str | None, calls: list[dict]) -> None:
    parsed = HermesToolParser().parse(text, final=True)
    assert parsed.content == content
    assert calls_of(parsed) == [(c["name"], c["arguments"]) for c in calls]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (json.dumps(WEATHER), None, [WEATHER]),
        (json.dumps([WEATHER, TIME]), None, [WEATHER, TIME]),
        ('{"name": "get_time", "parameters": {}}', None, [TIME]),  # Llama 3's key
        ('{"name": "get_time"} and then', '{"name": "get_time"} and then', []),
        ('{"city": "Paris"}', '{"city": "Paris"}', []),
        ("[]", "[]", []),
        ("[1, 2]", "[1, 2]", []),
        ("Sunny.", "Sunny.", []),
    ],
)
def test_json_whole_replies(text: str, content: str | None, calls: list[dict]) -> None:
    parsed = JsonToolParser().parse(text, final=True)
    assert parsed.content == content
    assert calls_of(parsed) == [(c["name"], c["arguments"]) for c in calls]


def chat_request(**fields: object) -> ChatCompletionRequest:
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "get_time"}},
    ]
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": tools, **fields}
    )


STREAMED_REPLIES = [
    ("hermes", {}, "I'll check both.\n" + hermes(WEATHER) + "\n" + hermes(TIME) + "\n"),
    ("hermes", {}, "No tools needed: the answer is <b>42</b> < 50."),
    ("hermes", {}, "a <tool_call>oops</tool_call> then " + hermes(TIME)),
    ("json", {}, json.dumps([WEATHER, TIME])),
    ("json", {}, '{"name": "get_time"} is not a call'),
    ("json", {"tool_choice": "required"}, json.dumps([WEATHER, TIME])),
    ("json", {"tool_choice": "required"}, json.dumps([WEATHER, TIME])[:-20]),  # cut at max_tokens
    ("json", {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, '{"city": "Oslo"}'),
]


@pytest.mark.parametrize(("parser", "fields", "text"), STREAMED_REPLIES)
def test_a_stream_sends_what_the_whole_reply_holds(parser: str, fields: dict, text: str) -> None:
    """Cut into random pieces, the deltas add up to the whole reply's content and calls, each call sent
    once with one id, and no content is sent that the whole reply does not hold."""
    calling = ToolCalling.for_request(chat_request(**fields), parser)
    assert calling is not None
    whole = calling.parse(text, final=True)
    rng = random.Random(text)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        stream = calling.streamer()
        content, calls = "", {}
        for index, piece in enumerate(pieces):
            delta = stream.feed(piece, final=index == len(pieces) - 1)
            content += delta.get("content", "")
            assert (whole.content or "").startswith(content)
            for call in delta.get("tool_calls", []):
                entry = calls.setdefault(call["index"], {"id": call.get("id"), "name": "", "arguments": ""})
                assert call.get("id", entry["id"]) == entry["id"]
                entry["name"] += call.get("function", {}).get("name", "")
                entry["arguments"] += call.get("function", {}).get("arguments", "")
        assert content == (whole.content or "")
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == calls_of(whole)
        assert [c["id"] for c in calls.values()] == [c.id for c in stream.calls]


def test_forced_and_refused_choices() -> None:
    assert ToolCalling.for_request(chat_request(tool_choice="none"), "hermes") is None
    named = chat_request(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.forced_tool_calls() == {"type": "object", "properties": {}}
    required = chat_request(tool_choice="required", parallel_tool_calls=False).forced_tool_calls()
    assert required is not None and required["maxItems"] == 1
    names = [item["properties"]["name"]["const"] for item in required["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    assert chat_request().forced_tool_calls() is None  # auto: free output
